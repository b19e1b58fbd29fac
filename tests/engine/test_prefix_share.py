"""Prefix sharing across slots: a request that copies another slot's committed leading columns, or
waits for another request's prefill of the same prompt (``n`` choices), emits exactly the tokens of
a cold run (T = 0 and seeded T > 0), alone and in batched steps mixed with cold requests.

Oracles: the same request on a fresh engine with ``prefix_cache=False`` (a cold prefill of the whole
prompt, same seed); a copied slot's KV equals a fresh HF prefill of its tokens; the prompt rows the
engine's steps prefilled (``StepStats.prefill_tokens``).
"""

from __future__ import annotations

import random

import pytest

from services.testing import tiny_drafter, tiny_service
from services.params import SamplingParams, SpecParams
from services.verifier.kv_cache import SlotKVCache
from services.verifier.prefix_cache import Placement
from tests.doubles import next_output
from tests.engine.test_kv_compaction import assert_slot_equals_fresh_prefill
from tests.engine.test_prefix_cache import CHUNK, METHODS, _cached, _cold, _engine, _prompt, _run


@pytest.fixture(scope="module")
def service(target):
    return tiny_service(target, tiny_drafter(target, seed=3, block_size=6))


def _steps(engine, arrivals, running=(), max_steps=400):
    """Step every active request together (``running``: requests added before, stepped too);
    ``arrivals[k]`` = ``(rid, prompt, sampling, spec)`` added before step ``k``, or ``("abort", rid)``.
    Returns ``({rid: tokens}, prompt rows the steps prefilled)``."""
    tokens: dict[str, list[int]] = {rid: [] for rid in running}
    active: list[str] = list(running)
    prefilled = 0
    for k in range(max_steps):
        for a in arrivals.get(k, []):
            if a[0] == "abort":
                engine.abort(a[1])
                active.remove(a[1])
                tokens.pop(a[1])
                continue
            engine.add_request(*a)
            tokens[a[0]] = []
            active.append(a[0])
        if not active and k > max(arrivals):
            return tokens, prefilled
        if not active:
            continue
        last = engine.last_step
        res = engine.step_batch(list(active))
        prefilled += engine.last_step.prefill_tokens if engine.last_step is not last else 0
        for rid, out in res.items():
            assert not isinstance(out, BaseException), out
            if out is not None:
                tokens[rid] += out.token_ids
                if out.finish_reason is not None:
                    active.remove(rid)
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_copied_prefixes_equal_a_cold_run(target, service, method, temperature):
    """A source request runs (decodes) while others copy its committed columns: part of its prompt
    (across a chunk boundary), its whole prompt but the last token, its prompt plus decoded tokens;
    one more waits for a cold request's prefill to commit the 30 positions they share, then copies
    them. All run in batched steps with cold requests; every request, the source included, emits
    a cold run's tokens."""
    rng = random.Random(17)
    spec = SpecParams(method, budget=6)
    sampling = SamplingParams(max_tokens=14, ignore_eos=True, temperature=temperature, seed=5)
    engine = _engine(target, service, max_running=7)
    pc = engine.runner.cache.prefix
    pc.min_copy = 2
    src = _prompt(rng, 21)
    src_sampling = SamplingParams(max_tokens=60, ignore_eos=True, temperature=temperature, seed=5)
    engine.add_request("src", src, src_sampling, spec)
    src_tokens = [t for _ in range(5) for t in next_output(engine, "src").token_ids]  # prefill + 4 rounds
    committed = list(engine._reqs["src"].hist_ids)
    assert len(committed) > len(src) and engine.runner.cache.length(engine._reqs["src"].slot) == len(committed)
    long_cold = _prompt(rng, 40)
    reqs = {"partial": (src[:13] + _prompt(rng, 6), 13),
            "whole": (list(src), len(src) - 1),
            "decoded": (committed + _prompt(rng, 3), len(committed)),
            "cold": (_prompt(rng, 11), 0),
            "long": (long_cold, 0),
            "waits": (long_cold[:30] + _prompt(rng, 5), 30)}
    arrivals = {0: [(r, reqs[r][0], sampling, spec) for r in ("partial", "whole", "decoded", "cold", "long")],
                1: [("waits", reqs["waits"][0], sampling, spec)]}
    before = (pc.stats.copied_tokens, pc.stats.waits)
    tokens, _ = _steps(engine, arrivals, running=["src"])  # the source decodes while copied from
    assert pc.stats.copied_tokens - before[0] == sum(n for _, n in reqs.values())
    assert pc.stats.waits - before[1] == 1
    for rid, (prompt, _) in reqs.items():
        assert tokens[rid] == _cold(target, service, prompt, sampling, spec), rid
    assert src_tokens + tokens["src"] == _cold(target, service, src, src_sampling, spec)


def test_copied_slot_holds_a_fresh_prefill_of_its_tokens(llama):
    service = tiny_service(llama, tiny_drafter(llama, seed=3, block_size=6))
    rng = random.Random(2)
    engine = _engine(llama, service, max_running=2)
    sampling, spec = SamplingParams(max_tokens=20, ignore_eos=True), SpecParams("dartree-pruned", budget=6)
    prompt = _prompt(rng, 19)
    engine.add_request("a", prompt, sampling, spec)
    for _ in range(4):
        next_output(engine, "a")
    committed = list(engine._reqs["a"].hist_ids)
    cache = engine.runner.cache
    slot = cache.free_slots()[0]
    cache.take(Placement(slot))
    assert cache.copy_prefix(engine._reqs["a"].slot, slot, len(committed)) is None  # a running source
    assert_slot_equals_fresh_prefill(llama, cache, slot, committed)


def test_copy_never_reads_uncommitted_columns():
    cache = SlotKVCache(2, 1, 2, 4, 16)
    a, b = cache.alloc(), cache.alloc()
    cache.extend(a, 5)
    with pytest.raises(ValueError, match="holds 5 committed"):
        cache.copy_prefix(a, b, 6)    # column 5 on is a running slot's speculative area
    cache.free(a, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="holds 5 committed"):
        cache.copy_prefix(a, b, 6)    # a free slot: its cached prefix only
    c = cache.alloc()
    with pytest.raises(ValueError, match="holds 0 committed"):
        cache.copy_prefix(3, b, 1)    # a free slot caching nothing
    cache.extend(c, 2)
    with pytest.raises(ValueError, match="must be taken, empty"):
        cache.copy_prefix(a, c, 2)    # the destination holds positions
    assert cache.copy_prefix(a, b, 5) is None and cache.length(b) == 5
    assert cache.prefix.stats.copied_tokens == 5 and cache.prefix.stats.copies == 1


def test_weak_match_is_copied_into_a_slot_caching_nothing(target, service):
    """A new conversation sharing only part of a cached one (under ``min_share`` of it) copies that
    part into a slot caching nothing: both conversations stay cached, tokens equal a cold run."""
    rng = random.Random(8)
    engine = _engine(target, service, max_running=2)
    pc = engine.runner.cache.prefix
    pc.min_copy = 4
    sampling, spec = SamplingParams(max_tokens=10, ignore_eos=True), SpecParams("dartree-pruned", budget=6)
    _run(engine, "a", _prompt(rng, 30), sampling, spec)
    (_, conv), = _cached(engine).items()
    prompt = conv[:12] + _prompt(rng, 7)   # 12 of ~39 cached positions: a weak match
    got = _run(engine, "b", prompt, sampling, spec)
    assert pc.stats.copied_tokens == 12 and pc.stats.evictions == 0
    assert got == _cold(target, service, prompt, sampling, spec)
    assert sorted(len(t) for t in _cached(engine).values()) == sorted([len(conv), len(prompt) + len(got) - 1])


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_n_choices_prefill_the_prompt_once(target, service, temperature):
    """``n = 3`` choices (``gateway.requests.choice_requests``: one engine request each, admitted
    together, seeds ``seed + i``): the first prefills the prompt, the other two wait for it, copy its
    24 - 1 positions and prefill only the last token; each equals its own cold run. A later burst
    reuses cached slots in place, or copies a choice's committed prompt when one slot caches it."""
    rng = random.Random(31)
    engine = _engine(target, service, max_running=4)
    spec = SpecParams("dartree-pruned", budget=6)
    prompt = _prompt(rng, 24)
    st = engine.runner.cache.prefix.stats
    seeds = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=temperature, seed=40 + i) for i in range(3)]
    colds = [_cold(target, service, prompt, s, spec) for s in seeds]

    def choices(tag):
        before = (st.hit_tokens, st.copied_tokens, st.waits)
        tokens, rows = _steps(engine, {0: [(f"{tag}-{i}", prompt, s, spec) for i, s in enumerate(seeds)]})
        assert [tokens[f"{tag}-{i}"] for i in range(3)] == colds, tag
        return rows, st.hit_tokens - before[0], st.copied_tokens - before[1], st.waits - before[2]

    assert choices("first") == (len(prompt) + 2, 2 * (len(prompt) - 1), 2 * (len(prompt) - 1), 2)
    assert choices("again") == (3, 3 * (len(prompt) - 1), 0, 0)   # three slots cache it: in place
    for slot in range(4):
        engine.runner.cache.prefix.drop(slot)
    _run(engine, "one", prompt, seeds[0], spec)                    # one slot caches the prompt
    assert choices("after-one") == (3, 3 * (len(prompt) - 1), 2 * (len(prompt) - 1), 0)


def test_choice_aborted_mid_prefill_leaves_the_others_correct(target, service):
    """The first of three identical requests is aborted after one prompt chunk: the second prefills
    the prompt itself (nothing the aborted one wrote is read), the third waits for it and copies
    (two requests waited: the third twice)."""
    rng = random.Random(4)
    engine = _engine(target, service, max_running=3)
    st = engine.runner.cache.prefix.stats
    sampling, spec = SamplingParams(max_tokens=8, ignore_eos=True), SpecParams("ddtree", budget=6)
    prompt = _prompt(rng, 30)
    arrivals = {0: [(f"c{i}", prompt, sampling, spec) for i in range(3)], 1: [("abort", "c0")]}
    tokens, rows = _steps(engine, arrivals)
    cold = _cold(target, service, prompt, sampling, spec)
    assert tokens == {"c1": cold, "c2": cold}
    assert rows == CHUNK + len(prompt) + 1 and st.copied_tokens == len(prompt) - 1 and st.waits == 2


def test_metrics_export_copied_tokens_and_waits(llama):
    from services import metrics as m
    from services.verifier.engine import EngineConfig, SpecEngine
    from services.verifier.worker import VerifierWorker, VerifierWorkerConfig
    from tests.service.fakes import verifier_info

    engine = SpecEngine(llama, None, EngineConfig(max_running=3, prefill_chunk=CHUNK))
    worker = VerifierWorker(engine, verifier_info(3), VerifierWorkerConfig(engine=EngineConfig(max_running=3)))
    sampling, spec = SamplingParams(max_tokens=4, ignore_eos=True), SpecParams("ar")
    prompt = _prompt(random.Random(4), 20)
    _steps(engine, {0: [(f"n{i}", prompt, sampling, spec) for i in range(3)]})
    worker._update_gauges()
    worker._update_gauges()
    r = worker.metrics.registry
    assert r.get_sample_value(m.PREFIX_COPIED) == 2 * 19 and r.get_sample_value(m.PREFIX_WAITS) == 2
    assert r.get_sample_value(m.PREFIX_HITS) == 2 * 19 and r.get_sample_value(m.PREFIX_QUERIED) == 60


@pytest.mark.parametrize("overlap", [False, True])
def test_worker_serves_n_choices_with_one_prefill(llama, overlap):
    """Through the verifier worker (with ``overlap``, waiting choices and their leader sit in the two
    groups that take turns): three choices as the gateway sends them (``choice_requests``: ids
    ``x-i``, seeds ``seed + i``) prefill the prompt once and each equals its own cold run."""
    from services import metrics as m
    from services import protocol as p
    from services.verifier.engine import EngineConfig, SpecEngine
    from services.verifier.worker import VerifierWorker, VerifierWorkerConfig
    from services.verifier.drafter_client import InprocDrafterClient
    from tests.service.fakes import verifier_info

    service = tiny_service(llama, tiny_drafter(llama, seed=3, block_size=6))
    engine = SpecEngine(llama, InprocDrafterClient(service),
                        EngineConfig(max_running=3, prefill_chunk=CHUNK, overlap=overlap), max_draft_depth=5)
    sent: list = []
    worker = VerifierWorker(engine, verifier_info(3), VerifierWorkerConfig(engine=EngineConfig(max_running=3, overlap=overlap)),
                            send=lambda identity, msg: sent.append(msg))
    prompt = _prompt(random.Random(9), 26)
    for i in range(3):
        worker.post(b"c", p.Generate(f"x-{i}", prompt, p.SamplingParams(max_tokens=7, temperature=0.9, seed=20 + i,
                                                                       ignore_eos=True),
                                     p.SpecParams("dartree-pruned", budget=6)))
    for _ in range(200):
        worker.run_once(idle_timeout=0)
        if not worker._has_work():
            break
    tokens = {f"x-{i}": [] for i in range(3)}
    for msg in sent:
        assert isinstance(msg, p.RoundChunk), msg
        tokens[msg.request_id] += list(msg.token_ids)
    spec = SpecParams("dartree-pruned", budget=6)
    for i in range(3):
        sampling = SamplingParams(max_tokens=7, temperature=0.9, seed=20 + i, ignore_eos=True)
        assert tokens[f"x-{i}"] == _cold(llama, service, prompt, sampling, spec), i
    r = worker.metrics.registry
    assert r.get_sample_value(m.PREFILL_CHUNK_TOKENS) == len(prompt) + 2
    assert r.get_sample_value(m.PREFIX_WAITS) == 2 and r.get_sample_value(m.PREFIX_COPIED) == 2 * (len(prompt) - 1)
