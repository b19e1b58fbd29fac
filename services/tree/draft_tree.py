"""The one canonical draft-tree representation and the one function deriving verify buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftTree:
    """A tree of draft tokens hanging below the root (the last committed token).

    Attributes:
        draft_tokens: ``[N]`` long, token id of each draft node.
        parents: ``[N]`` long, index of each node's parent *node*, ``-1`` for children of the root.
            Nodes are in topological order: ``parents[i] < i``.
        depths: ``[N]`` long, depth of each node (children of the root have depth 1).
        scores: ``[N]`` float32, the builder's path score of each node (log-probability units;
            for DARTree-pruned the path score *without* the depth bonus).

    An empty tree (``N = 0``) is valid: the verify pass then scores the root alone (plain decoding).
    """

    draft_tokens: Tensor
    parents: Tensor
    depths: Tensor
    scores: Tensor

    @property
    def num_nodes(self) -> int:
        """Number of draft nodes ``N`` (root excluded)."""
        return int(self.draft_tokens.numel())

    @property
    def max_depth(self) -> int:
        """Deepest node's depth (0 for an empty tree)."""
        return int(self.depths.max()) if self.num_nodes else 0

    @staticmethod
    def empty() -> "DraftTree":
        """A tree with no draft nodes (AR rounds)."""
        z = torch.zeros(0, dtype=torch.long)
        return DraftTree(z, z.clone(), z.clone(), torch.zeros(0, dtype=torch.float32))

    def validate(self, budget: int | None = None, vocab_size: int | None = None) -> None:
        """Check shapes, topological order, depth consistency, unique siblings and the budget.

        Raises:
            ValueError: with a one-line reason when the tree is malformed.
        """
        n = self.num_nodes
        for name in ("parents", "depths", "scores"):
            if getattr(self, name).shape != (n,):
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected ({n},)")
        if budget is not None and n > budget:
            raise ValueError(f"tree has {n} nodes, over the budget {budget}")
        if n == 0:
            return
        idx = torch.arange(n)
        if bool((self.parents >= idx).any()) or bool((self.parents < -1).any()):
            raise ValueError("parents are not in topological order (need -1 <= parents[i] < i)")
        parent_depth = torch.where(self.parents < 0, torch.zeros_like(self.depths),
                                   self.depths[self.parents.clamp(min=0)])
        if not bool((self.depths == parent_depth + 1).all()):
            raise ValueError("depths are not parent depth + 1")
        if vocab_size is not None and bool(((self.draft_tokens < 0) | (self.draft_tokens >= vocab_size)).any()):
            raise ValueError(f"draft token id outside the vocabulary [0, {vocab_size})")
        key = (self.parents + 1) * (int(self.draft_tokens.max()) + 1) + self.draft_tokens
        if torch.unique(key).numel() != n:
            raise ValueError("two siblings carry the same token")


@dataclass(frozen=True)
class VerifyBuffers:
    """Everything the verify pass and the walk need, derived from a :class:`DraftTree`.

    Attributes:
        input_ids: ``[N+1]`` long, root token then the draft tokens.
        tree_mask: ``[N+1, N+1]`` bool, ``tree_mask[i, j]`` = row ``j`` is an ancestor-or-self of row ``i``.
        position_offsets: ``[N+1]`` long, depth of every row (0 for the root); absolute position
            ids are ``start + position_offsets``.
        parent_rows: ``[N+1]`` long, verify row of each row's parent (``-1`` for the root).
        retrieve_indices: ``[P, D+1]`` long, one root-to-leaf path of verify rows per leaf, padded
            with ``-1``.
    """

    input_ids: Tensor
    tree_mask: Tensor
    position_offsets: Tensor
    parent_rows: Tensor
    retrieve_indices: Tensor


def derive_buffers(tree: DraftTree, root_token: int) -> VerifyBuffers:
    """Derive the tree attention mask, position offsets and paths of a tree (one function: docs/design.md "One tree representation").

    Worked example: root ``r`` with children ``a`` (node 0) and ``b`` (node 1), and ``c`` (node 2)
    below ``a``: ``parents = [-1, -1, 0]``, ``depths = [1, 1, 2]``. Verify rows are
    ``[r, a, b, c]`` and::

        tree_mask =        position_offsets = [0, 1, 1, 2]
          r a b c          parent_rows      = [-1, 0, 0, 1]
        r 1 0 0 0          retrieve_indices = [[0, 2, -1],   # r -> b
        a 1 1 0 0                              [0, 1,  3]]   # r -> a -> c
        b 1 0 1 0
        c 1 1 0 1

    Paths are listed leaf by leaf in row order of the leaves (``b`` is row 2, ``c`` row 3).

    Args:
        tree: a validated tree with ``N`` nodes.
        root_token: id of the root (last committed) token.
    Returns:
        :class:`VerifyBuffers` (all on the tree's device).

    Trees of up to :data:`SMALL_TREE` nodes (every tree a CPU server drafts) are derived with Python
    lists and a few tensor constructions (:func:`_derive_small`; alone on a 2-core CPU: the plain
    round's empty tree ~15 us instead of ~29 us of small tensor ops, three nodes ~18 us instead of
    ~58 us, several times more each right after a forward); larger ones with the vectorised passes
    below. Both give the same tensors (tests/tree/test_buffers.py).
    """
    if tree.num_nodes <= SMALL_TREE:
        return _derive_small(tree, root_token)
    return _derive_vectorised(tree, root_token)


SMALL_TREE = 32  # nodes up to which derive_buffers works on Python lists


def _derive_small(tree: DraftTree, root_token: int) -> VerifyBuffers:
    """:func:`derive_buffers` on Python lists: each row's path is its parent row's path plus itself
    (rows are in topological order), the mask is set from those paths in one indexed write."""
    dev = tree.draft_tokens.device
    parent_rows = [-1] + [p + 1 for p in tree.parents.tolist()]
    offsets = [0] + tree.depths.tolist()
    n1 = len(parent_rows)
    paths = [[0]]
    for i in range(1, n1):
        paths.append(paths[parent_rows[i]] + [i])
    mask = torch.zeros(n1 * n1, dtype=torch.bool, device=dev)
    mask[torch.tensor([i * n1 + j for i, path in enumerate(paths) for j in path], device=dev)] = True
    parents_set = set(parent_rows[1:])
    d1 = max(len(path) for path in paths)  # = the deepest depth + 1 (a validated tree)
    retrieve = [paths[i] + [-1] * (d1 - len(paths[i])) for i in range(n1) if i not in parents_set]
    return VerifyBuffers(torch.tensor([root_token] + tree.draft_tokens.tolist(), dtype=torch.long, device=dev),
                         mask.view(n1, n1), torch.tensor(offsets, dtype=torch.long, device=dev),
                         torch.tensor(parent_rows, dtype=torch.long, device=dev),
                         torch.tensor(retrieve, dtype=torch.long, device=dev))


def _derive_vectorised(tree: DraftTree, root_token: int) -> VerifyBuffers:
    """:func:`derive_buffers` with tensor passes, one per depth level (large trees)."""
    n = tree.num_nodes
    dev = tree.draft_tokens.device
    parent_rows = torch.cat([torch.tensor([-1], device=dev), tree.parents + 1])  # [N+1]
    position_offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), tree.depths])
    mask = torch.eye(n + 1, dtype=torch.bool, device=dev)
    mask[:, 0] = True
    if n:
        depth_max = int(tree.depths.max())
        anc = parent_rows.clone()  # [N+1] ancestor at distance k, walked up one level per pass
        rows = torch.arange(n + 1, device=dev)
        for _ in range(depth_max):  # loop over depth, never over nodes
            ok = anc >= 0
            mask[rows[ok], anc[ok]] = True
            anc = torch.where(ok, parent_rows[anc.clamp(min=0)], anc)
    is_parent = torch.zeros(n + 1, dtype=torch.bool, device=dev)
    if n:
        is_parent[parent_rows[1:]] = True
    leaves = (~is_parent).nonzero().flatten()  # [P]
    d1 = int(position_offsets.max()) + 1
    # Path of a leaf = its ancestor-or-self rows sorted by depth.
    leaf_mask = mask[leaves]  # [P, N+1]
    depth_of = position_offsets.expand_as(leaf_mask)
    key = torch.where(leaf_mask, depth_of, torch.full_like(depth_of, d1 + 1))
    order = torch.sort(key, dim=1, stable=True).indices[:, :d1]
    retrieve = torch.where(torch.gather(leaf_mask, 1, order), order, torch.full_like(order, -1))
    input_ids = torch.cat([torch.tensor([root_token], device=dev, dtype=torch.long), tree.draft_tokens.long()])
    return VerifyBuffers(input_ids, mask, position_offsets, parent_rows, retrieve)


def tree_from_parents(tokens: list[int], parents: list[int], scores: list[float] | None = None) -> DraftTree:
    """Build a :class:`DraftTree` from plain lists (depths computed from ``parents``).

    Raises:
        ValueError: when ``parents`` is not topological.
    """
    depths: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p} is not topological")
        depths.append(1 if p < 0 else depths[p] + 1)
    sc = scores if scores is not None else [0.0] * len(tokens)
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                     torch.tensor(depths, dtype=torch.long), torch.tensor(sc, dtype=torch.float32))
