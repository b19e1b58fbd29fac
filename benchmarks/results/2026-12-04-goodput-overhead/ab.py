"""In-process A/B of the goodput policy's step pricing at c concurrent GSM8K requests (q4, 2 threads
unless ``OMP_NUM_THREADS`` says otherwise).

``prev``: t priced at every step, a lone request's too (the policy of commit f6bbf7a).

Arms, one engine (shared calibration and cost model), interleaved with the order rotated each rep
(``c1.json``, ``c4.json``, ``c8.json`` were taken at commit f6bbf7a, before ``prev`` existed):
``ar`` (plain decoding), ``old`` (no per-drafted-round overhead: t = 0, o = the moving average of
all steps; every request's forecast curve recomputed after every calibration label), ``new`` (the
policy as committed: o and t fitted, curves refreshed after as many labels as running requests).
Each run: 16 prompts (6 at c = 1) x 64 tokens, c in flight. Prints one line per run and a JSON
summary. From a checkout:

    PYTHONPATH=$PWD python benchmarks/results/2026-12-04-goodput-overhead/ab.py C REPS ar,old,new
"""
import sys, statistics, json, torch
from services.generate import build_inprocess
from benchmarks.bench_goodput import _prompts, run_level
engine, tok, note = build_inprocess(None, None, torch.bfloat16, weights="q4", spec_policy="goodput")
ds = sys.argv[4] if len(sys.argv) > 4 else "gsm8k"
prompts = _prompts(tok, ds, 16)
c, reps, arms = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
cost = engine.policy.cost
new_ro, new_req = cost.round_overhead, cost.request_overhead
def set_arm(arm):
    pol = engine.policy
    if arm == "prev":
        pol._overheads = lambda n: (cost.request_overhead(), cost.round_overhead())
        return
    pol.__dict__.pop("_overheads", None)
    if arm == "old":
        pol._fresh_labels = lambda: 1
        cost.round_overhead = lambda: 0.0
        cost.request_overhead = lambda: cost.overhead_seconds
    else:
        pol.__dict__.pop("_fresh_labels", None)
        cost.round_overhead, cost.request_overhead = new_ro, new_req
run_level(engine, prompts[:c], c, "ar", None, 16)
for arm in arms:
    if arm != "ar":
        set_arm(arm); run_level(engine, prompts[:c], c, "dartree-pruned", None, 16)
res = {a: [] for a in arms}
n = 16 if c > 1 else 6
for rep in range(reps):
    order = arms[rep % len(arms):] + arms[:rep % len(arms)]
    for arm in order:
        set_arm(arm)
        r = run_level(engine, prompts[:n], c, "ar" if arm == "ar" else "dartree-pruned", None, 64)
        res[arm].append(r["tokens_per_s"])
        print(f"{arm:4s} c={c} {r['tokens_per_s']:7.2f} tok/s tau {r['tau']:.2f} plain {r['plain_round_fraction']:.3f}"
              f" t {1e3 * new_ro():.2f} ms o {1e3 * new_req():.2f} ms", flush=True)
mean = {k: statistics.mean(v) for k, v in res.items()}
print(json.dumps({"c": c, "dataset": ds, "reps": reps, "tokens_per_s": res,
                  "mean": {k: round(v, 2) for k, v in mean.items()},
                  "vs_ar": {k: round(v / mean["ar"], 3) for k, v in mean.items()}}))
