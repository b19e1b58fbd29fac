"""The host-RAM store of prefixes evicted from their KV slot (``--prefix-cache-ram-mib``).

Oracles: a cold run of the same request on a fresh engine without the prefix cache (tokens, and the
drafts and acceptance of every round); the restored slot's KV equals a fresh HF prefill of its
tokens; the prompt rows the engine's steps prefilled (``StepStats.prefill_tokens``); the saved KV
and features compared with what the slot held.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.params import SamplingParams, SpecParams
from services.testing import tiny_drafter, tiny_service
from services.verifier.kv_cache import SlotKVCache
from services.verifier.prefix_cache import Placement, PrefixCache
from services.verifier.prefix_store import ID_BYTES, MIN_STORED_TOKENS, PrefixStore
from tests.engine.test_kv_compaction import assert_slot_equals_fresh_prefill
from tests.engine.test_prefix_cache import _cached, _cold, _engine, _prompt, _trace
from tests.engine.test_prefix_share import _steps


@pytest.fixture(scope="module")
def service(llama):
    return tiny_service(llama, tiny_drafter(llama, seed=3, block_size=6))


def _ram_engine(target, service, mib=64, max_running=2):
    engine = _engine(target, service, max_running=max_running)
    ram = engine.runner.cache.prefix.ram
    ram.max_bytes, ram.min_tokens = mib * 2**20, 16
    return engine


@pytest.mark.parametrize("method", ["ar", "dartree-pruned"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_an_evicted_prefix_is_restored_from_ram(llama, service, method, temperature):
    """A finished conversation is evicted by two concurrent requests (every slot in use); its next
    turn copies the conversation back from RAM and prefills only the new tokens, with a cold run's
    tokens, drafts and acceptance; the restored slot holds a fresh prefill's KV."""
    rng = random.Random(11)
    spec = SpecParams(method, budget=6)
    sampling = SamplingParams(max_tokens=10, ignore_eos=True, temperature=temperature, seed=3)
    engine = _ram_engine(llama, service)
    pc, cache = engine.runner.cache.prefix, engine.runner.cache
    first = _prompt(rng, 40)
    assert _trace(engine, "a", first, sampling, spec)[0] == _cold(llama, service, first, sampling, spec)
    (_, conv), = _cached(engine).items()
    others = [(f"x{i}", _prompt(rng, 20), sampling, spec) for i in range(2)]
    _steps(engine, {0: others})  # both slots taken: the conversation's slot is evicted
    assert all(t[:len(conv)] != conv for t in _cached(engine).values())
    assert pc.ram.stats.saved == 1 and len(pc.ram) == 1 and pc.ram.nbytes() > 0

    turn = conv + _prompt(rng, 6)
    hits, copied = pc.stats.hit_tokens, pc.stats.copied_tokens
    engine.add_request("b", turn, sampling, spec)
    slot = engine._reqs["b"].slot
    assert engine._reqs["b"].prefilled == len(conv)
    assert_slot_equals_fresh_prefill(llama, cache, slot, conv)
    tokens, prefilled = _steps(engine, {0: []}, running=["b"])
    assert prefilled == len(turn) - len(conv)  # only the new turn's tokens
    assert pc.stats.hit_tokens - hits == pc.stats.copied_tokens - copied == len(conv)
    assert (pc.ram.stats.hits, pc.ram.stats.hit_tokens) == (1, len(conv))
    assert tokens["b"] == _cold(llama, service, turn, sampling, spec)


def test_a_restored_prefix_hands_the_drafter_a_cold_prefills_rounds(llama, service):
    """With the drafter on, the restored request's rounds (draft nodes, accepted) equal a cold run's:
    the feature rows come back from RAM."""
    rng = random.Random(4)
    spec, sampling = SpecParams("dartree-pruned", budget=6), SamplingParams(max_tokens=12, ignore_eos=True)
    engine = _ram_engine(llama, service, max_running=1)
    first = _prompt(rng, 30)
    _trace(engine, "a", first, sampling, spec)
    (_, conv), = _cached(engine).items()
    _trace(engine, "x", _prompt(rng, 12), sampling, spec)  # the only slot: the conversation goes to RAM
    assert len(engine.runner.cache.prefix.ram) == 1 and engine.runner.cache.prefix.ram.longest(conv, True)[1] > 0
    turn = conv[:25] + _prompt(rng, 5)  # shares part of the stored conversation
    got = _trace(engine, "b", turn, sampling, spec)
    assert engine.runner.cache.prefix.ram.stats.hit_tokens == 25
    assert got == _cold(llama, service, turn, sampling, spec, trace=True)


def _filled(cache: SlotKVCache, slot: int, n: int, seed: int) -> None:
    """Write random values into ``slot``'s first ``n`` columns of every layer."""
    g = torch.Generator().manual_seed(seed)
    for k, v in zip(cache.keys, cache.values):
        k[slot, :, :n] = torch.randn(k[slot, :, :n].shape, generator=g)
        v[slot, :, :n] = torch.randn(v[slot, :, :n].shape, generator=g)


def _cache_with(prefixes: list[list[int]], ram_bytes: int) -> SlotKVCache:
    """A 2-layer cache with one slot per prefix, each freed caching its prefix (random KV, features)."""
    cache = SlotKVCache(2, 1, 2, len(prefixes) + 1, 320)
    cache.prefix.ram.max_bytes, cache.prefix.ram.min_tokens = ram_bytes, 4
    for i, toks in enumerate(prefixes):
        slot = cache.alloc()
        _filled(cache, slot, len(toks), seed=i)
        cache.extend(slot, len(toks))
        cache.free(slot, toks, torch.full((len(toks), 3), float(i)))
    return cache


def _entry_bytes(n: int) -> int:
    return 2 * 2 * 1 * n * 2 * 4 + n * 3 * 4 + ID_BYTES * n  # K and V of 2 layers, features, ids


def test_the_byte_bound_drops_the_least_recently_used_entries():
    a, b, c = [1] * 8, [2] * 8, [3] * 8
    cache = _cache_with([a, b, c], ram_bytes=2 * _entry_bytes(8))
    ram = cache.prefix.ram
    saved_a = [k[0, :, :8].clone() for k in cache.keys]
    cache.reserve(0)                                        # a's slot taken: a saved
    assert ram.nbytes() == _entry_bytes(8) and ram.stats.saved == 1
    cache.reserve(1)                                        # b saved
    key_a, n = ram.longest(a + [9], need_features=True)
    assert n == 8 and all(torch.equal(ram.entry(key_a).keys[i], saved_a[i]) for i in range(2))
    ram.touch(key_a)                                        # a used again: b is now the LRU entry
    cache.reserve(2)                                        # c saved, past the bound: b dropped
    assert ram.stats.evictions == 1 and len(ram) == 2 and ram.nbytes() == 2 * _entry_bytes(8)
    assert ram.longest(b + [9], False) == (-1, 0) and ram.longest(a + [9], False)[1] == 8
    ram.max_bytes = _entry_bytes(8)                         # a lower bound drops the LRU one (a)
    assert ram.longest(a + [9], False) == (-1, 0) and ram.longest(c + [9], False)[1] == 8


def test_ram_off_stores_nothing():
    cache = _cache_with([[1] * 8, [2] * 300], ram_bytes=0)
    cache.reserve(0)
    cache.reserve(1)
    assert len(cache.prefix.ram) == 0 and cache.prefix.ram.nbytes() == 0 and cache.prefix.ram.stats.saved == 0
    assert PrefixStore().max_bytes == 0 and PrefixCache().ram.max_bytes == 0


def test_short_prefixes_are_not_saved_and_longer_ones_supersede():
    assert PrefixStore.min_tokens == MIN_STORED_TOKENS == 256
    cache = _cache_with([[1] * 3, [1] * 6, [1] * 10], ram_bytes=2**20)
    ram = cache.prefix.ram
    cache.reserve(0)                                        # 3 < min_tokens: not saved
    assert len(ram) == 0
    cache.reserve(1)
    cache.reserve(2)                                        # [1]*10 starts with [1]*6: replaces it
    assert len(ram) == 1 and ram.nbytes() == _entry_bytes(10) and ram.longest([1] * 20, False)[1] == 10


def test_a_stored_entry_serves_only_prompts_that_share_it():
    stored = list(range(10, 50))
    cache = _cache_with([stored], ram_bytes=2**20)
    pc = cache.prefix
    cache.reserve(0)                                        # saved to RAM; slots 1 and 2 free, empty
    keys = [k[0, :, :40].clone() for k in cache.keys]
    assert pc.plan(cache.free_slots(), [7] + stored, True) == Placement(1)          # shares nothing
    short = stored[:pc.min_copy - 1] + [99] * 20
    assert pc.plan(cache.free_slots(), short, True) == Placement(1)                 # < min_copy shared
    plan = pc.plan(cache.free_slots(), stored[:30] + [99, 98], True)
    assert (plan.slot, plan.source, plan.copied) == (1, -1, 30) and plan.stored >= 0
    prefilled, feats = cache.take(plan)
    assert prefilled == cache.length(1) == 30 and torch.equal(feats, torch.zeros(30, 3))
    assert all(torch.equal(k[1, :, :30], keys[i][:, :30]) for i, k in enumerate(cache.keys))
    with pytest.raises(ValueError, match="cannot restore"):
        cache.restore_prefix(pc.ram.entry(plan.stored), 1, 5)                       # holds positions now


def test_ram_store_is_wired_through_config_help_and_metrics():
    import argparse

    from services.config_cli import add_config_args, config_from_args
    from services.startup import prefix_cache_part
    from services.verifier.config import VerifierWorkerConfig

    parser = argparse.ArgumentParser()
    add_config_args(parser, VerifierWorkerConfig)
    assert config_from_args(VerifierWorkerConfig, parser.parse_args([])).prefix_cache_ram_mib == 1024
    cfg = config_from_args(VerifierWorkerConfig, parser.parse_args(["--prefix-cache-ram-mib", "0"]))
    assert cfg.prefix_cache_ram_mib == 0
    assert "host-RAM" in parser.format_help()
    with pytest.raises(ValueError, match="prefix_cache_ram_mib"):
        VerifierWorkerConfig(prefix_cache_ram_mib=-1)
    pc = PrefixCache(max_bytes=256 * 2**20)
    assert prefix_cache_part(pc) == "0 MB of <= 256 MB"
    pc.ram.max_bytes = 1024 * 2**20
    assert prefix_cache_part(pc) == "0 MB of <= 256 MB + 0 MB of <= 1,024 MB in RAM"


def test_verifier_metrics_export_the_ram_store(llama):
    from services import metrics as m
    from services.verifier.engine import EngineConfig, SpecEngine
    from services.verifier.worker import VerifierWorker, VerifierWorkerConfig
    from tests.engine.test_prefix_cache import CHUNK, V, _run
    from tests.service.fakes import verifier_info

    engine = SpecEngine(llama, None, EngineConfig(max_running=1, prefill_chunk=CHUNK))
    engine.runner.cache.prefix.ram.max_bytes, engine.runner.cache.prefix.ram.min_tokens = 2**20, 16
    worker = VerifierWorker(engine, verifier_info(V), VerifierWorkerConfig(engine=EngineConfig(max_running=1)))
    sampling, spec = SamplingParams(max_tokens=4, ignore_eos=True), SpecParams("ar")
    rng = random.Random(8)
    prompt = _prompt(rng, 20)
    _run(engine, "a", prompt, sampling, spec)
    _run(engine, "x", _prompt(rng, 5), sampling, spec)          # a's conversation (23 positions) to RAM
    _run(engine, "b", prompt + [3], sampling, spec)             # restores its 20 prompt positions
    worker._update_gauges()
    worker._update_gauges()  # counters advance by what changed: a second call adds nothing
    r = worker.metrics.registry
    assert r.get_sample_value(m.PREFIX_RAM_SAVED) == 1
    assert r.get_sample_value(m.PREFIX_RAM_HITS) == 20
    assert r.get_sample_value(m.PREFIX_RAM_EVICTIONS) == 0
    assert r.get_sample_value(m.PREFIX_RAM_BYTES) == engine.runner.cache.prefix.ram.nbytes() > 0
