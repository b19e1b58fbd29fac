"""EAGLE-2/3 dynamic draft tree: top-k expansion of the best frontier, global top-B rerank.

Source: EAGLE-2 (Li et al., arXiv 2406.16858) §4 "context-aware dynamic draft tree", as used
unchanged by EAGLE-3 (``topK_genrate``): depth 1 = the top-k tokens under the root; at every
further step the k frontier nodes are expanded (one drafter call for all of them), each proposes
its top-k children (P * k candidates, all kept as nodes), the next frontier is the global top-k
candidates by path log-probability; finally the top-B nodes by path score are kept (ties: lower
index first), which is prefix-closed because log-probabilities are <= 0. The model call is a
callback, so this module never sees a model (docs/design.md "Pure tree algorithms").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from services.tree.dartree import _prune_settled, select_nodes, top_b
from services.tree.draft_tree import DraftTree

# expand(frontier node ids [P], their tokens [P], their parents [P]) -> child log-probs [P, N]
Expand = Callable[[Tensor, Tensor, Tensor], Tensor]


def eagle_tree(root_logp: Tensor, expand: Expand, top_k: int = 8, depth: int = 6, budget: int = 64) -> DraftTree:
    """Build an EAGLE-3 dynamic draft tree.

    Args:
        root_logp: ``[N]`` log-probabilities of the token after the root (draft vocabulary).
        expand: callback ``(nodes [P], tokens [P], parents [P]) -> log-probs [P, N]`` of each frontier
            node's child (nodes in this function's numbering; parents ``-1`` = the root).
        top_k: k (children per expanded node, and frontier size); depth: deepest node;
            budget: B, nodes kept (root excluded).
    Returns:
        :class:`DraftTree` in creation order (depth-major), ``scores`` = path log-probability.
    Raises:
        ValueError: ``root_logp`` not 1-D, or ``top_k`` / ``depth`` < 1, or ``budget`` < 0.
    """
    if root_logp.ndim != 1:
        raise ValueError(f"root_logp must be [N], got shape {tuple(root_logp.shape)}")
    if top_k < 1 or depth < 1 or budget < 0:
        raise ValueError(f"need top_k >= 1, depth >= 1, budget >= 0 (got {top_k}, {depth}, {budget})")
    if budget == 0:
        return DraftTree.empty()
    k = min(top_k, root_logp.numel())
    vals, ids = torch.topk(root_logp.float(), k)
    toks, pars, deps, scs = [ids.long()], [torch.full((k,), -1, dtype=torch.long)], \
        [torch.ones(k, dtype=torch.long)], [vals]
    frontier, f_scores, created = torch.arange(k), vals, k
    for d in range(2, depth + 1):
        if created >= budget and _prune_settled(scs, deps, budget, 0.0, d - 1):
            break  # no deeper node can enter the top-B: the same tree with fewer drafter calls
        all_toks, all_pars = torch.cat(toks), torch.cat(pars)
        logp = expand(frontier, all_toks[frontier], all_pars[frontier]).float()  # [P, N]
        cv, ci = torch.topk(logp, k, dim=-1)  # [P, k]
        path = (f_scores[:, None] + cv).flatten()  # [P * k]
        n_new = path.numel()
        toks.append(ci.flatten().long())
        pars.append(frontier.repeat_interleave(k))
        deps.append(torch.full((n_new,), d, dtype=torch.long))
        scs.append(path)
        order = torch.sort(path, descending=True, stable=True).indices[:k]
        frontier, f_scores = created + order, path[order]
        created += n_new
    tree = DraftTree(torch.cat(toks).cpu(), torch.cat(pars), torch.cat(deps), torch.cat(scs).float().cpu())
    if tree.num_nodes > budget:
        tree = select_nodes(tree, top_b(tree.scores, tree.depths, budget, 0.0))
    return tree
