"""Chain and DDTree builders, and the sequential (chain) rollout of a correction head.

Sources: DFlash chain (ZDF ``dflash/model.py``), DDTree ``build_ddtree_tree`` (DDT ``ddtree.py``,
docs/algorithms.md §4), Domino chain rollout (DART ``spec_generate``, docs/algorithms.md §2.2).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch
from torch import Tensor

from services.tree.draft_tree import DraftTree
from services.tree.scorer import TreeScorer


def chain(tokens: Tensor, scores: Tensor | None = None) -> DraftTree:
    """A chain tree: node ``i`` is the child of node ``i - 1`` (DFlash and Domino baselines).

    Args:
        tokens: ``[D]`` long draft tokens, in order.
        scores: optional ``[D]`` per-node path scores.
    """
    assert tokens.ndim == 1, "tokens must be [D]"
    d = tokens.numel()
    idx = torch.arange(d)
    sc = scores.float() if scores is not None else torch.zeros(d)
    return DraftTree(tokens.long().cpu(), idx - 1, idx + 1, sc.cpu())


def ddtree(log_probs: Tensor, budget: int) -> DraftTree:
    """DDTree: best-first selection of the ``budget`` most likely prefixes under per-depth marginals.

    A max-heap (negated keys) over ``(-logw, ranks, parent, depth, rank, logw)`` entries; each pop
    creates a node and pushes its next sibling and its first child. Ties compare the ranks tuple
    lexicographically, then the parent index, exactly as DDT ``build_ddtree_tree``.

    Args:
        log_probs: ``[D, V]`` per-depth log-probabilities (full-vocabulary log-softmax of the
            drafter's logits, no temperature).
        budget: ``B``, number of draft nodes (root excluded).
    Returns:
        A :class:`DraftTree` in pop (best-first, topological) order; ``scores`` = path log-prob.
    """
    assert log_probs.ndim == 2, "log_probs must be [D, V]"
    depth_max, vocab = log_probs.shape
    if budget <= 0 or depth_max == 0:
        return DraftTree.empty()
    k = min(budget, vocab)
    top_lp, top_ids = torch.topk(log_probs.float(), k, dim=-1)  # [D, k]
    lp, ids = top_lp.tolist(), top_ids.tolist()
    heap = [(-lp[0][0], (0,), -1, 1, 0, lp[0][0])]
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    while heap and len(tokens) < budget:
        _, ranks, parent, depth, rank, logw = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        scores.append(logw)
        if rank + 1 < k:
            w = logw - lp[depth - 1][rank] + lp[depth - 1][rank + 1]
            heapq.heappush(heap, (-w, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, w))
        if depth < depth_max:
            w = logw + lp[depth][0]
            heapq.heappush(heap, (-w, ranks + (0,), node, depth + 1, 0, w))
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                     torch.tensor(depths, dtype=torch.long), torch.tensor(scores, dtype=torch.float32))


def chain_rollout(base_logits: Tensor, scorer: TreeScorer, root_token: int, pure_draft_prefix_len: int = 1,
                  pick: Callable[[Tensor], int] | None = None) -> tuple[Tensor, Tensor]:
    """Sequential Domino chain: each slot's corrected logits condition on the tokens picked so far.

    Slot ``s < pure_draft_prefix_len`` uses the base logits alone; later slots add the scorer's
    bias computed from the state after ``[root, d_1 .. d_s]`` (docs/algorithms.md §2.2).

    Args:
        base_logits: ``[D, V]`` drafter (backbone) logits, slot ``s`` predicts depth ``s + 1``.
        scorer: the correction head.
        root_token: last committed token id.
        pure_draft_prefix_len: number of leading uncorrected slots.
        pick: maps a ``[V]`` logits row to a token id; argmax when ``None``.
    Returns:
        ``tokens [D]`` long and the corrected ``logits [D, V]`` float32 each token was picked from.
    """
    assert base_logits.ndim == 2, "base_logits must be [D, V]"
    pick = pick or (lambda row: int(torch.argmax(row)))
    state = scorer.root_state(root_token)
    tokens, rows = [], []
    for slot in range(base_logits.shape[0]):
        base = base_logits[slot].float()
        row = base if slot < pure_draft_prefix_len else scorer.score(slot, state, None, base)[0].float()
        tok = pick(row)
        tokens.append(tok)
        rows.append(row)
        state = scorer.advance(state, torch.tensor([tok], device=base_logits.device))
    return torch.tensor(tokens, dtype=torch.long), torch.stack(rows)


def domino_ddtree(chain_logits: Tensor, budget: int) -> DraftTree:
    """The "Domino-chain + DDTree" ablation: DDTree over chain-conditioned distributions.

    Args:
        chain_logits: ``[D, V]`` corrected logits from :func:`chain_rollout` (each slot conditioned
            on the greedy chain before it).
        budget: ``B`` draft nodes.
    """
    return ddtree(torch.log_softmax(chain_logits.float(), dim=-1), budget)
