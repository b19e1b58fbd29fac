"""Chain, DDTree (vs brute-force enumeration), chain rollout and the Domino-chain + DDTree ablation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from services.tree.builders import chain, chain_rollout, ddtree, domino_ddtree
from services.tree.draft_tree import DraftTree
from services.tree.scorer import TableScorer


def token_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Root-to-node token path of every node, in node order."""
    toks, pars = tree.draft_tokens.tolist(), tree.parents.tolist()
    paths: list[tuple[int, ...]] = []
    for tok, par in zip(toks, pars):
        paths.append((paths[par] if par >= 0 else ()) + (tok,))
    return paths


def test_chain_literal() -> None:
    tree = chain(torch.tensor([4, 8, 15, 16]), torch.tensor([-0.5, -1.0, -1.5, -2.0]))
    tree.validate()
    assert tree.draft_tokens.tolist() == [4, 8, 15, 16]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.depths.tolist() == [1, 2, 3, 4]
    assert tree.scores.tolist() == [-0.5, -1.0, -1.5, -2.0]
    assert chain(torch.tensor([3])).scores.tolist() == [0.0]


def test_ddtree_golden() -> None:
    """Hand-traced heap: p(d1) = {2: .6, 0: .3, 1: .1}, p(d2) = {1: .7, 2: .2, 0: .1}, B = 4."""
    lp = torch.tensor([[0.3, 0.1, 0.6], [0.1, 0.7, 0.2]]).log()
    tree = ddtree(lp, 4)
    assert tree.draft_tokens.tolist() == [2, 1, 0, 1]  # (2) .6, (2,1) .42, (0) .3, (0,1) .21
    assert tree.parents.tolist() == [-1, 0, -1, 2]
    assert tree.depths.tolist() == [1, 2, 1, 2]
    assert torch.allclose(tree.scores, torch.tensor([0.6, 0.42, 0.3, 0.21]).log())


def _brute_force_top(lp: torch.Tensor, budget: int) -> tuple[list[tuple[int, ...]], list[float]]:
    """All prefixes up to depth D scored by summed per-depth log-probs, sorted descending."""
    depth_max, vocab = lp.shape
    scored = []
    for d in range(1, depth_max + 1):
        for prefix in itertools.product(range(vocab), repeat=d):
            scored.append((sum(float(lp[i, t]) for i, t in enumerate(prefix)), prefix))
    scored.sort(reverse=True)
    return [p for _, p in scored[:budget]], [s for s, _ in scored]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("budget", [1, 5, 12, 40])
def test_ddtree_equals_brute_force_top_b(seed: int, budget: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(2.0 * torch.randn(3, 5, generator=gen, dtype=torch.float64), dim=-1)
    expected, all_scores = _brute_force_top(lp, budget)
    if budget < len(all_scores):
        assert all_scores[budget - 1] - all_scores[budget] > 1e-4, "near-tie at the budget boundary"
    tree = ddtree(lp.float(), budget)
    tree.validate(budget=budget, vocab_size=5)
    paths = token_paths(tree)
    assert len(paths) == budget
    assert set(paths) == set(expected)
    want = torch.tensor([sum(float(lp[i, t]) for i, t in enumerate(p)) for p in paths], dtype=torch.float64)
    assert torch.allclose(tree.scores.double(), want, atol=1e-5)
    # Pop order is best-first: scores never increase.
    assert bool((tree.scores[1:] <= tree.scores[:-1] + 1e-6).all())


def test_ddtree_small_vocab_and_edge_budgets() -> None:
    lp = torch.log_softmax(torch.tensor([[0.3, -0.2], [1.0, 0.1]]), dim=-1)
    whole = ddtree(lp, 100)  # budget larger than the 2 + 4 prefixes: the whole tree
    assert sorted(token_paths(whole)) == sorted([(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)])
    assert ddtree(lp, 0).num_nodes == 0
    assert ddtree(lp[:0], 5).num_nodes == 0


def _manual_rollout(base: torch.Tensor, table: torch.Tensor, root: int, prefix: int,
                    pick=torch.argmax) -> tuple[list[int], torch.Tensor]:
    prev, tokens, rows = root, [], []
    for slot in range(base.shape[0]):
        row = base[slot] + (table[slot, prev] if slot >= prefix else 0.0)
        prev = int(pick(row))
        tokens.append(prev)
        rows.append(row)
    return tokens, torch.stack(rows)


@pytest.mark.parametrize("prefix", [0, 1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_chain_rollout_equals_manual_sequential_argmax(prefix: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    depth, vocab, root = 6, 9, 4
    base = torch.randn(depth, vocab, generator=gen)
    table = 3.0 * torch.randn(depth, vocab, vocab, generator=gen)  # large: corrections flip argmaxes
    tokens, logits = chain_rollout(base, TableScorer(table), root, pure_draft_prefix_len=prefix)
    want_tokens, want_rows = _manual_rollout(base, table, root, prefix)
    assert tokens.tolist() == want_tokens
    assert torch.allclose(logits, want_rows)
    if prefix == 0:  # the correction really changes the chain (else this test checks nothing)
        assert want_tokens != base.argmax(-1).tolist()


def test_chain_rollout_uses_pick() -> None:
    gen = torch.Generator().manual_seed(7)
    base, table = torch.randn(5, 6, generator=gen), torch.randn(5, 6, 6, generator=gen)
    tokens, _ = chain_rollout(base, TableScorer(table), 2, pure_draft_prefix_len=1,
                              pick=lambda row: int(torch.argmin(row)))
    assert tokens.tolist() == _manual_rollout(base, table, 2, 1, pick=torch.argmin)[0]


@pytest.mark.parametrize("budget", [1, 8, 30])
def test_domino_ddtree_is_ddtree_over_chain_logits(budget: int) -> None:
    gen = torch.Generator().manual_seed(11)
    base, table = torch.randn(5, 12, generator=gen), 2.0 * torch.randn(5, 12, 12, generator=gen)
    _, chain_logits = chain_rollout(base, TableScorer(table), 3)
    got = domino_ddtree(chain_logits, budget)
    want = ddtree(torch.log_softmax(chain_logits, dim=-1), budget)
    for field in ("draft_tokens", "parents", "depths", "scores"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    # and it differs from DDTree over the uncorrected base logits
    plain = ddtree(torch.log_softmax(base, dim=-1), budget)
    if budget > 1:
        assert set(token_paths(got)) != set(token_paths(plain))
    assert math.isclose(float(got.scores[0]), float(torch.log_softmax(chain_logits[0], -1).max()), rel_tol=1e-6)
