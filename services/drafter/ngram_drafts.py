"""The drafter's n-gram chains: each request's token history, and the chain it adds to every tree.

A :class:`~services.drafter.service.DrafterService` built with ``ngram_nodes > 0`` keeps one
:class:`~services.tree.ngram.NgramIndex` per request, fed with the tokens every draft job carries
(its ``committed_ids``: the prompt on the first draft, then the tokens committed since), and after
building a request's tree merges the continuation of the history's longest repeated suffix into it
(:func:`~services.tree.ngram.merge_chain`). No drafter forward is involved.

Budget: the chain gets its own allowance of ``ngram_nodes`` new nodes on top of the ``B`` nodes
the drafter built (nodes it shares with the drafter's tree cost nothing); the tree never exceeds
:data:`~services.spec.MAX_BUDGET` nodes (the verifier's row headroom). The goodput policy then cuts
the merged tree like any other (its calibrated acceptance per node decides whether the extra verify
rows pay); the fixed policy verifies every node.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.spec import MAX_BUDGET
from services.tree.draft_tree import DraftTree
from services.tree.ngram import NgramIndex, chain_hits, merge_chain

DEFAULT_NGRAM_NODES = 4  # the chain's allowance of new nodes per tree when n-gram drafting is on


@dataclass
class _Last:
    """The last tree a request was sent: its root and the index of its first n-gram node."""

    tree: DraftTree
    first_new: int
    root: int


class NgramDrafts:
    """Per-request n-gram histories and the counts behind ``dartree_ngram_*``.

    Args:
        max_nodes: new nodes a chain may add to one tree (>= 1).
        max_n, min_n: n-gram sizes looked up, longest first (:class:`NgramIndex`).

    Attributes:
        proposed: n-gram nodes added to trees so far (before the verifier's policy cut any).
        accepted: n-gram nodes on the path the target then emitted (counted at the request's next
            draft, from the tokens it carries).
    Raises:
        ValueError: ``max_nodes < 1`` or bad n-gram sizes.
    """

    def __init__(self, max_nodes: int = DEFAULT_NGRAM_NODES, max_n: int = 3, min_n: int = 2):
        if max_nodes < 1:
            raise ValueError(f"ngram_nodes must be >= 1 (got {max_nodes})")
        NgramIndex(max_n, min_n)  # checks the sizes
        self.max_nodes, self.max_n, self.min_n = int(max_nodes), int(max_n), int(min_n)
        self._index: dict[str, NgramIndex] = {}
        self._last: dict[str, _Last] = {}
        self.proposed = 0
        self.accepted = 0

    def counts(self) -> tuple[int, int]:
        """``(proposed, accepted)`` n-gram nodes so far."""
        return self.proposed, self.accepted

    def join(self, request_id: str, committed_ids: list[int], start: int, root: int, tree: DraftTree,
             max_depth: int) -> DraftTree:
        """Record a draft job's tokens and return ``tree`` with the request's n-gram chain merged in.

        Args:
            committed_ids: tokens of positions ``[start - len(committed_ids), start)``; root: the
                token at ``start``; tree: the drafter's tree below it (target ids); max_depth: the
                deepest a chain node may be.
        Returns:
            the merged tree (``tree`` itself when no chain matched or it added nothing).
        """
        index = self._index.get(request_id)
        if index is None or len(index) != start - len(committed_ids):
            index = self._index[request_id] = NgramIndex(self.max_n, self.min_n)  # new, or a gap: restart
        last = self._last.pop(request_id, None)
        if last is not None and committed_ids and committed_ids[0] == last.root:
            self.accepted += chain_hits(last.tree, last.first_new, list(committed_ids[1:]))
        index.extend(committed_ids)
        room = min(self.max_nodes, MAX_BUDGET - tree.num_nodes)
        merged, added = merge_chain(tree, index.propose(root, max_depth), room, max_depth)
        if added:
            self.proposed += added
            self._last[request_id] = _Last(merged, tree.num_nodes, int(root))
        return merged

    def release(self, request_id: str) -> None:
        """Forget a request's history (idempotent)."""
        self._index.pop(request_id, None)
        self._last.pop(request_id, None)
