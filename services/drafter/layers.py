"""Building blocks both drafter architectures share (DFlash / Domino / DSpark and EAGLE-3):
RMSNorm, rotary embedding, the SiLU-gated MLP, and reading a drafter's ``model.safetensors``.
"""

from __future__ import annotations

import functools
import json
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


def rope_cos_sin(pos: Tensor, dh: int, theta: float, scaling: dict | None = None,
                 max_positions: int = 0) -> tuple[Tensor, Tensor]:
    """The rotary tables of positions ``pos`` for :func:`apply_rope`, float32: ``cos`` and the
    signed ``sin`` (its first half negated), ``[T, Dh]`` for ``pos [T]``, ``[B, 1, T, Dh]`` for
    ``pos [B, T]`` (per-row positions, broadcast over heads).

    Computed once per forward and shared by every layer and by queries and keys (half-split layout,
    as HF Llama/Qwen3). ``scaling``: a scaled RoPE's parameters (``rope_type`` ``linear`` /
    ``llama3`` / ``yarn`` and its keys, :attr:`DrafterConfig.rope_scaling`), whose frequencies and
    attention factor come from transformers' own init functions
    (:func:`services.hf_compat.rope_inv_freq`, with ``max_positions`` as the config's
    ``max_position_embeddings``); None: the plain ``theta ** (-2i / Dh)`` frequencies.
    """
    factor = 1.0
    if scaling is None:
        inv = 1.0 / (theta ** (torch.arange(0, dh, 2, device=pos.device, dtype=torch.float32) / dh))
    else:
        inv, factor = _scaled_inv_freq(dh, json.dumps({**scaling, "rope_theta": theta}, sort_keys=True),
                                       int(max_positions))
        inv = inv.to(pos.device)
    ang = pos.float()[..., None] * inv  # [T, Dh/2] or [B, T, Dh/2]
    emb = torch.cat([ang, ang], -1)  # [..., Dh]
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:  # yarn's attention factor, as transformers scales its tables
        cos, sin = cos * factor, sin * factor
    sin = torch.cat([-sin[..., : dh // 2], sin[..., dh // 2:]], -1)
    if pos.ndim == 2:  # broadcast over heads
        cos, sin = cos[:, None], sin[:, None]
    return cos, sin


@functools.lru_cache(maxsize=32)
def _scaled_inv_freq(dh: int, params_json: str, max_positions: int) -> tuple[Tensor, float]:
    """:func:`services.hf_compat.rope_inv_freq` of JSON-spelled parameters, once per distinct RoPE."""
    from services.hf_compat import rope_inv_freq

    return rope_inv_freq(dh, json.loads(params_json), max_positions)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [..., T, Dh]`` by :func:`rope_cos_sin`'s tables (broadcast against ``x``).

    ``x * cos + [x2, x1] * sin`` in float32 with the signed ``sin``: equal, bit for bit, to the
    textbook ``x * cos + [-x2, x1] * sin`` (a negation is exact), cast back to ``x``'s dtype.
    """
    xf = x.float()
    return (xf * cos + xf.roll(x.shape[-1] // 2, -1) * sin).to(x.dtype)


def rope(x: Tensor, pos: Tensor, theta: float, scaling: dict | None = None, max_positions: int = 0) -> Tensor:
    """Rotary embedding (half-split layout, as HF Llama/Qwen3); ``scaling`` as :func:`rope_cos_sin`.

    ``x [..., T, Dh]`` with ``pos [T]`` (shared positions) or ``x [B, H, T, Dh]`` with ``pos [B, T]``
    (per-row positions, e.g. one training block per anchor).
    """
    return apply_rope(x, *rope_cos_sin(pos, x.shape[-1], theta, scaling, max_positions))


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
    """A drafter directory's weights as one state dict: ``p/model.safetensors``, or the shards a
    ``p/model.safetensors.index.json`` names in its ``weight_map`` (as transformers writes them).

    Raises:
        FileNotFoundError: neither file, or a shard the index names is missing (one line naming it).
        ValueError: a damaged file (truncated, not safetensors), an index that is not the
            transformers layout, or a shard holding a tensor the index does not place there (one
            line naming the file / tensor).
    """
    single, index = p / "model.safetensors", p / "model.safetensors.index.json"
    if single.is_file():
        return _read_safetensors(single, device)
    if not index.is_file():
        raise FileNotFoundError(f"drafter directory {str(p)!r} has no model.safetensors (nor model.safetensors.index.json)")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{index} is not a safetensors index (no weight_map: {error_line(exc)})") from None
    sd: dict[str, Tensor] = {}
    for name in shards:
        f = p / name
        if not f.is_file():
            raise FileNotFoundError(f"{index} names shard {name!r}, which is missing")
        for key, t in _read_safetensors(f, device).items():
            if weight_map.get(key) != name:
                raise ValueError(f"{f} holds {key!r}, which {index.name} places in {weight_map.get(key)!r}")
            sd[key] = t
    missing = sorted(set(weight_map) - set(sd))
    if missing:
        raise ValueError(f"{index.name} lists {len(missing)} tensor(s) no shard holds, e.g. {missing[0]!r}")
    return sd


def _read_safetensors(f: Path, device: str) -> dict[str, Tensor]:
    """One safetensors file as a state dict; a damaged one is ValueError naming it."""
    from safetensors.torch import load_file

    try:
        return load_file(str(f), device=device)
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError) for a damaged file
        raise ValueError(f"{f} is not a readable safetensors file ({error_line(exc)})") from None
