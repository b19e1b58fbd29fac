"""Building blocks both drafter architectures share (DFlash / Domino / DSpark and EAGLE-3):
RMSNorm, rotary embedding, the SiLU-gated MLP, and reading a drafter's ``model.safetensors``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.runtime import error_line


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale (weight key ``weight``), computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """:class:`RMSNorm` of ``x [..., Dh]`` by ``weight`` broadcast against it (``[Dh]``, or e.g.
    ``[heads, Dh]`` to norm several heads of different norms in one call): ``x * rsqrt(mean(x²) +
    eps)`` in float32, rounded to ``x``'s dtype, times ``weight``.

    On a CPU without autograd, the normalisation runs as torch's one fused op (``aten._fused_rms_norm``, 2
    ops instead of 8 at 5-8 µs each on a CPU), which gives the same bits as the float32 sequence
    (``tests/engine/test_drafter_lean.py``); else the sequence itself.
    """
    if _FUSED_RMS is not None and x.device.type == "cpu" and not (x.requires_grad and torch.is_grad_enabled()):
        return _FUSED_RMS(x, [x.shape[-1]], None, eps)[0] * weight.to(x.dtype)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight.to(x.dtype)


_FUSED_RMS = getattr(torch.ops.aten, "_fused_rms_norm", None)


def rope_cos_sin(pos: Tensor, dh: int, theta: float) -> tuple[Tensor, Tensor]:
    """The rotary tables of positions ``pos`` for :func:`apply_rope`, float32: ``cos`` and the
    signed ``sin`` (its first half negated), ``[T, Dh]`` for ``pos [T]``, ``[B, 1, T, Dh]`` for
    ``pos [B, T]`` (per-row positions, broadcast over heads).

    Computed once per forward and shared by every layer and by queries and keys (half-split layout,
    as HF Llama/Qwen3).
    """
    inv = 1.0 / (theta ** (torch.arange(0, dh, 2, device=pos.device, dtype=torch.float32) / dh))
    ang = pos.float()[..., None] * inv  # [T, Dh/2] or [B, T, Dh/2]
    emb = torch.cat([ang, ang], -1)  # [..., Dh]
    cos, sin = emb.cos(), emb.sin()
    sin = torch.cat([-sin[..., : dh // 2], sin[..., dh // 2:]], -1)
    if pos.ndim == 2:  # broadcast over heads
        cos, sin = cos[:, None], sin[:, None]
    return cos, sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [..., T, Dh]`` by :func:`rope_cos_sin`'s tables (broadcast against ``x``).

    ``x * cos + [x2, x1] * sin`` in float32 with the signed ``sin``: equal, bit for bit, to the
    textbook ``x * cos + [-x2, x1] * sin`` (a negation is exact), cast back to ``x``'s dtype.
    """
    xf = x.float()
    return (xf * cos + xf.roll(x.shape[-1] // 2, -1) * sin).to(x.dtype)


def rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotary embedding (half-split layout, as HF Llama/Qwen3).

    ``x [..., T, Dh]`` with ``pos [T]`` (shared positions) or ``x [B, H, T, Dh]`` with ``pos [B, T]``
    (per-row positions, e.g. one training block per anchor).
    """
    return apply_rope(x, *rope_cos_sin(pos, x.shape[-1], theta))


# torch's int4 CPU pack (``_convert_weight_to_int4pack_for_cpu``) interleaves the weight's rows in
# blocks of 64, so packs concatenate row-wise only at multiples of 64 rows.
INT4_PACK_ROWS = 64


class FusedInt4:
    """Several int4 linears over the same input as ONE kernel call: their outputs concatenated.

    The fused module is built on first use from the linears' packed weights (rows stacked; the
    per-column results are bit-identical to separate calls: the int4 CPU kernel computes each
    output column on its own, ``tests/engine/test_drafter_lean.py``; a probe call checks it when the
    module is built) and rebuilt when a linear is replaced. :meth:`get` gives None, so the caller
    runs the linears one by one, when one of them is not a :class:`services.weights.Int4Linear`
    (float32 / dense bfloat16 drafters: their GEMMs make no per-column promise), when a linear but
    the last has rows that are not a multiple of :data:`INT4_PACK_ROWS`, or inside ``torch.compile``. Not a
    registered submodule: state dicts and ``.to()`` see only the linears themselves.
    """

    def __init__(self):
        self._key: tuple[nn.Module, ...] = ()
        self._mod: nn.Module | None = None

    def get(self, *linears: nn.Module) -> nn.Module | None:
        """The fused ``[..., K] -> [..., sum N_i]`` module of ``linears``, or None (see the class)."""
        if torch.compiler.is_compiling():
            return None
        if len(self._key) == len(linears) and all(a is b for a, b in zip(self._key, linears)):
            return self._mod
        from services.weights import Int4Linear

        self._key, self._mod = tuple(linears), None
        if all(type(m) is Int4Linear and m.bias is None for m in linears) and \
                len({(m.in_features, m.scale_zeros.dtype) for m in linears}) == 1 and \
                all(m.out_features % INT4_PACK_ROWS == 0 for m in linears[:-1]):
            fused = Int4Linear.from_packed(torch.cat([m.packed for m in linears]),
                                           torch.cat([m.scale_zeros for m in linears], 1).contiguous())
            with torch.inference_mode():  # a probe: a kernel whose packing or columns changed is not used
                x = torch.randn(3, fused.in_features, generator=torch.Generator().manual_seed(0)).to(
                    fused.scale_zeros.dtype)
                same = torch.equal(fused(x), torch.cat([m(x) for m in linears], -1))
            self._mod = fused if same else None
        return self._mod


class MLP(nn.Module):
    """SiLU-gated MLP (Qwen3); ``c`` has ``hidden_size`` and ``intermediate_size``.

    With int4 linears the gate and up projections run as one kernel call (:class:`FusedInt4`).
    """

    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self._gate_up = FusedInt4()

    def forward(self, x: Tensor) -> Tensor:
        fused = self._gate_up.get(self.gate_proj, self.up_proj)
        if fused is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = fused(x).chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


def read_model_safetensors(p: Path, device: str) -> dict[str, Tensor]:
    """``p/model.safetensors`` as a state dict; a missing file is FileNotFoundError, a damaged one
    (truncated, not safetensors) ValueError, each one line naming the file."""
    from safetensors.torch import load_file

    f = p / "model.safetensors"
    if not f.is_file():
        raise FileNotFoundError(f"drafter directory {str(p)!r} has no model.safetensors")
    try:
        return load_file(str(f), device=device)
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError) for a damaged file
        raise ValueError(f"{f} is not a readable safetensors file ({error_line(exc)})") from None
