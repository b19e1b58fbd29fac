"""Where a plain q4 ``ar`` decode step's time goes: torch.profiler over ``--steps`` steps of the engine.

Builds the in-process engine as ``dartree generate --method ar --weights q4`` does (eager, packed
bf16 lm_head), prefills a short chat prompt, runs ``--warmup`` steps, times ``--steps`` steps without
the profiler, then ``--steps`` more under it, and sorts the profiler's self CPU time into int4
linears, the lm_head, attention, norms / rotary / elementwise, other aten ops, and the rest of the
step's wall time (Python and dispatch outside any op).

    python benchmarks/results/2026-12-03-first-start/profile_ar.py --steps 50 --out profile_ar.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

CATEGORIES = [  # (category, op-name fragments), first match wins
    ("int4 linears", ("_weight_int4pack_mm",)),
    ("lm_head (oneDNN bf16)", ("_linear_pointwise", "mkldnn")),
    ("attention", ("scaled_dot_product", "flash_attention", "softmax", "bmm", "baddbmm")),
    ("norms / rotary / elementwise", ("pow", "mean", "rsqrt", "mul", "add", "neg", "cat", "silu", "sub", "div",
                                      "cos", "sin", "to", "copy_", "_to_copy")),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from services.generate import build_inprocess, encode
    from services.params import SamplingParams, SpecParams

    engine, tok, _ = build_inprocess(None, None, torch.bfloat16, weights="q4", spec_policy="fixed")
    ids = encode(tok, "Write a short story about a lighthouse keeper who finds a message in a bottle.", True)
    total = args.warmup + 2 * args.steps + 1
    sampling = SamplingParams(max_tokens=total + 8, temperature=0.0, ignore_eos=True)
    gen = engine.generate(uuid.uuid4().hex, ids, sampling, SpecParams("ar"))
    next(gen)  # the prefill
    for _ in range(args.warmup):
        next(gen)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        next(gen)
    plain_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            next(gen)
        prof_wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    gen.close()
    per_cat: dict[str, float] = {c: 0.0 for c, _ in CATEGORIES}
    per_cat["other aten ops"] = 0.0
    top = []
    for ev in prof.key_averages():
        ms = ev.self_cpu_time_total / 1e3 / args.steps
        top.append((ms, ev.key, ev.count // args.steps))
        cat = next((c for c, frags in CATEGORIES if any(f in ev.key for f in frags)), "other aten ops")
        per_cat[cat] += ms
    in_ops = sum(per_cat.values())
    per_cat["outside ops (Python, dispatch)"] = prof_wall_ms - in_ops
    result = {"threads": torch.get_num_threads(), "steps": args.steps, "prompt_tokens": len(ids),
              "step_ms_without_profiler": round(plain_ms, 2), "step_ms_under_profiler": round(prof_wall_ms, 2),
              "ms_per_step": {k: round(v, 2) for k, v in per_cat.items()},
              "top_ops": [{"op": k, "ms_per_step": round(ms, 3), "calls_per_step": n}
                          for ms, k, n in sorted(top, reverse=True)[:15]]}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
