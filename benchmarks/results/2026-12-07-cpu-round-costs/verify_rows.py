"""One target forward of R causal rows (compiled q4 step, empty slot): logits for every row (what a
tree verify computes) against the last row's only (what the goodput cost sweep timed before).

    python benchmarks/results/2026-12-07-cpu-round-costs/verify_rows.py [--reps 15] [--out verify_rows.json]

Row counts and both kinds interleaved; min and median ms of ``--reps`` calls each, after 3 warm-up calls.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from compiled_engine import compiled_engine  # noqa: E402

from services.tree.batch import causal_segment  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=15)
ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 9])
ap.add_argument("--out", default=None)
a = ap.parse_args()
engine, _ = compiled_engine()
runner = engine.runner
slot = runner.cache.alloc()


def forward(rows: int, every_row: bool) -> float:
    keep = None if every_row else torch.tensor([rows - 1])
    return runner.execute([causal_segment([3] * rows, 0, slot)], keep).seconds


for r in a.rows:
    for every in (False, True):
        for _ in range(3):
            forward(r, every)
times: dict = {}
for _ in range(a.reps):
    for r in a.rows:
        for every in (False, True):
            times.setdefault((r, every), []).append(forward(r, every))
out = []
for (r, every), v in sorted(times.items()):
    out.append({"rows": r, "logits": "every row" if every else "last row", "min_ms": round(min(v) * 1e3, 2),
                "median_ms": round(statistics.median(v) * 1e3, 2)})
    print(json.dumps(out[-1]), flush=True)
if a.out:
    Path(a.out).write_text(json.dumps({"forwards": out, "torch": torch.__version__}, indent=1) + "\n")
