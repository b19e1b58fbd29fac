"""The drafter's block forward through CUDA graphs captured at start, with an eager fallback.

A DFlash block forward (:meth:`services.drafter.model.DFlashDrafter.block_forward`) runs ``Q`` block
rows of ``n`` requests against each request's context K/V. On a GPU its few layers are a few hundred
small launches; :class:`GraphedBlock` captures it once per key ``(n', Q, C')`` at start and replays:

- ``n'``: requests rounded up to a power of two, at most ``max_batch`` (padding requests see one
  zero context column and their rows are dropped);
- ``Q``: block rows, each value the service can run (:meth:`DrafterService.rows_for`);
- ``C'``: the longest context rounded up to ``ctx_bucket`` times a power of two, at most
  ``max_context``.

Every graph reads the same static buffers (block embeddings ``[B, Qmax, H]``, positions, a context
mask ``[B, Qmax, Cmax]`` and every layer's context K/V ``[L, 2, B, Hkv, Cmax, Dh]``): a call copies
its requests' contexts into them (one copy of the K/V the call reads; the eager batched path copies
them into its scratch too) and the key's graph reads its views. The mask makes the call attend to
each request's own context only, so a replay equals the eager masked block forward of the same
padded inputs (bitwise on the same device, the same kernels), and an eager unpadded call to
rounding. A call outside the grid (more requests, another row count, a longer context) runs the
eager block forward and is counted in :attr:`GraphedBlock.num_eager_calls`. Off CUDA nothing is
captured (the same padded calls run eagerly: the CPU tests of the padding).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import Tensor

from services.cuda_graphs import GraphBuckets, graphs_enabled, kv_lengths, segment_counts

log = logging.getLogger("drafter")

DEFAULT_GRAPH_CONTEXT = 4096  # contexts up to this are captured (longer ones run eagerly)
DEFAULT_MAX_BATCH = 8         # requests of one drafter call that are captured (as the default --max-running)


class GraphedBlock:
    """A drafter's block forward at fixed shapes (module docstring).

    Args:
        block_forward: ``(emb [n, Q, H], pos [n, Q], ctx [(K, V) [n, Hkv, C, Dh]] per layer,
            mask [n, Q, C] bool) -> [n, Q, H]``; layers, kv_heads, head_dim, hidden: its shapes.
        dtype, device: of the drafter's activations.
        rows: the block row counts to capture; max_batch, max_context, ctx_bucket: the grid's bounds.
        enabled: capture on CUDA (False, or off CUDA: every call runs eagerly through the padding).
    Raises:
        ValueError: a bound below 1 or no row count.
    """

    def __init__(self, block_forward: Callable[..., Tensor], layers: int, kv_heads: int, head_dim: int, hidden: int,
                 dtype: torch.dtype, device, rows: tuple[int, ...], max_batch: int = DEFAULT_MAX_BATCH,
                 max_context: int = DEFAULT_GRAPH_CONTEXT, ctx_bucket: int = 128, enabled: bool = True):
        if not rows or min(rows) < 1 or max_batch < 1 or max_context < 1:
            raise ValueError(f"a graphed block needs row counts, max_batch and max_context >= 1 "
                             f"(got {rows}, {max_batch}, {max_context})")
        self.block_forward, self.layers = block_forward, layers
        self.device = torch.device(device)
        self.rows, self.batches = tuple(sorted(set(rows))), segment_counts(max_batch)
        self.ctx_lengths = kv_lengths(min(ctx_bucket, max_context), max_context)
        self.max_batch, self.max_context = max_batch, max_context
        q = max(self.rows)
        self.emb = torch.zeros(max_batch, q, hidden, dtype=dtype, device=self.device)
        self.pos = torch.zeros(max_batch, q, dtype=torch.long, device=self.device)
        self.mask = torch.zeros(max_batch, q, max_context, dtype=torch.bool, device=self.device)
        self.kv = torch.zeros(layers, 2, max_batch, kv_heads, max_context, head_dim, dtype=dtype, device=self.device)
        self.graphs = GraphBuckets(self._make, enabled=enabled and self.device.type == "cuda" and graphs_enabled(),
                                   lazy=False, share_inputs=True)
        self.num_eager_calls = 0  # calls outside the grid (run by the eager block forward)

    def grid(self) -> list[tuple[int, int, int]]:
        """Every key ``(n', Q, C')``, widest first."""
        return [(n, q, c) for c in reversed(self.ctx_lengths) for n in reversed(self.batches) for q in reversed(self.rows)]

    def key(self, n: int, q: int, context: int) -> tuple[int, int, int] | None:
        """The key of a call of ``n`` requests, ``q`` rows, longest context ``context`` (None: outside the grid)."""
        if n > self.max_batch or q not in self.rows or context > self.max_context:
            return None
        return (next(b for b in self.batches if b >= n), q, next(c for c in self.ctx_lengths if c >= max(context, 1)))

    def _views(self, key: tuple[int, int, int]) -> tuple[Tensor, ...]:
        n, q, c = key
        kv = [self.kv[li, j, :n, :, :c] for li in range(self.layers) for j in (0, 1)]
        return (self.emb[:n, :q], self.pos[:n, :q], self.mask[:n, :q, :c], *kv)

    def _make(self, key):
        def block(emb, pos, mask, *kv):
            ctx = [(kv[2 * li], kv[2 * li + 1]) for li in range(self.layers)]
            return self.block_forward(emb, pos, ctx, mask)
        return block

    def capture(self) -> dict:
        """Capture every key of :meth:`grid` (on CUDA; elsewhere only record them), logged.

        Returns:
            ``{"graphs": captured, "seconds": ..., "static_bytes": the shared input buffers' bytes}``.
        """
        t0 = time.perf_counter()
        self.mask[:, :, 0] = True  # capture on visible zero columns: finite everywhere
        for key in self.grid():
            self.graphs.capture(key, *self._views(key))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        nbytes = sum(t.nbytes for t in (self.emb, self.pos, self.mask, self.kv))
        took = time.perf_counter() - t0
        log.info("CUDA graphs of the drafter block: %d keys (requests %s x rows %s x contexts %s), %d captured in "
                 "%.1f s, %.2f GiB of shared inputs", len(self.graphs.steps), self.batches, self.rows,
                 self.ctx_lengths, self.graphs.num_captured(), took, nbytes / 2**30)
        return {"graphs": self.graphs.num_captured(), "seconds": took, "static_bytes": nbytes}

    def __call__(self, emb: Tensor, pos: Tensor, bufs: list[Tensor | None], lens: list[int]) -> Tensor | None:
        """The block of ``n`` requests: ``emb [n, Q, H]``, ``pos [n, Q]``, each request's context
        buffer ``[L, 2, Hkv, cap, Dh]`` (None: empty) filled to ``lens[i]``. Returns ``[n, Q, H]``
        (a fresh tensor), or None when the call is outside the grid (counted; the caller runs the
        eager block forward)."""
        n, q = emb.shape[:2]
        key = self.key(n, q, max(lens))
        if key is None or key not in self.graphs.steps:
            self.num_eager_calls += 1
            return None
        nk, _, c = key
        self.emb[:n, :q] = emb
        self.emb[n:nk, :q] = 0
        self.pos[:n, :q] = pos
        self.pos[n:nk, :q] = 0
        mask = self.mask[:nk, :q, :c]
        mask.copy_((torch.arange(c, device=self.device)[None, :]
                    < torch.tensor(list(lens) + [1] * (nk - n), device=self.device)[:, None])[:, None, :].expand_as(mask))
        for i, (buf, length) in enumerate(zip(bufs, lens)):
            if buf is not None and length:
                self.kv[:, :, i, :, :length] = buf[..., :length, :]
        return self.graphs.run(key, *self._views(key))[:n].clone()


def graphed_block_for(service, cuda_graphs: bool | None) -> GraphedBlock | None:
    """The :class:`GraphedBlock` of a :class:`~services.drafter.service.DrafterService` (its block
    forward, shapes, every row count :meth:`~services.drafter.service.DrafterService.rows_for` can
    return), or None for eager blocks. ``cuda_graphs`` None: on for a CUDA drafter that is not
    compiled; True: on (off CUDA its padded calls run eagerly: the CPU tests).

    Raises:
        ValueError: ``cuda_graphs`` True for a drafter with a scaled RoPE (its frequencies are
            copied from the host every call, which a CUDA graph cannot capture; auto leaves it eager).
    """
    c = service.cfg
    on = (service.device.type == "cuda" and not service.compiled) if cuda_graphs is None else bool(cuda_graphs)
    if on and c.rope_scaling:
        if cuda_graphs:
            raise ValueError("--cuda-graphs: this drafter's scaled RoPE copies its frequencies from the host on "
                             "every block, which a CUDA graph cannot capture; pass --no-cuda-graphs")
        log.info("drafter block left eager: its scaled RoPE cannot be captured in a CUDA graph")
        return None
    if not on:
        return None
    rows = {service.rows_for(r) for r in range(c.num_draft_slots + 1)} | {service.rows_for(None)}
    return GraphedBlock(service.drafter.block_forward, c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                        c.hidden_size, service.dtype, service.device, tuple(rows),
                        max_context=min(DEFAULT_GRAPH_CONTEXT, c.max_position_embeddings))
