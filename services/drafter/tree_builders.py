"""The tree each drafting method builds from one round's drafter rows, and the Domino scorer.

:data:`TREE_BUILDERS` maps every drafting :class:`~services.spec.Method` to its builder over the
rows of one block forward (``hd [D, H]`` drafter hidden rows, ``base [D, N]`` base logits): the
DFlash argmax chain, DDTree, the DSpark Markov rollout, the Domino rollout / DDTree / seqheap /
DARTree. The builders themselves are the pure functions of :mod:`services.tree`; this module
binds them to a :class:`~services.drafter.service.DrafterService`'s heads (docs/algorithms.md
§2.2, §2.3, §3, §4). Kept apart from the service, which owns the drafter and its contexts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from services.drafter.model import DFlashDrafter
from services.spec import Method
from services.tree import DraftTree, MarkovScorer, chain, chain_rollout, dartree, ddtree, domino_ddtree, seqheap


class DominoScorer:
    """Domino correction head for one round, as a :class:`services.tree.TreeScorer`.

    ``score = cand_vals + SiLU(W_z h_d[slot] + W_s h) . W_out[cand]^T``; states are GRU states
    after ``[root, d_1 .. d_i]`` (docs/algorithms.md §2.3).

    Args:
        drafter: a drafter with a Domino head; embed: target embedding; hd: ``[D, H]`` drafter rows.
        d2t: ``[N]`` target id of each draft id when the drafter drafts over a reduced vocabulary
            (candidate ids are then draft ids; a token is mapped to its target id before the GRU
            embeds it); None = full vocabulary.
    """

    def __init__(self, drafter: DFlashDrafter, embed: torch.nn.Module, hd: Tensor, d2t: Tensor | None = None):
        self.drafter, self.embed, self.d2t, self.hd = drafter, embed, d2t, hd
        self.wz, self.ws, self.wout = drafter.head_split()
        self._z: Tensor | None = None

    @property
    def z(self) -> Tensor:
        """``[D, E]`` = ``hd W_zᵀ``, computed on first use (the same product: a round whose tree
        scores no slot, B = 1 or an early prune, skips it)."""
        if self._z is None:
            self._z = self.hd @ self.wz.T
        return self._z

    def root_state(self, root_token: int) -> Tensor:
        x = self.embed(torch.tensor([root_token], device=self.hd.device)).to(self.hd.dtype)
        return self.drafter.gru_cell(x, None)  # the zero state, without its h @ W_hh product

    def score(self, slot: int, parent_states: Tensor, cand_ids: Tensor | None, cand_vals: Tensor) -> Tensor:
        mid = F.silu(self.z[slot][None, :] + parent_states @ self.ws.T)  # [P, E]
        w = self.wout if cand_ids is None else self.wout[cand_ids]  # [M, E]
        return cand_vals.float()[None, :] + (mid @ w.T).float()

    def advance(self, parent_states: Tensor, tokens: Tensor) -> Tensor:
        if self.d2t is not None:
            tokens = self.d2t[tokens]
        return self.drafter.gru_cell(self.embed(tokens).to(parent_states.dtype), parent_states)


def _markov(svc) -> MarkovScorer:
    """DSpark: bias W2 . W1[prev] on every slot, slot 0's prev = the root (docs/algorithms.md §3)."""
    head = svc.drafter.markov_head
    return MarkovScorer(head.markov_w1.weight, head.markov_w2.weight)


def _domino(svc, hd: Tensor) -> DominoScorer:
    """The Domino correction head over this round's drafter rows ``hd [D, H]``."""
    return DominoScorer(svc.drafter, svc.embed, hd.to(svc.dtype), svc.d2t)


def _chain_of(base: Tensor) -> DraftTree:
    """DFlash: the argmax chain; scores: its path log-probabilities (the goodput policy calibrates them)."""
    toks = torch.argmax(base, dim=-1)
    return chain(toks, _path_scores(base, toks))


def _rollout(base: Tensor, scorer, root: int, prefix: int) -> DraftTree:
    """A chain rolled out slot by slot under ``scorer``."""
    toks, rows = chain_rollout(base, scorer, root, prefix)
    return chain(toks, _path_scores(rows, toks))


def _dartree(svc, knobs, hd: Tensor, base: Tensor, root: int, variant: str) -> DraftTree:
    budget, width, beta, k = knobs.astuple()
    return dartree(base, _domino(svc, hd), root, K=k, W=width, B=budget, beta=beta if variant == "pruned" else 0.0,
                   variant=variant, pure_draft_prefix_len=svc.cfg.pure_draft_prefix_len)


# The tree builder of each drafting method: ``builder(service, knobs, hd [D, H], base [D, V], root) -> DraftTree``
# (knobs: resolved :class:`~services.spec.TreeKnobs`; a method of an existing family is one entry here).
TREE_BUILDERS: dict[Method, Callable[..., DraftTree]] = {
    Method.DFLASH: lambda svc, kn, hd, base, root: _chain_of(base),
    Method.DDTREE: lambda svc, kn, hd, base, root: ddtree(torch.log_softmax(base, dim=-1), kn.budget),
    Method.DSPARK: lambda svc, kn, hd, base, root: _rollout(base, _markov(svc), root, 0),
    Method.DSPARK_DARTREE: lambda svc, kn, hd, base, root: dartree(
        base, _markov(svc), root, K=kn.candidates, W=kn.width, B=kn.budget, beta=kn.depth_bonus, variant="pruned",
        pure_draft_prefix_len=0),
    Method.DOMINO: lambda svc, kn, hd, base, root: _rollout(base, _domino(svc, hd), root,
                                                            svc.cfg.pure_draft_prefix_len),
    Method.DOMINO_DDTREE: lambda svc, kn, hd, base, root: domino_ddtree(
        chain_rollout(base, _domino(svc, hd), root, svc.cfg.pure_draft_prefix_len)[1], kn.budget),
    Method.SEQHEAP: lambda svc, kn, hd, base, root: seqheap(
        base, _domino(svc, hd), root, K=kn.candidates, B=kn.budget, beta=kn.depth_bonus,
        pure_draft_prefix_len=svc.cfg.pure_draft_prefix_len),
    Method.DARTREE_FIXED: lambda svc, kn, hd, base, root: _dartree(svc, kn, hd, base, root, "fixed"),
    Method.DARTREE_PRUNED: lambda svc, kn, hd, base, root: _dartree(svc, kn, hd, base, root, "pruned"),
}


def _path_scores(logits: Tensor, tokens: Tensor) -> Tensor:
    """``[D]`` cumulative log-softmax of ``logits [D, V]`` at a chain's ``tokens [D]``."""
    lp = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens.long().to(logits.device)[:, None])[:, 0]
    return lp.cumsum(0).cpu()
