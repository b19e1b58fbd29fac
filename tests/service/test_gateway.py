"""The gateway on a scripted engine: responses, streaming, stop strings, usage, errors, admission."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from gateway.handlers import CUT_BY_STOP

from .conftest import GatewayHarness
from .fakes import Script


def run(coro):
    return asyncio.run(coro)


def sse_events(body: str) -> list:
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = [line[len("data: "):] for line in body.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def stream_text(events: list, chat: bool = False) -> str:
    if chat:
        return "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
    return "".join(c["text"] for e in events for c in e["choices"])


TEXTS = ["Hello world, this is a test.", "你好，世界！这是一个测试。", "Emoji 😀🎉 party 🧪 time", "mixed 日本語 🎉!"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("sizes", [[1], [3, 1, 4], [7]])
def test_stream_equals_non_stream_and_usage_counts_emitted_tokens(harness, text, sizes):
    ids = harness.text.encode(text, add_special_tokens=False)
    harness.script = lambda gen: Script(ids, round_sizes=sizes)

    async def go():
        plain = (await harness.complete(prompt="Say:", max_tokens=100, return_token_ids=True)).json()
        r = await harness.complete(prompt="Say:", max_tokens=100, stream=True, return_token_ids=True,
                                   stream_options={"include_usage": True})
        return plain, r

    plain, r = run(go())
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    usage_event = events[-1]
    assert usage_event["choices"] == [] and usage_event["usage"] == plain["usage"]
    body_events = events[:-1]
    assert stream_text(body_events) == plain["choices"][0]["text"]
    prompt_ids = harness.engine.generated[0].prompt_ids
    assert plain["choices"][0]["text"] == harness.text.decode(prompt_ids + ids)[len(harness.text.decode(prompt_ids)):]
    assert plain["usage"]["completion_tokens"] == len(ids) == len(plain["choices"][0]["token_ids"])
    assert [t for e in body_events for t in e["choices"][0]["token_ids"]] == ids
    assert len(body_events) <= -(-len(ids) // min(sizes)) + 1  # at most one event per round
    assert body_events[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"] == "stop"
    assert all(e["id"] == body_events[0]["id"] for e in events)


def test_max_tokens_gives_length_and_exact_usage(bl_harness):
    h = bl_harness
    r = run(h.complete(prompt="x", max_tokens=5)).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}
    assert h.engine.generated[0].sampling.max_tokens == 5


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_stop_reason_names_the_stop_token_id(bl_harness, stream, chat):
    """A request the engine ended on an entry of ``stop_token_ids`` reports that id as ``stop_reason``
    (as vLLM does); one ended by EOS reports null."""
    h = bl_harness
    for stop_id, want in ((17, 17), (None, None)):
        h.script = lambda gen, stop_id=stop_id: Script([5, 6, 7], stop_token_id=stop_id)

        async def go():
            body = {"max_tokens": 50, "stop_token_ids": [17], "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            if chat:
                return await h.chat(messages=[{"role": "user", "content": "x"}], **body)
            return await h.complete(prompt="x", **body)

        r = run(go())
        choice = ([e for e in sse_events(r.text) if e.get("choices")][-1] if stream else r.json())["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == want, (stop_id, choice)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_mid_round_cuts_text_ids_and_usage(bl_harness, stream):
    h = bl_harness
    ids = h.text.encode("one two STOP three four", add_special_tokens=False)
    h.script = lambda gen: Script(ids, round_sizes=[len(ids)])  # everything in one round

    async def go():
        return await h.complete(prompt="x", max_tokens=50, stop=["STOP"], stream=stream, return_token_ids=True,
                                **({"stream_options": {"include_usage": True}} if stream else {}))

    r = run(go())
    if stream:
        events = sse_events(r.text)
        text, usage = stream_text(events[:-1]), events[-1]["usage"]
        kept = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
        finish = events[-2]["choices"][0]
    else:
        body = r.json()
        text, usage, finish = body["choices"][0]["text"], body["usage"], body["choices"][0]
        kept = finish["token_ids"]
    assert text == "one two "
    assert finish["finish_reason"] == "stop" and finish["stop_reason"] == "STOP"
    assert usage["completion_tokens"] == len(kept) < len(ids)
    assert "STOP" in h.text.decode(kept) and h.text.decode(kept[:-1]).find("STOP") < 0
    assert [a.reason for a in h.engine.aborts] == ["stop_string"]


def test_echo_and_token_prompt(bl_harness):
    h = bl_harness
    prompt_ids = h.text.encode("Hi there", add_special_tokens=False)
    r = run(h.complete(prompt=prompt_ids, max_tokens=3, echo=True)).json()
    assert r["choices"][0]["text"].startswith("Hi there")
    assert h.engine.generated[0].prompt_ids == prompt_ids
    assert r["usage"]["prompt_tokens"] == len(prompt_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completion_uses_the_template(bl_harness, stream):
    h = bl_harness
    r = run(h.chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                   max_completion_tokens=4, stream=stream))
    prompt = h.engine.generated[0].prompt_ids
    assert h.text.decode(prompt, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert h.engine.generated[0].sampling.max_tokens == 4
    if stream:
        events = sse_events(r.text)
        assert events[0]["object"] == "chat.completion.chunk"
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all("role" not in e["choices"][0]["delta"] for e in events[1:])
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    else:
        body = r.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] == 4


def test_chat_default_max_tokens_fills_the_context(bl_harness):
    h = bl_harness
    run(h.chat(messages=[{"role": "user", "content": "hi"}]))
    gen = h.engine.generated[0]
    assert gen.sampling.max_tokens == 256 - len(gen.prompt_ids)


def test_speculative_and_sampling_fields_reach_the_engine(bl_harness):
    h = bl_harness
    run(h.complete(prompt="x", max_tokens=2, temperature=0.7, top_p=0.9, top_k=5, seed=11, ignore_eos=True,
                   stop_token_ids=[7], speculative={"method": "ddtree", "budget": 32, "width": 4,
                                                    "depth_bonus": -0.2, "candidates": 8}))
    gen = h.engine.generated[0]
    assert (gen.sampling.temperature, gen.sampling.top_p, gen.sampling.top_k, gen.sampling.seed) == (0.7, 0.9, 5, 11)
    assert gen.sampling.ignore_eos and gen.sampling.stop_token_ids == (7,)
    assert (gen.spec.method, gen.spec.budget, gen.spec.width, gen.spec.depth_bonus, gen.spec.candidates) == \
        ("ddtree", 32, 4, -0.2, 8)


def test_request_id_is_honoured_and_echoed(bl_harness):
    h = bl_harness
    r = run(h.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "abc-1"}))
    assert r.headers["x-request-id"] == "abc-1" and r.json()["id"] == "cmpl-abc-1"
    assert h.engine.generated[0].request_id.startswith("abc-1-")
    r = run(h.client.get("/health/live"))
    assert len(r.headers["x-request-id"]) == 32


def test_error_after_stream_started_is_an_error_event_then_done(bl_harness):
    h = bl_harness
    h.script = lambda gen: Script(list(range(10, 30)), round_sizes=[2], error_after_rounds=2)
    r = run(h.complete(prompt="x", max_tokens=50, stream=True))
    events = sse_events(r.text)
    assert "error" in events[-1] and events[-1]["error"]["message"] == "scripted failure"
    assert all("choices" in e for e in events[:-1])


@pytest.mark.parametrize("status", [429, 400, 503])
def test_engine_refusal_before_first_round_keeps_its_status(bl_harness, status):
    h = bl_harness
    h.script = lambda gen: Script([5], error_after_rounds=0, error_status=status)
    for stream in (False, True):
        r = run(h.complete(prompt="x", max_tokens=5, stream=stream))
        assert r.status_code == status
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    if status == 429:
        assert r.headers["retry-after"] == "1"


def test_admission_limit_returns_429_with_retry_after(bytelevel_dir):
    h = GatewayHarness(bytelevel_dir, max_concurrent_requests=2)
    h.script = lambda gen: Script(list(range(10, 40)), round_sizes=[1], delay_s=0.01)

    async def go():
        return await asyncio.gather(*(h.complete(prompt="x", max_tokens=20) for _ in range(4)))

    codes = sorted(r.status_code for r in run(go()))
    assert codes == [200, 200, 429, 429]
    assert h.gateway.in_flight == 0


def test_not_ready_and_draining_are_503(bl_harness):
    h = bl_harness
    h.engine.is_ready = False
    assert run(h.client.get("/health/ready")).status_code == 503
    r = run(h.complete(prompt="x"))
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    h.engine.is_ready = True
    assert run(h.client.get("/health/ready")).status_code == 200
    h.gateway.begin_drain()
    assert run(h.complete(prompt="x")).status_code == 503
    assert run(h.client.get("/health/ready")).json()["detail"] == "draining"
    assert run(h.client.get("/v1/models")).status_code == 200


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_bare_health_answers_as_ready(bl_harness, method):
    """``/health`` (the path vLLM, TGI and llama.cpp answer, which benchmark clients, load balancers
    and probes call) answers as ``/health/ready``: 200 when ready, 503 with the reason when not or
    when draining."""
    h = bl_harness

    def probe():
        r = run(h.client.request(method, "/health"))
        ready = run(h.client.request(method, "/health/ready"))
        assert (r.status_code, r.content) == (ready.status_code, ready.content)
        return r

    r = probe()
    assert r.status_code == 200 and (method == "HEAD" or r.json() == {"status": "ready", "detail": "ready"})
    h.engine.is_ready = False
    r = probe()
    assert r.status_code == 503 and (method == "HEAD" or r.json()["status"] == "unavailable")
    h.engine.is_ready = True
    h.gateway.begin_drain()
    r = probe()
    assert r.status_code == 503 and (method == "HEAD" or r.json()["detail"] == "draining")


def test_health_answers_head_probes(bl_harness):
    """Monitors that probe with HEAD see the same status as GET (no 405)."""
    h = bl_harness
    assert run(h.client.head("/health/ready")).status_code == 200
    assert run(h.client.head("/health/live")).status_code == 200
    h.engine.is_ready = False
    assert run(h.client.head("/health/ready")).status_code == 503


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "MODEL"])
def test_get_routes_answer_head_as_get(bl_harness, path):
    """HEAD on a GET route has GET's status and content type (no 405); an unknown model is a 404."""
    h = bl_harness
    if path == "MODEL":
        path = "/v1/models/" + run(h.client.get("/v1/models")).json()["data"][0]["id"]
        assert run(h.client.head("/v1/models/no-such-model")).status_code == 404
    get, head = run(h.client.get(path)), run(h.client.head(path))
    assert get.status_code == head.status_code == 200
    assert head.headers["content-type"] == get.headers["content-type"]


@pytest.mark.parametrize("knob, value", [("budget", 65), ("width", 65), ("candidates", 65)])
def test_tree_knobs_over_the_server_cap_are_a_400_naming_the_knob(bl_harness, knob, value, caplog):
    """The verifier's limits (``--max-request-budget``) bound a request's tree: one knob over its
    cap is refused before anything runs, with a log line; at the cap it is served."""
    h = bl_harness
    with caplog.at_level(logging.INFO, logger="gateway"):
        r = run(h.complete(prompt="x", speculative={"method": "dartree-pruned", knob: value}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == f"speculative.{knob}" and "64" in err["message"] and err["code"] == "invalid_value"
    assert not h.engine.generated
    assert any("rejected: 400 invalid_value [speculative." + knob in m for m in caplog.messages), caplog.messages
    r = run(h.complete(prompt="x", speculative={"method": "dartree-pruned", knob: value - 1}))
    assert r.status_code == 200 and h.engine.generated[-1].spec.__getattribute__(knob) == value - 1


def test_n_over_the_verifiers_slots_is_a_400_naming_n(bl_harness):
    """``n`` choices need ``n`` request slots at once: above running + waiting (4 + 8 here) no retry
    could succeed, so a 400 naming ``n`` rather than a 429; at the limit it is served."""
    h = bl_harness
    r = run(h.complete(prompt="x", n=13, max_tokens=2))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "12" in r.json()["error"]["message"]
    r = run(h.complete(prompt="x", n=12, max_tokens=2))
    assert r.status_code == 200 and len(r.json()["choices"]) == 12


def test_api_key(bytelevel_dir):
    h = GatewayHarness(bytelevel_dir, api_key="sekrit", metrics_auth=True)
    r = run(h.complete(prompt="x", max_tokens=1))
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = run(h.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                          headers={"Authorization": "Bearer sekrit"}))
    assert r.status_code == 200
    assert run(h.client.get("/health/live")).status_code == 200
    assert run(h.client.get("/metrics")).status_code == 401
    h2 = GatewayHarness(bytelevel_dir, api_key="sekrit")
    assert run(h2.client.get("/metrics")).status_code == 200


def test_models_metrics_and_openapi(bl_harness):
    h = bl_harness
    models = run(h.client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256
    run(h.complete(prompt="x", max_tokens=3))
    text = run(h.client.get("/metrics")).text
    assert 'dartree_requests_total{finish_reason="length"} 1.0' in text
    assert "dartree_generation_tokens_total 3.0" in text
    assert "dartree_time_to_first_token_seconds_count 1.0" in text
    spec = run(h.client.get("/openapi.json")).json()
    assert "CompletionRequest" in spec["components"]["schemas"]
    assert spec["paths"]["/v1/completions"]["post"]["requestBody"]["required"] is True


def test_unknown_route_is_openai_shaped_404(bl_harness):
    r = run(bl_harness.client.get("/v1/nope"))
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == "not_found" and r.json()["error"]["type"] == "not_found_error"


def test_wrong_http_method_is_openai_shaped_405(bl_harness):
    r = run(bl_harness.client.get("/v1/completions"))
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text
    assert "POST" in r.headers.get("allow", "")


def test_deadline_aborts_the_request(bytelevel_dir):
    h = GatewayHarness(bytelevel_dir, request_timeout_s=0.05)
    h.script = lambda gen: Script(list(range(10, 40)), round_sizes=[1], delay_s=0.02)
    r = run(h.complete(prompt="x", max_tokens=30))
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert [a.reason for a in h.engine.aborts] == ["deadline"]
    assert h.gateway.in_flight == 0


def test_many_concurrent_greedy_requests_agree(bl_harness):
    h = bl_harness

    async def go():
        return await asyncio.gather(*(h.complete(prompt="x", max_tokens=30, stream=bool(i % 2)) for i in range(8)))

    rs = run(go())
    texts = {r.json()["choices"][0]["text"] if not r.headers["content-type"].startswith("text/event-stream")
             else stream_text(sse_events(r.text)) for r in rs}
    assert len(texts) == 1 and h.gateway.in_flight == 0


@pytest.mark.parametrize("stream", [False, True])
def test_internal_errors_are_500_without_traceback(bl_harness, stream):
    h = bl_harness

    def broken(gen):
        raise RuntimeError("secret internals")

    h.script = broken
    r = run(h.complete(prompt="x", max_tokens=3, stream=stream))
    if stream and r.status_code == 200:
        assert sse_events(r.text)[-1]["error"]["code"] == "internal_error"
    else:
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
    assert "secret" not in r.text and "Traceback" not in r.text
    assert h.gateway.in_flight == 0


def test_models_retrieve_and_unknown_model_404(bl_harness):
    h = bl_harness
    card = run(h.client.get("/v1/models/tiny")).json()
    assert card == run(h.client.get("/v1/models")).json()["data"][0]
    for unknown in ("gpt-4", "org/name"):
        r = run(h.client.get(f"/v1/models/{unknown}"))
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("body, message", [
    (b'{"prompt": "\\ud800", "max_tokens": 1}', "invalid Unicode escape (lone surrogate"),
    (b'{"prompt": "\\udc00x", "max_tokens": 1}', "invalid Unicode escape (lone surrogate"),
    (b'{"prompt": "\xff", "max_tokens": 1}', "not valid UTF-8"),
    (b'{"prompt": }', "not valid JSON: expected value at line 1 column 12"),
])
def test_undecodable_bodies_get_an_accurate_400(bl_harness, body, message):
    r = run(bl_harness.client.post("/v1/completions", content=body, headers={"content-type": "application/json"}))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert message in r.json()["error"]["message"]


@pytest.mark.parametrize("reason,says", [(None, "at the end of the drain timeout"),
                                         (CUT_BY_STOP, "told to stop now")])
def test_cut_in_flight_ends_streams_with_an_error_event_and_others_with_503(bl_harness, reason, says):
    """The drain timeout or a second stop signal (Gateway.cut_in_flight): every open stream gets a
    server_shutdown error event then [DONE]; a request still waiting for its JSON answer gets a 503;
    both say which of the two cut them; the engine requests are aborted."""
    h = bl_harness
    h.script = lambda gen: Script(list(range(10, 200)), round_sizes=[1], delay_s=0.05)

    async def go():
        tasks = [asyncio.ensure_future(h.complete(prompt="x", max_tokens=150, stream=True)),
                 asyncio.ensure_future(h.complete(prompt="x", max_tokens=150)),
                 asyncio.ensure_future(h.chat(messages=[{"role": "user", "content": "x"}], max_tokens=150,
                                              stream=True))]
        await asyncio.sleep(0.5)  # several rounds of each are out
        h.gateway.begin_drain()
        h.gateway.cut_in_flight(*([reason] if reason else []))
        return await asyncio.wait_for(asyncio.gather(*tasks), 5)

    body, plain, chat = run(go())
    for r in (body, chat):
        events = sse_events(r.text)
        assert len(events) > 2
        assert events[-1]["error"]["code"] == "server_shutdown" and events[-1]["error"]["type"] == "service_unavailable"
        assert says in events[-1]["error"]["message"]
        assert all("choices" in e for e in events[:-1])
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "server_shutdown"
    assert says in plain.json()["error"]["message"]
    assert h.gateway.in_flight == 0 and len(h.engine.aborts) == 3
    assert [a.reason for a in h.engine.aborts] == ["shutdown"] * 3  # cut by the server, not left by a client
