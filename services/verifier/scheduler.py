"""The step plan: which requests the next target forward holds, in which role, and with which
tree knobs, decided before anything is drafted or run.

The verifier worker makes the plan and the engine runs exactly it (``SpecEngine.step(plan)``):

1. :func:`plan_step` (pure: no torch, no engine) lays out the candidates (:class:`Candidate`, the
   engine's view of each request: ``SpecEngine.candidates``): decode rounds first, then prompt
   chunks, each group in the candidates' priority order;
2. :func:`make_plan` asks the speculation policy (``services.verifier.policy``) for each decode
   round's resolved :class:`~services.spec.TreeKnobs` (None: a plain round, no drafter call), then
   takes decode rounds while the step has rows left (``1 +`` the most nodes its draft can have; the
   first entry always runs) and sizes each prompt chunk to the rows the rounds left over.

The result is a frozen :class:`StepPlan` that a test compares literally and a log line can print.
Which requests are candidates is the worker's call: every running request in an order that rotates
each step, and with overlap only one of two groups of drafting requests per step
(:class:`OverlapGroups`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from services.spec import TreeKnobs


@dataclass
class RoundInfo:
    """One decoding request of a step, as the policy sees it.

    Attributes:
        rid: request id; method: its speculative method; temperature: its sampling temperature;
        can_draft: the method drafts and the context has room for a draft token;
        explicit_budget: the request set ``speculative.budget`` itself;
        owed: context tokens its drafter has not seen (its next draft catches them up first);
        remaining: tokens it may still emit (``max_tokens`` minus emitted; None = unknown: the policy
        uses the mean length of its method / regime's ended requests).
    """

    rid: str
    method: str
    temperature: float
    can_draft: bool
    explicit_budget: bool = False
    owed: int = 0
    remaining: int | None = None


@dataclass(frozen=True)
class Candidate:
    """One request's state as the planner sees it.

    Attributes:
        rid: request id; slot: its KV slot; prompt_len: prompt tokens; prefilled: prompt tokens
        already in the slot (``== prompt_len``: the request decodes); can_draft: a decode round may
        call the drafter (a drafting method, a drafter, room for a draft token); owed: context
        tokens its drafter has not seen yet; info: a decoding request's view for the policy;
        spec: its ``SpecParams`` (the knobs it asked for); depth: the deepest draft it may get;
        tree: its method branches (a draft has at most ``budget`` nodes; else a chain of at most
        ``depth``); in_flight: the knobs of a draft already submitted for this round (overlap).
    """

    rid: str
    slot: int
    prompt_len: int
    prefilled: int
    can_draft: bool = False
    owed: int = 0
    info: RoundInfo | None = None
    spec: Any = None
    depth: int = 0
    tree: bool = True
    in_flight: TreeKnobs | None = None

    @property
    def decoding(self) -> bool:
        return self.prefilled >= self.prompt_len


@dataclass(frozen=True)
class PlanEntry:
    """One request's part of a step.

    Attributes:
        rid, slot: as the :class:`Candidate`; kind: ``"decode"`` (draft -> verify -> commit) or
        ``"chunk"`` (a prompt chunk); chunk: ``(first position, tokens)`` of a chunk (None for a
        decode round; :func:`plan_step` gives the most tokens, :func:`make_plan` the exact ones);
        can_draft, owed: as the :class:`Candidate` (decode rounds); knobs: a decode round's
        resolved tree knobs (None: a plain round); rows: the most rows the entry takes in the step
        (set by :func:`make_plan`).
    """

    rid: str
    slot: int
    kind: str
    chunk: tuple[int, int] | None = None
    can_draft: bool = False
    owed: int = 0
    knobs: TreeKnobs | None = None
    rows: int = 0


@dataclass(frozen=True)
class StepPlan:
    """A step's requests, decode rounds first, then prompt chunks (each group in priority order).

    Attributes:
        entries: the requests, in the order the step lays out their rows.
        max_step_tokens: rows the step may hold in all (verify rows + chunk rows); the first entry
            always runs.
        chunk_rows: rows the chunks asked for, capped at ``max_step_tokens`` (what the policy is told
            the step holds besides the decode rounds).
    """

    entries: tuple[PlanEntry, ...]
    max_step_tokens: int
    chunk_rows: int

    @property
    def decodes(self) -> tuple[PlanEntry, ...]:
        return tuple(e for e in self.entries if e.kind == "decode")

    @property
    def chunks(self) -> tuple[PlanEntry, ...]:
        return tuple(e for e in self.entries if e.kind == "chunk")


def plan_step(candidates: Iterable[Candidate], max_step_tokens: int, prefill_chunk: int) -> StepPlan:
    """The plan of one step over ``candidates`` (priority order, each request once).

    Args:
        candidates: the requests that may run, most urgent first.
        max_step_tokens: rows one step may hold (>= 1); prefill_chunk: prompt tokens a request
            prefills per step at most (>= 1).
    Returns:
        :class:`StepPlan`: every decoding candidate as a ``"decode"`` entry, then every other one as
        a ``"chunk"`` entry of ``(prefilled, min(prefill_chunk, prompt tokens left))``.
    Raises:
        ValueError: a request id twice, or a limit below 1.
    """
    if max_step_tokens < 1 or prefill_chunk < 1:
        raise ValueError(f"max_step_tokens and prefill_chunk must be >= 1 (got {max_step_tokens}, {prefill_chunk})")
    cands = list(candidates)
    if len({c.rid for c in cands}) != len(cands):
        raise ValueError("a request appears twice among the step's candidates")
    decodes = [PlanEntry(c.rid, c.slot, "decode", can_draft=c.can_draft, owed=c.owed) for c in cands if c.decoding]
    chunks = [PlanEntry(c.rid, c.slot, "chunk", (c.prefilled, min(prefill_chunk, c.prompt_len - c.prefilled)))
              for c in cands if not c.decoding]
    return StepPlan(tuple(decodes + chunks), max_step_tokens, min(sum(e.chunk[1] for e in chunks), max_step_tokens))


def make_plan(candidates: Iterable[Candidate], policy, max_step_tokens: int, prefill_chunk: int,
              num_running: int) -> StepPlan:
    """The plan the engine runs: :func:`plan_step`'s layout with each decode round's resolved knobs
    and the row budget applied (module docstring).

    Args:
        candidates: the requests that may run, most urgent first (``SpecEngine.candidates``).
        policy: the speculation policy (``begin_step`` with the step's decoding requests, then
            ``draft_knobs`` per round that may draft and has no draft in flight).
        max_step_tokens, prefill_chunk: as :func:`plan_step`; num_running: requests holding state.
    Returns:
        :class:`StepPlan` of the entries that run: decode rounds while rows are left (each
        ``1 + nodes`` rows at most), then each chunk cut to the rows left (at least one while any
        are; the first entry of a step always runs).
    Raises:
        ValueError: as :func:`plan_step`.
    """
    cands = list(candidates)
    base = plan_step(cands, max_step_tokens, prefill_chunk)
    by_rid = {c.rid: c for c in cands}
    policy.begin_step([by_rid[e.rid].info for e in base.decodes], extra_rows=base.chunk_rows,
                      num_running=num_running)
    entries: list[PlanEntry] = []
    left = max_step_tokens
    for e in base.decodes:
        if left <= 0 and entries:
            break
        c = by_rid[e.rid]
        knobs = c.in_flight if c.in_flight is not None else policy.draft_knobs(e.rid, c.spec) if c.can_draft \
            else None
        rows = 1 + draft_nodes(c, knobs)
        entries.append(replace(e, knobs=knobs, rows=rows))
        left -= rows
    for e in base.chunks:
        if left > 0 or not entries:
            first, most = e.chunk
            n = min(most, max(left, 1))
            entries.append(replace(e, chunk=(first, n), rows=n))
            left -= n
    return StepPlan(tuple(entries), max_step_tokens, base.chunk_rows)


def draft_nodes(c: Candidate, knobs: TreeKnobs | None) -> int:
    """The most draft nodes a round of ``c`` verifies with ``knobs`` (None: a plain round, 0): the
    budget for a branching method, the draft depth for a chain."""
    if knobs is None:
        return 0
    return knobs.budget if c.tree else c.depth


class OverlapGroups:
    """With overlap: the drafting requests in two balanced groups that take turns step by step, so
    the drafter drafts one group's next trees while the target verifies the other's; requests that
    draft nothing run every step.

    Attributes:
        group: each drafting request's group (0 / 1); turn: the group of the next step.
    """

    def __init__(self) -> None:
        self.group: dict[str, int] = {}
        self.turn = 0

    def pick(self, order: list[str], drafting: set[str]) -> list[str]:
        """The requests of ``order`` that run in the next step, in that order.

        Args:
            order: the running requests in priority order; drafting: those that call the drafter.
        Returns:
            ``order`` unchanged when fewer than two draft (and the turn does not advance); else the
            non-drafting requests plus the drafting ones of this turn's group. Newcomers join the
            smaller group; when finished requests unbalance the groups, requests move over one at a
            time until the sizes differ by at most one.
        """
        moving = [r for r in order if r in drafting]
        if len(moving) < 2:
            return order
        sizes = [sum(1 for r in moving if self.group.get(r) == g) for g in (0, 1)]
        for r in moving:  # newcomers join the smaller group
            if r not in self.group:
                self.group[r] = int(sizes[1] < sizes[0])
                sizes[self.group[r]] += 1
        for r in moving:  # finished / aborted requests unbalance the groups: move one at a time
            big = int(sizes[1] > sizes[0])
            if sizes[big] - sizes[1 - big] <= 1:
                break
            if self.group[r] == big:
                self.group[r] = 1 - big
                sizes[big], sizes[1 - big] = sizes[big] - 1, sizes[1 - big] + 1
        g, self.turn = self.turn, self.turn ^ 1
        return [r for r in order if r not in drafting or self.group.get(r) == g]

    def forget(self, rid: str) -> None:
        """A request left the table (idempotent)."""
        self.group.pop(rid, None)
