"""What every speculation policy shares (the step's types, knob resolution, the tree cut) and the
fixed policy; the goodput policy is in :mod:`services.verifier.policy`, ``make_policy`` in
:mod:`services.verifier.policy_build`.

A policy is called at four points of a step: the step plan (``scheduler.make_plan``, which the
verifier worker makes) calls 1 and 2, the engine (``SpecEngine.step``) 3 and 4:

1. :meth:`SpecPolicy.begin_step` with the step's decoding requests (before any drafting);
2. :meth:`SpecPolicy.draft_knobs` per request: the fully resolved :class:`~services.spec.TreeKnobs` of its
   drafter call, or ``None`` for a plain-decoding round (B = 0: no drafter call at all); with
   overlap the engine also asks it for a request's next draft right after its commit. This is
   the one place a request's knobs are resolved: its explicit ``speculative`` values, then the
   ``--tree-schedule`` pick at the current running count (:class:`TreeSchedule`), then (goodput)
   ``max_budget`` for the budget, then the verifier's defaults;
3. :meth:`SpecPolicy.select` after drafting: how many nodes of each tree to verify (a prefix-closed top-b by
   calibrated acceptance, so the cut tree stays a valid tree);
4. :meth:`SpecPolicy.observe_round` / :meth:`SpecPolicy.observe_step` after the forward: the committed tokens (labels for
   the calibrator) and the step's measured times (the cost model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from services.spec import DEFAULT_KNOBS, TreeKnobs, TreeSchedule
from services.tree import DraftTree
from services.tree.dartree import select_nodes
from services.verifier.scheduler import RoundInfo


def resolve_knobs(spec, defaults: TreeKnobs, schedule: TreeSchedule | None = None, num_running: int = 1,
                  max_budget: int | None = None) -> TreeKnobs:
    """A request's fully resolved knobs. ``spec`` has ``budget, width, depth_bonus, candidates``
    (``None`` = unset); each unset one comes from the schedule's pick at ``num_running`` (budget and
    width), then ``max_budget`` (budget), then ``defaults`` (which must be resolved)."""
    pick = schedule.pick(num_running) if schedule is not None else None
    budget, width = pick if pick is not None else (None, None)
    asked = TreeKnobs(spec.budget, spec.width, spec.depth_bonus, spec.candidates)
    return asked.filled_from(TreeKnobs(budget if budget is not None else max_budget, width)).filled_from(defaults)


def truncate_tree(tree: DraftTree, keep_order: torch.Tensor, b: int) -> DraftTree:
    """The first ``b`` nodes of ``keep_order`` as a tree (their indices sorted, parents remapped).

    Raises:
        ValueError: the kept set is not prefix-closed (``select_nodes``).
    """
    if b >= tree.num_nodes:
        return tree
    if b <= 0:
        return DraftTree.empty()
    return select_nodes(tree, torch.sort(keep_order[:b]).values)


@dataclass
class Drafted:
    """A request's tree after drafting (``tree`` is empty for a request that did not draft)."""

    info: RoundInfo
    tree: DraftTree
    drafted: bool


@dataclass
class Selection:
    """What :meth:`select` chose for one request: the tree to verify, its budget and predicted tau."""

    tree: DraftTree
    budget: int
    predicted_tau: float | None = None


@runtime_checkable
class SpecPolicy(Protocol):
    """What the engine calls on a policy, in step order (module docstring); ``name`` is one of
    :data:`services.spec.POLICIES`."""

    name: str

    def begin_step(self, rounds: list[RoundInfo], extra_rows: int = 0, num_running: int = 1) -> None: ...

    def draft_knobs(self, rid: str, spec) -> TreeKnobs | None: ...

    def select(self, items: list[Drafted]) -> dict[str, Selection]: ...

    def observe_round(self, rid: str, committed: list[int]) -> None: ...

    def observe_step(self, stats) -> None: ...

    def predicted_step_seconds(self) -> float | None: ...

    def release(self, rid: str) -> None: ...


class FixedPolicy:
    """Every drafting request drafts with its resolved knobs; nothing is cut.

    Args:
        schedule: ``--tree-schedule`` (None = off): budget / width by running count.
        defaults: the verifier's default knobs, every one set (:func:`services.spec.default_tree_knobs`).
    Raises:
        ValueError: ``defaults`` with an unset knob.
    """

    name = "fixed"

    def __init__(self, schedule: TreeSchedule | None = None, defaults: TreeKnobs = DEFAULT_KNOBS):
        if not defaults.is_resolved():
            raise ValueError(f"the default tree knobs must all be set (got {defaults})")
        self.schedule, self.defaults = schedule, defaults
        self._running = 1

    def begin_step(self, rounds: list[RoundInfo], extra_rows: int = 0, num_running: int = 1) -> None:
        """Remember the running count (the schedule's pick)."""
        self._running = num_running

    def draft_knobs(self, rid: str, spec) -> TreeKnobs | None:
        """The request's resolved knobs (never ``None``: always draft)."""
        return resolve_knobs(spec, self.defaults, self.schedule, self._running)

    def select(self, items: list[Drafted]) -> dict[str, Selection]:
        """Every tree whole."""
        return {d.info.rid: Selection(d.tree, d.tree.num_nodes) for d in items}

    def observe_round(self, rid: str, committed: list[int]) -> None:
        """Nothing to learn."""

    def observe_step(self, stats) -> None:
        """Nothing to learn."""

    def predicted_step_seconds(self) -> float | None:
        """No prediction."""
        return None

    def release(self, rid: str) -> None:
        """Nothing held."""

    def flush(self) -> None:
        """Nothing learnt to save."""
