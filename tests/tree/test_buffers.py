"""DraftTree validation and derive_buffers on hand-written trees with literal expected tensors (R7)."""

from __future__ import annotations

import pytest
import torch

from services.tree.draft_tree import SMALL_TREE, DraftTree, _derive_small, _derive_vectorised, derive_buffers, tree_from_parents

ROOT = 99


def _t(rows: list) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def _mask(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# (tokens, parents, tree_mask, position_offsets, parent_rows, retrieve_indices)
CASES = {
    # r -> 5 -> 6 -> 7
    "chain": (
        [5, 6, 7], [-1, 0, 1],
        [[1, 0, 0, 0],
         [1, 1, 0, 0],
         [1, 1, 1, 0],
         [1, 1, 1, 1]],
        [0, 1, 2, 3], [-1, 0, 1, 2], [[0, 1, 2, 3]],
    ),
    # r -> a(10) -> c(12) ; r -> b(11) -> d(13)
    "two_branch": (
        [10, 11, 12, 13], [-1, -1, 0, 1],
        [[1, 0, 0, 0, 0],
         [1, 1, 0, 0, 0],
         [1, 0, 1, 0, 0],
         [1, 1, 0, 1, 0],
         [1, 0, 1, 0, 1]],
        [0, 1, 1, 2, 2], [-1, 0, 0, 1, 2], [[0, 1, 3], [0, 2, 4]],
    ),
    # r -> a(20) -> {b(21) -> d(23), c(22)}: two paths sharing the prefix r, a
    "shared_prefix": (
        [20, 21, 22, 23], [-1, 0, 0, 1],
        [[1, 0, 0, 0, 0],
         [1, 1, 0, 0, 0],
         [1, 1, 1, 0, 0],
         [1, 1, 0, 1, 0],
         [1, 1, 1, 0, 1]],
        [0, 1, 2, 2, 3], [-1, 0, 1, 1, 2], [[0, 1, 3, -1], [0, 1, 2, 4]],
    ),
    # The derive_buffers docstring example: r -> a -> c ; r -> b.
    "docstring": (
        [1, 2, 3], [-1, -1, 0],
        [[1, 0, 0, 0],
         [1, 1, 0, 0],
         [1, 0, 1, 0],
         [1, 1, 0, 1]],
        [0, 1, 1, 2], [-1, 0, 0, 1], [[0, 2, -1], [0, 1, 3]],
    ),
    # Topological but not depth-ordered (DFS order): r -> a -> b ; r -> c.
    "dfs_order": (
        [7, 8, 9], [-1, 0, -1],
        [[1, 0, 0, 0],
         [1, 1, 0, 0],
         [1, 1, 1, 0],
         [1, 0, 0, 1]],
        [0, 1, 2, 1], [-1, 0, 1, 0], [[0, 1, 2], [0, 3, -1]],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_derive_buffers_literal(name: str) -> None:
    tokens, parents, mask, positions, parent_rows, retrieve = CASES[name]
    tree = tree_from_parents(tokens, parents)
    tree.validate()
    buf = derive_buffers(tree, ROOT)
    assert torch.equal(buf.input_ids, _t([ROOT] + tokens))
    assert torch.equal(buf.tree_mask, _mask(mask))
    assert torch.equal(buf.position_offsets, _t(positions))
    assert torch.equal(buf.parent_rows, _t(parent_rows))
    assert torch.equal(buf.retrieve_indices, _t(retrieve))


def test_derive_buffers_empty_tree() -> None:
    buf = derive_buffers(DraftTree.empty(), ROOT)
    assert torch.equal(buf.input_ids, _t([ROOT]))
    assert torch.equal(buf.tree_mask, _mask([[1]]))
    assert torch.equal(buf.position_offsets, _t([0]))
    assert torch.equal(buf.parent_rows, _t([-1]))
    assert torch.equal(buf.retrieve_indices, _t([[0]]))


def _random_parents(n: int, gen: torch.Generator) -> list[int]:
    return [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_derive_buffers_matches_brute_force_ancestors(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = 12
    parents = _random_parents(n, gen)
    tree = tree_from_parents(list(range(n)), parents)
    buf = derive_buffers(tree, ROOT)
    rows_parent = [-1] + [p + 1 for p in parents]
    expected = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    for i in range(n + 1):
        j = i
        while j >= 0:
            expected[i, j] = True
            j = rows_parent[j]
    assert torch.equal(buf.tree_mask, expected)
    # EAGLE identity: position = number of ancestors (mask row sum) - 1.
    assert torch.equal(buf.position_offsets, buf.tree_mask.sum(1) - 1)
    # Every path is a root-to-leaf chain of parent links, and every leaf has exactly one path.
    leaves = set(range(n + 1)) - set(rows_parent[1:])
    assert {int(p[p >= 0][-1]) for p in buf.retrieve_indices} == leaves
    for path in buf.retrieve_indices.tolist():
        rows = [r for r in path if r >= 0]
        assert rows[0] == 0
        assert all(rows_parent[b] == a for a, b in zip(rows, rows[1:]))


@pytest.mark.parametrize("seed", range(6))
def test_small_tree_derivation_equals_the_vectorised_one(seed: int) -> None:
    """derive_buffers' list-based path (trees up to SMALL_TREE nodes) gives the vectorised path's
    tensors, dtypes included, on random trees of every size around the switch."""
    gen = torch.Generator().manual_seed(seed)
    for n in list(range(0, 9)) + [SMALL_TREE - 1, SMALL_TREE, SMALL_TREE + 1, 48]:
        parents = _random_parents(n, gen)
        tokens = torch.randint(0, 1000, (n,), generator=gen).tolist()
        tree = tree_from_parents(tokens, parents)
        a, b = _derive_small(tree, ROOT), _derive_vectorised(tree, ROOT)
        for name in ("input_ids", "tree_mask", "position_offsets", "parent_rows", "retrieve_indices"):
            x, y = getattr(a, name), getattr(b, name)
            assert x.dtype == y.dtype and torch.equal(x, y), (n, name, x, y)


def test_tree_from_parents_depths_and_rejects_non_topological() -> None:
    tree = tree_from_parents([1, 2, 3, 4], [-1, 0, 1, -1], [-0.1, -0.2, -0.3, -0.4])
    assert torch.equal(tree.depths, _t([1, 2, 3, 1]))
    assert tree.max_depth == 3 and tree.num_nodes == 4
    assert torch.allclose(tree.scores, torch.tensor([-0.1, -0.2, -0.3, -0.4]))
    with pytest.raises(ValueError):
        tree_from_parents([1, 2], [1, -1])


def _tree(tokens: list[int], parents: list[int], depths: list[int]) -> DraftTree:
    return DraftTree(_t(tokens), _t(parents), _t(depths), torch.zeros(len(tokens)))


@pytest.mark.parametrize(
    "tree, kwargs, message",
    [
        (_tree([1, 2], [1, -1], [2, 1]), {}, "topological"),  # parent after child
        (_tree([1, 2], [-1, 1], [1, 2]), {}, "topological"),  # self-parent
        (_tree([1, 2], [-1, -2], [1, 1]), {}, "topological"),  # parent below -1
        (_tree([1, 2], [-1, 0], [1, 3]), {}, "depth"),  # depth != parent depth + 1
        (_tree([1, 2], [-1, -1], [2, 1]), {}, "depth"),  # root child not at depth 1
        (_tree([1, 2, 2], [-1, 0, 0], [1, 2, 2]), {}, "same token"),  # duplicate siblings
        (_tree([3, 3], [-1, -1], [1, 1]), {}, "same token"),  # duplicate children of the root
        (_tree([1, 2, 3], [-1, 0, 1], [1, 2, 3]), {"budget": 2}, "budget"),
        (_tree([1, 7], [-1, 0], [1, 2]), {"vocab_size": 7}, "vocabulary"),
        (DraftTree(_t([1, 2]), _t([-1]), _t([1, 2]), torch.zeros(2)), {}, "shape"),
    ],
)
def test_validate_rejects(tree: DraftTree, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tree.validate(**kwargs)


def test_validate_accepts_valid_trees() -> None:
    # Same token under different parents is fine; the budget is inclusive.
    tree = _tree([5, 5, 5, 6], [-1, 0, -1, 2], [1, 2, 1, 2])
    with pytest.raises(ValueError):  # tokens 5 twice under the root
        tree.validate()
    ok = _tree([5, 5, 6, 5], [-1, 0, -1, 2], [1, 2, 1, 2])
    ok.validate(budget=4, vocab_size=7)
    DraftTree.empty().validate(budget=0)
