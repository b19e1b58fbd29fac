"""Speculation settings, torch-free: the methods, the tree knobs with their limits, the policy names.

Every other module takes these names from here (the wire protocol, the CLIs, the workers, the
benchmarks and the test doubles), so a method or a policy is spelled in one place.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from math import isfinite


class Method(enum.StrEnum):
    """A speculative method a request may name (``"ar"``: plain decoding, no drafter).

    The members compare equal to their strings (``Method.DDTREE == "ddtree"``), so a method read from
    JSON, a flag or the wire needs no conversion before a membership test.
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
        """Whether the drafter needs the Domino correction head (:data:`HEAD_METHODS`)."""
        return self.value in HEAD_METHODS

    @property
    def is_tree(self) -> bool:
        """Whether the draft may branch (False: a chain, or no draft at all for ``ar``)."""
        return self not in (Method.AR, Method.DFLASH, Method.DOMINO, Method.DSPARK)

    @property
    def family(self) -> str:
        """The drafter family that serves it: ``"dflash"`` (DFlash backbone, with or without the
        Domino head), ``"dspark"`` (Markov head) or ``"eagle3"``; ``"ar"`` needs none."""
        if self is Method.AR:
            return "ar"
        if self.value in MARKOV_METHODS:
            return "dspark"
        return "eagle3" if self.value in EAGLE3_METHODS else "dflash"

    def served_by(self, kind: str) -> bool:
        """Whether a drafter of ``kind`` serves this method (:func:`served_methods`)."""
        return self.value in served_methods(kind)


# Methods of the DFlash-backbone family (a plain DFlash drafter serves ar/dflash/ddtree, a Domino one all of them).
DFLASH_METHODS = ("ar", "dflash", "ddtree", "domino", "dartree-fixed", "dartree-pruned", "seqheap", "domino-ddtree")
# Methods that need a drafter with the Domino correction head.
HEAD_METHODS = frozenset({"domino", "dartree-fixed", "dartree-pruned", "seqheap", "domino-ddtree"})
# DSpark drafters (Markov head, docs/algorithms.md §3): its own chain rollout and DARTree with the Markov scorer.
MARKOV_METHODS = frozenset({"dspark", "dspark-dartree"})
# EAGLE-3 drafters: the dynamic top-k draft tree (services.tree.eagle).
EAGLE3_METHODS = frozenset({"eagle3"})
# Every method, in the order tables and error messages list them.
METHODS = tuple(m.value for m in Method)

DEFAULT_METHOD = Method.DARTREE_PRUNED.value  # the method of a request that names none, when served
# The default method's stand-ins, best first, when a drafter does not serve it.
PREFERRED_METHODS = ("dartree-pruned", "dspark-dartree", "eagle3", "ddtree", "ar")

_SERVED = {
    "dflash": frozenset({"ar", "dflash", "ddtree"}),
    "domino": frozenset(DFLASH_METHODS),
    "dspark": frozenset({"ar", "dflash", "ddtree"}) | MARKOV_METHODS,
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
