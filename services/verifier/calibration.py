"""Calibrated acceptance of draft nodes for the goodput policy.

For a draft node ``i`` let ``A_i`` = "node i and all its ancestors are accepted" (it lies on the
accepted path). A round emits ``1 + sum_i A_i`` tokens, so ``E[emitted | tree] = 1 + sum_i P(A_i)``.

The calibration map estimates ``P(A_i)`` from the drafter's path score ``s_i`` (log q of the path)
and depth ``d_i``: Beta counts per ``(depth bucket, q = exp(s) bucket)`` cell, one table per regime
(``greedy`` for T = 0, ``sampled`` for T > 0), with exponential forgetting so a change of data
(another kind of prompt, a weaker drafter) moves the estimates within a few rounds. The prior of a
cell is its own q (the drafter's belief) with ``prior_weight`` pseudo-observations. Probabilities
are made monotone along paths (``P(child) <= P(parent)``; ``A_child`` implies ``A_parent``), so
the top-b nodes by P (ties to the lower index) form a prefix-closed subtree and the expected gain
of every budget b is a prefix sum (:func:`prefix_gains`).

Labels come from the request's committed continuation after the root: ``A_i`` holds exactly when
node i's path equals the first ``d_i`` committed tokens. At T = 0 that is the walk's acceptance; at
T > 0 the committed tokens are target samples, and the walk accepts node i with the same
probability (each verify row is an independent target sample), so the label has the right law. The
labels therefore exist for every drafted node, verified or not (a tree cut to b = 0 still teaches
the calibrator). A per-request factor (realised / predicted accepted tokens, forgetting old rounds)
adapts the global map to the request's own text.

Pure: torch tensors only, no models.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch

from services.tree import DraftTree

# upper edges of the q = exp(path score) buckets (the last bucket runs to 1)
Q_EDGES = (0.01, 0.03, 0.06, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)


def regime_of(temperature: float) -> str:
    """``"greedy"`` at T = 0, else ``"sampled"``."""
    return "greedy" if temperature == 0 else "sampled"


def accepted_labels(tree: DraftTree, continuation: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Which nodes' paths equal the committed continuation: ``(labels [N] bool, known [N] bool)``.

    A node deeper than ``len(continuation)`` is unknown (the request ended first). Loops over
    depths, never nodes.
    """
    n = tree.num_nodes
    if n == 0:
        return torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.bool)
    known = tree.depths <= len(continuation)
    cont = torch.tensor(list(continuation) + [-1], dtype=torch.long)
    idx = (tree.depths - 1).clamp(max=len(continuation))
    ok = tree.draft_tokens.long() == cont[idx]
    ok &= known
    for _ in range(int(tree.depths.max()) - 1):  # propagate "parent not on the path" down the tree
        par_ok = torch.where(tree.parents >= 0, ok[tree.parents.clamp(min=0)], torch.ones_like(ok))
        ok = ok & par_ok
    return ok, known


def prefix_gains(p_sorted: list[float]) -> list[float]:
    """``[0, p0, p0 + p1, ...]``: expected accepted tokens of the top-b nodes, b = 0..len."""
    out = [0.0]
    for p in p_sorted:
        out.append(out[-1] + p)
    return out


@dataclass
class _RequestScale:
    realised: float = 0.0
    predicted: float = 0.0


@dataclass
class AcceptanceCalibrator:
    """Online ``P(node on the accepted path | depth, path score, regime)``.

    Args:
        max_depth_bucket: depths >= this share the last bucket.
        prior_weight: pseudo-observations of each cell's prior (its own q).
        forget: factor applied to a regime's counts per observed tree (0 < forget <= 1).
        request_forget: factor applied to a request's realised / predicted sums per round.
        request_prior: pseudo accepted tokens of the per-request factor (starts at 1).
        request_relax: factor applied to a request's sums per round it does not draft (:meth:`relax`).
    Raises:
        ValueError: a parameter out of range.
    """

    max_depth_bucket: int = 8
    prior_weight: float = 1.0
    forget: float = 0.995
    request_forget: float = 0.85
    request_prior: float = 3.0
    request_relax: float = 0.9
    _acc: dict = field(default_factory=dict)   # regime -> [Dd, Q] weighted accepted counts
    _tot: dict = field(default_factory=dict)   # regime -> [Dd, Q] weighted observations
    _req: dict = field(default_factory=dict)   # request id -> _RequestScale
    _cell_cache: dict = field(default_factory=dict, repr=False)  # id(tree) -> (tree, d, s): forecasts reuse a tree

    def __post_init__(self) -> None:
        if self.max_depth_bucket < 1 or self.prior_weight <= 0:
            raise ValueError("max_depth_bucket must be >= 1 and prior_weight > 0")
        if not 0 < self.forget <= 1 or not 0 < self.request_forget <= 1:
            raise ValueError("forget and request_forget must be in (0, 1]")
        shape = self._shape = (self.max_depth_bucket, len(Q_EDGES) + 1)
        centres = [0.005] + [(lo + hi) / 2 for lo, hi in zip(Q_EDGES[:-1], Q_EDGES[1:])] + [0.995]
        self._prior = torch.tensor(centres, dtype=torch.float64)[None, :].expand(shape)

    # ------------------------------------------------------------------ cells
    def _cells(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cell_entry(tree)[1:3]

    def _cell_entry(self, tree: DraftTree) -> tuple:
        """``(tree, d [N], s [N], (d, s, parents) as lists)``: each node's table cell, cached per tree."""
        hit = self._cell_cache.get(id(tree))
        if hit is not None and hit[0] is tree:  # the policy re-reads a request's last tree every step
            return hit
        d = (tree.depths.clamp(min=1, max=self.max_depth_bucket) - 1).long()
        q = torch.exp(tree.scores.double().clamp(max=0.0)).tolist()
        s_list = [bisect.bisect_left(Q_EDGES, v) for v in q]
        s = torch.tensor(s_list, dtype=torch.long)
        if len(self._cell_cache) >= 1024:
            self._cell_cache.clear()
        entry = self._cell_cache[id(tree)] = (tree, d, s, (d.tolist(), s_list, tree.parents.tolist()))
        return entry

    def _table(self, regime: str) -> tuple[torch.Tensor, torch.Tensor]:
        if regime not in self._acc:
            self._acc[regime] = torch.zeros(self._shape, dtype=torch.float64)
            self._tot[regime] = torch.zeros(self._shape, dtype=torch.float64)
        return self._acc[regime], self._tot[regime]

    def cell_probability(self, regime: str, optimism: float = 0.0) -> torch.Tensor:
        """``[depth buckets, q buckets]`` posterior mean of each cell (float64), plus ``optimism``
        posterior standard deviations (an upper confidence bound: cells with little evidence look
        better, so a policy deciding from them keeps trying them)."""
        acc, tot = self._table(regime)
        w = self.prior_weight
        mean = (acc + w * self._prior) / (tot + w)
        if optimism:
            mean = mean + optimism * torch.sqrt(mean * (1 - mean) / (tot + w + 1))
        return mean.clamp(0.0, 1.0)

    # ------------------------------------------------------------ prediction
    def p_accept(self, tree: DraftTree, regime: str = "greedy", request_id: str | None = None,
                 optimism: float = 0.0) -> torch.Tensor:
        """``[N]`` float64 calibrated ``P(A_i)``, monotone along paths, times the request's factor.

        ``regime`` names a table: ``greedy`` / ``sampled``, optionally prefixed by the method
        (``"ddtree:greedy"``), since each builder's scores mean something else; a new name starts a
        table at the prior.
        """
        n = tree.num_nodes
        if n == 0:
            return torch.zeros(0, dtype=torch.float64)
        table = self.cell_probability(regime, optimism).tolist()
        return torch.tensor(self._path_p(tree, table, self.request_factor(request_id)), dtype=torch.float64)

    def _path_p(self, tree: DraftTree, table: list[list[float]], factor: float = 1.0) -> list[float]:
        """Each node's cell probability in ``table`` (``[depth buckets][q buckets]``) times ``factor``,
        clamped to [0, 1], then cut to its parent's (P(child) <= P(parent)): Python floats, float64."""
        d, s, parents = self._cell_entry(tree)[3]
        p = [min(max(table[a][b] * factor, 0.0), 1.0) for a, b in zip(d, s)]
        for i, par in enumerate(parents):  # a parent comes before its children
            if par >= 0 and p[par] < p[i]:
                p[i] = p[par]
        return p

    def sorted_lists(self, trees: list[DraftTree], regime: str = "greedy", optimism: float = 0.0,
                     length: int = 8) -> list[list[float]]:
        """Per non-empty tree of ``trees``: its calibrated P (as :meth:`p_accept` without a request
        factor) in descending order, zero-padded or cut to ``length`` floats. A forecast reads a
        window of a few small trees every step: in Python floats (the same float64 values as
        :meth:`p_accept`) this costs a fraction of the ~40 small tensor ops it took, ~0.2 ms a step."""
        table = self.cell_probability(regime, optimism).tolist()  # [depth buckets][q buckets]
        out = []
        for t in trees:
            if not t.num_nodes:
                continue
            p = self._path_p(t, table)
            p.sort(reverse=True)
            out.append(p[:length] + [0.0] * max(length - len(p), 0))
        return out

    @staticmethod
    def order(p: torch.Tensor) -> torch.Tensor:
        """Node indices by descending P, ties to the lower index: every prefix is prefix-closed when
        ``p`` is monotone along paths (a parent has a lower index and P >= its child's)."""
        return torch.sort(p, descending=True, stable=True).indices

    def expected_emitted(self, tree: DraftTree, b: int, regime: str = "greedy", request_id: str | None = None
                         ) -> float:
        """``1 + sum`` of the top-``b`` calibrated P (expected tokens of a round verifying them)."""
        p = self.p_accept(tree, regime, request_id)
        return 1.0 + float(p[self.order(p)[:max(b, 0)]].sum())

    def request_factor(self, request_id: str | None) -> float:
        """The request's realised / predicted accepted tokens (1 for unknown requests)."""
        st = self._req.get(request_id) if request_id is not None else None
        if st is None:
            return 1.0
        k = self.request_prior
        return (st.realised + k) / (st.predicted + k)

    # ------------------------------------------------------------ learning
    def observe(self, tree: DraftTree, continuation: list[int], regime: str = "greedy",
                request_id: str | None = None) -> tuple[float, float]:
        """Learn from one drafted tree and the tokens committed after its root.

        Args:
            tree: the tree as drafted (before any truncation).
            continuation: committed tokens after the root (at least the tree's depth, unless the
                request ended first; nodes deeper than this are not counted).
            regime: ``greedy`` / ``sampled``; request_id: updates that request's factor too.
        Returns:
            ``(predicted, realised)`` accepted tokens of the whole tree (predicted by the global map
            before this update).
        """
        if tree.num_nodes == 0:
            return 0.0, 0.0
        labels, known = accepted_labels(tree, continuation)
        predicted = float(self.p_accept(tree, regime)[known].sum())
        realised = float(labels.sum())
        d, s = self._cells(tree)
        acc, tot = self._table(regime)
        flat = d * acc.shape[1] + s
        acc *= self.forget
        tot *= self.forget
        acc += torch.bincount(flat[known], weights=labels[known].double(), minlength=acc.numel()).view_as(acc)
        tot += torch.bincount(flat[known], minlength=acc.numel()).double().view_as(tot)
        if request_id is not None:  # against the updated map: the factor is what the map still misses
            st = self._req.setdefault(request_id, _RequestScale())
            st.realised = st.realised * self.request_forget + realised
            st.predicted = st.predicted * self.request_forget + float(self.p_accept(tree, regime)[known].sum())
        return predicted, realised

    def relax(self, request_id: str) -> None:
        """A round without a draft: age the request's evidence one round, so a factor that stopped
        a request drafting drifts back towards 1 (the global map) instead of staying stale."""
        st = self._req.get(request_id)
        if st is not None:
            st.realised *= self.request_relax
            st.predicted *= self.request_relax

    def release(self, request_id: str) -> None:
        """Forget a finished request's factor."""
        self._req.pop(request_id, None)

    def state(self) -> dict:
        """JSON-able counts of every regime's table (:meth:`load_state` restores them): ``{"q_edges",
        "depth_buckets", "regimes": {regime: {"acc": [Dd][Q], "tot": [Dd][Q]}}}`` (weighted counts)."""
        return {"q_edges": list(Q_EDGES), "depth_buckets": self.max_depth_bucket,
                "regimes": {r: {"acc": self._acc[r].tolist(), "tot": self._tot[r].tolist()} for r in self._acc}}

    def load_state(self, state: dict, max_weight: float = 50.0) -> bool:
        """Start from a saved :meth:`state` (a calibration learnt before): each regime's counts, scaled
        down so no cell carries more than ``max_weight`` observations (a loaded map is a prior that the
        online updates soon outweigh). False (nothing loaded) when the buckets differ or the state is
        malformed."""
        try:
            if list(state["q_edges"]) != list(Q_EDGES) or int(state["depth_buckets"]) != self.max_depth_bucket:
                return False
            tables = {r: (torch.tensor(t["acc"], dtype=torch.float64), torch.tensor(t["tot"], dtype=torch.float64))
                      for r, t in state["regimes"].items()}
        except (KeyError, TypeError, ValueError):
            return False
        if any(a.shape != self._shape or t.shape != self._shape or bool((a < 0).any()) or bool((a > t + 1e-9).any())
               for a, t in tables.values()):
            return False
        for r, (acc, tot) in tables.items():
            scale = min(1.0, max_weight / max(float(tot.max()), 1e-9))
            self._acc[r], self._tot[r] = acc * scale, tot * scale
        return True

    def mean_probability(self, regime: str = "greedy") -> float:
        """Observation-weighted mean P over all cells (for logs and tests)."""
        acc, tot = self._table(regime)
        return float(acc.sum()) / float(tot.sum()) if float(tot.sum()) > 0 else math.nan
