"""Tree-verify attention over a slot's cache: an unmasked prefix call merged with a small tree block.

A verify segment's rows (root + draft nodes, or a prompt chunk, or one ``ar`` row) attend to every
committed column of their slot (``[0, start)``, no mask) and, among their own ``R`` columns
(``[start, start + R)``), to their ancestors-or-self (the tree mask). The dense reference
(:func:`services.verifier.slot_attention.slot_attention_eager`'s SDPA call) builds a ``[1, 1, R, L]`` bool
mask over the whole prefix on the host and hands it to SDPA, which rules out the flash kernels. This
module splits the softmax in two and merges the halves by their log-sum-exp (flash-decoding's
split-KV merge)::

    prefix:  o1, lse1 = attention(q, K[:start], V[:start])                  no mask: a flash kernel
    tree:    o2, lse2 = attention(q, K[start:start+R], V[...], tree_mask)  [R, R] scores, float32
    out     = o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse),   lse = logaddexp(lse1, lse2)

Nothing is copied out of the cache (``k_slot`` / ``v_slot`` are views of the slot), and the only
mask is the ``[R, R]`` tree block, built on the device from the parent rows
(:func:`services.tree.tree_mask.tree_mask_from_parents`). Grouped-query heads are handled without
repeating K/V: the ``G`` query heads of a KV head are stacked as ``G * R`` rows of one call (the
prefix has no mask, so rows are independent).

The prefix call is the fused kernel that returns the log-sum-exp: ``_scaled_dot_product_flash_attention``
on CUDA (bfloat16 / float16, head dim <= 256), ``_scaled_dot_product_flash_attention_for_cpu`` on
CPU, and plain matmul + ``logsumexp`` elsewhere (:func:`prefix_attention`). Numerics: float32
results equal the dense reference to ~1e-6, not bitwise (the split changes the summation order);
bfloat16 to bfloat16 rounding (tests/engine/test_tree_attention.py).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from services.tree.batch import PackedRows, Segment
from services.tree.tree_mask import tree_mask_from_parents

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def _stack_groups(q: Tensor, kv_heads: int) -> Tensor:
    """``q [1, Hq, R, Dh]`` -> ``[1, Hkv, G*R, Dh]``: query head ``kv*G + g``, row ``r`` at stacked row
    ``g*R + r`` of KV head ``kv`` (a view of a contiguous ``q``)."""
    _, hq, r, dh = q.shape
    return q.reshape(1, kv_heads, (hq // kv_heads) * r, dh)


def prefix_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Unmasked attention with its log-sum-exp.

    Args:
        q: ``[1, H, M, Dh]``; k, v: ``[1, H, L, Dh]`` (``L >= 1``; views with a unit last stride).
        scale: the score scale (``Dh ** -0.5`` usually).
    Returns:
        ``(out [1, H, M, Dh]`` in ``q``'s dtype, ``lse [1, H, M]`` float32, natural log of the sum of
        ``exp(scale * q.k)`` over the ``L`` columns).
    """
    if q.device.type == "cuda" and q.dtype in FLASH_DTYPES and q.shape[-1] <= 256:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)
        return out[0], out[1]
    if q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
        return out, lse.float()
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [1, H, M, L]
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v.float()).to(q.dtype), lse


def tree_block_attention(q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Masked attention of stacked rows against the segment's own ``R`` columns, in float32.

    Args:
        q: ``[1, Hkv, G*R, Dh]`` (:func:`_stack_groups`); k, v: ``[1, Hkv, R, Dh]``;
        tree_mask: ``[R, R]`` bool, every row sees itself (so no row is empty).
    Returns:
        ``(out [1, Hkv, G*R, Dh]`` float32, ``lse [1, Hkv, G*R]`` float32).
    """
    r = tree_mask.shape[0]
    groups = q.shape[2] // r
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [1, Hkv, G*R, R]
    s = s.masked_fill(~tree_mask.repeat(groups, 1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v.float()), lse


def tree_verify_attention(q: Tensor, k_slot: Tensor, v_slot: Tensor, start: int, tree_mask: Tensor,
                          scale: float) -> Tensor:
    """Attention of one segment's rows over its slot (module docstring), no KV copy, no prefix mask.

    Args:
        q: ``[1, Hq, R, Dh]`` the segment's queries.
        k_slot, v_slot: ``[Hkv, L, Dh]`` views of the slot with ``L >= start + R``; columns
            ``[start, start + R)`` hold the segment's own K/V rows (already written).
        start: committed columns of the slot (host int, ``>= 0``).
        tree_mask: ``[R, R]`` bool on the device, ancestor-or-self of the segment's rows.
        scale: the score scale.
    Returns:
        ``[1, Hq, R, Dh]`` in ``q``'s dtype, equal to SDPA with the dense mask
        ``[ones(R, start) | tree_mask | zeros]`` to rounding (module docstring).
    Raises:
        ValueError: shapes that do not fit together.
    """
    _, hq, r, dh = q.shape
    hkv = k_slot.shape[0]
    if tree_mask.shape != (r, r) or hq % hkv or k_slot.shape[1] < start + r or k_slot.shape[-1] != dh:
        raise ValueError(f"tree attention: q {tuple(q.shape)}, k {tuple(k_slot.shape)}, start {start}, "
                         f"mask {tuple(tree_mask.shape)} do not fit")
    qs = _stack_groups(q.contiguous(), hkv)  # [1, Hkv, G*R, Dh]
    o2, lse2 = tree_block_attention(qs, k_slot[None, :, start:start + r], v_slot[None, :, start:start + r],
                                    tree_mask, scale)
    if start > 0:
        o1, lse1 = prefix_attention(qs, k_slot[None, :, :start], v_slot[None, :, :start], scale)
        lse = torch.logaddexp(lse1, lse2)
        out = o1.float() * torch.exp(lse1 - lse)[..., None] + o2 * torch.exp(lse2 - lse)[..., None]
    else:
        out = o2
    return out.to(q.dtype).reshape(1, hq, r, dh)


def segment_parts(segments: list[Segment], p: PackedRows, dev) -> list[tuple]:
    """Per segment of ``p`` (the packed ``segments``, host tensors): ``(first row, end row, slot,
    start, KV length, tree mask [R_i, R_i] on dev, None)``, the arguments of its
    :func:`tree_verify_attention` call (in the runner's per-request loop). The masks are built on the
    device from the segments' parent rows (:meth:`Segment.parents`; one small copy to the device):
    one mask over the step's forest (:func:`~services.tree.tree_mask.tree_mask_from_parents`), whose
    diagonal blocks are the segments' masks. No host-built prefix mask, no read of device values."""
    bounds = p.cu_rows.tolist()
    parents = torch.cat([torch.where(s.parents() < 0, -1, s.parents() + a) for s, a in zip(segments, bounds)])
    forest = tree_mask_from_parents(parents.to(dev))  # [R, R]
    return [(a, b, s.slot, s.start, length, forest[a:b, a:b], None)
            for s, a, b, length in zip(segments, bounds, bounds[1:], p.segment_kv_lengths)]


def tree_attention_on(asked: bool | None, on_cuda: bool, fixed_or_compiled: bool) -> bool:
    """Whether a runner's unpadded steps use the tree-verify attention (``ModelRunner``'s ``tree_attention``).

    Raises:
        ValueError: asked for together with compiled or padded (CUDA-graph) steps.
    """
    if asked and fixed_or_compiled:
        raise ValueError("tree_attention runs eager unpadded steps: it excludes compile and cuda_graphs")
    if asked is None:
        return on_cuda and not fixed_or_compiled and os.environ.get("DARTREE_TREE_ATTENTION", "1") != "0"
    return bool(asked)
