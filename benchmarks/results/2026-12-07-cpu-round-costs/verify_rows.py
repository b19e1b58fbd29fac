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

import torch  # noqa: E402

from services.generate import build_inprocess  # noqa: E402
from services.tree.batch import causal_segment  # noqa: E402
from services.verifier.build import build_engine  # noqa: E402
from services.verifier.engine import EngineConfig  # noqa: E402
from services.weights import compute_dtype  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=15)
ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 9])
ap.add_argument("--out", default=None)
a = ap.parse_args()
torch.set_num_threads(2)
engine0, _, _ = build_inprocess(None, None, compute_dtype("q4"), weights="q4")
engine = build_engine(engine0.target, engine0.drafter, EngineConfig(max_running=1, compile=True),
                      max_draft_depth=engine0.max_draft_depth, policy="fixed", defaults=engine0.policy.defaults,
                      cost_key=("smollm2-135m-instruct", "q4", "cpu"))
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
