"""The GGUF side of the ``q4`` format: the Q4_1 byte layout and reading a GGUF's tensors.

Only this module knows the Q4_1 byte layout (ggml ``block_q4_1``: fp16 ``d``, fp16 ``m``, 16 bytes
of nibbles; element ``j < 16`` is the low nibble of byte ``j``, element ``j + 16`` the high nibble).
Per block of 32 weights ``w = d * q + m`` (``q`` in 0..15, ``d``, ``m`` fp16). The kernels that
serve them are in :mod:`services.q4_weights` (4-bit linears) and :mod:`services.int8_head` (the
lm_head's int8 rows).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

Q4_GROUP = 32  # elements per Q4_1 block (ggml QK4_1)
_Q4_1_BYTES = 20  # fp16 d + fp16 m + 16 bytes of nibbles
# HF linear name inside a decoder layer -> GGUF tensor name inside ``blk.N``
_GGUF_LINEARS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
# llama.cpp's converter permutes q/k rows of these architectures (HF rotary halves -> interleaved)
_PERMUTED_ARCHS = ("llama", "mistral")


@dataclass(frozen=True)
class Q4Blocks:
    """One Q4_1 weight matrix, unpacked: ``w[n, k] = d[n, k // 32] * q[n, k] + m[n, k // 32]``.

    Attributes:
        q: ``[N, K]`` int32 in 0..15. d, m: ``[N, K / 32]`` float32 (exact fp16 values).
    """

    q: Tensor
    d: Tensor
    m: Tensor

    def dequantize(self) -> Tensor:
        """``[N, K]`` float32 weights, ``d * q + m`` (what transformers' GGUF loader produces)."""
        return self.d.repeat_interleave(Q4_GROUP, 1) * self.q.float() + self.m.repeat_interleave(Q4_GROUP, 1)

    def permute_rows(self, n_head: int) -> "Q4Blocks":
        """Undo llama.cpp's q/k row permutation (``[n_head, 2, dim]`` -> ``[n_head, dim, 2]`` halves),
        as transformers' GGUF loader does for the dequantized matrix; rows are whole, so the blocks move
        with them."""
        def undo(t: Tensor) -> Tensor:
            dim = t.shape[0] // n_head // 2
            return t.reshape(n_head, dim, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()

        return Q4Blocks(undo(self.q), undo(self.d), undo(self.m))


def parse_q4_1(raw: np.ndarray) -> Q4Blocks:
    """Unpack ggml ``block_q4_1`` bytes.

    Args:
        raw: ``[N, K / 32 * 20]`` uint8, one matrix row per row (gguf's ``ReaderTensor.data``).
    Raises:
        ValueError: the byte count is not a whole number of blocks.
    """
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] % _Q4_1_BYTES:
        raise ValueError(f"Q4_1 data must be [rows, blocks * {_Q4_1_BYTES}] bytes, got {list(raw.shape)}")
    n, nb = raw.shape[0], raw.shape[1] // _Q4_1_BYTES
    blk = raw.reshape(n, nb, _Q4_1_BYTES)
    d = blk[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blk[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blk[:, :, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, nb * Q4_GROUP).astype(np.int32)
    return Q4Blocks(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))


_READERS: dict[str, object] | None = None  # path -> gguf.GGUFReader while one_gguf_reader() is open


@contextlib.contextmanager
def one_gguf_reader():
    """Within this block every GGUF file is parsed once (:func:`_gguf_reader`): a load that reads
    both the q4 linears and the int8 lm_head's rows parsed SmolLM2's file twice, ~2 s each on the
    2-core VM. The readers (and their file mappings) are dropped at the end."""
    global _READERS
    outer = _READERS is not None
    if not outer:
        _READERS = {}
    try:
        yield
    finally:
        if not outer:
            _READERS = None


def _gguf_reader(path: str | Path):
    """``gguf.GGUFReader`` of ``path``, shared inside :func:`one_gguf_reader`."""
    import gguf

    if _READERS is None:
        return gguf.GGUFReader(str(path))
    key = str(Path(path).resolve())
    if key not in _READERS:
        _READERS[key] = gguf.GGUFReader(str(path))
    return _READERS[key]


def read_gguf_linears(path: str | Path, config) -> tuple[dict[str, Q4Blocks], list[str]]:
    """The Q4_1 decoder linears of a GGUF file, by HF module name (``model.layers.3.mlp.up_proj``).

    q/k rows are un-permuted for llama-family files (as transformers' loader does). Returns
    ``(blocks, skipped)``: ``skipped`` names linears stored in another type (left dense).

    Raises:
        OSError: the file cannot be read; ValueError: it is not a GGUF file.
    """
    import gguf

    reader = _gguf_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    heads, kv_heads = int(config.num_attention_heads), int(getattr(config, "num_key_value_heads", None)
                                                          or config.num_attention_heads)
    permute = getattr(config, "model_type", "") in _PERMUTED_ARCHS
    out: dict[str, Q4Blocks] = {}
    skipped: list[str] = []
    for i in range(int(config.num_hidden_layers)):
        for hf, gg in _GGUF_LINEARS.items():
            name = f"model.layers.{i}.{hf}"
            t = tensors.get(f"blk.{i}.{gg}.weight")
            if t is None or t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
                skipped.append(name)
                continue
            b = parse_q4_1(np.asarray(t.data))
            if permute and gg in ("attn_q", "attn_k"):
                b = b.permute_rows(heads if gg == "attn_q" else kv_heads)
            out[name] = b
    return out, skipped


def read_gguf_output_rows(path: str | Path, shape: tuple[int, int]):
    """The exact output-projection weights of a GGUF file as a function of a row range, or None.

    The GGUF's ``output.weight`` (else ``token_embd.weight``: a tied head) when stored as Q8_0
    (fp16 ``d`` + 32 int8 ``q`` per block, ``w = d * q``), F16 or F32 with ``shape`` ``[N, K]``.
    Returns ``rows(i, j) -> [j - i, K]`` float32 (dequantised on demand, so a caller can go in chunks
    over the memory-mapped file), or None for another type or shape. Raises OSError / ValueError
    (not a GGUF file) as :func:`read_gguf_linears`.
    """
    import gguf

    reader = _gguf_reader(path)
    tensors = {t.name: t for t in reader.tensors}
    t = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if t is None:
        return None
    n, k = shape
    kind = gguf.GGMLQuantizationType
    data = np.asarray(t.data)
    if t.tensor_type == kind.Q8_0 and data.shape == (n, k // 32 * 34) and k % 32 == 0:
        blocks = data.reshape(n, k // 32, 34)

        def rows(i: int, j: int) -> Tensor:
            b = blocks[i:j]
            d = torch.from_numpy(b[:, :, :2].copy().view(np.float16)).float()  # [r, K/32, 1]
            q = torch.from_numpy(b[:, :, 2:].copy().view(np.int8)).float()  # [r, K/32, 32]
            return (q * d).reshape(j - i, k)
        return rows
    if t.tensor_type in (kind.F16, kind.F32) and tuple(data.shape) == (n, k):
        return lambda i, j: torch.from_numpy(np.array(data[i:j], dtype=np.float32))
    return None


def quantize_q4_1(w: Tensor) -> Q4Blocks:
    """Round a dense ``[N, K]`` weight to Q4_1 blocks (ggml ``quantize_row_q4_1_ref``): per block of
    32, ``m = min``, ``d = (max - min) / 15``, ``q = round((w - m) / d)`` in 0..15, ``d`` and ``m``
    stored as fp16.

    For weights that have no GGUF (the drafter's, :func:`quantize_linears_q4`).

    Raises:
        ValueError: ``w`` is not 2-D or ``K % 32 != 0``.
    """
    if w.ndim != 2 or w.shape[1] % Q4_GROUP:
        raise ValueError(f"Q4_1 needs a [N, K] weight with K % {Q4_GROUP} == 0, got {list(w.shape)}")
    n, k = w.shape
    g = w.detach().float().reshape(n, k // Q4_GROUP, Q4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((g - m[..., None]) * inv[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    return Q4Blocks(q, d, m)


def gguf_source(target_dir: str | Path) -> Path | None:
    """The GGUF a target directory was made from: a ``*.gguf`` file inside it, or, for the default
    target's converted directory, the package's ``SmolLM2-135M-Instruct.Q4_1.gguf``; else None."""
    from services.models import registry

    target_dir = Path(target_dir)
    files = sorted(target_dir.glob("*.gguf"))
    if files:
        return files[0]
    if target_dir.resolve() == (registry.cache_root() / registry.DEFAULT_TARGET).resolve():
        try:
            path = registry._gguf_dir() / registry.GGUF_FILE
        except registry.ModelNotFoundError:
            return None
        return path if path.exists() else None
    return None
