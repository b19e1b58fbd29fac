"""datagen's engine backend: continuous batching across shards gives each prompt exactly what plain
decoding gives it alone (greedy == HF greedy with EOS cut/kept, T = 1 reproducible by seed), and every
shard is handed over once, complete, in its prompt order."""

import random

import torch

from services.testing import greedy_reference, tiny_target
from services.training.datagen import generate_engine
from services.params import SamplingParams, SpecParams
from services.verifier.engine import EngineConfig, SpecEngine


def _shards(seed: int = 0, n_shards: int = 4, per: int = 3, vocab: int = 128):
    rng = random.Random(seed)
    return {b: [(f"u{b}-{i}", [rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))]) for i in range(per)]
            for b in range(n_shards)}


def _run(target, shards, in_flight, max_new=12, sampled_every=2):
    engine = SpecEngine(target, None, EngineConfig(max_running=in_flight, max_context=64), max_draft_depth=1)
    got = []
    generate_engine(engine, shards, max_new, sampled_every, in_flight, lambda b, rows: got.append((b, rows)))
    return got, engine


def test_engine_backend_equals_plain_decoding():
    torch.manual_seed(0)
    target = tiny_target()
    eos = target.eos_token_ids[0]
    shards = _shards()
    got, engine = _run(target, shards, in_flight=5)
    assert sorted(b for b, _ in got) == sorted(shards)  # each shard exactly once
    assert engine.num_active() == 0 and engine.num_free_slots() == 5
    for b, rows in got:
        assert [r["uid"] for r in rows] == [u for u, _ in shards[b]]
        for (uid, p), row in zip(shards[b], rows):
            assert row["prompt_ids"] == p and row["backend"] == "engine:float32"
            assert row["sampled"] == (b % 2 == 0)
            if row["sampled"]:
                continue
            ref = greedy_reference(target.model, p, 12)
            if eos in ref:
                ref = ref[:ref.index(eos) + 1]
            assert row["response_ids"] == ref


def test_engine_backend_sampled_rows_do_not_depend_on_batching():
    torch.manual_seed(0)
    target = tiny_target()
    shards = _shards(seed=1)
    a, _ = _run(target, shards, in_flight=7)
    b, _ = _run(target, shards, in_flight=1)
    assert dict(a) == dict(b)
    # and a sampled row is the seeded T=1 decode of that prompt alone
    engine = SpecEngine(target, None, EngineConfig(max_running=1, max_context=64), max_draft_depth=1)
    uid, p = shards[0][1]
    solo = []
    for r in engine.generate("x", p, SamplingParams(max_tokens=12, temperature=1.0, seed=0 * 1000 + 1),
                             SpecParams("ar")):
        solo += r.token_ids
    row = dict(a)[0][1]
    assert row["sampled"] and row["response_ids"][:len(solo)] == solo


def test_engine_backend_keeps_the_eos_it_stopped_at():
    torch.manual_seed(0)
    target = tiny_target()
    shards = _shards(seed=2, n_shards=2)
    uid, p = shards[1][0]
    eos = greedy_reference(target.model, p, 12)[4]  # make the 5th greedy token of this prompt a terminator
    engine = SpecEngine(target, None, EngineConfig(max_running=3, max_context=64), max_draft_depth=1)
    engine.eos_token_ids = (eos,)
    got = {}
    generate_engine(engine, shards, 12, 2, 3, lambda b, rows: got.__setitem__(b, rows))
    for (uid, p), row in zip(shards[1], got[1]):
        ref = greedy_reference(target.model, p, 12)
        if eos in ref:
            ref = ref[:ref.index(eos) + 1]
        assert row["response_ids"] == ref
    assert got[1][0]["response_ids"][-1] == eos and len(got[1][0]["response_ids"]) <= 5
