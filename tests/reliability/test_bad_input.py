"""Bad input against a running ``dartree serve`` (tiny models): fuzzing, an explicit table, the context end.

- schemathesis generates valid and invalid bodies from the server's own OpenAPI schema: never a 5xx,
  every error in the OpenAI shape, the server still ready afterwards (examples bounded: < 60 s).
- The explicit table repeats the classes of ``tests/service/test_validation.py`` against the real
  three-process stack (there the gateway runs on a scripted engine; here the verifier validates
  too) and adds what that table lacks (lone surrogates, NaN/Infinity literals, deep nesting,
  template kwargs, duplicate keys, BOM, chunked oversize bodies, ...).
- Near the end of the context: prompts at the drafter's and at the target's position limit
  (-1, 0, +1) are served (and equal plain greedy decoding) or refused with a 400; never a 5xx.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from .conftest import AUTH, MAX_BODY_BYTES, MAX_PROMPT_TOKENS, MAX_TOKENS_LIMIT, start_tiny_server

pytestmark = pytest.mark.e2e
ERROR_KEYS = {"message", "type", "param", "code"}
UNSUPPORTED = ("best_of", "suffix", "echo")  # still refused when set; every other documented field is fuzzed
EXAMPLES = 60  # per generation mode, over all operations (~30 s in all on the tiny models)


def check_openai_error(status: int, body: bytes | str, where: str) -> None:
    assert status < 500, f"{where}: {status} {body[:300]!r}"
    if status >= 400:
        err = json.loads(body)["error"]
        assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"], where
        assert "Traceback" not in err["message"], where


# ------------------------------------------------------------------------------------------ fuzzing
@pytest.fixture(scope="module")
def api_schema(rel_server):
    """The running server's own OpenAPI document, loaded by schemathesis (its pytest plugin is not used:
    it does not run under pytest 9; its hypothesis strategies do)."""
    raw = httpx.get(rel_server.base + "/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(raw)
    schema.config.update(base_url=rel_server.base)
    return schema


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_fuzzed_requests_never_get_a_5xx_and_errors_are_openai_shaped(api_schema, rel_server, mode):
    seen: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=api_schema.as_strategy(generation_mode=mode))
    def run(case):
        if isinstance(case.body, dict):
            if type(case.body.get("max_tokens")) is int:
                case.body["max_tokens"] = min(case.body["max_tokens"], 24)  # bounded run time, not validation
            if mode == GenerationMode.POSITIVE and len(seen) % 2 == 0:  # half reach generation: drop the
                for name in UNSUPPORTED:                                 # documented-but-refused fields
                    case.body.pop(name, None)
                case.body["model"] = "tiny"
        response = case.call(headers=AUTH, timeout=60)
        where = f"{case.method} {case.path} {json.dumps(case.body, default=str)[:300]}"
        param = json.loads(response.content)["error"]["param"] if response.status_code >= 400 else ""
        key = f"{case.method} {case.path} {response.status_code} {param or ''}".strip()
        seen[key] = seen.get(key, 0) + 1
        ctype = response.headers.get("content-type") or [""]
        if (ctype[0] if isinstance(ctype, list) else ctype).startswith("text/event-stream"):
            if response.stream_cut_short:  # schemathesis hung up after its event cap: a client disconnect
                return
            assert response.text.endswith("data: [DONE]\n\n"), where
            last = json.loads(response.text.split("\n\n")[-3][6:])
            assert "error" not in last, (where, last)
        elif case.path != "/metrics":
            check_openai_error(response.status_code, response.content, where)

    run()
    assert any(k.startswith("POST /v1/completions") for k in seen), seen
    print(mode, dict(sorted(seen.items())))


def test_server_is_ready_after_fuzzing(rel_server):
    assert httpx.get(rel_server.base + "/health/ready").status_code == 200


# ------------------------------------------------------------------------------------ explicit table
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
CASES = [
    # (id, path, raw body or json, extra headers, status, param)
    ("empty-prompt", C, {"prompt": ""}, None, 400, "prompt"),
    ("empty-token-list", C, {"prompt": []}, None, 400, "prompt"),
    ("empty-nested-list", C, {"prompt": [[]]}, None, 400, "prompt"),
    ("out-of-vocab", C, {"prompt": [5, 10**6]}, None, 400, "prompt[1]"),
    ("id-beyond-int64", C, {"prompt": [2**70]}, None, 400, "prompt[0]"),
    ("max-tokens-negative", C, {"prompt": "x", "max_tokens": -1}, None, 400, "max_tokens"),
    ("max-tokens-huge", C, {"prompt": "x", "max_tokens": 10**12}, None, 400, "max_tokens"),
    ("max-tokens-over-limit", C, {"prompt": "x", "max_tokens": MAX_TOKENS_LIMIT + 1}, None, 400, "max_tokens"),
    ("max-tokens-float", C, {"prompt": "x", "max_tokens": 5.5}, None, 400, "max_tokens"),
    ("beyond-context", C, {"prompt": list(range(3, 103)), "max_tokens": 157}, None, 400, "max_tokens"),
    ("prompt-over-limit", C, {"prompt": list(range(3, 4 + MAX_PROMPT_TOKENS))}, None, 400, "prompt"),
    ("chat-over-context", CHAT, {"messages": MSG * 300, "max_tokens": 2}, None, 400, "messages"),
    ("temperature-negative", C, {"prompt": "x", "temperature": -0.01}, None, 400, "temperature"),
    ("temperature-nan", C, b'{"prompt": "x", "temperature": NaN}', None, 400, "temperature"),
    ("temperature-infinity", C, b'{"prompt": "x", "temperature": Infinity}', None, 400, "temperature"),
    ("temperature-1e400", C, b'{"prompt": "x", "temperature": 1e400}', None, 400, "temperature"),
    ("non-json", C, b"prompt=x", None, 400, None),
    ("truncated-json", C, b'{"prompt": "x"', None, 400, None),
    ("json-bom", C, b'\xef\xbb\xbf{"prompt": "x"}', None, 400, None),
    ("deeply-nested", C, b'{"prompt": "x", "user": ' + b"[" * 20000 + b"]" * 20000 + b"}", None, 400, None),
    ("wrong-content-type", C, {"prompt": "x"}, {"content-type": "text/plain"}, 415, None),
    ("form-content-type", C, b"prompt=x", {"content-type": "application/x-www-form-urlencoded"}, 415, None),
    ("oversize-body", C, {"prompt": "x" * MAX_BODY_BYTES}, None, 413, None),
    ("unknown-method", C, {"prompt": "x", "speculative": {"method": "eagle3"}}, None, 400, "speculative.method"),
    ("budget-zero", C, {"prompt": "x", "speculative": {"budget": 0}}, None, 400, "speculative.budget"),
    ("budget-over-max", C, {"prompt": "x", "speculative": {"budget": 5000}}, None, 400, "speculative.budget"),
    ("width-over-max", C, {"prompt": "x", "max_tokens": 2, "speculative": {"width": 1000}}, None, 400,
     "speculative.width"),
    ("candidates-over-max", C, {"prompt": "x", "max_tokens": 2, "speculative": {"candidates": 5000}}, None, 400,
     "speculative.candidates"),
    ("depth-bonus-positive", C, {"prompt": "x", "max_tokens": 2, "speculative": {"depth_bonus": 1.0}}, None, 400,
     "speculative.depth_bonus"),
    ("width-beyond-int64", C, {"prompt": "x", "speculative": {"width": 10**30}}, None, 400, "speculative.width"),
    ("candidates-beyond-int64", C, {"prompt": "x", "speculative": {"candidates": 2**64}}, None, 400,
     "speculative.candidates"),
    ("top-k-beyond-int64", C, {"prompt": "x", "top_k": 10**30}, None, 400, "top_k"),
    ("speculative-not-object", C, {"prompt": "x", "speculative": "dflash"}, None, 400, "speculative"),
    ("five-stop-strings", C, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, None, 400, "stop"),
    ("invalid-utf8", C, b'{"prompt": "\xc3\x28"}', None, 400, None),
    ("lone-surrogate", C, b'{"prompt": "\\ud800"}', None, 400, None),
    ("lone-surrogate-in-stop", C, b'{"prompt": "x", "stop": ["\\udfff"]}', None, 400, None),
    ("template-kwargs-collide", CHAT, {"messages": MSG, "chat_template_kwargs": {"messages": 5}}, None, 400,
     "chat_template_kwargs"),
    ("template-kwargs-generation-prompt", CHAT,
     {"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}}, None, 400, "chat_template_kwargs"),
    ("request-id-129", C, {"prompt": "x"}, {"x-request-id": "r" * 129}, 400, "x-request-id"),
]
OK = [
    ("special-tokens-only", C, {"prompt": "<|im_end|><|im_start|>", "max_tokens": 3}),
    ("nul-in-prompt", C, {"prompt": "a\u0000b", "max_tokens": 2}),
    ("duplicate-keys-last-wins", C, b'{"prompt": "x", "max_tokens": 0, "max_tokens": 2}'),
    ("tiny-temperature", C, {"prompt": "x", "max_tokens": 4, "temperature": 5e-324}),
    ("top-k-beyond-vocab", C, {"prompt": "x", "max_tokens": 4, "temperature": 0.7, "top_k": 10**6}),
    ("negative-seed", C, {"prompt": "x", "max_tokens": 4, "temperature": 0.7, "seed": -(2**63)}),
    ("every-token-a-stop-id", C, {"prompt": "x", "max_tokens": 4, "stop_token_ids": list(range(300))}),
    ("budget-1-width-1", C, {"prompt": "x", "max_tokens": 4, "speculative": {"method": "dartree-fixed", "budget": 1,
                                                                            "width": 1}}),
    ("prompt-at-limit", C, {"prompt": list(range(3, 3 + MAX_PROMPT_TOKENS)), "max_tokens": 2}),
    ("request-id-128", C, {"prompt": "x", "max_tokens": 1}),
]


def _post(server, path, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base + path, content=data, timeout=60,
                      headers={"content-type": "application/json", **AUTH, **(headers or {})})


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_4xx_in_the_openai_shape(rel_server, case):
    _, path, body, headers, status, param = case
    r = _post(rel_server, path, body, headers)
    check_openai_error(r.status_code, r.content, case[0])
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("case", OK, ids=[c[0] for c in OK])
def test_edge_inputs_are_served(rel_server, case):
    headers = {"x-request-id": "r" * 128} if case[0] == "request-id-128" else None
    r = _post(rel_server, case[1], case[2], headers)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_oversize_chunked_body_without_content_length_is_413(rel_server):
    def chunks():
        for _ in range(MAX_BODY_BYTES // 4096 + 2):
            yield b" " * 4096

    r = httpx.post(rel_server.base + C, content=chunks(), timeout=60,
                   headers={"content-type": "application/json", **AUTH})
    assert r.status_code == 413 and set(r.json()["error"]) == ERROR_KEYS


# ------------------------------------------------------------------------------------- context end
TARGET_CTX, DRAFTER_CTX = 64, 40


@pytest.fixture(scope="module")
def short_server(tmp_path_factory):
    """Tiny models with a 64-position target and a 40-position drafter (the drafter's window is smaller)."""
    from tests.service import tiny

    root = tmp_path_factory.mktemp("short")
    target_dir, drafter_dir = tiny.make_tiny_models(root, context=TARGET_CTX)
    cfg_path = Path(drafter_dir) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = DRAFTER_CTX  # same weights; RoPE is computed, so only the limit changes
    cfg_path.write_text(json.dumps(cfg))
    with start_tiny_server(target_dir, drafter_dir, root / "serve.log", "--budget", "8", "--candidates", "8",
                           "--width", "4") as srv:
        yield srv


def _greedy_ar(target_dir, prompt, n):
    from tests.service.test_e2e_tiny import _ar_reference

    return _ar_reference(target_dir, prompt, n)


@pytest.mark.parametrize("prompt_len,max_tokens", [
    (DRAFTER_CTX - 6, 12), (DRAFTER_CTX - 2, 8), (DRAFTER_CTX - 1, 6), (DRAFTER_CTX, 6), (DRAFTER_CTX + 1, 6),
    (TARGET_CTX - 9, 9), (TARGET_CTX - 2, 2), (TARGET_CTX - 1, 1),
])
@pytest.mark.parametrize("method", ["dartree-pruned", "ddtree"])
def test_prompts_at_the_position_limits_are_served_exactly(short_server, prompt_len, max_tokens, method):
    prompt = [3 + (7 * i) % 300 for i in range(prompt_len)]
    r = httpx.post(short_server.base + C, timeout=60, json={
        "prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True, "speculative": {"method": method}})
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["token_ids"]
    assert prompt_len + len(ids) <= TARGET_CTX
    assert ids == _greedy_ar(short_server.target_dir, prompt, max_tokens)[:len(ids)]
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("prompt_len,max_tokens,param", [
    (TARGET_CTX - 1, 2, "max_tokens"), (TARGET_CTX, 1, "prompt"), (TARGET_CTX + 1, 1, "prompt"),
    (DRAFTER_CTX, TARGET_CTX - DRAFTER_CTX + 1, "max_tokens"),
])
def test_prompts_past_the_target_limit_are_refused_cleanly(short_server, prompt_len, max_tokens, param):
    prompt = [3 + (7 * i) % 300 for i in range(prompt_len)]
    r = httpx.post(short_server.base + C, json={"prompt": prompt, "max_tokens": max_tokens}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_short_server_is_healthy_after_the_edges(short_server):
    assert httpx.get(short_server.base + "/health/ready").status_code == 200
    assert "Traceback" not in short_server.log.read_text()
