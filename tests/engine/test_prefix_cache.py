"""Prefix caching: a request that reuses a finished request's slot emits exactly the tokens of a
cold run (T = 0 and seeded T > 0), for every kind of hit, alone and in batched steps.

Oracle: the same request on a fresh engine with ``prefix_cache=False`` (a cold prefill of the whole
prompt); the reused slot's KV equals a fresh prefill of its committed tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.testing import tiny_drafter, tiny_eagle3, tiny_service, tiny_target
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import EngineConfig, SpecEngine
from services.verifier.kv_cache import SlotKVCache
from services.verifier.prefix_cache import PrefixCache, common_prefix
from tests.doubles import next_output
from tests.engine.conftest import TARGET_KW, V
from tests.engine.test_kv_compaction import assert_slot_equals_fresh_prefill

CHUNK = 8
METHODS = ["ar", "dartree-pruned", "ddtree", "domino"]


@pytest.fixture(scope="module")
def service(target):
    return tiny_service(target, tiny_drafter(target, seed=3, block_size=6))


def _engine(target, service, **cfg):
    cfg.setdefault("prefill_chunk", CHUNK)
    return SpecEngine(target, InprocDrafterClient(service), EngineConfig(**cfg), max_draft_depth=5)


def _trace(engine, rid, prompt, sampling, spec):
    """Tokens and ``(draft nodes, accepted)`` per round: equal traces = equal drafts accepted alike."""
    outs = list(engine.generate(rid, prompt, sampling, spec))
    return [t for out in outs for t in out.token_ids], [(o.num_draft_tokens, o.accept_length) for o in outs]


def _run(engine, rid, prompt, sampling, spec):
    return _trace(engine, rid, prompt, sampling, spec)[0]


def _cold(target, service, prompt, sampling, spec, trace=False):
    out = _trace(_engine(target, service, max_running=1, prefix_cache=False), "cold", prompt, sampling, spec)
    return out if trace else out[0]


def _prompt(rng, n):
    return [rng.randrange(3, V - 1) for _ in range(n)]


def _cached(engine):
    """``{slot: tokens}`` of every cached prefix."""
    cache = engine.runner.cache
    return {s: cache.prefix.entry(s).tokens for s in range(cache.num_slots) if cache.prefix.entry(s) is not None}


def _hit(engine, rid, prompt, sampling, spec):
    """Run a request; returns its tokens and the positions it reused."""
    stats = engine.runner.cache.prefix.stats
    before = stats.hit_tokens
    tokens = _run(engine, rid, prompt, sampling, spec)
    return tokens, stats.hit_tokens - before


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_kind_of_hit_equals_a_cold_run(target, service, method, temperature):
    rng = random.Random(7)
    spec = SpecParams(method, budget=6)
    sampling = SamplingParams(max_tokens=12, ignore_eos=True, temperature=temperature, seed=11)
    engine = _engine(target, service, max_running=2)
    engine.runner.cache.prefix.min_share = 0  # the longest match always, however short (test_weak_match_...)
    first = _prompt(rng, 21)
    out, hit = _hit(engine, "a", first, sampling, spec)
    assert hit == 0 and out == _cold(target, service, first, sampling, spec)
    (slot, committed), = _cached(engine).items()
    assert committed[:len(first)] == first and len(committed) >= len(first) + len(out) - 1

    cases = [
        ("turn", committed + _prompt(rng, 5), len(committed)),          # the next turn of a chat
        ("whole", list(committed), len(committed) - 1),                  # all but the last token
        ("diverge", committed[:13] + [(committed[13] + 1) % V] + _prompt(rng, 6), 13),  # across a chunk boundary
        ("short", committed[:3], 2),
        ("miss", [(committed[0] + 1) % V] + _prompt(rng, 9), 0),
    ]
    stats = engine.runner.cache.prefix.stats
    for name, prompt, want_hit in cases:
        cached_before = _cached(engine)
        before = stats.hit_tokens
        got = _trace(engine, name, prompt, sampling, spec)
        assert stats.hit_tokens - before == want_hit, name
        assert got == _cold(target, service, prompt, sampling, spec, trace=True), name  # drafts included
        if want_hit:  # the reusing request caches its own conversation in the slot it took
            assert any(t[:want_hit] == prompt[:want_hit] for t in _cached(engine).values())
        assert len(_cached(engine)) <= 2 and cached_before  # two slots, never more entries


def test_reused_slot_holds_a_fresh_prefill_of_its_tokens(llama):
    service = tiny_service(llama, tiny_drafter(llama, seed=3, block_size=6))
    rng = random.Random(1)
    engine = _engine(llama, service, max_running=1)
    sampling, spec = SamplingParams(max_tokens=9, ignore_eos=True), SpecParams("dartree-pruned", budget=6)
    _run(engine, "a", _prompt(rng, 17), sampling, spec)
    (slot, committed), = _cached(engine).items()
    _run(engine, "b", committed + _prompt(rng, 4), sampling, spec)
    (slot, committed), = _cached(engine).items()
    cache = engine.runner.cache
    assert cache.alloc_prefix(committed + [1])[:2] == (slot, len(committed))
    assert_slot_equals_fresh_prefill(llama, cache, slot, committed)


def test_batched_hits_mixed_with_cold_requests(target, service):
    from tests.engine.test_batched import _run_batched

    rng = random.Random(3)
    engine = _engine(target, service, max_running=4)
    engine.runner.cache.prefix.min_share = 0  # hit1's 11 shared tokens are a weak match
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    convs = []
    for i, method in enumerate(["dartree-pruned", "ar"]):
        prompt = _prompt(rng, 15 + 4 * i)
        _run(engine, f"warm{i}", prompt, sampling, SpecParams(method, budget=5))
    convs = list(_cached(engine).values())
    assert len(convs) == 2
    reqs = [("hit0", convs[0] + _prompt(rng, 3), SpecParams("ddtree", budget=7)),
            ("cold0", _prompt(rng, 25), SpecParams("dartree-pruned", budget=4)),
            ("hit1", convs[1][:11] + _prompt(rng, 9), SpecParams("domino")),
            ("cold1", _prompt(rng, 6), SpecParams("ar"))]
    stats = engine.runner.cache.prefix.stats
    before = stats.hit_tokens
    arrivals = {0: [(r, p, sampling, s) for r, p, s in reqs[:3]], 2: [(reqs[3][0], reqs[3][1], sampling, reqs[3][2])]}
    tokens, sizes = _run_batched(engine, arrivals)
    assert max(sizes) >= 3
    assert stats.hit_tokens - before == len(convs[0]) + 11
    for rid, prompt, spec in reqs:
        assert tokens[rid] == _cold(target, service, prompt, sampling, spec), rid


def test_a_running_request_is_never_evicted(llama):
    service = tiny_service(llama, tiny_drafter(llama, seed=3, block_size=6))
    rng = random.Random(5)
    engine = _engine(llama, service, max_running=2)
    sampling, spec = SamplingParams(max_tokens=8, ignore_eos=True), SpecParams("dartree-pruned", budget=6)
    a = _prompt(rng, 12)
    _run(engine, "a", a, sampling, spec)
    (slot_a, _), = _cached(engine).items()
    b = _prompt(rng, 20)
    engine.add_request("b", b, sampling, spec)  # takes the slot caching nothing
    slot_b = engine._reqs["b"].slot
    assert slot_b != slot_a and slot_a in _cached(engine)
    out = {"b": next_output(engine, "b").token_ids + next_output(engine, "b").token_ids, "c": []}
    stats = engine.runner.cache.prefix.stats
    engine.add_request("c", b + [5], sampling, spec)  # shares b's tokens: copied from b's running slot
    assert engine._reqs["c"].slot == slot_a and engine._reqs["c"].prefilled == stats.copied_tokens == len(b)
    assert stats.evictions == 1 and not _cached(engine)
    with pytest.raises(ValueError, match="KV slots are in use"):
        engine.add_request("d", b, sampling, spec)
    while engine.num_active():
        for rid, res in engine.step_batch([r for r in ("b", "c") if r in engine._reqs]).items():
            assert not isinstance(res, BaseException)
            out[rid] += res.token_ids if res is not None else []
    assert out["b"] == _cold(llama, service, b, sampling, spec)
    assert out["c"] == _cold(llama, service, b + [5], sampling, spec)


def test_an_aborted_request_leaves_nothing_reusable(llama):
    service = tiny_service(llama, tiny_drafter(llama, seed=3, block_size=6))
    rng = random.Random(9)
    engine = _engine(llama, service, max_running=1)
    sampling, spec = SamplingParams(max_tokens=20, ignore_eos=True), SpecParams("dartree-pruned", budget=6)
    a = _prompt(rng, 19)
    engine.add_request("a", a, sampling, spec)
    next_output(engine, "a")
    next_output(engine, "a")  # prefilled and one round committed
    engine.abort("a")
    assert not _cached(engine)
    engine.add_request("mid", a, sampling, spec)
    engine.step_batch(["mid"])  # one prompt chunk only
    engine.abort("mid")
    assert not _cached(engine)
    got, hit = _hit(engine, "b", a + [4, 5], sampling, spec)
    assert hit == 0 and got == _cold(llama, service, a + [4, 5], sampling, spec)


def test_no_prefix_cache_is_cold(llama):
    service = tiny_service(llama, tiny_drafter(llama, seed=3, block_size=6))
    engine = _engine(llama, service, max_running=2, prefix_cache=False)
    sampling, spec = SamplingParams(max_tokens=6, ignore_eos=True), SpecParams("ddtree", budget=6)
    prompt = _prompt(random.Random(2), 14)
    first, hit1 = _hit(engine, "a", prompt, sampling, spec)
    second, hit2 = _hit(engine, "b", prompt, sampling, spec)
    assert hit1 == hit2 == 0 and first == second and not _cached(engine)
    assert engine.runner.cache.prefix.stats.queried_tokens == 2 * len(prompt)


def test_metrics_count_queried_and_hit_tokens(llama):
    service = tiny_service(llama, tiny_drafter(llama, seed=3, block_size=6))
    engine = _engine(llama, service, max_running=1)
    sampling, spec = SamplingParams(max_tokens=5, ignore_eos=True), SpecParams("ar")
    prompt = _prompt(random.Random(4), 12)
    _run(engine, "a", prompt, sampling, spec)
    _run(engine, "b", prompt, sampling, spec)
    st = engine.runner.cache.prefix.stats
    assert (st.queried_tokens, st.hit_tokens, st.hits, st.evictions) == (24, 11, 1, 0)
    _run(engine, "c", [(prompt[0] + 1) % V] + prompt, sampling, spec)
    assert st.evictions == 1 and st.hits == 1


def test_eagle3_hit_equals_a_cold_run():
    target3 = tiny_target("llama", target_layer_ids=[0, 1, 2], **TARGET_KW)
    service = tiny_service(target3, tiny_eagle3(target3, seed=4, std=0.3))
    rng = random.Random(6)
    engine = _engine(target3, service, max_running=1)
    sampling, spec = SamplingParams(max_tokens=10, ignore_eos=True), SpecParams("eagle3")
    _run(engine, "a", _prompt(rng, 15), sampling, spec)
    (_, committed), = _cached(engine).items()
    for prompt in (committed + _prompt(rng, 4), committed[:9] + _prompt(rng, 8)):
        got, hit = _hit(engine, "b", prompt, sampling, spec)
        assert hit > 0 and got == _cold(target3, service, prompt, sampling, spec)


# ---------------------------------------------------------------------------------------------
# The slot choice on its own
# ---------------------------------------------------------------------------------------------

def test_common_prefix():
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2
    for n in range(40):
        a = list(range(50))
        b = a[:n] + [-1] + a[n + 1:]
        assert common_prefix(a, b) == n


def test_match_prefers_longest_then_least_recently_used():
    pc = PrefixCache()
    pc.store(0, [1, 2, 3, 4], None)
    pc.store(1, [1, 2, 9], None)
    pc.store(2, [1, 2, 3, 4], None)
    assert pc.match([0, 1, 2], [1, 2, 3, 4, 5], False) == (0, 4)  # longest; 0 older than 2
    assert pc.match([1, 2], [1, 2, 3, 4], False) == (2, 3)        # capped at len(prompt) - 1
    assert pc.match([0, 1, 2], [7, 7], False) == (0, 0)           # no match: LRU victim
    assert pc.match([0, 1], [1, 2, 3], True) == (0, 0)            # no features cached: no match
    assert pc.match([0], [1], False) == (0, 0)                    # a one-token prompt prefills it
    assert pc.stats.queried_tokens == 5 + 4 + 2 + 3 + 1 and pc.stats.hit_tokens == 7
    with pytest.raises(ValueError, match="feature rows"):
        pc.store(3, [1, 2], torch.zeros(3, 4))
    off = PrefixCache(enabled=False)
    off.store(0, [1, 2, 3], None)
    assert len(off) == 0 and off.match([0], [1, 2, 3], False) == (0, 0)


def test_weak_match_leaves_its_prefix_for_a_slot_caching_nothing():
    pc = PrefixCache()
    pc.store(0, [1, 2, 3, 4, 5, 6, 7, 8], None)   # a conversation
    pc.store(1, [1, 2, 9, 9], None)
    # shares 2 of 8 with slot 0 and 2 of 4 (= min_share) with slot 1: slot 1, slot 0 kept
    assert pc.match([0, 1, 2], [1, 2, 7], False) == (1, 2)
    # 3 of 8 shared with slot 0 only: below min_share, and slot 2 caches nothing
    assert pc.match([0, 2], [1, 2, 3, 0, 0], False) == (2, 0)
    # 4 of 8 = min_share: taken
    assert pc.match([0, 2], [1, 2, 3, 4, 0], False) == (0, 4)
    # a match of min_share (2 of slot 1's 4) beats a longer weak one (3 of slot 0's 8)
    assert pc.match([0, 1], [1, 2, 3, 0, 0], False) == (1, 2)
    # no slot caching nothing: the weak match beats evicting a prefix for nothing
    assert pc.match([0], [1, 2, 3, 0, 0], False) == (0, 3)
    assert pc.stats.hit_tokens == 2 + 4 + 2 + 3 and pc.stats.hits == 4


def test_slot_cache_alloc_prefers_empty_slots_then_lru():
    cache = SlotKVCache(1, 1, 2, 3, 16)
    s0, s1, s2 = cache.alloc(), cache.alloc(), cache.alloc()
    for s in (s0, s1, s2):
        cache.extend(s, 3)
    cache.free(s1, [5, 6, 7])
    cache.free(s0)                      # no tokens: caches nothing
    cache.free(s2, [5, 6])              # length mismatch: caches nothing
    assert len(cache.prefix) == 1
    assert cache.alloc() == s0          # an empty slot before evicting s1's prefix
    slot, reused, feats = cache.alloc_prefix([5, 6, 7, 8])
    assert (slot, reused, feats) == (s1, 3, None) and cache.length(s1) == 3
    cache.free(s1, [5, 6, 7])
    assert cache.alloc_prefix([9, 9])[:2] == (s2, 0)
    assert cache.alloc() == s1 and cache.prefix.stats.evictions == 1
    with pytest.raises(RuntimeError, match="in use"):
        cache.alloc_prefix([1])


def test_verifier_metrics_export_the_prefix_cache(llama):
    from services import metrics as m
    from services.verifier.worker import VerifierWorker, VerifierWorkerConfig
    from tests.service.fakes import verifier_info

    engine = SpecEngine(llama, None, EngineConfig(max_running=1, prefill_chunk=CHUNK))
    worker = VerifierWorker(engine, verifier_info(V), VerifierWorkerConfig(engine=EngineConfig(max_running=1)))
    sampling, spec = SamplingParams(max_tokens=4, ignore_eos=True), SpecParams("ar")
    prompt = _prompt(random.Random(4), 12)
    _run(engine, "a", prompt, sampling, spec)
    _run(engine, "b", prompt + [3], sampling, spec)
    worker._update_gauges()
    worker._update_gauges()  # counters advance by what changed: a second call adds nothing
    r = worker.metrics.registry
    assert r.get_sample_value(m.PREFIX_QUERIED) == 25
    assert r.get_sample_value(m.PREFIX_HITS) == 12
    assert r.get_sample_value(m.PREFIX_EVICTIONS) == 0
    assert r.get_sample_value(m.PREFIX_CACHED) == 12 + 1 + 4 - 1
    assert r.get_sample_value(m.PREFIX_BYTES) == 8 * (12 + 1 + 4 - 1)  # no drafter: token ids only
    _run(engine, "c", [(prompt[0] + 1) % V] * 3, sampling, spec)
    worker._update_gauges()
    assert r.get_sample_value(m.PREFIX_EVICTIONS) == 1


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_goodput_policy_with_a_hit_emits_the_cold_tokens(llama, temperature):
    from tests.engine.test_seeded_sampling import _goodput

    service = tiny_service(llama, tiny_drafter(llama, seed=3, block_size=6))
    rng = random.Random(12)
    sampling = SamplingParams(max_tokens=12, ignore_eos=True, temperature=temperature, seed=4)
    spec = SpecParams("dartree-pruned")
    engine = SpecEngine(llama, InprocDrafterClient(service), EngineConfig(max_running=2, prefill_chunk=CHUNK),
                        max_draft_depth=5, policy=_goodput())
    _run(engine, "a", _prompt(rng, 18), sampling, spec)
    (_, committed), = _cached(engine).items()
    prompt = committed + _prompt(rng, 5)
    got, hit = _hit(engine, "b", prompt, sampling, spec)
    cold = SpecEngine(llama, InprocDrafterClient(service),
                      EngineConfig(max_running=2, prefill_chunk=CHUNK, prefix_cache=False),
                      max_draft_depth=5, policy=_goodput())
    assert hit == len(committed) and got == _run(cold, "b", prompt, sampling, spec)


# ---------------------------------------------------------------------------------------------
# The memory bound (--prefix-cache-mib)
# ---------------------------------------------------------------------------------------------

def test_bound_evicts_least_recently_used_prefixes():
    from services.verifier.prefix_cache import ID_BYTES

    row = 4 * 4  # one float32 feature row of F = 4
    pc = PrefixCache(max_bytes=3 * (row + ID_BYTES) * 4)  # room for 12 positions
    feats = lambda n: torch.zeros(n, 4)  # noqa: E731
    pc.store(0, [1] * 4, feats(4))
    pc.store(1, [2] * 4, feats(4))
    pc.store(2, [3] * 4, feats(4))
    assert len(pc) == 3 and pc.nbytes() == 12 * (row + ID_BYTES) == pc.max_bytes
    pc.match([0, 1, 2], [1, 1, 1, 7], True)  # a lookup does not refresh; reuse re-stores
    pc.store(3, [4] * 2, feats(2))           # past the bound: the LRU prefix (slot 0) goes
    assert sorted(pc._entries) == [1, 2, 3] and pc.stats.evictions == pc.stats.bound_evictions == 1
    pc.store(1, [2] * 4, feats(4))           # re-stored: most recent, no eviction
    pc.store(0, [5] * 3, feats(3))           # evicts slot 2 (now the least recently used)
    assert sorted(pc._entries) == [0, 1, 3] and pc.nbytes() == 9 * (row + ID_BYTES)
    pc.store(4, [6] * 13, feats(13))         # larger than the bound alone: evicts all, keeps nothing
    assert len(pc) == 0 and pc.nbytes() == 0 and pc.stats.bound_evictions == 6  # 3 others + itself
    pc.store(0, [1] * 4, feats(4))
    pc.store(1, [2] * 4, None)               # no features: ids only
    assert pc.nbytes() == 4 * (row + ID_BYTES) + 4 * ID_BYTES
    pc.max_bytes = 4 * ID_BYTES              # a lower bound evicts at once (slot 0 is older)
    assert list(pc._entries) == [1] and pc.nbytes() == 4 * ID_BYTES
    pc.drop(1)
    assert pc.nbytes() == 0
    pc.max_bytes = 0
    pc.store(0, [1], None)
    assert len(pc) == 0
    with pytest.raises(ValueError, match=">= 0"):
        PrefixCache(max_bytes=-1)


@pytest.mark.parametrize("method", ["dartree-pruned", "ar"])
def test_bounded_cache_stays_within_its_bound_and_keeps_the_tokens(target, service, method):
    """Three conversations take turns on three slots under a bound that holds one conversation but
    never two: every store past the first evicts, the footprint never exceeds the bound, the most
    recent conversation still hits in full, and every request emits the tokens of a cold run."""
    rng = random.Random(21)
    sampling, spec = SamplingParams(max_tokens=8, ignore_eos=True), SpecParams(method, budget=6)
    engine = _engine(target, service, max_running=3)
    pc = engine.runner.cache.prefix
    per_position = target.feature_dim * 4 + 8  # float32 feature row + id (a drafter is configured)
    pc.max_bytes = 70 * per_position  # conversations hold 37..66 positions: one fits, two never do
    convs = [_prompt(rng, 30 + 3 * i) for i in range(3)]
    for turn in range(3):
        for i in range(3):
            prompt = convs[i]
            got, hit = _hit(engine, f"{i}-{turn}", prompt, sampling, spec)
            assert hit == 0 and got == _cold(target, service, prompt, sampling, spec), (i, turn)
            (slot, cached), = _cached(engine).items()  # only this request's conversation is kept
            assert cached[:len(prompt)] == prompt and pc.nbytes() == len(cached) * per_position <= pc.max_bytes
            convs[i] = cached + _prompt(rng, 3)  # the next turn resends the conversation
    assert pc.stats.bound_evictions == pc.stats.evictions == 8
    got, hit = _hit(engine, "last", convs[2], sampling, spec)  # the latest conversation hits in full
    assert hit == len(convs[2]) - 3 and got == _cold(target, service, convs[2], sampling, spec)


def test_startup_prints_the_prefix_cache_bound():
    from services.startup import prefix_cache_part

    pc = PrefixCache(max_bytes=256 * 2**20)
    pc.store(0, [1, 2], torch.zeros(2, 2**17))  # 1 MiB of features
    assert prefix_cache_part(pc) == "1 MB of <= 256 MB"
    assert prefix_cache_part(PrefixCache()) == "0 MB of no bound"
    assert prefix_cache_part(PrefixCache(enabled=False)) == "off"


def test_prefix_cache_mib_flag():
    import argparse

    from services.config_cli import add_config_args, config_from_args
    from services.verifier.worker import VerifierWorkerConfig

    parser = argparse.ArgumentParser()
    add_config_args(parser, VerifierWorkerConfig)
    assert config_from_args(VerifierWorkerConfig, parser.parse_args([])).prefix_cache_mib == 256
    cfg = config_from_args(VerifierWorkerConfig, parser.parse_args(["--prefix-cache-mib", "64"]))
    assert cfg.prefix_cache_mib == 64
    assert "--prefix-cache-mib" in parser.format_help()
    with pytest.raises(ValueError, match="prefix_cache_mib"):
        VerifierWorkerConfig(prefix_cache_mib=-1)
