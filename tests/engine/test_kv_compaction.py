"""KV compaction: after many verify + commit rounds over branching trees, the target cache equals a
fresh prefill of the committed tokens (keys and values, every layer)."""

from __future__ import annotations

import random

import pytest
import torch

from services import hf_compat
from services.testing import ARCHS, greedy_reference, tiny_target, tree_from_nodes
from services.tree import derive_buffers, walk
from services.spec import DEFAULT_KNOBS
from services.verifier.drafter_client import DraftJob
from services.params import SamplingParams, SpecParams
from services.verifier.engine import SpecEngine
from tests.doubles import OracleDrafter, next_output

V = 128
ATOL = 1e-5


def assert_slot_equals_fresh_prefill(target, slot_cache, slot, committed):
    """Slot ``slot`` of a :class:`SlotKVCache` holds exactly a fresh prefill of ``committed``."""
    fresh = target.new_cache()
    target.prefill(committed, fresh)
    n = len(committed)
    assert slot_cache.length(slot) == n
    for i, (fk, fv) in enumerate(hf_compat.cache_layers(fresh)):
        torch.testing.assert_close(slot_cache.keys[i][slot, :, :n], fk[0], atol=ATOL, rtol=0,
                                   msg=lambda m: f"layer {i} keys: {m}")
        torch.testing.assert_close(slot_cache.values[i][slot, :, :n], fv[0], atol=ATOL, rtol=0,
                                   msg=lambda m: f"layer {i} values: {m}")


def _assert_cache_equals_fresh_prefill(target, cache, committed):
    fresh = target.new_cache()
    target.prefill(committed, fresh)
    got, want = hf_compat.cache_layers(cache), hf_compat.cache_layers(fresh)
    assert len(got) == len(want) == target.config.num_hidden_layers
    for i, ((k, v), (fk, fv)) in enumerate(zip(got, want)):
        assert k.shape == fk.shape and v.shape == fv.shape, f"layer {i}: {tuple(k.shape)} vs {tuple(fk.shape)}"
        torch.testing.assert_close(k, fk, atol=ATOL, rtol=0, msg=lambda m: f"layer {i} keys: {m}")
        torch.testing.assert_close(v, fv, atol=ATOL, rtol=0, msg=lambda m: f"layer {i} values: {m}")


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_after_many_branching_rounds_equals_fresh_prefill(arch):
    target = tiny_target(arch, vocab_size=V, hidden_size=32, num_layers=3)
    rng = random.Random(0)
    prompt = [rng.randrange(3, V) for _ in range(6)]
    ref = greedy_reference(target.model, prompt, 120)
    oracle = OracleDrafter({"r": prompt + ref}, depth=5, distractors=3, vocab_size=V, seed=1, truth_prob=0.7)
    cache = target.new_cache()
    logits, feats = target.prefill(prompt, cache)
    root, start, committed = int(logits.argmax()), len(prompt), list(prompt)
    ctx_ids, ctx_feats = list(prompt), feats
    gathered = lengths = 0
    for rnd in range(20):
        tree, _ = oracle.draft_job(DraftJob("r", ctx_ids, ctx_feats, root, start, "dartree-pruned", DEFAULT_KNOBS))
        buffers = derive_buffers(tree, root)
        logits, feats = target.verify(buffers, cache, start)
        res = walk(buffers, logits.argmax(-1))
        rows = res.accepted_rows
        assert hf_compat.cache_length(cache) == start + tree.num_nodes + 1
        target.commit(cache, start, rows)
        gathered += rows.tolist() != list(range(rows.numel()))
        lengths += rows.numel()
        ctx_ids = buffers.input_ids[rows].tolist()
        ctx_feats = feats[rows]
        committed += ctx_ids
        start += rows.numel()
        root = res.bonus_token
        assert hf_compat.cache_length(cache) == start == len(committed)
        if rnd % 5 == 4:
            _assert_cache_equals_fresh_prefill(target, cache, committed)
    assert committed + [root] == (prompt + ref)[:len(committed) + 1]  # walked the greedy path
    assert gathered >= 10 and lengths > 40  # compaction really moved rows, over many tokens
    _assert_cache_equals_fresh_prefill(target, cache, committed)


@pytest.mark.parametrize("rows", [[0], [0, 1, 2], [0, 1, 2, 5], [0, 3], [0, 3, 4, 6]])
def test_commit_single_round(rows):
    """Root-only, contiguous-prefix (plain crop) and scattered paths of one hand-made tree."""
    target = tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2)
    prefix = [5, 6, 7, 8]
    # rows: 0 root | 1 a | 2 b (child of a) | 3 c | 4 d (child of c) | 5 e (child of b) | 6 f (child of d)
    tree = tree_from_nodes([11, 12, 13, 14, 15, 16], [-1, 0, -1, 2, 1, 3])
    buffers = derive_buffers(tree, 10)
    cache = target.new_cache()
    target.prefill(prefix, cache)
    target.verify(buffers, cache, len(prefix))
    target.commit(cache, len(prefix), torch.tensor(rows))
    _assert_cache_equals_fresh_prefill(target, cache, prefix + buffers.input_ids[rows].tolist())


def test_engine_cache_equals_fresh_prefill_after_many_rounds():
    """White-box: the engine's own KV slot (private ``_reqs``) after rounds of an oracle with
    mid-path rejections."""
    target = tiny_target("qwen3", vocab_size=V, hidden_size=32, num_layers=3)
    prompt = [9, 4, 33, 71, 5]
    ref = greedy_reference(target.model, prompt, 150)
    oracle = OracleDrafter({"r": prompt + ref}, depth=6, distractors=2, vocab_size=V, seed=2, truth_prob=0.6)
    engine = SpecEngine(target, oracle, max_draft_depth=6)
    engine.add_request("r", prompt, SamplingParams(max_tokens=150, ignore_eos=True), SpecParams("dartree-pruned"))
    tokens = []
    for _ in range(20):
        out = next_output(engine, "r")
        assert out.finish_reason is None
        tokens += out.token_ids
    assert len(tokens) > 40
    req = engine._reqs["r"]
    assert req.start == len(prompt) + len(tokens) - 1 and tokens == ref[:len(tokens)]
    assert_slot_equals_fresh_prefill(target, engine.runner.cache, req.slot, prompt + tokens[:-1])
    engine.abort("r")
    assert engine.num_active() == 0 and oracle.num_contexts() == 0
