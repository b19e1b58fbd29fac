"""The goodput policy's learning side: what it takes from each finished round, step and request.

:class:`PolicyObservation` is the part of :class:`~services.verifier.policy.GoodputPolicy` called after
the forward (step point 4 of :mod:`services.verifier.policy_base`) and at a request's end: a round's
committed tokens label the request's pending trees for the acceptance calibrator, a step's measured
times refresh the cost model and the exploration time budget, an ended request's labels and length go
to the calibrator and the probe gate, and the calibration is saved to its store
(:class:`~services.verifier.calibration_store.CalibrationStore`) every ``save_every`` labelled trees.
"""

from __future__ import annotations

import logging

log = logging.getLogger("verifier.policy")


class PolicyObservation:
    """The observing methods of :class:`~services.verifier.policy.GoodputPolicy` (module docstring), a
    mixin of it: it reads and updates the policy's calibrator ``cal``, cost model ``cost``, probe gate
    ``probes``, per-request states ``_req`` / plain set ``_skip``, the calibration ``_version``, the
    store (``store``, ``save_every``, ``_unsaved``) and the exploration time budget (``_wall``,
    ``_explore_s``, ``_unforecast``), and calls its ``forecast``."""

    def attach_store(self, store) -> bool:
        """Load the calibration ``store`` holds (an earlier start's, as the starting counts) and save
        this one's there from now on. Returns whether a saved calibration was loaded."""
        state = store.load()
        loaded = state is not None and self.cal.load_state(state)
        self.store = store
        log.info("acceptance calibration: %s (%s)", "loaded from an earlier start" if loaded else "cold start",
                 store.key)
        return loaded

    def observe_round(self, rid: str, committed: list[int]) -> None:
        """The tokens a round committed after its root (accepted drafts + bonus): label the
        request's pending trees once the tokens reach their depth."""
        st = self._req.get(rid)
        if st is None:
            return
        st.emitted += len(committed)
        while st.pending:
            for entry in st.pending:
                entry[1].extend(committed)
            committed = []
            tree, cont = st.pending[0]
            if len(cont) < tree.max_depth:
                return
            st.pending.popleft()
            self.cal.observe(tree, cont, st.regime, rid)
            self._version += 1
            self._unsaved += 1

    def observe_step(self, stats) -> None:
        """A step's measured forward (rows, seconds), drafter seconds and wall time (``StepStats``)."""
        if not stats.requests:
            return
        self._wall += getattr(stats, "wall_seconds", 0.0) or stats.forward_seconds + stats.draft_wait_seconds
        drafting = getattr(stats, "drafting", 0)
        if self._unforecast and drafting:  # the exploration budget's spending
            self._explore_s += stats.draft_wait_seconds * min(self._unforecast, drafting) / drafting
        self._unforecast = 0
        self.cost.observe_forward(stats.rows, stats.forward_seconds)
        if drafting:
            self.cost.observe_draft(stats.draft_wait_seconds / drafting, drafting, getattr(stats, "draft_owed", None))
        wall = getattr(stats, "wall_seconds", 0.0)
        if wall > 0:
            rest = wall - stats.forward_seconds - stats.draft_wait_seconds
            self.cost.observe_overhead(max(rest, 0.0) / stats.requests, stats.requests, drafting)

    def release(self, rid: str) -> None:
        """A request ended: label its pending trees with the tokens it had, forget its state."""
        st = self._req.get(rid)
        if st is not None:  # what it says about its regime's requests (the probe's price)
            self.probes.record(st.regime, st.emitted, (self.forecast(st.regime, rid) or []) if st.trees else None)
        st = self._req.pop(rid, None)
        self._skip.discard(rid)
        if st is not None:
            for tree, cont in st.pending:
                if cont:
                    self.cal.observe(tree, cont, st.regime, None)
                    self._version += 1
                    self._unsaved += 1
        self.cal.release(rid)
        if self._unsaved >= self.save_every:
            self.flush()

    def flush(self) -> None:
        """Save the calibration to the store now (when one is attached and something new was learnt)."""
        if self.store is not None and self._unsaved:
            self.store.save(self.cal.state())
            self._unsaved = 0
