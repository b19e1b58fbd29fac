"""The goodput policy's forecast: the expected acceptance of the next draft's nodes, before drafting.

:class:`Forecaster` keeps each method / regime's recent drafted trees and reads, for a request about
to draft, the expected calibrated P of the k-th most likely node of its next tree: the mean over
recent trees of their sorted calibrated P, blended between the request's own recent trees and its
regime's longer window (:func:`blend`), times the request's factor. The per-request window and the
rounds since its last drafter call live in the policy's per-request state, which is passed in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from services.tree import DraftTree
from services.verifier.calibration import AcceptanceCalibrator

# the forecast of a request that has drafted weighs its own recent trees against this many trees' worth
# of its method / regime's longer window, and its own trees' weight decays by FORECAST_RELAX a plain round
FORECAST_PRIOR_TREES = 1.0
FORECAST_RELAX = 0.9
# trees (or labels per running request) after which the regime's cached forecast curve is recomputed
REGIME_REFRESH = 8


class RequestWindow(Protocol):
    """What the forecast reads of a request's state: its own recent ``(tree, budget)`` (``trees``), its
    count of plain rounds when each was drafted (``stamps``, aligned with the newest trees), its plain
    rounds so far (``plain``), the rounds since its last drafter call and its cached own curve
    (``(key, version, curve)`` or None)."""

    trees: deque
    stamps: deque
    plain: int
    since_draft: int
    curve: tuple | None


def blend(own: list[float], prior: list[float] | None, weight: float) -> list[float]:
    """``(weight * own + FORECAST_PRIOR_TREES * prior) / (weight + FORECAST_PRIOR_TREES)`` position by
    position (a missing position is 0); ``own`` alone when there is no ``prior``. Both non-increasing,
    so is the blend."""
    if not prior:
        return own
    n = max(len(own), len(prior))
    a, b = own + [0.0] * (n - len(own)), prior + [0.0] * (n - len(prior))
    return [(weight * x + FORECAST_PRIOR_TREES * y) / (weight + FORECAST_PRIOR_TREES) for x, y in zip(a, b)]


def mean_curve(cal: AcceptanceCalibrator, window, regime: str, optimism: float, cap: int,
               weights: list[float] | None = None) -> list[float]:
    """Mean sorted calibrated P (with ``optimism`` posterior standard deviations) of a window of
    ``(tree, budget)``, position k over the trees drafted with a budget above k, each tree weighted by
    ``weights`` (aligned with ``window``; None = equal); non-increasing; up to the largest tree's node
    count (at most ``cap``): every position beyond it would be 0."""
    # positions past the largest tree are 0 in every curve: the curve stops there (the forecast
    # reads it up to its first 0); up to the cap (1,024 unless set) it cost ~0.5 ms a step at c = 1
    length = min(cap, max((t.num_nodes for t, _ in window), default=0))
    curves = cal.sorted_lists([t for t, _ in window], regime, optimism, length)  # T x length
    budgets = [b for t, b in window if t.num_nodes]
    ws = [1.0] * len(budgets) if weights is None else [w for (t, _), w in zip(window, weights) if t.num_nodes]
    out, low = [], float("inf")
    for k in range(length):
        vals = [(w * c[k], w) for c, b, w in zip(curves, budgets, ws) if k < b]
        v = sum(x for x, _ in vals) / sum(w for _, w in vals) if vals else 0.0
        low = min(low, v)  # the k-th most likely node: never above the (k-1)-th
        out.append(low)
    return out


class Forecaster:
    """Each method / regime's recent trees and the forecast read from them (module docstring).

    Args:
        cal: the acceptance calibrator (its request factor scales a forecast).
        curve_of: ``(window of (tree, budget), regime[, weights]) -> mean curve`` (:func:`mean_curve`
            with the policy's optimism and cap; ``weights`` only where the trees weigh differently).
        fresh_labels: new calibration labels after which a cached curve is recomputed (the policy's
            running count).
        window: trees kept per method / regime (``forecast_trees``).
    """

    def __init__(self, cal: AcceptanceCalibrator, curve_of: Callable[..., list[float]],
                 fresh_labels: Callable[[], int], window: int = 64):
        self.cal, self._curve_of, self._fresh_labels, self.window = cal, curve_of, fresh_labels, window
        self.version = 0  # calibration updates so far (a cached curve is refreshed after fresh_labels() more)
        self._regime_trees: dict[str, deque] = {}  # recent (tree, budget) of each method / regime
        self._curve_cache: dict[str, tuple] = {}  # regime -> (calibration version, trees added, mean curve)
        self._regime_added: dict[str, int] = {}   # regime -> trees added to its window so far

    def remember(self, regime: str, tree: DraftTree, budget: int) -> None:
        """Add a drafted (non-empty) tree, drafted with ``budget``, to the window of ``regime``."""
        if tree.num_nodes == 0:
            return
        window = self._regime_trees.get(regime)
        if window is None:
            window = self._regime_trees[regime] = deque(maxlen=self.window)
        window.append((tree, budget))
        self._regime_added[regime] = self._regime_added.get(regime, 0) + 1

    def forecast(self, regime: str, st: RequestWindow | None = None, rid: str | None = None) -> list[float] | None:
        """Expected P of the k-th most likely node of the next draft, k = 0 .. B_max - 1 (descending,
        zeros left out): the mean over recent trees of their sorted calibrated P, times the request's
        factor; None before the regime's first tree. A request that has drafted (``st`` with trees)
        blends the mean of its own recent trees with its regime's (:func:`blend`, weights
        :meth:`own_weight`): its own text first, relaxing towards the regime's longer window while it
        decodes plainly. Position k averages only the trees drafted with a budget above k (a tree
        drafted with budget 3 says nothing about a 5th node), so drafting small trees does not read as
        "no 5th node" and the budget can grow again.

        The mean, not the last tree: the policy stops drafting right after a low-confidence tree, so a
        forecast read from the last tree is biased low and stays there while nothing is drafted
        (docs/roofline.md, "What the goodput policy does here").

        A cached own curve is recomputed when its trees change, or once the calibration has taken as
        many new labels as ``fresh_labels()`` (the running requests): at c = 1 after every label; at
        c = 8 recomputing every request's curve after every label cost ~1 ms a step (0.15 ms a request,
        3 % of a q4 CPU step) for forecasts that moved by a few labels' worth."""
        regime_curve = self._regime_curve(regime)
        own = self._own_curve(st, regime) if st is not None else None
        if own is None and regime_curve is None:
            return None
        curve = regime_curve if own is None else blend(own, regime_curve, self.own_weight(st))
        f = self.cal.request_factor(rid)
        return [min(v * f, 1.0) for v in curve[:next((i for i, v in enumerate(curve) if v <= 0.0), len(curve))]]

    def _own_curve(self, st: RequestWindow, regime: str) -> list[float] | None:
        """The mean curve of the request's own recent trees (cached in ``st.curve``); None before its first."""
        if not st.trees:
            return None
        key = (id(st.trees[-1][0]), len(st.trees))
        if st.curve is None or st.curve[0] != key or self.version - st.curve[1] >= self._fresh_labels():
            ages = _ages(st)
            if any(ages):  # trees drafted before plain rounds weigh less: relative to the newest
                newest = min(ages)
                curve = self._curve_of(st.trees, regime, [FORECAST_RELAX ** (a - newest) for a in ages])
            else:
                curve = self._curve_of(st.trees, regime)
            st.curve = (key, self.version, curve)
        return st.curve[2]

    def _regime_curve(self, regime: str) -> list[float] | None:
        """The mean curve of the regime's recent trees; None before its first. Cached until its window
        has taken an eighth of its length in new trees (at most :data:`REGIME_REFRESH`), or as many times
        ``fresh_labels()`` new labels: a full window of 64 trees is a slow prior, and recomputing it
        every step cost ~0.5 ms at c = 1; a short one (a cold start) is recomputed as often as before."""
        window = self._regime_trees.get(regime)
        if not window:
            return None
        cached, added = self._curve_cache.get(regime), self._regime_added.get(regime, 0)
        every = min(max(len(window) // 8, 1), REGIME_REFRESH)
        if cached is None or added - cached[1] >= every or self.version - cached[0] >= every * self._fresh_labels():
            cached = self._curve_cache[regime] = (self.version, added, self._curve_of(window, regime))
        return cached[2]

    @staticmethod
    def own_weight(st: RequestWindow) -> float:
        """Weight of the request's own trees against :data:`FORECAST_PRIOR_TREES` of its regime's: each
        own tree weighs :data:`FORECAST_RELAX` to the power of the plain rounds since it was drafted. A
        request stops drafting after a dip of its own window and then draws no new tree, so an own-only
        forecast froze at the dip (2-core CPU, q4, goodput at ``B_max`` = 1: 1,131 of 3,295 rounds plain
        where fixed B = 1 paid); relaxing towards the regime's longer window lets it draft again. Aged
        per tree, not per request: one draft after a long plain stretch used to give the whole stale
        window its full weight back, and the request went plain again (goodput at ``B_max`` = 1 on the
        recorded GSM8K trace: 164 of 381 rounds plain at a first-node acceptance of ~0.5 there)."""
        return sum(FORECAST_RELAX ** a for a in _ages(st))


def _ages(st: RequestWindow) -> list[float]:
    """Plain rounds since each of the request's own trees was drafted (oldest first); a tree without a
    stamp counts the rounds since the request's last drafter call."""
    stamps = list(getattr(st, "stamps", ()))[-len(st.trees):]
    missing = len(st.trees) - len(stamps)
    return [float(st.since_draft)] * missing + [float(st.plain - s) for s in stamps]
