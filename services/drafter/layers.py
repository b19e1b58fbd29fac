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
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight.to(x.dtype)


def rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotary embedding (half-split layout, as HF Llama/Qwen3).

    ``x [..., T, Dh]`` with ``pos [T]`` (shared positions) or ``x [B, H, T, Dh]`` with ``pos [B, T]``
    (per-row positions, e.g. one training block per anchor).
    """
    dh = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dh, 2, device=x.device, dtype=torch.float32) / dh))
    ang = pos.float()[..., None] * inv  # [T, Dh/2] or [B, T, Dh/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    if pos.ndim == 2:  # broadcast over heads
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


class MLP(nn.Module):
    """SiLU-gated MLP (Qwen3); ``c`` has ``hidden_size`` and ``intermediate_size``."""

    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
