"""Which compiled steps inductor's disk cache holds: the record :mod:`services.verifier.compile_swap`
writes after a successful swap, read at start to load the steps instead of deferring them.

The record is a small JSON file in inductor's cache folder (wiping that folder forgets it too), keyed
by :func:`steps_key`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

WARM_FILE = "dartree_compiled_steps.json"  # in inductor's cache folder: wiping that folder forgets it too


def _warm_path() -> Path:
    from services.machine_cache import inductor_cache_dir

    return inductor_cache_dir() / WARM_FILE


def steps_key(target, rows: tuple[int, ...]) -> str:
    """What the compiled steps of ``target`` warmed up for ``rows`` depend on: the machine and torch
    (:func:`services.machine_cache.machine_id`), the model folder, weight format and its kernels'
    version, dtype, tapped layers, row counts and the switches that change the traced step."""
    import torch

    from services.machine_cache import machine_id
    from services import native_lib as native
    from services.weight_formats import kernels_version

    parts = (machine_id(torch.__version__), getattr(target, "name", "model"), str(getattr(target, "weights", "")),
             f"kernels {kernels_version()}", str(target.dtype), f"taps {sorted(target.target_layer_ids)}",
             f"rows {sorted(rows)}", f"native {native.ENABLED}", f"fused {native.FUSED}",
             f"threads {torch.get_num_threads()}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def cache_is_warm(key: str) -> bool:
    """True when steps of ``key`` were built and loaded before with this inductor cache folder."""
    from services.machine_cache import read_entries

    return key in read_entries(_warm_path())


def remember_warm(key: str, seconds: float) -> None:
    """Record that the steps of ``key`` load from the disk cache (``seconds``: that load)."""
    from services.machine_cache import write_entry

    write_entry(_warm_path(), key, {"load_seconds": round(seconds, 2)})


def forget_warm(key: str) -> None:
    """Drop ``key``'s record (its load failed: the next start builds it off the critical path again)."""
    from services.machine_cache import drop_entry

    drop_entry(_warm_path(), key)


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
