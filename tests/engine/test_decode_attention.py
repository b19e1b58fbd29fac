"""The runner's grouped few-row attention (:mod:`services.verifier.attention`) against SDPA.

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head dim 64); K/V are strided views of a
larger cache, as the runner reads a slot. Checked: equality to SDPA to rounding; each row's output
bitwise independent of how many rows share its call and of masked KV columns appended or inside
the KV length (bfloat16: the properties speculative == plain decoding rests on in the bf16 formats;
float32's GEMMs are not row invariant, float32 keeps SDPA); the runner takes the path where the
rule says.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.verifier import attention as A

HQ, HKV, DH = 9, 3, 64
G = HQ // HKV
SCALE = DH ** -0.5


def _case(rows: int, length: int, dtype, pad: int = 0, seed: int = 0, tree: bool = False):
    """``(query [1, Hq, R, Dh] strided, key, value [1, Hkv, L + pad, Dh] cache views, mask [1, 1, R, L + pad])``:
    the last ``R`` of ``L`` positions causal (or, ``tree``, each row seeing a random subset of the
    other new rows), ``pad`` masked columns after them."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(1, rows, HQ, DH, generator=g).to(dtype).transpose(1, 2)
    cache = torch.randn(2, 1, HKV, 4608, DH, generator=g).to(dtype)
    key, value = cache[0, :, :, :length + pad], cache[1, :, :, :length + pad]
    mask = torch.zeros(1, 1, rows, length + pad, dtype=torch.bool)
    start = length - rows
    for r in range(rows):
        mask[0, 0, r, :start + r + 1] = True
        if tree:
            mask[0, 0, r, start:start + r] = torch.rand(r, generator=g) < 0.5
    return query, key, value, mask


def _grouped(query, key, value, mask):
    return A.grouped_attention(query, key, value, A.additive_mask(mask, G), SCALE)


def _sdpa(query, key, value, mask):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=SCALE, enable_gqa=True)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("length", [17, 64, 320, 1088])
@pytest.mark.parametrize("tree", [False, True])
def test_equals_sdpa(dtype, atol, length, tree):
    """Every row count 1..17 against SDPA on the same inputs (float32 to its rounding; bfloat16 to
    about one ulp of outputs of magnitude ~1: the scores are rounded to bfloat16, SDPA's are not)."""
    for rows in range(1, 18):
        q, k, v, m = _case(rows, length, dtype, seed=rows, tree=tree)
        out = _grouped(q, k, v, m)
        assert out.shape == (1, HQ, rows, DH) and out.dtype == dtype
        torch.testing.assert_close(out.float(), _sdpa(q.float(), k.float(), v.float(), m), atol=atol, rtol=0)


@pytest.mark.parametrize("length", [17, 64, 320, 1024, 2048])
def test_rows_bitwise_independent_of_the_row_count_bf16(length):
    """In bfloat16 row ``r`` of an ``R``-row call is bitwise the 1-row call of that row (its query,
    its mask row), ``R`` = 1..17 and 40 (two row blocks), causal and tree masks."""
    for rows in list(range(1, 18)) + [40]:
        for tree in (False, True):
            if rows > length:
                continue
            q, k, v, m = _case(rows, length, torch.bfloat16, seed=rows, tree=tree)
            out = _grouped(q, k, v, m)
            for r in range(rows):
                solo = _grouped(q[:, :, r:r + 1], k, v, m[:, :, r:r + 1])
                assert torch.equal(solo[:, :, 0], out[:, :, r]), (length, rows, r, tree)


def test_rows_float32_to_rounding():
    """float32's GEMMs (MKL sgemm) change a row's last bits with the row count, as SDPA's kernel
    does: rows agree with their 1-row call to float32 rounding only."""
    q, k, v, m = _case(17, 512, torch.float32)
    out = _grouped(q, k, v, m)
    solo = torch.cat([_grouped(q[:, :, r:r + 1], k, v, m[:, :, r:r + 1]) for r in range(17)], dim=2)
    torch.testing.assert_close(out, solo, atol=1e-6, rtol=0)


@pytest.mark.parametrize("length, pad", [(32, 16), (32, 64), (192, 16), (192, 64), (576, 448), (640, 448),
                                         (960, 128), (1024, 64), (1088, 64), (1088, 448), (2048, 64), (1984, 128)])
def test_masked_columns_appended_change_nothing_bf16(length, pad):
    """In bfloat16 a row read with ``pad`` more KV columns (masked, holding other values) is bitwise
    the same, also across 1,024 columns (the runner reads a request's slot up to its bucketed length,
    an ``ar`` step and a verify at the same position may read different lengths)."""
    for rows in (1, 2, 5, 9, 17):
        q, k, v, m = _case(rows, length, torch.bfloat16, seed=rows)
        qp, kp, vp, mp = _case(rows, length, torch.bfloat16, pad=pad, seed=rows)
        assert torch.equal(k, kp[:, :, :length])
        assert torch.equal(_grouped(q, k, v, m), _grouped(qp, kp, vp, mp)), (rows, length, pad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_columns_inside_the_length_are_not_read(dtype):
    """Changing the K/V values of masked columns (a tree's other branches) changes no output bit."""
    q, k, v, m = _case(17, 300, dtype, tree=True)
    out = _grouped(q, k, v, m)
    for r in range(17):
        cols = ~m[0, 0, r]  # the columns row r does not see: other values there
        k3, v3 = k.clone(), v.clone()
        k3[:, :, cols] = 100.0
        v3[:, :, cols] = -7.0
        assert torch.equal(_grouped(q, k3, v3, m)[:, :, r], out[:, :, r]), r


def test_rule():
    """Grouped on CPU in bfloat16 / float16 whatever the rows and KV length, unless switched off."""
    assert A.use_grouped(torch.bfloat16, "cpu") and A.use_grouped(torch.float16, "cpu")
    assert not A.use_grouped(torch.float32, "cpu")
    assert not A.use_grouped(torch.bfloat16, "meta")


@pytest.mark.parametrize("enabled", [True, False])
def test_runner_takes_the_path_per_rule(monkeypatch, enabled):
    """A bfloat16 runner step of an ``ar`` row, a 9-row tree and a 40-row prompt chunk sends each
    through the grouped attention (once per layer), none when switched off; the logits agree with
    the SDPA runner to bfloat16 rounding."""
    from services.testing import tiny_causal_lm
    from services.tree.batch import causal_segment
    from services.verifier.runner import ModelRunner
    from services.verifier.target import TargetModel

    model = tiny_causal_lm("llama", vocab_size=128, hidden_size=576, intermediate_size=128, num_layers=2,
                           num_heads=HQ, num_kv_heads=HKV, max_position_embeddings=256, init_std=0.05,
                           dtype=torch.bfloat16)
    runner = ModelRunner(TargetModel(model, [0, 1]), num_slots=3, capacity=256, kv_bucket=16)
    calls = []
    real = A.attend

    def counted(query, *args):
        calls.append(query.shape[2])
        return real(query, *args)

    monkeypatch.setattr("services.verifier.slot_attention.attend", counted)
    monkeypatch.setattr(A, "GROUPED_ATTENTION", enabled)
    slots = [runner.cache.alloc() for _ in range(3)]
    for s, n in zip(slots[:2], (50, 70)):
        runner.execute([causal_segment(list(range(3, 3 + n)), 0, s)])
        runner.cache.extend(s, n)
    calls.clear()
    segs = [causal_segment([5], 50, slots[0]), causal_segment(list(range(9, 18)), 70, slots[1]),
            causal_segment(list(range(40)), 0, slots[2])]
    out = runner.execute(segs)
    assert calls == ([1, 9, 40] * 2 if enabled else [])
    monkeypatch.setattr(A, "GROUPED_ATTENTION", False)
    ref = runner.execute(segs)
    torch.testing.assert_close(out.logits, ref.logits, atol=0.1, rtol=0)
