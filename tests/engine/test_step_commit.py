"""A step's decode rounds committed on the device (services/verifier/step_commit.py): one host read of
tensor values per step between the forward and the next drafts, and the same tokens as the host walk
and per-slot commit (EngineConfig(device_walk=False)), batched, at T = 0 and T > 0."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from services import hf_compat
from services.params import SamplingParams, SpecParams
from services.testing import tiny_drafter, tiny_service
from services.verifier.drafter_client import InprocDrafterClient
from services.verifier.engine import EngineConfig, SpecEngine
from tests.engine.conftest import V

# every Python-level read of a tensor's value (what copies device memory to the host on CUDA)
_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")


@contextlib.contextmanager
def _count_reads(engine: SpecEngine):
    """Count tensor value reads from the moment each step's forward returns until the engine submits
    the next drafts (the commit phase); ``counts`` gets one entry per step."""
    counts: list[int] = []
    state = {"on": False}
    saved = {n: getattr(torch.Tensor, n) for n in _READS}

    def counting(name):
        def f(self, *a, **k):
            if state["on"]:
                counts[-1] += 1
            return saved[name](self, *a, **k)
        return f

    execute, submit = engine.runner.execute, engine.drafts.submit

    def execute_then_count(*a, **k):
        out = execute(*a, **k)
        counts.append(0)
        state["on"] = True
        return out

    def submit_uncounted(*a, **k):
        state["on"] = False
        return submit(*a, **k)

    engine.runner.execute, engine.drafts.submit = execute_then_count, submit_uncounted
    for n in _READS:
        setattr(torch.Tensor, n, counting(n))
    try:
        yield counts
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        engine.runner.execute, engine.drafts.submit = execute, submit


@pytest.fixture(scope="module")
def service(llama):
    return tiny_service(llama, tiny_drafter(llama, seed=3, block_size=6))


def _requests(seed: int):
    """Greedy and seeded T > 0 (top-p, top-k) trees and chains, a penalty round and a plain ``ar``."""
    rng = random.Random(seed)
    kinds = [(SamplingParams(max_tokens=20, ignore_eos=True), SpecParams("dartree-pruned", budget=9, width=3)),
             (SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7),
              SpecParams("dartree-pruned")),
             (SamplingParams(max_tokens=14, ignore_eos=True, temperature=1.2, top_k=20, seed=3), SpecParams("domino")),
             (SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.3), SpecParams("dartree-fixed")),
             (SamplingParams(max_tokens=10, ignore_eos=True), SpecParams("ar"))]
    return [(f"r{i}", [rng.randrange(3, V - 1) for _ in range(rng.randrange(3, 20))], s, p)
            for i, (s, p) in enumerate(kinds)]


def _run(engine: SpecEngine, reqs, on_step=None):
    """Every request added at once and stepped together; ``{rid: (tokens, accept lengths)}``."""
    got = {rid: ([], []) for rid, *_ in reqs}
    for rid, prompt, sampling, spec in reqs:
        engine.add_request(rid, prompt, sampling, spec)
    active = [rid for rid, *_ in reqs]
    while active:
        res = engine.step_batch(list(active))
        if on_step is not None:
            on_step(res)
        for rid, out in res.items():
            assert not isinstance(out, BaseException), out
            if out is None:
                continue
            got[rid][0].extend(out.token_ids)
            got[rid][1].append(out.accept_length)
            if out.finish_reason is not None:
                active.remove(rid)
    return got


def _engine(llama, service, device_walk: bool) -> SpecEngine:
    return SpecEngine(llama, InprocDrafterClient(service), EngineConfig(max_running=5, device_walk=device_walk,
                                                                        prefix_cache=False), max_draft_depth=5)


def test_a_step_reads_the_device_once(llama, service):
    """Between a step's forward and the next drafts the engine reads one tensor (the packed walk)
    however many rounds share the step, plus one per prompt that emits its first token (the penalty
    request is left out: its penalties read more, see services/verifier/step_commit.py)."""
    engine = _engine(llama, service, device_walk=True)
    steps = []
    with _count_reads(engine) as counts:
        got = _run(engine, [r for r in _requests(0) if r[0] != "r3"], on_step=lambda res: steps.append(
            (sum(1 for o in res.values() if o is not None and o.is_prefill),
             sum(1 for o in res.values() if o is not None and not o.is_prefill), engine.last_step)))
    assert len(counts) == len(steps)
    decode_steps = 0
    for n, (prefills, rounds, st) in zip(counts, steps):
        assert n == int(rounds > 0) + prefills, (n, rounds, prefills)
        assert st.device_rounds == st.decoding == rounds and st.round_reads == int(rounds > 0)
        decode_steps += rounds >= 3
    assert decode_steps >= 3  # several rounds really shared steps
    assert any(sum(acc) > 0 for _, acc in got.values())  # and drafts were accepted


def test_counter_sees_a_read_in_the_commit_phase(llama, service, monkeypatch):
    """The read counter is live: an extra ``.tolist()`` of the logits after the forward is counted."""
    engine = _engine(llama, service, device_walk=True)
    finish = engine._finish
    monkeypatch.setattr(engine, "_finish", lambda item, logits, feats, c=None: (
        logits[:1, :1].tolist(), finish(item, logits, feats, c))[1])
    with _count_reads(engine) as counts:
        _run(engine, _requests(1)[:1])
    assert counts and all(n >= 2 for n in counts)


@pytest.mark.parametrize("seed", [0, 1])
def test_device_commit_equals_host_walk_and_commit(llama, service, seed):
    """The same batched requests with the device commit and with the host walk + per-slot commit:
    identical tokens and accept lengths, and every slot equals a fresh prefill of its tokens."""
    reqs = _requests(seed)
    host = _run(_engine(llama, service, device_walk=False), reqs)
    dev_engine = _engine(llama, service, device_walk=True)
    slots = {}
    orig = dev_engine.add_request

    def add(rid, prompt, sampling, spec):
        orig(rid, prompt, sampling, spec)
        slots[rid] = (dev_engine._reqs[rid], prompt)

    dev_engine.add_request = add
    dev = _run(dev_engine, reqs)
    assert dev == host
    assert any(sum(acc) > 0 for _, acc in dev.values())
    cache = dev_engine.runner.cache
    for rid, (req, prompt) in slots.items():  # a freed slot keeps its columns: the committed KV
        fresh = llama.new_cache()
        llama.prefill(req.hist_ids, fresh)
        n = len(req.hist_ids)
        for i, (fk, fv) in enumerate(hf_compat.cache_layers(fresh)):
            torch.testing.assert_close(cache.keys[i][req.slot, :, :n], fk[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(cache.values[i][req.slot, :, :n], fv[0], atol=1e-5, rtol=0)


def test_the_walk_follows_the_device_unless_set(llama, service):
    """``device_walk=None`` (the default): a CPU target's rounds walk and commit on the host (no
    round read of the packed walk); True / False set it on any device."""
    engine = SpecEngine(llama, InprocDrafterClient(service), EngineConfig(max_running=5, prefix_cache=False),
                        max_draft_depth=5)
    assert EngineConfig().device_walk is None and engine.device_walk is False
    steps = []
    _run(engine, _requests(0)[:2], on_step=lambda res: steps.append(engine.last_step))
    assert sum(st.decoding for st in steps) > 0
    assert all(st.device_rounds == 0 and st.round_reads == 0 for st in steps)
    assert _engine(llama, service, device_walk=True).device_walk is True
