"""The weight-format choice ``--runs`` times in a row (nothing cached), a competing process running
for part of each measurement: which format each run chose, from a measurement or by rule, and its
figures.

    python benchmarks/results/2026-12-03-first-start-cached/choice_under_load.py --runs 10 --out choice.json

The competitor (``python -c "while True: pass"``, or a 2-thread torch matmul loop every other run)
starts a random 0-4 s after the models are loaded and runs 1-4 s.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

COMPETITORS = [[sys.executable, "-c", "while True: pass"],
               [sys.executable, "-c", "import torch\na=torch.randn(512,512)\nwhile True: a@a"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from services import weight_choice as WC
    from services.models.registry import resolve_target
    from services.weight_formats import kernels_version
    from services.weights import available_formats, load_causal_lm

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("services.weights").addHandler(Keep())
    logging.getLogger("services.weights").setLevel(logging.INFO)
    target = resolve_target(None)
    rng = random.Random(0)
    runs = []
    for i in range(args.runs):
        start, length = rng.uniform(0, 4), rng.uniform(1, 4)
        loaded = threading.Event()

        def load(d, fmt, dev, _loaded=loaded, _n=[0]):
            m = load_causal_lm(d, fmt, dev)
            _n[0] += 1
            if _n[0] == 3:
                _loaded.set()
            return m

        def compete(cmd=COMPETITORS[i % 2], ev=loaded, s=start, n=length):
            ev.wait()
            time.sleep(s)
            p = subprocess.Popen(cmd)
            time.sleep(n)
            p.kill()
            p.wait()

        th = threading.Thread(target=compete, daemon=True)
        th.start()
        n0 = len(lines)
        t0 = time.perf_counter()
        choice = WC.choose_auto(target, available_formats(target), load, kernels_version(), cache=False)
        took = time.perf_counter() - t0
        th.join()
        line = next((x for x in lines[n0:] if x.startswith("weights auto")), "")
        runs.append({"choice": choice, "competitor": " ".join(COMPETITORS[i % 2][2:])[:30],
                     "competitor_start_s": round(start, 2), "competitor_s": round(length, 2), "took_s": round(took, 1),
                     "line": line})
        print(i, choice, f"{took:.1f} s", f"competitor +{start:.1f} s for {length:.1f} s", line[:260], flush=True)
    Path(args.out).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
