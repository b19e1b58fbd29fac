"""API-key checks at the gateway's edge: a table of ``Authorization`` header variants on every route,
method and path variant (issue 17, class 1: header parsing must never let a request through without
the key, nor answer a 500).

Rules held here (README "Authentication"): exactly one ``Authorization`` header (two or more, in any
order, are refused); the ``Bearer`` scheme is case-insensitive (RFC 7235); the credentials must equal
the key byte for byte; every path needs the key except health, the OpenAPI description and (unless
``--metrics-auth``) ``/metrics``; refusals are a 401 in the OpenAI error shape.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from .conftest import GatewayHarness

KEY = "s3cret-K"
BODY = {"model": "tiny", "prompt": "Count from 1 to 20: 1, 2, 3,", "max_tokens": 4, "temperature": 0}

# header lists (name, value bytes) that must be refused
REFUSED = {
    "none": [],
    "wrong": [(b"authorization", b"Bearer wrong")],
    "wrong-then-right": [(b"authorization", b"Bearer wrong"), (b"authorization", f"Bearer {KEY}".encode())],
    "right-then-wrong": [(b"authorization", f"Bearer {KEY}".encode()), (b"authorization", b"Bearer wrong")],
    "right-twice": [(b"authorization", f"Bearer {KEY}".encode())] * 2,
    "mixed-case-names": [(b"Authorization", b"Bearer wrong"), (b"authorization", f"Bearer {KEY}".encode())],
    "empty": [(b"authorization", b"")],
    "scheme-only": [(b"authorization", b"Bearer")],
    "scheme-and-space": [(b"authorization", b"Bearer ")],
    "no-scheme": [(b"authorization", KEY.encode())],
    "no-space": [(b"authorization", f"Bearer{KEY}".encode())],
    "basic": [(b"authorization", f"Basic {KEY}".encode())],
    "prefix": [(b"authorization", f"Bearer {KEY[:-1]}".encode())],
    "suffix": [(b"authorization", f"Bearer {KEY}x".encode())],
    "inner-tab": [(b"authorization", f"Bearer \t{KEY}".encode())],
    "key-padded-inside": [(b"authorization", f"Bearer {KEY}\t{KEY}".encode())],
    "nul": [(b"authorization", f"Bearer {KEY}".encode() + b"\x00")],
    "two-tokens": [(b"authorization", f"Bearer {KEY} {KEY}".encode())],
    "non-ascii": [(b"authorization", f"Bearer {KEY}".encode() + b"\xc3\xa9")],
    "latin1-byte": [(b"authorization", b"Bearer \xff" + KEY.encode())],
    "long": [(b"authorization", b"Bearer " + b"k" * 20000)],
    "long-with-key": [(b"authorization", f"Bearer {KEY}".encode() + b" " * 6000 + b"x")],
}
ACCEPTED = {
    "canonical": f"Bearer {KEY}",
    "lower-scheme": f"bearer {KEY}",
    "upper-scheme": f"BEARER {KEY}",
    "mixed-scheme": f"bEaReR {KEY}",
    "two-spaces": f"Bearer  {KEY}",
    "surrounding-ows": f" Bearer {KEY}\t ",  # optional whitespace around a field value is not part of it
}
# every route of the API and variants of its paths; none may answer without the key
PROTECTED = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
             ("GET", "/v1/models/tiny"), ("GET", "/v1/models/other/x"), ("POST", "/v1/completions/"),
             ("POST", "/v1//completions"), ("POST", "/v1/completions?stream=true"), ("GET", "/v1"),
             ("GET", "/V1/models"), ("GET", "/nope"), ("GET", "/"), ("POST", "//v1/completions"),
             ("GET", "/health/ready/"), ("GET", "/health/"), ("GET", "/metrics/")]
METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]
OPEN = ["/health", "/health/live", "/health/ready", "/openapi.json", "/metrics"]


def _send(h: GatewayHarness, method: str, path: str, headers: list) -> httpx.Response:
    async def go():
        body = None if method in ("GET", "HEAD", "OPTIONS", "DELETE") else BODY
        return await h.client.request(method, path, headers=headers, json=body)

    return asyncio.run(go())


@pytest.fixture
def keyed(bytelevel_dir):
    return GatewayHarness(bytelevel_dir, api_key=KEY)


def _assert_refused(r: httpx.Response, what) -> None:
    assert r.status_code == 401, (what, r.status_code, r.text[:300])
    if r.request.method != "HEAD":
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "authentication_error", what
    assert not any(r.text.startswith(p) for p in ('{"id"', "data:")), what  # never a completion


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_authorization_headers_are_401_on_every_route_and_method(keyed, case):
    for method, path in [(m, p) for m in METHODS for p in ("/v1/completions", "/v1/models")] + PROTECTED:
        _assert_refused(_send(keyed, method, path, REFUSED[case]), (case, method, path))
    assert keyed.engine.generated == []  # nothing reached the engine


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_the_bearer_scheme_is_case_insensitive_and_the_key_exact(keyed, case):
    r = _send(keyed, "POST", "/v1/completions", [(b"authorization", ACCEPTED[case].encode())])
    assert r.status_code == 200, (case, r.text)
    assert r.json()["usage"]["completion_tokens"] > 0
    for method in METHODS:  # with the key, no route answers 401 or 500 whatever the method
        r = _send(keyed, method, "/v1/models", [(b"authorization", ACCEPTED[case].encode())])
        assert r.status_code in (200, 405), (case, method, r.status_code)


def test_open_paths_need_no_key_and_metrics_auth_closes_metrics(keyed, bytelevel_dir):
    for path in OPEN:
        assert _send(keyed, "GET", path, []).status_code == 200, path
    closed = GatewayHarness(bytelevel_dir, api_key=KEY, metrics_auth=True)
    for headers in ([], REFUSED["wrong-then-right"]):
        _assert_refused(_send(closed, "GET", "/metrics", headers), "/metrics")
    assert _send(closed, "GET", "/metrics", [(b"authorization", f"bearer {KEY}".encode())]).status_code == 200


def test_no_key_configured_lets_everything_through(bytelevel_dir):
    h = GatewayHarness(bytelevel_dir)
    assert _send(h, "POST", "/v1/completions", REFUSED["wrong-then-right"]).status_code == 200
