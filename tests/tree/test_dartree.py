"""DARTree: golden case, fast == reference, invariants, Lemma 1 (top-B == best-first for beta <= 0)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from services.tree.dartree import dartree, dartree_reference, select_nodes, seqheap, top_b
from services.tree.draft_tree import DraftTree, tree_from_parents
from services.tree.scorer import MarkovScorer, TableScorer

from .test_builders import token_paths


def _lse(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def _inputs(seed: int, depth: int, vocab: int, scale: float = 2.0) -> tuple[torch.Tensor, TableScorer]:
    gen = torch.Generator().manual_seed(seed)
    base = 2.0 * torch.randn(depth, vocab, generator=gen)
    table = scale * torch.randn(depth, vocab, vocab, generator=gen)
    return base, TableScorer(table)


def _assert_same_tree(got: DraftTree, want: DraftTree) -> None:
    assert torch.equal(got.draft_tokens, want.draft_tokens)
    assert torch.equal(got.parents, want.parents)
    assert torch.equal(got.depths, want.depths)
    assert torch.allclose(got.scores, want.scores, atol=1e-5)


# ---------------------------------------------------------------- golden literal case


@pytest.mark.parametrize("budget, beta, tokens, parents", [
    (4, -0.2, [1, 2, 0, 2], [-1, -1, 0, 1]),  # no prune: 2 + 2 nodes
    (2, 0.0, [1, 0], [-1, 0]),  # beta = 0 keeps the deep, likely node
    (2, -1.0, [1, 2], [-1, -1]),  # a strong depth penalty keeps the two depth-1 nodes
])
def test_dartree_golden(budget: int, beta: float, tokens: list[int], parents: list[int]) -> None:
    """V = 3, K = 2, W = 2, D = 2, prefix 1; the table boosts token 2 after token 2 at slot 1."""
    base = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])  # candidates: [1, 2] then [0, 2]
    table = torch.zeros(2, 3, 3)
    table[1, 2, 2] = 5.0
    tree = dartree(base, TableScorer(table), root_token=0, K=2, W=2, B=budget, beta=beta)
    d1 = [2.0 - _lse([2.0, 1.0]), 1.0 - _lse([2.0, 1.0])]  # depth 1: base logits only
    full = {(1,): d1[0], (2,): d1[1],
            (1, 0): d1[0] + 3.0 - _lse([3.0, 1.0]),  # parent 1: no correction
            (2, 2): d1[1] + 6.0 - _lse([3.0, 6.0])}  # parent 2: candidate 2 gets +5
    assert tree.draft_tokens.tolist() == tokens
    assert tree.parents.tolist() == parents
    want = torch.tensor([full[p] for p in token_paths(tree)])
    assert torch.allclose(tree.scores, want, atol=1e-5)
    _assert_same_tree(tree, dartree_reference(base, TableScorer(table), 0, K=2, W=2, B=budget, beta=beta))


# ---------------------------------------------------------------- fast == reference

COMBOS = [  # (K, W, B, D, V)
    (4, 3, 6, 4, 10),
    (8, 5, 12, 5, 16),
    (5, 12, 64, 3, 7),  # budget above the supertree size: nothing pruned
    (16, 4, 8, 6, 32),
    (3, 2, 3, 5, 3),  # B < D: the fixed variant stops early
]


@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("variant, beta", [("pruned", -0.2), ("pruned", 0.0), ("fixed", 0.0)])
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "K{}W{}B{}D{}V{}".format(*c))
def test_dartree_equals_reference(combo: tuple, variant: str, beta: float, prefix: int) -> None:
    K, W, B, D, V = combo
    base, scorer = _inputs(seed=10 * COMBOS.index(combo) + prefix, depth=D, vocab=V)
    kw = dict(K=K, W=W, B=B, beta=beta, variant=variant, pure_draft_prefix_len=prefix)
    got = dartree(base, scorer, 1, **kw)
    want = dartree_reference(base, scorer, 1, **kw)
    _assert_same_tree(got, want)
    _check_invariants(got, K, W, B, D, V, variant)


def _check_invariants(tree: DraftTree, K: int, W: int, B: int, D: int, V: int, variant: str) -> None:
    tree.validate(budget=B, vocab_size=V)  # topological parents, depths, unique siblings, budget
    assert bool((tree.parents < torch.arange(tree.num_nodes)).all())
    assert bool((tree.depths[1:] >= tree.depths[:-1]).all()), "BFS order: depths non-decreasing"
    same_depth = tree.depths[1:] == tree.depths[:-1]
    assert bool((tree.scores[1:] <= tree.scores[:-1] + 1e-6)[same_depth].all()), "descending within a depth"
    # a child's path score is its parent's plus a log-probability (<= 0)
    has_parent = tree.parents >= 0
    assert bool((tree.scores[has_parent] <= tree.scores[tree.parents[has_parent]] + 1e-6).all())
    counts, frontier, created = [], 1, 0
    for depth in range(1, D + 1):
        quota = W if variant == "pruned" else math.ceil((B - created) / (D - depth + 1))
        if quota <= 0:
            break
        frontier = min(quota, frontier * min(K, V))
        counts.append(frontier)
        created += frontier
    if variant == "pruned":
        assert tree.num_nodes == min(B, sum(counts))
    else:
        per_depth = torch.bincount(tree.depths, minlength=D + 1)[1:].tolist()
        assert per_depth == counts + [0] * (D - len(counts))


def test_fixed_quota_literal() -> None:
    """B = 10 over D = 4: ceil(10/4) = 3, ceil(7/3) = 3, ceil(4/2) = 2, ceil(2/1) = 2."""
    base, scorer = _inputs(seed=3, depth=4, vocab=20)
    tree = dartree(base, scorer, 0, K=8, B=10, beta=0.0, variant="fixed")
    assert torch.bincount(tree.depths).tolist() == [0, 3, 3, 2, 2]
    paper = dartree(*_inputs(seed=4, depth=16, vocab=200), 0, K=64, B=64, beta=0.0, variant="fixed")
    assert torch.bincount(paper.depths).tolist() == [0] + [4] * 16  # the paper's 4 per depth


def test_pruned_defaults_keep_b_of_w_times_d() -> None:
    base, scorer = _inputs(seed=5, depth=16, vocab=200)
    tree = dartree(base, scorer, 0, K=64, W=12, B=64, beta=-0.2)
    assert tree.num_nodes == 64
    unpruned = dartree(base, scorer, 0, K=64, W=12, B=10_000, beta=-0.2)
    assert tree.num_nodes < unpruned.num_nodes == 12 * 16
    # The pruned tree is exactly the top-64 of the supertree by score + beta * depth.
    key = unpruned.scores + -0.2 * unpruned.depths
    top = set(torch.topk(key, 64).indices.tolist())
    assert set(token_paths(tree)) == {p for i, p in enumerate(token_paths(unpruned)) if i in top}


def test_max_depth_caps_the_tree() -> None:
    base, scorer = _inputs(seed=6, depth=6, vocab=12)
    capped = dartree(base, scorer, 2, K=5, W=3, B=10, max_depth=2)
    _assert_same_tree(capped, dartree(base[:2], scorer, 2, K=5, W=3, B=10))
    assert capped.max_depth == 2


def test_prefix_len_uses_base_logits_at_depth_one() -> None:
    base, scorer = _inputs(seed=8, depth=3, vocab=9, scale=10.0)
    tree = dartree(base, scorer, 0, K=4, W=4, B=100, pure_draft_prefix_len=1)
    top_vals, top_ids = torch.topk(base[0], 4)
    depth1 = tree.depths == 1
    assert tree.draft_tokens[depth1].tolist() == top_ids.tolist()
    assert torch.allclose(tree.scores[depth1], torch.log_softmax(top_vals, 0), atol=1e-6)
    corrected = dartree(base, scorer, 0, K=4, W=4, B=100, pure_draft_prefix_len=0)
    assert not torch.allclose(corrected.scores[corrected.depths == 1], tree.scores[depth1])


@pytest.mark.parametrize("kwargs", [
    dict(beta=0.1),  # pruned needs beta <= 0
    dict(beta=-0.2, variant="fixed"),  # fixed needs beta == 0
    dict(beta=0.0, variant="breadth"),  # unknown variant
    dict(K=0),
])
def test_dartree_rejects_bad_arguments(kwargs: dict) -> None:
    base, scorer = _inputs(seed=0, depth=3, vocab=5)
    with pytest.raises(ValueError):
        dartree(base, scorer, 0, **kwargs)
    with pytest.raises(ValueError):
        dartree_reference(base, scorer, 0, **kwargs)


def test_dartree_with_markov_scorer_equals_reference() -> None:
    gen = torch.Generator().manual_seed(21)
    vocab, rank = 50, 8
    scorer = MarkovScorer(torch.randn(vocab, rank, generator=gen), torch.randn(vocab, rank, generator=gen))
    base = 3.0 * torch.randn(5, vocab, generator=gen)
    for variant, beta in (("pruned", -0.2), ("fixed", 0.0)):
        kw = dict(K=10, W=4, B=12, beta=beta, variant=variant)
        got = dartree(base, scorer, 7, **kw)
        _assert_same_tree(got, dartree_reference(base, scorer, 7, **kw))
        _check_invariants(got, 10, 4, 12, 5, vocab, variant)
    # the Markov bias matters: without it (prefix covering every slot) the tree differs
    plain = dartree(base, scorer, 7, K=10, W=4, B=12, pure_draft_prefix_len=5)
    assert set(token_paths(plain)) != set(token_paths(dartree(base, scorer, 7, K=10, W=4, B=12)))


# ---------------------------------------------------------------- Lemma 1


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 2**31 - 1), budget=st.integers(1, 39), beta=st.floats(-1.5, 0.0),
       vocab=st.integers(3, 6), prefix=st.integers(0, 1))
def test_lemma1_top_b_equals_best_first(seed: int, budget: int, beta: float, vocab: int, prefix: int) -> None:
    """beta <= 0: the global top-B of the full K=3, D=3 tree (W = 27 materialises all 39 nodes) is
    prefix-closed and equals exact best-first (heap) search."""
    base, scorer = _inputs(seed, depth=3, vocab=vocab)
    kw = dict(K=3, beta=beta, pure_draft_prefix_len=prefix)
    full = dartree(base, scorer, 0, W=27, B=1000, **kw)
    assert full.num_nodes == 3 + 9 + 27
    key = torch.sort(full.scores + beta * full.depths, descending=True).values
    assume(budget == full.num_nodes or float(key[budget - 1] - key[budget]) > 1e-4)  # no tie at the cut
    heap_tree = seqheap(base, scorer, 0, B=budget, **kw)
    top_tree = dartree(base, scorer, 0, W=27, B=budget, **kw)
    heap_tree.validate(budget=budget)
    top_tree.validate(budget=budget)
    assert heap_tree.num_nodes == top_tree.num_nodes == budget
    assert set(token_paths(heap_tree)) == set(token_paths(top_tree))


def test_top_b_not_prefix_closed_for_positive_beta_literal() -> None:
    """r -> a (-1.0) -> c (-1.1); r -> b (-0.5). beta = +1: keys a 0.0, b 0.5, c 0.9 -> top-2 = {b, c}."""
    tree = tree_from_parents([1, 2, 3], [-1, -1, 0], [-1.0, -0.5, -1.1])
    keep = top_b(tree.scores, tree.depths, 2, beta=1.0)
    assert keep.tolist() == [1, 2]
    with pytest.raises(ValueError, match="prefix-closed"):
        select_nodes(tree, keep)
    kept = select_nodes(tree, top_b(tree.scores, tree.depths, 2, beta=0.0))  # beta = 0 is fine
    assert kept.draft_tokens.tolist() == [1, 2] and kept.parents.tolist() == [-1, -1]


def test_top_b_not_prefix_closed_for_positive_beta_on_a_supertree() -> None:
    base, scorer = _inputs(seed=9, depth=3, vocab=5)
    full = dartree(base, scorer, 0, K=3, W=27, B=1000, beta=0.0)
    keep = top_b(full.scores, full.depths, 5, beta=5.0)  # deep nodes win, their parents do not
    assert bool((full.depths[keep] == 3).all())
    with pytest.raises(ValueError, match="prefix-closed"):
        select_nodes(full, keep)
    with pytest.raises(ValueError):
        seqheap(base, scorer, 0, K=3, B=5, beta=5.0)


class _CountingScorer(TableScorer):
    def __init__(self, table: torch.Tensor):
        super().__init__(table)
        self.slots: list[int] = []

    def score(self, slot, parent_states, cand_ids, cand_vals):
        self.slots.append(slot)
        return super().score(slot, parent_states, cand_ids, cand_vals)


@pytest.mark.parametrize("beta", [-0.2, -1.0, 0.0])
def test_pruned_early_stop_is_exact_and_saves_depths(beta: float) -> None:
    """Once no deeper node can enter the top-B the builder stops descending; the tree equals the
    reference (full supertree, then prune) for every seed, and some seeds really stop early."""
    K, W, B, D, V = 6, 3, 5, 8, 12
    stopped = 0
    for seed in range(40):
        # scale 6: peaked distributions (deep chains); scale 0.5: flat (the top-B settles early)
        base, table = _inputs(seed, depth=D, vocab=V, scale=6.0 if seed % 2 else 0.5)
        scorer = _CountingScorer(table.table)
        kw = dict(K=K, W=W, B=B, beta=beta, variant="pruned", pure_draft_prefix_len=1)
        got = dartree(base, scorer, 1, **kw)
        _assert_same_tree(got, dartree_reference(base, TableScorer(table.table), 1, **kw))
        stopped += max(scorer.slots, default=0) < D - 1
    assert stopped >= 5
