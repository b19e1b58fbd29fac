"""Validation table: every bad-input class gets its status code, the OpenAI error shape and its ``param``."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib

import pytest

from .conftest import GatewayHarness

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

CASES = [
    # (id, path, body, headers, status, param)
    ("non-json", C, b"{not json", None, 400, None),
    ("invalid-utf8", C, b'{"prompt": "\xff\xfe"}', None, 400, None),
    ("json-array", C, b"[1, 2]", None, 400, None),
    ("wrong-content-type", C, b'{"prompt": "x"}', {"content-type": "text/plain"}, 415, None),
    ("body-too-large", C, {"prompt": "x" * 5000}, None, 413, None),
    ("gzip-body-too-large-decoded", C, gzip.compress(b'{"prompt": "' + b"x" * 100_000 + b'"}'),
     {"content-encoding": "gzip"}, 413, None),
    ("gzip-corrupt", C, b"\x1f\x8b\x08\x00junk", {"content-encoding": "gzip"}, 400, None),
    ("gzip-truncated", C, gzip.compress(b'{"prompt": "x"}')[:-12], {"content-encoding": "gzip"}, 400, None),
    ("gzip-header-plain-body", C, b'{"prompt": "x"}', {"content-encoding": "gzip"}, 400, None),
    ("brotli", C, b'{"prompt": "x"}', {"content-encoding": "br"}, 415, None),
    ("missing-prompt", C, {}, None, 400, "prompt"),
    ("prompt-wrong-type", C, {"prompt": 5}, None, 400, "prompt"),
    ("empty-prompt", C, {"prompt": ""}, None, 400, "prompt"),
    ("token-out-of-vocab", C, {"prompt": [5, 10**6]}, None, 400, "prompt[1]"),
    ("token-negative", C, {"prompt": [-1, 5]}, None, 400, "prompt[0]"),
    ("batched-prompts", C, {"prompt": ["a", "b"]}, None, 400, "prompt"),
    ("max-tokens-zero", C, {"prompt": "x", "max_tokens": 0}, None, 400, "max_tokens"),
    ("max-tokens-negative", C, {"prompt": "x", "max_tokens": -3}, None, 400, "max_tokens"),
    ("max-tokens-huge", C, {"prompt": "x", "max_tokens": 10**9}, None, 400, "max_tokens"),
    ("max-tokens-string", C, {"prompt": "x", "max_tokens": "5"}, None, 400, "max_tokens"),
    ("max-tokens-bool", C, {"prompt": "x", "max_tokens": True}, None, 400, "max_tokens"),
    ("context-exceeded", C, {"prompt": "x", "max_tokens": 256}, None, 400, "max_tokens"),
    ("prompt-over-context", C, {"prompt": list(range(3, 259))}, None, 400, "prompt"),
    ("temperature-negative", C, {"prompt": "x", "temperature": -0.5}, None, 400, "temperature"),
    ("temperature-nan", C, b'{"prompt": "x", "temperature": NaN}', None, 400, "temperature"),
    ("temperature-too-high", C, {"prompt": "x", "temperature": 3}, None, 400, "temperature"),
    ("top-p-zero", C, {"prompt": "x", "top_p": 0}, None, 400, "top_p"),
    ("seed-too-big", C, {"prompt": "x", "seed": 2**64}, None, 400, "seed"),
    ("five-stop-strings", C, {"prompt": "x", "stop": list("abcde")}, None, 400, "stop"),
    ("empty-stop-string", C, {"prompt": "x", "stop": [""]}, None, 400, "stop"),
    ("stop-wrong-type", C, {"prompt": "x", "stop": [1]}, None, 400, "stop[0]"),
    ("stop-token-out-of-vocab", C, {"prompt": "x", "stop_token_ids": [10**6]}, None, 400, "stop_token_ids[0]"),
    ("n-over-128", C, {"prompt": "x", "n": 129}, None, 400, "n"),
    ("best-of", C, {"prompt": "x", "best_of": 3}, None, 400, "best_of"),
    ("penalty-out-of-range", C, {"prompt": "x", "presence_penalty": 5}, None, 400, "presence_penalty"),
    ("logit-bias-out-of-vocab", C, {"prompt": "x", "logit_bias": {"1000000": 10}}, None, 400, "logit_bias.1000000"),
    ("logprobs-over-5", C, {"prompt": "x", "logprobs": 6}, None, 400, "logprobs"),
    ("logprobs-negative", C, {"prompt": "x", "logprobs": -1}, None, 400, "logprobs"),
    ("logprobs-bool", C, {"prompt": "x", "logprobs": True}, None, 400, "logprobs"),
    ("logprobs-string", C, {"prompt": "x", "logprobs": "2"}, None, 400, "logprobs"),
    ("logprobs-with-echo", C, {"prompt": "x", "logprobs": 1, "echo": True}, None, 400, "echo"),
    ("suffix", C, {"prompt": "x", "suffix": "end"}, None, 400, "suffix"),
    ("min-tokens-over-max-tokens", C, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, None, 400, "min_tokens"),
    ("repetition-penalty-zero", C, {"prompt": "x", "repetition_penalty": 0}, None, 400, "repetition_penalty"),
    ("unknown-model", C, {"prompt": "x", "model": "gpt-9"}, None, 404, "model"),
    ("spec-unknown-method", C, {"prompt": "x", "speculative": {"method": "medusa"}}, None, 400, "speculative.method"),
    ("spec-budget-zero", C, {"prompt": "x", "speculative": {"budget": 0}}, None, 400, "speculative.budget"),
    ("spec-budget-over-max", C, {"prompt": "x", "speculative": {"budget": 1000}}, None, 400, "speculative.budget"),
    ("spec-unknown-key", C, {"prompt": "x", "speculative": {"beam": 2}}, None, 400, "speculative.beam"),
    ("spec-depth-bonus-nan", C, b'{"prompt": "x", "speculative": {"depth_bonus": NaN}}', None, 400,
     "speculative.depth_bonus"),
    ("spec-depth-bonus-positive", C, {"prompt": "x", "speculative": {"depth_bonus": 0.5}}, None, 400,
     "speculative.depth_bonus"),
    ("stream-options-without-stream", C, {"prompt": "x", "stream_options": {"include_usage": True}}, None, 400,
     "stream_options"),
    ("request-id-too-long", C, {"prompt": "x"}, {"x-request-id": "a" * 129}, 400, "x-request-id"),
    ("request-id-with-space", C, {"prompt": "x"}, {"x-request-id": "a b"}, 400, "x-request-id"),
    ("chat-no-messages", CHAT, {"messages": []}, None, 400, "messages"),
    ("chat-missing-messages", CHAT, {}, None, 400, "messages"),
    ("chat-bad-role", CHAT, {"messages": [{"role": "bot", "content": "x"}]}, None, 400, "messages[0].role"),
    ("chat-user-without-content", CHAT, {"messages": [{"role": "user"}]}, None, 400, "messages[0]"),
    ("chat-system-null-content", CHAT, {"messages": [{"role": "system", "content": None}, {"role": "user",
                                                                                         "content": "x"}]},
     None, 400, "messages[0]"),
    ("chat-image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     None, 400, "messages[0].content[0].type"),
    ("chat-max-completion-tokens-zero", CHAT, {"messages": MSG, "max_completion_tokens": 0}, None, 400,
     "max_completion_tokens"),
    ("chat-context-exceeded", CHAT, {"messages": MSG, "max_completion_tokens": 10**4}, None, 400,
     "max_completion_tokens"),
    ("chat-logprobs-int", CHAT, {"messages": MSG, "logprobs": 1}, None, 400, "logprobs"),
    ("chat-top-logprobs-over-20", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, None, 400,
     "top_logprobs"),
    ("chat-top-logprobs-negative", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": -1}, None, 400,
     "top_logprobs"),
    ("chat-top-logprobs-float", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 2.0}, None, 400,
     "top_logprobs"),
    ("chat-top-logprobs-without-logprobs", CHAT, {"messages": MSG, "top_logprobs": 3}, None, 400, "top_logprobs"),
    ("chat-tool-without-function", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, None, 400,
     "tools[0].function"),
    ("chat-json-schema-invalid", CHAT, {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, None, 400,
     "response_format.json_schema.schema"),
]

OK_CASES = [
    ("special-tokens-only", C, {"prompt": "<|im_end|>", "max_tokens": 2}),
    ("prompt-at-context-minus-one", C, {"prompt": list(range(3, 258)), "max_tokens": 1}),
    ("harmless-unknown-fields", C, {"prompt": "x", "max_tokens": 1, "user": "u", "metadata": {"a": 1}}),
    ("off-values-of-unsupported-fields", C, {"prompt": "x", "max_tokens": 1, "n": 1, "presence_penalty": 0,
                                             "frequency_penalty": 0.0, "logit_bias": {}, "best_of": 1,
                                             "mirostat": 0, "mirostat_tau": 5.0, "dry_multiplier": 0.0,
                                             "xtc_probability": 0, "tfs_z": 1.0}),
    ("penalties-bias-min-tokens-min-p", C, {"prompt": "x", "max_tokens": 2, "presence_penalty": 0.5,
                                            "frequency_penalty": -1.0, "repetition_penalty": 1.2,
                                            "logit_bias": {"5": 10}, "min_tokens": 1, "min_p": 0.1}),
    ("n-2", C, {"prompt": "x", "max_tokens": 1, "n": 2}),
    ("single-prompt-in-a-list", C, {"prompt": ["x"], "max_tokens": 1}),
    ("token-prompt-in-a-list", C, {"prompt": [[5, 6]], "max_tokens": 1}),
    ("chat-minimal", CHAT, {"messages": MSG, "max_tokens": 1}),
    ("chat-assistant-null-content", CHAT, {"messages": [{"role": "user", "content": "x"},
                                                        {"role": "assistant", "content": None},
                                                        {"role": "user", "content": "y"}], "max_tokens": 1}),
    ("top-k-disabled", C, {"prompt": "x", "max_tokens": 1, "top_k": -1}),
    ("logprobs-0", C, {"prompt": "x", "max_tokens": 1, "logprobs": 0}),
    ("logprobs-5", C, {"prompt": "x", "max_tokens": 1, "logprobs": 5}),
    ("chat-top-logprobs-20", CHAT, {"messages": MSG, "max_tokens": 1, "logprobs": True, "top_logprobs": 20}),
    ("chat-logprobs-off", CHAT, {"messages": MSG, "max_tokens": 1, "logprobs": False, "top_logprobs": 0}),
]


@pytest.fixture(scope="module")
def vharness(bytelevel_dir):
    return GatewayHarness(bytelevel_dir, max_body_bytes=4096)


def _post(h, path, body, headers):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"content-type": "application/json", **(headers or {})}
    return asyncio.run(h.client.post(path, content=data, headers=hdrs))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_with_status_and_param(vharness, case):
    _, path, body, headers, status, param = case
    r = _post(vharness, path, body, headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if param == "stop":
        assert err["code"] == "invalid_value"
    if status == 400:  # every field error names its kind, as OpenAI's do
        assert err["code"], r.text
    assert "Traceback" not in r.text


@pytest.mark.parametrize("case", OK_CASES, ids=[c[0] for c in OK_CASES])
def test_edge_inputs_are_served(vharness, case):
    _, path, body = case
    r = _post(vharness, path, body, None)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("encoding, encode", [
    ("gzip", gzip.compress), ("x-gzip", gzip.compress), ("deflate", zlib.compress),
    ("deflate", lambda b: zlib.compress(b)[2:-4]),  # a raw deflate stream, as some clients send "deflate"
    ("gzip, identity", gzip.compress), ("identity", lambda b: b)])
def test_compressed_bodies_are_decoded(vharness, encoding, encode):
    """A body sent with Content-Encoding gzip / deflate is served as the same body sent plainly."""
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
    plain = _post(vharness, C, body, None)
    r = _post(vharness, C, encode(json.dumps(body).encode()), {"content-encoding": encoding})
    assert plain.status_code == r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert r.json()["usage"] == plain.json()["usage"]


@pytest.mark.parametrize("method, says", [("eagle3", "is not served by this server's drafter"),
                                          ("medusa", "is not a speculative method")])
def test_method_errors_tell_unserved_from_unknown(vharness, method, says):
    """A real method this drafter cannot serve is not called "unknown" (the CLI says "not served" too)."""
    r = _post(vharness, C, {"prompt": "x", "speculative": {"method": method}}, None)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert says in msg and "this server serves: " in msg, msg
