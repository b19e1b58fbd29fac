"""DARTree's lean loop builds exactly the tree of the eager loop, with fewer scorer calls.

:func:`dartree` computes the root state only when a corrected slot or a child state needs it and
advances no state after the last depth it builds. ``_eager_dartree`` below is the loop without
those cuts (root state up front, every depth's children advanced); both must give the same tree,
scores bit for bit, for budgets 1-8 on random inputs, with a table, a Markov and a Domino scorer.
"""

from __future__ import annotations

import math

import pytest
import torch

from services.tree.dartree import _check_args, _prune_settled, _slot_logits, candidates, dartree, pruned_reach, \
    select_nodes, top_b
from services.tree.draft_tree import DraftTree
from services.tree.scorer import MarkovScorer, TableScorer


def _eager_dartree(base_logits, scorer, root_token, K=64, W=12, B=64, beta=-0.2, variant="pruned",
                   pure_draft_prefix_len=1):
    """The DARTree loop with the root state computed first and every depth's children advanced."""
    _check_args(base_logits, K, W, B, beta, variant)
    depth_max = base_logits.shape[0]
    if variant == "pruned":
        W, depth_max = pruned_reach(W, B, depth_max)
    cand_vals, cand_ids = candidates(base_logits, K)
    k = cand_vals.shape[1]
    states = scorer.root_state(root_token)
    frontier_scores, frontier_nodes = torch.zeros(1), torch.tensor([-1])
    toks, pars, deps, scs = [], [], [], []
    created = 0
    for depth in range(1, depth_max + 1):
        quota = W if variant == "pruned" else math.ceil((B - created) / (depth_max - depth + 1))
        if quota <= 0:
            break
        logits = _slot_logits(scorer, depth - 1, states, cand_ids, cand_vals, pure_draft_prefix_len)
        log_q = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        path = (frontier_scores[:, None] + log_q).flatten()
        order = torch.sort(path, descending=True, stable=True).indices[:quota]
        pidx, rank = order // k, order % k
        child_tokens = cand_ids[depth - 1][rank]
        states = scorer.advance(states[pidx], child_tokens)
        frontier_scores = path[order]
        toks.append(child_tokens)
        pars.append(frontier_nodes[pidx])
        deps.append(torch.full((order.numel(),), depth, dtype=torch.long))
        scs.append(frontier_scores)
        frontier_nodes = torch.arange(created, created + order.numel())
        created += order.numel()
        if variant == "pruned" and created >= B and depth < depth_max and _prune_settled(scs, deps, B, beta, depth):
            break
    if not toks:
        return DraftTree.empty()
    tree = DraftTree(torch.cat(toks).long(), torch.cat(pars).long(), torch.cat(deps), torch.cat(scs).float())
    if variant == "pruned" and tree.num_nodes > B:
        tree = select_nodes(tree, top_b(tree.scores, tree.depths, B, beta))
    return tree


def _assert_identical(got: DraftTree, want: DraftTree) -> None:
    for name in ("draft_tokens", "parents", "depths", "scores"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


class _Counting:
    """Wraps a scorer and counts its calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, {"root_state": 0, "score": 0, "advance": 0}

    def root_state(self, root_token):
        self.calls["root_state"] += 1
        return self.inner.root_state(root_token)

    def score(self, *a):
        self.calls["score"] += 1
        return self.inner.score(*a)

    def advance(self, *a):
        self.calls["advance"] += 1
        return self.inner.advance(*a)


def _table_inputs(seed: int, depth: int, vocab: int, ties: bool):
    g = torch.Generator().manual_seed(seed)
    base = 2.0 * torch.randn(depth, vocab, generator=g)
    table = 2.0 * torch.randn(depth, vocab, vocab, generator=g)
    if ties:
        base, table = base.round(), table.round()
    return base, TableScorer(table)


@pytest.mark.parametrize("variant,beta", [("pruned", -0.2), ("pruned", 0.0), ("pruned", -1.0), ("fixed", 0.0)])
@pytest.mark.parametrize("ties", [False, True])
def test_lean_equals_eager_table_scorer(variant: str, beta: float, ties: bool) -> None:
    for budget in range(1, 9):
        for seed in range(3):
            for prefix in (0, 1):
                for width in (1, 3, 12):
                    base, scorer = _table_inputs(10 * seed + budget, depth=6, vocab=11, ties=ties)
                    kw = dict(K=7, W=width, B=budget, beta=beta, variant=variant, pure_draft_prefix_len=prefix)
                    counted = _Counting(scorer)
                    got = dartree(base, counted, 2, **kw)
                    _assert_identical(got, _eager_dartree(base, scorer, 2, **kw))
                    assert counted.calls["root_state"] <= 1
                    # no state is advanced past the deepest depth built
                    assert counted.calls["advance"] <= max(got.max_depth - 1, 0) + (variant == "pruned")


def test_lean_equals_eager_markov_scorer() -> None:
    g = torch.Generator().manual_seed(4)
    for budget in range(1, 9):
        base = 3.0 * torch.randn(5, 40, generator=g)
        scorer = MarkovScorer(torch.randn(40, 6, generator=g), torch.randn(40, 6, generator=g))
        for prefix in (0, 1):
            kw = dict(K=16, W=12, B=budget, beta=-0.2, pure_draft_prefix_len=prefix)
            _assert_identical(dartree(base, scorer, 3, **kw), _eager_dartree(base, scorer, 3, **kw))


def test_budget_one_under_the_prefix_runs_no_scorer() -> None:
    """B = 1, prefix 1: the one node is the best base candidate of slot 0; no GRU step, no score."""
    base, scorer = _table_inputs(3, depth=4, vocab=9, ties=False)
    counted = _Counting(scorer)
    tree = dartree(base, counted, 1, K=5, W=12, B=1, beta=-0.2, pure_draft_prefix_len=1)
    assert tree.draft_tokens.tolist() == [int(base[0].argmax())]
    assert counted.calls == {"root_state": 0, "score": 0, "advance": 0}


def test_budget_three_advances_only_inner_depths() -> None:
    """B = 3, W = 12, a chain-favouring table: 3 depths, 2 advances (none after depth 3), 1 root state."""
    base = torch.zeros(4, 6)
    base[:, 1] = 8.0  # one dominant candidate per slot: the tree is a 3-deep chain
    counted = _Counting(TableScorer(torch.zeros(4, 6, 6)))
    tree = dartree(base, counted, 0, K=4, W=12, B=3, beta=0.0, pure_draft_prefix_len=1)
    assert tree.depths.tolist() == [1, 2, 3]
    assert counted.calls == {"root_state": 1, "score": 2, "advance": 2}


def _domino_scorer(seed: int):
    from services.drafter.model import DFlashDrafter, DrafterConfig
    from services.drafter.tree_builders import DominoScorer

    c = DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, vocab_size=50, block_size=8, num_target_layers=2,
                      target_hidden_size=32, target_layer_ids=[0, 1], mask_token_id=49, gru_hidden_dim=16,
                      emb_dim=8)
    torch.manual_seed(seed)
    m = DFlashDrafter(c)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
    embed = torch.nn.Embedding(50, 32)
    hd = torch.randn(8, 32)
    return DominoScorer(m.eval(), embed, hd), 3.0 * torch.randn(8, 50)


@torch.inference_mode()
def test_lean_equals_eager_domino_scorer() -> None:
    """The real correction head (GRU states, float32): identical trees for B = 1..8."""
    for seed in range(3):
        scorer, base = _domino_scorer(seed)
        for budget in range(1, 9):
            kw = dict(K=12, W=12, B=budget, beta=-0.2, variant="pruned", pure_draft_prefix_len=1)
            got = dartree(base, scorer, 5, **kw)
            _assert_identical(got, _eager_dartree(base, scorer, 5, **kw))
            got.validate(budget=budget, vocab_size=50)


@torch.inference_mode()
def test_domino_scorer_computes_z_on_first_score() -> None:
    """``DominoScorer.z`` is ``hd W_zᵀ`` bit for bit, computed only when a slot is scored: a B = 1
    tree under the one-slot prefix never computes it."""
    scorer, base = _domino_scorer(4)
    dartree(base, scorer, 5, K=12, W=12, B=1, beta=-0.2, variant="pruned", pure_draft_prefix_len=1)
    assert scorer._z is None
    dartree(base, scorer, 5, K=12, W=12, B=4, beta=-0.2, variant="pruned", pure_draft_prefix_len=1)
    wz = scorer.drafter.head_split()[0]
    assert scorer._z is not None and torch.equal(scorer._z, scorer.hd @ wz.T)
