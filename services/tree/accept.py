"""Acceptance: the tree walk (greedy or one target sample per node) and chain rejection sampling.

Sources: ``follow_verified_tree`` (DART/DDT, docs/algorithms.md §5) and standard speculative rejection
sampling (DeepSpec ``utils/sampling.py``, docs/algorithms.md §3).

Sampling at T > 0 is counter-based: the token at absolute position ``t`` is drawn by inverse CDF
with the uniform ``position_uniforms(seed, t)``, a hash of ``(seed, t)``. Every verify row is
sampled with the uniform of the position it predicts (``start + depth + 1``) and :func:`walk`
accepts a draft node iff it equals its parent row's sample ("typical acceptance by exact match").
The accepted path is then, token for token, what plain decoding with the same seed emits: each
emitted token is the inverse-CDF sample of the target distribution given the emitted prefix, with a
uniform no other position uses. So the walk is lossless (the tokens are plain target samples), and a
seeded request's tokens depend on (prompt, sampling params, seed) only, never on the drafted tree,
the verify rows per round, the method or the batch. Sibling rows share their depth's uniform; only
one of them can lie on the accepted path, so no emitted token reuses a uniform.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from services.tree.draft_tree import VerifyBuffers


@dataclass(frozen=True)
class AcceptResult:
    """Outcome of one verify round.

    Attributes:
        accepted_rows: ``[L]`` long verify rows of the accepted path, root (row 0) first.
        bonus_token: the target's token after the last accepted row.
    """

    accepted_rows: Tensor
    bonus_token: int

    @property
    def accept_length(self) -> int:
        """Accepted draft tokens (bonus and root excluded)."""
        return int(self.accepted_rows.numel()) - 1


def sample_target_tokens(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                         generator: torch.Generator | None = None, uniforms: Tensor | None = None) -> Tensor:
    """One target token per verify row: argmax at ``temperature == 0``, else one sample per row.

    Args:
        logits: ``[R, V]`` target logits (R = N + 1 verify rows).
        temperature: >= 0; top_p in (0, 1]; top_k >= 0 (0 = off).
        generator: RNG for rows without ``uniforms`` (independent draws).
        uniforms: ``[R]`` float in [0, 1), row i's inverse-CDF uniform (:func:`position_uniforms`);
            when given, the samples are a deterministic function of the logits and these.
    Returns:
        ``[R]`` long token ids.
    """
    assert logits.ndim == 2, "logits must be [R, V]"
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    probs = target_probs(logits, temperature, top_p, top_k)
    return sample_rows(probs, generator, uniforms)


def sample_rows(probs: Tensor, generator: torch.Generator | None = None, uniforms: Tensor | None = None) -> Tensor:
    """One sample per row of ``probs [R, V]`` by inverse-CDF (cumsum + searchsorted).

    Same distribution as ``torch.multinomial(probs, 1)`` at a fraction of its cost on CPU (one
    uniform per row instead of a per-row alias/sort pass); zero-probability tokens are never drawn.
    The uniforms come from ``uniforms [R]`` (values in [0, 1)) when given, else from ``generator``.
    """
    cdf = probs.float().cumsum(dim=-1)  # [R, V]
    total = cdf[:, -1:]  # [R, 1]
    if uniforms is None:
        uniforms = torch.rand(probs.shape[0], generator=generator, device=probs.device)
    assert uniforms.shape == (probs.shape[0],), "uniforms must be [R]"
    u = uniforms.to(device=probs.device, dtype=torch.float32)[:, None] * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # strictly below the last step
    idx = torch.searchsorted(cdf, u, right=True).squeeze(1)
    return idx.clamp(max=probs.shape[-1] - 1)


_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit ints that scrambles every bit."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_uniforms(seed: int, positions: Tensor | list[int]) -> Tensor:
    """Counter-based uniforms: entry i is a function of ``(seed, positions[i])`` alone.

    The ``t``-th output of a SplitMix64 stream keyed by the mixed seed, reduced to 24 bits (exact in
    float32, so the value is the same on every device and never rounds up to 1).

    Args:
        seed: any int (taken modulo 2**64, so the API's signed 64-bit range maps one to one).
        positions: ``[R]`` long absolute token positions (>= 0), or the same as a list of ints (then
            no tensor value is read: the engine's device rounds pass host lists).
    Returns:
        ``[R]`` float32 on the CPU, values in ``[0, 1)`` in steps of 2**-24.
    """
    if isinstance(positions, Tensor):
        assert positions.ndim == 1, "positions must be [R]"
        positions = positions.cpu().tolist()
    key = _mix64((seed + _GOLDEN64) & _MASK64)
    memo: dict[int, float] = {}
    for t in positions:
        if t not in memo:
            memo[t] = (_mix64((key + (int(t) + 1) * _GOLDEN64) & _MASK64) >> 40) * 2.0**-24
    return torch.tensor([memo[t] for t in positions], dtype=torch.float32)


# the smallest positive normal float32: a temperature below it rounds to 0 (or a subnormal) in the
# float32 division, which made the max-shifted row's top entry 0 / 0 = NaN and sampled the last token id
_TINY_T = torch.finfo(torch.float32).tiny


def scale_by_temperature(logits: Tensor, temperature: float) -> Tensor:
    """``(logits - rowmax) / T`` in float32 (the max shift first: no inf at tiny T), with ``T`` at
    least the smallest normal float32 (any smaller positive T is the same one-hot distribution,
    and rounded to 0 it gave NaN rows).

    Args:
        logits: ``[R, V]``; temperature: ``T > 0``.
    Returns:
        ``[R, V]`` float32, each row's maximum 0.
    """
    x = logits.float()
    return (x - x.max(dim=-1, keepdim=True).values) / max(float(temperature), _TINY_T)


def target_probs(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """The distribution each row is sampled from: softmax(logits / T) restricted by top-k, top-p.

    Returns:
        ``[R, V]`` float32 probabilities, rows sum to 1.
    """
    x = scale_by_temperature(logits, temperature)
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        drop = (cum - torch.softmax(sorted_x, dim=-1)) >= top_p  # keep the smallest prefix reaching top_p
        drop[..., 0] = False  # and the most likely token always (a top_p that is 0 in float32 dropped all)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sorted_x)
    return torch.softmax(x, dim=-1)


def walk(buffers: VerifyBuffers, target_tokens: Tensor) -> AcceptResult:
    """Follow the target's tokens down the tree: the longest path whose every node matches.

    A draft row is *matched* when its token equals the target token of its parent row; it is
    accepted when it and all its ancestors are matched. Siblings carry distinct tokens, so the
    accepted rows form one root-to-node path. Vectorised over rows (no per-node Python loop).

    Args:
        buffers: the round's :class:`VerifyBuffers`.
        target_tokens: ``[N+1]`` long, the target's token at every verify row (argmax or sample).
    Returns:
        :class:`AcceptResult` with the accepted rows (root first) and the bonus token.
    """
    ids = buffers.input_ids
    assert target_tokens.shape == ids.shape, "target_tokens must be [N+1]"
    if ids.numel() <= SMALL_WALK and ids.device.type == "cpu" and target_tokens.device.type == "cpu":
        return _walk_small(buffers, target_tokens)
    parent_tok = target_tokens[buffers.parent_rows.clamp(min=0)]
    matched = ids == parent_tok
    matched[0] = True
    ok = ~(buffers.tree_mask & ~matched[None, :]).any(dim=1)  # [N+1]
    rows = ok.nonzero().flatten()  # ascending rows = depth order along one path
    return AcceptResult(rows, int(target_tokens[rows[-1]]))


SMALL_WALK = 33  # verify rows up to which walk runs on Python lists (CPU tensors)


def _walk_small(buffers: VerifyBuffers, target_tokens: Tensor) -> AcceptResult:
    """:func:`walk` on Python lists (rows are in topological order, so a row is accepted iff its
    parent row is and its token is the parent row's target token): the same result without the
    mask's tensor ops (~10 us instead of ~80 us right after a step's forward)."""
    ids, parents, targets = buffers.input_ids.tolist(), buffers.parent_rows.tolist(), target_tokens.tolist()
    ok = [True] + [False] * (len(ids) - 1)
    rows = [0]
    for i in range(1, len(ids)):
        p = parents[i]
        if ok[p] and ids[i] == targets[p]:
            ok[i] = True
            rows.append(i)
    return AcceptResult(torch.tensor(rows, dtype=torch.long), int(targets[rows[-1]]))


def rejection_accept_chain(draft_tokens: Tensor, draft_probs: Tensor, target_probs_: Tensor,
                           generator: torch.Generator | None = None) -> tuple[int, int]:
    """Classic speculative rejection sampling on a chain drafted by *sampling* from ``q``.

    Accept draft ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``; at the first rejection
    emit a sample of the residual ``max(p_i - q_i, 0)`` (normalised); if all are accepted, emit a
    sample of ``p_D``. The emitted tokens are distributed exactly as the target's.

    Args:
        draft_tokens: ``[D]`` long; draft_probs: ``[D, V]`` q; target_probs_: ``[D+1, V]`` p.
    Returns:
        ``(num_accepted, next_token)``.
    """
    d = draft_tokens.numel()
    assert draft_probs.shape[0] == d and target_probs_.shape[0] == d + 1, "need q [D, V] and p [D+1, V]"
    u = torch.rand(d, generator=generator, device=draft_probs.device)
    for i in range(d):  # loop over depth
        x = int(draft_tokens[i])
        p, q = float(target_probs_[i, x]), float(draft_probs[i, x])
        if q > 0 and float(u[i]) < min(1.0, p / q):
            continue
        residual = (target_probs_[i] - draft_probs[i]).clamp(min=0)
        if float(residual.sum()) <= 0:
            residual = target_probs_[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return d, int(torch.multinomial(target_probs_[d], 1, generator=generator))
