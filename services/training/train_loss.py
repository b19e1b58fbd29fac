"""The loss of ``dartree train-drafter``: one drafter, the frozen target pieces it borrows, and the
joint loss of one sequence's anchors (docs/algorithms.md §1.3, §2.1, §3)."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from services.drafter.model import DFlashDrafter


class Trainer:
    """One drafter, the frozen target pieces it borrows, and the loss of one sequence's anchors."""

    def __init__(self, drafter: DFlashDrafter, embed_w: torch.Tensor, head_w: torch.Tensor, args):
        """``embed_w [V, H]`` and ``head_w [V, H]`` are the target's (full vocabulary); a drafter with a
        reduced draft vocabulary trains on the ``head_w`` rows its ``d2t`` selects, and labels outside
        its vocabulary are ignored (it can never draft them)."""
        self.m, self.embed_w, self.a = drafter, embed_w, args
        c = drafter.config
        d2t = drafter.draft_to_target()
        self.label_map = None
        if d2t is not None:
            head_w = head_w[d2t]
            self.label_map = torch.full((c.vocab_size,), -100, dtype=torch.long)
            self.label_map[d2t] = torch.arange(d2t.numel())
        self.head_w = head_w
        self.bs = c.block_size
        decay = args.row_decay if not drafter.has_markov or args.dspark_gamma <= 0 else args.dspark_gamma
        self.row_w = torch.exp(-torch.arange(self.bs).float() / decay)

    def batch(self, row: dict, n_anchor: int, rng: random.Random):
        """Sample anchors of one sequence.

        Returns ``(anchors [A], block ids [A, Q], labels [A, Q] (-100 = none), realised [A, Q])``, or None
        when the sequence has no anchor or no anchor has a label (a loss of 0 / 0):
        row j of the block anchored at a is labelled with the target's greedy token after
        ``ids[: a + j + 1]`` (shift-label); ``realised`` are the tokens the GRU consumes.
        """
        ids, labels_all = row["ids"], row["labels"]
        n = ids.numel()
        lo, hi = max(row["prompt_len"] - 1, 1), n - 2
        if hi < lo:
            return None
        anchors = torch.tensor(sorted(rng.sample(range(lo, hi + 1), min(n_anchor, hi - lo + 1))))
        pad = torch.full((self.bs,), -100, dtype=torch.long)
        idx = anchors[:, None] + torch.arange(self.bs)[None, :]  # [A, Q]
        labels = torch.cat([labels_all.long(), pad])[idx]
        if self.label_map is not None:  # target ids -> draft ids (-100: not in the draft vocabulary)
            labels = torch.where(labels >= 0, self.label_map[labels.clamp(min=0)], labels)
        if not bool((labels >= 0).any()):  # nothing to learn (e.g. every label outside the draft vocabulary):
            return None                    # the loss would be 0 / 0 = NaN
        realised = torch.cat([ids.long(), pad])[idx]  # realised[:, 0] = anchor token
        block = torch.full_like(idx, self.m.config.mask_token_id)
        block[:, 0] = realised[:, 0]
        return anchors, block, labels, realised

    def loss(self, row: dict, lam: float, rng: random.Random):
        """Joint Domino loss of one sequence; returns ``(loss, stats)`` or None when it has no anchor."""
        b = self.batch(row, self.a.anchors, rng)
        if b is None:
            return None
        anchors, block, labels, realised = b
        m = self.m
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.a.bf16):
            hd = self._block_hidden(row["feats"], anchors, block)  # [A, Q, H]
            base = hd @ self.head_w.T  # [A, Q, V]
            w = self.row_w[None, :].expand_as(labels) * (labels >= 0)
            loss_base = _weighted_ce(base, labels, w)
            stats = {"acc_base": self._chain_tau(base, labels)}
            if m.has_markov:
                loss, stats["acc_dspark"] = self._dspark_loss(base, labels, realised, w)
            elif m.has_head:
                loss_fin, stats["acc_domino"] = self._domino_loss(hd, base, labels, realised, w)
                loss = (1 - lam) * loss_fin + lam * loss_base
            else:
                loss = loss_base
        stats["loss"] = float(loss.detach())
        return loss, stats

    def _block_hidden(self, feats: torch.Tensor, anchors: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """Backbone output ``[A, Q, H]`` of the blocks ``block [A, Q]`` anchored at ``anchors [A]``, each
        attending to the target features ``feats [T, F]`` of the positions before its anchor."""
        m = self.m
        t = int(anchors.max())  # context never needs positions >= the last anchor
        pos_ctx = torch.arange(t)
        ctx_kv = m.context_kv(feats[:t].float()[None], pos_ctx)
        A = anchors.numel()
        ctx_kv = [(k.expand(A, -1, -1, -1), v.expand(A, -1, -1, -1)) for k, v in ctx_kv]
        ctx_mask = (pos_ctx[None, None, :] < anchors[:, None, None]).expand(A, self.bs, t)
        pos_blk = anchors[:, None] + torch.arange(self.bs)[None, :]  # [A, Q]
        emb = F.embedding(block, self.embed_w)  # [A, Q, H]
        return m.block_forward(emb, pos_blk, ctx_kv, ctx_mask)  # [A, Q, H], positions per anchor

    def _dspark_loss(self, base: torch.Tensor, labels: torch.Tensor, realised: torch.Tensor,
                     w: torch.Tensor) -> tuple[torch.Tensor, float]:
        """DSpark loss and chain acceptance of base logits ``[A, Q, V]`` plus the Markov head's bias.

        docs/algorithms.md §3: logits_k = base_k + W2 . W1[x_{a+k}] (teacher-forced prev tokens);
        loss = ce * CE + l1 * L1, where L1 = |softmax - onehot(label)|_1 = 2 (1 - p_label) (the labels
        are the target's greedy tokens, so its distribution is taken as one-hot), rows weighted ``w``
        = exp(-k / gamma) (the DSpark recipe: gamma 4, ce 0.1, l1 0.9).
        """
        final = base + self.m.markov_head.bias(realised.clamp(min=0))
        logp = torch.log_softmax(final.float(), dim=-1)
        nll = -logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        l1 = 2.0 * (1.0 - nll.neg().exp())
        per = self.a.dspark_ce * nll + self.a.dspark_l1 * l1
        return (per * w).sum() / w.sum(), self._chain_tau(final, labels)

    def _domino_loss(self, hd: torch.Tensor, base: torch.Tensor, labels: torch.Tensor, realised: torch.Tensor,
                     w: torch.Tensor) -> tuple[torch.Tensor, float]:
        """CE and chain acceptance of the Domino-corrected logits: ``base [A, Q, V]`` plus the correction
        of the backbone output ``hd [A, Q, H]`` and the GRU over the realised tokens ``[A, Q]`` (none on
        the first ``pure_draft_prefix_len`` rows)."""
        m = self.m
        gru_in = F.embedding(realised.clamp(min=0), self.embed_w)  # [A, Q, H]
        states, _ = m.prefix_gru(gru_in)  # state i consumed [anchor, y_1 .. y_i]
        corr = m.correction(hd, states)
        corr[:, : m.config.pure_draft_prefix_len] = 0
        final = base + corr
        return _weighted_ce(final, labels, w), self._chain_tau(final, labels)

    @staticmethod
    @torch.no_grad()
    def _chain_tau(logits: torch.Tensor, labels: torch.Tensor) -> float:
        """Mean 1 + leading argmax matches per block (teacher-forced chain acceptance)."""
        ok = (logits.argmax(-1) == labels) & (labels >= 0)
        return float((ok.int().cumprod(1).sum(1) + 1).float().mean())


def _weighted_ce(logits: torch.Tensor, labels: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Row-weighted mean cross-entropy of ``logits [A, Q, V]`` against ``labels [A, Q]`` (-100 = none;
    its weight in ``w [A, Q]`` is 0)."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
    return (ce.view_as(labels) * w).sum() / w.sum()
