"""Weight formats of the target (``--weights``): loading a target in one, and choosing one (``auto``).

Each format is a :class:`services.weight_formats.WeightFormat` of the registry
(:mod:`services.weight_formats`): float32, bfloat16, and ``q4``, the GGUF's own 4-bit blocks
(:mod:`services.q4_weights`, with the int8-row lm_head of :mod:`services.int8_head`). This module
loads a HF target in a format (:func:`load_causal_lm`: the dense model in the format's activation
dtype, then the format's ``prepare`` hook) and resolves ``--weights`` (:func:`choose_weights`).

Dense bfloat16 linears (all of them under ``bfloat16``; under ``q4`` the lm_head where the int8 one
is off) are pre-packed for oneDNN on CPU (:func:`services.cpu_gemm.pack_linears_bf16`): same results
as ``F.linear``, without re-laying-out the weight on every call; each row independent of the step's
row count.

The default is chosen on the machine that serves (``--weights auto``, :func:`choose_weights`, the
rules in :mod:`services.weight_choice`): bfloat16 is 1.7x faster than float32 on a CPU with native
bf16 and emulated (slower than both others) on an AVX2-only one; a measurement taken on a busy
machine is rejected and never cached.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from services import weight_formats
from services.gguf_blocks import (Q4_GROUP, Q4Blocks, gguf_source, parse_q4_1,  # noqa: F401 (re-exported)
                                  quantize_q4_1, read_gguf_linears, read_gguf_output_rows)
from services.int8_head import Int8RowLinear, int8_lm_head_enabled, use_int8_lm_head  # noqa: F401 (re-exported)
from services.q4_weights import (Int4Linear, apply_q4, int4_kernel_available,  # noqa: F401 (re-exported)
                                 quantize_linears_q4)
from services.runtime import WEIGHT_CHOICES as CHOICES, WEIGHT_FORMATS as FORMATS, default_weights  # noqa: F401

log = logging.getLogger(__name__)


def compute_dtype(fmt: str) -> torch.dtype:
    """Activation (and KV cache) dtype of a weight format (its registry entry's ``act_dtype``).

    Raises:
        ValueError: unknown format (one line).
    """
    check_format(fmt, allow_auto=False)
    return getattr(torch, weight_formats.get(fmt).act_dtype)


def drafter_dtype(act_dtype: torch.dtype, device: str = "cpu") -> torch.dtype:
    """The dtype the drafter runs in next to a target whose activations are ``act_dtype``.

    On a CPU without native bfloat16 GEMMs (oneDNN reports no bf16 support: e.g. an AVX2-only CPU,
    where bfloat16 is emulated) float32: there the drafter's 16-row block and the tree build's small
    ops ran 2.4-2.7x slower in bfloat16 (on an AMD EPYC with AVX2 only,
    ``python -m benchmarks.bench_draft_vocab --weights q4 --drafter-dtype {float32,bfloat16}``:
    draft phase 36 vs 94 ms per B = 8 round next to a 58-75 ms q4 ``ar`` step); its weights are small
    (~60 MB in float32). On a CPU with them (AVX-512-bf16 / AMX), and on CUDA, the target's activation
    dtype, as before. Losslessness does not depend on it (the target decides every token); the drafts'
    last bits do.
    """
    if torch.device(device).type != "cpu" or act_dtype == torch.float32:
        return act_dtype
    from services.cpu_gemm import onednn_bf16_available

    return act_dtype if onednn_bf16_available() else torch.float32


def check_format(fmt: str, allow_auto: bool = True) -> None:
    """ValueError (one line) unless ``fmt`` is a registered weight format (or ``auto`` when allowed)."""
    ok = ("auto", *weight_formats.names()) if allow_auto else weight_formats.names()
    if fmt not in ok:
        raise ValueError(f"weights {fmt!r} is not supported (choose from {', '.join(ok)})")


def load_causal_lm(target_dir: str | Path, fmt: str, device: str = "cpu"):
    """A HF causal LM from ``target_dir`` in weight format ``fmt`` (SDPA attention, eval mode): the
    dense model in the format's activation dtype, then the format's ``prepare`` hook.

    Raises:
        ValueError: a format that cannot run on ``device`` or for this target (one line).
    """
    from transformers import AutoModelForCausalLM

    check_format(fmt, allow_auto=False)
    wf = weight_formats.get(fmt)
    why = wf.unavailable(device, target_dir)
    if why:
        raise ValueError(why)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=compute_dtype(fmt),
                                                 attn_implementation="sdpa").to(device).eval()
    wf.prepare_model(model, target_dir, device)
    if model.dtype == torch.bfloat16 and torch.device(device).type == "cpu":
        from services.cpu_gemm import pack_linears_bf16

        pack_linears_bf16(model)  # the dense bf16 linears (all of them; q4's lm_head if not int8) pre-packed
    release_freed_memory()  # what loading freed (the dense copy, the unpacked blocks) leaves the RSS
    return model


def release_freed_memory() -> None:
    """Collect garbage and return the C heap's freed pages to the operating system (glibc
    ``malloc_trim``; a no-op elsewhere). Loading frees more than it keeps (a dense copy cast to
    bfloat16, the GGUF's unpacked 4-bit blocks) and glibc keeps freed heap pages resident otherwise:
    270 MB of the SmolLM2 q4 verifier's RSS."""
    import gc

    from services.runtime import trim_heap

    gc.collect()
    trim_heap()


# ------------------------------------------------------------------------------------ auto choice

def q4_unavailable(target_dir: str | Path, device: str = "cpu") -> str | None:
    """Why ``q4`` cannot run here for this target (one line), or None when it can
    (:meth:`services.weight_formats.WeightFormat.unavailable`)."""
    return weight_formats.get("q4").unavailable(device, target_dir)


def available_formats(target_dir: str | Path, device: str = "cpu") -> list[str]:
    """The registered formats that can run here for this target, in registration order."""
    return [f.name for f in weight_formats.FORMATS.values() if f.available(device, target_dir)]


def choose_weights(requested: str, target_dir: str | Path, device: str = "cpu", *, cache: bool = True,
                   remeasure: bool = False) -> str:
    """Resolve ``--weights``: a concrete format is checked and returned; ``auto`` chooses.

    ``auto`` on CUDA is bfloat16; on CPU :func:`services.weight_choice.choose_auto`: candidates by
    the CPU's capabilities (no bfloat16 where it is emulated), a measurement that a busy machine
    cannot corrupt (interleaved, repeats that agree, a one-row step near the model's floor) or else
    the rule's answer (the registry's ranks: q4 > native bf16 > float32), never cached. One log line
    says which and why. ``remeasure`` ignores a cached choice.

    Raises:
        ValueError: an unknown format, or one that cannot run here (one line).
    """
    check_format(requested)
    target_dir = Path(target_dir)
    if requested != "auto":
        why = weight_formats.get(requested).unavailable(device, target_dir)
        if why:
            raise ValueError(why)
        return requested
    if torch.device(device).type != "cpu":
        return "bfloat16"
    from services.weight_choice import choose_auto

    return choose_auto(target_dir, available_formats(target_dir, device), load_causal_lm,
                       weight_formats.kernels_version(), device, cache=cache, remeasure=remeasure)


def resolve_cli_weights(weights: str | None, dtype: str | None, target_dir: str | Path,
                        device: str = "cpu") -> tuple[str | None, torch.dtype]:
    """``(format, activation dtype)`` from a command line's ``--weights`` and the older ``--dtype``.

    An explicit ``--dtype`` pins the format when ``--weights`` is ``auto`` (or absent), as before
    ``--weights`` existed; ``--dtype float16`` (no format of its own) loads dense float16 weights and
    returns ``(None, torch.float16)``.

    Raises:
        ValueError: an unknown or unavailable format (one line).
    """
    weights = weights or "auto"
    if dtype and weights == "auto":
        if dtype not in FORMATS:
            return None, getattr(torch, dtype)
        weights = dtype
    fmt = choose_weights(weights, target_dir, device)
    return fmt, compute_dtype(fmt)
