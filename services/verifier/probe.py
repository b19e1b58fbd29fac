"""The goodput policy's probe gate: whether a request's first draft pays for its drafter's catch-up.

A request that has not drafted yet owes its drafter the whole context (the prompt, and the tokens of
its plain rounds); its first drafter call (the probe) pays that catch-up. :class:`ProbeGate` prices
it against the seconds the request is expected to save over its remaining tokens, learnt from the
method / regime's recent requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from services.verifier.cost_model import StepCostModel
from services.verifier.pricing import could_pay, saving_per_token


class ProbeGate:
    """Each method / regime's recent requests' forecasts at their end and their mean length.

    Args:
        cost: the step cost model (seconds of forward rows and drafter calls).
        limits: ``() -> (cap, top)``, read at each use (the policy's budget may change): the most nodes
            a request verifies (the pseudo-request's chain) and a drafter call drafts
            (:func:`~services.verifier.pricing.could_pay`).
        window: recent requests per method / regime whose saving per token prices a probe.
    """

    def __init__(self, cost: StepCostModel, limits: Callable[[], tuple[int, int]], window: int = 64):
        self.cost, self.limits, self.window = cost, limits, max(int(window), 1)
        self._curves: dict[str, deque] = {}   # regime -> forecast curves of its recent requests at their end
        self._ended: dict[str, int] = {}      # regime -> curves added so far (the cache's key)
        self._cache: dict[tuple, float] = {}  # (regime, requests, ended, cap) -> regime_saving
        self._lengths: dict[str, float] = {}  # regime -> mean tokens of its ended requests (moving)

    def record(self, regime: str, emitted: int, curve: list[float] | None) -> None:
        """A request of ``regime`` ended after emitting ``emitted`` tokens; ``curve``: its forecast from
        its own trees (None: it never drafted)."""
        if not emitted:
            return
        old = self._lengths.get(regime)
        self._lengths[regime] = emitted if old is None else 0.8 * old + 0.2 * emitted
        if curve is not None:
            self._curves.setdefault(regime, deque(maxlen=self.window)).append(list(curve))
            self._ended[regime] = self._ended.get(regime, 0) + 1

    def regime_saving(self, regime: str, requests: int) -> float:
        """Mean seconds saved per token by the regime's recent requests' forecasts plus one
        pseudo-request at full acceptance of a ``cap``-node chain, each priced in a step of
        ``requests`` (:func:`~services.verifier.pricing.saving_per_token`); cached until the window
        takes a new request."""
        curves, cap = self._curves.get(regime, ()), self.limits()[0]
        key = (regime, requests, self._ended.get(regime, 0), cap)
        if key not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            total = sum(saving_per_token(self.cost, c, requests) for c in (*curves, [1.0] * cap))
            self._cache[key] = total / (len(curves) + 1)
        return self._cache[key]

    def pays(self, regime: str, emitted: int, owed: int, remaining: int | None, requests: int = 1) -> bool:
        """Whether a probe of a request that has emitted ``emitted`` tokens and owes ``owed`` context
        positions pays for itself: expected seconds saved over its ``remaining`` tokens (None: its
        regime's mean request length minus ``emitted``) at :meth:`regime_saving`, above
        ``draft_cost(owed)``. The pseudo-request is optimism: text like none seen yet is tried while the
        evidence is thin. Before any request of the regime ended (no saving, no length known): the probe
        runs where a fully accepted tree could pay at all (:func:`~services.verifier.pricing.could_pay`).
        In a step of ``requests`` > 1 the probe also needs a fully accepted tree to pay at that batch
        size, and the savings are priced there: where batching already fills the step, a tree's rows
        save less."""
        top = self.limits()[1]
        if requests > 1 and not could_pay(self.cost, requests, top):
            return False
        if remaining is None:
            length = self._lengths.get(regime)
            remaining = None if length is None else max(int(round(length)) - emitted, 0)
        if not self._curves.get(regime) or remaining is None:
            return could_pay(self.cost, 1, top)
        return remaining * self.regime_saving(regime, requests) > self.cost.draft_cost(max(owed, 1))
