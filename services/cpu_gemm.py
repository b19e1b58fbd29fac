"""Pre-packed float32 GEMM weights for the fixed row counts of speculative rounds on CPU.

Why: a tree verify multiplies every weight by ``N + 1`` rows (9 at the CPU default B = 8) and the
drafter's block by 16 rows. For such small row counts MKL's ``sgemm`` re-packs the whole weight on
every call, which on the 2-core CI machine makes a 17-row linear cost ~2.4x a 1-row one although the
arithmetic is hardly the bottleneck. MKL can pack a weight once for a given row count
(``cblas_sgemm_pack``, exposed by torch as ``torch.ops.mkl._mkl_reorder_linear_weight`` /
``_mkl_linear``, the kernels torch.compile's CPU freezing pass uses). On SmolLM2-135M
``python -m benchmarks.bench_verify`` (2 threads) measured a 16-node verify at 72.0 -> 63.0 ms and a
64-node one at 132 -> 114 ms (benchmarks/README.md, "Other figures"). The packed kernel gave results bitwise equal to ``F.linear``
for the packed row count in our probes; tests check agreement to float32 rounding.

How: :func:`pack_linears` turns the ``nn.Linear`` modules of a model *in place* into
:class:`PackedLinear` (a subclass: same parameters, same state-dict keys, tied weights stay tied,
every reference to the module sees the packs). A call whose row count ``M`` fits a packed size
``R`` (``R/2 < M <= R``) zero-pads to ``R`` rows and uses the packed weight; any other call, any
non-float32/non-CPU input, and any call that needs autograd runs plain ``F.linear``. A weight that
is modified in place after packing (``load_state_dict``, an optimiser step) drops its packs. With
``lazy=True`` (what the server does) a row count is packed on its first call instead of up front, so
the packs' memory (each ~ the weight's size) follows the step sizes that really run.

Everything here is a no-op where the MKL ops are missing (non-MKL builds, other CPUs); only this
module touches those private torch ops.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)

__all__ = ["PackedLinear", "pack_linears", "packing_available", "packed_bytes", "lazy_packing_paused", "OneDNNLinear", "pack_linears_bf16",
           "onednn_bf16_available", "rows_are_independent", "ONEDNN_MAX_ROWS", "cached_verdicts"]


def packing_available() -> bool:
    """True when this torch build has MKL's packed-sgemm ops (x86 CPU builds with MKL)."""
    try:
        return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight") \
            and hasattr(torch.ops.mkl, "_mkl_linear")
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` with MKL-packed copies of its weight for some row counts (see the module doc).

    Not constructed directly: :func:`pack_linears` converts existing modules. ``forward`` has the
    ``nn.Linear`` contract: ``[..., in_features] -> [..., out_features]``.
    """

    _packs: dict[int, Tensor]
    _packed_version: int
    _lazy: tuple[int, ...] = ()  # row counts packed on their first call (``pack_linears(lazy=True)``)

    def add_rows(self, rows: Iterable[int]) -> int:
        """Pack the weight for each row count in ``rows`` not packed yet; returns bytes added.

        Raises:
            ValueError: a row count < 2 (one row runs MKL's GEMV, which packing does not help).
        """
        added = 0
        w = self.weight.detach()
        if self._packs and self._packed_version != self.weight._version:
            self._packs.clear()
        for r in sorted(set(int(r) for r in rows)):
            if r < 2:
                raise ValueError(f"packed row counts must be >= 2, got {r}")
            if r not in self._packs:
                self._packs[r] = torch.ops.mkl._mkl_reorder_linear_weight(w, r)
                added += _pack_bytes(w)
        self._packed_version = self.weight._version
        _PACKED[id(self.weight)] = self
        return added

    def _rows_for(self, m: int) -> int | None:
        for r in sorted(set(self._packs) | set(self._lazy)):
            if m <= r:
                return r if 2 * m > r else None
        return None

    def forward(self, x: Tensor) -> Tensor:
        packs = self._packs
        if (packs or self._lazy) and x.device.type == "cpu" and x.dtype == torch.float32 and self.weight.dtype == torch.float32 \
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            if torch.compiler.is_compiling():  # traced: one opaque op (inductor cannot lower an eager pack)
                y = torch.ops.dartree.packed_linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
                return y.reshape(*x.shape[:-1], self.out_features)
            if self._packed_version != self.weight._version:  # weight changed in place: packs are stale
                packs.clear()
                if self._lazy:  # packed again from the current weight on the next calls
                    self._packed_version = self.weight._version
                    return self._packed(x)
            else:
                return self._packed(x)
        return F.linear(x, self.weight, self.bias)

    def _packed(self, x: Tensor) -> Tensor:
        k = x.shape[-1]
        m = x.numel() // k if k else 0
        r = self._rows_for(m) if m > 1 else None
        if r is None:
            return F.linear(x, self.weight, self.bias)
        if r not in self._packs:  # a lazy row count's first call: pack now (about one call's own re-pack)
            if _LAZY_PAUSED:
                return F.linear(x, self.weight, self.bias)
            with torch.inference_mode(False), torch.no_grad():
                self._packs[r] = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), r)
        x2 = x.reshape(m, k)
        if r > m:
            x2 = torch.cat([x2, x2.new_zeros(r - m, k)])
        elif not x2.is_contiguous():
            x2 = x2.contiguous()
        y = torch.ops.mkl._mkl_linear(x2, self._packs[r], self.weight, self.bias, r)
        return y[:m].reshape(*x.shape[:-1], self.out_features)

    def _pack_valid(self) -> bool:
        return bool(self._packs or self._lazy) and self._packed_version == self.weight._version


_LAZY_PAUSED = 0  # > 0 inside lazy_packing_paused(): first calls of a lazy row count do not pack


@contextlib.contextmanager
def lazy_packing_paused():
    """Inside: a lazy row count's first call runs ``F.linear`` and packs nothing (packs made before
    are used), e.g. while a start-up sweep times step sizes that serving may never run."""
    global _LAZY_PAUSED
    _LAZY_PAUSED += 1
    try:
        yield
    finally:
        _LAZY_PAUSED -= 1


def _pack_bytes(w: Tensor) -> int:
    """Memory a pack of ``w`` uses: about the weight's own size. (torch allocates the pack buffer as
    float32 elements counted in bytes, so its ``numel() * element_size()`` is ~4x larger, but the
    pages beyond the packed data are never touched.)"""
    return w.numel() * w.element_size()


def pack_linears(module: nn.Module, rows: Iterable[int], lazy: bool = False) -> int:
    """Convert every float32 CPU ``nn.Linear`` under ``module`` (itself included) to
    :class:`PackedLinear` packed for ``rows``; modules met twice (shared) are packed once.

    Args:
        module: a model (its linears are changed in place; parameters and keys are untouched).
        rows: row counts (``>= 2``) to pack for, e.g. ``[budget + 1]`` for a tree verify.
        lazy: pack each row count on its first call instead of now, so the packs' memory follows
            the row counts the engine really runs (each pack ~ the weight's size; packing costs
            about what one unpacked call spends re-packing the weight anyway).
    Returns:
        Approximate bytes of packed weights added now (0 when lazy, when MKL packing is
        unavailable or nothing qualified); :func:`packed_bytes` counts what is packed later.
    Raises:
        ValueError: a row count < 2.
    """
    rows = [int(r) for r in rows]
    if any(r < 2 for r in rows):
        raise ValueError(f"packed row counts must be >= 2, got {rows}")
    if not rows or not packing_available():
        return 0
    added, seen = 0, set()
    for m in module.modules():
        if not isinstance(m, nn.Linear) or id(m) in seen:
            continue
        seen.add(id(m))
        if m.weight.device.type != "cpu" or m.weight.dtype != torch.float32:
            continue
        if type(m) is nn.Linear:
            m.__class__ = PackedLinear
            m._packs, m._packed_version = {}, m.weight._version
        if isinstance(m, PackedLinear) and lazy:
            m._lazy = tuple(sorted(set(m._lazy) | set(rows)))
            _PACKED[id(m.weight)] = m
        elif isinstance(m, PackedLinear):
            added += m.add_rows(rows)
    if lazy:
        log.info("float32 GEMM weights pack on first use for %s rows (~%.0f MB each)", sorted(set(rows)),
                 sum(_pack_bytes(m.weight) for m in module.modules() if isinstance(m, PackedLinear)) / 2**20)
    if added:
        log.info("packed float32 GEMM weights for %s rows: %.0f MB", sorted(set(rows)), added / 2**20)
    return added


def packed_bytes(module: nn.Module) -> int:
    """Bytes held by packed weights under ``module``: float32 MKL packs (one per packed row count)
    and bfloat16 oneDNN packs, each shared linear counted once."""
    seen, total = set(), 0
    for m in module.modules():
        if id(m) in seen:
            continue
        seen.add(id(m))
        if isinstance(m, PackedLinear):
            total += len(m._packs) * _pack_bytes(m.weight)
        elif isinstance(m, OneDNNLinear) and m._onednn_pack is not None:
            total += _pack_bytes(m.weight)
    return total


# ---------------------------------------------------------------------------- bfloat16 (oneDNN)
#
# Why: a bfloat16 ``F.linear`` on CPU goes to oneDNN, which reorders the whole weight into its
# blocked (AMX / avx512_bf16) layout on *every* call. Reordered once, the same kernel costs about
# half: on a 2-core Sapphire Rapids machine (1 thread) a 1536 x 576 linear
# 130 -> 64 us at 1 row, 145 -> 71 us at 9 rows, 156 -> 85 us at 17 rows (AMX makes 9 rows cost
# ~1.1x one row; torch's int4 kernel, 64 us at 1 row, costs 273 us at 9), and the 49152 x 576 lm_head
# 4.1 -> 3.0 ms. These are the ops torch.compile's CPU freezing pass emits
# (``mkldnn._reorder_linear_weight`` / ``mkldnn._linear_pointwise``).
#
# Exactness: packed for a batch-size hint of 1, the kernel gave every row bitwise the result of that
# row alone for every row count 1..128 and every SmolLM2 linear shape on a Sapphire Rapids machine;
# beyond ~130 rows oneDNN switched blocking for the 576 x 1536 down projection. On an AVX-512-bf16
# AMD EPYC the same down projection changes rows in their last bits from 2-row calls on, for some
# inputs. So :func:`pack_linears_bf16` finds each shape's :func:`invariant_rows` on the machine at
# load and cuts calls into pieces of that many rows (at most ``ONEDNN_MAX_ROWS``): batched == solo
# and a tree verify == each path alone stay exact (tests/engine/test_cpu_gemm.py checks this on the
# machine that runs the tests).
# Results equal ``F.linear`` on the same bf16 weight (the same kernel, without the per-call reorder).

ONEDNN_MAX_ROWS = 128


def onednn_bf16_available() -> bool:
    """True when this torch build can run oneDNN's pre-packed bfloat16 linear on this CPU."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and torch.ops.mkldnn._is_mkldnn_bf16_supported() \
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


class OneDNNLinear(nn.Linear):
    """A bfloat16 ``nn.Linear`` whose weight is also held in oneDNN's packed layout (see above).

    Not constructed directly: :func:`pack_linears_bf16` converts existing modules in place (same
    parameters, same state-dict keys, tied weights stay tied). ``forward``: ``[..., in_features] ->
    [..., out_features]``; CPU bfloat16 inputs outside autograd use the pack, in pieces of at most
    ``max_rows`` rows (under ``torch.compile`` as the opaque op ``dartree::packed_linear``: inductor
    cannot lower an eager pack); anything else, and a weight changed in place since packing, runs
    ``F.linear``.
    """

    _onednn_pack: Tensor | None
    _packed_version: int
    max_rows: int

    def repack(self) -> int:
        """(Re)build the pack from the current weight; returns its bytes."""
        w = self.weight.detach()
        self._onednn_pack = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        self._packed_version = self.weight._version
        _PACKED[id(self.weight)] = self
        return w.numel() * w.element_size()

    def _pack_valid(self) -> bool:
        return self._onednn_pack is not None and self._packed_version == self.weight._version

    def forward(self, x: Tensor) -> Tensor:
        pack = self._onednn_pack
        if pack is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu" \
                and self.weight.dtype == torch.bfloat16 \
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            if torch.compiler.is_compiling():  # traced: one opaque op (inductor cannot lower an eager pack)
                y = torch.ops.dartree.packed_linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias)
                return y.reshape(*x.shape[:-1], self.out_features)
            if self._packed_version != self.weight._version:  # weight changed in place: the pack is stale
                self._onednn_pack = None
            else:
                return self._packed(x)
        return F.linear(x, self.weight, self.bias)

    def _packed(self, x: Tensor) -> Tensor:
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        m, cap, pack = x2.shape[0], self.max_rows, self._onednn_pack
        if m <= cap:
            y = torch.ops.mkldnn._linear_pointwise(x2, pack, self.bias, "none", [], "")
        else:
            y = torch.cat([torch.ops.mkldnn._linear_pointwise(x2[i:i + cap], pack, self.bias, "none", [], "")
                           for i in range(0, m, cap)])
        return y.reshape(*x.shape[:-1], self.out_features)


# weight tensor id -> its packed module (PackedLinear / OneDNNLinear), for the opaque op of compiled
# steps; registered when packing (never inside a traced forward: a dict write there is a graph break
# per linear, and the resumed frames then recompile per layer until dynamo gives up), weak (a
# module that is gone drops out)
_PACKED: "weakref.WeakValueDictionary[int, nn.Linear]" = weakref.WeakValueDictionary()


@torch.library.custom_op("dartree::packed_linear", mutates_args=())
def _packed_linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``[M, K] -> [M, N]``: the pre-packed call (:class:`PackedLinear` / :class:`OneDNNLinear`) of the
    module owning ``weight``, as one opaque op inside a ``torch.compile``'d step; eager body, plain
    ``F.linear`` when that module's packs are gone or stale."""
    mod = _PACKED.get(id(weight))
    if mod is None or mod.weight is not weight or not mod._pack_valid():
        return F.linear(x, weight, bias)
    return mod._packed(x)


@_packed_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def rows_are_independent(lin: OneDNNLinear, rows: Iterable[int] = (2, 9, 17, 33, 64, ONEDNN_MAX_ROWS),
                         samples: int = 256, seed: int = 0) -> bool:
    """Whether ``lin`` gives every row of a call of each row count ``m`` in ``rows`` bitwise the result
    of that row alone (oneDNN picks kernels per shape and CPU, see the section doc).

    Whether a kernel's blocking changes a row shows only for some inputs (a last-bit rounding
    difference), so each count is tried on ``samples`` random rows (``samples // m`` calls of ``m``
    rows, at least one).

    Args:
        lin: a packed module; its calls are made through its own ``forward`` (so its ``max_rows``
            cut applies).
        rows: the row counts to try.
        samples: random input rows per count.
        seed: seed of the random inputs.
    """
    rows = sorted(set(int(m) for m in rows))
    n = max(samples, max(rows))
    key = (id(lin), lin._packed_version, n, seed)
    with torch.inference_mode():
        if key in _SOLO:  # invariant_rows probing this module count after count: the same inputs, solo rows
            x, solo = _SOLO[key]
        else:
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(n, lin.in_features, generator=g).to(torch.bfloat16)
            solo = torch.cat([lin(x[i:i + 1]) for i in range(n)])
            if _SOLO.get("probing") is lin:
                _SOLO[key] = (x, solo)
        for m in rows:
            used = max(m, n - n % m)
            y = torch.cat([lin(x[i:i + m]) for i in range(0, used, m)])
            if not torch.equal(y, solo[:used]):
                return False
    return True


def invariant_rows(lin: OneDNNLinear, limit: int = ONEDNN_MAX_ROWS, dense: int = 9) -> int:
    """The largest row count ``r <= limit`` for which every call of 1..r rows gives each row bitwise the
    result of that row alone, as far as random probes show, on this CPU and thread count.

    The counts 2..``dense`` are tried one by one, then 16, 17, 32, 33, 64, 65 and ``limit``
    (:func:`rows_are_independent`); the answer is the last count before the first failure (1 when
    two-row calls already differ). A call cut into pieces of ``r`` rows is then batch-invariant: a
    request's rows never depend on which other rows share the step. Seen on an AVX-512-bf16 AMD
    EPYC: SmolLM2's 576 x 1536 down projection differs from 2-row calls on for some inputs (so
    ``r = 1``), every other shape keeps ``r = limit``.

    Args:
        lin: a packed module (its ``max_rows`` is set to ``limit`` while checking).
        limit: the largest row count of interest (>= 1).
        dense: the counts tried one by one.
    Returns:
        ``r`` in ``[1, limit]``.
    """
    lin.max_rows = limit
    counts = list(range(2, min(dense, limit) + 1)) + [m for m in (16, 17, 32, 33, 64, 65, limit) if dense < m <= limit]
    best = 1
    _SOLO.clear()
    _SOLO["probing"] = lin  # the one-row reference is computed once for all counts, not once per count
    try:
        for m in sorted(set(counts)):
            if not rows_are_independent(lin, rows=[m]):
                break
            best = m
    finally:
        _SOLO.clear()
    return best


# the inputs and one-row outputs of the module :func:`invariant_rows` is probing, shared by its
# counts (a 49152-row lm_head: 256 one-row calls once instead of once per count, ~5x less probe time)
_SOLO: dict = {}


def _verdict_key(max_rows: int) -> str:
    """What an :func:`invariant_rows` verdict depends on besides the shape: the CPU and its flags,
    torch (its oneDNN), the intra-op threads and the limit probed up to."""
    from services.machine_cache import machine_id

    return f"{machine_id(torch.__version__)}|threads {torch.get_num_threads()}|limit {max_rows}"


def cached_verdicts(max_rows: int = ONEDNN_MAX_ROWS) -> dict[str, int]:
    """Weight shape (``"N x K"``) -> its :func:`invariant_rows` found on this machine before
    (``<state dir>/onednn_rows.json``, :mod:`services.machine_cache`); empty when none."""
    from services.machine_cache import ONEDNN_ROWS, read_entries, state_dir

    entry = read_entries(state_dir() / ONEDNN_ROWS).get(_verdict_key(max_rows))
    rows = entry.get("rows") if isinstance(entry, dict) else None
    return {str(k): int(v) for k, v in rows.items()} if isinstance(rows, dict) else {}


def _remember_verdicts(max_rows: int, rows: dict[str, int]) -> None:
    from services.machine_cache import ONEDNN_ROWS, state_dir, write_entry

    write_entry(state_dir() / ONEDNN_ROWS, _verdict_key(max_rows), {"rows": dict(sorted(rows.items()))})


def pack_linears_bf16(module: nn.Module, max_rows: int = ONEDNN_MAX_ROWS, check: bool = True) -> int:
    """Convert every bfloat16 CPU ``nn.Linear`` under ``module`` (itself included) to
    :class:`OneDNNLinear`; a module met twice (shared) is packed once.

    Args:
        module: a model (changed in place; parameters and state-dict keys untouched).
        max_rows: the largest row count one kernel call gets (larger calls are cut into pieces).
        check: find each distinct weight shape's :func:`invariant_rows` on this CPU and cut that
            shape's calls into pieces of that many rows (logged when below ``max_rows``), so batched ==
            solo never depends on the kernel's blocking (on an AVX-512-bf16 EPYC the 576 x 1536 down
            projection changes rows from 2-row calls on for some inputs: its calls go row by row).
            A verdict found once is kept per machine, torch, thread count and shape
            (:func:`cached_verdicts`): SmolLM2's 49152 x 576 lm_head alone took 3.8 s to probe at
            every start of the 2-core VM.
    Returns:
        Bytes of packed weights added (0 when oneDNN bf16 is unavailable or nothing qualified).
    Raises:
        ValueError: ``max_rows < 1``.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    if not onednn_bf16_available():
        return 0
    added, seen, verdict = 0, set(), {}
    known = cached_verdicts(max_rows) if check else {}
    new: dict[str, int] = {}
    for m in module.modules():
        if not isinstance(m, nn.Linear) or id(m) in seen:
            continue
        seen.add(id(m))
        if m.weight.device.type != "cpu" or m.weight.dtype != torch.bfloat16 or type(m) not in (nn.Linear, OneDNNLinear):
            continue
        if isinstance(m, OneDNNLinear) and m._pack_valid():
            continue  # already packed (a borrowed module, e.g. the target's lm_head in the drafter)
        m.__class__ = OneDNNLinear
        m.max_rows = max_rows
        size = m.repack()
        shape = tuple(m.weight.shape)
        if check:
            name = f"{shape[0]} x {shape[1]}"
            if shape not in verdict and name in known and 1 <= known[name] <= max_rows:
                verdict[shape] = known[name]
            elif shape not in verdict:
                verdict[shape] = new[name] = invariant_rows(m, limit=max_rows)
                if verdict[shape] < max_rows:
                    log.info("oneDNN bf16 linear %s: rows depend on the row count past %d rows here; "
                             "calls are cut into pieces of %d rows", list(shape), verdict[shape], verdict[shape])
            m.max_rows = verdict[shape]
        added += size
    if new:
        _remember_verdicts(max_rows, {**known, **new})
    if added:
        log.info("packed bfloat16 GEMM weights (oneDNN, <= %d rows per call): %.0f MB", max_rows, added / 2**20)
    return added
