"""Cached packs of a weight format in the state directory: one safetensors file per model and key.

A pack is what a format computes from the model's files at every start (the ``q4`` linears' int4
packs, the lm_head's int8 rows); its key names everything the pack depends on (machine, kernels'
version, source file, model configuration, dtype), so a changed one is made again, never reused.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger("services.weights")


def pack_key(source: str | Path, config, dtype: torch.dtype, kernels_version: int) -> str:
    """What a pack made from the file ``source`` for a model of HF ``config`` in ``dtype`` depends on:
    the CPU and its flags with torch's vector ISA and version (an int4 pack's layout is the kernel's,
    per ISA), the format's ``kernels_version``, the file (path, size, modification time), the
    model's configuration and the activation dtype."""
    from services.machine_cache import machine_id

    st = Path(source).stat()
    cfg = hashlib.sha1(config.to_json_string(use_diff=False).encode()).hexdigest()[:12]
    return (f"{machine_id(torch.__version__)}|{torch.backends.cpu.get_cpu_capability()}|kernels {kernels_version}|"
            f"{Path(source).resolve()}:{st.st_size}:{st.st_mtime_ns}|config {cfg}|{dtype}")


def pack_path(packs_dir: str, model_name: str, key: str) -> Path:
    """``<state dir>/<packs_dir>/<model>-<hash of key>.safetensors`` (:mod:`services.machine_cache`)."""
    from services.machine_cache import state_dir

    name = Path(str(model_name)).name or "model"
    return state_dir() / packs_dir / f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.safetensors"


def read_pack(path: Path, key: str) -> tuple[dict[str, Tensor], dict[str, str]] | None:
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


def write_pack(path: Path, key: str, tensors: dict[str, Tensor], **meta: str) -> None:
    """Write ``tensors`` to ``path`` with ``key`` (atomically; an unwritable state directory only logs)."""
    from safetensors.torch import save_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"key": key, **meta})
        tmp.replace(path)
    except OSError as e:
        log.warning("could not cache %s: %s", path, e)
