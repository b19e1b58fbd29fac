"""The slot attention as a C++ operator (``dartree_native::slot_attention``), built on this machine.

Why: in a compiled q4 step on the 2-core CPU the Python body of the opaque slot-attention op
(:func:`services.verifier.runner._slot_attention_eager` with :func:`services.verifier.attention.attend`)
spent ~30 µs of interpreter time per layer beyond its ATen calls (``torch.profiler`` self time of
``dartree::slot_attention``, 2026-12-05), ~1 ms of a ~10 ms step. ``native_attention.cpp`` makes the
same ATen calls (slot writes, two bfloat16 ``bmm``, the float32 softmax with the additive mask, the
1,024-column blocks and 32-row blocks) in the same order on the same views, so every row gets the
same bits as the Python body (tests/engine/test_native_attention.py compares them); only the CPU
bfloat16 / float16 path with the grouped attention (:func:`~services.verifier.attention.use_grouped`)
has a native form, every other step keeps the Python body. The same library holds
``dartree_native::int4_mm``, torch's int4 CPU kernel with its group size as an int, which compiled
q4 linears call (:class:`services.q4_weights.Int4Linear`; the ``quantized::int4mm_packed_weight_cpu``
overload inductor emits reads the group size from a tensor, one ``item()`` a call). In process the
two took a compiled q4 one-row step from 10.70 to 10.13 ms a token
(``benchmarks/results/2026-12-05-native-attention``).

Built with the system C++ compiler (``$CXX``, else ``g++``) against the installed torch's headers
and libraries (``make setup`` runs ``python -m services.verifier.native``; ~8 s on the 2-core CPU)
into ``<state dir>/native/<key>/`` (``$DARTREE_CACHE_DIR``, else ``~/.cache/dartree``), where
``key`` hashes the source, torch's version and the compiler flags, so a torch upgrade or a changed
source builds again. A compiled runner that finds no library builds it (:func:`load` with
``build=True``); where that fails the step runs the Python body, with the same results.
``DARTREE_NATIVE_ATTENTION=0`` switches the native ops off.
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

from services.q4_weights import use_native_int4_mm

log = logging.getLogger("verifier.native")

SOURCE = Path(__file__).with_name("native_attention.cpp")
ENABLED = os.environ.get("DARTREE_NATIVE_ATTENTION", "1") != "0"
_LOADED = False  # the library is loaded in this process
_GAVE_UP = False  # its build or load failed in this process: not tried again


def _flags() -> list[str]:
    """Compiler and linker flags for a library that links against the installed torch."""
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-O2", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    flags += [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    for p in library_paths():
        flags += [f"-L{p}", f"-Wl,-rpath,{p}"]
    return flags + ["-lc10", "-ltorch_cpu", "-ltorch"]


def library_path() -> Path:
    """Where this machine's build of the current source for the installed torch lives (it may not exist)."""
    from services.machine_cache import state_dir

    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(_flags()).encode())
    return state_dir() / "native" / h.hexdigest()[:16] / "dartree_native.so"


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
    path = library_path()
    if not path.exists():
        if not build:
            log.info("native slot attention not built for this torch (run `make setup` or `python -m "
                     "services.verifier.native`); the attention runs its Python body")
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
    use_native_int4_mm()  # the compiled q4 linears call dartree_native::int4_mm from now on
    return True


def _register_fake() -> None:
    @torch.library.register_fake("dartree_native::slot_attention")
    def _(query, key, value, layer, scaling):
        return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])

    @torch.library.register_fake("dartree_native::int4_mm")
    def _(x, packed, group_size, scale_zeros):
        return x.new_empty(x.shape[0], scale_zeros.shape[1])


def available() -> bool:
    """Whether this process loaded the library and it is switched on (no loading attempted)."""
    return ENABLED and _LOADED


def main(argv: list[str] | None = None) -> int:
    """``python -m services.verifier.native``: build the library for this machine; one line, exit 0.
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
