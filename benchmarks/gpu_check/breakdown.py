"""The measuring sections of ``gpu_check``: the gpu-marked tests in a subprocess, and the round-time
breakdown per (shape, method, B) with its graph probe and verify curve (:mod:`benchmarks.gpu_verify_curve`)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu_check.engines import build_engine, graph_probe, measure, shapes

REPO = Path(__file__).resolve().parents[2]
METHODS = ("ar", "dflash", "domino", "ddtree", "dartree-pruned")
GRAPH_METHODS = ("ar", "dartree-pruned")  # also measured on the CUDA-graph runner (--graphs)
BUDGET_METHODS = ("ddtree", "dartree-pruned", "domino-ddtree", "seqheap", "dartree-fixed")


def gpu_test_files() -> list[str]:
    """Test files that use the ``gpu`` marker (collecting only these keeps the run short)."""
    return sorted(str(f.relative_to(REPO)) for f in (REPO / "tests").rglob("test_*.py")
                  if "pytest.mark.gpu" in f.read_text(encoding="utf-8", errors="replace"))


def run_tests(files: list[str], timeout: float) -> dict:
    """``pytest -m gpu`` over ``files`` in a subprocess: counts parsed from its summary line."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(10.0, timeout))
    except subprocess.TimeoutExpired:
        return {"command": " ".join(cmd[2:]), "status": "timeout", "elapsed_s": time.perf_counter() - t0}
    tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail[0])}
    ok = r.returncode in (0, 5) and not counts.get("failed") and not counts.get("error") and not counts.get("errors")
    status = ("ok" if counts.get("passed") else "skipped") if ok else "failed"  # skipped: no test ran (no GPU)
    return {"command": "python " + " ".join(cmd[1:]), "files": files, "status": status,
            "returncode": r.returncode, "counts": counts, "summary": tail[0], "elapsed_s": time.perf_counter() - t0,
            "output_tail": (r.stdout + r.stderr)[-3000:] if not ok else ""}


def breakdown(a, device: str, dtype: torch.dtype, deadline: float) -> tuple[list[dict], list[dict], list[dict]]:
    """Every (shape, method, B) cell, the graph probe and the verify curve
    (:func:`benchmarks.gpu_verify_curve.verify_curve`); cells past ``deadline`` are skipped."""
    from benchmarks.gpu_verify_curve import MODES, ROWS, SMOKE_ROWS, verify_curve

    cells, probes, curves = [], [], []
    gen = torch.Generator().manual_seed(0)
    runs = [(name, spec, graphs) for name, spec in shapes(a.smoke).items() if name in a.shapes
            for graphs in ((False, True) if a.graphs else (False,))]
    for name, spec, graphs in runs:
        if time.perf_counter() > deadline:
            cells.append({"shape": name, "graphs": graphs, "status": "skipped", "error": "time limit"})
            continue
        t0 = time.perf_counter()
        try:
            engine = build_engine(spec, device, dtype, a.context + a.rounds + 64, graphs=graphs)
        except Exception as e:  # noqa: BLE001 (reported per shape; the check goes on)
            cells.append({"shape": name, "graphs": graphs, "status": "error",
                          "error": f"build: {type(e).__name__}: {e}"[:500]})
            continue
        prompt = torch.randint(100, spec["target"]["vocab_size"] - 100, (a.context,), generator=gen).tolist()
        cells += _cells(engine, a, name, graphs, prompt, time.perf_counter() - t0, deadline)
        if not graphs:
            probes += _graph_probes(engine, name, a, device, deadline)
            modes = [m for m in MODES if a.graphs or m != "graphs"]
            curves += verify_curve(engine.target, name, a.context, SMOKE_ROWS if a.smoke else ROWS, a.probe_reps,
                                   deadline, modes)
        del engine
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return cells, probes, curves


def _cells(engine, a, name: str, graphs: bool, prompt: list[int], build_s: float, deadline: float) -> list[dict]:
    """The (method, B) cells of one engine: :func:`measure` after two untimed warm-up rounds; past
    ``deadline`` a cell is ``skipped``, a failing one is ``error`` with its message."""
    cells = []
    for m in (a.methods if not graphs else [m for m in a.methods if m in GRAPH_METHODS]):
        for b in (a.budgets if m in BUDGET_METHODS else [None]):
            cell = {"shape": name, "method": m, "budget": b, "build_s": build_s, "graphs": graphs}
            if time.perf_counter() > deadline:
                cells.append({**cell, "status": "skipped", "error": "time limit"})
                continue
            try:
                measure(engine, m, b, prompt, 2, f"warm-{name}-{m}-{b}")  # untimed warm-up
                cell.update(measure(engine, m, b, prompt, a.rounds, f"{name}-{m}-{b}"), status="ok")
                if graphs:
                    cell["graphs_captured"] = engine.runner.graphs.num_captured()
            except Exception as e:  # noqa: BLE001 (reported per cell; the check goes on)
                cell.update(status="error", error=f"{type(e).__name__}: {e}"[:500])
            cells.append(cell)
    return cells


def _graph_probes(engine, name: str, a, device: str, deadline: float) -> list[dict]:
    """:func:`graph_probe` of ``B + 1`` rows for every budget ``B`` until ``deadline``."""
    probes = []
    for b in a.budgets:
        if time.perf_counter() > deadline:
            break
        try:
            probes.append({"shape": name, **graph_probe(engine.target.model, b + 1, device, a.probe_reps)})
        except Exception as e:  # noqa: BLE001 (reported per probe; the check goes on)
            probes.append({"shape": name, "rows": b + 1, "error": f"{type(e).__name__}: {e}"[:500]})
    return probes
