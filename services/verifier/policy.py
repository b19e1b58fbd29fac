"""Speculation policies: who drafts each step, with which budget, and which nodes are verified.

The points of a step where a policy is called: :mod:`services.verifier.policy_base`.

Two policies (``--spec-policy``):

- :class:`FixedPolicy`: explicit request values, then the manual ``--tree-schedule`` pick, then the
  verifier's defaults; every drafting request drafts every round and the whole tree is verified.
- :class:`GoodputPolicy` maximises expected emitted tokens per second of the whole step:
  ``sum_r E[emitted_r] / predicted step seconds``, with ``E`` from :class:`AcceptanceCalibrator`
  (``1 + sum`` of the calibrated P of the verified nodes) and the seconds from
  :class:`StepCostModel` (forward ``a + b * rows``, a drafter call per drafting request, a
  per-request overhead). Before drafting it predicts each request's gain from the mean calibrated
  curve of its own recent trees, weighed against its method / regime's longer window and relaxed
  towards it every plain round (:mod:`services.verifier.forecast`) and
  lets only requests whose draft pays for itself call the drafter (plus an exploration draft every
  ``explore_every`` rounds, backing off while they do not pay and capped at ``explore_fraction`` of
  the wall time, so a recovering drafter is noticed at a bounded cost); after drafting it adds nodes in
  descending calibrated P while a node's P per marginal row second beats the step's current
  tokens per second (the ratio rises exactly while that holds). Requests that set
  ``speculative.budget`` keep their whole tree (explicit values win).

Lossless by construction: a policy only changes which draft nodes are verified, never how the
target's tokens are chosen (greedy argmax / one target sample per row, then the walk).

This module holds :class:`GoodputPolicy`'s decision before drafting (who drafts, with which budget);
its parts live beside it: the per-request state and exploration intervals
(:mod:`services.verifier.policy_state`), the cut after drafting (:mod:`services.verifier.policy_select`),
the learning from rounds, steps and ended requests (:mod:`services.verifier.policy_observe`); building
a policy by name and with its cost sweep is :mod:`services.verifier.policy_build`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from services.spec import DEFAULT_KNOBS, MAX_BUDGET, TreeKnobs, TreeSchedule
from services.spec import parse_tree_schedule  # noqa: F401 (the policies' input, re-exported)
from services.tree import DraftTree
from services.verifier.calibration import AcceptanceCalibrator
from services.verifier.cost_model import StepCostModel
from services.verifier.forecast import Forecaster, mean_curve
from services.verifier.policy_base import (Drafted, FixedPolicy, Selection, SpecPolicy,  # noqa: F401 (re-exported)
                                           resolve_knobs, truncate_tree)
from services.verifier.policy_observe import PolicyObservation
from services.verifier.policy_select import DraftSelection
from services.verifier.policy_state import ExplorationBook, ReqState
from services.verifier.pricing import best_prefix, could_pay, explore_budget, overheads
from services.verifier.probe import ProbeGate
from services.verifier.scheduler import RoundInfo  # noqa: F401 (the policy's input, re-exported)


def _check_goodput_args(defaults: TreeKnobs, max_budget: int | None, explore_every: int, forecast_trees: int,
                        widen_every: int, explore_fraction: float) -> None:
    """:class:`GoodputPolicy`'s argument ranges (ValueError: one line naming the first bad one)."""
    if not defaults.is_resolved():
        raise ValueError(f"the default tree knobs must all be set (got {defaults})")
    if max_budget is not None and not 1 <= max_budget <= MAX_BUDGET:
        raise ValueError(f"max_budget must be in [1, {MAX_BUDGET}] (got {max_budget})")
    if explore_every < 1:
        raise ValueError(f"explore_every must be >= 1 (got {explore_every})")
    if forecast_trees < 1:
        raise ValueError(f"forecast_trees must be >= 1 (got {forecast_trees})")
    if widen_every < 0:
        raise ValueError(f"widen_every must be >= 0 (got {widen_every})")
    if not 0 <= explore_fraction <= 1:
        raise ValueError(f"explore_fraction must be in [0, 1] (got {explore_fraction})")


class GoodputPolicy(ExplorationBook, DraftSelection, PolicyObservation):
    """Per step, choose each request's budget (0 = plain decoding) to maximise tokens / second.

    Args:
        cost: the step cost model (seeded by a start-up sweep, refreshed by :meth:`observe_step`).
        calibrator: acceptance calibration (refreshed by :meth:`observe_round`).
        max_budget: B_max, the budget of a drafter call (None = ``defaults.budget``) and the most
            nodes one request verifies.
        explore_every: a request not drafting for this many rounds drafts once anyway (its tree
            is labelled by the tokens that follow, verified or not); while such drafts are cut to
            b = 0 the interval doubles, up to ``explore_max`` (an exploration costs a drafter call,
            so a useless drafter costs ~1 / ``explore_max`` of a call per round), and a draft that
            pays resets it. The interval is also kept per method / regime: a new request starts
            from its regime's current one, so a drafter that does not pay at this load is not
            re-explored by every arriving request.
            A new request also starts counting rounds from its regime's count of rounds since the
            regime last drafted, so requests shorter than the interval still explore.
        explore_max: the longest exploration interval.
        explore_fraction: drafter calls made regardless of the forecast (explorations, and a
            regime's first draft) may take at most this fraction of the wall time the policy has
            seen (their measured drafter wait, catch-up of the context included); a due exploration
            beyond it waits. So a drafter that never pays costs at most ~this fraction of plain
            decoding's speed, whatever the load and the length of the contexts it must catch up.
        optimism: the forecast before drafting uses calibrated P plus this many posterior standard
            deviations (an upper confidence bound), so a map made pessimistic by a few unlucky rounds
            is retried instead of trusted; the cut after drafting uses the plain posterior mean.
        schedule: ``--tree-schedule`` (None = off): the drafter call's budget / width by running
            count (before ``max_budget``); the policy may still verify fewer nodes.
        defaults: the verifier's default knobs, every one set.
        forecast_trees: the forecast before drafting is the mean sorted calibrated P (with
            ``optimism``, under the current calibration) of this many recent trees of the method /
            regime (blended with the request's own recent trees, :meth:`forecast`), times the
            request's factor.
        widen_every: every this many drafter calls of a method / regime, a call drafts one node more
            than the forecast's best budget, so the forecast keeps evidence on the next node and the
            budget can grow again when the drafter grows more confident (0 = never).
        store: where the calibration learnt by an earlier start is loaded from (as the calibrator's
            starting counts) and this one's is saved to, every ``save_every`` labelled trees at a
            request's end (:class:`~services.verifier.calibration_store.CalibrationStore`; None = off).
        probe: a request that has not drafted yet drafts once (a probe, whole budget) in the first
            round where the probe pays for its catch-up of the owed context
            (:class:`~services.verifier.probe.ProbeGate`; ~0.2-0.3 ms per prompt token on the CPU),
            outside the exploration time budget. From its first tree on, a request's forecast is
            mostly its own recent trees (in mixed traffic the regime's are other requests' text). Until
            it has drafted, a request drafts only through the probe, exploration or an explicit budget,
            so a request that never drafts pays no catch-up (the same work as ``ar``).
            ``probe=False``: no probe; the regime's forecast decides from the first round.
        probe_window: recent requests per method / regime whose saving per token prices a probe.
    Raises:
        ValueError: ``max_budget`` outside ``[1, MAX_BUDGET]``, ``explore_every < 1``,
            ``forecast_trees < 1``, ``widen_every < 0`` or ``defaults`` with an unset knob.
    """

    name = "goodput"

    def __init__(self, cost: StepCostModel | None = None, calibrator: AcceptanceCalibrator | None = None,
                 max_budget: int | None = None, explore_every: int = 16, explore_max: int = 128,
                 optimism: float = 0.5, explore_fraction: float = 0.01, schedule: TreeSchedule | None = None,
                 defaults: TreeKnobs = DEFAULT_KNOBS, forecast_trees: int = 64, widen_every: int = 4,
                 store=None, save_every: int = 64, probe: bool = True, probe_window: int = 64):
        _check_goodput_args(defaults, max_budget, explore_every, forecast_trees, widen_every, explore_fraction)
        self.schedule, self.defaults, self._running = schedule, defaults, 1
        self.cost = cost or StepCostModel()
        self.cal = calibrator or AcceptanceCalibrator()
        self.max_budget, self.explore_every = max_budget, explore_every
        self.explore_max = max(explore_max, explore_every)
        self.optimism = optimism
        self.explore_fraction = explore_fraction
        self._wall = 0.0          # seconds of steps seen
        self._explore_s = 0.0     # drafter seconds of calls made regardless of the forecast
        self._unforecast = 0      # such calls in the current step
        self.forecast_trees, self.widen_every = forecast_trees, widen_every
        self._plan: dict[str, int] = {}  # this step's drafting budget of each forecast-drafting request
        self._sized: set[str] = set()    # ... of which explorations (explore_budget; never widened)
        self._regime_calls: dict[str, int] = {}  # drafter calls of each method / regime (the widening)
        self.forecaster = Forecaster(self.cal, lambda *a: self._mean_curve(*a),
                                     self._fresh_labels, forecast_trees)
        self._regime_since: dict[str, int] = {}  # rounds since each method / regime last drafted
        self._regime_interval: dict[str, int] = {}  # the exploration interval of each method / regime
        self._req: dict[str, ReqState] = {}
        self._skip: set[str] = set()
        self._predicted: float | None = None
        self.store, self.save_every, self._unsaved, self.probe = None, save_every, 0, probe
        self.probes = ProbeGate(self.cost, lambda: (self._cap(), self._top()), probe_window)
        if store is not None:
            self.attach_store(store)

    # ----------------------------------------------------------------- helpers
    def _sorted_p(self, tree: DraftTree, regime: str, rid: str, optimism: float = 0.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.cal.p_accept(tree, regime, rid, optimism)
        order = self.cal.order(p)
        return p[order], order

    def _cap(self) -> int:
        return self.max_budget or MAX_BUDGET

    def remember(self, regime: str, tree: DraftTree, budget: int | None = None) -> None:
        """Add a drafted (non-empty) tree to the forecast window of ``regime`` (a method / regime name);
        ``budget``: the budget it was drafted with (None = the cap)."""
        self.forecaster.remember(regime, tree, budget or self._cap())

    def forecast(self, regime: str, rid: str | None = None) -> list[float] | None:
        """The forecast of request ``rid`` (None: the regime's alone) before drafting:
        :meth:`~services.verifier.forecast.Forecaster.forecast` with the request's own recent trees."""
        return self.forecaster.forecast(regime, self._req.get(rid) if rid is not None else None, rid)

    @property
    def _version(self) -> int:
        """Calibration updates so far (the forecaster's cached curves follow it)."""
        return self.forecaster.version

    @_version.setter
    def _version(self, value: int) -> None:
        self.forecaster.version = value

    def _overheads(self, requests: int) -> tuple[float, float]:
        """:func:`~services.verifier.pricing.overheads` on the policy's cost model."""
        return overheads(self.cost, requests)

    def _fresh_labels(self) -> int:
        """New calibration labels after which a cached forecast curve is recomputed: the running count."""
        return max(1, self._running)

    def _top(self) -> int:
        """The most nodes a drafter call drafts, as far as pricing goes: the budget, at most 16."""
        return min(self.max_budget or self.defaults.budget, 16)

    def _could_pay(self, requests: int = 1, drafter: bool = True) -> bool:
        """:func:`~services.verifier.pricing.could_pay` within :meth:`_top` nodes."""
        return could_pay(self.cost, requests, self._top(), drafter)

    def explore_budget(self, curve: list[float]) -> int:
        """Budget of an exploration whose forecast is ``curve`` (:func:`~services.verifier.pricing.explore_budget`
        up to the cap). A request's first draft (its probe) keeps the whole budget instead."""
        return explore_budget(self.cost, curve, self._cap())

    def probe_pays(self, regime: str, st: ReqState, owed: int, remaining: int | None, requests: int = 1) -> bool:
        """Whether the probe of a request that has not drafted yet pays for its catch-up
        (:meth:`~services.verifier.probe.ProbeGate.pays`)."""
        return self.probes.pays(regime, st.emitted, owed, remaining, requests)

    def _mean_curve(self, window, regime: str, weights: list[float] | None = None) -> list[float]:
        """:func:`~services.verifier.forecast.mean_curve` of a window of ``(tree, budget)`` with the
        policy's ``optimism`` and cap."""
        return mean_curve(self.cal, window, regime, self.optimism, self._cap(), weights)

    # ----------------------------------------------------------- before drafting
    def _best_prefix(self, gain0: float, rows0: int, probs: list[float], fixed_s: float,
                     extra_rows: int = 0) -> tuple[int, float, float]:
        """:func:`~services.verifier.pricing.best_prefix` on the policy's cost model."""
        return best_prefix(self.cost, gain0, rows0, probs, fixed_s, extra_rows)

    def begin_step(self, rounds: list[RoundInfo], extra_rows: int = 0, num_running: int = 1) -> None:
        """Decide which requests call the drafter this step, from each request's forecast (its last
        tree under the current calibration): for m = 0, 1, ... of the requests with the largest
        forecast gain, the best number of nodes over their pooled forecasts, paying m drafter calls;
        the m with the most tokens per predicted second drafts.

        A forecast draft is priced at the steady drafter call (one owed token): the catch-up of a
        context the drafter has not seen (a new request's prompt, the tokens of plain rounds) is paid
        by whichever draft comes next and only grows while the request waits, so it is no reason to
        wait; charged to this round alone it kept every new request plain (docs/roofline.md). The one
        exception is a request that has not drafted yet: its first draft (the probe) is priced with
        its whole catch-up against the saving expected over its remaining tokens
        (:meth:`probe_pays`), and it stays plain until that pays (or an exploration is due).

        Args:
            rounds: the step's decoding requests; extra_rows: other rows of the step (prompt chunks);
            num_running: requests holding state (the schedule's pick).
        """
        self._running = num_running
        o, e = self._overheads(len(rounds))  # e: a drafted round's own work in the step, beyond its drafter call
        forced_s, curves, held, sized = self._triage(rounds, e)
        n = len(rounds)
        best_m, best_k, pool = self._best_drafting(curves, n, forced_s, o * n, extra_rows)
        drafting = {rid for _, rid, _, _ in curves[:best_m]}
        self._skip = {rid for _, rid, _, _ in curves if rid not in drafting} | held
        pool = sorted((x for x in pool if x[1] in drafting), key=lambda x: -x[0])[:best_k]
        self._plan = {rid: max(sum(1 for _, r in pool if r == rid), 1) for rid in drafting} | sized
        self._sized = set(sized)

    def _triage(self, rounds: list[RoundInfo], e: float) -> tuple[float, list, set[str], dict[str, int]]:
        """Each round's way into the step (:meth:`begin_step`): ``(forced_s, curves, held, sized)``:
        the seconds of the drafts made regardless of the forecast (explicit budget, no forecast yet,
        exploration, probe); ``(gain, rid, forecast curve, drafter seconds)`` of the others, largest
        gain first; the requests held plain; each exploration's budget."""
        c = self.cost
        forced_s, planned, self._unforecast = 0.0, 0.0, 0
        pays_here: bool | None = None  # whether any tree could pay at this batch size (once, when needed)
        curves: list[tuple[float, str, list[float], float]] = []
        held: set[str] = set()  # not drafted yet and no probe due: plain (no catch-up paid)
        sized: dict[str, int] = {}  # the drafting budget of each exploration (explore_budget)
        for r in rounds:
            st = self._enter(r)
            if not r.can_draft:
                continue
            forecast = self.forecast(st.regime, r.rid)
            explore = forecast is not None and st.since_draft + 1 >= st.interval
            if explore and self._explore_s + planned > self.explore_fraction * self._wall:
                explore = False       # over the exploration time budget (this step's planned ones included)
            if self.probe and not st.probed and forecast is not None and not explore and not r.explicit_budget:
                if not self.probe_pays(st.regime, st, r.owed, r.remaining, len(rounds)):
                    held.add(r.rid)  # its catch-up would cost more than its text is expected to save
                    continue
                explore = True  # its probe: its own text's first tree
            if r.explicit_budget or forecast is None or explore:
                if not r.explicit_budget:
                    pays_here = self._could_pay(len(rounds), False) if pays_here is None else pays_here
                    if not pays_here:  # not even a fully accepted tree's rows pay at this batch size: plain
                        held.add(r.rid)
                        continue
                cost = c.draft_cost(r.owed)
                forced_s += cost + e                     # draft regardless (explicit / no forecast / explore)
                self._unforecast += not r.explicit_budget
                planned += 0.0 if r.explicit_budget else cost
                if explore and st.probed:                # an exploration of a request that has drafted: a small
                    sized[r.rid] = self.explore_budget(forecast)  # tree suffices (its first draft stays whole)
                continue
            curves.append((sum(forecast), r.rid, forecast, c.draft_cost(min(r.owed, 1)) + e))
        curves.sort(key=lambda x: -x[0])
        return forced_s, curves, held, sized

    def _best_drafting(self, curves: list, n: int, forced_s: float, per_req: float,
                       extra_rows: int) -> tuple[int, int, list[tuple[float, str]]]:
        """``(m, k, pool)``: the first m requests of ``curves`` draft on their forecast; k nodes of
        their pooled forecasts are expected to be verified; ``pool``: every curve's nodes as (P, rid),
        most likely first. m and k maximise the step's expected tokens per predicted second
        (``forced_s``: the drafts made regardless; ``per_req``: the per-request overheads;
        ``extra_rows``: the step's prompt-chunk rows)."""
        best_m, best_ratio, best_k = 0, -1.0, 0
        pool: list[tuple[float, str]] = []
        draft_s = forced_s
        for m in range(len(curves) + 1):
            if m:
                pool = sorted(pool + [(p, curves[m - 1][1]) for p in curves[m - 1][2]], key=lambda x: -x[0])
                draft_s += curves[m - 1][3]
            k, g, t = self._best_prefix(float(n), n, [p for p, _ in pool], draft_s + per_req, extra_rows)
            if t > 0 and g / t > best_ratio + 1e-12:
                best_m, best_ratio, best_k = m, g / t, k
        return best_m, best_k, pool

    def draft_knobs(self, rid: str, spec) -> TreeKnobs | None:
        """``None`` (plain round, no drafter call) for a request :meth:`begin_step` left out; else the
        request's resolved knobs. An unset budget is the schedule's pick, else ``max_budget``, cut to
        the forecast's best budget when the request drafts on its forecast: its nodes among the most
        likely nodes of the step that maximise expected tokens per predicted second on the measured
        cost curve (on a q4 CPU the 5th verify row crosses the kernel's 4-row tile, so B = 3 where
        the forecast does not pay for that row; docs/roofline.md), plus one node every
        ``widen_every``-th call of its method / regime. Drafting the budget the step will verify
        also saves the drafter's work on nodes the cut would drop."""
        st = self._state(rid)
        if rid in self._skip:
            st.since_draft += 1
            st.plain += 1
            self._regime_since[st.regime] = max(self._regime_since.get(st.regime, 0), st.since_draft)
            self.cal.relax(rid)
            return None
        st.since_draft = self._regime_since[st.regime] = 0
        st.probed = True
        knobs = resolve_knobs(spec, self.defaults, self.schedule, self._running, self.max_budget)
        plan = self._plan.get(rid)
        if spec.budget is None and plan is not None:
            calls = self._regime_calls[st.regime] = self._regime_calls.get(st.regime, 0) + 1
            widen = self.widen_every and calls % self.widen_every == 0 and rid not in self._sized
            knobs = replace(knobs, budget=min(knobs.budget, plan + int(bool(widen))))
        st.budget = knobs.budget
        return knobs
