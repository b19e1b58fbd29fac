"""DARTree supertree construction (pruned and fixed), its slow reference, and the seq-heap ablation.

Source: DART ``eval_dartree.py`` ``build_dartree_supertree`` @5bb3240e (docs/algorithms.md §2.3) and
the paper's §3 (Lemma 1 for the top-B prune). Python loops run over depths, never over nodes.
"""

from __future__ import annotations

import heapq
import math

import torch
from torch import Tensor

from services.tree.draft_tree import DraftTree
from services.tree.scorer import TreeScorer

VARIANTS = ("pruned", "fixed")


def _check_args(base_logits: Tensor, K: int, W: int, B: int, beta: float, variant: str) -> None:
    if base_logits.ndim != 2:
        raise ValueError(f"base_logits must be [D, V], got shape {tuple(base_logits.shape)}")
    if variant not in VARIANTS:
        raise ValueError(f"unknown DARTree variant {variant!r} (choose from {VARIANTS})")
    if K < 1 or B < 0 or (variant == "pruned" and W < 1):
        raise ValueError(f"need K >= 1, B >= 0, W >= 1 (got K={K}, B={B}, W={W})")
    if variant == "pruned" and beta > 0:
        raise ValueError(f"the depth bonus beta must be <= 0 for the pruned variant (got {beta}); "
                         "with beta > 0 the top-B set need not be prefix-closed (Lemma 1)")
    if variant == "fixed" and beta != 0:
        raise ValueError(f"the fixed variant uses beta = 0 (got {beta})")


def top_b(scores: Tensor, depths: Tensor, budget: int, beta: float) -> Tensor:
    """Indices of the global top-``budget`` nodes by ``score + beta * depth``, ascending.

    Ties are broken by lower index first (stable sort), as DART's CPU fallback does.

    Args:
        scores: ``[N]`` path scores; depths: ``[N]``; budget: ``B``; beta: depth bonus.
    Returns:
        ``[min(B, N)]`` long, sorted ascending (so BFS/topological order is kept).
    """
    s = scores.float() + beta * depths.float()
    order = torch.sort(s, descending=True, stable=True).indices[:budget]
    return torch.sort(order).values


def select_nodes(tree: DraftTree, keep: Tensor) -> DraftTree:
    """Restrict a tree to the nodes ``keep`` (ascending) and remap parents.

    Raises:
        ValueError: when ``keep`` is not prefix-closed (a kept node's parent was dropped).
    """
    remap = torch.full((tree.num_nodes,), -1, dtype=torch.long)
    remap[keep] = torch.arange(keep.numel())
    old_par = tree.parents[keep]
    new_par = torch.where(old_par < 0, old_par, remap[old_par.clamp(min=0)])
    if bool(((old_par >= 0) & (new_par < 0)).any()):
        raise ValueError("selected node set is not prefix-closed")
    return DraftTree(tree.draft_tokens[keep], new_par, tree.depths[keep], tree.scores[keep])


def candidates(base_logits: Tensor, K: int) -> tuple[Tensor, Tensor]:
    """Shared top-K candidates per depth from the base logits: ``(cand_vals [D, K] f32, cand_ids [D, K])``."""
    k = min(K, base_logits.shape[-1])
    return torch.topk(base_logits.float(), k, dim=-1)


def _slot_logits(scorer: TreeScorer, slot: int, states: Tensor | None, cand_ids: Tensor, cand_vals: Tensor,
                 prefix_len: int) -> Tensor:
    """Corrected candidate logits ``[P, K]`` for one slot (base logits alone while slot < prefix).
    ``states [P, S]``; None = the root alone (P = 1), only under the prefix (no state computed yet)."""
    if slot < prefix_len:
        return cand_vals[slot].float()[None, :].expand(1 if states is None else states.shape[0], -1)
    return scorer.score(slot, states, cand_ids[slot], cand_vals[slot]).float()


def pruned_reach(W: int, B: int, depth_max: int) -> tuple[int, int]:
    """``(width, depth)`` that a pruned DARTree of budget ``B`` can use: ``(min(W, B), min(D, B))``.

    Lemma 1 (paper §3, docs/algorithms.md §2.3): with ``beta <= 0`` the top-B set by ``path + beta *
    depth`` is prefix-closed, and a node's adjusted score is at most its parent's (``log q <= 0``).
    So a kept node at depth ``d`` has its ``d - 1`` ancestors kept before it (``d <= B``), and a kept
    node ranks among the top ``B`` children of its depth (every same-depth node that outranks it has
    a higher adjusted score and a lower index, so it is kept too): a per-depth quota ``W > B`` and
    depths beyond ``B`` only build nodes the final prune drops. The tree is the one the full build
    gives (``tests/tree/test_small_budget.py`` checks it against :func:`dartree_reference`); small
    budgets then score ``B`` frontier rows per depth instead of ``W``. ``B = 0`` keeps width 1.
    """
    b = max(B, 1)
    return min(W, b), min(depth_max, b)


# A node's log q is <= 0 up to float32 rounding of the log-sum-exp; the early stop keeps this margin.
_EARLY_STOP_MARGIN = 1e-4


def _prune_settled(scs: list[Tensor], deps: list[Tensor], B: int, beta: float, depth: int) -> bool:
    """True when no node deeper than ``depth`` can enter the final top-B (so building can stop).

    A deeper node's adjusted score is at most ``max(frontier path) + beta * (depth + 1)`` (log q <= 0,
    beta <= 0); if the B-th best adjusted score so far is above that bound (by a rounding margin), the
    top-B is already decided, and since deeper nodes would get larger indices they lose ties too. The
    tree is then identical to the one the full build and prune give.
    """
    adjusted = torch.cat(scs).float() + beta * torch.cat(deps).float()
    kth = torch.topk(adjusted, B).values[-1]
    bound = scs[-1].float().max() + beta * (depth + 1)
    return bool(kth > bound + _EARLY_STOP_MARGIN)


def dartree(base_logits: Tensor, scorer: TreeScorer, root_token: int, K: int = 64, W: int = 12, B: int = 64,
            beta: float = -0.2, variant: str = "pruned", pure_draft_prefix_len: int = 1,
            max_depth: int | None = None, sync_free: bool | None = None) -> DraftTree:
    """Build a DARTree: depth-by-depth batched correction over shared top-K candidates.

    Per depth ``d`` (slot ``d - 1``): score every frontier node's K candidates in one scorer call,
    ``log q`` = log-softmax over the K candidates, path = parent score + log q, keep the global
    top-quota children (several per parent allowed), advance their states in one call. ``pruned``
    uses quota W at every depth, then keeps the global top-B by ``path + beta * depth`` (it stops
    descending once no deeper node can enter the top-B, :func:`_prune_settled`: same tree, fewer calls);
    ``fixed`` uses quota ``ceil(remaining / remaining depths)`` and no prune. The root state is
    computed on first use and no state is advanced after the last depth built (same tree: B = 1
    under a one-slot prefix calls no scorer at all).

    Every shape in the depth loop is fixed by ``(K, W, B, D)`` (frontier ``P <= W`` rows, quota
    children per depth), so the loop runs on the logits' device. With ``sync_free`` it reads no
    device value at all: the early stop (a host read per depth) is left out, so every depth up to
    ``min(D, B)`` is built (the same tree, Lemma 1), the final top-B prune runs on the device, and
    the tree comes to the host in one copy.

    Args:
        base_logits: ``[D, V]`` drafter backbone logits (slot s predicts depth s + 1).
        scorer: correction head (:class:`TreeScorer`).
        root_token: last committed token id.
        K, W, B, beta, variant: as in the paper (defaults 64, 12, 64, -0.2, "pruned").
        pure_draft_prefix_len: leading slots scored by base logits alone (Domino: 1).
        max_depth: optional cap on the depth (context-window limits); default ``D``.
        sync_free: build without host reads (above); None = when the logits are not on the CPU (on
            the CPU a read costs nothing and the early stop saves scorer calls).
    Returns:
        :class:`DraftTree` in BFS order (depth-major, descending path score within a depth).
    Raises:
        ValueError: bad variant, beta > 0 for pruned, beta != 0 for fixed, K/W/B out of range.
    """
    _check_args(base_logits, K, W, B, beta, variant)
    depth_max = base_logits.shape[0] if max_depth is None else min(max_depth, base_logits.shape[0])
    if variant == "pruned":  # the same tree, fewer scorer rows: :func:`pruned_reach`
        W, depth_max = pruned_reach(W, B, depth_max)
    cand_vals, cand_ids = candidates(base_logits, K)  # [D, K]
    k = cand_vals.shape[1]
    dev = base_logits.device  # the search runs where the logits are (CPU or CUDA); the tree comes back on CPU
    # frontier states [P, S]; None = the root's, computed on first use: a tree that stops before any
    # corrected slot or any child's state is needed (B = 1 under the Domino prefix) runs no scorer
    states: Tensor | None = None
    sync_free = dev.type != "cpu" if sync_free is None else sync_free
    frontier_scores = torch.zeros(1, device=dev)
    frontier_nodes = torch.tensor([-1], device=dev)
    toks, pars, deps, scs = [], [], [], []
    created = 0
    for depth in range(1, depth_max + 1):
        quota = W if variant == "pruned" else math.ceil((B - created) / (depth_max - depth + 1))
        if quota <= 0:
            break
        if states is None and depth - 1 >= pure_draft_prefix_len:  # the first corrected slot
            states = scorer.root_state(root_token)
        logits = _slot_logits(scorer, depth - 1, states, cand_ids, cand_vals, pure_draft_prefix_len)
        log_q = logits - torch.logsumexp(logits, dim=-1, keepdim=True)  # [P, K]
        path = (frontier_scores[:, None] + log_q).flatten()  # [P * K]
        order = torch.sort(path, descending=True, stable=True).indices[:quota]
        pidx, rank = order // k, order % k
        child_tokens = cand_ids[depth - 1][rank]
        frontier_scores = path[order]
        toks.append(child_tokens)
        pars.append(frontier_nodes[pidx])
        deps.append(torch.full((order.numel(),), depth, dtype=torch.long, device=dev))
        scs.append(frontier_scores)
        frontier_nodes = torch.arange(created, created + order.numel(), device=dev)
        created += order.numel()
        # the last depth built: no child state is needed (the fixed variant's next quota would be 0)
        if depth == depth_max or (variant == "fixed" and created >= B) or (
                variant == "pruned" and created >= B and not sync_free and _prune_settled(scs, deps, B, beta, depth)):
            break
        states = scorer.advance((scorer.root_state(root_token) if states is None else states)[pidx], child_tokens)
    if not toks:
        return DraftTree.empty()
    prune = B if variant == "pruned" and created > B else None
    if sync_free:
        return _tree_in_one_copy(torch.cat(toks), torch.cat(pars), torch.cat(deps), torch.cat(scs), prune, beta)
    tree = DraftTree(torch.cat(toks).long().cpu(), torch.cat(pars).long().cpu(), torch.cat(deps).cpu(),
                     torch.cat(scs).float().cpu())
    if prune is not None:
        tree = select_nodes(tree, top_b(tree.scores, tree.depths, B, beta))
    return tree


def _tree_in_one_copy(toks: Tensor, pars: Tensor, deps: Tensor, scs: Tensor, prune: int | None,
                      beta: float) -> DraftTree:
    """The built nodes (``[N]`` each, on their device) as a :class:`DraftTree` on the host, cut to the
    top-``prune`` (:func:`top_b`, None: all kept) on the device and read with ONE device-to-host copy
    (float64 holds the ids and the float32 scores exactly).

    Raises:
        ValueError: the kept set is not prefix-closed (as :func:`select_nodes`).
    """
    closed = torch.ones((), dtype=torch.bool, device=toks.device)
    if prune is not None:
        keep = top_b(scs, deps, prune, beta)  # [B] ascending
        remap = torch.full((toks.numel(),), -1, dtype=torch.long, device=toks.device)
        remap[keep] = torch.arange(keep.numel(), device=toks.device)
        old_par = pars[keep]
        new_par = torch.where(old_par < 0, old_par, remap[old_par.clamp(min=0)])
        closed = ~((old_par >= 0) & (new_par < 0)).any()
        toks, pars, deps, scs = toks[keep], new_par, deps[keep], scs[keep]
    n = toks.numel()
    packed = torch.cat([torch.stack([toks.double(), pars.double(), deps.double(), scs.float().double()]).flatten(),
                        closed.double()[None]])
    host = packed.tolist()  # the build's one device-to-host copy
    if not host[-1]:
        raise ValueError("selected node set is not prefix-closed")
    col = lambda i, dtype: torch.tensor(host[i * n:(i + 1) * n], dtype=dtype)  # noqa: E731
    return DraftTree(col(0, torch.long), col(1, torch.long), col(2, torch.long), col(3, torch.float32))


def dartree_reference(base_logits: Tensor, scorer: TreeScorer, root_token: int, K: int = 64, W: int = 12,
                      B: int = 64, beta: float = -0.2, variant: str = "pruned",
                      pure_draft_prefix_len: int = 1) -> DraftTree:
    """Slow, obviously-correct DARTree: loops over every node and candidate (tests only).

    Same semantics and tie rule as :func:`dartree` (ties: lower flat index first, where the flat
    index of candidate ``r`` of the ``p``-th frontier node is ``p * K + r``).
    """
    _check_args(base_logits, K, W, B, beta, variant)
    cand_vals, cand_ids = candidates(base_logits, K)
    k = cand_vals.shape[1]
    nodes: list[dict] = []
    frontier = [{"idx": -1, "score": 0.0, "state": scorer.root_state(root_token)}]
    for depth in range(1, base_logits.shape[0] + 1):
        quota = W if variant == "pruned" else math.ceil((B - len(nodes)) / (base_logits.shape[0] - depth + 1))
        if quota <= 0:
            break
        options = []
        for p, parent in enumerate(frontier):
            logits = _slot_logits(scorer, depth - 1, parent["state"], cand_ids, cand_vals, pure_draft_prefix_len)[0]
            lse = torch.logsumexp(logits, dim=0)
            for r in range(k):
                options.append((parent["score"] + float(logits[r] - lse), p * k + r, parent, r))
        options.sort(key=lambda o: (-o[0], o[1]))
        new_frontier = []
        for score, _, parent, r in options[:quota]:
            tok = int(cand_ids[depth - 1][r])
            node = {"idx": len(nodes), "score": score, "parent": parent["idx"], "depth": depth, "token": tok,
                    "state": scorer.advance(parent["state"], torch.tensor([tok]))}
            nodes.append(node)
            new_frontier.append(node)
        frontier = new_frontier
    if variant == "pruned" and len(nodes) > B:
        ranked = sorted(nodes, key=lambda n: (-(n["score"] + beta * n["depth"]), n["idx"]))[:B]
        keep = sorted(n["idx"] for n in ranked)
        remap = {old: new for new, old in enumerate(keep)}
        nodes = [dict(nodes[i], idx=remap[i], parent=remap.get(nodes[i]["parent"], -1)) for i in keep]
    if not nodes:
        return DraftTree.empty()
    return DraftTree(torch.tensor([n["token"] for n in nodes]), torch.tensor([n["parent"] for n in nodes]),
                     torch.tensor([n["depth"] for n in nodes]),
                     torch.tensor([n["score"] for n in nodes], dtype=torch.float32))


def seqheap(base_logits: Tensor, scorer: TreeScorer, root_token: int, K: int = 64, B: int = 64,
            beta: float = -0.2, pure_draft_prefix_len: int = 1) -> DraftTree:
    """The paper's "sequential correction with heap" ablation: exact best-first search.

    Each pop creates a node, advances its state and scores its K children with one scorer call
    (so B pops cost B scorer calls). Key = path score + beta * depth; ties pop in push order.

    Args:
        base_logits: ``[D, V]``; K, B, beta, pure_draft_prefix_len: as in :func:`dartree`.
    Returns:
        :class:`DraftTree` in pop order (topological).
    Raises:
        ValueError: when beta > 0.
    """
    _check_args(base_logits, K, 1, B, beta, "pruned")
    cand_vals, cand_ids = candidates(base_logits, K)
    depth_max = base_logits.shape[0]
    heap: list = []
    counter = 0

    def push_children(parent: int, state: Tensor, score: float, depth: int) -> None:
        nonlocal counter
        logits = _slot_logits(scorer, depth, state, cand_ids, cand_vals, pure_draft_prefix_len)[0]
        path = score + (logits - torch.logsumexp(logits, dim=0))
        for r, s in enumerate(path.tolist()):
            heapq.heappush(heap, (-(s + beta * (depth + 1)), counter, parent, depth + 1, r, s, state))
            counter += 1

    push_children(-1, scorer.root_state(root_token), 0.0, 0)
    toks, pars, deps, scs = [], [], [], []
    while heap and len(toks) < B:
        _, _, parent, depth, r, s, pstate = heapq.heappop(heap)
        tok = int(cand_ids[depth - 1][r])
        node = len(toks)
        toks.append(tok), pars.append(parent), deps.append(depth), scs.append(s)
        if depth < depth_max:
            push_children(node, scorer.advance(pstate, torch.tensor([tok], device=cand_ids.device)), s, depth)
    if not toks:
        return DraftTree.empty()
    return DraftTree(torch.tensor(toks), torch.tensor(pars), torch.tensor(deps),
                     torch.tensor(scs, dtype=torch.float32))
