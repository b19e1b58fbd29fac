"""n-gram draft chains from a request's own tokens, merged into a drafted tree (no model involved).

Where text repeats (a summary quoting its source, a code edit copying the file, a RAG answer
citing its passages), the continuation of the last few tokens' earlier occurrence is a good guess
of what comes next: llama.cpp's ``ngram-*`` speculative types and HF transformers' prompt lookup
decoding draft exactly that. Here such a chain joins the drafter's tree as extra nodes:

1. :class:`NgramIndex` holds a request's history (prompt + committed tokens) and, for every
   ``n`` in ``[min_n, max_n]``, the position following the *latest* earlier occurrence of each
   n-gram (a dict updated as tokens are appended: O(max_n) per token, O(max_n) per lookup).
2. :meth:`NgramIndex.propose` takes the history plus the round's root token, looks its suffix up
   longest first (``n = max_n`` down to ``min_n``) and returns the tokens that followed it.
3. :func:`merge_chain` walks the tree from the root along the chain (trie merge): the prefix the
   drafter already proposed is shared, the rest is appended as new nodes, one chain below the last
   shared node, at most ``max_new`` of them and never deeper than ``max_depth``.

Defaults: ``max_n = 3``, ``min_n = 2``. A 1-gram (a single token) matches almost everywhere and its
continuation is mostly noise; three tokens are enough to lock onto a copied span, and falling back
to two keeps the chain alive right after an edit.

Lossless by construction: the verifier verifies any tree and accepts a node only when it equals the
target's own token at its parent (greedy or the seeded sample, docs/algorithms.md §5); an n-gram
node is one more deterministic proposal, it needs no draft distribution.
"""

from __future__ import annotations

import math

from services.tree.draft_tree import DraftTree, tree_from_parents

# Probability an n-gram node is given in its path score (scores are log-probabilities; the goodput
# policy buckets nodes by their score before its calibration learns each bucket's real rate).
NGRAM_NODE_Q = 0.5


class NgramIndex:
    """A request's token history and the latest continuation of each of its n-grams.

    Args:
        max_n, min_n: longest and shortest n-gram looked up (``1 <= min_n <= max_n``).
    Raises:
        ValueError: ``min_n < 1`` or ``max_n < min_n``.
    """

    def __init__(self, max_n: int = 3, min_n: int = 2):
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.max_n, self.min_n = int(max_n), int(min_n)
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> position of the token after its latest occurrence

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        """Append ``tokens`` (ints) to the history; each n-gram that now has a following token
        points at it (a later occurrence replaces an earlier one)."""
        toks, table = self.tokens, self._next
        for t in tokens:
            i = len(toks)
            for n in range(self.min_n, min(self.max_n, i) + 1):
                table[tuple(toks[i - n:i])] = i
            toks.append(int(t))

    def propose(self, root: int, max_len: int) -> list[int]:
        """The continuation of the longest suffix of ``history + [root]`` seen before, at most
        ``max_len`` tokens (``[]`` when no suffix of ``min_n`` or more tokens occurred before).

        Example: history ``[5, 6, 7, 8, 5, 6]``, root ``7``: the 3-gram ``(5, 6, 7)`` occurred at
        positions 0-2, so the proposal is ``[8, 5, 6, 7]`` (cut to ``max_len``).
        """
        if max_len <= 0:
            return []
        seq = self.tokens[-(self.max_n - 1):] if self.max_n > 1 else []
        seq = seq + [int(root)]
        toks = self.tokens
        for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
            key = tuple(seq[-n:])
            # the latest occurrence may end on the last committed token (a run such as "x x x")
            p = len(toks) if len(toks) >= n and tuple(toks[-n:]) == key else self._next.get(key)
            if p is not None:
                out = toks[p:p + max_len]
                return out + [int(root)] if len(out) < max_len else out
        return []


def merge_chain(tree: DraftTree, chain: list[int], max_new: int, max_depth: int,
                node_q: float = NGRAM_NODE_Q) -> tuple[DraftTree, int]:
    """Merge a chain of tokens below the root into ``tree`` (a trie merge).

    Walks from the root along ``chain``: while a node with the chain's next token exists under the
    current node it is reused; from the first token the tree lacks, the chain continues as new nodes
    appended after the existing ones (so ``parents[i] < i`` still holds), each the child of the one
    before. Stops after ``max_new`` new nodes or at depth ``max_depth``. A new node's score is its
    parent's score (0 at the root) plus ``log(node_q)``; existing nodes are unchanged.

    Example: ``tree`` = root -> a (0) -> b (1), and root -> c (2); chain ``[a, d, e]``: ``a`` is
    node 0, ``d`` becomes node 3 (parent 0) and ``e`` node 4 (parent 3).

    Args:
        tree: a valid tree of ``N`` nodes (topological order).
        chain: proposed tokens, the first one a child of the root.
        max_new: most nodes to add (>= 0); max_depth: deepest depth a node may have.
    Returns:
        ``(merged tree, nodes added)``; the tree itself when nothing was added. The first ``N``
        nodes of the merged tree are ``tree``'s, unchanged.
    """
    tokens, parents = tree.draft_tokens.tolist(), tree.parents.tolist()
    scores = tree.scores.tolist()
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
    node, depth, added = -1, 0, 0
    step = math.log(node_q)
    for tok in chain[:max(0, max_depth)]:
        nxt = child.get((node, int(tok)))
        if nxt is None:
            if added >= max_new:
                break
            nxt = len(tokens)
            tokens.append(int(tok))
            parents.append(node)
            scores.append((scores[node] if node >= 0 else 0.0) + step)
            child[(node, int(tok))] = nxt
            added += 1
        node, depth = nxt, depth + 1
    if not added:
        return tree, 0
    return tree_from_parents(tokens, parents, scores), added


def chain_hits(tree: DraftTree, first_new: int, emitted: list[int]) -> int:
    """How many of ``tree``'s nodes from index ``first_new`` on lie on the path the target emitted.

    Args:
        tree: a drafted tree; first_new: index of its first n-gram node (nodes ``first_new ..``
            were added by :func:`merge_chain`).
        emitted: the tokens committed after the tree's root (accepted draft tokens, then the
            target's own).
    Returns:
        the count of n-gram nodes on the longest root path spelled by a prefix of ``emitted``.
    """
    child = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.draft_tokens.tolist()))}
    node, hits = -1, 0
    for tok in emitted:
        node = child.get((node, int(tok)), -2)
        if node == -2:
            break
        hits += node >= first_new
    return hits
