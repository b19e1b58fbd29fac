"""Load-dependent tree budget/width: ``--tree-schedule "1:16x12,2:12x8,4:8x6,8:4x4"``.

Each ``N:BxW`` step reads "while at least N requests are running, draft trees of B nodes and width
W". The verifier picks the step once per round from its running count, so a request's tree shrinks
while the server is busy and grows back when it empties. The pick fills only the ``budget`` /
``width`` a request left unset (``speculative`` values always win); below the first threshold, or
with no schedule (the default), the drafter's defaults apply (``default_tree_knobs``).

A manual override: all running requests now share one batched step (engine v2), so a smaller B
under load makes each step lighter (B + 1 rows per request); whether that raises tokens/s depends
on τ(B) against the step's cost, which the goodput policy measures per step. Numbers: benchmarks/README.md and
docs/configuration.md ("Tree defaults").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.spec import MAX_BUDGET, MAX_WIDTH
from services.spec import MAX_CANDIDATES, check_tree_knobs  # noqa: F401 (re-exported: their old home)

_STEP_RE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*[xX]\s*(\d+)\s*$")


@dataclass(frozen=True)
class TreeSchedule:
    """``steps``: ``(min_running, budget, width)`` with strictly increasing ``min_running``."""

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
