"""Why the repeats of a timed step scatter on this VM: the same one-row step timed many times,
at 2 and 1 threads, back to back and interleaved with other formats, with the CPU's steal time and
every other process's CPU time over each block.

    python benchmarks/results/2026-12-03-first-start-cached/scatter.py --out scatter.json [--formats q4,bfloat16]

Prints one line per block (min, median, how many repeats within 15 % of the minimum, how many above
1.5x it, steal and foreign CPU seconds) and writes every time to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))


def cpu_times() -> dict:
    """``/proc/stat`` cpu line (jiffies): user nice system idle iowait irq softirq steal."""
    f = open("/proc/stat").readline().split()[1:9]
    return dict(zip("user nice system idle iowait irq softirq steal".split(), map(int, f)))


def foreign_cpu() -> float:
    """CPU seconds (user + system) of every process but this one, summed over /proc."""
    tck, me, total = os.sysconf("SC_CLK_TCK"), os.getpid(), 0
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            parts = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            total += int(parts[11]) + int(parts[12])
        except (OSError, IndexError):
            pass
    return total / tck


def block(name: str, fns: dict, n: int, warmup: int = 2) -> dict:
    """Time ``fns`` (label -> callable) ``n`` rounds, interleaved, after ``warmup`` untimed rounds."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    c0, f0 = cpu_times(), foreign_cpu()
    t0 = time.perf_counter()
    out = {k: [] for k in fns}
    for _ in range(n):
        for k, fn in fns.items():
            s = time.perf_counter()
            fn()
            out[k].append((time.perf_counter() - s) * 1e3)
    wall = time.perf_counter() - t0
    c1, f1 = cpu_times(), foreign_cpu()
    d = {k: c1[k] - c0[k] for k in c0}
    tot = sum(d.values()) or 1
    res = {"block": name, "wall_s": wall, "steal_pct": 100 * d["steal"] / tot, "idle_pct": 100 * d["idle"] / tot,
           "foreign_cpu_s": f1 - f0, "times_ms": out}
    for k, ts in out.items():
        lo = min(ts)
        med = sorted(ts)[len(ts) // 2]
        near = sum(t <= 1.15 * lo for t in ts)
        slow = sum(t > 1.5 * lo for t in ts)
        print(f"{name:32s} {k:14s} n={len(ts):2d} min {lo:6.2f} med {med:6.2f} max {max(ts):6.2f} ms  "
              f"<=1.15min {near:2d}  >1.5min {slow:2d}  steal {res['steal_pct']:.1f}% idle {res['idle_pct']:.0f}% "
              f"foreign {res['foreign_cpu_s']:.2f} s", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default="q4,bfloat16")
    ap.add_argument("--n", type=int, default=30)
    args = ap.parse_args()
    import torch

    from services.models.registry import resolve_target
    from services.weight_choice import _load_for_timing, step_callables
    from services.weights import load_causal_lm

    target = resolve_target(None)
    fmts = args.formats.split(",")
    models = {f: _load_for_timing(load_causal_lm, target, f, "cpu") for f in fmts}
    steps = {f: step_callables(m) for f, m in models.items()}
    res = {"env": {k: v for k, v in os.environ.items() if k.startswith(("OMP", "KMP", "GOMP", "MKL"))},
           "blocks": []}
    first = fmts[0]
    for threads in (2, 1):
        torch.set_num_threads(threads)
        res["blocks"].append(block(f"{threads}t {first} 1-row alone", {f"{first}/1": steps[first][1]}, args.n))
        res["blocks"].append(block(f"{threads}t {first} 9-row alone", {f"{first}/9": steps[first][9]}, args.n))
        gc.disable()
        res["blocks"].append(block(f"{threads}t {first} 1-row no gc", {f"{first}/1": steps[first][1]}, args.n))
        gc.enable()
        inter = {f"{f}/{r}": fn for f, per in steps.items() for r, fn in per.items()}
        res["blocks"].append(block(f"{threads}t interleaved", inter, max(args.n // 3, 5)))
    torch.set_num_threads(2)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
