"""services/drafter/graphed_block.py: the drafter's block forward at fixed shapes (CUDA graphs).

On CPU nothing is captured: the same padded calls run eagerly, so the padding (requests, context
columns, the mask) is checked here against the eager block, with the grid's choice of graph or
eager and its count; the ``gpu`` tests check that a replay equals the eager padded block bitwise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.drafter.build import build_drafter
from services.drafter.graphed_block import GraphedBlock
from services.testing import tiny_drafter
from tests.engine.test_padded_steps import _fail_on_host_sync


def _service(target, **kw):
    drafter = tiny_drafter(target, seed=3, block_size=6).to(torch.device(target.device))
    return build_drafter(drafter, target.embed_tokens(), target.lm_head(), packed_gemm=False, **kw)


def _contexts(service, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    for i, n in enumerate(lengths):
        service.append_context(f"r{i}", torch.randn(n, service.cfg.feature_dim, generator=g).to(service.dtype), n)
    return [(f"r{i}", 5 + i, n) for i, n in enumerate(lengths)]


def _close(a, b):
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # padded context columns: other reduction blocks


def test_padded_block_equals_the_eager_block(target):
    """Alone and batched, full block or fewer rows: the padded block (what a graph replays) gives
    the eager block's drafter states and logits to float32 rounding; every call is in the grid."""
    eager, graphed = _service(target), _service(target, cuda_graphs=True)
    assert eager.graphed is None and isinstance(graphed.graphed, GraphedBlock)
    assert graphed.graphed.graphs.num_captured() == 0 and len(graphed.graphed.graphs.steps) == len(
        graphed.graphed.grid())  # CPU: keys recorded at start, nothing captured
    for lengths, rows in (([37], None), ([37], 2), ([12, 53, 7], None), ([129, 3], 3)):
        jobs = [_contexts(s, lengths) for s in (eager, graphed)][0]
        for (h_a, l_a), (h_b, l_b) in zip(eager.block_logits_batch(jobs, rows), graphed.block_logits_batch(jobs, rows)):
            _close(h_a, h_b)
            _close(l_a, l_b)
        for s in (eager, graphed):
            for rid, *_ in jobs:
                s.release(rid)
    assert graphed.graphed.num_eager_calls == 0


def test_calls_outside_the_grid_run_eager_and_are_counted(target):
    service = _service(target, cuda_graphs=True)
    block = service.graphed
    assert block.key(1, block.rows[-1], 37) == (1, block.rows[-1], 128)
    assert block.key(3, block.rows[0], 129) == (4, block.rows[0], 256)
    assert block.key(9, block.rows[0], 10) is None  # more requests than max_batch
    assert block.key(1, block.rows[0], block.max_context + 1) is None  # a longer context
    small = _service(target, cuda_graphs=True)
    small.graphed = GraphedBlock(small.drafter.block_forward, small.cfg.num_hidden_layers,
                                 small.cfg.num_key_value_heads, small.cfg.head_dim, small.cfg.hidden_size, small.dtype,
                                 small.device, rows=block.rows, max_batch=2, max_context=64, ctx_bucket=32)
    small.graphed.capture()
    ref = _service(target)
    for lengths, counted in (([20], 0), ([40, 10], 0), ([70], 1), ([5, 5, 5], 1)):
        jobs = [_contexts(s, lengths) for s in (ref, small)][0]
        before = small.graphed.num_eager_calls
        for (h_a, _), (h_b, _) in zip(ref.block_logits_batch(jobs), small.block_logits_batch(jobs)):
            _close(h_a, h_b)
        assert small.graphed.num_eager_calls - before == counted, lengths
        for s in (ref, small):
            for rid, *_ in jobs:
                s.release(rid)


def test_the_block_callable_holds_no_host_sync(target):
    """What a graph captures reads no tensor value on the host (a CPU proxy of capturable)."""
    service = _service(target, cuda_graphs=True)
    block = service.graphed
    key = block.key(2, block.rows[-1], 40)
    with _fail_on_host_sync():
        out = block._make(key)(*block._views(key))
    assert out.shape == (key[0], key[1], service.cfg.hidden_size)


def test_default_off_cpu_and_refusals(target):
    assert _service(target).graphed is None  # CPU: eager blocks, nothing to capture
    drafter = tiny_drafter(target, seed=3, block_size=6)
    drafter.config = dataclasses.replace(drafter.config, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="scaled RoPE .* pass --no-cuda-graphs"):
        build_drafter(drafter, target.embed_tokens(), target.lm_head(), packed_gemm=False, cuda_graphs=True)
    from services.drafter.worker import DrafterWorkerConfig

    with pytest.raises(ValueError, match=r"^--cuda-graphs needs a CUDA device \(got --device cpu\)"):
        DrafterWorkerConfig(device="cpu", cuda_graphs=True)


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_drafter_graph_replay_equals_the_eager_padded_block_bitwise(arch, monkeypatch):
    """On a GPU the block's grid is captured at start (the default there) and a replay gives the
    very bits of the same padded block run eagerly, alone and batched."""
    from services.testing import tiny_target
    from tests.engine.conftest import TARGET_KW

    target = tiny_target(arch, **TARGET_KW)
    target.model.to("cuda")
    target.device = torch.device("cuda")
    graphed = _service(target)  # CUDA: graphs by default
    with monkeypatch.context() as m:
        m.setenv("DARTREE_CUDA_GRAPHS", "0")
        eager = _service(target, cuda_graphs=True)  # the same padded calls, uncaptured
    assert graphed.graphed.graphs.num_captured() == len(graphed.graphed.grid()) > 0
    assert eager.graphed.graphs.num_captured() == 0
    for lengths, rows in (([37], None), ([12, 53, 7], None), ([129, 3], 3)):
        jobs = [_contexts(s, lengths) for s in (eager, graphed)][0]
        for (h_a, l_a), (h_b, l_b) in zip(eager.block_logits_batch(jobs, rows), graphed.block_logits_batch(jobs, rows)):
            assert torch.equal(h_a, h_b) and torch.equal(l_a, l_b)
        for s in (eager, graphed):
            for rid, *_ in jobs:
                s.release(rid)
    assert graphed.graphed.num_eager_calls == 0
