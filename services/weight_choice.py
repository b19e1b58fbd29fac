"""``--weights auto`` on CPU: the weight format this machine serves fastest, chosen so that a busy
machine cannot corrupt the choice.

Why: timing a step while another process shares the cores measures the other process. Two torch
processes on two cores make OpenMP threads spin-wait for each other, so one forward can take 50x its
idle time; a start-up that timed a q4 one-row step at 1.9 s (an idle one takes 20-30 ms) chose, and
cached for good, whichever format happened to run while the cores were free.

How, in order:

1. Rule out what cannot win from the CPU's capabilities: ``bfloat16`` is a candidate only where the
   CPU multiplies bfloat16 natively (``avx512_bf16`` / ``amx_bf16`` on x86, ``bf16`` on ARM); on an
   AVX2-only CPU it is emulated (a 9-row bf16 linear cost 10.7x a one-row one there) and loses to
   both others (the registry's ``needs_native_bf16``, :mod:`services.weight_formats`). ``q4`` needs
   torch's int4 kernel and the target's GGUF (its registry entry's ``unavailable``).
2. The rule's answer (:func:`rule_choice`, the registry's ranks): ``q4`` when it runs (the fewest
   weight bytes per step: a CPU decode step reads every weight once), else ``bfloat16`` where
   native, else ``float32``.
3. Measure the remaining candidates *interleaved* (A B A B ..., one warm-up round excluded; the loop
   of :func:`services.timing.time_interleaved`): a disturbance then lands on every format alike
   instead of on whichever was being timed. Each format and row count is estimated by its **fastest
   time reproduced** (the smallest repeat that another one confirms within 15 %); rounds continue
   until every step has one, 4 to 10 rounds. On an idle 2-core VM the repeats scatter 1.0-1.6x in
   phases even at 1 thread, so a rule on their spread rejected nearly every idle start.
4. Reject (:func:`judge`) a measurement taken while another process had the cores (the timing
   process's CPU share, :func:`services.timing.busy_reason`: 0.99 idle, 0.57-0.63 next to one
   competing process, whose steps still reproduce their slower times), one whose fastest times were
   never reproduced, or whose one-row step is far above the model's own floor (weight bytes /
   measured memory bandwidth + FLOPs / a quick GEMM probe, times :data:`FLOOR_FACTOR`, plus
   :data:`LAYER_OVERHEAD_MS` of eager dispatch per decoder layer). Retry once; a second rejection
   serves the rule's answer and caches nothing.
5. Only an accepted measurement is cached (``<state dir>/weights_choice.json``,
   :mod:`services.machine_cache`, per CPU / flags / torch / threads / kernels / model). One log line
   says what was chosen and why.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from services import timing, weight_formats
from services.machine_cache import cpu_info, read_entries, state_dir, write_entry

log = logging.getLogger("services.weights")

FLOOR_FACTOR = 10.0       # a one-row step above this many times its floor is not this machine's speed
LAYER_OVERHEAD_MS = 1.0   # eager dispatch allowance per decoder layer on top of the floor (ms)
MEASURE_ROWS = (1, 9)     # a one-token step and the CPU default tree's verify (B = 8)
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 'flags' / ARM 'Features' of native bf16 math


# ------------------------------------------------------------------------------- CPU capabilities

def native_bf16(flags: set[str] | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 natively (any of :data:`BF16_FLAGS`). Without readable
    flags (no ``/proc/cpuinfo``), whether oneDNN reports bf16 support."""
    if flags is None:
        flags = cpu_info()[1]
    if flags:
        return any(f in flags for f in BF16_FLAGS)
    from services.cpu_gemm import onednn_bf16_available

    return onednn_bf16_available()


def cpu_capabilities() -> dict:
    """What the format choice depends on: CPU model, torch's vector ISA
    (``torch.backends.cpu.get_cpu_capability()``: e.g. ``AVX2``, ``AVX512``), the bf16 / AMX / VNNI
    flags present, native bf16, MKL packing, oneDNN bf16, the int4 kernel, threads and cores."""
    from services.cpu_gemm import onednn_bf16_available, packing_available

    int4_kernel_available = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    name, flags = cpu_info()
    return {"cpu": name, "isa": torch.backends.cpu.get_cpu_capability(),
            "flags": sorted(f for f in flags if f.startswith(("avx512", "amx", "avx_vnni", "bf16")) or f == "avx2"),
            "native_bf16": native_bf16(flags), "mkl_packing": packing_available(),
            "onednn_bf16": onednn_bf16_available(), "int4_kernel": int4_kernel_available,
            "threads": torch.get_num_threads(), "cores": os.cpu_count()}


def candidate_formats(available: list[str]) -> list[str]:
    """The formats worth measuring here: the ``available`` ones
    (:func:`services.weights.available_formats`) without those that need native bf16 GEMMs
    (``bfloat16``) where the CPU lacks them (:func:`native_bf16`)."""
    return [f for f in available if not weight_formats.get(f).needs_native_bf16 or native_bf16()]


def rule_choice(candidates: list[str]) -> tuple[str, str]:
    """``(format, reason)`` without measuring: the candidate of the lowest registry rank, ``q4`` >
    native ``bfloat16`` > ``float32`` (a CPU decode step reads every weight once; fewer bytes,
    faster step); ``float32`` without candidates."""
    ranked = weight_formats.by_rank(candidates) or [weight_formats.get("float32")]
    return ranked[0].name, ranked[0].reason


# -------------------------------------------------------------------------------------- probes

@lru_cache(maxsize=1)
def memory_bandwidth_gbps(mb: int = 64, repeats: int = 5) -> float:
    """Best-of-``repeats`` copy bandwidth in GB/s (bytes read + written) of a ``mb`` MB buffer."""
    a = torch.ones(mb << 18)  # float32: mb MB
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best / 1e9


@lru_cache(maxsize=1)
def gemm_gflops(n: int = 512, repeats: int = 5) -> float:
    """Best-of-``repeats`` float32 GEMM rate in GFLOP/s (``n x n`` by ``n x n``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def step_floor_ms(model) -> float:
    """A one-row step's lower bound in ms: the bytes a step reads (every weight and buffer once; the
    input embedding only when it is also the output projection) at the measured bandwidth, plus two
    FLOPs per linear weight at the measured GEMM rate."""
    seen, nbytes, flops = set(), 0, 0
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is embed
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key in seen or (t is embed and not tied):
            continue
        seen.add(key)
        nbytes += t.numel() * t.element_size()
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, torch.nn.Linear) and w is not None:
            flops += 2 * w.numel()
        elif hasattr(m, "in_features") and hasattr(m, "out_features") and not isinstance(m, torch.nn.Linear):
            flops += 2 * m.in_features * m.out_features  # a 4-bit linear
    return (nbytes / (memory_bandwidth_gbps() * 1e9) + flops / (gemm_gflops() * 1e9)) * 1e3


def step_limit_ms(model) -> float:
    """The slowest one-row step accepted as this machine's speed: ``FLOOR_FACTOR x floor`` plus
    ``LAYER_OVERHEAD_MS`` per decoder layer."""
    return FLOOR_FACTOR * step_floor_ms(model) + LAYER_OVERHEAD_MS * int(model.config.num_hidden_layers)


# --------------------------------------------------------------------------------- measurement

def _time_call(fn: Callable[[], None]) -> float:
    """Wall ms of ``fn()``."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure_interleaved(steps: dict[str, dict[int, Callable[[], None]]], max_rounds: int = 10,
                        min_rounds: int = 4) -> timing.Timings:
    """Time every ``steps[fmt][rows]()`` (wall ms, :func:`_time_call`) in rounds, formats and row
    counts interleaved (A B A B ...), one warm-up round first, until every step has a fastest time
    reproduced (:func:`services.timing.time_interleaved`).

    Returns:
        :class:`~services.timing.Timings` keyed by ``(format, rows)``, times in ms, with the CPU share
        at ``torch.get_num_threads()`` threads.
    """
    calls = {(f, r): (lambda fn=fn: _time_call(fn)) for f, per in steps.items() for r, fn in per.items()}
    return timing.time_interleaved(calls, max_rounds, min_rounds, threads=torch.get_num_threads())


def judge(t: timing.Timings, limits_ms: dict[str, float]) -> str | None:
    """Why a measurement cannot be trusted (one line), or None when it can: another process had the
    cores (:func:`services.timing.busy_reason`), a step's fastest time never reproduced
    (:func:`services.timing.unsteady_reason`), or a format's one-row estimate above its limit
    (:func:`step_limit_ms`)."""
    why = timing.busy_reason(t) or timing.unsteady_reason(t, lambda k: f"{k[0]} {k[1]}-row")
    if why:
        return why
    for fmt, per in _by_format(t).items():
        one = per[min(per)]
        if fmt in limits_ms and one > limits_ms[fmt]:
            return f"{fmt} one-row step {one:.1f} ms is above its plausible {limits_ms[fmt]:.1f} ms"
    return None


def _by_format(t: timing.Timings) -> dict[str, dict[int, float]]:
    """Format -> row count -> estimated ms (:func:`services.timing.fastest_reproduced`)."""
    out: dict[str, dict[int, float]] = {}
    for (fmt, r), ms in t.estimates().items():
        out.setdefault(fmt, {})[r] = ms
    return out


def step_callables(model, context: int = 64, rows: tuple[int, ...] = MEASURE_ROWS) -> dict[int, Callable[[], None]]:
    """Row count -> a callable running one forward of that many causal rows over a ``context``-token
    cache (prefilled here), cropping the cache back after each call."""
    from services import hf_compat

    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    kw = next(iter(hf_compat.cache_kwargs(model, None)))
    cache = hf_compat.new_dynamic_cache(model.config)
    dev = next(model.parameters()).device
    with torch.inference_mode():
        model(input_ids=torch.randint(0, vocab, (1, context), generator=g).to(dev), use_cache=True,
              logits_to_keep=1, **{kw: cache})

    def make(r: int):
        ids = torch.randint(0, vocab, (1, r), generator=g).to(dev)

        @torch.inference_mode()
        def run():
            model(input_ids=ids, use_cache=True, **{kw: cache})
            hf_compat.crop_cache(cache, context)
        return run

    return {r: make(r) for r in rows}


def _load_for_timing(load: Callable, target_dir: Path, fmt: str, device: str):
    """A model of ``fmt`` (``load(target_dir, fmt, device)``) as the engine serves it (float32 with
    its 9-row GEMMs packed)."""
    model = load(target_dir, fmt, device)
    if weight_formats.get(fmt).act_dtype == "float32":
        from services.cpu_gemm import pack_linears

        pack_linears(model, [r for r in MEASURE_ROWS if r >= 2])
    return model


def measure_formats(target_dir: Path, formats: list[str], load: Callable, device: str = "cpu", max_rounds: int = 10,
                    tries: int = 2, budget_s: float = 60.0) -> tuple[dict[str, dict[int, float]] | None, str]:
    """Load ``formats`` together (``load(target_dir, fmt, device)``: :func:`services.weights.load_causal_lm`),
    time them interleaved, judge; up to ``tries`` times, and no new try once ``budget_s`` seconds of
    timing have passed (a machine that slow is busy).

    Returns:
        ``(fastest reproduced ms per format and row count, "")`` for a trusted measurement, else
        ``(None, why the last one was rejected)``. The models are freed before returning.
    """
    models = {f: _load_for_timing(load, target_dir, f, device) for f in formats}
    try:
        steps = {f: step_callables(m) for f, m in models.items()}
        limits = {f: step_limit_ms(m) for f, m in models.items()}
        why, t0 = "", time.perf_counter()
        for _ in range(tries):
            times = measure_interleaved(steps, max_rounds)
            why = judge(times, limits) or ""
            if not why:
                return _by_format(times), ""
            if time.perf_counter() - t0 > budget_s:
                break
        return None, why
    finally:
        models.clear()
        gc.collect()


# ------------------------------------------------------------------------------------- choice

def machine_key(target_dir: Path, threads: int, kernels_version: int) -> str:
    """What a cached choice depends on: CPU model and its AVX-512/AMX flags, torch, threads,
    kernels version (:func:`services.weight_formats.kernels_version`), model."""
    cpu, flags = cpu_info()
    simd = ",".join(sorted(f for f in flags if f.startswith(("avx512", "amx"))))
    cfg = (target_dir / "config.json").read_bytes() if (target_dir / "config.json").exists() else b""
    return (f"{cpu}|{hashlib.sha1(simd.encode()).hexdigest()[:8]}|torch {torch.__version__}|threads {threads}|"
            f"kernels {kernels_version}|{target_dir.name}:{hashlib.sha1(cfg).hexdigest()[:10]}")


def choice_cache_path() -> Path:
    """``<state dir>/weights_choice.json`` (:func:`services.machine_cache.state_dir`)."""
    return state_dir() / "weights_choice.json"


def read_choices(path: Path | None = None) -> dict:
    """The cached choices (key -> ``{"choice", "ms", "when", "time"}``); empty when absent or unreadable."""
    return read_entries(path or choice_cache_path())


def _save_choice(key: str, entry: dict) -> None:
    write_entry(choice_cache_path(), key, entry)


def choose_auto(target_dir: Path, available: list[str], load: Callable, kernels_version: int, device: str = "cpu",
                *, cache: bool = True, remeasure: bool = False) -> str:
    """The CPU ``auto`` format (module doc): candidates by capability among ``available``, a cached
    accepted measurement, else an interleaved measurement of models made by ``load(target_dir, fmt,
    device)`` that must pass :func:`judge`, else the rule's answer (not cached). Logs one line with
    the choice and the reason. ``remeasure`` ignores the cached entry; ``kernels_version`` is part
    of the cache key."""
    t0 = time.perf_counter()
    cands = candidate_formats(available)
    rule, why_rule = rule_choice(cands)
    out = [f for f in available if f not in cands]  # the formats that need native bf16 GEMMs, on a CPU without
    dropped = f"; {', '.join(out)} ruled out (no native bf16 on this CPU)" if out else ""
    if len(cands) == 1:
        log.info("weights auto: %s (the only candidate%s)", rule, dropped)
        return rule
    threads = torch.get_num_threads()
    key = machine_key(target_dir, threads, kernels_version)
    hit = read_choices().get(key) if cache and not remeasure else None
    if isinstance(hit, dict) and hit.get("choice") in cands:
        log.info("weights auto: %s (cached measurement of %s, ms %s%s)", hit["choice"], hit.get("when"),
                 hit.get("ms"), dropped)
        return hit["choice"]
    ms, rejected = measure_formats(target_dir, cands, load, device)
    took = time.perf_counter() - t0
    if ms is None:
        log.warning("weights auto: %s by rule (%s); measurement rejected (%s), not cached, "
                    "%.1f s%s", rule, why_rule, rejected, took, dropped)
        return rule
    choice = min(ms, key=lambda f: sum(ms[f].values()))
    shown = {f: {f"{r}-row": round(v, 2) for r, v in per.items()} for f, per in ms.items()}
    log.info("weights auto: %s (fastest measured, ms per forward %s, %d threads, %.1f s%s)", choice, shown,
             threads, took, dropped)
    if cache:
        _save_choice(key, {"choice": choice, "ms": shown, "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
                           "time": time.time()})
    return choice
