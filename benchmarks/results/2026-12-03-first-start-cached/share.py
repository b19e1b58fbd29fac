"""The timing process's CPU share (its CPU seconds / (wall seconds x threads)) over blocks of one-row
q4 steps, idle and with a competing process: the contention signal of the timing guard.

    python benchmarks/results/2026-12-03-first-start-cached/share.py
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

COMPETITORS = {
    "idle": None,
    "1 busy loop": [sys.executable, "-c", "while True: pass"],
    "torch 2-thread matmuls": [sys.executable, "-c",
                               "import torch\na=torch.randn(512,512)\nwhile True: a@a"],
}


def main() -> None:
    import torch

    from services.models.registry import resolve_target
    from services.weight_choice import _load_for_timing, step_callables
    from services.weights import load_causal_lm

    model = _load_for_timing(load_causal_lm, resolve_target(None), "q4", "cpu")
    step = step_callables(model)[1]
    for threads in (2, 1):
        torch.set_num_threads(threads)
        for name, cmd in COMPETITORS.items():
            proc = subprocess.Popen(cmd) if cmd else None
            time.sleep(0.5 if cmd else 0)
            for _ in range(3):
                step()
            w0, c0, ts = time.perf_counter(), time.process_time(), []
            for _ in range(20):
                s = time.perf_counter()
                step()
                ts.append((time.perf_counter() - s) * 1e3)
            share = (time.process_time() - c0) / ((time.perf_counter() - w0) * threads)
            if proc:
                proc.kill()
                proc.wait()
            ts.sort()
            print(f"{threads} threads, {name:24s} share {share:.2f}  min {ts[0]:6.1f} 2nd {ts[1]:6.1f} "
                  f"med {ts[10]:6.1f} max {ts[-1]:6.1f} ms", flush=True)


if __name__ == "__main__":
    main()
