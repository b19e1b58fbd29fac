"""The ``TreeScorer`` protocol through which a correction head re-ranks tree candidates.

A scorer carries a per-node state (a GRU state for Domino, the previous token's low-rank
embedding for a DSpark-style Markov head). The tree builders only ever call these three methods,
so the tree code never sees a model (docs/design.md "Pure tree algorithms").
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class TreeScorer(Protocol):
    """Correction head seen by the tree builders.

    Methods:
        root_state(root_token) -> ``[1, S]``: state after consuming the root token.
        score(slot, parent_states [P, S], cand_ids [M] | None, cand_vals [M] or [V]) -> ``[P, M]``:
            corrected logits of the candidates at draft slot ``slot`` (0-based; slot ``d - 1``
            predicts depth ``d``) for each parent. ``cand_vals`` are the base logits of the
            candidates; ``cand_ids = None`` means the full vocabulary (chain rollouts).
        advance(parent_states [C, S], tokens [C]) -> ``[C, S]``: child states after consuming
            each child's token.
    """

    def root_state(self, root_token: int) -> Tensor: ...

    def score(self, slot: int, parent_states: Tensor, cand_ids: Tensor | None, cand_vals: Tensor) -> Tensor: ...

    def advance(self, parent_states: Tensor, tokens: Tensor) -> Tensor: ...


class TableScorer:
    """Toy scorer for tests: the state is the path's last token; the bias is a table lookup.

    Corrected logit of candidate ``c`` under a parent whose last token is ``t`` at slot ``s`` is
    ``cand_vals[c] + table[s, t, c]``.

    Args:
        table: ``[D, V, V]`` float bias table.
    """

    def __init__(self, table: Tensor):
        assert table.ndim == 3 and table.shape[1] == table.shape[2], "table must be [D, V, V]"
        self.table = table.float()

    def root_state(self, root_token: int) -> Tensor:
        return torch.tensor([[float(root_token)]])

    def score(self, slot: int, parent_states: Tensor, cand_ids: Tensor | None, cand_vals: Tensor) -> Tensor:
        last = parent_states[:, 0].long()  # [P]
        bias = self.table[slot][last]  # [P, V]
        if cand_ids is not None:
            bias = bias[:, cand_ids]  # [P, M]
        return cand_vals.float()[None, :] + bias

    def advance(self, parent_states: Tensor, tokens: Tensor) -> Tensor:
        return tokens.float()[:, None]


class MarkovScorer:
    """DSpark-style stateless bigram head: bias ``= W2[c] . W1[prev_token]`` (docs/algorithms.md §3).

    Args:
        w1: ``[V, r]`` embedding of the previous token (``markov_head.markov_w1.weight``).
        w2: ``[V, r]`` output projection (``markov_head.markov_w2.weight``).
    """

    def __init__(self, w1: Tensor, w2: Tensor):
        assert w1.ndim == 2 and w1.shape == w2.shape, "w1 and w2 must both be [V, r]"
        self.w1, self.w2 = w1, w2

    def root_state(self, root_token: int) -> Tensor:
        return self.w1[root_token][None, :]

    def score(self, slot: int, parent_states: Tensor, cand_ids: Tensor | None, cand_vals: Tensor) -> Tensor:
        w2 = self.w2 if cand_ids is None else self.w2[cand_ids]  # [M, r]
        return cand_vals.float()[None, :] + (parent_states @ w2.T).float()

    def advance(self, parent_states: Tensor, tokens: Tensor) -> Tensor:
        return self.w1[tokens]
