"""The goodput policy's per-request state and its exploration bookkeeping.

:class:`ReqState` is what :class:`~services.verifier.policy.GoodputPolicy` keeps of one request between
steps (its regime, exploration interval, recent trees, pending labels). :class:`ExplorationBook` is the
part of the policy that keeps it and each method / regime's exploration interval: a new request starts
from its regime's interval and rounds since its last draft, and a draft that did not pay for its
drafter call doubles the interval (:meth:`ExplorationBook._back_off`). Kept apart from the policy's
pricing and selection so that the per-request bookkeeping reads in one place.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.verifier.calibration import regime_of
from services.verifier.policy_base import Drafted
from services.verifier.scheduler import RoundInfo


@dataclass
class ReqState:
    """What the goodput policy keeps of one request between its steps (fields commented below); the
    forecast reads its own window (:class:`~services.verifier.forecast.RequestWindow`)."""

    since_draft: int = 0                     # rounds since the last drafter call
    interval: int = 0                        # exploration interval (doubles while drafts do not pay)
    regime: str = "greedy"
    fresh: bool = True                       # no step seen yet (takes its regime's exploration interval)
    budget: int = 0                          # budget of its last drafter call (the most nodes select verifies)
    trees: deque = field(default_factory=lambda: deque(maxlen=8))  # its own recent (tree, budget): its forecast
    stamps: deque = field(default_factory=lambda: deque(maxlen=8))  # `plain` when each of them was drafted
    plain: int = 0                           # its plain rounds so far (its own trees' age)
    probed: bool = False                     # it has called the drafter (no probe due any more)
    emitted: int = 0                         # tokens its rounds committed
    curve: tuple | None = None               # (last tree, count, calibration version) -> its mean curve, cached
    pending: deque = field(default_factory=deque)  # [tree, continuation] waiting for labels


class ExplorationBook:
    """The per-request states and exploration intervals of
    :class:`~services.verifier.policy.GoodputPolicy` (module docstring), a mixin of it: it reads the
    policy's ``cost`` (the step cost model), ``explore_every`` / ``explore_max`` and the tables
    ``_req`` (rid -> :class:`ReqState`), ``_regime_interval`` and ``_regime_since`` (method / regime ->
    its exploration interval, rounds since it last drafted)."""

    def _state(self, rid: str) -> ReqState:
        """The state of request ``rid`` (created on first use, with the policy's exploration interval)."""
        st = self._req.get(rid)
        if st is None:
            st = self._req[rid] = ReqState(interval=self.explore_every)
        return st

    def _enter(self, r: RoundInfo) -> ReqState:
        """The request's state, its regime set; a new request takes its regime's exploration state."""
        st = self._state(r.rid)
        st.regime = f"{r.method}:{regime_of(r.temperature)}"  # one calibration table per method and regime
        if st.fresh:
            st.fresh = False
            st.interval = self._regime_interval.get(st.regime, self.explore_every)
            st.since_draft = self._regime_since.get(st.regime, 0)
        return st

    def _back_off(self, items: list[Drafted], chosen: dict[str, int], probs: dict, rows: int, total_gain: float,
                  seconds: float, e: float) -> None:
        """Exploration back-off: a draft that did not pay for its drafter call doubles its request's
        interval (and its regime's), one that paid resets it."""
        c = self.cost
        for d in items:
            rid = d.info.rid
            if d.drafted and not d.info.explicit_budget:
                st = self._state(rid)
                b = chosen.get(rid, 0)
                g = float(probs[rid][:b].sum()) if b else 0.0
                t = c.draft_cost(min(d.info.owed, 1)) + e + c.forward_seconds(rows) - c.forward_seconds(rows - b)
                paid = b > 0 and (t <= 0 or g / t >= (total_gain - g) / max(seconds - t, 1e-9))
                st.interval = self.explore_every if paid else min(2 * st.interval, self.explore_max)
                self._regime_interval[st.regime] = st.interval
