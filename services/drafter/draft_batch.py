"""One draft call for several requests: their jobs gathered into ONE block forward, then a tree each.

:class:`DraftBatching` is the part of :class:`~services.drafter.service.DrafterService` that runs a
call (:meth:`DraftBatching.draft_batch`): it checks each job, appends its newly committed target
features to its drafter context, lays the blocks ``[root, MASK x (rows - 1)]`` of all requests out
as one forward's inputs (embeddings, positions, their contexts' K/V copied into one zero-padded,
masked batch scratch, or the captured graphs of :mod:`services.drafter.graphed_block`), projects
the draft rows to logits with the target's lm_head, and builds each request's tree
(:mod:`services.drafter.tree_builders`), mapped to target ids and joined with its n-gram chain
(:mod:`services.drafter.ngram_drafts`). The service owns the drafter, its contexts and their
storage; this module only assembles and runs the call (docs/algorithms.md §1.3).
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import Tensor

from services.drafter.tree_builders import TREE_BUILDERS
from services.protocol import METHODS, served_methods
from services.spec import Method
from services.tree import DraftTree


class DraftBatching:
    """The draft call of :class:`~services.drafter.service.DrafterService` (module docstring), a
    mixin of it: it reads the service's drafter config ``cfg``, ``device``, ``dtype``, ``embed``,
    ``lm_head``, ``d2t``, ``ngram``, ``compiled``, ``block_rows`` / ``spare_rows``, its block forward
    (``_block_forward``, ``graphed``), the contexts ``_ctx`` / ``_ctx_len`` and the batch scratch
    ``_batch_ctx``, and calls :meth:`~services.drafter.service.DrafterService.append_context` and
    :meth:`~services.drafter.service.DrafterService.context_capacity_for`."""

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
        ok = self._admit(jobs, out)
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
            t1 = time.perf_counter()
            try:
                out[i] = (self._job_tree(jobs[i], hd, base), {"draft": share, "tree_build": time.perf_counter() - t1})
            except Exception as exc:
                out[i] = exc
        return out

    def _admit(self, jobs: list, out: list) -> list[int]:
        """Check each job and append its features to its request's context; returns the indices of
        the jobs admitted, in order (a job that failed gets its exception in ``out``)."""
        ok: list[int] = []
        for i, j in enumerate(jobs):
            try:
                self._check_job(j.committed_ids, j.features, j.method, j.spec)
                if j.request_id in {jobs[k].request_id for k in ok}:
                    raise ValueError(f"request {j.request_id!r} appears twice in one draft batch")
                self.append_context(j.request_id, j.features, j.start)
                ok.append(i)
            except Exception as exc:
                out[i] = exc
        return ok

    def _job_tree(self, j, hd: Tensor, base: Tensor) -> DraftTree:
        """Job ``j``'s tree from its block rows ``hd [D, H]`` / ``base [D, N]``: cut to its
        ``max_depth``, built by its method, mapped to target ids, joined with its n-gram chain."""
        depth = base.shape[0] if j.max_depth is None else max(0, min(j.max_depth, base.shape[0]))
        tree = self._build(j.method, j.spec, hd[:depth], base[:depth], j.root_token) if depth \
            else DraftTree.empty()
        if self.d2t is not None and tree.num_nodes:  # draft ids -> target ids
            tree = dataclasses.replace(tree, draft_tokens=self._to_target_ids(tree.draft_tokens))
        if self.ngram is not None:  # chain nodes may reach the job's depth cap, whatever the block's rows
            cap = self.cfg.num_draft_slots if j.max_depth is None else j.max_depth
            tree = self.ngram.join(j.request_id, j.committed_ids, j.start, j.root_token, tree, cap)
        return tree

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
        kv = DraftBatching._layer_kv(self.scratch)[0]
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

