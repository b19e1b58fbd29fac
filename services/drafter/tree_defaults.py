"""Server-side defaults of the tree knobs, per device (shared by every drafter service)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TreeDefaults:
    """Server-side defaults of the tree knobs (paper: B=64, W=12, beta=-0.2, K=64)."""

    budget: int = 64
    width: int = 12
    depth_bonus: float = -0.2
    candidates: int = 64


def default_tree_knobs(device: str = "cpu") -> TreeDefaults:
    """Per-device server defaults. On CUDA the paper's B=64, W=12. On CPU a tree verify costs
    1.5-3.4 one-token steps (4-64 nodes, weights pre-packed), so small trees win: in
    ``dartree bench --skip-main --datasets gsm8k --sweep-grid --sweep-budget 4 8 12 16 24 32
    --sweep-width 4 8 12 --sweep-prompts 6`` on the 2-core CI machine (2026-11-30,
    benchmarks/results/2026-11-30-cpu2-packed-sweep) B=4..12 were within 2 % of each other
    (0.86-0.90x of ``ar``) and larger B slower; B=8, W=12 (0.89x, tau 1.89; the best point B=4
    reached 0.90x at tau 1.71) is the middle of that plateau."""
    return TreeDefaults() if str(device).startswith("cuda") else TreeDefaults(budget=8, width=12)
