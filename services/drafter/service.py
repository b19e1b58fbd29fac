"""The drafter's compute, transport-agnostic: the drafter, its borrowed target I/O and per-request contexts.

:class:`DrafterService` loads and prepares the drafter (weights packed or rounded to int4, the
reduced vocabulary's lm_head rows, compiled or graphed block forward) and owns each request's
drafter context (K/V only, appended in place). One call per step drafts for every drafting request
at once (:meth:`DrafterService.draft_batch`, assembled in :mod:`services.drafter.draft_batch`;
each method's tree in :mod:`services.drafter.tree_builders`; docs/algorithms.md §1.3, §2.2, §2.3, §4).
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from services.drafter.draft_batch import DraftBatching
from services.drafter.model import DFlashDrafter
from services.drafter.ngram_drafts import NgramDrafts
from services.protocol import (DFLASH_METHODS, EAGLE3_METHODS, HEAD_METHODS, MARKOV_METHODS,  # noqa: F401 (re-exported)
                               METHODS, served_methods)


# Context appends of at least this many rows (a catch-up) go through dense bfloat16 copies of an
# int4 drafter's context projections (DrafterService catch_up_rows).
CATCH_UP_DENSE_ROWS = 32


class DrafterService(DraftBatching):
    """Owns the drafter, the borrowed target embedding / lm_head, and per-request drafter contexts.

    A drafter with a reduced draft vocabulary (``draft_vocab_size = N``) projects onto the N
    lm_head rows its ``d2t`` map selects; the tree builders run over draft ids and the finished
    tree's tokens are mapped back to target ids, so verification and acceptance see target ids only.

    Args:
        drafter: DFlash drafter (with or without a Domino head), eval mode.
        embed: the target's ``embed_tokens``; lm_head: the target's output projection (full vocabulary).
        packed_gemm: on a float32 CPU drafter, pre-pack the drafter's linears for its block rows and
            the lm_head for its draft rows (:mod:`services.cpu_gemm`; numerics unchanged).
        compile: run the drafter's block forward (its layers over the ``block_size`` rows against the
            request's context K/V) through ``torch.compile`` with dynamic shapes (context length and
            batch size vary; one graph for one request, one for a batch); call :meth:`warm_up` at
            start. Drafts may differ from eager ones in the last bits (never the verified output:
            the target decides every token). The tree build stays eager (Python and small ops).
        block_rows: rows of the block forward at inference, ``[root, MASK x (block_rows - 1)]``
            (None = the trained ``block_size``). Fewer rows cost less and draft at most
            ``block_rows`` deep (shift-label) but change the drafts (the mask rows attend to each
            other): ``python -m benchmarks.bench_small_trees tau --blocks`` replays their τ.
        spare_rows: the rows of each call follow the call's budget: the slots its trees can reach
            (:func:`~services.drafter.draft_batch._reach`: a ``dartree-pruned`` / seqheap / DDTree tree of budget B is at most B
            deep) plus ``spare_rows`` more mask rows, at most ``block_rows`` (a draft equals the
            draft of a fixed ``block_rows`` of that many rows); None = always ``block_rows``.
            The default 1 (B + 1 rows for a shift-label drafter) keeps τ within 1-3 % of the
            trained block (benchmarks/results/2026-12-03-draft-cost).
        q4_linears: the drafter's decoder layers and its feature projection ``fc`` as
            :class:`services.q4_weights.Int4Linear` (weights rounded to Q4_1 blocks at load,
            :func:`services.q4_weights.quantize_linears_q4`; the output projection stays bfloat16: on
            the int4 kernel it cost 1.5-3.6 % of replayed τ, benchmarks/results/2026-12-03-draft-cost-small);
            None = when the drafter runs in bfloat16 on a CPU with torch's int4 kernel and
            ``packed_gemm`` is on (next to a q4 or bfloat16 target). Drafts change a little
            (τ in the results above), the served output does not (the target decides every token).
        context_chunk: positions by which a request's context buffer grows (see Context storage).
        cuda_graphs: the block forward through CUDA graphs captured at start for a grid of
            requests x block rows x context lengths (:mod:`services.drafter.graphed_block`; calls
            outside it run eagerly); None = on for a CUDA drafter that is not compiled; True off
            CUDA runs the same padded calls eagerly (the CPU tests). Raises ValueError for a
            drafter whose scaled RoPE cannot be captured when True.
        catch_up_rows: with ``q4_linears``, a context append of at least this many
            positions (a new request's prompt, the tokens of plain rounds) projects through dense
            bfloat16 copies of the int4 ``fc`` and k/v weights, dequantized
            (:meth:`DFlashDrafter.set_dense_context`; 4.6 MB more for the default drafter); None = the
            int4 kernel for every append. Keys / values equal the int4 path's up to rounding.
        ngram_nodes: n-gram drafting (:mod:`services.drafter.ngram_drafts`): after building a
            request's tree, merge in the continuation of its history's longest repeated 3- or
            2-gram, at most this many new nodes on top of the tree's budget; 0 = off. Costs no
            drafter forward; the verified output is unchanged (the target decides every token).

    Context storage: each request's drafter context (the K/V of its committed positions, every
    layer) lives in one buffer ``[L, 2, Hkv, cap, Dh]``; each layer's K or V is a ``[1, Hkv, T, Dh]``
    view of its filled part (rows of T x Dh contiguous values per head). An append writes its
    positions in place; when they leave no free position, the buffer is reallocated to
    :meth:`context_capacity_for` its new length (the next multiple of ``context_chunk`` above it, at
    most ``max_position_embeddings`` while the context is shorter) and the filled part copied once.
    A buffer always keeps a free position so that the views are never contiguous: under ``compile``
    dynamo takes their capacity-dependent strides as symbols, but a view that happened to be
    contiguous (length = capacity) would fail the graph's guard and compile another (tested).
    Slack: 1 to ``context_chunk`` positions a request (2 x L x Hkv x Dh x itemsize bytes a position:
    2,304 B for the default drafter in bfloat16, so at most 0.59 MB a request at the default 256).
    A batched call copies the contexts into one reusable scratch buffer ``[L or 1, 2, n, Hkv, C,
    Dh]`` (padded rows zeroed and masked), kept until the last context is released: one layer's
    K/V at a time, refilled as the block forward reaches each layer (eager), or every layer's
    (compiled: the graph takes a list).
    Raises:
        ValueError: ``block_rows`` outside ``[2, block_size]``, ``spare_rows < 0``, ``context_chunk < 1``,
            ``ngram_nodes < 0``.
    """

    def __init__(self, drafter: DFlashDrafter, embed: torch.nn.Module, lm_head: torch.nn.Module,
                 description: str = "", packed_gemm: bool = True, compile: bool = False,
                 block_rows: int | None = None, spare_rows: int | None = 1, q4_linears: bool | None = None,
                 context_chunk: int = 256, catch_up_rows: int | None = CATCH_UP_DENSE_ROWS,
                 cuda_graphs: bool | None = None, ngram_nodes: int = 0):
        block_rows = drafter.config.block_size if block_rows is None else int(block_rows)
        if not 2 <= block_rows <= drafter.config.block_size:
            raise ValueError(f"block_rows must be in [2, {drafter.config.block_size}] (got {block_rows})")
        if spare_rows is not None and spare_rows < 0:
            raise ValueError(f"spare_rows must be >= 0 or None (got {spare_rows})")
        if context_chunk < 1:
            raise ValueError(f"context_chunk must be >= 1 (got {context_chunk})")
        self.context_chunk = int(context_chunk)
        self.ngram = NgramDrafts(ngram_nodes) if ngram_nodes else None
        self.block_rows, self.spare_rows = block_rows, spare_rows
        own = getattr(drafter, "has_own_io", drafter.has_markov)
        if own:  # DSpark / speculators exports carry their own embedding and lm_head (copies of the target's)
            if drafter.needs_target_io:  # saved without them: they ARE the target's, refill from it
                drafter.copy_target_io(embed.weight.detach().to(self._dtype_of(drafter)),
                                       lm_head.weight.detach().to(self._dtype_of(drafter)))
            embed, lm_head = drafter.embed_tokens, drafter.lm_head
        self.drafter, self.embed = drafter.eval(), embed
        self.cfg = drafter.config
        self.d2t = drafter.draft_to_target()  # [N] target ids, or None (full vocabulary)
        if self.d2t is not None and not own:  # an own head already has the N draft rows
            lm_head = frozen_linear(lm_head.weight.detach()[self.d2t.to(lm_head.weight.device)].clone())
        self.lm_head = lm_head
        self.q4_linears = _want_q4(drafter, packed_gemm) if q4_linears is None else bool(q4_linears)
        if self.q4_linears:
            from services.q4_weights import quantize_linears_q4

            quantize_linears_q4(drafter, self._dtype_of(drafter), names=("layers", "fc"))
        if packed_gemm:
            from services.cpu_gemm import pack_linears, pack_linears_bf16

            pack_linears(drafter, sorted({self.cfg.block_size, block_rows}))
            if spare_rows is not None:  # the rows of a small budget's block: packed on first use
                pack_linears(drafter, [2, 4, 8], lazy=True)
            pack_linears(lm_head, [self.cfg.num_draft_slots])
            pack_linears(lm_head, [2, 4, 8], lazy=True)  # a small tree's slots (_reach): packed on first use
            # bfloat16 drafters: oneDNN's pre-packed kernel (no-op in float32), one call per linear
            # whatever the rows: the drafter only proposes, so its rows need not be batch-invariant
            # (cutting the 576 x 1536 down projection into 1-row calls cost 3-4 ms of a 16-row block)
            pack_linears_bf16(drafter, check=False)
            pack_linears_bf16(lm_head)
        if self.q4_linears and catch_up_rows is not None:
            self._dense_catch_up(drafter, catch_up_rows)
        self.description = description
        self._ctx: dict[str, Tensor] = {}  # request -> [L, 2, Hkv, cap, Dh] context K/V, filled up to _ctx_len
        self._ctx_len: dict[str, int] = {}
        self._batch_ctx: Tensor | None = None  # [(1 or L) * 2 * n * Hkv * C * Dh] scratch of block_logits_batch
        self.dtype = next(drafter.parameters()).dtype
        self.device = next(drafter.parameters()).device  # ids / positions / masks are built here (CUDA too)
        self.compiled = bool(compile)
        self.warm_up_seconds = 0.0
        self._block_forward = (torch.compile(drafter.block_forward, dynamic=True) if compile
                               else drafter.block_forward)
        from services.drafter.graphed_block import graphed_block_for

        self.graphed = graphed_block_for(self, cuda_graphs)  # None: eager blocks

    @staticmethod
    def _dense_catch_up(drafter: DFlashDrafter, min_rows: int) -> None:
        """Dense copies, in the drafter's dtype, of an int4 drafter's ``fc`` and every layer's k/v
        projection, its int4 weights dequantized, for context appends of at least ``min_rows`` rows
        (:meth:`DFlashDrafter.set_dense_context`). Not oneDNN-packed: a pack doubles their 4.6 MB
        (default drafter) and gained nothing at these row counts."""
        from services.q4_weights import Int4Linear

        dtype = drafter.norm.weight.dtype
        kv = [p for layer in drafter.layers for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
        if any(type(m) is not Int4Linear or m.bias is not None for m in [drafter.fc, *kv]):
            return  # a projection left dense (a shape the int4 kernel cannot pack), or a bias: int4 path
        # copies made outside inference mode (dequantized() returns inference tensors)
        fc = frozen_linear(drafter.fc.dequantized().to(dtype, copy=True))
        kvl = frozen_linear(torch.cat([m.dequantized() for m in kv]).to(dtype, copy=True))
        drafter.set_dense_context(fc, kvl, min_rows)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Run the block for two scratch contexts of different lengths, alone and batched (compiles
        every graph when :attr:`compiled`), leaving no context behind. Returns seconds taken."""
        t0 = time.perf_counter()
        # lengths no model dimension is likely to equal: dynamo gives equal sizes one symbol at
        # trace time ("duck sizing"), and a later request whose sizes differ would recompile
        jobs = [("__warm_up_a__", 0, 37), ("__warm_up_b__", 0, 53)]
        try:
            for rid, _, n in jobs:
                self.append_context(rid, torch.zeros(n, self.cfg.feature_dim, dtype=self.dtype, device=self.device), n)
            if self.compiled:  # an eager block first builds the fused int4 kernels the trace then calls
                compiled, self._block_forward = self._block_forward, self.drafter.block_forward  # (FusedInt4)
                try:
                    self.block_logits_batch(jobs[:1])
                finally:
                    self._block_forward = compiled
            for job in jobs:
                self.block_logits_batch([job])
            self.block_logits_batch(jobs)
        finally:
            for rid, *_ in jobs:
                self.release(rid)
        took = time.perf_counter() - t0
        self.warm_up_seconds += took
        return took

    def info(self) -> dict:
        """Handshake fields."""
        c = self.cfg
        return {"vocab_size": c.vocab_size, "draft_vocab_size": c.out_vocab_size, "block_size": c.block_size, "mask_token_id": c.mask_token_id,
                "feature_dim": c.feature_dim, "max_position": c.max_position_embeddings,
                "num_draft_slots": c.num_draft_slots, "has_head": self.drafter.has_head,
                "target_layer_ids": list(c.target_layer_ids),
                "methods": list(served_methods(self.kind)),
                "description": self.description, "context_bytes": self.context_bytes_per_position()}

    def context_bytes_per_position(self) -> int:
        """Device bytes a request's context takes per position: every layer's K and V in its buffer,
        plus its share of the batch scratch (one layer eager, every layer compiled; see Context
        storage). The verifier's memory plan reserves it (:mod:`services.memory_plan`)."""
        c = self.cfg
        one_layer = 2 * c.num_key_value_heads * c.head_dim * torch.empty(0, dtype=self.dtype).element_size()
        return one_layer * (c.num_hidden_layers + (c.num_hidden_layers if self.compiled else 1))

    @staticmethod
    def _dtype_of(m: torch.nn.Module) -> torch.dtype:
        return next(m.parameters()).dtype

    @property
    def kind(self) -> str:
        """``"dspark"``, ``"domino"`` or ``"dflash"`` (see :func:`services.protocol.served_methods`)."""
        return self.cfg.kind

    def num_contexts(self) -> int:
        """Requests holding a drafter context (a gauge: returns to 0 when all are released)."""
        return len(self._ctx)

    def release(self, request_id: str) -> None:
        """Drop a request's drafter context and its buffer (idempotent); the batch scratch goes with
        the last context."""
        self._ctx.pop(request_id, None)
        self._ctx_len.pop(request_id, None)
        if self.ngram is not None:
            self.ngram.release(request_id)
        if not self._ctx:
            self._batch_ctx = None

    def context_capacity(self, request_id: str) -> int:
        """Positions the request's context buffer holds room for (0 without a context)."""
        buf = self._ctx.get(request_id)
        return 0 if buf is None else buf.shape[3]

    def context_capacity_for(self, length: int) -> int:
        """Capacity of a context buffer grown to hold ``length`` positions and at least one more:
        the next multiple of :attr:`context_chunk` above ``length``, cut to
        ``max_position_embeddings`` when ``length`` is below it."""
        cap = (length // self.context_chunk + 1) * self.context_chunk
        limit = self.cfg.max_position_embeddings
        return min(cap, limit) if length < limit else cap

    @torch.inference_mode()
    def append_context(self, request_id: str, features: Tensor, start: int) -> None:
        """Append ``features [n, F]``, the target features of positions ``[start - n, start)``, to
        the request's drafter context (its K/V, written in place; the buffer grows by
        :meth:`context_capacity_for` when full).

        Raises:
            ValueError: the context does not end at ``start - n`` (a gap or an overlap).
        """
        n = features.shape[0]
        have = self._ctx_len.get(request_id, 0)
        if have != start - n:
            raise ValueError(f"drafter context of {request_id!r} holds {have} positions, expected {start - n}")
        if n == 0:
            return
        pos = torch.arange(start - n, start, device=self.device)
        kv = self.drafter.context_kv_packed(features.to(self.device, self.dtype)[None], pos)[0]  # [n, L, 2, Hkv, Dh]
        kv = kv.permute(1, 2, 3, 0, 4)  # [L, 2, Hkv, n, Dh], the buffer's layout
        buf = self._ctx.get(request_id)
        if buf is None or buf.shape[3] <= start:  # keep a free position (see the class)
            grown = kv.new_empty(*kv.shape[:3], self.context_capacity_for(start), kv.shape[4])
            if buf is not None:
                grown[..., :have, :] = buf[..., :have, :]
            self._ctx[request_id] = buf = grown
        buf[..., have:start, :] = kv
        self._ctx_len[request_id] = start


def _want_q4(drafter: DFlashDrafter, packed_gemm: bool) -> bool:
    """The default of ``DrafterService(q4_linears=None)``: a bfloat16 drafter on a device where the
    ``q4`` format's kernels run (:mod:`services.weight_formats`: a CPU with torch's int4 kernel),
    with ``packed_gemm`` on."""
    from services.weight_formats import get as get_format

    p = next(drafter.parameters())
    return packed_gemm and p.dtype == torch.bfloat16 and get_format("q4").available(str(p.device))


def frozen_linear(weight: Tensor) -> torch.nn.Linear:
    """A bias-free ``nn.Linear`` over ``weight [out, in]`` (no gradient; no throw-away random init)."""
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = torch.nn.Parameter(weight, requires_grad=False)
    return lin
