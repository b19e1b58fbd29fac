"""The goodput policy's cut after drafting: which nodes of each drafted tree the step verifies.

:class:`DraftSelection` is the part of :class:`~services.verifier.policy.GoodputPolicy` called once the
drafter has answered (:meth:`DraftSelection.select`, step point 3 of
:mod:`services.verifier.policy_base`): every candidate node of the step in descending calibrated P is
tried as a prefix, and the prefix with the most expected tokens per predicted second is verified. The
decision before drafting (who drafts, with which budget) stays in :mod:`services.verifier.policy`.
"""

from __future__ import annotations

import torch

from services.tree import DraftTree
from services.verifier.policy_base import Drafted, Selection, truncate_tree


class DraftSelection:
    """:meth:`select` of :class:`~services.verifier.policy.GoodputPolicy` (module docstring), a mixin of
    it: it reads the policy's ``cost`` (the step cost model), its prices (``_overheads``, ``_best_prefix``,
    ``_cap``), the calibrated order of a tree's nodes (``_sorted_p``), the per-request states
    (``_state``), the forecast window (``remember``) and the exploration back-off (``_back_off``), and
    sets ``_predicted``."""

    def select(self, items: list[Drafted]) -> dict[str, Selection]:
        """Cut each drafted tree to the budgets that maximise the step's expected tokens / second.

        All candidate nodes of the step, in descending calibrated P (each request's own nodes in
        its prefix-closed order), are tried as prefixes k = 0, 1, ...; the k with the most expected
        tokens per predicted second wins (drafter calls already made count in the seconds at their
        steady price: sunk, but they set the bar; a catch-up's seconds would lower it). Explicit
        budgets keep the whole tree.
        """
        c = self.cost
        gain0, rows0, cands, orders, probs, explicit = self._select_candidates(items)
        o, e = self._overheads(len(items))
        # drafter calls made count at the steady price: a catch-up's seconds in the bar made a probe's
        # nodes look cheap (its 300-token catch-up is ~4 steps; at c = 4 it verified rows that cost more)
        fixed_s = sum(c.draft_cost(min(d.info.owed, 1)) + e for d in items if d.drafted) + o * len(items)
        k, _, seconds = self._best_prefix(gain0, rows0, [p for p, _, _ in cands], fixed_s)
        chosen = {rid: (probs[rid].numel() if rid in explicit else 0) for rid in orders}
        for _, _, rid in cands[:k]:
            chosen[rid] += 1
        self._back_off(items, chosen, probs, rows0 + k, gain0 + sum(p for p, _, _ in cands[:k]), seconds, e)
        self._predicted = seconds
        out = {}
        for d in items:
            rid = d.info.rid
            if rid not in orders:
                out[rid] = Selection(DraftTree.empty(), 0, 1.0)
                continue
            b = chosen[rid]
            tau = 1.0 + float(probs[rid][:b].sum())
            out[rid] = Selection(truncate_tree(d.tree, orders[rid], b), b, tau)
        return out

    def _select_candidates(self, items: list[Drafted]) -> tuple:
        """``(gain0, rows0, cands, orders, probs, explicit)`` of :meth:`select`: the gain and rows of
        the step before any cut node (a row and a token per request, explicit budgets' whole trees),
        the cut candidates ``(P, index, rid)`` in descending P (a request's own nodes in its order),
        each tree's node order and sorted P, the requests with an explicit budget. Remembers each
        drafted tree for the forecast and the labels."""
        gain0, rows0 = float(len(items)), len(items)
        cands: list[tuple[float, int, str]] = []
        orders: dict[str, torch.Tensor] = {}
        probs: dict[str, torch.Tensor] = {}
        explicit: set[str] = set()
        for d in items:
            rid, tree = d.info.rid, d.tree
            st = self._state(rid)
            if d.drafted and tree.num_nodes:
                self.remember(st.regime, tree, st.budget)
                st.trees.append((tree, st.budget or self._cap()))
                st.stamps.append(st.plain)
                st.pending.append([tree, []])
            if tree.num_nodes == 0:
                continue
            p_sorted, order = self._sorted_p(tree, st.regime, rid)
            orders[rid], probs[rid] = order, p_sorted
            if d.info.explicit_budget:
                explicit.add(rid)
                gain0 += float(p_sorted.sum())
                rows0 += tree.num_nodes
                continue
            for i, p in enumerate(p_sorted[:min(self._cap(), st.budget or self._cap())].tolist()):
                cands.append((p, i, rid))
        cands.sort(key=lambda x: (-x[0], x[1]))  # a request's own nodes stay in its order (P sorted, ties by i)
        return gain0, rows0, cands, orders, probs, explicit

    def predicted_step_seconds(self) -> float | None:
        """The last :meth:`select`'s predicted seconds of the step (None before any)."""
        return self._predicted
