"""Device walk vs host walk of a CPU target's rounds, in process (c = 1, compiled q4 step).

    python benchmarks/results/2026-12-07-cpu-round-costs/walk_ab.py [--reps 3] [--out walk_ab.json]

Per repeat and walk: 3 GSM8K prompts x 96 tokens through the in-process engine (``run_level``), plain
decoding (``ar``) and a fixed B = 2 tree; tokens/s and the decode step split (forward, draft wait,
the rest) in ms. Both walks commit the same tokens (checked).
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from compiled_engine import compiled_engine  # noqa: E402

from benchmarks.bench_goodput import _prompts, run_level  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--out", default=None)
a = ap.parse_args()
engine, tok = compiled_engine()
prompts = _prompts(tok, "gsm8k", 3)
run_level(engine, prompts[:1], 1, "ar", None, 8)
cfg, rows, outs = engine.config, [], {}
for rep in range(a.reps):
    for walk in ("device", "host"):
        engine.config = dataclasses.replace(cfg, device_walk=walk == "device")
        for method, budget in (("ar", None), ("dartree-pruned", 2)):
            r = run_level(engine, prompts, 1, method, budget, 96)
            same = outs.setdefault(method, r["outputs"]) == r["outputs"]
            rows.append({"rep": rep, "walk": walk, "method": method, "budget": budget,
                         "tokens_per_s": round(r["tokens_per_s"], 2), "step_ms": r["step_ms"], "same_tokens": same})
            print(json.dumps(rows[-1]), flush=True)
if a.out:
    Path(a.out).write_text(json.dumps({"runs": rows, "torch": torch.__version__}, indent=1) + "\n")
