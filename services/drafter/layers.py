"""Building blocks both drafter architectures share (DFlash / Domino / DSpark and EAGLE-3):
RMSNorm, rotary embedding, the SiLU-gated MLP, and reading a drafter's ``model.safetensors``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.int4_fused import INT4_PACK_ROWS, FusedInt4  # noqa: F401 (INT4_PACK_ROWS: re-exported)
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
