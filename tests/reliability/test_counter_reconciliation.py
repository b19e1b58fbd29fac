"""The counters reconcile (docs/serving.md "Metrics", reconciliation rules) under batching, stop
strings, EOS, stop ids and ``max_tokens``, on the real gateway app over an in-process verifier worker
running ``SpecEngine`` with a scripted drafter (every round accepts its full depth, so every round
emits ``D + 1`` tokens unless a cut ends it and a stop string lands inside a round).

Nine requests of the same prompt run concurrently (five non-streamed, four streamed), batched by
the verifier; the rules checked over their window:

1. sum(usage.completion_tokens) == rise(dartree_generation_tokens_total)
2. rise(dartree_emitted_tokens_total) == sum(completion_tokens) + rise(dartree_discarded_tokens_total)
3. rise(emitted{phase="prefill"}) == requests; rise(emitted{phase="round"}) == rise(acceptance_length_sum)
4. rise(rounds_total) + rise(accepted_tokens_total) == rise(acceptance_length_sum) + rise(cut_rounds_total),
   with cut rounds exactly those the terminators and ``max_tokens`` cut before their bonus token
5. one ``dartree_round_seconds{phase="total"}`` observation per round, one ``dartree_step_seconds``
   per batched step, and no per-step observation in ``dartree_round_seconds``
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from .test_commit_semantics import D, TextStack, _sse, expected_engine, expected_rounds, text_reference


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tests.service.fakes import bytelevel_model_dir

    s = TextStack(bytelevel_model_dir(tmp_path_factory.mktemp("reconcile")))
    yield s
    s.close()


def _first_at(ref: list[int], lo: int, hi: int, avoid: set[int]) -> int:
    """The first index in [lo, hi) whose token appears nowhere before it and is not in ``avoid``."""
    return next(i for i in range(lo, hi) if ref.index(ref[i]) == i and ref[i] not in avoid)


def _mid_round_stop(stack, prompt: list[int], ref: list[int], limit: int) -> tuple[str, int]:
    """A stop string cut from the text whose match keeps ``k < limit`` tokens, the last of them
    inside a round (round r emits tokens ``1 + (r - 1)(D + 1)`` .. ``r (D + 1)``): the rest of that
    round reaches no client."""
    full, _, _ = text_reference(stack.text, prompt, ref[:limit], [])
    for a in range(len(full) - 1):
        stop = full[a:a + 2]
        if "\ufffd" in stop or not stop.strip():
            continue
        _, kept, matched = text_reference(stack.text, prompt, ref[:limit], [stop])
        if matched is not None and 2 <= kept < limit and (kept - 1) % (D + 1) != 0:
            return stop, kept
    pytest.fail("no stop string ends inside a round")


def _snapshot(*registries) -> list[tuple[str, dict, float]]:
    return [(smp.name, smp.labels, smp.value) for r in registries for m in r.collect() for smp in m.samples]


def _total(snap, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in snap if n == name and all(lab.get(k) == x for k, x in labels.items()))


def test_counters_reconcile_under_batching_stop_strings_and_eos(stack):
    prompt, ref = stack.cases[1]
    eos_at = _first_at(ref, 14, 30, set())
    stop_at = _first_at(ref, 8, eos_at, {ref[eos_at]})
    stop, kept = _mid_round_stop(stack, prompt, ref, stop_at)
    eos, stop_id = ref[eos_at], ref[stop_at]
    ignore = {"ignore_eos": True}
    # (body, the engine's cut: (max_tokens, ignore_eos, stop ids), or None for a stop-string request)
    plans = [({"max_tokens": 9}, (9, False, set())),
             ({"max_tokens": 13, "stream": True}, (13, False, set())),
             ({"max_tokens": 32}, (32, False, set())),
             ({"max_tokens": 32, "stream": True}, (32, False, set())),
             ({"max_tokens": 32, "stop_token_ids": [stop_id]}, (32, False, {stop_id})),
             ({"max_tokens": 32, "stop_token_ids": [stop_id], "stream": True, **ignore}, (32, True, {stop_id})),
             ({"max_tokens": 30, **ignore}, (30, True, set())),
             ({"max_tokens": 31, "stop": [stop], **ignore}, None),  # 31 = 1 + 5 (D + 1): never a cut round
             ({"max_tokens": 31, "stop": [stop], "stream": True, **ignore}, None)]
    stack.engine.eos_token_ids = (eos,)
    stack.drafter.set_script([], prompt + ref)
    registries = (stack.worker.metrics.registry, stack.app.state.gateway.metrics.registry)
    before = _snapshot(*registries)

    async def one(c, body) -> int:
        r = await c.post("/v1/completions", json={
            "model": "tiny", "prompt": prompt, "temperature": 0, "speculative": {"method": "dartree-pruned"},
            **body, **({"stream_options": {"include_usage": True}} if body.get("stream") else {})})
        assert r.status_code == 200, r.text
        return (_sse(r.text)[-1] if body.get("stream") else r.json())["usage"]["completion_tokens"]

    async def go():
        await stack.client.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=stack.app), base_url="http://t",
                                     timeout=60) as c:
            return await asyncio.gather(*(one(c, b) for b, _ in plans))

    results = asyncio.run(go())
    for _ in range(300):  # the verifier frees a stop-string request at its next round boundary
        if stack.engine.num_active() == 0:
            break
        threading.Event().wait(0.01)
    threading.Event().wait(0.2)  # the late rounds of those requests reach the gateway's client
    after = _snapshot(*registries)
    rise = lambda name, **kw: _total(after, name, **kw) - _total(before, name, **kw)  # noqa: E731
    completion = sum(results)

    expected_cut = {"stop": 0, "length": 0}
    for (body, cut), got in zip(plans, results):
        if cut is None:
            assert got == kept, (body, got, kept)
            continue
        ids, finish = expected_engine(ref, cut[0], None if cut[1] else eos, cut[2], cut[1])
        assert got == len(ids), (body, got, len(ids))
        last_emit, last_acc = expected_rounds(len(ids), [], finish)[-1]
        expected_cut[finish] += last_emit == last_acc
    assert expected_cut["stop"] >= 3 and expected_cut["length"] >= 1  # the plan cuts rounds both ways

    tokens, rounds = rise("dartree_spec_acceptance_length_sum"), rise("dartree_spec_rounds_total")
    assert rise("dartree_generation_tokens_total") == completion                                        # 1
    assert rise("dartree_emitted_tokens_total") == completion + rise("dartree_discarded_tokens_total")  # 2
    # each stop-string request: at least the rest of the round its stop string ended in
    assert rise("dartree_discarded_tokens_total", reason="stop_string") >= 2 * (D + 1 - (kept - 1) % (D + 1))
    assert rise("dartree_emitted_tokens_total", phase="prefill") == len(plans)                          # 3
    assert rise("dartree_emitted_tokens_total", phase="round") == tokens
    assert rounds + rise("dartree_spec_accepted_tokens_total") == tokens + rise("dartree_spec_cut_rounds_total")  # 4
    assert rise("dartree_spec_cut_rounds_total", reason="stop") == expected_cut["stop"]
    assert rise("dartree_spec_cut_rounds_total", reason="length") == expected_cut["length"]
    assert rise("dartree_round_seconds_count", phase="total") == rounds                                 # 5
    assert rise("dartree_step_seconds_count") == rise("dartree_step_requests_count") > 0
    assert rise("dartree_round_seconds_count", phase="step") == 0
    assert rise("dartree_step_requests_count") < rounds  # batched: several requests' rounds share a step
