"""Logit processors applied along each tree path: penalties, logit bias, min_tokens, min_p.

Every verify row of a tree predicts the token after its own root-to-node path, so its distribution
is computed as if that path had been emitted one token at a time: the penalty counts of row ``i``
are the request's counts so far plus the draft tokens on ``i``'s path (ancestors and itself, read
from the tree's ancestor matrix), and ``min_tokens`` looks at the output position row ``i`` predicts.
A tree row therefore gets exactly the logits plain decoding would see at that point, and the walk
(accept.py) stays lossless with every option on. Vectorised over the tree (no per-node loop).

Order (vLLM's sampler): ``min_tokens`` and ``logit_bias`` -> repetition, frequency and presence
penalties (the processed logits; greedy takes their argmax) -> temperature -> ``min_p`` -> top-k
-> top-p (the sampled distribution). Semantics follow vLLM / OpenAI:

- ``repetition_penalty`` r > 0: a token seen in the prompt or the output has its logit divided by r
  when positive, multiplied by r otherwise.
- ``frequency_penalty`` f and ``presence_penalty`` p in [-2, 2]: ``logit -= f * count + p * (count > 0)``
  over the output only.
- ``logit_bias``: added to the logits of the given token ids.
- ``min_tokens`` m: while fewer than m tokens were emitted, EOS (unless ignored) and the stop token
  ids get ``-inf``, except in a row where nothing else is allowed (a grammar that is complete, or
  whose only continuation is a stop token): there completion wins and the request stops early.
- ``min_p`` in [0, 1]: after temperature, tokens whose probability is below ``min_p`` times the
  most likely token's probability are removed.

Shapes: R verify rows, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from services.tree.accept import sample_rows, scale_by_temperature, target_probs


@dataclass(frozen=True)
class LogitOptions:
    """One request's logit processors (the defaults change nothing).

    Attributes:
        presence_penalty, frequency_penalty: over output tokens; repetition_penalty: over prompt + output.
        logit_bias: ``(token_id, bias)`` pairs.
        min_tokens: output tokens before EOS / stop ids may be sampled.
        terminator_ids: the ids ``min_tokens`` masks (EOS unless ignored, plus the stop token ids).
        min_p: probability floor relative to the most likely token (0 = off).
    """

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    terminator_ids: tuple[int, ...] = ()
    min_p: float = 0.0

    @property
    def needs_counts(self) -> bool:
        """Whether the output token counts are read (a penalty is on)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def filters(self) -> bool:
        """Whether a filter after temperature is on (:func:`sample_probs`: ``min_p``)."""
        return self.min_p > 0

    @property
    def changes_logits(self) -> bool:
        """Whether :func:`process_logits` changes anything."""
        return self.needs_counts or bool(self.logit_bias) or (self.min_tokens > 0 and bool(self.terminator_ids))


def token_counts(token_ids: list[int] | Tensor, vocab_size: int, device=None) -> Tensor:
    """``[V]`` float32 occurrences of each id in ``token_ids``."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=device).flatten()
    return torch.zeros(vocab_size, dtype=torch.float32, device=ids.device).index_add_(
        0, ids, torch.ones(ids.numel(), dtype=torch.float32, device=ids.device))


def path_counts(output_counts: Tensor, input_ids: Tensor, tree_mask: Tensor) -> Tensor:
    """Per-row output counts of a tree: the committed counts plus the row's own path's draft tokens.

    Args:
        output_counts: ``[V]`` float counts of the tokens emitted so far (the root token included).
        input_ids: ``[R]`` long verify-row tokens (row 0 = the root, already counted).
        tree_mask: ``[R, R]`` bool, ``tree_mask[i, j]`` = row ``j`` is an ancestor-or-self of row ``i``.
    Returns:
        ``[R, V]`` float32, row ``i`` = ``output_counts`` + one per draft token on the path to ``i``.
    """
    assert output_counts.ndim == 1 and input_ids.ndim == 1, "need output_counts [V] and input_ids [R]"
    r = input_ids.shape[0]
    assert tree_mask.shape == (r, r), "tree_mask must be [R, R]"
    dev = output_counts.device
    counts = output_counts.float()[None, :].expand(r, -1).clone()  # [R, V]
    # root column skipped (already counted); the nonzero runs where the mask is (host-built: no device sync)
    rows, cols = (t.to(dev) for t in tree_mask[:, 1:].nonzero(as_tuple=True))
    toks = input_ids.to(dev)[1:][cols]
    counts.index_put_((rows, toks), torch.ones(rows.numel(), dtype=counts.dtype, device=dev), accumulate=True)
    return counts


def process_logits(logits: Tensor, opts: LogitOptions, counts: Tensor | None = None,
                   prompt_mask: Tensor | None = None, output_index: Tensor | None = None) -> Tensor:
    """``min_tokens``, ``logit_bias``, then the penalties (greedy takes the argmax of the result).

    Args:
        logits: ``[R, V]`` raw target logits.
        opts: the request's :class:`LogitOptions`.
        counts: ``[R, V]`` output counts per row (:func:`path_counts`); needed when a penalty is on.
        prompt_mask: ``[V]`` bool, tokens of the prompt; needed with ``repetition_penalty``.
        output_index: ``[R]`` long, the output position each row predicts (0 = the first generated
            token); needed with ``min_tokens``.
    Returns:
        ``[R, V]`` float32 processed logits (a new tensor).
    """
    assert logits.ndim == 2, "logits must be [R, V]"
    x = logits.float().clone()
    if opts.min_tokens > 0 and opts.terminator_ids:
        assert output_index is not None and output_index.shape == (x.shape[0],), "output_index must be [R]"
        early = output_index.to(x.device) < opts.min_tokens  # [R]
        ids = torch.tensor(opts.terminator_ids, dtype=torch.long, device=x.device)
        block = torch.zeros_like(x, dtype=torch.bool)
        block[:, ids] = True
        block &= early[:, None]
        blocked = x.masked_fill(block, float("-inf"))
        done = (blocked == float("-inf")).all(dim=-1, keepdim=True)  # [R, 1] only terminators were allowed
        x = torch.where(done, x, blocked)
    if opts.logit_bias:
        ids = torch.tensor([t for t, _ in opts.logit_bias], dtype=torch.long, device=x.device)
        vals = torch.tensor([b for _, b in opts.logit_bias], dtype=torch.float32, device=x.device)
        x[:, ids] += vals
    if opts.needs_counts:
        assert counts is not None and counts.shape == x.shape, "counts must be [R, V]"
        counts = counts.to(x.device)
        # The penalties change only columns seen in some row's output (or, with repetition_penalty, in
        # the prompt): they are applied to those K columns alone ([R, K] instead of several [R, V] passes).
        touched = counts.amax(dim=0) > 0  # [V]
        if opts.repetition_penalty != 1:
            assert prompt_mask is not None and prompt_mask.shape == (x.shape[1],), "prompt_mask must be [V]"
            prompt_mask = prompt_mask.to(x.device)
            touched = touched | prompt_mask
        cols = touched.nonzero().squeeze(1)  # [K]
        sub, cnt = x[:, cols], counts[:, cols]  # [R, K]
        seen = cnt > 0
        if opts.repetition_penalty != 1:
            rep = seen | prompt_mask[cols][None, :]
            r = opts.repetition_penalty
            sub = torch.where(rep, torch.where(sub > 0, sub / r, sub * r), sub)
        if opts.frequency_penalty != 0:
            sub = sub - opts.frequency_penalty * cnt
        if opts.presence_penalty != 0:
            sub = sub - opts.presence_penalty * seen.float()
        x[:, cols] = sub
    return x


def sample_probs(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                 min_p: float = 0.0) -> Tensor:
    """The distribution sampled at ``temperature > 0``: temperature -> min_p -> top-k -> top-p.

    Args:
        logits: ``[R, V]`` processed logits (:func:`process_logits`).
    Returns:
        ``[R, V]`` float32 probabilities, rows sum to 1.
    """
    assert logits.ndim == 2 and temperature > 0, "logits must be [R, V] and temperature > 0"
    if min_p <= 0:
        return target_probs(logits, temperature, top_p, top_k)
    x = scale_by_temperature(logits, temperature)
    probs = torch.softmax(x, dim=-1)
    x = x.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return target_probs(x, 1.0, top_p, top_k)


def sample_processed(logits: Tensor, temperature: float, top_p: float, top_k: int, opts: LogitOptions,
                     uniforms: Tensor | None = None) -> Tensor:
    """One token per row of processed ``logits [R, V]``: argmax at ``temperature == 0``, else the
    inverse-CDF sample of :func:`sample_probs` (with the filters of ``opts``: ``min_p``) with
    ``uniforms [R]`` (accept.py). Returns ``[R]`` long."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    return sample_rows(sample_probs(logits, temperature, top_p, top_k, opts.min_p), uniforms=uniforms)
