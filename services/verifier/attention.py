"""Grouped-query attention of one request's rows against its slot cache, as batched GEMMs.

The runner's per-request attention (:mod:`services.verifier.runner`) on CPU in bfloat16 / float16,
for every call (``ar`` decode rows, tree verifies, prompt chunks). torch's CPU
``F.scaled_dot_product_attention`` is slow for few query rows (SmolLM2's 9 / 3 heads, head dim 64,
one thread, bfloat16: 1 row against 2,048 KV columns 1.98 ms, more than 9 rows; this module
0.33 ms; 9 rows 1.05 / 0.70 ms; ``benchmarks/bench_decode_attention.py``). Its floor is ~70 us (two
oneDNN bfloat16 GEMMs), so below ~128 columns (1 row) / ~256-512 columns (2-17 rows) SDPA is
faster by up to ~50 us a call; the rule keeps one path anyway (below). The query heads of each KV
head are stacked as the columns of one matrix, so K/V are read in place (no ``repeat_interleave``,
K not transposed)::

    q   [1, Hq, R, Dh] -> [Hkv, G*R, Dh]            (G = Hq / Hkv; row g*R + r = head kv*G + g, row r)
    s^T = k @ q^T                                    [Hkv, L, G*R]  (input dtype)
    p   = softmax(scale * s + bias) in float32       [Hkv, G*R, L]  (bias 0 / -inf), cast back
    o   = sum over 1,024-column blocks c of p_c @ v_c, in float32, cast back -> [1, Hq, R, Dh]

Rows go :data:`ROW_BLOCK` at a time (a prompt chunk's scores stay small). The numerics are those of
transformers' eager attention (scores rounded to the input dtype, softmax in float32, probabilities
in the input dtype), not SDPA's bits (its CPU kernel keeps the scores in float32): about one
bfloat16 ulp of the output apart (max 0.0078 on unit-variance inputs; the q4 SmolLM2-135M's
logits move by up to 0.7, greedy tokens unchanged over 64 at 600 and 2,000 positions).

Invariance (torch 2.13's oneDNN bfloat16 GEMMs on an AVX-512 AMD EPYC, 1 and 2 threads; pinned by
tests/engine/test_decode_attention.py): in bfloat16 each row's output is bitwise the same whether
it is computed alone or among other rows, and whatever masked KV columns follow or sit inside the
call's KV length. SDPA has neither (136 of 765 rows change in their last bits with the row count;
appended masked columns changed 10 of 34 calls at 256-320 columns), and the rule (:func:`use_grouped`) looks at neither the rows nor the length: with the bf16 formats'
row-invariant linears a speculative step's accepted rows are bitwise the rows plain decoding
computes. The ``p @ v`` product goes in fixed 1,024-column blocks because oneDNN reblocks that GEMM
past 1,024 columns (a row read with 1,024 columns, then with 1,088 of which 64 masked, changed).
In float32 no GEMM formulation is row invariant (MKL's sgemm, like SDPA's kernel, changes a row's
last bits with the row count), so float32 keeps SDPA.

Switch: ``DARTREE_GROUPED_ATTENTION=0`` (read at import) or :data:`GROUPED_ATTENTION` = False sends
every call back to SDPA.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

GROUPED_ATTENTION = os.environ.get("DARTREE_GROUPED_ATTENTION", "1") != "0"
GROUPED_DTYPES = (torch.bfloat16, torch.float16)
ROW_BLOCK = 32  # query rows per GEMM pair (a prompt chunk's scores stay cache-sized)
KV_BLOCK = 1024  # KV columns per ``p @ v`` GEMM (oneDNN's bfloat16 kernel reblocks past 1,024)


def use_grouped(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether the runner's per-request calls run :func:`grouped_attention` (else SDPA): on CPU, in
    bfloat16 / float16, unless switched off. The rule looks at neither the row count nor the KV
    length, so a position's row takes the same path in an ``ar`` step, a tree verify and a prompt
    chunk."""
    return GROUPED_ATTENTION and dtype in GROUPED_DTYPES and torch.device(device).type == "cpu"


def additive_mask(mask: Tensor, groups: int) -> Tensor:
    """The additive bias of :func:`grouped_attention` from a boolean mask.

    Args:
        mask: ``[1, 1, R, L]`` bool, True = attend.
        groups: ``G``, query heads per KV head.
    Returns:
        ``[G*R, L]`` float32: 0 where ``mask`` is True, -inf elsewhere, the ``R`` rows repeated for
        each of the ``G`` query heads of a KV head (row ``g*R + r`` = row ``r``).
    """
    assert mask.ndim == 4 and mask.shape[:2] == (1, 1) and mask.dtype == torch.bool, mask.shape
    bias = torch.where(mask[0, 0], 0.0, float("-inf"))  # float32 (the default dtype of the scalars)
    return bias.repeat(groups, 1)


def grouped_attention(query: Tensor, key: Tensor, value: Tensor, bias: Tensor, scale: float) -> Tensor:
    """Attention of one request's rows (the module docstring's formulation), :data:`ROW_BLOCK` rows
    at a time.

    Args:
        query: ``[1, Hq, R, Dh]`` (any strides).
        key, value: ``[1, Hkv, L, Dh]``, ``Hkv`` dividing ``Hq``; each head's ``[L, Dh]`` may be a
            strided view (a slot of the cache).
        bias: ``[G*R, L]`` float32 from :func:`additive_mask`.
        scale: the score scale (usually ``Dh ** -0.5``).
    Returns:
        ``[1, Hq, R, Dh]`` in the query's dtype.
    """
    _, hq, rows, dh = query.shape
    hkv, length = key.shape[1], key.shape[2]
    assert key.shape == value.shape == (1, hkv, length, dh) and hq % hkv == 0, (query.shape, key.shape)
    assert bias.shape == ((hq // hkv) * rows, length), (bias.shape, query.shape, key.shape)
    return attend(query, key[0], value[0], bias, scale)


def attend(query: Tensor, key: Tensor, value: Tensor, bias: Tensor, scale: float) -> Tensor:
    """:func:`grouped_attention` over ``key, value [Hkv, L, Dh]`` (views of one slot of one layer),
    without its argument checks: the runner's call, once per request and layer (the same ops, so
    the same bits)."""
    rows = query.shape[2]
    if rows <= ROW_BLOCK:
        return _block(query, key, value, bias, scale)
    g = query.shape[1] // key.shape[0]
    bias = bias.view(g, rows, key.shape[1])
    return torch.cat([_block(query[:, :, a:a + ROW_BLOCK], key, value, bias[:, a:a + ROW_BLOCK].flatten(0, 1), scale)
                      for a in range(0, rows, ROW_BLOCK)], dim=2)


def _block(query: Tensor, key: Tensor, value: Tensor, bias: Tensor, scale: float) -> Tensor:
    """:func:`attend` of up to :data:`ROW_BLOCK` rows (same arguments)."""
    _, hq, rows, dh = query.shape
    hkv, length = key.shape[0], key.shape[1]
    q = query[0].reshape(hkv, hq // hkv * rows, dh)  # [Hkv, G*R, Dh]
    scores_t = torch.bmm(key, q.transpose(1, 2))  # [Hkv, L, G*R]: K read in place, untransposed
    probs = torch.softmax(torch.add(bias, scores_t.transpose(1, 2), alpha=scale), -1).to(query.dtype)  # [Hkv, G*R, L]
    if length <= KV_BLOCK:
        out = torch.bmm(probs, value)  # [Hkv, G*R, Dh]
    else:  # fixed column blocks, summed in float32: masked blocks add exact zeros
        out = sum(torch.bmm(probs[:, :, c:c + KV_BLOCK], value[:, c:c + KV_BLOCK]).float()
                  for c in range(0, length, KV_BLOCK)).to(query.dtype)
    return out.view(1, hq, rows, dh)
