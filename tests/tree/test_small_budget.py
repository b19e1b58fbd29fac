"""Small-budget pruned DARTree: the width / depth cut of :func:`pruned_reach` builds the same tree.

The fast builder scores only ``min(W, B)`` frontier rows per depth and descends at most ``B``
depths; the reference builds the whole ``W``-quota supertree over every depth and prunes it. Both
must give the same tree (Lemma 1), ties included (integer logits make many).
"""

from __future__ import annotations

import pytest
import torch

from services.tree.dartree import dartree, dartree_reference, pruned_reach
from services.tree.scorer import TableScorer

from .test_dartree import _assert_same_tree


def _inputs(seed: int, depth: int, vocab: int, ties: bool) -> tuple[torch.Tensor, TableScorer]:
    gen = torch.Generator().manual_seed(seed)
    base = 2.0 * torch.randn(depth, vocab, generator=gen)  # [D, V]
    table = 2.0 * torch.randn(depth, vocab, vocab, generator=gen)  # [D, V, V]
    if ties:  # coarse values: equal path scores across parents and depths
        base, table = base.round(), table.round()
    return base, TableScorer(table)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("beta", [0.0, -0.2, -1.0])
@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("width", [1, 2, 3, 12])
def test_small_budget_equals_reference(width: int, budget: int, beta: float, ties: bool) -> None:
    for seed in range(4):
        for prefix in (0, 1):
            base, scorer = _inputs(100 * seed + budget, depth=6, vocab=9, ties=ties)
            kw = dict(K=6, W=width, B=budget, beta=beta, variant="pruned", pure_draft_prefix_len=prefix)
            got = dartree(base, scorer, 1, **kw)
            _assert_same_tree(got, dartree_reference(base, scorer, 1, **kw))
            got.validate(budget=budget, vocab_size=9)
            assert int(got.depths.max()) <= budget


class _CountingScorer(TableScorer):
    """A table scorer that records the frontier rows of every ``score`` call."""

    def __init__(self, table: torch.Tensor):
        super().__init__(table)
        self.rows: list[int] = []

    def score(self, slot, parent_states, cand_ids, cand_vals):
        self.rows.append(int(parent_states.shape[0]))
        return super().score(slot, parent_states, cand_ids, cand_vals)


def test_small_budget_scores_only_reachable_rows() -> None:
    """B = 3, W = 12, D = 16: at most 3 frontier rows per call and at most 2 corrected depths
    (depth 1 is scored by the base logits alone, prefix 1)."""
    base, table = _inputs(7, depth=16, vocab=40, ties=False)
    scorer = _CountingScorer(table.table)
    tree = dartree(base, scorer, 1, K=16, W=12, B=3, beta=-0.2)
    assert tree.num_nodes == 3
    assert max(scorer.rows) <= 3 and len(scorer.rows) <= 2
    assert pruned_reach(12, 3, 16) == (3, 3)
    assert pruned_reach(12, 64, 16) == (12, 16)
    assert pruned_reach(12, 0, 16) == (1, 1)
