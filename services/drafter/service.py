"""The drafter's compute, transport-agnostic: per-request drafter contexts and tree building.

One call per step, for every drafting request at once (:meth:`DrafterService.draft_batch`): append
each request's newly committed target features to its drafter context (K/V only), run the blocks
``[root, MASK x (block_size - 1)]`` of all requests in one forward, project to logits with the
target's lm_head, and build each request's tree (docs/algorithms.md §1.3, §2.2, §2.3, §4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from services.drafter.model import DFlashDrafter
from services.drafter.ngram_drafts import NgramDrafts
from services.protocol import (DFLASH_METHODS, EAGLE3_METHODS, HEAD_METHODS, MARKOV_METHODS,  # noqa: F401 (re-exported)
                               METHODS, served_methods)
from services.spec import Method
from services.tree import DraftTree, MarkovScorer, chain, chain_rollout, dartree, ddtree, domino_ddtree, seqheap


class DominoScorer:
    """Domino correction head for one round, as a :class:`services.tree.TreeScorer`.

    ``score = cand_vals + SiLU(W_z h_d[slot] + W_s h) . W_out[cand]^T``; states are GRU states
    after ``[root, d_1 .. d_i]`` (docs/algorithms.md §2.3).

    Args:
        drafter: a drafter with a Domino head; embed: target embedding; hd: ``[D, H]`` drafter rows.
        d2t: ``[N]`` target id of each draft id when the drafter drafts over a reduced vocabulary
            (candidate ids are then draft ids; a token is mapped to its target id before the GRU
            embeds it); None = full vocabulary.
    """

    def __init__(self, drafter: DFlashDrafter, embed: torch.nn.Module, hd: Tensor, d2t: Tensor | None = None):
        self.drafter, self.embed, self.d2t, self.hd = drafter, embed, d2t, hd
        self.wz, self.ws, self.wout = drafter.head_split()
        self._z: Tensor | None = None

    @property
    def z(self) -> Tensor:
        """``[D, E]`` = ``hd W_zᵀ``, computed on first use (the same product: a round whose tree
        scores no slot, B = 1 or an early prune, skips it)."""
        if self._z is None:
            self._z = self.hd @ self.wz.T
        return self._z

    def root_state(self, root_token: int) -> Tensor:
        x = self.embed(torch.tensor([root_token], device=self.hd.device)).to(self.hd.dtype)
        return self.drafter.gru_cell(x, None)  # the zero state, without its h @ W_hh product

    def score(self, slot: int, parent_states: Tensor, cand_ids: Tensor | None, cand_vals: Tensor) -> Tensor:
        mid = F.silu(self.z[slot][None, :] + parent_states @ self.ws.T)  # [P, E]
        w = self.wout if cand_ids is None else self.wout[cand_ids]  # [M, E]
        return cand_vals.float()[None, :] + (mid @ w.T).float()

    def advance(self, parent_states: Tensor, tokens: Tensor) -> Tensor:
        if self.d2t is not None:
            tokens = self.d2t[tokens]
        return self.drafter.gru_cell(self.embed(tokens).to(parent_states.dtype), parent_states)


# Context appends of at least this many rows (a catch-up) go through dense bfloat16 copies of an
# int4 drafter's context projections (DrafterService catch_up_rows).
CATCH_UP_DENSE_ROWS = 32


class DrafterService:
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
            (:func:`_reach`: a ``dartree-pruned`` / seqheap / DDTree tree of budget B is at most B
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

    @staticmethod
    def _layer_kv(ctx: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per-layer ``(K, V)`` views ``[B, Hkv, C, Dh]`` of ``ctx [L, 2, B, Hkv, C, Dh]``."""
        return [(ctx[li, 0], ctx[li, 1]) for li in range(ctx.shape[0])]

    def _batch_scratch(self, layers: int, n: int, cmax: int, like: Tensor) -> Tensor:
        """A contiguous ``[layers, 2, n, Hkv, cmax, Dh]`` view of the reusable batch scratch (grown
        to :meth:`context_capacity_for` ``cmax`` positions a row when too small; contents undefined);
        ``like``: a context buffer ``[L, 2, Hkv, cap, Dh]``."""
        shape = (layers, 2, n, like.shape[2], cmax, like.shape[4])
        need = layers * 2 * n * like.shape[2] * cmax * like.shape[4]
        if self._batch_ctx is None or self._batch_ctx.numel() < need:
            self._batch_ctx = None  # free the old scratch before allocating the new one
            self._batch_ctx = like.new_empty(need // cmax * self.context_capacity_for(cmax))
        return self._batch_ctx[:need].view(shape)

    def _batch_kv(self, bufs: list[Tensor | None], lens: list[int]):
        """Per-layer ``(K, V)`` ``[n, Hkv, max(lens), Dh]`` of several contexts (``bufs``: their
        buffers ``[L, 2, Hkv, cap, Dh]``, None for an empty one), zero-padded, in the batch scratch:
        every layer at once when compiled, else one layer at a time (:class:`_LayerwiseContext`)."""
        like = next(b for b in bufs if b is not None)
        scratch = self._batch_scratch(like.shape[0] if self.compiled else 1, len(bufs), max(lens), like)
        for i, (buf, n) in enumerate(zip(bufs, lens)):
            scratch[:, :, i, :, n:].zero_()  # padded rows are masked; zeros keep them finite
            if n and self.compiled:
                scratch[:, :, i, :, :n] = buf[..., :n, :]
        return self._layer_kv(scratch) if self.compiled else _LayerwiseContext(scratch, bufs, lens, like.shape[0])

    def rows_for(self, reach: int | None) -> int:
        """Block rows of a call whose trees use at most ``reach`` draft slots (None = every slot):
        ``block_rows``, or with :attr:`spare_rows` the rows those slots need plus the spare ones."""
        if self.spare_rows is None or reach is None:
            return self.block_rows
        need = reach if self.cfg.shift_label else reach + 1
        return max(1 if self.cfg.shift_label else 2, min(self.block_rows, need + self.spare_rows))

    def _block(self, request_id: str, root_token: int, start: int, logit_rows: int | None = None
               ) -> tuple[Tensor, Tensor]:
        c = self.cfg
        q = self.rows_for(logit_rows)
        ids = torch.tensor([root_token] + [c.mask_token_id] * (q - 1), device=self.device)
        pos = torch.arange(start, start + q, device=self.device)
        emb, buf, length = self.embed(ids).to(self.dtype)[None], self._ctx[request_id], self._ctx_len[request_id]
        h = self.graphed(emb, pos[None], [buf], [length]) if self.graphed is not None else None
        if h is None:  # eager (no graphs, or outside their grid)
            h = self._block_forward(emb, pos, self._layer_kv(buf[:, :, None, :, :length]))
        h = h[0]
        hd = h if c.shift_label else h[1:]
        return hd, self.lm_head(hd[:logit_rows].to(self.lm_head.weight.dtype)).float()

    @torch.inference_mode()
    def block_logits_batch(self, jobs: list[tuple[str, int, int]], logit_rows: int | None = None
                           ) -> list[tuple[Tensor, Tensor]]:
        """The block of several requests (contexts already appended, :meth:`append_context`) in ONE
        forward: ``jobs`` are ``(request_id, root_token, start)``; contexts of different lengths are
        copied into the reusable batch scratch, zero-padded and masked (``ctx_mask``). Returns
        ``(hd [D, H], base_logits [D', N] float32)`` per job (D = the draft slots of :meth:`rows_for`
        ``logit_rows`` block rows; D' = ``min(D, logit_rows)``, None = D: the output projection runs
        only over the slots a tree can reach; N = the draft vocabulary: ``V`` unless reduced;
        column i is target id ``d2t[i]``)."""
        if len(jobs) == 1:
            return [self._block(*jobs[0], logit_rows=logit_rows)]
        c = self.cfg
        n, q = len(jobs), self.rows_for(logit_rows)
        lens = [self._ctx_len.get(rid, 0) for rid, *_ in jobs]
        cmax, dev = max(lens), self.device
        ids = torch.tensor([[root] + [c.mask_token_id] * (q - 1) for _, root, _ in jobs], device=dev)
        pos = torch.stack([torch.arange(start, start + q, device=dev) for _, _, start in jobs])
        emb, bufs = self.embed(ids).to(self.dtype), [self._ctx.get(rid) for rid, *_ in jobs]
        h = self.graphed(emb, pos, bufs, lens) if self.graphed is not None else None  # [n, Q, H]
        if h is None:  # eager (no graphs, or outside their grid)
            ctx = self._batch_kv(bufs, lens)
            mask = (torch.arange(cmax, device=dev)[None, None, :]
                    < torch.tensor(lens, device=dev)[:, None, None]).expand(n, q, cmax)
            h = self._block_forward(emb, pos, ctx, mask)
        hd = h if c.shift_label else h[:, 1:]
        logits = self.lm_head(hd[:, :logit_rows].to(self.lm_head.weight.dtype)).float()
        return [(hd[i], logits[i]) for i in range(n)]

    @torch.inference_mode()
    def draft_batch(self, jobs: list) -> list:
        """Draft several requests with ONE block forward, then build each request's tree.

        Args:
            jobs: ``services.verifier.drafter_client.DraftJob`` s (the drafter worker builds them
                from the wire): ``committed_ids`` are the tokens committed since the request's last
                draft (first draft: the prompt), ``features [len(committed_ids), F]`` their target
                features, ``root_token`` the last committed token at position ``start``; ``method``
                the speculative method; ``spec`` its :class:`~services.spec.TreeKnobs`, every one set
                (the verifier's policy resolved them); ``max_depth`` caps the tree's depth (None =
                every draft slot).
        Returns:
            per job ``(tree, {"draft": s, "tree_build": s})`` (the shared forward's time split evenly)
            or the exception that job raised (the others are unaffected): ValueError for an unknown
            method, a method needing a head this drafter lacks, an unset tree knob, an inconsistent
            context, a request twice in the batch.
        """
        out: list = [None] * len(jobs)
        ok = []
        for i, j in enumerate(jobs):
            try:
                self._check_job(j.committed_ids, j.features, j.method, j.spec)
                if j.request_id in {jobs[k].request_id for k in ok}:
                    raise ValueError(f"request {j.request_id!r} appears twice in one draft batch")
                self.append_context(j.request_id, j.features, j.start)
                ok.append(i)
            except Exception as exc:
                out[i] = exc
        if not ok:
            return out
        t0 = time.perf_counter()
        try:
            rows = self.block_logits_batch([(jobs[i].request_id, jobs[i].root_token, jobs[i].start) for i in ok],
                                           max(_reach(jobs[i]) for i in ok))
        except Exception as exc:
            for i in ok:
                out[i] = exc
            return out
        share = (time.perf_counter() - t0) / len(ok)
        for i, (hd, base) in zip(ok, rows):
            j = jobs[i]
            t1 = time.perf_counter()
            try:
                depth = base.shape[0] if j.max_depth is None else max(0, min(j.max_depth, base.shape[0]))
                tree = self._build(j.method, j.spec, hd[:depth], base[:depth], j.root_token) if depth \
                    else DraftTree.empty()
                if self.d2t is not None and tree.num_nodes:  # draft ids -> target ids
                    tree = dataclasses.replace(tree, draft_tokens=self._to_target_ids(tree.draft_tokens))
                if self.ngram is not None:  # chain nodes may reach the job's depth cap, whatever the block's rows
                    cap = self.cfg.num_draft_slots if j.max_depth is None else j.max_depth
                    tree = self.ngram.join(j.request_id, j.committed_ids, j.start, j.root_token, tree, cap)
                out[i] = (tree, {"draft": share, "tree_build": time.perf_counter() - t1})
            except Exception as exc:
                out[i] = exc
        return out

    def _to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """``[N]`` draft-vocabulary ids -> target ids (CPU, as every tree's tensors)."""
        return self.d2t[draft_ids.long().to(self.d2t.device)].cpu()

    def _check_job(self, committed_ids, features: Tensor, method: str, spec) -> None:
        if features.shape[0] != len(committed_ids):
            raise ValueError("features must have one row per committed token")
        if method not in METHODS or not Method(method).drafts:
            raise ValueError(f"method {method!r} does not draft (choose from {METHODS[1:]})")
        if method not in served_methods(self.kind):
            m = Method(method)
            need = ("a Domino correction head" if m.needs_head else "a DSpark (Markov head) drafter"
                    if m.family == "dspark" else "an EAGLE-3 drafter")
            raise ValueError(f"method {method!r} needs {need}; this {self.kind} drafter serves "
                             f"{', '.join(served_methods(self.kind))}")
        if not spec.is_resolved():
            raise ValueError(f"a draft job's tree knobs must all be set by the verifier (got {spec})")

    def _build(self, method: str, spec, hd: Tensor, base: Tensor, root: int) -> DraftTree:
        """The tree of one job from its draft rows ``hd [D, H]`` / ``base [D, V]`` (:data:`TREE_BUILDERS`)."""
        return TREE_BUILDERS[Method(method)](self, spec, hd, base, root)

    def _markov(self) -> MarkovScorer:
        """DSpark: bias W2 . W1[prev] on every slot, slot 0's prev = the root (docs/algorithms.md §3)."""
        head = self.drafter.markov_head
        return MarkovScorer(head.markov_w1.weight, head.markov_w2.weight)

    def _domino(self, hd: Tensor) -> DominoScorer:
        """The Domino correction head over this round's drafter rows ``hd [D, H]``."""
        return DominoScorer(self.drafter, self.embed, hd.to(self.dtype), self.d2t)


def _chain_of(base: Tensor) -> DraftTree:
    """DFlash: the argmax chain; scores: its path log-probabilities (the goodput policy calibrates them)."""
    toks = torch.argmax(base, dim=-1)
    return chain(toks, _path_scores(base, toks))


def _rollout(base: Tensor, scorer, root: int, prefix: int) -> DraftTree:
    """A chain rolled out slot by slot under ``scorer``."""
    toks, rows = chain_rollout(base, scorer, root, prefix)
    return chain(toks, _path_scores(rows, toks))


def _dartree(svc: DrafterService, knobs, hd: Tensor, base: Tensor, root: int, variant: str) -> DraftTree:
    budget, width, beta, k = knobs.astuple()
    return dartree(base, svc._domino(hd), root, K=k, W=width, B=budget, beta=beta if variant == "pruned" else 0.0,
                   variant=variant, pure_draft_prefix_len=svc.cfg.pure_draft_prefix_len)


# The tree builder of each drafting method: ``builder(service, knobs, hd [D, H], base [D, V], root) -> DraftTree``
# (knobs: resolved :class:`~services.spec.TreeKnobs`; a method of an existing family is one entry here).
TREE_BUILDERS: dict[Method, Callable[..., DraftTree]] = {
    Method.DFLASH: lambda svc, kn, hd, base, root: _chain_of(base),
    Method.DDTREE: lambda svc, kn, hd, base, root: ddtree(torch.log_softmax(base, dim=-1), kn.budget),
    Method.DSPARK: lambda svc, kn, hd, base, root: _rollout(base, svc._markov(), root, 0),
    Method.DSPARK_DARTREE: lambda svc, kn, hd, base, root: dartree(
        base, svc._markov(), root, K=kn.candidates, W=kn.width, B=kn.budget, beta=kn.depth_bonus, variant="pruned",
        pure_draft_prefix_len=0),
    Method.DOMINO: lambda svc, kn, hd, base, root: _rollout(base, svc._domino(hd), root,
                                                            svc.cfg.pure_draft_prefix_len),
    Method.DOMINO_DDTREE: lambda svc, kn, hd, base, root: domino_ddtree(
        chain_rollout(base, svc._domino(hd), root, svc.cfg.pure_draft_prefix_len)[1], kn.budget),
    Method.SEQHEAP: lambda svc, kn, hd, base, root: seqheap(
        base, svc._domino(hd), root, K=kn.candidates, B=kn.budget, beta=kn.depth_bonus,
        pure_draft_prefix_len=svc.cfg.pure_draft_prefix_len),
    Method.DARTREE_FIXED: lambda svc, kn, hd, base, root: _dartree(svc, kn, hd, base, root, "fixed"),
    Method.DARTREE_PRUNED: lambda svc, kn, hd, base, root: _dartree(svc, kn, hd, base, root, "pruned"),
}


class _LayerwiseContext:
    """A batch's per-layer context ``(K, V)`` ``[n, Hkv, C, Dh]`` for :meth:`DFlashDrafter.block_forward`,
    copied into one layer's scratch ``[1, 2, n, Hkv, C, Dh]`` as the forward iterates its layers:
    layer i+1 is copied when the forward asks for it (``zip(self.layers, ctx_kv)``), after layer i's
    attention has read (concatenated) its K/V, so one layer's scratch serves all (1/L of the
    memory). Padded rows are zeroed by the caller and never written here."""

    def __init__(self, scratch: Tensor, bufs: list[Tensor | None], lens: list[int], num_layers: int):
        self.scratch, self.bufs, self.lens, self.num_layers = scratch, bufs, lens, num_layers

    def __len__(self) -> int:
        return self.num_layers

    def __iter__(self):
        kv = DrafterService._layer_kv(self.scratch)[0]
        for li in range(self.num_layers):
            for i, (buf, n) in enumerate(zip(self.bufs, self.lens)):
                if n:
                    self.scratch[0, :, i, :, :n] = buf[li, :, :, :n]
            yield kv


def _reach(job) -> int:
    """Draft slots ``job``'s tree can use (>= 1): its ``max_depth`` (None = all, a large number),
    cut to the budget for the methods whose tree is at most budget deep (:attr:`Method.budget_deep`)."""
    depth = 1 << 30 if job.max_depth is None else job.max_depth
    if Method(job.method).budget_deep:
        depth = min(depth, job.spec.budget)
    return max(depth, 1)


def _want_q4(drafter: DFlashDrafter, packed_gemm: bool) -> bool:
    """The default of ``DrafterService(q4_linears=None)``: a bfloat16 drafter on a device where the
    ``q4`` format's kernels run (:mod:`services.weight_formats`: a CPU with torch's int4 kernel),
    with ``packed_gemm`` on."""
    from services.weight_formats import get as get_format

    p = next(drafter.parameters())
    return packed_gemm and p.dtype == torch.bfloat16 and get_format("q4").available(str(p.device))


def _path_scores(logits: Tensor, tokens: Tensor) -> Tensor:
    """``[D]`` cumulative log-softmax of ``logits [D, V]`` at a chain's ``tokens [D]``."""
    lp = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens.long().to(logits.device)[:, None])[:, 0]
    return lp.cumsum(0).cpu()


def frozen_linear(weight: Tensor) -> torch.nn.Linear:
    """A bias-free ``nn.Linear`` over ``weight [out, in]`` (no gradient; no throw-away random init)."""
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = torch.nn.Parameter(weight, requires_grad=False)
    return lin
