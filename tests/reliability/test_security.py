"""Security checks on a running ``dartree serve`` (tiny models, ``--api-key`` and small limits).

- Only loopback listens by default (gateway, both metrics endpoints); ZeroMQ uses ``ipc://`` sockets
  (mode 0600) in a private 0700 directory owned by this user, never TCP.
- ``--api-key``: 401 in the OpenAI shape without or with a wrong key (the openai client sees an
  ``AuthenticationError``), ``/health/*`` open, ``/metrics`` open unless ``--metrics-auth``; the key
  is never printed.
- Limits: concurrent requests (429 + Retry-After), request-id length, body/prompt/max_tokens
  (the latter three in ``test_bad_input.py``).
- Garbage frames sent straight to the verifier's and the drafter's sockets are logged, counted and
  dropped; requests that bypass the gateway are validated by the verifier itself; neither worker
  crashes or restarts, and the server keeps serving. Nothing on a socket is unpickled.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import random
import stat
from pathlib import Path

import httpx
import msgspec
import openai
import psutil
import pytest
import zmq

from services import protocol as p
from services.spec import TreeKnobs
from services.wire import decode, encode

from .conftest import API_KEY, AUTH, MAX_CONCURRENT, metric_total, scrape

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
ROLES = {"gateway": "dartree-gateway", "verifier": "dartree-verifie", "drafter": "dartree-drafter"}


def _procs(server) -> dict[str, psutil.Process]:
    return {role: server.child(comm) for role, comm in ROLES.items()}


# ----------------------------------------------------------------------------------------- exposure
def test_defaults_bind_loopback_only():
    from gateway.config import GatewayConfig
    from services.drafter.worker import DrafterWorkerConfig
    from services.verifier.worker import VerifierWorkerConfig

    assert GatewayConfig().host == "127.0.0.1"
    assert VerifierWorkerConfig().transport.metrics_host == DrafterWorkerConfig().transport.metrics_host \
        == "127.0.0.1"
    assert VerifierWorkerConfig().verifier_endpoint == DrafterWorkerConfig().drafter_endpoint == ""  # = ipc://


def test_running_server_listens_on_loopback_and_ipc_only(rel_server):
    procs = [psutil.Process(rel_server.proc.pid), *_procs(rel_server).values()]
    listening = []
    for proc in procs:
        for c in proc.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                listening.append((proc.name(), c.laddr.ip, c.laddr.port))
    assert listening, "nothing listens?"
    assert all(ipaddress.ip_address(ip).is_loopback for _, ip, _ in listening), listening
    ports = {port for _, _, port in listening}
    assert ports == {int(rel_server.base.rsplit(":", 1)[1]), *rel_server.metrics_ports}, listening  # no ZMQ TCP


def _ipc_paths(server) -> dict[str, Path]:
    """The bound ipc sockets, from the workers' command line free view of /proc (psutil unix connections)."""
    paths = {}
    for role in ("verifier", "drafter"):
        for c in _procs(server)[role].net_connections(kind="unix"):
            if c.laddr and c.laddr.endswith(f"{role}.sock"):
                paths[role] = Path(c.laddr)
    return paths


def test_ipc_sockets_live_in_a_private_directory(rel_server):
    paths = _ipc_paths(rel_server)
    assert set(paths) == {"verifier", "drafter"}, paths
    for path in paths.values():
        st = path.stat()
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
        dst = path.parent.stat()
        assert stat.S_IMODE(dst.st_mode) == 0o700 and dst.st_uid == os.getuid(), oct(dst.st_mode)
    assert paths["verifier"].parent == paths["drafter"].parent


def test_no_module_on_the_wire_path_unpickles():
    files = [*Path(REPO, "gateway").glob("*.py"), *(Path(REPO, "services", f) for f in (
        "wire.py", "protocol.py", "ipc_pool.py", "verifier/worker.py", "verifier/remote_drafter.py",
        "drafter/worker.py"))]
    for f in files:
        src = f.read_text()
        for bad in ("import pickle", "pickle.loads", "recv_pyobj", "recv_serialized", "torch.load("):
            assert bad not in src, (f, bad)


# ------------------------------------------------------------------------------------------ API key
def test_api_key_is_required_on_the_api_and_health_stays_open(rel_server):
    base = rel_server.base
    for key in (None, "wrong", API_KEY + "x"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
            r = httpx.request(method, base + path, headers=headers, json={"prompt": "x"}, timeout=10)
            assert r.status_code == 401, (key, path, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
            assert r.json()["error"]["type"] == "authentication_error" and "x-request-id" in r.headers
    r = httpx.post(base + "/v1/completions", headers={"Authorization": API_KEY}, json={"prompt": "x"})  # no "Bearer"
    assert r.status_code == 401
    for path in ("/health/live", "/health/ready", "/metrics"):  # metrics open: --metrics-auth not given
        assert httpx.get(base + path, timeout=10).status_code == 200, path
    bad = openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert info.value.status_code == 401 and info.value.body["type"] == "authentication_error"
    good = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
    assert good.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_the_key_is_never_printed(rel_server):
    assert API_KEY not in rel_server.log.read_text()


def test_metrics_auth_and_api_key_reach_the_gateway_from_flags_and_env(tmp_path, monkeypatch):
    import argparse

    from services.serve import add_serve_args, config_from_args
    from gateway.config import GatewayConfig

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    cfg = config_from_args(GatewayConfig, parser.parse_args(["--api-key", "k1", "--metrics-auth"]))
    assert cfg.api_key == "k1" and cfg.metrics_auth and cfg.host == "127.0.0.1"
    monkeypatch.setenv("DARTREE_API_KEY", "k2")
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert config_from_args(GatewayConfig, parser.parse_args([])).api_key == "k2"


# ------------------------------------------------------------------------------------------- limits
def test_concurrency_limit_answers_429_with_retry_after(rel_server):
    n = MAX_CONCURRENT + 8

    async def go():
        async with httpx.AsyncClient(base_url=rel_server.base, timeout=60,
                                     limits=httpx.Limits(max_connections=n + 2)) as c:
            return await asyncio.gather(*(c.post("/v1/completions", headers=AUTH, json={
                "prompt": "slow", "max_tokens": 120, "speculative": {"method": "ar"}}) for _ in range(n)))

    rs = asyncio.run(go())
    codes = sorted(r.status_code for r in rs)
    assert set(codes) == {200, 429} and codes.count(200) >= MAX_CONCURRENT // 2, codes
    for r in rs:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"
    g = scrape(rel_server)["gateway"]
    assert metric_total(g, "dartree_gateway_requests_in_flight") == 0
    assert metric_total(g, "dartree_rejected_requests_total", reason="overloaded") >= codes.count(429)


def test_request_id_is_bounded_and_echoed(rel_server):
    rid = "a" * 128
    r = httpx.post(rel_server.base + "/v1/completions", headers={**AUTH, "x-request-id": rid},
                   json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 200 and r.headers["x-request-id"] == rid and r.json()["id"] == f"cmpl-{rid}"
    for bad in ("a" * 129, "has space", "tab\tinside"):
        r = httpx.post(rel_server.base + "/v1/completions", headers={**AUTH, "x-request-id": bad},
                       json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-request-id"


# ----------------------------------------------------------------------------------- worker sockets
def _garbage(rng: random.Random) -> list[list[bytes]]:
    """Malformed messages of every kind the decoder refuses."""
    tag = lambda t: bytes((t,))  # noqa: E731
    g = [
        [], [b""], [b"\x63", b"junk"], [b"\x00\x01", b"x"], [rng.randbytes(rng.randint(1, 64)) for _ in range(3)],
        [tag(p.MessageType.GENERATE), b"\xc1"],                                   # not msgpack
        [tag(p.MessageType.GENERATE), msgspec.msgpack.encode(["", [1], [5], []])],  # schema violation
        [tag(p.MessageType.GENERATE), msgspec.msgpack.encode([["nested"]] * 4)],
        [tag(p.MessageType.PING), b"\x91" + b"\x00" * (70 * 1024)],               # over the PING size limit
        [tag(p.MessageType.ABORT), msgspec.msgpack.encode(["r" * 5000])],         # request id too long
        [tag(p.MessageType.RELEASE), msgspec.msgpack.encode([123])],
        [*encode(p.Ping(1)), b"unexpected side frame"],
        [tag(p.MessageType.DRAFT_BATCH), msgspec.msgpack.encode(
            [[["r", 1, [1, 2], ["float32", [2, 8]], 2, 2, [None] * 5]]]), b"\x00" * 7],          # size mismatch
        [tag(p.MessageType.DRAFT_BATCH), msgspec.msgpack.encode(
            [[["r", 1, [1, 2], ["complex64", [2, 8]], 2, 2, [None]]]]), b"\x00" * 128],          # dtype not allowed
        [tag(p.MessageType.DRAFT_BATCH), msgspec.msgpack.encode(
            [[["r", 1, [1], ["float32", [2**40, 2**40]], 1, 1, [None]]]])],                      # absurd tensor
        [bytes((20,)), msgspec.msgpack.encode(["r", 1, [1], ["float32", [1, 8]], 1, 1, [None]]), b"\x00" * 32],  # v3 DRAFT
        [tag(p.MessageType.HELLO), msgspec.msgpack.encode([p.PROTOCOL_VERSION + 7, {"new": "layout"}])],
        encode(p.Pong(1, "x", True)),                                                                # wrong direction
        encode(p.RoundChunk("r", [1, 2], None)),
    ]
    return g + [[rng.randbytes(rng.randint(0, 300)) for _ in range(rng.randint(1, 4))] for _ in range(200)]


def _exchange(endpoint: str, messages: list[list[bytes]], probe: list[bytes], want) -> list:
    """Send ``messages`` then ``probe`` on one DEALER (in order); the replies up to the first ``want``."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        for m in messages:
            if m:
                s.send_multipart(m)
        replies = []
        s.send_multipart(probe)
        while s.poll(5000):
            try:
                replies.append(decode(s.recv_multipart()).msg)
            except p.ProtocolError:
                continue
            if want(replies[-1]):
                break
        return replies
    finally:
        s.close(0)
        ctx.term()


def test_garbage_on_the_worker_sockets_is_dropped_and_nothing_crashes(rel_server):
    rng = random.Random(7)
    paths = _ipc_paths(rel_server)
    pids = {role: proc.pid for role, proc in _procs(rel_server).items()}
    before = scrape(rel_server)
    garbage = _garbage(rng)

    # the verifier: garbage, then requests that bypass the gateway's validation, then a ping
    v = f"ipc://{paths['verifier']}"
    bypass = [encode(p.Generate("bypass-vocab", [5, 10**6], p.SamplingParams(max_tokens=2), p.SpecParams())),
              encode(p.Generate("bypass-empty", [], p.SamplingParams(max_tokens=2), p.SpecParams())),
              encode(p.Generate("bypass-nan", [5], p.SamplingParams(max_tokens=2, temperature=float("nan")), p.SpecParams())),
              encode(p.Generate("bypass-method", [5], p.SamplingParams(max_tokens=2), p.SpecParams(method="bogus"))),
              encode(p.Generate("bypass-context", [5], p.SamplingParams(max_tokens=10**6), p.SpecParams())),
              encode(p.Abort("never-existed"))]
    replies = _exchange(v, garbage + bypass, encode(p.Ping(42)), lambda m: isinstance(m, p.Pong) and m.nonce == 42)
    assert replies and replies[-1].nonce == 42  # everything before the ping went through the I/O thread
    replies = _exchange(v, [], encode(p.Generate("bypass-vocab2", [5, 10**6], p.SamplingParams(max_tokens=2),
                                                 p.SpecParams())), lambda m: isinstance(m, p.RequestError))
    assert replies and isinstance(replies[-1], p.RequestError) and replies[-1].status == 400
    assert replies[-1].param == "prompt" and "[0, " in replies[-1].message

    # the drafter: garbage, a draft whose context is inconsistent (an error reply, no state), a release
    d = f"ipc://{paths['drafter']}"
    feats = p.TensorMeta("float32", (1, 128))
    bad_job = p.DraftRequest("stranger", 1, [5], feats, 5, 99, "dflash", TreeKnobs())
    bad_draft = encode(p.DraftBatch([bad_job]), [b"\x00" * 512])
    replies = _exchange(d, garbage + [encode(p.Release("nobody"))], bad_draft, lambda m: isinstance(m, p.DraftReply))
    assert replies and replies[-1].error, replies
    pong = _exchange(d, [], encode(p.Ping(43)), lambda m: isinstance(m, p.Pong))
    assert pong and pong[-1].nonce == 43

    after = scrape(rel_server)
    assert {role: proc.pid for role, proc in _procs(rel_server).items()} == pids  # nobody crashed or restarted
    for role in ("verifier", "drafter"):
        grew = metric_total(after[role], "dartree_ipc_errors_total") - metric_total(before[role], "dartree_ipc_errors_total")
        assert grew >= len(garbage) - 10, (role, grew)  # a few random frames may decode as something valid
    assert metric_total(after["drafter"], "dartree_drafter_contexts") == 0
    r = httpx.post(rel_server.base + "/v1/completions", headers=AUTH, json={"prompt": "still fine", "max_tokens": 8},
                   timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert httpx.get(rel_server.base + "/health/ready").status_code == 200


def _raw(base: str, header_lines: list[bytes]) -> tuple[int, bytes]:
    """One raw HTTP/1.1 POST of P20 with exactly these header lines (duplicates, any bytes); (status, body)."""
    import socket

    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": "tiny", "prompt": "Count from 1 to 20: 1, 2, 3,", "max_tokens": 4,
                       "temperature": 0}).encode()
    head = [b"POST /v1/completions HTTP/1.1", b"Host: x", b"Content-Type: application/json",
            b"Content-Length: " + str(len(body)).encode(), b"Connection: close", *header_lines]
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def test_authorization_header_variants_over_real_http(rel_server):
    """Issue 17 class 1 through uvicorn's parser: duplicate headers in both orders are refused, the
    scheme is case-insensitive, odd bytes and huge headers are a 401 in the OpenAI shape (never a 500
    or a completion)."""
    good, bad = f"Bearer {API_KEY}".encode(), b"Bearer wrong"
    for lines in ([b"Authorization: " + bad, b"Authorization: " + good],
                  [b"Authorization: " + good, b"Authorization: " + bad],
                  [b"Authorization: " + good, b"authorization: " + good],
                  [b"Authorization: " + good + b"\xc3\xa9"], [b"Authorization: Bearer \xff\xfe"],
                  [b"Authorization: Bearer " + b"k" * 8000], [b"Authorization: Bearer " + b"k" * 200_000]):
        status, body = _raw(rel_server.base, lines)
        assert status == 401, (lines[0][:60], status, body[:200])
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    for scheme in (b"bearer", b"BEARER", b"Bearer"):
        status, body = _raw(rel_server.base, [b"Authorization: " + scheme + b" " + API_KEY.encode()])
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4, (scheme, status, body[:200])
