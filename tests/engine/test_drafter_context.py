"""DrafterService context storage: per-request K/V buffers written in place and grown in chunks
(``context_chunk``), a reusable batch scratch, against the concatenated / zero-padded contexts
they replace (float32, bitwise)."""

from __future__ import annotations

import pytest
import torch

from services.drafter.service import DrafterService
from services.testing import block_logits_one, draft_job, draft_one, tiny_drafter, tiny_target
from services.params import SpecParams

V = 96
CHUNK = 4


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=3, target_layer_ids=[0, 2],
                       max_position_embeddings=62)


def _service(target, chunk=CHUNK, seed=1):
    drafter = tiny_drafter(target, seed=seed, block_size=6, num_layers=2)  # 2 layers: layer indexing shows
    return DrafterService(drafter, target.embed_tokens(), target.lm_head(), context_chunk=chunk)


def _feats(target, n, seed=0):
    return torch.randn(n, target.feature_dim, generator=torch.Generator().manual_seed(seed))


def _kv(svc, feats, start):
    """The per-layer ``[1, Hkv, n, Dh]`` K/V of ``feats`` at positions ``[start - n, start)``."""
    with torch.inference_mode():
        return svc.drafter.context_kv(feats[None], torch.arange(start - feats.shape[0], start))


def _reference_block(svc, pieces, roots, starts):
    """The block over contexts concatenated from their appended ``pieces`` (per request: a list of
    :func:`_kv` results) and zero-padded to the longest, as the service computed it before."""
    c, q, n = svc.cfg, svc.rows_for(None), len(pieces)
    ctx = []
    with torch.inference_mode():
        for li in range(c.num_hidden_layers):
            full = [[torch.cat([p[li][j] for p in req], 2) for j in (0, 1)] for req in pieces]
            lens = [k.shape[2] for k, _ in full]
            kv = [torch.zeros(n, *full[0][0].shape[1:2], max(lens), c.head_dim) for _ in (0, 1)]
            for i, pair in enumerate(full):
                for j in (0, 1):
                    kv[j][i, :, :lens[i]] = pair[j][0]
            ctx.append(tuple(kv))
        mask = (torch.arange(max(lens))[None, None] < torch.tensor(lens)[:, None, None]).expand(n, q, max(lens))
        ids = torch.tensor([[r] + [c.mask_token_id] * (q - 1) for r in roots])
        pos = torch.stack([torch.arange(s, s + q) for s in starts])
        h = svc.drafter.block_forward(svc.embed(ids), pos, ctx, mask if n > 1 else None)
        hd = h if c.shift_label else h[:, 1:]
        return hd, svc.lm_head(hd).float()


def test_small_appends_across_growth_boundaries_equal_the_concatenated_context(target):
    """Appends of 1-7 positions crossing many chunk boundaries: after each, the block equals the block
    over the concatenation of every append's K/V (the former storage), bit for bit; and equals one
    append of everything within float32 rounding."""
    svc = _service(target)
    feats, start, pieces = _feats(target, 40), 0, []
    for n in (3, 1, 2, 5, 1, 7, 4, 1, 6, 2, 3, 5):
        part, start = feats[start:start + n], start + n
        pieces.append(_kv(svc, part, start))
        hd, base = block_logits_one(svc, "r", part, 11, start)
        ref_hd, ref_base = _reference_block(svc, [pieces], [11], [start])
        assert torch.equal(hd, ref_hd[0]) and torch.equal(base, ref_base[0]), start
    one = _service(target)
    hd1, base1 = block_logits_one(one, "r", feats[:start], 11, start)
    torch.testing.assert_close(hd, hd1, atol=1e-5, rtol=0)
    torch.testing.assert_close(base, base1, atol=1e-5, rtol=0)


@pytest.mark.parametrize("all_layers", [False, True])
def test_batched_block_equals_the_zero_padded_batch_and_drafts_equal_solo(target, all_layers):
    """Three contexts of different lengths in one call equal the zero-padded concatenated batch bit for
    bit, even when the scratch held non-finite values (the padding is rewritten, not assumed); each
    request's tree equals its tree drafted alone. The scratch holds one layer at a time, or every
    layer (the compiled service's list, here run eagerly)."""
    svc, solo = _service(target), _service(target)
    svc.compiled = all_layers
    lengths, pieces = {"a": (5, 9, 2), "b": (1,), "c": (13, 3)}, {}
    starts = {}
    for k, (rid, ns) in enumerate(lengths.items()):
        feats, s = _feats(target, sum(ns), seed=k), 0
        for n in ns:
            s += n
            pieces.setdefault(rid, []).append(_kv(svc, feats[s - n:s], s))
            svc.append_context(rid, feats[s - n:s], s)
            solo.append_context(rid, feats[s - n:s], s)
        starts[rid] = s
    jobs = [(rid, 3 + i, starts[rid]) for i, rid in enumerate(lengths)]
    svc._batch_ctx = torch.full((10_000,), float("nan"))
    got = svc.block_logits_batch(jobs)
    ref_hd, ref_base = _reference_block(svc, [pieces[r] for r, *_ in jobs], [r for _, r, _ in jobs],
                                        [s for *_, s in jobs])
    for i, (hd, base) in enumerate(got):
        assert torch.equal(hd, ref_hd[i]) and torch.equal(base, ref_base[i]), jobs[i][0]
    spec = SpecParams("dartree-pruned", budget=6, width=3, candidates=4)
    more = _feats(target, 2, seed=9)
    batch = svc.draft_batch([draft_job(rid, [7, 7], more, 7, starts[rid] + 2, spec) for rid in lengths])
    for k, rid in enumerate(lengths):
        tree, _ = draft_one(solo, rid, [7, 7], more, 7, starts[rid] + 2, spec)
        assert tree.num_nodes > 1 and torch.equal(batch[k][0].draft_tokens, tree.draft_tokens) and torch.equal(
            batch[k][0].parents, tree.parents), rid


def test_capacity_follows_the_chunk_rule_and_release_frees_it(target):
    """Capacity = the next multiple of ``context_chunk`` above the length (a free position always),
    cut to max_position (62) while the length is below it; an append that leaves a free position
    writes in place (same buffer); release drops the
    buffer and, with the last context, the batch scratch (one layer's K/V of 2 x the capacity of the
    longest); a released request re-appends from 0."""
    svc = _service(target)
    feats, caps, ptrs, s = _feats(target, 70), [], [], 0
    for n in (3, 1, 1, 4, 9, 1, 43, 1, 7):
        svc.append_context("r", feats[s:s + n], s + n)
        s += n
        caps.append(svc.context_capacity("r"))
        ptrs.append(svc._ctx["r"].data_ptr())
    # lengths 3 4 5 9 18 19 62 63 70
    assert caps == [4, 8, 8, 12, 20, 20, 64, 64, 72]
    assert ptrs[1] == ptrs[2] and ptrs[4] == ptrs[5] and ptrs[6] == ptrs[7] and ptrs[0] != ptrs[1]
    assert [svc.context_capacity_for(n) for n in (1, 3, 4, 8, 60, 61, 62, 63)] == [4, 4, 8, 12, 62, 62, 64, 64]
    first = svc.block_logits_batch([("r", 5, s)])[0]
    svc.append_context("q", feats[:9], 9)
    svc.block_logits_batch([("r", 5, s), ("q", 5, 9)])
    row = svc._ctx["r"][0, :, :, 0].numel()  # one layer's K/V of a position: 2 x Hkv x Dh
    assert svc._batch_ctx.numel() == 2 * svc.context_capacity_for(s) * row
    svc.release("q")
    assert svc.num_contexts() == 1 and svc._batch_ctx is not None
    svc.release("r")
    svc.release("r")
    assert svc.num_contexts() == 0 and svc.context_capacity("r") == 0 and svc._batch_ctx is None
    svc.append_context("r", feats[:s], s)  # released: starts again at 0, one append
    assert svc.context_capacity("r") == 72
    torch.testing.assert_close(svc.block_logits_batch([("r", 5, s)])[0][1], first[1], atol=1e-5, rtol=0)


def test_gap_and_overlap_raise_and_leave_the_context_unchanged(target):
    svc = _service(target)
    feats = _feats(target, 10)
    before = block_logits_one(svc, "r", feats[:6], 2, 6)
    with pytest.raises(ValueError, match="holds 6 positions, expected 7"):
        svc.append_context("r", feats[6:8], 9)  # gap
    with pytest.raises(ValueError, match="holds 6 positions, expected 4"):
        svc.append_context("r", feats[4:8], 8)  # overlap
    after = svc.block_logits_batch([("r", 2, 6)])[0]
    assert torch.equal(before[1], after[1]) and svc.context_capacity("r") == 8


def test_context_chunk_must_be_positive(target):
    with pytest.raises(ValueError, match="context_chunk"):
        _service(target, chunk=0)
