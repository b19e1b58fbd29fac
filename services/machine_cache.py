"""What start-ups measure or build once per machine, kept on disk so that a restart reuses it.

Torch-free. Every entry lives under the state directory (:func:`state_dir`: ``$DARTREE_CACHE_DIR``,
else ``$DARTREE_CACHE``, else ``~/.cache/dartree``) and is keyed by what it depends on, so a
changed CPU, torch, thread count, kernel version or model misses instead of reusing a stale entry:

=============================  ==================================================  ===========================
file                           what                                                 key
=============================  ==================================================  ===========================
``weights_choice.json``        ``--weights auto``'s accepted measurement            :func:`services.weight_choice.machine_key`
``cost_model.json``            the goodput policy's accepted step-cost sweep        :func:`services.verifier.cost_model.cache_key`
``onednn_rows.json``           :func:`services.cpu_gemm.invariant_rows` verdicts    :func:`machine_id` + threads + shape
``q4/<model>-<hash>.safetensors``  the q4 linears as torch's int4 kernel packs them  :func:`services.q4_weights.q4_pack_key`
``calibration.json``           the goodput policy's learnt acceptance calibration  :func:`services.verifier.calibration_store.calibration_key`
``inductor/``                  compiled steps' kernels (torch inductor's cache)    inductor's own (graph + torch)
=============================  ==================================================  ===========================

A JSON file maps key -> entry (a dict with ``time``, epoch seconds); writes go to a temporary file
renamed over the old one, so a reader never sees half a file; an unreadable or unwritable cache only
costs the measurement again (logged). ``dartree doctor`` lists every entry with its age
(:mod:`services.doctor`). The test suite points ``$DARTREE_CACHE_DIR`` at a temporary directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

log = logging.getLogger("dartree.cache")

ONEDNN_ROWS = "onednn_rows.json"
INDUCTOR = "inductor"


def state_dir() -> Path:
    """``$DARTREE_CACHE_DIR``, else ``$DARTREE_CACHE`` (the model cache root), else ``~/.cache/dartree``."""
    env = os.environ.get("DARTREE_CACHE_DIR") or os.environ.get("DARTREE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dartree"


def cpu_info() -> tuple[str, set[str]]:
    """``(model name, flags)`` from ``/proc/cpuinfo`` (x86 ``flags``, ARM ``Features``); the
    platform's machine name and an empty set where it cannot be read."""
    name, flags = platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return name, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name == platform.machine():
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return name, flags


def machine_id(torch_version: str) -> str:
    """``<CPU model>|<hash of its flags>|torch <version>``: what a kernel's behaviour on this machine
    depends on (the vector ISA in the flags; the kernels in torch)."""
    cpu, flags = cpu_info()
    return f"{cpu}|{hashlib.sha1(' '.join(sorted(flags)).encode()).hexdigest()[:8]}|torch {torch_version}"


def read_entries(path: Path) -> dict:
    """Key -> entry of a cache file; empty when absent, unreadable or not a JSON object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_entry(path: Path, key: str, entry: dict) -> bool:
    """Store ``entry`` (``time`` added when missing) under ``key`` in ``path``, atomically; False
    (logged) when the file cannot be written."""
    data = read_entries(path)
    data[key] = {"time": time.time(), **entry}
    return _write(path, data)


def drop_entry(path: Path, key: str) -> None:
    """Remove ``key`` from ``path`` (best effort)."""
    data = read_entries(path)
    if data.pop(key, None) is not None:
        _write(path, data)


def _write(path: Path, data: dict) -> bool:
    """Replace ``path`` with ``data`` as JSON through a temporary file; False (logged) on an I/O error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as e:
        log.warning("could not write the cache %s: %s", path, e)
        return False
    return True


def inductor_cache_dir() -> Path:
    """Torch inductor's on-disk cache: ``$TORCHINDUCTOR_CACHE_DIR`` when set, else ``<state dir>/inductor``."""
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or state_dir() / INDUCTOR)


def use_inductor_cache() -> Path:
    """Point torch inductor's on-disk cache (``$TORCHINDUCTOR_CACHE_DIR``) at :func:`inductor_cache_dir`
    (``<state dir>/inductor`` unless the variable is already set); returns it. Call before the first
    compile: a restart then loads the compiled steps' kernels instead of generating them again."""
    path = inductor_cache_dir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    return path
