"""The slot attention as a C++ operator (``dartree_native::slot_attention``), built on this machine.

Why: in a compiled q4 step on the 2-core CPU the Python body of the opaque slot-attention op
(:func:`services.verifier.slot_attention.slot_attention_eager` with :func:`services.verifier.attention.attend`)
spent ~30 µs of interpreter time per layer beyond its ATen calls, and its ATen calls (two oneDNN
bfloat16 ``bmm`` per request, ~15 µs each for 2-3 µs of arithmetic at one row, plus the softmax)
~40 µs more (``torch.profiler``, 2026-12-05: attention 1.2 ms of a ~7.3 ms step).

``dartree_native::slot_attention`` is a fused kernel (``fused_attention.h``): one call per layer writes
every request's K/V rows into its slot and attends each request's rows (decode rows, tree verifies,
prompt chunks) to its slot up to its KV length, with its tree / causal mask, without a GEMM: per
(request, KV head) it loops over the slot's columns, ``q . k`` and ``sum p v`` accumulated in
float32 in a fixed order, a two-pass softmax, bfloat16 / float16 / float32 caches, grouped query
heads read from their KV head in place, tasks spread over torch's threads (``at::parallel_for``).
Each row's output depends on nothing but its own query, mask row and slot, so it is bitwise the
same alone or beside any rows or requests, and masked columns change nothing: speculative rows equal
the rows plain decoding computes with it (tests/engine/test_fused_attention.py). It differs from the
Python body's bits (that rounds scores and probabilities to bfloat16) by about one bfloat16 ulp.
``dartree_native::slot_attention_aten`` keeps the Python body's ATen calls in C++ (the same bits as the
Python body: tests/engine/test_native_attention.py), the reference of the fused kernel and the op
compiled steps call with ``DARTREE_NATIVE_ATTENTION=aten`` or a head dim that is not a multiple of 16.
Only the CPU bfloat16 / float16 path with the grouped attention
(:func:`~services.verifier.attention.use_grouped`) calls the native ops; every other step keeps the
Python body. The same library holds ``dartree_native::int4_mm``, torch's int4 CPU kernel with its
group size as an int, which compiled q4 linears call (:class:`services.q4_weights.Int4Linear`; the
``quantized::int4mm_packed_weight_cpu`` overload inductor emits reads the group size from a tensor,
one ``item()`` a call), and the integer-dot q4 linears and int8 lm_head (``dartree_native::q4_mm``,
``dartree_native::q8_mm``; ``int_dot.h``, :mod:`services.int_dot`).

Built with the system C++ compiler (``$CXX``, else ``g++``; ``-O3 -march=native``) against the
installed torch's headers and libraries (``make setup`` runs ``python -m services.native_lib``;
~15 s on the 2-core CPU) into ``<state dir>/native/<key>/`` (``$DARTREE_CACHE_DIR``, else
``~/.cache/dartree``), where ``key`` hashes the sources, torch's version, the compiler flags and the
CPU's feature flags, so a torch upgrade, a changed source or another CPU builds again. A compiled
runner that finds no library builds it (:func:`load` with ``build=True``); where that fails the step
runs the Python body. ``DARTREE_NATIVE_ATTENTION=0`` switches the native ops off; ``=aten`` keeps
them but runs the ATen-call attention instead of the fused kernel.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch


log = logging.getLogger("verifier.native")

SOURCE = Path(__file__).parent / "verifier" / "native_attention.cpp"
HEADERS = (SOURCE.with_name("fused_attention.h"), SOURCE.with_name("int_dot.h"))  # included by SOURCE: part of the cache key
_SWITCH = os.environ.get("DARTREE_NATIVE_ATTENTION", "1").strip().lower()
ENABLED = _SWITCH != "0"
FUSED = _SWITCH != "aten"  # ``aten``: the compiled step calls slot_attention_aten (the Python body's ATen calls)
_LOADED = False  # the library is loaded in this process
_GAVE_UP = False  # its build or load failed in this process: not tried again


def _flags() -> list[str]:
    """Compiler and linker flags for a library that links against the installed torch."""
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -march=native: this CPU's vector units (the library is cached per machine); -ffp-contract=off: no
    # multiply-adds fused behind the kernel's back (its fixed summation order, fused_attention.h);
    # -fopenmp: at::parallel_for's OpenMP body is compiled into the caller
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    flags += [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    for p in library_paths():
        flags += [f"-L{p}", f"-Wl,-rpath,{p}"]
    return flags + ["-lc10", "-ltorch_cpu", "-ltorch"]


def _cpu_flags() -> str:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def library_path(root: Path | None = None) -> Path:
    """Where this machine's build of the current source for the installed torch lives (it may not
    exist), under ``root`` (default: the state directory)."""
    from services.machine_cache import state_dir

    h = hashlib.sha256(SOURCE.read_bytes())
    for header in HEADERS:
        h.update(header.read_bytes())
    h.update(torch.__version__.encode())
    h.update(_cpu_flags().encode())  # -march=native: a copied state directory on another CPU builds again
    h.update(" ".join(_flags()).encode())
    return (root or state_dir()) / "native" / h.hexdigest()[:16] / "dartree_native.so"


def _built_path() -> Path:
    """The state directory's build, else the same build (same key) in the default state directory,
    where ``make setup`` puts it (a state directory moved with ``$DARTREE_CACHE_DIR``, as the test
    suite does, still finds it), else the state directory's path (not built)."""
    path = library_path()
    if not path.exists():
        env = os.environ.get("DARTREE_CACHE")
        default = library_path(Path(env) if env else Path.home() / ".cache" / "dartree")
        if default.exists():
            return default
    return path


def build_library(compiler: str | None = None) -> Path:
    """Compile :data:`SOURCE` into :func:`library_path` (nothing to do when it exists); returns the path.

    Raises:
        RuntimeError: no compiler, or the compile failed (its last output lines in the message).
    """
    out = library_path()
    if out.exists():
        return out
    cxx = compiler or os.environ.get("CXX") or "g++"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = [cxx, str(SOURCE), "-o", str(tmp), *_flags()]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise RuntimeError(f"cannot run the C++ compiler {cxx!r}: {e}") from None
    if res.returncode != 0:
        tmp.unlink(missing_ok=True)  # a partial output of the failed compile
        tail = " | ".join((res.stderr or res.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"building the native slot attention failed ({cxx}): {tail}")
    tmp.replace(out)
    return out


def load(build: bool = False) -> bool:
    """Load this machine's library once per process; True when ``torch.ops.dartree_native.slot_attention``
    is available. ``build``: compile it first when it is missing (~8 s on the 2-core CPU; the compiled
    steps that use it need the same compiler for inductor anyway). False when switched off
    (``DARTREE_NATIVE_ATTENTION=0``), not built, or when its build or load failed (logged; not tried
    again in this process): the attention then runs its Python body, with the same results."""
    global _LOADED, _GAVE_UP
    if not ENABLED:
        return False
    if _LOADED:
        return True
    if _GAVE_UP:
        return False
    path = _built_path()
    if not path.exists():
        if not build:
            log.info("native slot attention not built for this torch (run `make setup` or `python -m "
                     "services.native_lib`); the attention runs its Python body")
            return False
        try:
            path = build_library()
        except RuntimeError as e:
            log.warning("%s; the attention runs its Python body", e)
            _GAVE_UP = True
            return False
        log.info("built the native slot attention: %s", path)
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        log.warning("could not load the native slot attention %s: %s; the attention runs its Python body", path, e)
        _GAVE_UP = True
        return False
    _register_fake()
    _LOADED = True
    return True


def _register_fake() -> None:
    @torch.library.register_fake("dartree_native::slot_attention")
    def _(query, key, value, layer, scaling):
        return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])

    @torch.library.register_fake("dartree_native::slot_attention_aten")
    def _(query, key, value, layer, scaling):
        return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])

    @torch.library.register_fake("dartree_native::int4_mm")
    def _(x, packed, group_size, scale_zeros):
        return x.new_empty(x.shape[0], scale_zeros.shape[1])

    @torch.library.register_fake("dartree_native::q4_mm")
    def _(x, qw, dm):
        return x.new_empty(x.shape[0], qw.shape[0] * 16)

    @torch.library.register_fake("dartree_native::q8_mm")
    def _(x, qw, scale):
        return x.new_empty(x.shape[0], qw.shape[0] * 16)


def fused_head_dim(head_dim: int) -> bool:
    """Whether the fused kernel serves this head dim (a multiple of its 16 float32 lanes)."""
    return head_dim % 16 == 0


def available() -> bool:
    """Whether this process loaded the library and it is switched on (no loading attempted)."""
    return ENABLED and _LOADED


def main(argv: list[str] | None = None) -> int:
    """``python -m services.native_lib``: build the library for this machine; one line, exit 0.
    A failed build is reported and exits 0 too (the server then runs the Python body); ``--strict``
    exits 1 instead."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        path = build_library()
    except RuntimeError as e:
        print(f"dartree: native slot attention not built: {e}", file=sys.stderr)
        return 1 if "--strict" in argv else 0
    print(f"dartree: native slot attention: {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
