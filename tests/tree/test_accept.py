"""Acceptance: literal walks (R7), target-distribution and seeded-determinism tests (R9)."""

from __future__ import annotations

import pytest
import torch

from services.tree.accept import (
    SMALL_WALK,
    _walk_small,
    rejection_accept_chain,
    sample_target_tokens,
    target_probs,
    walk,
)
from services.tree.draft_tree import DraftTree, derive_buffers, tree_from_parents

# Chi-square critical values at p = 0.001, by degrees of freedom.
CHI2_CRIT_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def chi2_stat(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson chi-square of integer ``samples`` against ``probs`` [V]; returns (statistic, dof).

    A sample in a zero-probability cell gives an infinite statistic.
    """
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = counts.sum() * probs.double()
    support = expected > 0
    if bool((counts[~support] > 0).any()):
        return float("inf"), int(support.sum()) - 1
    stat = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    return float(stat), int(support.sum()) - 1


def assert_follows(samples: list[int] | torch.Tensor, probs: torch.Tensor) -> None:
    stat, dof = chi2_stat(torch.as_tensor(samples, dtype=torch.long), probs)
    assert stat < CHI2_CRIT_0_001[dof], f"chi2 = {stat:.1f} >= {CHI2_CRIT_0_001[dof]} (dof {dof})"


def assert_differs(samples: list[int] | torch.Tensor, probs: torch.Tensor) -> None:
    """Power check: the test above would catch the wrong distribution."""
    stat, dof = chi2_stat(torch.as_tensor(samples, dtype=torch.long), probs)
    assert stat > CHI2_CRIT_0_001[dof]


def test_chi2_helper_literal() -> None:
    stat, dof = chi2_stat(torch.tensor([0, 0, 1, 1]), torch.tensor([0.5, 0.5]))
    assert (stat, dof) == (0.0, 1)
    stat, dof = chi2_stat(torch.tensor([0, 0, 0, 1]), torch.tensor([0.5, 0.5]))
    assert stat == pytest.approx(1.0) and dof == 1  # (3-2)^2/2 + (1-2)^2/2
    assert chi2_stat(torch.tensor([2]), torch.tensor([0.5, 0.5, 0.0]))[0] == float("inf")


# ---------------------------------------------------------------- greedy walk on a literal tree

# r -> a(1) -> c(3) -> e(5) ; a -> d(4) ; r -> b(2) -> f(6).  Rows: r0 a1 b2 c3 d4 e5 f6.
TOKENS, PARENTS = [1, 2, 3, 4, 5, 6], [-1, -1, 0, 0, 2, 1]
V = 10


def _buffers():
    return derive_buffers(tree_from_parents(TOKENS, PARENTS), root_token=0)


def _logits_for(target_tokens: list[int]) -> torch.Tensor:
    """Target logits [N+1, V] whose row-wise argmax is ``target_tokens`` (vLLM's create_logits_tensor)."""
    logits = torch.randn(len(target_tokens), V, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(target_tokens)), target_tokens] = 100.0
    return logits


@pytest.mark.parametrize("target, rows, bonus", [
    # mismatch at the root; row 6 (f) matches its parent b's target but b is not accepted
    ([9, 3, 6, 5, 7, 7, 7], [0], 9),
    # mismatch mid-path: r -> a -> c, then c's target 8 is not e(5)
    ([1, 3, 6, 8, 7, 7, 7], [0, 1, 3], 8),
    # full accept down the deepest path: bonus after e
    ([1, 3, 6, 5, 7, 2, 7], [0, 1, 3, 5], 2),
    # the two paths below a share the prefix r, a: target 4 takes the d branch, not c
    ([1, 4, 6, 5, 8, 7, 7], [0, 1, 4], 8),
    # the other root branch, fully accepted: r -> b -> f
    ([2, 3, 6, 5, 7, 7, 0], [0, 2, 6], 0),
])
def test_walk_literal(target: list[int], rows: list[int], bonus: int) -> None:
    tokens = sample_target_tokens(_logits_for(target), temperature=0.0)
    assert tokens.tolist() == target
    res = walk(_buffers(), tokens)
    assert res.accepted_rows.tolist() == rows
    assert res.bonus_token == bonus
    assert res.accept_length == len(rows) - 1


def test_walk_on_empty_tree_emits_the_root_target() -> None:
    res = walk(derive_buffers(DraftTree.empty(), 5), torch.tensor([7]))
    assert res.accepted_rows.tolist() == [0] and res.bonus_token == 7 and res.accept_length == 0


def _walk_vectorised(buffers, target_tokens: torch.Tensor):
    """walk's tensor path, forced (on CPU it runs for more than SMALL_WALK rows only)."""
    import services.tree.accept as accept

    saved, accept.SMALL_WALK = accept.SMALL_WALK, 0
    try:
        return walk(buffers, target_tokens)
    finally:
        accept.SMALL_WALK = saved


@pytest.mark.parametrize("seed", range(4))
def test_small_walk_equals_the_vectorised_walk(seed: int) -> None:
    """The list-based walk (up to SMALL_WALK rows) accepts the rows and bonus of the tensor walk,
    on random trees whose targets follow a random path part of the way (partial and full accepts)."""
    gen = torch.Generator().manual_seed(seed)
    for n in (0, 1, 2, 3, 5, 8, SMALL_WALK - 1):
        parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]
        tokens = list(range(10, 10 + n))  # distinct: siblings never share a token
        buf = derive_buffers(tree_from_parents(tokens, parents), 5)
        for _ in range(8):
            target = torch.randint(0, 10 + n, (n + 1,), generator=gen)
            row = 0
            for _ in range(int(torch.randint(0, 4, (1,), generator=gen))):  # follow children of row
                kids = [i + 1 for i, p in enumerate(parents) if p + 1 == row]
                if not kids:
                    break
                child = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
                target[row] = tokens[child - 1]
                row = child
            a, b = _walk_small(buf, target), _walk_vectorised(buf, target)
            assert a.accepted_rows.tolist() == b.accepted_rows.tolist() and a.bonus_token == b.bonus_token
            assert a.accepted_rows.dtype == b.accepted_rows.dtype == torch.long


# ---------------------------------------------------------------- sampled walk is lossless

# r -> a(0) -> {c(2), d(3)} ; r -> b(1) -> e(0).  Rows: r0 a1 b2 c3 d4 e5.  V = 6.
S_TOKENS, S_PARENTS = [0, 1, 2, 3, 0], [-1, -1, 0, 0, 1]
S_PATHS = {0: (), 1: (0,), 2: (1,), 3: (0, 2), 4: (0, 3), 5: (1, 0)}  # row -> token path
S_PROBS = torch.tensor([
    [0.30, 0.25, 0.15, 0.10, 0.10, 0.10],  # r
    [0.05, 0.10, 0.30, 0.25, 0.20, 0.10],  # a
    [0.40, 0.05, 0.10, 0.15, 0.20, 0.10],  # b
    [0.10, 0.10, 0.10, 0.10, 0.10, 0.50],  # c
    [0.25, 0.25, 0.05, 0.05, 0.20, 0.20],  # d
    [0.05, 0.35, 0.05, 0.35, 0.10, 0.10],  # e
])


def _sampled_emissions(n: int, seed: int) -> list[list[int]]:
    buffers = derive_buffers(tree_from_parents(S_TOKENS, S_PARENTS), root_token=4)
    logits = S_PROBS.log() + 0.7  # any shift: softmax(logits / 1) == S_PROBS
    gen = torch.Generator().manual_seed(seed)
    samples = sample_target_tokens(logits.repeat(n, 1), temperature=1.0, generator=gen).view(n, -1)
    out = []
    for row_tokens in samples:
        res = walk(buffers, row_tokens)
        out.append(buffers.input_ids[res.accepted_rows[1:]].tolist() + [res.bonus_token])
    return out


def test_sampled_walk_emits_the_target_distribution() -> None:
    emissions = _sampled_emissions(n=20000, seed=1234)
    for row, path in S_PATHS.items():
        # the token emitted right after `path` must follow the target distribution at that row
        nxt = [e[len(path)] for e in emissions if len(e) > len(path) and tuple(e[:len(path)]) == path]
        assert len(nxt) > 1000
        assert_follows(nxt, S_PROBS[row])
        assert_differs(nxt, S_PROBS[(row + 1) % len(S_PROBS)])  # the test can tell rows apart
    first = [e[0] for e in emissions]
    assert_follows(first, S_PROBS[0])


def test_sampled_walk_is_deterministic_when_seeded() -> None:
    assert _sampled_emissions(300, seed=7) == _sampled_emissions(300, seed=7)
    assert _sampled_emissions(300, seed=7) != _sampled_emissions(300, seed=8)


def test_target_probs_temperature_top_k_top_p_literal() -> None:
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])  # sorted: 1 (.5), 3 (.3), 0 (.15), 2 (.05)
    logits = probs.log()
    assert torch.allclose(target_probs(logits, 1.0), probs)
    assert torch.allclose(target_probs(logits, 2.0), torch.softmax(logits / 2.0, -1))
    assert torch.allclose(target_probs(logits, 1.0, top_k=2), torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    assert torch.allclose(target_probs(logits, 1.0, top_k=1), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    # top_p keeps the smallest prefix (by probability) whose mass reaches top_p
    assert torch.allclose(target_probs(logits, 1.0, top_p=0.4), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert torch.allclose(target_probs(logits, 1.0, top_p=0.6), torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    assert torch.allclose(target_probs(logits, 1.0, top_p=0.9), torch.tensor([[0.15, 0.5, 0.0, 0.3]]) / 0.95)
    assert torch.allclose(target_probs(logits, 1.0, top_p=0.9, top_k=2),
                          torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    two_rows = target_probs(torch.cat([logits, logits.flip(-1)]), 1.0, top_k=2)  # row-wise
    assert torch.allclose(two_rows[1], torch.tensor([0.375, 0.0, 0.625, 0.0]))


def test_sample_target_tokens_respects_top_k() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(3)
    tokens = sample_target_tokens(logits, 1.0, top_k=2, generator=gen)
    assert set(tokens.tolist()) == {1, 3}
    assert sample_target_tokens(logits[:3], 0.0).tolist() == [1, 1, 1]


# ---------------------------------------------------------------- rejection sampling on a chain

Q = torch.tensor([[0.45, 0.30, 0.15, 0.10, 0.00],  # q never proposes token 4 at slot 0
                  [0.20, 0.20, 0.20, 0.20, 0.20]])
P = torch.tensor([[0.10, 0.20, 0.30, 0.20, 0.20],
                  [0.50, 0.05, 0.05, 0.20, 0.20],
                  [0.20, 0.30, 0.10, 0.10, 0.30]])


def _rejection_emissions(depth: int, n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    q, p = Q[:depth], P[:depth + 1]
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).T  # [n, D], x_i ~ q_i
    out = []
    for draft in drafts:
        accepted, nxt = rejection_accept_chain(draft, q, p, generator=gen)
        out.append(draft[:accepted].tolist() + [nxt])
    return out


@pytest.mark.parametrize("depth, n", [(1, 12000), (2, 16000)])
def test_rejection_sampling_preserves_the_target(depth: int, n: int) -> None:
    emissions = _rejection_emissions(depth, n, seed=99)
    for pos in range(depth + 1):
        # the target is position-wise here, so the token at position `pos` follows P[pos]
        tokens = [e[pos] for e in emissions if len(e) > pos]
        assert len(tokens) > 1000
        assert_follows(tokens, P[pos])
    assert_differs([e[0] for e in emissions], Q[0])  # q really differs from p
    assert_differs(torch.multinomial(Q[0], 5000, replacement=True, generator=torch.Generator().manual_seed(0)), P[0])
    assert len({len(e) for e in emissions}) == depth + 1  # every accept length occurs


def test_rejection_sampling_is_deterministic_when_seeded() -> None:
    assert _rejection_emissions(2, 200, seed=5) == _rejection_emissions(2, 200, seed=5)
    assert _rejection_emissions(2, 200, seed=5) != _rejection_emissions(2, 200, seed=6)


def test_rejection_greedy_one_hot_literal() -> None:
    one_hot = torch.eye(5)
    p = one_hot[[2, 4, 1]]  # target argmaxes 2, 4, then 1
    assert rejection_accept_chain(torch.tensor([2, 4]), one_hot[[2, 4]], p) == (2, 1)
    assert rejection_accept_chain(torch.tensor([2, 3]), one_hot[[2, 3]], p) == (1, 4)
    assert rejection_accept_chain(torch.tensor([0, 4]), one_hot[[0, 4]], p) == (0, 2)
