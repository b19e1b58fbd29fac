"""``dartree doctor``: what this machine offers a CPU server, and what start-ups cached about it.

One screen: the CPU's capabilities (vector ISA, native bf16, MKL / oneDNN packing, the int4
kernel, threads, RAM), what start-ups keep in the state directory (:mod:`services.machine_cache`):
the weight-format choices (``weights_choice.json``), step-cost sweeps (``cost_model.json``),
oneDNN row-invariance verdicts (``onednn_rows.json``), packed q4 linears (``q4/``), compiled steps'
kernels (``inductor/``) and the goodput policy's acceptance calibrations (``calibration.json``), with
their figures and age, and, with ``--remeasure``, a fresh weight choice and cost sweep for a target,
of the steps the server runs (compiled for q4 on CPU; each cached only when the measurement is
trusted).
"""

from __future__ import annotations

import argparse
import json
import time


def add_doctor_args(p: argparse.ArgumentParser) -> None:
    """The ``dartree doctor`` flags (torch-free)."""
    p.add_argument("--remeasure", action="store_true",
                   help="measure the weight choice and the step-cost sweep again (a minute or two; cached "
                        "only when the machine was quiet enough to trust the figures)")
    p.add_argument("--target", default=None, help="target for --remeasure (default: SmolLM2-135M-Instruct)")


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "age unknown"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} old"
    return f"{seconds:.0f} s old"


def _when(entry: dict) -> float | None:
    """Epoch seconds of a cache entry (``time``, or the ISO ``when`` of older entries)."""
    if isinstance(entry.get("time"), (int, float)):
        return float(entry["time"])
    try:
        return time.mktime(time.strptime(entry["when"], "%Y-%m-%dT%H:%M:%S"))
    except (KeyError, TypeError, ValueError):
        return None


def capability_lines() -> list[str]:
    """The CPU section (:func:`services.weight_choice.cpu_capabilities`), a few lines."""
    import psutil

    from services.weight_choice import cpu_capabilities

    c = cpu_capabilities()
    vm = psutil.virtual_memory()
    yes = {True: "yes", False: "no"}
    return [f"CPU        {c['cpu']} ({c['cores']} cores, torch threads {c['threads']})",
            f"ISA        torch {c['isa']}; flags {' '.join(c['flags']) or '-'}",
            f"bfloat16   native {yes[c['native_bf16']]}; oneDNN bf16 {yes[c['onednn_bf16']]}"
            + ("" if c["native_bf16"] else " (emulated: --weights auto never picks bfloat16 here)"),
            f"kernels    MKL packed sgemm {yes[c['mkl_packing']]}; int4 (q4) {yes[c['int4_kernel']]}",
            f"RAM        {vm.total / 2**30:.1f} GiB, {vm.available / 2**30:.1f} GiB available"]


def _pack_lines(now: float) -> list[str]:
    """Each weight format's cached packs (:mod:`services.weight_formats` ``packs_dir``), one line a file."""
    from services.machine_cache import state_dir
    from services.weight_formats import FORMATS

    out = []
    for fmt in (f for f in FORMATS.values() if f.packs_dir):
        folder = state_dir() / fmt.packs_dir
        packs = sorted(folder.glob("*.safetensors"))
        out.append(f"{fmt.name + ' packs':<16}{folder}")
        for f in packs:
            st = f.stat()
            out.append(f"  {f.name}: {st.st_size / 2**20:.0f} MB, {_age(now - st.st_mtime)}")
        if not packs:
            out.append("  none")
    return out


def cache_lines(now: float | None = None) -> list[str]:
    """The cached choices and sweeps, one line each (path first; 'none' when absent)."""
    from services.machine_cache import ONEDNN_ROWS, inductor_cache_dir, read_entries, state_dir
    from services.models.registry import cache_root
    from services.verifier.calibration_store import default_store_path
    from services.verifier.cost_model import default_cache_path
    from services.weight_choice import choice_cache_path, read_choices

    now = time.time() if now is None else now
    models = sorted(p.name for p in cache_root().glob("*") if (p / "config.json").exists())
    out = [f"models          {cache_root()} ($DARTREE_CACHE): {', '.join(models) or 'none converted yet'}",
           f"state           {state_dir()} ($DARTREE_CACHE_DIR)",
           f"weight choices  {choice_cache_path()}"]
    choices = read_choices()
    for key, e in choices.items():
        if isinstance(e, dict):
            t = _when(e)
            out.append(f"  {e.get('choice')}: ms {json.dumps(e.get('ms'))}, {_age(None if t is None else now - t)}"
                       f"  [{key}]")
    if not choices:
        out.append("  none")
    path = default_cache_path()
    out.append(f"cost sweeps     {path}")
    sweeps = read_entries(path)
    for key, e in sweeps.items():
        if isinstance(e, dict) and "samples" in e:
            pts = " ".join(f"{int(r)}:{float(s) * 1e3:.1f}" for r, s in e["samples"])
            out.append(f"  rows:ms {pts}, {_age(now - e.get('time', now))}  [{key}]")
    if not sweeps:
        out.append("  none")
    path = state_dir() / ONEDNN_ROWS
    out.append(f"oneDNN rows     {path}")
    verdicts = {k: e for k, e in read_entries(path).items() if isinstance(e, dict) and isinstance(e.get("rows"), dict)}
    for key, e in verdicts.items():
        shown = ", ".join(f"{shape}: {r}" for shape, r in e["rows"].items())
        out.append(f"  {shown}, {_age(now - e.get('time', now))}  [{key}]")
    if not verdicts:
        out.append("  none")
    out += _pack_lines(now)
    path = inductor_cache_dir()
    files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else []
    out.append(f"compiled steps  {path}")
    if files:
        newest = max(f.stat().st_mtime for f in files)
        out.append(f"  {len(files)} files, {sum(f.stat().st_size for f in files) / 2**20:.0f} MB, newest "
                   f"{_age(now - newest)} (torch inductor's cache; delete it to compile afresh)")
    else:
        out.append("  none")
    import torch

    from services import native_lib as native

    path = native.library_path()
    out.append(f"native op       {path.parent}")
    out.append(f"  slot attention: {'built' if path.exists() else 'not built'} for torch {torch.__version__}"
               f"{'' if native.ENABLED else ' (switched off: DARTREE_NATIVE_ATTENTION=0)'}"
               f"{' (ATen calls: DARTREE_NATIVE_ATTENTION=aten)' if native.ENABLED and not native.FUSED else ''}")
    path = default_store_path()
    out.append(f"calibrations    {path}")
    calibrations = {k: e for k, e in read_entries(path).items() if isinstance(e, dict) and isinstance(e.get("state"), dict)}
    for key, e in calibrations.items():
        out.append(f"  {key}, {_age(now - e.get('time', now))}")
    if not calibrations:
        out.append("  none")
    return out


def remeasure(target_ref: str | None) -> list[str]:
    """A fresh weight choice and a cost sweep of the chosen format (one line each)."""
    import torch

    from services.models.registry import resolve_target
    from services.verifier.cost_model import forget_cached, startup_sweep
    from services.verifier.build import make_runner, sweep_key, time_forward
    from services.verifier.engine import EngineConfig
    from services.verifier.runner import auto_compile
    from services.verifier.target import TargetModel
    from services.weights import choose_weights

    target_dir = resolve_target(target_ref)
    fmt = choose_weights("auto", target_dir, remeasure=True)
    target = TargetModel.from_pretrained(target_dir, [0], weights=fmt)  # taps unused here
    # the steps the server runs by default: compiled where --compile's auto rule compiles them
    runner = make_runner(target, EngineConfig(max_running=1, max_context=256, compile=auto_compile(target)))
    target.pack_for_steps(8, 16, 1, lazy=True)
    if runner.compiled:
        runner.warm_up((1, 9))
    key = sweep_key(target_dir.name, fmt, "cpu", runner)
    forget_cached(key)
    samples, source = startup_sweep(lambda rows: time_forward(runner, rows), key, fmt,
                                    threads=torch.get_num_threads())
    pts = " ".join(f"{r}:{s * 1e3:.1f}" for r, s in samples)
    return [f"weights auto -> {fmt}", f"cost sweep ({source}{', compiled steps' if runner.compiled else ''}): "
                                      f"rows:ms {pts}"]


def doctor_main(args: argparse.Namespace) -> int:
    """Print the report; ``--remeasure`` measures first. Returns 0."""
    from services.runtime import setup_logging

    setup_logging("WARNING")
    lines = capability_lines()
    if args.remeasure:
        lines += ["", "re-measured:"] + ["  " + s for s in remeasure(args.target)]
    lines += [""] + cache_lines()
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover - python -m services.doctor == dartree doctor
    import sys

    from services.command_line import Parser, run_command

    parser = Parser(prog="dartree doctor", description="what this machine offers a CPU server")
    add_doctor_args(parser)
    sys.exit(run_command(doctor_main, parser.parse_args()))
