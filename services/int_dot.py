"""Integer-dot CPU linears for the ``q4`` format: the packs, the switch and the torch reference.

The native library (:mod:`services.native_lib`, kernels in ``services/verifier/int_dot.h``) holds
``dartree_native::q4_mm`` (the Q4_1 int4 linears) and ``dartree_native::q8_mm`` (the int8 lm_head
rows). Both quantize each activation row to int8 per block of 32 (llama.cpp's Q8_1 for its Q4_1 dot
products) and multiply with integer dot products (AVX-512 VNNI ``vpdpbusd``), where torch's weight-only
kernels turn every weight into a float first. On the 2-core AVX-512 EPYC the one-row q4 step's int4
linears and lm_head took ~6.2 of its ~9.8 ms through torch's kernels, reading ~14 and ~12 GB/s of the
~40 GB/s the cores read (``benchmarks/results/2026-12-07-int-dot``).

Numerics (:func:`q4_reference`, :func:`q8_reference`: the same arithmetic in torch, bit for bit): the
Q4_1 weights are exact (``d``, ``m`` kept fp16 as in the GGUF), each activation block of 32 is rounded
to ``dx * xq`` with ``dx = max|x| / 127`` and ``xq`` an int8, every row is computed alone in a fixed
order, so a row's output does not depend on the other rows of the call: speculative rows equal the
rows plain decoding computes (``tests/engine/test_int_dot.py``). The served model is therefore the
GGUF's weights against 8-bit activations, as in llama.cpp, not torch's kernel's bfloat16 block
constants against bfloat16 activations; ``ar`` and every speculative method run the same kernels.

Used where :func:`enabled`: the library is built and loaded, its kernels use VNNI (a CPU without it
keeps torch's kernels: the scalar build of the same arithmetic is the test reference, not a serving
path), and ``DARTREE_INT_DOT`` is not ``0``. A module decides once, when it is built, so one model
never mixes the two arithmetics.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from services import native_lib

BLOCK = 32  # activation and Q4_1 block
LANES = 16  # output columns per kernel tile


def enabled() -> bool:
    """Whether new q4 linears and int8 lm_heads use the integer-dot kernels (see the module doc)."""
    if os.environ.get("DARTREE_INT_DOT", "1").strip() == "0":
        return False
    return isa() == "avx512_vnni"


def isa() -> str | None:
    """The instructions of this machine's library build (``"avx512_vnni"`` or ``"scalar"``), or None
    when the native library is not loaded and cannot be (not built, switched off, failed)."""
    if not native_lib.load():
        return None
    return torch.ops.dartree_native.int_dot_isa()


def pack_q4(q: Tensor, d: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel's layout of one Q4_1 matrix ``w = d * q + m``.

    Args:
        q: ``[N, K]`` integers in 0..15; d, m: ``[N, K / 32]`` (fp16 values). ``N % 16 == 0``, ``K % 32 == 0``.
    Returns:
        ``qw`` uint8 ``[N/16, K/8, 16, 4]`` (byte b of lane l in octet j: ``q[16t+l, 8j+b] | q[16t+l, 8j+4+b] << 4``)
        and ``dm`` fp16 ``[N/16, K/32, 2, 16]`` (``d`` then ``m`` of each block, lane by lane).
    Raises:
        ValueError: shapes the kernel cannot tile.
    """
    n, k = q.shape
    if n % LANES or k % BLOCK or tuple(d.shape) != (n, k // BLOCK) or tuple(m.shape) != (n, k // BLOCK):
        raise ValueError(f"q4 pack needs q [N, K] with N % 16 == 0, K % 32 == 0 and d, m [N, K/32]; got "
                         f"q {list(q.shape)}, d {list(d.shape)}, m {list(m.shape)}")
    qq = q.to(torch.uint8).reshape(n // LANES, LANES, k // 8, 2, 4)  # [t, l, j, half, b]
    qw = (qq[:, :, :, 0] | (qq[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    dm = torch.stack([d, m], 0).to(torch.float16).reshape(2, n // LANES, LANES, k // BLOCK)
    return qw, dm.permute(1, 3, 0, 2).contiguous()


def unpack_q4(qw: Tensor, dm: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(q [N, K] int32, d [N, K/32] float32, m [N, K/32] float32)`` back from :func:`pack_q4`'s layout."""
    t, j = qw.shape[0], qw.shape[1]
    lo, hi = (qw & 15).to(torch.int32), (qw >> 4).to(torch.int32)
    q = torch.stack([lo, hi], 3).permute(0, 2, 1, 3, 4).reshape(t * LANES, j * 8)
    dmf = dm.float().permute(2, 0, 3, 1).reshape(2, t * LANES, dm.shape[1])
    return q, dmf[0], dmf[1]


def pack_q8(q: Tensor) -> Tensor:
    """The kernel's layout of int8 rows ``q [N, K]`` (``N % 16 == 0``, ``K % 32 == 0``): uint8
    ``[N/16, K/4, 16, 4]`` holding ``q + 128``.

    Raises:
        ValueError: shapes the kernel cannot tile, or ``q`` not int8.
    """
    n, k = q.shape
    if q.dtype != torch.int8 or n % LANES or k % BLOCK:
        raise ValueError(f"int8 pack needs int8 q [N, K] with N % 16 == 0 and K % 32 == 0; got {q.dtype} {list(q.shape)}")
    u = (q.view(torch.uint8) ^ 128).reshape(n // LANES, LANES, k // 4, 4)  # q + 128 as a byte: the sign bit flipped
    return u.permute(0, 2, 1, 3).contiguous()


def unpack_q8(qw: Tensor) -> Tensor:
    """The int8 rows ``q [N, K]`` back from :func:`pack_q8`'s layout."""
    t, j = qw.shape[0], qw.shape[1]
    return (qw ^ 128).view(torch.int8).permute(0, 2, 1, 3).reshape(t * LANES, j * 4)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kernels' activation quantization of ``x [M, K]``: ``xq [M, K]`` int32 (in -127..127),
    ``dx``, ``dxs`` ``[M, K/32]`` float32 and ``sxq [M, K/32]`` int32 (see the module doc)."""
    xf = x.float().reshape(x.shape[0], -1, BLOCK)
    a = xf.abs().amax(-1, keepdim=True)
    dx = a / 127.0
    xq = torch.where(a == 0, torch.zeros_like(xf), torch.round(xf / dx)).clamp(-127, 127)
    xq = xq.to(torch.int32)
    sxq = xq.sum(-1)
    dx = dx.squeeze(-1)
    return xq.reshape(x.shape), dx, dx * sxq.float(), sxq


def q4_reference(x: Tensor, qw: Tensor, dm: Tensor) -> Tensor:
    """``dartree_native::q4_mm`` in torch, the same bits: ``x [M, K]`` (bfloat16 / float32) times the
    packed Q4_1 weight -> ``[M, N]`` in ``x``'s dtype. Slow (a loop over blocks); tests only."""
    q, d, m = unpack_q4(qw, dm)
    xq, dx, dxs, _ = quantize_rows(x)
    isum = _block_sums(xq, q)
    acc = torch.zeros(x.shape[0], q.shape[0])
    for g in range(q.shape[1] // BLOCK):
        t1 = (isum[:, g].float() * d[:, g]) * dx[:, g, None]
        acc = (acc + t1) + m[:, g] * dxs[:, g, None]
    return acc.to(x.dtype)


def q8_reference(x: Tensor, qw: Tensor, scale: Tensor) -> Tensor:
    """``dartree_native::q8_mm`` in torch, the same bits: ``x [M, K]`` times the packed int8 rows with
    their bfloat16 ``scale [N]`` -> ``[M, N]`` in ``x``'s dtype. Slow; tests only."""
    q = unpack_q8(qw)
    xq, dx, _, _ = quantize_rows(x)
    isum = _block_sums(xq, q)
    acc = torch.zeros(x.shape[0], q.shape[0])
    for g in range(q.shape[1] // BLOCK):
        acc = acc + isum[:, g].float() * dx[:, g, None]
    return (acc * scale.float()).to(x.dtype)


def _block_sums(xq: Tensor, q: Tensor) -> Tensor:
    """``[M, K / 32, N]`` int32: ``sum`` over each block of 32 of ``xq [M, K] * q [N, K]``, exactly
    (float64 products and sums of integers far below 2^53)."""
    n, k = q.shape
    return torch.einsum("mgb,ngb->mgn", xq.reshape(-1, k // BLOCK, BLOCK).double(),
                        q.reshape(n, -1, BLOCK).double()).to(torch.int32)
