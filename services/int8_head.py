"""The ``q4`` format's lm_head as int8 rows through torch's weight-only int8 kernel (:class:`Int8RowLinear`).

The rows come from the GGUF's exact output weights where it has them (:mod:`services.gguf_blocks`),
cached next to the q4 packs (:mod:`services.pack_cache`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services import int_dot
from services.gguf_blocks import read_gguf_output_rows
from services.pack_cache import pack_key, pack_path, read_pack, write_pack
from services.weight_formats import get as get_format


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

    Where :func:`services.int_dot.enabled` (the native library with AVX-512 VNNI), the rows are
    multiplied by ``dartree_native::q8_mm`` instead: the activations quantized to int8 per block of
    32 and integer dot products, ~2.4x faster than torch's kernel at one row with the weight not in
    cache (``benchmarks/results/2026-12-07-int-dot``); the int8 rows are the same.

    Cost by rows (torch's kernel): the kernel reads the weight once per 4 rows, so up to 4 rows a call costs about
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

    q8_weight: Tensor | None  # [N, K] int8 (non-persistent buffer: not in the state dict), torch's kernel
    q8_packed: Tensor | None  # [N/16, K/4, 16, 4] uint8, the integer-dot kernel's pack (services.int_dot)
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
        # mapping (24 bytes past a 64-byte boundary here), which a compiled step's kernels crashed on.
        # The integer-dot kernel (services.int_dot) where it runs: its pack instead of the int8 rows.
        tiles = q.shape[0] % int_dot.LANES == 0 and q.shape[1] % int_dot.BLOCK == 0
        packed = int_dot.pack_q8(q) if tiles and int_dot.enabled() else None
        for name, t in (("q8_weight", None if packed is not None else q.clone(memory_format=torch.contiguous_format)),
                        ("q8_packed", packed),
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

    def int8_rows(self) -> tuple[Tensor, Tensor] | None:
        """``(q [N, K] int8, scale [N] bfloat16)`` this module multiplies by, or None before :meth:`set_int8`."""
        packed = self._buffers.get("q8_packed")
        if packed is not None:
            return int_dot.unpack_q8(packed), self.q8_scale
        q = self._buffers.get("q8_weight")
        return None if q is None else (q, self.q8_scale)

    def forward(self, x: Tensor) -> Tensor:
        packed = self._buffers.get("q8_packed")
        q = self._buffers.get("q8_weight") if packed is None else packed
        if q is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" and self.bias is None \
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)) \
                and (torch.compiler.is_compiling() or self._q8_version == self.weight._version):
            x2 = x.reshape(-1, self.in_features)
            if not x2.is_contiguous():
                x2 = x2.contiguous()
            y = torch.ops.aten._weight_int8pack_mm(x2, q, self.q8_scale) if packed is None \
                else torch.ops.dartree_native.q8_mm(x2, packed, self.q8_scale)
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        """Bytes of the int8 copy and its scales (0 when not built)."""
        rows = self._buffers.get("q8_packed")
        rows = self._buffers.get("q8_weight") if rows is None else rows
        return 0 if rows is None else rows.numel() + self.q8_scale.numel() * self.q8_scale.element_size()

    def extra_repr(self) -> str:
        return super().extra_repr() + ", int8 rows (weight-only, one scale per output row)"


def use_int8_lm_head(model: nn.Module, gguf_path: str | Path | None = None, cache: bool = False) -> int:
    """Serve ``model``'s output projection through :class:`Int8RowLinear` (in place).

    Applies to a plain bfloat16 CPU ``nn.Linear`` without bias when :func:`int8_lm_head_enabled`
    (:func:`services.weights.load_causal_lm` calls it before any oneDNN packing). The int8 rows
    are quantised from ``gguf_path``'s exact output weights where it has them
    (:func:`read_gguf_output_rows`; SmolLM2's Q8_0 embedding: next-token NLL 2.7721 against 2.7754
    quantised from the bfloat16-rounded weight), else from the module's weight. With ``cache`` and a
    GGUF, the copy is read from / written to the state directory next to the q4 packs (keyed as
    they are, :func:`services.q4_weights.q4_pack_key`): quantising took ~1.8 s of every q4 start on the 2-core VM.
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
        q4 = get_format("q4")  # cached next to the q4 packs, keyed as they are
        key = pack_key(gguf_path, model.config, torch.bfloat16, q4.kernels_version) + "|lm_head int8 rows"
        path = pack_path(q4.packs_dir, getattr(model.config, "_name_or_path", "") or "model", key)
        cached = (read_pack(path, key) or ({}, {}))[0]
        if {"q8_weight", "q8_scale"} <= cached.keys():
            try:
                return head.set_int8(cached["q8_weight"], cached["q8_scale"])
            except ValueError:
                pass  # another shape: quantised again below
    source = None if gguf_path is None else read_gguf_output_rows(gguf_path, tuple(head.weight.shape))
    nbytes = head.requantize(source)
    if path is not None:
        q, scale = head.int8_rows()
        write_pack(path, key, {"q8_weight": q.contiguous(), "q8_scale": scale})
    return nbytes
