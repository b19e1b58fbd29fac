"""Padded fixed-shape steps (the runner's CUDA-graph path, issue 16 item 4), tested on CPU.

On a GPU each :class:`~services.tree.batch.StepBucket` is captured once in a CUDA graph; on CPU the
same padded step runs eagerly, so the padding itself is checked here against the unpadded runner:
padding rows and padding segments must change no real row's logits, features or KV, write only to the scratch slot, and the step must hold no host synchronisation (which a
CUDA graph cannot capture). The capture is checked by the ``gpu`` test at the end.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from services.testing import random_tree, tiny_drafter, tiny_service
from services.tree import derive_buffers
from services.metrics import GRAPH_EAGER_STEPS, VerifierMetrics
from services.tree.batch import (Segment, StepBucket, causal_segment, pack_segments, pad_packed, padded_step_mask,
                                 padded_tree_rows, row_bucket, step_bucket)
from services.verifier.runner import ModelRunner
from tests.engine.conftest import TARGET_KW, V
from tests.doubles.segments import LockstepSlots, random_segments
from tests.engine.test_batched import _engine, _mixed_requests, _run_batched, _solo


def test_step_bucket_rounds_up_and_caps():
    p = pack_segments([causal_segment([1] * 5, 40, 0), causal_segment([2] * 3, 0, 1),
                       causal_segment([3], 7, 2)], kv_bucket=16)
    assert (p.row_index.shape, p.input_ids.numel(), p.kv_length) == ((3, 5), 9, 48)
    b = step_bucket(p, logit_rows=3, max_segments=8, kv_bucket=16, kv_capacity=300)
    assert b == StepBucket(segments=4, rows_per_segment=16, rows=16, kv_length=64, logit_rows=16)
    b = step_bucket(p, logit_rows=1, max_segments=3, kv_bucket=16, kv_capacity=50)
    assert b == StepBucket(segments=3, rows_per_segment=16, rows=16, kv_length=50, logit_rows=1)
    one = pack_segments([causal_segment([1], 7, 2)], kv_bucket=16)  # a plain decoding row: no padding
    assert step_bucket(one, 1, 8, 16, 300) == StepBucket(1, 1, 1, 16, 1)
    with pytest.raises(ValueError, match="segments exceeds"):
        step_bucket(p, 1, max_segments=2, kv_bucket=16, kv_capacity=300)


def test_rows_bucket_by_16_past_one_row():
    assert [row_bucket(n) for n in (0, 1, 2, 3, 5, 9, 16, 17, 32, 33, 48, 49, 65, 129)] == \
        [1, 1, 16, 16, 16, 16, 16, 32, 32, 48, 48, 64, 80, 144]
    for n in range(2, 300):  # never below n, less than 16 rows of padding, multiples of 16
        b = row_bucket(n)
        assert n <= b < n + 16 and b % 16 == 0
    # a B = 64 tree (65 verify rows) beside an ar row: 80 rows per segment, 80 rows, not 128
    b65 = derive_buffers(random_tree(random.Random(0), V, 64, 8), 1)
    p = pack_segments([Segment(b65.input_ids, b65.position_offsets, b65.tree_mask, 10, 0),
                       causal_segment([3], 4, 1)], kv_bucket=16)
    b = step_bucket(p, logit_rows=66, max_segments=4, kv_bucket=16, kv_capacity=512)
    assert b == StepBucket(segments=2, rows_per_segment=80, rows=80, kv_length=128, logit_rows=80)
    # the grid's bucketing: rows per segment capped at segment_rows, every row's logits
    b = step_bucket(p, logit_rows=1, max_segments=4, kv_bucket=16, kv_capacity=512, segment_rows=80)
    assert b == StepBucket(segments=2, rows_per_segment=80, rows=80, kv_length=128, logit_rows=80)


def test_steps_past_the_grid_run_eager_and_are_counted(target):
    """Once a grid is captured, a step whose bucket is in it is not counted (on CPU it runs eagerly
    too: nothing is captured), a step outside it runs eagerly and is counted; the worker's metric
    advances by the runner's running total. Without padded steps nothing is counted."""
    runner = ModelRunner(target, num_slots=2, capacity=100, kv_bucket=8, cuda_graphs=True)
    info = runner.capture_graphs(max_rows=32, segment_rows=16)  # rows 1, 16, 32; 1 or 2 segments
    assert info["graphs"] == 0 and runner.graphs.num_captured() == 0 and info["pool_bytes"] == 0  # CPU
    assert set(runner.graphs.steps) == set(runner.padded.grid.buckets)
    a, b = runner.cache.alloc(), runner.cache.alloc()
    metrics = VerifierMetrics(model="tiny")
    steps = (([1], 0), ([5], 0), ([33], 1),  # 33 rows: past the widest step
             ([20], 1),  # one request's 20 rows (a prompt chunk): wider than segment_rows
             ([1, 1], 0), ([17, 2], 1),  # a 17-row segment beside another: wider than segment_rows
             ([16, 16], 0), ([1], 0))
    for rows, counted in steps:
        before = runner.num_eager_steps
        segs = [causal_segment([4] * n, 0, slot) for n, slot in zip(rows, (a, b))]
        bucket = runner.padded.bucket(pack_segments(segs, 8, 100, with_mask=False), sum(rows))
        assert (bucket not in runner.padded.grid) == bool(counted), rows
        runner.execute(segs)
        assert runner.num_eager_steps - before == counted, rows
        metrics.observe_graph_eager_steps(runner.num_eager_steps)
        assert metrics.registry.get_sample_value(GRAPH_EAGER_STEPS) == runner.num_eager_steps
    assert runner.num_eager_steps == 3
    assert ModelRunner(target, num_slots=1, capacity=64).num_eager_steps == 0  # unpadded: none


def test_pad_packed_keeps_real_rows_and_sends_padding_to_the_scratch_slot():
    rng = random.Random(1)
    segs = random_segments(rng, [0, 2, 1], [5, 0, 9], V)
    p = pack_segments(segs, kv_bucket=8)
    r, (n, rm) = p.input_ids.numel(), p.row_index.shape
    b = step_bucket(p, r, max_segments=4, kv_bucket=8, kv_capacity=100)
    q = pad_packed(p, b, scratch_slot=4)
    assert q.input_ids.shape == (b.rows,) and q.row_index.shape == (b.segments, b.rows_per_segment)
    assert q.attn_mask.shape == (b.segments, 1, b.rows_per_segment, b.kv_length)
    for f in ("input_ids", "positions", "write_slot", "write_pos"):
        assert torch.equal(getattr(q, f)[:r], getattr(p, f)), f
    assert torch.equal(q.slots[:n], p.slots) and bool((q.slots[n:] == 4).all())
    assert bool((q.write_slot[r:] == 4).all())  # padding rows never write a request's slot
    # row_index and padded_pos stay inverse, and every real row keeps its segment, column and mask row
    assert torch.equal(q.row_index.flatten()[q.padded_pos], torch.arange(b.rows))
    for i in range(n):
        for j in range(rm):
            if p.row_index[i, j] >= 0:
                assert q.row_index[i, j] == p.row_index[i, j]
            assert torch.equal(q.attn_mask[i, 0, j, :p.kv_length], p.attn_mask[i, 0, j])
            assert not q.attn_mask[i, 0, j, p.kv_length:].any()
    assert bool(q.attn_mask.any(-1).all())  # no empty softmax row anywhere (no NaN)
    with pytest.raises(ValueError, match="scratch slot"):
        pad_packed(p, b, scratch_slot=2)
    with pytest.raises(ValueError, match="does not fit"):
        pad_packed(p, StepBucket(b.segments, rm - 1, b.rows, b.kv_length, b.logit_rows), scratch_slot=4)


@pytest.mark.parametrize("seed", range(4))
def test_device_built_padded_mask_equals_the_host_mask(seed):
    """The mask a padded step builds inside itself from starts, row counts and parent rows equals
    pad_packed's host-built one, bit for bit (trees, prompt chunks, lone rows, padding segments)."""
    rng = random.Random(seed)
    for _ in range(8):
        n = rng.randrange(1, 5)
        segs = random_segments(rng, rng.sample(range(6), n), [rng.randrange(0, 60) for _ in range(n)], V)
        p = pack_segments(segs, kv_bucket=8)
        b = step_bucket(p, rng.randrange(1, p.input_ids.numel() + 1), max_segments=6, kv_bucket=8, kv_capacity=200)
        want = pad_packed(p, b, scratch_slot=6).attn_mask
        got = padded_step_mask(*padded_tree_rows(segs, b), b.kv_length)
        assert got.shape == want.shape and torch.equal(got, want)
    bare = pad_packed(pack_segments(segs, kv_bucket=8, with_mask=False), b, scratch_slot=6)
    assert bare.attn_mask.shape[-1] == 0  # no host mask when the step builds its own


def _close(a, b):
    # the bucket's longer KV length changes the attention GEMMs' reduction blocking: float32 ulps
    # (measured <= 1e-6 here), as between a request's solo and batched steps on the plain runner
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_compile_and_padded_steps_on_cpu_are_refused(target):
    with pytest.raises(ValueError, match="exclude each other"):
        ModelRunner(target, num_slots=2, capacity=64, compile=True, cuda_graphs=True)


@pytest.fixture
def one_thread():
    """One intra-op thread for a bitwise comparison: at 2 threads MKL's float32 GEMM splits a padded
    row count differently from the unpadded one, so the same row can differ in its last bit (the
    test then depended on whether an earlier test had left torch at one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_padded_runner_equals_plain_runner(target, one_thread):
    """Prefill chunks, random trees, lone rows, subsets of logit rows, across commits: the padded
    runner's logits, features and slot KV equal the plain runner's (float32; bitwise where the KV
    length is the same, within float32 rounding where the bucket reads more columns)."""
    plain = ModelRunner(target, num_slots=4, capacity=200, kv_bucket=8)
    padded = ModelRunner(target, num_slots=4, capacity=200, kv_bucket=8, cuda_graphs=True)
    assert padded.cache.num_free() == 4 and padded.scratch_slot == 4
    rng = random.Random(0)
    walk = LockstepSlots((plain, padded))
    for step in range(6):
        segs = walk.segments(rng, step, V)
        rows = sum(s.num_rows for s in segs)
        keep = None if step % 2 == 0 else torch.tensor(sorted(rng.sample(range(rows), rng.randrange(1, rows + 1))))
        a, b = plain.execute(segs, keep), padded.execute(segs, keep)
        _close(a.logits, b.logits)
        _close(a.features, b.features)
        if step == 0:  # same KV length, one segment on both sides
            assert torch.equal(a.logits, b.logits) and torch.equal(a.features, b.features)
        assert torch.equal(a.packed.cu_rows, b.packed.cu_rows)
        walk.commit(segs)  # commit everything written (trees: all their nodes; the KV then must match too)
        for layer in range(len(plain.cache.keys)):
            for s, n in zip(walk.slots, walk.lengths):
                _close(plain.cache.keys[layer][s, :, :n], padded.cache.keys[layer][s, :, :n])
                _close(plain.cache.values[layer][s, :, :n], padded.cache.values[layer][s, :, :n])
    # no grid captured: every padded step ran eagerly and was counted
    assert padded.graphs.num_captured() == 0 and padded.num_eager_steps == 6


@contextlib.contextmanager
def _fail_on_host_sync():
    """Raise on every Python-level read of a tensor's value (what synchronises a CUDA stream)."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def fail(name):
        def f(self, *a, **k):
            raise AssertionError(f"host sync inside a padded step: Tensor.{name}")
        return f

    for n in names:
        setattr(torch.Tensor, n, fail(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def test_padded_step_holds_no_host_sync(target):
    """The callable a CUDA graph captures (transformers' forward + our slot attention + the feature
    taps) never reads a tensor value on the host (transformers' causal-mask builder would: the step
    runs under an attention name without one). A CPU proxy of "capturable"."""
    runner = ModelRunner(target, num_slots=3, capacity=100, kv_bucket=8, cuda_graphs=True)
    make = runner.graphs.make_fn

    def guarded(bucket):
        fn = make(bucket)

        def run(*inputs):
            with _fail_on_host_sync():
                return fn(*inputs)
        return run

    runner.graphs.make_fn = guarded
    rng = random.Random(2)
    slots = [runner.cache.alloc() for _ in range(3)]
    runner.execute(random_segments(rng, slots, [0, 0, 0], V))
    runner.execute(random_segments(rng, slots[:1], [0], V), torch.tensor([0]))
    with pytest.raises(AssertionError, match="host sync"):  # the guard itself works
        with _fail_on_host_sync():
            torch.ones(2).tolist()


@pytest.mark.parametrize("seed,n", [(1, 3), (2, 8)])
def test_padded_engine_equals_plain_solo(target, seed, n):
    """Requests of every method sharing padded steps emit exactly what each emits alone on the plain
    runner (T = 0, float32)."""
    service = tiny_service(target, tiny_drafter(target, seed=3, block_size=6))
    reqs = _mixed_requests(seed, n)
    arrivals: dict[int, list] = {}
    for i, r in enumerate(reqs):
        arrivals.setdefault(2 * (i % 3), []).append(r)
    engine = _engine(target, service, max_running=8, prefill_chunk=4, max_step_tokens=64, cuda_graphs=True)
    assert engine.runner.graphed and engine.num_free_slots() == 8
    got, _ = _run_batched(engine, arrivals)
    for rid, prompt, sampling, spec in reqs:
        assert got[rid] == _solo(target, service, prompt, sampling, spec), (rid, spec.method)


def _cuda_target(arch):
    from services.testing import tiny_target

    target = tiny_target(arch, **TARGET_KW)
    target.model.to("cuda")
    target.device = torch.device("cuda")
    return target


def _grid_runner(target, monkeypatch, captured: bool) -> ModelRunner:
    """A padded runner on CUDA with the same grid as every other one here, captured or not
    (``DARTREE_CUDA_GRAPHS=0``: the grid's buckets, each run eagerly)."""
    with monkeypatch.context() as m:
        if not captured:
            m.setenv("DARTREE_CUDA_GRAPHS", "0")
        runner = ModelRunner(target, num_slots=4, capacity=200, kv_bucket=8)  # CUDA: padded by default
        info = runner.capture_graphs(max_rows=48, segment_rows=16)
    assert runner.graphed and not runner.compiled and (info["graphs"] > 0) == captured
    return runner


def _steps(runners, n_steps=8, seed=0):
    """The same random steps on every runner, committed on each: yields their outputs per step."""
    rng = random.Random(seed)
    walk = LockstepSlots(tuple(runners))
    for step in range(n_steps):
        segs = walk.segments(rng, step, V)
        yield [r.execute(segs) for r in runners]
        walk.commit(segs)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graphed_runner_equals_eager_runner_on_cuda(arch, monkeypatch):
    """On a GPU the grid is captured at start and its graphs replay what the eager unpadded runner
    computes, step after step (equal up to float32 reduction order: other shapes)."""
    target = _cuda_target(arch)
    eager = ModelRunner(target, num_slots=4, capacity=200, kv_bucket=8, cuda_graphs=False)
    graphed = _grid_runner(target, monkeypatch, captured=True)
    for a, b in _steps([eager, graphed]):
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.features, a.features, rtol=1e-4, atol=1e-4)
    assert graphed.num_eager_steps == 0  # every step was in the grid


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graph_replay_equals_the_eager_padded_step_bitwise(arch, monkeypatch):
    """A replayed graph computes the very padded step it captured: logits, features and the KV it
    writes equal, bit for bit, the same grid bucket run eagerly."""
    target = _cuda_target(arch)
    graphed = _grid_runner(target, monkeypatch, captured=True)
    eager = _grid_runner(target, monkeypatch, captured=False)
    for a, b in _steps([eager, graphed]):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.features, b.features)
    assert graphed.num_eager_steps == 0 and eager.num_eager_steps == 0
    for k_a, k_b in zip(eager.cache.keys, graphed.cache.keys):
        assert torch.equal(k_a[:4], k_b[:4])
