"""Speculation settings, torch-free: the methods, the tree knobs with their limits and defaults, the
load-dependent tree schedule, the policy names.

Every other module takes these names from here (the wire protocol, the CLIs, the workers, the
benchmarks and the test doubles), so a method or a policy is spelled in one place.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from math import isfinite


class Method(enum.StrEnum):
    """A speculative method a request may name (``"ar"``: plain decoding, no drafter).

    The members compare equal to their strings (``Method.DDTREE == "ddtree"``), so a method read from
    JSON, a flag or the wire needs no conversion before a membership test. What each one is (its
    family, whether it needs the Domino head, branches, is bounded by its budget) is one row of
    :data:`METHOD_TRAITS`; the family sets below are read from it.
    """

    AR = "ar"
    DFLASH = "dflash"
    DDTREE = "ddtree"
    DOMINO = "domino"
    DARTREE_FIXED = "dartree-fixed"
    DARTREE_PRUNED = "dartree-pruned"
    SEQHEAP = "seqheap"
    DOMINO_DDTREE = "domino-ddtree"
    DSPARK = "dspark"
    DSPARK_DARTREE = "dspark-dartree"
    EAGLE3 = "eagle3"

    @property
    def drafts(self) -> bool:
        """Whether a round of this method calls the drafter (every method but ``ar``)."""
        return self is not Method.AR

    @property
    def needs_head(self) -> bool:
        """Whether the drafter needs the Domino correction head."""
        return METHOD_TRAITS[self].head

    @property
    def is_tree(self) -> bool:
        """Whether the draft may branch (False: a chain, or no draft at all for ``ar``)."""
        return METHOD_TRAITS[self].tree

    @property
    def budget_deep(self) -> bool:
        """Whether a B-node tree of this method is at most B deep and identical when built over only
        B draft slots (``dartree.pruned_reach``; seqheap / DDTree pop at most B nodes, a depth-d node
        after its d - 1 ancestors): the drafter then drafts only ``budget`` slots."""
        return METHOD_TRAITS[self].budget_deep

    @property
    def family(self) -> str:
        """The drafter family that serves it: ``"dflash"`` (DFlash backbone, with or without the
        Domino head), ``"dspark"`` (Markov head) or ``"eagle3"``; ``"ar"`` needs none."""
        return METHOD_TRAITS[self].family

    def served_by(self, kind: str) -> bool:
        """Whether a drafter of ``kind`` serves this method (:func:`served_methods`)."""
        return self.value in served_methods(kind)


@dataclass(frozen=True)
class MethodTraits:
    """What a :class:`Method` is. family: the drafter family that serves it (``"ar"``: none);
    head: needs the Domino correction head; tree: the draft may branch; budget_deep: see
    :attr:`Method.budget_deep`."""

    family: str
    head: bool = False
    tree: bool = True
    budget_deep: bool = False


METHOD_TRAITS: dict[Method, MethodTraits] = {
    Method.AR: MethodTraits("ar", tree=False),
    Method.DFLASH: MethodTraits("dflash", tree=False),
    Method.DDTREE: MethodTraits("dflash", budget_deep=True),
    Method.DOMINO: MethodTraits("dflash", head=True, tree=False),
    Method.DARTREE_FIXED: MethodTraits("dflash", head=True),
    Method.DARTREE_PRUNED: MethodTraits("dflash", head=True, budget_deep=True),
    Method.SEQHEAP: MethodTraits("dflash", head=True, budget_deep=True),
    Method.DOMINO_DDTREE: MethodTraits("dflash", head=True),
    Method.DSPARK: MethodTraits("dspark", tree=False),
    Method.DSPARK_DARTREE: MethodTraits("dspark", budget_deep=True),
    Method.EAGLE3: MethodTraits("eagle3"),
}

# Methods of the DFlash-backbone family (a plain DFlash drafter serves ar/dflash/ddtree, a Domino one all of them).
DFLASH_METHODS = tuple(m.value for m in Method if m.family in ("ar", "dflash"))
# Methods that need a drafter with the Domino correction head.
HEAD_METHODS = frozenset(m.value for m in Method if m.needs_head)
# DSpark drafters (Markov head, docs/algorithms.md §3): its own chain rollout and DARTree with the Markov scorer.
MARKOV_METHODS = frozenset(m.value for m in Method if m.family == "dspark")
# EAGLE-3 drafters: the dynamic top-k draft tree (services.tree.eagle).
EAGLE3_METHODS = frozenset(m.value for m in Method if m.family == "eagle3")
# Every method, in the order tables and error messages list them.
METHODS = tuple(m.value for m in Method)

DEFAULT_METHOD = Method.DARTREE_PRUNED.value  # the method of a request that names none, when served
# The default method's stand-ins, best first, when a drafter does not serve it.
PREFERRED_METHODS = ("dartree-pruned", "dspark-dartree", "eagle3", "ddtree", "ar")

_PLAIN_DFLASH = frozenset(m for m in DFLASH_METHODS if m not in HEAD_METHODS)  # ar, dflash, ddtree
_SERVED = {
    "dflash": _PLAIN_DFLASH,
    "domino": frozenset(DFLASH_METHODS),
    "dspark": _PLAIN_DFLASH | MARKOV_METHODS,
    "eagle3": frozenset({"ar"}) | EAGLE3_METHODS,
}


def served_methods(kind: str) -> tuple[str, ...]:
    """Methods a drafter of ``kind`` serves, in :data:`METHODS` order.

    ``kind``: ``"dflash"`` (no correction head), ``"domino"``, ``"dspark"`` or ``"eagle3"``.

    Raises:
        ValueError: unknown kind.
    """
    if kind not in _SERVED:
        raise ValueError(f"unknown drafter kind {kind!r} (choose from {', '.join(_SERVED)})")
    return tuple(m for m in METHODS if m in _SERVED[kind])


def preferred_method(served: tuple[str, ...] | list[str]) -> str:
    """The first of :data:`PREFERRED_METHODS` in ``served`` (``"ar"`` when none is)."""
    return next((m for m in PREFERRED_METHODS if m in served), "ar")


# ------------------------------------------------------------------------------------------ policies

# Speculation policies (``--spec-policy``; services.verifier.policy). goodput: each round's tree budget
# (0 = plain decoding) maximises tokens/s, the budget knob is its maximum; fixed: every round verifies
# the whole tree of the budget.
POLICIES = ("goodput", "fixed")
DEFAULT_POLICY = "goodput"  # dartree serve and generate (dartree bench measures fixed budgets unless told)


# ---------------------------------------------------------------------------------------- tree knobs

MAX_BUDGET = 1024      # largest tree budget B a request, a default or the schedule may ask for
MAX_WIDTH = 256        # largest tree width W
MAX_CANDIDATES = 1024  # largest candidate pool K


DEFAULT_MAX_REQUEST_BUDGET = 64  # `dartree serve --max-request-budget`: the largest tree a request may ask for


def request_tree_limits(max_request_budget: int) -> tuple[int, int, int]:
    """``(budget, width, candidates)`` caps on a request's ``speculative`` knobs for a server whose
    ``--max-request-budget`` is ``max_request_budget``: B and W up to it, K up to it or the
    default K (64), whichever is larger; never above :data:`MAX_BUDGET` / :data:`MAX_WIDTH` /
    :data:`MAX_CANDIDATES`. One request's tree is verified in the step every running request
    shares, and its drafting (W x K candidates a depth) delays them too: without a cap a single
    request asking for B = 1,024, W = 256, K = 1,024 made a concurrent 32-token answer take 33 s
    instead of 0.3 s on a 2-core CPU.

    Raises:
        ValueError: ``max_request_budget`` outside ``[1, MAX_BUDGET]``.
    """
    if not 1 <= max_request_budget <= MAX_BUDGET:
        raise ValueError(f"max_request_budget must be in [1, {MAX_BUDGET}] (got {max_request_budget})")
    return (max_request_budget, min(max_request_budget, MAX_WIDTH),
            min(max(max_request_budget, DEFAULT_KNOBS.candidates), MAX_CANDIDATES))


def check_tree_knobs(budget: int | None, width: int | None, depth_bonus: float | None, candidates: int | None,
                     prefix: str = "speculative.") -> None:
    """The ranges of the tree knobs, for a request (``speculative.*``) and for the server defaults.

    Raises:
        ValueError: one line naming the first bad knob (``None`` = unset, always fine).
    """
    for name, v, hi in (("budget", budget, MAX_BUDGET), ("width", width, MAX_WIDTH),
                        ("candidates", candidates, MAX_CANDIDATES)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise ValueError(f"{prefix}{name} must be an integer (got {v!r})")
        if v is not None and not 1 <= v <= hi:
            raise ValueError(f"{prefix}{name} must be in [1, {hi}] (got {v})")
    if depth_bonus is not None and (isinstance(depth_bonus, bool) or not isfinite(depth_bonus) or depth_bonus > 0):
        raise ValueError(f"{prefix}depth_bonus must be a finite number <= 0 (got {depth_bonus})")


@dataclass(frozen=True)
class TreeKnobs:
    """The knobs of the tree builders (``services.tree``); ``None`` = unset (the defaults apply).

    Attributes:
        budget: B, draft nodes per tree (root excluded), in ``[1, MAX_BUDGET]``.
        width: W, children kept per node (DARTree), in ``[1, MAX_WIDTH]``.
        depth_bonus: beta <= 0 of the pruned DARTree score.
        candidates: K, the candidate pool per depth, in ``[1, MAX_CANDIDATES]``.
    """

    budget: int | None = None
    width: int | None = None
    depth_bonus: float | None = None
    candidates: int | None = None

    def __post_init__(self) -> None:
        self.check(prefix="")

    def check(self, prefix: str = "speculative.") -> None:
        """Raises ValueError (one line, field names after ``prefix``) for a knob out of range."""
        check_tree_knobs(self.budget, self.width, self.depth_bonus, self.candidates, prefix)

    def filled_from(self, defaults: TreeKnobs) -> TreeKnobs:
        """These knobs with each unset one taken from ``defaults`` (set values win)."""
        return TreeKnobs(*(v if v is not None else d for v, d in zip(self.astuple(), defaults.astuple())))

    def astuple(self) -> tuple:
        """``(budget, width, depth_bonus, candidates)``."""
        return (self.budget, self.width, self.depth_bonus, self.candidates)

    def is_resolved(self) -> bool:
        """Whether every knob is set (what a drafter call needs)."""
        return None not in self.astuple()


# The paper's tree knobs (B=64, W=12, beta=-0.2, K=64): the CUDA default, and the engine's when it is
# given no policy.
DEFAULT_KNOBS = TreeKnobs(budget=64, width=12, depth_bonus=-0.2, candidates=64)


def default_tree_knobs(device: str = "cpu") -> TreeKnobs:
    """The verifier's default tree knobs on ``device``: :data:`DEFAULT_KNOBS` on CUDA, B=8 on CPU.

    On CPU a tree verify costs 1.5-3.4 one-token steps (4-64 nodes, weights pre-packed), so small
    trees win: in ``dartree bench --skip-main --datasets gsm8k --sweep-grid --sweep-budget 4 8 12 16
    24 32 --sweep-width 4 8 12 --sweep-prompts 6`` on a 2-core machine
    (benchmarks/results/2026-11-30-cpu2-packed-sweep) B=4..12 were within 2 % of each other
    (0.86-0.90x of ``ar``) and larger B slower; B=8, W=12 (0.89x, tau 1.89) is the middle of that
    plateau.
    """
    if str(device).startswith("cuda"):
        return DEFAULT_KNOBS
    return TreeKnobs(budget=8, width=12, depth_bonus=-0.2, candidates=64)


# ------------------------------------------------------------------------------------ tree schedule

_STEP_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*[xX]\s*(\d+)\s*$")


@dataclass(frozen=True)
class TreeSchedule:
    """``--tree-schedule``: ``steps`` are ``(min_running, budget, width)`` with strictly increasing
    ``min_running``; the verifier's policy picks a step per round from the running count
    (docs/configuration.md, "Tree defaults")."""

    steps: tuple[tuple[int, int, int], ...]

    def pick(self, num_running: int) -> tuple[int, int] | None:
        """``(budget, width)`` of the last step whose threshold is <= ``num_running`` (None: below all)."""
        chosen = None
        for min_running, budget, width in self.steps:
            if num_running < min_running:
                break
            chosen = (budget, width)
        return chosen

    def __str__(self) -> str:
        return ",".join(f"{n}:{b}x{w}" for n, b, w in self.steps)


def parse_tree_schedule(text: str, max_budget: int = MAX_BUDGET, max_running: int | None = None
                        ) -> TreeSchedule | None:
    """Parse ``"N:BxW,N:BxW,..."`` ("" or "none" = no schedule).

    Raises:
        ValueError: one line naming the bad step: malformed, threshold < 1 or not increasing
            (or above ``max_running``, where it could never apply), budget outside
            ``[1, max_budget]``, width outside ``[1, MAX_WIDTH]``.
    """
    if text.strip().lower() in ("", "none"):
        return None
    steps: list[tuple[int, int, int]] = []
    for part in text.split(","):
        m = _STEP_RE.match(part)
        if m is None:
            raise ValueError(f"tree_schedule: {part.strip()!r} is not MIN_RUNNING:BUDGETxWIDTH "
                             f"(example: 1:16x12,4:8x6)")
        n, b, w = (int(g) for g in m.groups())
        if n < 1 or (steps and n <= steps[-1][0]):
            raise ValueError(f"tree_schedule: thresholds must be >= 1 and strictly increasing (got {n} "
                             f"after {steps[-1][0] if steps else 'nothing'})")
        if max_running is not None and n > max_running:
            raise ValueError(f"tree_schedule: threshold {n} exceeds max_running {max_running} (it could never apply)")
        if not 1 <= b <= max_budget:
            raise ValueError(f"tree_schedule: budget {b} (at {n} running) must be in [1, {max_budget}]")
        if not 1 <= w <= MAX_WIDTH:
            raise ValueError(f"tree_schedule: width {w} (at {n} running) must be in [1, {MAX_WIDTH}]")
        steps.append((n, b, w))
    return TreeSchedule(tuple(steps))
