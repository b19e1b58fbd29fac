"""Start-up bookkeeping of ``dartree serve``: phase times, resident memory by part, the fit check,
and the weight-format choice in a throw-away process.

Torch-free at import (the supervisor imports it): the weight choice loads and times models, so it
runs in a spawned child (:func:`choose_in_child`) that exits afterwards; the supervisor itself never
holds a model.

Memory of a served target (:func:`serve_footprint`, the fit check's formula)::

    KV cache  = 2 (keys, values) x layers x slots x kv_heads x capacity x head_dim x bytes(act dtype)
    capacity  = min(--max-context or the target's, the target's) + max(MAX_BUDGET + 1, --prefill-chunk)
    weights   = parameters x bytes per parameter of the format (float32 4, bfloat16 2, q4 ~0.6:
                4-bit blocks of the linears, bf16 embedding)

The KV cache is reserved (``torch.empty``) and its pages are committed as contexts use them; the
check still refuses a configuration whose full reservation exceeds the RAM available now, because
``--max-running`` requests at full context would need it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import time
from pathlib import Path

log = logging.getLogger("dartree.startup")

ACT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_bytes_per_param(fmt: str) -> float:
    """Bytes per parameter of weights served in ``fmt``: a registered format's ``bytes_per_param``
    (:mod:`services.weight_formats`; q4: 4-bit linears + scales, bf16 embedding, its int8 lm_head
    copy), a plain dtype's size (``float16``, ``--dtype`` without a format of its own), else 4."""
    from services.weight_formats import FORMATS

    return FORMATS[fmt].bytes_per_param if fmt in FORMATS else float(ACT_BYTES.get(fmt, 4))


# ------------------------------------------------------------------------------------- phases

def log_phase(process: str, name: str, seconds: float) -> None:
    """One line: ``start-up <process>: <name> <seconds> s``."""
    log.info("start-up %s: %s %.1f s", process, name, seconds)


@contextlib.contextmanager
def phase(process: str, name: str):
    """Time a start-up phase and log it in one line (:func:`log_phase`), also when it fails."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        log_phase(process, name, time.perf_counter() - t0)


# ------------------------------------------------------------------------------------- memory

def rss_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (this one by default), bytes."""
    import psutil

    return psutil.Process(pid or os.getpid()).memory_info().rss


def mb(n: float) -> str:
    return f"{n / 2**20:,.0f} MB"


def memory_line(process: str, parts: dict[str, int | str]) -> str:
    """``resident memory <process>: RSS X MB (part a MB, part b MB, ...)``; str parts verbatim."""
    shown = ", ".join(f"{k} {v if isinstance(v, str) else mb(v)}" for k, v in parts.items())
    return f"resident memory {process}: RSS {mb(rss_bytes())} ({shown})"


def module_bytes(module) -> int:
    """Bytes of a torch module's parameters and buffers, each storage once (tied weights once)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def object_memory_parts(obj) -> dict[str, int | str]:
    """``{"weights", "GEMM packs"}`` of the torch modules among ``obj``'s attributes (a drafter
    service: the drafter, the borrowed embedding and lm_head), each storage once; a
    :class:`~services.drafter.build.MappedEmbedding` (a view of a file mapping, resident only
    where read) is shown apart as ``"mapped embedding"``, its weight's bytes."""
    import torch

    from services.cpu_gemm import packed_bytes

    mods = [v for v in vars(obj).values() if isinstance(v, torch.nn.Module)]
    mapped = [m for m in mods if getattr(m, "mapped", False)]
    holder = torch.nn.ModuleList([m for m in mods if m not in mapped])
    parts: dict[str, int | str] = {"weights": module_bytes(holder), "GEMM packs": packed_bytes(holder)}
    if mapped:
        parts["mapped embedding"] = f"{mb(sum(m.weight.nbytes for m in mapped))} of file, resident as read"
    return parts


def kv_committed_bytes(cache) -> int:
    """Bytes of a :class:`~services.verifier.kv_cache.SlotKVCache` written so far (columns zeroed or
    filled per slot; the rest is reserved, not resident)."""
    per_col = cache.nbytes() // max(cache.num_slots * cache.capacity, 1)
    return per_col * sum(getattr(cache, "_clean", [0]))


def prefix_cache_part(prefix) -> str:
    """``"X MB of <= Y MB"``: what a :class:`~services.verifier.prefix_cache.PrefixCache` holds beyond
    the reserved KV slots (feature rows and token ids of cached prefixes) and its bound; ``"off"``
    when disabled, ``"no bound"`` without one; then, when its host-RAM store is on,
    ``" + X MB of <= Y MB in RAM"`` (:class:`~services.verifier.prefix_store.PrefixStore`)."""
    if not prefix.enabled:
        return "off"
    bound = "no bound" if prefix.max_bytes is None else f"<= {mb(prefix.max_bytes)}"
    ram = prefix.ram
    stored = f" + {mb(ram.nbytes())} of <= {mb(ram.max_bytes)} in RAM" if ram.max_bytes else ""
    return f"{mb(prefix.nbytes())} of {bound}{stored}"


# ---------------------------------------------------------------------------------- footprint

def kv_capacity(max_context: int, target_max_context: int, prefill_chunk: int) -> int:
    """Positions per KV slot, as :class:`services.verifier.engine.SpecEngine` sizes them: the context
    allowed plus room for the widest step segment past it."""
    from services.spec import MAX_BUDGET

    ctx = min(max_context or target_max_context, target_max_context)
    return ctx + max(MAX_BUDGET + 1, prefill_chunk)


def _config(target_dir: Path) -> dict:
    return json.loads((Path(target_dir) / "config.json").read_text())


def kv_bytes(config: dict, slots: int, capacity: int, act_dtype: str) -> int:
    """Bytes of the keys and values of ``slots`` slots x ``capacity`` positions (module doc)."""
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return 2 * int(config["num_hidden_layers"]) * slots * kv_heads * capacity * head_dim * ACT_BYTES[act_dtype]


def num_parameters(target_dir: Path) -> int:
    """Parameters stored in a HF directory's ``*.safetensors`` (from their headers; no torch)."""
    total = 0
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= int(d)
                total += count
    return total


def serve_footprint(target_dir: Path, fmt: str, act_dtype: str, max_running: int, max_context: int,
                    prefill_chunk: int) -> dict[str, int]:
    """``{"weights", "kv", "kv_capacity"}``: the verifier's planned memory (module doc's formula)."""
    cfg = _config(target_dir)
    cap = kv_capacity(max_context, int(cfg.get("max_position_embeddings", 2048)), prefill_chunk)
    return {"weights": int(num_parameters(target_dir) * weight_bytes_per_param(fmt)),
            "kv": kv_bytes(cfg, max_running, cap, act_dtype), "kv_capacity": cap}


def check_fits(target_dir: Path, fmt: str, act_dtype: str, max_running: int, max_context: int,
               prefill_chunk: int, available: int | None = None) -> dict[str, int]:
    """The footprint (:func:`serve_footprint`) when it fits the RAM available now, else ValueError
    (one line naming the flags to change)."""
    import psutil

    fp = serve_footprint(target_dir, fmt, act_dtype, max_running, max_context, prefill_chunk)
    avail = psutil.virtual_memory().available if available is None else available
    if fp["weights"] + fp["kv"] > avail:
        raise ValueError(f"the KV cache ({max_running} slots x {fp['kv_capacity']} positions in {act_dtype}: "
                         f"{fp['kv'] / 2**30:.2f} GiB) plus the {fmt} weights ({fp['weights'] / 2**30:.2f} GiB) "
                         f"exceed the {avail / 2**30:.2f} GiB of RAM available: lower --max-running or "
                         "--max-context")
    return fp


# ---------------------------------------------------------------------------- weight choice

def _choose(target_ref: str | None, weights: str, dtype: str | None, device: str, log_level: str,
            remeasure: bool = False) -> tuple[str, str | None, str, str]:
    """Body of :func:`choose_in_child` (runs in the child)."""
    from services.runtime import setup_logging

    setup_logging(log_level)
    import torch

    from services.hf_compat import quiet_progress_bars
    from services.models.registry import resolve_target
    from services.weights import choose_weights, drafter_dtype, resolve_cli_weights

    quiet_progress_bars()

    with phase("supervisor", "target ready"):
        target = str(resolve_target(target_ref))
    with phase("supervisor", "weight format chosen (in a throw-away process: what it loads is freed)"):
        if remeasure:
            choose_weights("auto", target, device, remeasure=True)
        fmt, act = resolve_cli_weights(weights, dtype, target, device)
    name = str(act).removeprefix("torch.")
    return target, fmt, name, str(drafter_dtype(getattr(torch, name), device)).removeprefix("torch.")


def choose_in_child(target_ref: str | None, weights: str = "auto", dtype: str | None = None, device: str = "cpu",
                    log_level: str = "INFO", remeasure: bool = False,
                    start_method: str = "auto") -> tuple[str, str | None, str, str]:
    """``(target dir, format, activation dtype name, drafter dtype name)`` resolved in a child
    process (forked from the workers' forkserver on CPU, :func:`services.runtime.worker_context`;
    the default target converted once, :func:`services.models.registry.resolve_target`;
    :func:`services.weights.resolve_cli_weights`, where ``auto`` may load and time every candidate
    format), which exits afterwards, so what it loaded is freed with it.

    Raises:
        ValueError, RuntimeError: a target or format that cannot run here (one line, from the child).
    """
    from concurrent.futures import ProcessPoolExecutor

    from services.runtime import restore_stop_signals, worker_context

    with ProcessPoolExecutor(1, mp_context=worker_context(start_method, device),
                             initializer=restore_stop_signals) as pool:
        return pool.submit(_choose, target_ref, weights, dtype, device, log_level, remeasure).result()
