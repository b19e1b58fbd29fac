"""The ATen-call native slot attention (``dartree_native::slot_attention_aten``,
:mod:`services.native_lib`) against the Python body it replaces
(:func:`services.verifier.slot_attention.slot_attention_eager`); the fused kernel is
tests/engine/test_fused_attention.py's.

Same inputs, same cache: the outputs and the cache written must be bitwise equal, for steps of one
``ar`` row, several requests with tree masks, a prompt chunk of more than 32 rows (the row
blocks) and a KV length past 1,024 columns (the column blocks). Skipped where no C++ compiler can
build the library.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.tree.batch import Segment, causal_segment, pack_segments
from services import native_lib as native
from services.verifier import slot_attention as SA
from services.verifier.kv_cache import SlotKVCache

HQ, HKV, DH, LAYERS = 9, 3, 64, 2
G = HQ // HKV

pytestmark = pytest.mark.skipif(not native.load(build=True), reason="the native slot attention cannot be built here")


def _tree_segment(rng: random.Random, n: int, start: int, slot: int) -> Segment:
    """A random tree of ``n`` rows (each row's parent an earlier row; row 0 the root)."""
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
        depth[i] = 0 if parents[i] < 0 else depth[parents[i]] + 1
    ids = torch.tensor([rng.randrange(100) for _ in range(n)])
    return Segment(ids, torch.tensor(depth), mask, start, slot)


def _step(segments, capacity: int, seed: int):
    """A filled cache, the packed step, its request parts and random q / k / v for its rows."""
    g = torch.Generator().manual_seed(seed)
    cache = SlotKVCache(LAYERS, HKV, DH, 4, capacity, torch.bfloat16, "cpu")
    for t in cache.keys + cache.values:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    p = pack_segments(segments, 64, capacity)
    parts = SA.request_parts(p, G, torch.bfloat16)
    rows = p.input_ids.numel()
    q = torch.randn(1, rows, HQ, DH, generator=g).bfloat16().transpose(1, 2)  # strided, as the step's
    k = torch.randn(1, rows, HKV, DH, generator=g).bfloat16().transpose(1, 2)
    v = torch.randn(1, rows, HKV, DH, generator=g).bfloat16().transpose(1, 2)
    return cache, p, parts, q, k, v


def _python(cache, p, parts, layer, q, k, v):
    SA.ACTIVE.step = (cache, p, parts, False)
    try:
        return SA.slot_attention_eager(layer, q, k, v, None, scaling=DH ** -0.5)[0].contiguous()
    finally:
        SA.ACTIVE.step = None


def _native(cache, parts, layer, q, k, v):
    SA.native_step(cache, parts)
    try:
        return torch.ops.dartree_native.slot_attention_aten(q, k, v, torch.tensor(layer), DH ** -0.5)
    finally:
        torch.ops.dartree_native.clear_step()


def _clone(cache: SlotKVCache) -> SlotKVCache:
    other = SlotKVCache(LAYERS, HKV, DH, cache.num_slots, cache.capacity, cache.dtype, "cpu")
    for a, b in zip(other.keys + other.values, cache.keys + cache.values):
        a.copy_(b)
    return other


CASES = {
    "one ar row": lambda rng: [causal_segment([5], 40, 0)],
    "ar rows and trees": lambda rng: [causal_segment([5], 40, 0), _tree_segment(rng, 9, 100, 1),
                                      _tree_segment(rng, 4, 7, 2), causal_segment([6], 300, 3)],
    "a 70-row prompt chunk beside a tree": lambda rng: [causal_segment(list(range(70)), 130, 2),
                                                        _tree_segment(rng, 17, 60, 0)],
    "past 1,024 columns": lambda rng: [_tree_segment(rng, 5, 1500, 1), causal_segment([9], 2040, 3)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_native_equals_the_python_body_bitwise(case):
    for seed in range(3):
        segments = CASES[case](random.Random(seed))
        cache, p, parts, q, k, v = _step(segments, 2112, seed)
        twin = _clone(cache)
        for layer in range(LAYERS):
            want = _python(cache, p, parts, layer, q, k, v)
            got = _native(twin, parts, layer, q, k, v)
            assert got.shape == want.shape == (1, q.shape[2], HQ, DH) and got.is_contiguous()
            assert torch.equal(got, want), (case, seed, layer)
        for a, b in zip(twin.keys + twin.values, cache.keys + cache.values):
            assert torch.equal(a, b)  # the same K/V rows written to the same columns


def test_outside_a_step_the_native_op_refuses():
    q = torch.zeros(1, HQ, 1, DH, dtype=torch.bfloat16)
    kv = torch.zeros(1, HKV, 1, DH, dtype=torch.bfloat16)
    torch.ops.dartree_native.clear_step()
    for op in (torch.ops.dartree_native.slot_attention, torch.ops.dartree_native.slot_attention_aten):
        with pytest.raises(RuntimeError, match="outside a step"):
            op(q, kv, kv, torch.tensor(0), 0.125)


def test_a_new_cache_is_handed_over_even_when_an_old_one_had_its_id():
    """The thread's cache is tracked by reference, not by ``id()``: a new cache is always set."""
    first, p, parts, q, k, v = _step([causal_segment([5], 40, 0)], 128, 0)
    _native(first, parts, 0, q, k, v)
    second = _clone(first)
    second.keys[0].zero_()
    second.values[0].zero_()
    got = _native(second, parts, 0, q, k, v)
    assert torch.equal(got, _python(_clone(second), p, parts, 0, q, k, v))


def test_native_int4_mm_is_torchs_int4_kernel():
    """``dartree_native::int4_mm`` (the compiled q4 linears' op) returns the kernel's bits, and a
    compiled ``Int4Linear`` calls it."""
    from services.weights import Int4Linear, quantize_q4_1

    torch.manual_seed(0)
    lin = Int4Linear(quantize_q4_1(torch.randn(64, 96)), kernel="torch")
    for m in (1, 2, 5, 9, 33):
        x = torch.randn(m, 96).bfloat16()
        want = torch.ops.aten._weight_int4pack_mm_for_cpu(x, lin.packed, 32, lin.scale_zeros)
        assert torch.equal(torch.ops.dartree_native.int4_mm(x, lin.packed, 32, lin.scale_zeros), want)
    calls = []
    real = torch.ops.dartree_native.int4_mm

    def seen(gm, example_inputs):
        calls.extend(str(n.target) for n in gm.graph.nodes)
        return gm

    x = torch.randn(3, 96).bfloat16()
    with torch.inference_mode():
        out = torch.compile(lin, backend=seen)(x)
    assert any("dartree_native.int4_mm" in c for c in calls), calls
    assert torch.equal(out, real(x, lin.packed, 32, lin.scale_zeros))
