"""The fused slot attention (``dartree_native::slot_attention``, ``services/verifier/fused_attention.h``).

Against a float64 dense attention over the same cache (and, in bfloat16, no further from it than
the ATen-call reference op): every row count a step runs (1-17 rows of a tree, a 65-row prompt
chunk), KV lengths across the 1,024-column blocks of the reference, random tree masks, grouped and
ungrouped heads, bfloat16 / float16 / float32 caches. Then the invariance speculation rests on: each
row's output is bitwise the same computed alone, beside other rows and requests, on one or two
threads, and with masked columns appended. Skipped where no C++ compiler can build the library.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.tree.batch import causal_segment, pack_segments
from services import native_lib as native
from services.verifier import runner as R
from services.verifier import slot_attention as SA
from services.verifier.kv_cache import SlotKVCache
from tests.engine.test_native_attention import _tree_segment

pytestmark = pytest.mark.skipif(not native.load(build=True), reason="the native slot attention cannot be built here")

TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2 ** -8, 2 ** -10), torch.float16: (2 ** -10, 2 ** -12)}


def _step(segments, heads: tuple[int, int, int], dtype, capacity: int, seed: int):
    """A random cache, the step's parts (with additive biases whatever the dtype) and its q / k / v."""
    hq, hkv, dh = heads
    g = torch.Generator().manual_seed(seed)
    cache = SlotKVCache(1, hkv, dh, 4, capacity, dtype, "cpu")
    for t in cache.keys + cache.values:
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    p = pack_segments(segments, 64, capacity)
    parts = SA.request_parts(p, hq // hkv, torch.bfloat16)  # a bias is made for bf16 only: ask for one
    rows = p.input_ids.numel()
    qkv = [torch.randn(1, rows, h, dh, generator=g).to(dtype).transpose(1, 2) for h in (hq, hkv, hkv)]
    return cache, parts, qkv


def _call(cache, parts, q, k, v, op="slot_attention"):
    """One layer call of ``op`` over ``parts`` (tuples as :func:`SA.request_parts` makes)."""
    torch.ops.dartree_native.set_cache(cache.keys, cache.values)
    torch.ops.dartree_native.set_step([x for part in parts for x in part[:5]], [part[6] for part in parts])
    try:
        return getattr(torch.ops.dartree_native, op)(q, k, v, torch.tensor(0), q.shape[-1] ** -0.5)
    finally:
        torch.ops.dartree_native.clear_step()


def _dense(cache, parts, q):
    """float64 attention of every request's rows over its slot as written: ``[1, R, Hq, Dh]``."""
    hq, dh, hkv = q.shape[1], q.shape[3], cache.keys[0].shape[1]
    outs = []
    for a, b, slot, _, length, _, bias in parts:
        k = cache.keys[0][slot, :, :length].double().repeat_interleave(hq // hkv, 0)  # [Hq, L, Dh]
        v = cache.values[0][slot, :, :length].double().repeat_interleave(hq // hkv, 0)
        s = q[0, :, a:b].double() @ k.transpose(1, 2) * dh ** -0.5 + bias[:b - a].double()  # [Hq, R_i, L]
        outs.append(torch.softmax(s, -1) @ v)
    return torch.cat(outs, 1).transpose(0, 1)[None]


ROWS = list(range(1, 18)) + [65]
LENGTHS = [40, 300, 1030, 2100]  # the reference's p @ v goes in 1,024-column blocks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fused_equals_the_dense_reference_for_every_row_count(dtype):
    rtol, atol = TOL[dtype]
    rng = random.Random(0)
    for rows in ROWS:
        length = LENGTHS[rows % len(LENGTHS)]
        start = max(length - rows, 0)
        seg = causal_segment(list(range(rows)), start, 1) if rows > 17 else _tree_segment(rng, rows, start, 1)
        cache, parts, (q, k, v) = _step([seg], (9, 3, 64), dtype, 2176, rows)
        got = _call(cache, parts, q, k, v)
        assert got.shape == (1, rows, 9, 64) and got.dtype == dtype and got.is_contiguous()
        want = _dense(cache, parts, q)
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol, msg=lambda m: f"{rows} rows: {m}")
        if dtype != torch.float32:  # no further from float64 than the Python body's ATen calls
            ref = _call(cache, parts, q, k, v, op="slot_attention_aten")
            assert (got.double() - want).abs().max() <= (ref.double() - want).abs().max(), rows


@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 16)], ids=str)
def test_fused_equals_the_reference_for_head_layouts_and_several_requests(heads):
    for dtype in (torch.float32, torch.bfloat16):
        for seed in range(2):
            rng = random.Random(seed)
            segments = [causal_segment([5], 40 + seed, 0), _tree_segment(rng, 9, 1100, 1),
                        causal_segment(list(range(40)), 7, 2), _tree_segment(rng, 17, 300, 3)]
            cache, parts, (q, k, v) = _step(segments, heads, dtype, 1216, seed)
            got = _call(cache, parts, q, k, v)
            torch.testing.assert_close(got.double(), _dense(cache, parts, q), rtol=TOL[dtype][0], atol=TOL[dtype][1])


def _row_alone(cache, parts, q, k, v, i: int, r: int):
    """Row ``r`` of request ``i`` computed in a call of its own (its K/V row written again, same bits)."""
    a, _, slot, start, length, _, bias = parts[i]
    one = [(0, 1, slot, start + r, length, None, bias[r:r + 1])]
    return _call(cache, one, q[:, :, a + r:a + r + 1], k[:, :, a + r:a + r + 1], v[:, :, a + r:a + r + 1])[0, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_each_row_is_bitwise_the_same_alone_beside_others_on_any_threads_and_with_masked_columns(dtype):
    rng = random.Random(3)
    segments = [causal_segment([5], 1030, 0), _tree_segment(rng, 9, 200, 1), causal_segment(list(range(40)), 7, 2),
                _tree_segment(rng, 17, 2000, 3)]
    cache, parts, (q, k, v) = _step(segments, (9, 3, 64), dtype, 2112, 3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = _call(cache, parts, q, k, v)
        torch.set_num_threads(2)
        full = _call(cache, parts, q, k, v)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(full, one_thread)
    for i, (a, b, slot, start, length, _, bias) in enumerate(parts):
        rows = (q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
        alone = _call(cache, [(0, b - a, slot, start, length, None, bias)], *rows)  # the request's solo step
        assert torch.equal(alone, full[:, a:b]), i
        padded = torch.cat([bias, bias.new_full((bias.shape[0], 64), float("-inf"))], 1)  # 64 more masked columns
        more = _call(cache, [(0, b - a, slot, start, length + 64, None, padded)], *rows)
        assert torch.equal(more, alone), i
        for r in range(b - a):
            assert torch.equal(_row_alone(cache, parts, q, k, v, i, r), full[0, a + r]), (i, r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_masked_columns_between_seen_ones_change_nothing(dtype):
    """A tree verify's row sees its path with masked siblings between its columns; the commit then
    compacts the path and plain decoding computes it contiguous. The row's output is bitwise the same
    with any masked gap before it, at any column (the sum of the probabilities once took the columns in
    16 lanes by their index, so a gap shifted the later columns to other lanes and changed the bits)."""
    length = 150
    cache, parts, (q, k, v) = _step([causal_segment([5], length - 1, 0)], (9, 3, 64), dtype, 512, 7)
    want = _call(cache, parts, q, k, v)
    a, b, slot, start, width, _, bias = parts[0]  # width: the KV length the step attends (bucketed)
    for at, gap in ((1, 1), (37, 2), (100, 3), (140, 16), (148, 5)):
        other = 1  # the same columns in another slot, with `gap` masked columns inserted at column `at`
        for t in cache.keys + cache.values:
            t[other, :, :at] = t[slot, :, :at]
            t[other, :, at:at + gap] = torch.randn(t[other, :, at:at + gap].shape).to(dtype)
            t[other, :, at + gap:width + gap] = t[slot, :, at:width]
        wide = torch.cat([bias[:, :at], bias.new_full((bias.shape[0], gap), float("-inf")), bias[:, at:]], 1)
        got = _call(cache, [(a, b, other, start + gap, width + gap, None, wide)], q, k, v)
        assert torch.equal(got, want), (at, gap)


def test_the_fused_op_writes_the_step_rows_like_the_reference():
    rng = random.Random(5)
    segments = [causal_segment([5], 40, 0), _tree_segment(rng, 9, 100, 1)]
    cache, parts, (q, k, v) = _step(segments, (9, 3, 64), torch.bfloat16, 256, 5)
    twin = SlotKVCache(1, 3, 64, 4, 256, torch.bfloat16, "cpu")
    for x, y in zip(twin.keys + twin.values, cache.keys + cache.values):
        x.copy_(y)
    _call(cache, parts, q, k, v)
    _call(twin, parts, q, k, v, op="slot_attention_aten")
    for x, y in zip(twin.keys + twin.values, cache.keys + cache.values):
        assert torch.equal(x, y)
    assert not torch.equal(cache.keys[0][1, :, 100:109], torch.zeros_like(cache.keys[0][1, :, 100:109]))


def test_bad_calls_are_refused_with_the_shapes():
    cache, parts, (q, k, v) = _step([causal_segment([5], 40, 0)], (9, 3, 64), torch.bfloat16, 128, 0)
    with pytest.raises(RuntimeError, match="slot_attention: query"):
        _call(cache, parts, q.float(), k, v)  # a float32 query against a bfloat16 cache
    torch.ops.dartree_native.clear_step()
    with pytest.raises(RuntimeError, match="outside a step"):
        torch.ops.dartree_native.slot_attention(q, k, v, torch.tensor(0), 0.125)


def test_compiled_runners_pick_the_fused_kernel_unless_switched_to_aten(monkeypatch):
    from tests.engine.test_batch_invariance import _target

    target = _target("q4")
    runner = R.ModelRunner(target, num_slots=1, capacity=64, kv_bucket=16, compile=True)
    assert runner.native and runner.lean.attention is SA.native_lean_attention
    monkeypatch.setattr(native, "FUSED", False)
    runner = R.ModelRunner(target, num_slots=1, capacity=64, kv_bucket=16, compile=True)
    assert runner.native and runner.lean.attention is SA.native_aten_lean_attention
