"""What the token counters count (issue 17, class 4), held on a running ``dartree serve`` (tiny models).

- ``dartree_generation_tokens_total`` (gateway) rises by exactly the completion tokens handed to
  clients: ``usage.completion_tokens`` of every non-streamed response, the tokens of every stream
  event written; over a mixed batch with stop strings, stop ids (the EOS class), ``max_tokens``,
  both endpoints, streams and not, and requests closed while queued (which add 0).
- ``dartree_prompt_tokens_total`` (gateway) counts a prompt when its prefill ran (the first round
  came back), so requests closed while still queued at the verifier add nothing.
- The verifier's speculative counters count the tokens of speculative rounds the verifier emitted:
  the prefill's first token is in none of them, so for requests no stop string or disconnect cut,
  ``sum(completion_tokens) == rise(dartree_spec_acceptance_length_sum) + number of requests`` and
  each round is one observation (README "Metrics").
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from .conftest import metric_total, start_tiny_server

pytestmark = pytest.mark.e2e
PROMPT = "Count from 1 to 20: 1, 2, 3,"


@pytest.fixture(scope="module")
def count_server(tiny_models, tmp_path_factory):
    target_dir, drafter_dir = tiny_models
    log = tmp_path_factory.mktemp("counters") / "serve.log"
    with start_tiny_server(target_dir, drafter_dir, log, "--budget", "8", "--candidates", "8", "--width", "4",
                           "--max-running", "2", "--max-waiting", "16") as srv:
        yield srv


def _metrics(server) -> tuple[str, str]:
    vport, _ = server.metrics_ports
    return (httpx.get(server.base + "/metrics", timeout=10).text,
            httpx.get(f"http://127.0.0.1:{vport}/metrics", timeout=10).text)


def _gateway_counts(server) -> tuple[float, float]:
    g, _ = _metrics(server)
    return metric_total(g, "dartree_generation_tokens_total"), metric_total(g, "dartree_prompt_tokens_total")


async def _run(client: httpx.AsyncClient, path: str, body: dict) -> tuple[int, int]:
    """``(prompt_tokens, completion tokens the client received)`` of one request read to its end."""
    if not body.get("stream"):
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert u["completion_tokens"] == len(r.json()["choices"][0]["token_ids"])
        return u["prompt_tokens"], u["completion_tokens"]
    seen, usage = 0, None
    async with client.stream("POST", path, json={**body, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                seen += sum(len(c.get("token_ids") or []) for c in event["choices"])
                usage = event.get("usage") or usage
    assert usage is not None and usage["completion_tokens"] == seen, (usage, seen)
    return usage["prompt_tokens"], seen


async def _send_raw(base: str, body: dict) -> asyncio.StreamWriter:
    """Send one request over a raw connection and return its writer (to close it later)."""
    host, port = base.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    return writer


async def _wait_waiting(server, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=10) as c:
        while time.monotonic() < deadline:
            text = (await c.get(f"http://127.0.0.1:{server.metrics_ports[0]}/metrics")).text
            if metric_total(text, "dartree_num_requests_waiting") >= n:
                return
            await asyncio.sleep(0.02)
    raise TimeoutError(f"never {n} requests waiting:\n{server.log_tail()}")


def test_generated_and_prompt_counters_match_what_clients_got(count_server):
    base = count_server.base
    ref = httpx.post(base + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "return_token_ids": True}).json()
    text, ids = ref["choices"][0]["text"], ref["choices"][0]["token_ids"]
    stop = next(text[i:i + 2] for i in range(3, len(text) - 1)
                if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip())  # a stop string mid-text
    stop_id = ids[len(ids) // 2]
    common = {"temperature": 0, "return_token_ids": True}
    bodies = [("/v1/completions", {"prompt": PROMPT, "max_tokens": 24}),
              ("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "stream": True}),
              ("/v1/completions", {"prompt": PROMPT, "max_tokens": 48, "stop": [stop],
                                   "speculative": {"method": "dartree-pruned", "budget": 16, "width": 4}}),
              ("/v1/completions", {"prompt": PROMPT, "max_tokens": 48, "stop": [stop], "stream": True}),
              ("/v1/completions", {"prompt": PROMPT, "max_tokens": 48, "stop_token_ids": [stop_id]}),
              ("/v1/completions", {"prompt": PROMPT, "max_tokens": 48, "stop_token_ids": [stop_id], "stream": True,
                                   "speculative": {"method": "ar"}}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 17}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 17,
                                        "stream": True})]
    blocker = {"prompt": "x", "max_tokens": 230, "temperature": 0, "stream": True, "return_token_ids": True,
               "speculative": {"method": "ar"}}
    gen0, prompt0 = _gateway_counts(count_server)

    async def go():
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            blockers = [asyncio.ensure_future(_run(client, "/v1/completions", blocker)) for _ in range(2)]
            while True:  # both slots taken
                v = (await client.get(f"http://127.0.0.1:{count_server.metrics_ports[0]}/metrics")).text
                if metric_total(v, "dartree_num_requests_running") >= 2:
                    break
                await asyncio.sleep(0.02)
            # four requests queued behind the blockers, closed before they are ever prefilled
            queued = [await _send_raw(base, {"prompt": PROMPT, "max_tokens": 24, "stream": s})
                      for s in (True, False, True, False)]
            await _wait_waiting(count_server, 4)
            for writer in queued:
                writer.transport.abort()  # the request was sent; its prefill never ran
            rest = [_run(client, path, {**common, **b}) for path, b in bodies]
            return await asyncio.gather(*blockers, *rest)

    results = asyncio.run(go())
    deadline = time.monotonic() + 10
    while True:  # the gateway counts a response as it writes it: wait until every request is released
        g, _ = _metrics(count_server)
        if metric_total(g, "dartree_gateway_requests_in_flight") == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    gen1, prompt1 = _gateway_counts(count_server)
    assert gen1 - gen0 == sum(c for _, c in results), (gen1 - gen0, results)
    assert prompt1 - prompt0 == sum(p for p, _ in results), (prompt1 - prompt0, results)


async def _hang_up_mid_stream(base: str, body: dict, events: int) -> int:
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            seen, n = 0, 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    seen += len(json.loads(line[6:])["choices"][0]["token_ids"])
                    n += 1
                    if n >= events:
                        return seen


def test_a_stream_cut_by_its_client_counts_what_was_written(count_server):
    gen0, prompt0 = _gateway_counts(count_server)
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True, "return_token_ids": True,
            "speculative": {"method": "ar"}}
    seen = asyncio.run(_hang_up_mid_stream(count_server.base, body, 3))
    time.sleep(1.0)
    gen1, prompt1 = _gateway_counts(count_server)
    assert seen <= gen1 - gen0 < 200, (seen, gen1 - gen0)  # written events only, never the whole max_tokens
    assert prompt1 - prompt0 > 0


def test_speculative_counters_count_the_verifier_rounds_and_not_the_prefill(count_server):
    """The documented definition: the verifier's acceptance-length histogram observes every
    speculative round's emitted tokens; the prefill's token is in no speculative counter."""
    _, v0 = _metrics(count_server)
    total, n = 0, 0
    with httpx.Client(base_url=count_server.base, timeout=60) as c:
        for method in ("dartree-pruned", "ddtree", "ar"):
            for max_tokens in (1, 9, 33):
                r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                                                    "speculative": {"method": method}})
                assert r.status_code == 200, r.text
                total += r.json()["usage"]["completion_tokens"]
                n += 1
    _, v1 = _metrics(count_server)
    rise = lambda name: metric_total(v1, name) - metric_total(v0, name)  # noqa: E731
    assert rise("dartree_spec_acceptance_length_sum") + n == total
    assert rise("dartree_spec_acceptance_length_count") == rise("dartree_spec_rounds_total")
    assert rise("dartree_spec_accepted_tokens_total") + rise("dartree_spec_rounds_total") == total - n


def _verifier_idle(server) -> bool:
    g, v = _metrics(server)
    return (metric_total(g, "dartree_gateway_requests_in_flight") == 0
            and metric_total(v, "dartree_num_requests_running") == 0
            and metric_total(v, "dartree_num_requests_waiting") == 0)


def test_counters_reconcile_under_batching_stop_strings_and_terminators(count_server):
    """docs/serving.md "Metrics", the reconciliation rules, on the three-process server (gateway and
    verifier over ZMQ), over nine concurrent requests (four streamed, five not, speculative and
    plain, batched two at a time): stop strings (tokens past them reach no client), stop ids (a
    terminator: the same cut as EOS) and ``max_tokens``.

    1. sum(usage.completion_tokens) == rise(dartree_generation_tokens_total)
    2. rise(dartree_emitted_tokens_total) == sum(completion_tokens) + rise(dartree_discarded_tokens_total)
    3. rise(emitted{phase="round"}) == rise(acceptance_length_sum); rise(emitted{phase="prefill"}) == requests
    4. rise(rounds_total) + rise(accepted_tokens_total) == rise(acceptance_length_sum) + rise(cut_rounds_total)
    5. one round_seconds{phase="total"} observation per round; one dartree_step_seconds per step
    """
    base = count_server.base
    ref = httpx.post(base + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "return_token_ids": True}).json()
    text, ids = ref["choices"][0]["text"], ref["choices"][0]["token_ids"]
    stop = next(text[i:i + 2] for i in range(3, len(text) - 1)
                if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip())  # a stop string mid-text
    spec = {"speculative": {"method": "dartree-pruned", "budget": 16, "width": 4}}
    bodies = [{"max_tokens": 24, **spec}, {"max_tokens": 24, "stream": True, **spec},
              {"max_tokens": 48, "stop": [stop], **spec}, {"max_tokens": 48, "stop": [stop], "stream": True, **spec},
              {"max_tokens": 48, "stop_token_ids": [ids[len(ids) // 2]], **spec},
              {"max_tokens": 48, "stop_token_ids": [ids[len(ids) // 3]], "stream": True, **spec},
              {"max_tokens": 19, "speculative": {"method": "ddtree"}},
              {"max_tokens": 17, "stream": True, "speculative": {"method": "ar"}},
              {"max_tokens": 1, "stream": False, **spec}]
    _, v0 = _metrics(count_server)
    g0, _ = _metrics(count_server)

    async def go():
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            return await asyncio.gather(*(_run(client, "/v1/completions", {"prompt": PROMPT, "temperature": 0,
                                                                             "return_token_ids": True, **b})
                                          for b in bodies))

    results = asyncio.run(go())
    completion = sum(c for _, c in results)
    deadline = time.monotonic() + 15
    while True:  # late rounds of a request cut at a stop string reach the gateway after its response
        g1, v1 = _metrics(count_server)
        emitted = metric_total(v1, "dartree_emitted_tokens_total") - metric_total(v0, "dartree_emitted_tokens_total")
        discarded = (metric_total(g1, "dartree_discarded_tokens_total")
                     - metric_total(g0, "dartree_discarded_tokens_total"))
        if (_verifier_idle(count_server) and emitted == completion + discarded) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    rise = lambda text_, name, **kw: metric_total(v1 if text_ == "v" else g1, name, **kw) - metric_total(  # noqa: E731
        v0 if text_ == "v" else g0, name, **kw)
    assert rise("g", "dartree_generation_tokens_total") == completion
    assert emitted == completion + discarded, (emitted, completion, discarded)
    # only stop strings discard here (no client closed early); the tiny drafter's rounds are mostly one
    # token, so this may be 0 (tests/reliability/test_counter_reconciliation.py forces mid-round stops)
    assert discarded == rise("g", "dartree_discarded_tokens_total", reason="stop_string")
    assert rise("v", "dartree_emitted_tokens_total", phase="prefill") == len(bodies)
    tokens = rise("v", "dartree_spec_acceptance_length_sum")
    assert rise("v", "dartree_emitted_tokens_total", phase="round") == tokens
    rounds, cut = rise("v", "dartree_spec_rounds_total"), rise("v", "dartree_spec_cut_rounds_total")
    assert rounds + rise("v", "dartree_spec_accepted_tokens_total") == tokens + cut, (rounds, cut, tokens)
    assert rise("v", "dartree_spec_cut_rounds_total", reason="stop") >= 2  # the stop ids' rounds
    assert rise("v", "dartree_round_seconds_count", phase="total") == rounds
    assert rise("v", "dartree_step_seconds_count") == rise("v", "dartree_step_requests_count") > 0
    assert rise("v", "dartree_round_seconds_count", phase="step") == 0
