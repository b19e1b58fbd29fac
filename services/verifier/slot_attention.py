"""The slot attention: the one piece of a target's forward that is ours, over the slot KV cache.

Registered with transformers' ``AttentionInterface`` (:func:`services.hf_compat.register_slot_attention`)
by :class:`~services.verifier.runner.ModelRunner`, which sets the step it runs in :data:`ACTIVE`: each
layer's call writes the step's K/V rows into their slots, then runs attention once per request, on
that request's rows ``[1, Hq, R_i, Dh]`` against its slot read up to its own (bucketed) KV length,
with its own mask: the very call the request's step makes when it runs alone (the runner's module
docstring: batch invariance). On CPU in bfloat16 / float16 that call is
:func:`services.verifier.attention.grouped_attention` (two batched GEMMs, several times faster than
torch's CPU SDPA for few rows at long contexts, and row invariant: its module docstring;
``DARTREE_GROUPED_ATTENTION=0`` switches it off), elsewhere ``F.scaled_dot_product_attention``; with
tree attention, :func:`services.verifier.tree_attention.tree_verify_attention`; on padded steps
(``cuda_graphs``) one padded call over the bucket's layout. Compiled steps see it as the opaque
custom op ``dartree::slot_attention`` (the slot writes stay out of the compiler's graph), and
compiled lean steps on the grouped path as the C++ operator ``dartree_native::slot_attention``
(:mod:`services.native_lib`: a fused kernel, each row in float32 in a fixed order, within a
bfloat16 ulp of the Python body and row invariant by construction) when it is built. A forward
without step metadata (the HF reference paths of :class:`~services.verifier.target.TargetModel`)
falls through to transformers' SDPA.

Tree attention (``tree_attention``, the default for eager CUDA targets): each request's call is
:func:`services.verifier.tree_attention.tree_verify_attention` instead, an unmasked prefix call (a
flash kernel on CUDA) merged by log-sum-exp with the ``[R_i, R_i]`` tree block, whose mask is built
on the device from the segments' parent rows; the step's layout is read on the host before its
tensors move, so laying it out reads no device value. Equal to the dense call to rounding.

Cost: ``n`` SDPA calls per layer instead of one, but no K/V gather, no row scatter and no
padding to the widest segment and longest context. SmolLM2's attention shape, 1-8 requests mixing
``ar`` rows and 9 / 17-row trees at 200-700 positions (a probe on a loaded 2-core AVX2 VM, one
thread, under load): bfloat16 within 0.8-1.25x of the padded call, float32 ~0.5x (the padded call
read every slot up to the longest context).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from services import hf_compat
from services.tree.batch import PackedRows
from services.verifier.attention import additive_mask, attend, use_grouped
from services.verifier.kv_cache import SlotKVCache
from services.verifier.tree_attention import tree_verify_attention

# The step being run by this thread's forward: ``(cache, packed rows, request parts, mode)`` with mode
# "dense", "tree" or "padded" (set by :meth:`ModelRunner.execute`; None outside a step).
ACTIVE = threading.local()


def slot_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """Attention of one layer over the slot cache (see the module docstring); shapes as HF's SDPA.

    Under ``torch.compile`` (``ModelRunner(compile=True)``; only steps run compiled) it is the opaque
    custom op ``dartree::slot_attention``, whose eager body is this function: the compiler sees a
    pure ``[1, Hq, R, Dh] x 3 -> [1, R, Hq, Dh]`` op and the slot writes stay out of its graph."""
    if torch.compiler.is_compiling():
        scaling = kwargs.get("scaling")
        return torch.ops.dartree.slot_attention(query, key, value, module.dartree_layer,
                                                float(scaling if scaling is not None else module.scaling)), None
    return slot_attention_eager(module.layer_idx, query, key, value, attention_mask, module, **kwargs)


def slot_attention_eager(layer: int, query: Tensor, key: Tensor, value: Tensor, attention_mask, module=None,
                         **kwargs):
    """The eager body of :func:`slot_attention` for layer ``layer`` over the step in :data:`ACTIVE`
    (SDPA without one): ``(out [1, R, Hq, Dh], None)``."""
    step = getattr(ACTIVE, "step", None)
    if step is None:
        return hf_compat.sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    cache, p, parts, mode = step
    scale = kwargs.get("scaling")
    if mode == "padded":  # one call over the bucket's layout (fixed shapes, no host sync)
        cache.write(layer, p.write_slot, p.write_pos, key[0].transpose(0, 1), value[0].transpose(0, 1))
        k, v = cache.read(layer, p.slots, p.kv_length)  # [n, Hkv, L, Dh], gathered
        q = query[0].transpose(0, 1)[p.row_index.clamp(min=0)].transpose(1, 2)  # [n, Hq, Rm, Dh]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=p.attn_mask, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out.transpose(1, 2).flatten(0, 1)[p.padded_pos][None], None  # [1, R, Hq, Dh]
    one = len(parts) == 1
    outs = []
    for a, b, slot, start, length, mask, bias in parts:  # each request exactly as its solo step: batch invariant
        # its rows' K/V to consecutive columns from its start, then its slot read to its own length
        # (slots are distinct within a step, so a request's write never touches another's read)
        k, v = cache.write_read(layer, slot, start, key[0] if one else key[0, :, a:b],
                                value[0] if one else value[0, :, a:b], length)  # [Hkv, L_i, Dh] views
        q = query if one else query[:, :, a:b]
        scaling = scale if scale is not None else k.shape[-1] ** -0.5
        if mode == "tree":  # mask: the segment's [R_i, R_i] tree mask, built on the device
            outs.append(tree_verify_attention(q, k, v, start, mask, scaling))
        elif bias is not None:  # bf16 / fp16 on CPU: batched GEMMs (services.verifier.attention)
            outs.append(attend(q, k, v, bias, scaling))
        else:
            outs.append(F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=mask, scale=scale,
                                                       enable_gqa=k.shape[0] != query.shape[1]))
    out = outs[0] if one else torch.cat(outs, dim=2)  # [1, Hq, R, Dh]
    return out.transpose(1, 2), None


def lean_attention(layer: int, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
    """The slot attention as :class:`~services.verifier.lean_step.LeanLlamaStep` calls it: ``[1, R, Hq, Dh]``."""
    return slot_attention_eager(layer, query, key, value, None, scaling=scaling)[0]


def compiled_lean_attention(layer: Tensor, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
    """The slot attention as the compiled :class:`~services.verifier.lean_step.LeanLlamaStep` calls it: the
    opaque op ``dartree::slot_attention`` (``layer``: the attention module's 0-d index buffer); ``[1, R, Hq, Dh]``."""
    return torch.ops.dartree.slot_attention(query, key, value, layer, scaling)


def native_lean_attention(layer: Tensor, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
    """The compiled lean step's slot attention as the fused C++ kernel ``dartree_native::slot_attention``
    (:mod:`services.native_lib`: one call per layer, no GEMM, each row accumulated in float32 in a
    fixed order, so row and batch invariant by construction); ``[1, R, Hq, Dh]``."""
    return torch.ops.dartree_native.slot_attention(query, key, value, layer, scaling)


def native_aten_lean_attention(layer: Tensor, query: Tensor, key: Tensor, value: Tensor, scaling: float) -> Tensor:
    """The compiled lean step's slot attention as ``dartree_native::slot_attention_aten`` (the same ATen
    calls as :func:`compiled_lean_attention`'s body, so the same bits, without the interpreter;
    ``DARTREE_NATIVE_ATTENTION=aten``); ``[1, R, Hq, Dh]``."""
    return torch.ops.dartree_native.slot_attention_aten(query, key, value, layer, scaling)


_NATIVE = threading.local()  # .cache: the SlotKVCache the native op of this thread holds (a reference)


def native_step(cache: SlotKVCache, parts: list[tuple]) -> None:
    """Hand the native op this thread's step: the cache (when it is not the one it holds already)
    and each request's ``(first row, end row, slot, start, KV length)`` and additive bias."""
    if any(part[6] is None for part in parts):
        raise RuntimeError("the native slot attention runs the grouped path only, switched off since this runner "
                           "was built (services.verifier.attention.GROUPED_ATTENTION)")
    if getattr(_NATIVE, "cache", None) is not cache:
        torch.ops.dartree_native.set_cache(cache.keys, cache.values)
        _NATIVE.cache = cache
    torch.ops.dartree_native.set_step([x for part in parts for x in part[:5]], [part[6] for part in parts])


def request_parts(p: PackedRows, groups: int, dtype: torch.dtype, host: PackedRows | None = None) -> list[tuple]:
    """Per segment of ``p`` (unpadded): ``(first row, end row, slot, start, KV length, mask [1, 1, R_i, L_i],
    bias [G*R_i, L_i] or None)`` (``slot``, ``start``: ints; the segment's K/V rows go to columns
    ``start ..`` of its slot), the arguments of its attention call, equal to those of the segment's
    solo step (a :func:`~services.tree.batch.pack_segments` of it alone; contiguous masks, like a solo step's). ``bias``
    (:func:`~services.verifier.attention.additive_mask`, made once per step for every layer) is set
    where the call runs :func:`~services.verifier.attention.grouped_attention` instead of SDPA
    (:func:`~services.verifier.attention.use_grouped`); ``groups``: query heads per KV head; ``host``:
    ``p`` before it moved to the device (its row bounds, slots and starts are read there: no device read)."""
    h = p if host is None else host
    bounds = h.cu_rows.tolist()
    slots, starts = h.slots.tolist(), h.starts.tolist()
    parts = []
    for i, length in enumerate(p.segment_kv_lengths):
        a, b = bounds[i], bounds[i + 1]
        mask = p.attn_mask[i:i + 1, :, :b - a, :length]
        bias = additive_mask(mask, groups) if use_grouped(dtype, mask.device) else None
        if bias is None and len(bounds) > 2:
            mask = mask.contiguous()  # SDPA reads it: contiguous, like a solo step's
        parts.append((a, b, slots[i], starts[i], length, mask, bias))
    return parts


@torch.library.custom_op("dartree::slot_attention", mutates_args=())
def _slot_attention_op(query: Tensor, key: Tensor, value: Tensor, layer: Tensor, scaling: float) -> Tensor:
    """The slot attention of the active step as one opaque op (for compiled steps; writes the step's
    K/V into the slot cache as a side effect the compiler does not see: each call's output is used,
    so it runs exactly once per layer, in order). ``layer``: the layer index as a 0-d int64 tensor
    (the attention module's ``dartree_layer`` buffer), an input of the compiled layer rather than a
    constant baked into it, so one compiled layer serves every layer."""
    return slot_attention_eager(int(layer), query, key, value, None, scaling=scaling)[0].contiguous()


@_slot_attention_op.register_fake
def _(query, key, value, layer, scaling):
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])
