"""services/verifier/graph_grid.py: which verify-step shapes a CUDA target captures at start, and
that every step the engine can run in the grid's limits lands on one of them (CPU: pure arithmetic
over :func:`~services.tree.batch.step_bucket`; nothing is captured off CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

from services.tree.batch import StepBucket, causal_segment, pack_segments, step_bucket
from services.cuda_graphs import kv_lengths, segment_counts
from services.verifier.graph_grid import row_buckets, verify_grid
from services.verifier.runner import ModelRunner


def test_rows_kv_lengths_and_segments_of_the_grid():
    assert row_buckets(1) == (1,)
    assert row_buckets(65) == (1, 16, 32, 48, 64, 80)
    assert row_buckets(520) == (1,) + tuple(range(16, 529, 16))
    assert kv_lengths(64, 1089) == (64, 128, 256, 512, 1024, 1089)  # kv_bucket x 2^i, capped
    assert kv_lengths(64, 512) == (64, 128, 256, 512)
    assert segment_counts(8) == (1, 2, 4, 8) and segment_counts(6) == (1, 2, 4, 6) and segment_counts(1) == (1,)
    with pytest.raises(ValueError, match="kv_bucket"):
        kv_lengths(0, 10)


def test_grid_for_eight_requests_of_b64_trees():
    """max_running 8, B = 64 (65 rows a request), max_step_tokens 512, a 1089-column slot."""
    g = verify_grid(max_segments=8, max_rows=min(512, 8 * 65), segment_rows=65, kv_bucket=64, capacity=1089,
                    max_graphs=1000)
    assert g.segment_rows == 80 and g.rows == row_buckets(512) and g.dropped_rows == ()
    pairs = {(b.segments, b.rows) for b in g.buckets}
    assert {r for n, r in pairs if n == 1} == {1, 16, 32, 48, 64, 80}  # one request: ar row .. its whole tree
    assert {r for n, r in pairs if n == 2} == set(range(16, 161, 16))  # two requests: up to 2 x 80
    assert {r for n, r in pairs if n == 8} == set(range(16, 513, 16))  # 5-8 requests: at least 5 rows
    assert len(g.buckets) == len(pairs) * 6 and len(set(g.buckets)) == len(g.buckets)
    for b in g.buckets:  # rows per segment: a lone request all its rows, else at most a tree's bucket
        assert b.rows_per_segment == (b.rows if b.segments == 1 else min(b.rows, 80))
        assert b.logit_rows == b.rows and b.rows <= b.segments * b.rows_per_segment
    assert g.buckets[0].kv_length == 1089 and g.buckets[-1] == StepBucket(1, 1, 1, 64, 1)  # widest first
    assert "graphs: rows 1..512 by 16" in g.describe()


def test_grid_shrinks_widest_rows_first_past_max_graphs():
    full = verify_grid(8, 512, 65, 64, 1089, max_graphs=10_000)
    small = verify_grid(8, 512, 65, 64, 1089, max_graphs=120)
    assert len(full.buckets) > 120 >= len(small.buckets) > 0
    assert small.dropped_rows and small.dropped_rows[-1] == 512 and small.rows[-1] < small.dropped_rows[0]
    assert set(small.buckets) <= set(full.buckets)
    assert max(b.rows for b in small.buckets) == small.rows[-1] and "left out" in small.describe()
    tiny = verify_grid(8, 512, 65, 64, 1089, max_graphs=3)  # one row bucket left: shortest KV lengths
    assert len(tiny.buckets) <= 3 and {b.rows for b in tiny.buckets} == {1}
    with pytest.raises(ValueError, match="max_graphs"):
        verify_grid(8, 512, 65, 64, 1089, max_graphs=0)


@pytest.mark.parametrize("seed", range(3))
def test_every_step_within_the_limits_lands_in_the_grid(seed):
    """Random steps of up to 8 requests, each an ar row or a tree of up to B + 1 = 17 rows, at most
    64 rows in all, at any context: the grid's bucketing puts each on a captured shape; a wider
    segment beside another, or more rows, falls outside."""
    rng = random.Random(seed)
    cap, grid = 300, verify_grid(max_segments=8, max_rows=64, segment_rows=17, kv_bucket=16, capacity=300)
    for _ in range(200):
        n = rng.randrange(1, 9)
        sizes = [rng.choice([1, rng.randrange(2, 18)]) for _ in range(n)]
        while sum(sizes) > 64:
            sizes[sizes.index(max(sizes))] -= 1
        segs = [causal_segment([5] * r, rng.randrange(0, cap - r), slot) for slot, r in enumerate(sizes)]
        p = pack_segments(segs, 16, cap, with_mask=False)
        assert step_bucket(p, sum(sizes), 8, 16, cap, segment_rows=grid.segment_rows) in grid, sizes
    wide = pack_segments([causal_segment([5] * 33, 0, 0), causal_segment([5], 0, 1)], 16, cap, with_mask=False)
    assert step_bucket(wide, 34, 8, 16, cap, segment_rows=grid.segment_rows) not in grid
    many = pack_segments([causal_segment([5] * 16, 0, s) for s in range(5)], 16, cap, with_mask=False)
    assert step_bucket(many, 80, 8, 16, cap, segment_rows=grid.segment_rows) not in grid  # 80 > 64 rows


def test_on_cpu_nothing_is_captured_and_graphs_are_off_by_default(target):
    runner = ModelRunner(target, num_slots=2, capacity=64, kv_bucket=8)
    assert not runner.graphed and runner.padded is None and runner.num_eager_steps == 0
    with pytest.raises(RuntimeError, match="nothing to capture"):
        runner.capture_graphs(16, 16)
    padded = ModelRunner(target, num_slots=2, capacity=64, kv_bucket=8, cuda_graphs=True)
    info = padded.capture_graphs(max_rows=32, segment_rows=16)
    assert info["graphs"] == 0 and info["pool_bytes"] == 0 and padded.graphs.num_captured() == 0
    assert padded.graphs.pool is None and len(padded.graphs.steps) == len(padded.padded.grid.buckets) > 0
    assert not any(s.captured for s in padded.graphs.steps.values())
    assert torch.device(target.device).type == "cpu"


def test_the_flag_and_the_refusal_off_cuda():
    """``--no-cuda-graphs`` turns the padded steps off on CUDA; ``--cuda-graphs`` on another device is
    refused at start with the reason; unset they follow the device (the memory plan's ``graphed``)."""
    from services.cli import build_parser, command_parser
    from services.config_cli import config_from_args
    from services.verifier.config import EngineConfig, VerifierWorkerConfig

    parser = command_parser(build_parser(), "serve")
    for argv, want in (([], None), (["--no-cuda-graphs"], False), (["--cuda-graphs"], True)):
        args = parser.parse_args(argv + ["--device", "cuda"])
        assert config_from_args(VerifierWorkerConfig, args).engine.cuda_graphs is want
    with pytest.raises(ValueError, match=r"^--cuda-graphs needs a CUDA device \(got --device cpu\)"):
        VerifierWorkerConfig(device="cpu", engine=EngineConfig(cuda_graphs=True))
    assert VerifierWorkerConfig(device="cpu", engine=EngineConfig(cuda_graphs=False)).engine.cuda_graphs is False
