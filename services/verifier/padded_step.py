"""Padded verify steps (the runner's CUDA-graph path): pad a step to its bucket, replay the bucket's
graph (or run it eagerly past the grid), slice the real rows out.

:class:`PaddedSteps` belongs to a :class:`~services.verifier.runner.ModelRunner` with ``cuda_graphs``.
Its buckets come from :func:`~services.tree.batch.step_bucket` with the grid's ``segment_rows``
(:mod:`services.verifier.graph_grid`); :meth:`PaddedSteps.capture` captures a
:class:`~services.verifier.graph_grid.GraphGrid` at start, every bucket's graph in one shared memory
pool, widest first. Captured steps copy their logits and features into two output buffers shared
by every graph (sized for the widest bucket), so the pool holds one step's activations rather than
every graph's outputs; a replay's outputs are sliced and cloned before the next step. A step whose
bucket is not captured runs the same padded callable eagerly (fresh outputs) and is counted in
:attr:`PaddedSteps.num_eager_steps` (the ``dartree_graph_eager_steps_total`` metric). Off CUDA (or
with ``DARTREE_CUDA_GRAPHS=0``) nothing is captured: every step runs eagerly, and only steps
outside the grid are counted, so the CPU tests check the grid's choice of graph or eager.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import Tensor

from services.cuda_graphs import GraphBuckets, graphs_enabled
from services.tree.batch import (PackedRows, Segment, StepBucket, pad_packed, padded_step_mask, padded_tree_rows,
                                 step_bucket)
from services.verifier.graph_grid import GraphGrid

log = logging.getLogger("verifier")

# forward(p, ids [1, R'], pos [1, R'], keep [K']) -> (logits [K', V] float32, features [R', F])
Forward = Callable[[PackedRows, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def grid_inputs(bucket: StepBucket, scratch_slot: int, device) -> tuple[Tensor, ...]:
    """Example inputs of ``bucket``'s step that write and read only ``scratch_slot`` (every row and
    segment a padding one): what a capture runs on. The order of :meth:`PaddedSteps.step_inputs`."""
    b, dev = bucket, device
    zeros = torch.zeros(b.rows, dtype=torch.long, device=dev)
    row_index = torch.full((b.segments, b.rows_per_segment), -1, dtype=torch.long, device=dev)
    row_index.view(-1)[:b.rows] = torch.arange(b.rows, device=dev)
    slots = torch.full((b.segments,), scratch_slot, dtype=torch.long, device=dev)
    seg_zeros = torch.zeros(b.segments, dtype=torch.long, device=dev)
    parents = torch.full((b.segments, b.rows_per_segment), -1, dtype=torch.long, device=dev)
    return (zeros[None], zeros[None].clone(), torch.full_like(zeros, scratch_slot), zeros.clone(), slots, row_index,
            torch.arange(b.rows, device=dev), seg_zeros, seg_zeros.clone(), parents,
            torch.arange(b.logit_rows, device=dev))


class PaddedSteps:
    """A runner's padded steps over its slot cache.

    Args:
        cache: the runner's :class:`~services.verifier.kv_cache.SlotKVCache` (``scratch_slot`` reserved in it).
        scratch_slot: the slot padding rows write to; kv_bucket: the runner's KV rounding.
        forward: the target's forward over a padded step's metadata (:data:`Forward`; no host sync).
        device: the target's device; enabled: capture on CUDA (False: every step eager).
    Attributes:
        grid: the captured :class:`~services.verifier.graph_grid.GraphGrid` (None before :meth:`capture`:
            buckets then follow :func:`~services.tree.batch.step_bucket` without ``segment_rows``).
        graphs: the :class:`~services.cuda_graphs.GraphBuckets` (not lazy: only the grid is captured).
    """

    def __init__(self, cache, scratch_slot: int, kv_bucket: int, forward: Forward, device, enabled: bool):
        self.cache, self.scratch_slot, self.kv_bucket, self.forward = cache, scratch_slot, kv_bucket, forward
        self.device = torch.device(device)
        self.grid: GraphGrid | None = None
        self._out: tuple[Tensor, Tensor] | None = None  # shared outputs of captured steps
        self.graphs = GraphBuckets(self.make_step, enabled=enabled and self.device.type == "cuda" and graphs_enabled(),
                                   lazy=False)

    @property
    def num_eager_steps(self) -> int:
        """Steps run eagerly because their bucket was not captured."""
        return self.graphs.num_eager_overflow

    def bucket(self, p: PackedRows, logit_rows: int) -> StepBucket:
        """The bucket of step ``p`` with ``logit_rows`` logit rows (the grid's bucketing once captured)."""
        return step_bucket(p, logit_rows, self.scratch_slot, self.kv_bucket, self.cache.capacity,
                           segment_rows=self.grid.segment_rows if self.grid is not None else None)

    def capture(self, grid: GraphGrid, vocab: int, feature_dim: int, feature_dtype: torch.dtype) -> dict:
        """Capture every bucket of ``grid`` (on CUDA; elsewhere only record them), logged.

        Returns:
            ``{"graphs": captured count, "seconds": ..., "pool_bytes": device memory the graphs and
            their output buffers took (0 off CUDA)}``.
        """
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.device) if cuda else 0
        rows = max((b.rows for b in grid.buckets), default=1)
        self._out = (torch.empty(rows, vocab, dtype=torch.float32, device=self.device),
                     torch.empty(rows, feature_dim, dtype=feature_dtype, device=self.device))
        self.grid = grid
        self.cache.prepare([self.scratch_slot], max((b.kv_length for b in grid.buckets), default=0))
        for b in grid.buckets:
            self.graphs.capture(b, *grid_inputs(b, self.scratch_slot, self.device))
        if cuda:
            torch.cuda.synchronize(self.device)
        took = time.perf_counter() - t0
        pool = torch.cuda.memory_reserved(self.device) - before if cuda else 0
        log.info("CUDA graphs of the verify step: %s; %d captured in %.1f s, %.2f GiB (graph pool and outputs)",
                 grid.describe(), self.graphs.num_captured(), took, pool / 2**30)
        return {"graphs": self.graphs.num_captured(), "seconds": took, "pool_bytes": pool}

    def execute(self, segments: list[Segment], p: PackedRows, logit_rows: Tensor | None) -> tuple[Tensor, Tensor]:
        """Step ``p`` (of ``segments``) at its bucket: ``(logits [K, V] float32, features [R, F])`` of
        its real rows (fresh tensors). The step's mask is built inside the step from the segments'
        starts, row counts and parent rows (:func:`~services.tree.batch.padded_step_mask`)."""
        r = p.input_ids.numel()
        k = r if logit_rows is None else int(logit_rows.numel())
        bucket = self.bucket(p, k)
        padded = pad_packed(p, bucket, self.scratch_slot)
        self.cache.prepare(sorted(set(padded.slots.tolist())), bucket.kv_length)
        keep = torch.zeros(bucket.logit_rows, dtype=torch.long)
        keep[:k] = torch.arange(k) if logit_rows is None else logit_rows.long().cpu()
        logits, feats = self.graphs.run(bucket, *(t.to(self.device) for t in (
            padded.input_ids[None], padded.positions[None], padded.write_slot, padded.write_pos, padded.slots,
            padded.row_index, padded.padded_pos, *padded_tree_rows(segments, bucket), keep)))
        # a replay's outputs are the shared static buffers: the next replay overwrites them
        return logits[:k].clone(), feats[:r].clone()

    def make_step(self, bucket: StepBucket):
        """The callable of one bucket (captured by :class:`~services.cuda_graphs.GraphBuckets`): the
        :func:`grid_inputs` tensors in, ``(logits [K', V] float32, features [R', F])`` out; every
        shape fixed by ``bucket``, no host sync inside. A bucket of the grid writes its outputs into
        the shared buffers (views of them are returned)."""
        shared = self._out if self.grid is not None and bucket in self.grid else None

        def step(ids, pos, write_slot, write_pos, slots, row_index, padded_pos, starts, num_rows, parents, keep):
            none = ids.new_zeros(0)
            attn_mask = padded_step_mask(starts, num_rows, parents, bucket.kv_length)  # [n', 1, Rm', L']
            p = PackedRows(input_ids=ids[0], positions=pos[0], cu_rows=none, slots=slots, starts=none,
                           row_index=row_index, padded_pos=padded_pos, write_slot=write_slot, write_pos=write_pos,
                           attn_mask=attn_mask, kv_length=bucket.kv_length)
            logits, feats = self.forward(p, ids, pos, keep)
            if shared is None:
                return logits, feats
            out_logits, out_feats = shared[0][:logits.shape[0]], shared[1][:feats.shape[0]]
            out_logits.copy_(logits)
            out_feats.copy_(feats)
            return out_logits, out_feats

        return step
