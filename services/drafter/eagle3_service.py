"""The EAGLE-3 drafter's compute: per-request drafter KV caches and the dynamic draft tree.

Same interface as :class:`services.drafter.service.DrafterService` (``draft_batch``, ``release``,
``info``, ``num_contexts``), so the engine, the workers and the bench use it unchanged.

One draft per request and round (EAGLE-3 ``cnets.py``, adapted to our round layout): the committed tokens since
the last call sit at positions ``[start - n, start)`` with target features ``f``; the drafter's
context row at position ``i`` is the pair ``(fc(f_i), token_{i+1})``, so the new rows use the tokens
``committed_ids[1:] + [root]`` and are appended to the request's drafter cache once (never
recomputed). The last new row's output predicts depth 1; :func:`services.tree.eagle.eagle_tree`
then expands the tree, each expansion one drafter call over the frontier at position
``start + depth - 1`` that sees the context rows, its own ancestors' rows and itself (tree mask).
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import Tensor

from services.drafter.eagle3 import Eagle3Drafter
from services.protocol import METHODS, served_methods
from services.spec import Method
from services.tree import DraftTree
from services.tree.eagle import eagle_tree


class Eagle3Service:
    """Owns an EAGLE-3 drafter, the borrowed target embedding, and per-request drafter caches.

    Tree knobs (each job's, resolved by the verifier): ``budget`` (B, nodes kept; the paper's Table 4
    uses 64); ``width``, ``depth_bonus`` and ``candidates`` are DARTree's and not used; k and the
    depth are the drafter config's ``top_k`` / ``depth``.

    Args:
        drafter: :class:`Eagle3Drafter` (eval mode); embed: the target's ``embed_tokens``.
        description: shown in the handshake.
        packed_gemm: pre-pack the float32 CPU linears for the frontier / block row counts.
    """

    kind = "eagle3"

    def __init__(self, drafter: Eagle3Drafter, embed: torch.nn.Module, description: str = "",
                 packed_gemm: bool = True):
        self.drafter, self.embed = drafter.eval(), embed
        self.cfg = drafter.config
        self.d2t = drafter.draft_to_target()
        self.description = description
        self.dtype = next(drafter.parameters()).dtype
        if packed_gemm:
            from services.cpu_gemm import pack_linears, pack_linears_bf16

            pack_linears(drafter, sorted({max(2, self.cfg.top_k)}))
            pack_linears_bf16(drafter)  # bfloat16 drafters: oneDNN's pre-packed kernel (no-op in float32)
        self._k: dict[str, Tensor] = {}
        self._v: dict[str, Tensor] = {}
        self._len: dict[str, int] = {}
        self._last: dict[str, Tensor] = {}  # output row of the last context pair: predicts depth 1

    def info(self) -> dict:
        """Handshake fields (``block_size`` = the tree depth: the verifier sizes chain verifies by it)."""
        c = self.cfg
        return {"vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size, "block_size": c.depth,
                "mask_token_id": 0, "feature_dim": c.feature_dim, "max_position": c.max_position_embeddings,
                "num_draft_slots": c.num_draft_slots, "has_head": False,
                "target_layer_ids": list(c.target_layer_ids), "methods": list(served_methods("eagle3")),
                "description": self.description,
                # device bytes a context position takes: the one layer's K and V (the memory plan's figure)
                "context_bytes": 2 * c.num_key_value_heads * c.head_dim * torch.empty(0, dtype=self.dtype).element_size()}

    def num_contexts(self) -> int:
        """Requests holding a drafter cache."""
        return len(self._k)

    def release(self, request_id: str) -> None:
        """Drop a request's drafter cache (idempotent)."""
        for d in (self._k, self._v, self._len, self._last):
            d.pop(request_id, None)

    def _check_job(self, committed_ids, features: Tensor, method: str, spec) -> None:
        if features.shape[0] != len(committed_ids):
            raise ValueError("features must have one row per committed token")
        if features.ndim != 2 or features.shape[1] != self.cfg.feature_dim:
            raise ValueError(f"features must be [n, {self.cfg.feature_dim}], got {tuple(features.shape)}")
        if method not in METHODS or not Method(method).drafts:
            raise ValueError(f"method {method!r} does not draft (choose from {METHODS[1:]})")
        if method != Method.EAGLE3:
            need = "a DSpark (Markov head) drafter" if Method(method).family == "dspark" else "a DFlash-family drafter"
            raise ValueError(f"method {method!r} needs {need}; this eagle3 drafter serves "
                             f"{', '.join(served_methods('eagle3'))}")
        if not spec.is_resolved():
            raise ValueError(f"a draft job's tree knobs must all be set by the verifier (got {spec})")

    def _append(self, request_id: str, committed_ids: list[int], features: Tensor, root_token: int, start: int) -> None:
        """Append the pairs ``(fc(f_i), token_{i+1})`` of positions ``[start - n, start)`` to the cache."""
        n = features.shape[0]
        have = self._len.get(request_id, 0)
        if have != start - n:
            raise ValueError(f"drafter context of {request_id!r} holds {have} positions, expected {start - n}")
        if n == 0:
            if request_id not in self._last:
                raise ValueError(f"request {request_id!r} has no drafter context yet")
            return
        m = self.drafter
        toks = torch.tensor(list(committed_ids[1:]) + [root_token])
        emb = self.embed(toks).to(self.dtype)[None]  # [1, n, H]
        hid = m.fuse(features.to(self.dtype))[None]  # [1, n, H]
        pos = torch.arange(start - n, start)
        h, k, v = m.midlayer(emb, hid, pos, self._k.get(request_id), self._v.get(request_id))
        old_k = self._k.get(request_id)
        self._k[request_id] = k if old_k is None else torch.cat([old_k, k], 2)
        self._v[request_id] = v if old_k is None else torch.cat([self._v[request_id], v], 2)
        self._len[request_id] = start
        self._last[request_id] = h[0, -1]

    def _tree(self, request_id: str, start: int, spec, max_depth: int | None) -> DraftTree:
        c, m = self.cfg, self.drafter
        budget = spec.budget
        top_k = c.top_k
        depth = c.depth if max_depth is None else max(0, min(max_depth, c.depth))
        if depth == 0 or budget == 0:
            return DraftTree.empty()
        ctx_k, ctx_v = self._k[request_id], self._v[request_id]
        L = ctx_k.shape[2]
        root_h = self._last[request_id]
        anc: dict[int, list[int]] = {}   # node id -> rows of its expanded ancestors and itself
        rows_k: list[Tensor] = []
        rows_v: list[Tensor] = []
        hid_of: dict[int, Tensor] = {-1: root_h}

        def expand(nodes: Tensor, tokens: Tensor, parents: Tensor) -> Tensor:
            p = nodes.numel()
            d = len(rows_k)  # steps done so far = depth of the frontier - 1
            emb = self.embed(self.d2t[tokens]).to(self.dtype)[None]  # [1, P, H]
            hid = torch.stack([hid_of[int(q)] for q in parents.tolist()])[None]  # [1, P, H]
            m_prev = sum(x.shape[2] for x in rows_k)
            mask = torch.zeros(p, L + m_prev + p, dtype=torch.bool)
            mask[:, :L] = True
            for i, q in enumerate(parents.tolist()):
                for r in anc.get(q, []):
                    mask[i, L + r] = True
                mask[i, L + m_prev + i] = True
            past_k = torch.cat([ctx_k] + rows_k, 2)
            past_v = torch.cat([ctx_v] + rows_v, 2)
            pos = torch.full((p,), start + d, dtype=torch.long)
            h, k, v = m.midlayer(emb, hid, pos, past_k, past_v, mask[None])
            rows_k.append(k)
            rows_v.append(v)
            for i, (node, q) in enumerate(zip(nodes.tolist(), parents.tolist())):
                anc[node] = anc.get(q, []) + [m_prev + i]
                hid_of[node] = h[0, i]
            return torch.log_softmax(m.logits(h[0]).float(), dim=-1)

        root_logp = torch.log_softmax(m.logits(root_h).float(), dim=-1)
        return eagle_tree(root_logp, expand, top_k=top_k, depth=depth, budget=budget)

    def _draft_one(self, job) -> tuple[DraftTree, dict[str, float]]:
        """One job's tree: ``(tree, {"draft": s, "tree_build": s})``; ``draft`` = appending the
        context rows, ``tree_build`` = the expansion (drafter calls included) and the rerank."""
        self._check_job(job.committed_ids, job.features, job.method, job.spec)
        t0 = time.perf_counter()
        self._append(job.request_id, job.committed_ids, job.features, job.root_token, job.start)
        t1 = time.perf_counter()
        tree = self._tree(job.request_id, job.start, job.spec, job.max_depth)
        if tree.num_nodes:
            tree = dataclasses.replace(tree, draft_tokens=self.d2t[tree.draft_tokens.long()])
        return tree, {"draft": t1 - t0, "tree_build": time.perf_counter() - t1}

    @torch.inference_mode()
    def draft_batch(self, jobs: list) -> list:
        """Draft several requests (one after the other: EAGLE-3's tree expansion is per request here).

        Args:
            jobs: as :meth:`DrafterService.draft_batch`'s.
        Returns:
            per job ``(tree, {"draft": s, "tree_build": s})`` or the exception that job raised (the
            others are unaffected): ValueError for a method other than ``eagle3``, a bad feature
            width, an inconsistent context, a request twice in the batch.
        """
        out: list = []
        seen: set[str] = set()
        for j in jobs:
            try:
                if j.request_id in seen:
                    raise ValueError(f"request {j.request_id!r} appears twice in one draft batch")
                seen.add(j.request_id)
                out.append(self._draft_one(j))
            except Exception as exc:
                out.append(exc)
        return out
