"""The step plan: which requests the next target forward holds and in which role, decided before
anything is drafted or run.

:func:`plan_step` is pure (no torch, no engine): it takes each candidate request's state as a
:class:`Candidate` and returns a frozen :class:`StepPlan` that the engine executes
(``SpecEngine.step_batch``), a test compares literally and a log line can print. Decode rounds come
first, then prompt chunks, each group in the candidates' priority order. How many decode rounds
fit is known only once their trees are drafted and cut (a round takes ``nodes + 1`` rows), so the
plan carries the row budget and each chunk's upper bound; the engine takes decode rounds while rows
are left (the first entry always runs) and shrinks the chunks to the rows the rounds left over.

Which requests are candidates is the verifier worker's call: every running request in an order that
rotates each step, and with overlap only one of two groups of drafting requests per step
(:class:`OverlapGroups`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """One request's state as the planner sees it.

    Attributes:
        rid: request id; slot: its KV slot; prompt_len: prompt tokens; prefilled: prompt tokens
        already in the slot (``== prompt_len``: the request decodes); can_draft: a decode round may
        call the drafter (a drafting method, a drafter, room for a draft token); owed: context
        tokens its drafter has not seen yet.
    """

    rid: str
    slot: int
    prompt_len: int
    prefilled: int
    can_draft: bool = False
    owed: int = 0

    @property
    def decoding(self) -> bool:
        return self.prefilled >= self.prompt_len


@dataclass(frozen=True)
class PlanEntry:
    """One request's part of a step.

    Attributes:
        rid, slot: as the :class:`Candidate`; kind: ``"decode"`` (draft -> verify -> commit) or
        ``"chunk"`` (a prompt chunk); chunk: ``(first position, most tokens)`` of a chunk (None for
        a decode round); can_draft, owed: as the :class:`Candidate` (decode rounds).
    """

    rid: str
    slot: int
    kind: str
    chunk: tuple[int, int] | None = None
    can_draft: bool = False
    owed: int = 0


@dataclass(frozen=True)
class StepPlan:
    """A step's requests, decode rounds first, then prompt chunks (each group in priority order).

    Attributes:
        entries: the requests, in the order the step lays out their rows.
        max_step_tokens: rows the step may hold in all (verify rows + chunk rows); the first entry
            always runs.
        chunk_rows: rows the chunks ask for, capped at ``max_step_tokens`` (what the policy is told
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
