"""What the goodput policy sees at c = 1 on GSM8K (q4, compiled steps, in process): its cost model's
forward seconds by rows, draft cost, sweep and real-step tables, and per-round forecasts / decisions.

    python benchmarks/results/2026-12-05-draft-phase-split/policy_diag.py
"""
from pathlib import Path
import sys, statistics, json, torch
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
torch.set_num_threads(2)
from benchmarks.bench_goodput import _prompts as goodput_prompts, run_level
from services.generate import build_inprocess
from services.verifier.build import build_engine
from services.verifier.engine import EngineConfig
from services.verifier.policy import FixedPolicy
from services.weights import compute_dtype
engine0, tok, note = build_inprocess(None, None, compute_dtype("q4"), weights="q4")
svc = engine0.drafter.service
defaults = engine0.policy.defaults
engine = build_engine(engine0.target, engine0.drafter, EngineConfig(max_running=1, compile=True),
                      max_draft_depth=engine0.max_draft_depth, policy="goodput", defaults=defaults,
                      cost_key=("smollm2-135m-instruct", "q4", "cpu"))
pol = engine.policy
log = []
orig_begin = pol.begin_step
def begin_step(rounds, extra_rows=0, num_running=1):
    orig_begin(rounds, extra_rows, num_running)
    for r in rounds:
        f = pol.forecast(pol._state(r.rid).regime, r.rid) if pol._state(r.rid).regime else None
        log.append({"rid": r.rid, "forecast": [round(x, 3) for x in (f or [])][:6],
                    "skip": r.rid in pol._skip, "plan": pol._plan.get(r.rid), "owed": r.owed})
pol.begin_step = begin_step
orig_select = pol.select
def select(items):
    out = orig_select(items)
    for d in items:
        s = out.get(d.info.rid)
        if s is not None and log:
            log[-1]["verified"] = s.budget if hasattr(s, "budget") else None
            log[-1]["pred_tau"] = round(s[2], 3) if isinstance(s, tuple) else None
    return out
pol.select = select
prompts = goodput_prompts(tok, "gsm8k", 6)
run_level(engine, prompts[:1], 1, "ar", None, 8)
for rep in range(1):
    engine.policy = FixedPolicy(defaults=defaults)
    r0 = run_level(engine, prompts, 1, "ar", None, 64)
    engine.policy = pol
    log.clear()
    r1 = run_level(engine, prompts, 1, "dartree-pruned", None, 64)
    print(f"ar {r0['tokens_per_s']:.1f}  goodput {r1['tokens_per_s']:.1f} tau {r1['tau']:.2f} plain {r1['plain_round_fraction']:.2f} steps {r1.get('step_ms')}")
c = pol.cost
print("forward ms", [round(1e3 * c.forward_seconds(r), 3) for r in range(1, 10)])
print("draft_cost(1) ms", round(1e3 * c.draft_cost(1), 3), "overhead ms", round(1e3 * c.overhead_seconds, 3), "overheads()", [round(1e3*x,3) for x in pol._overheads(1)])
for attr in ("_a", "_b", "draft_seconds", "_draft"):
    if hasattr(c, attr): print(attr, getattr(c, attr))
print("seed", {k: round(1e3*v,2) for k,v in sorted(c._seed.items())}); print("table", {k: round(1e3*v,2) for k,v in sorted(c._table.items())}); print("fit", c._fit()[:2]); print("draft coeffs", c.draft_coefficients(), "per-node", c.draft_node_coefficients(), "overhead coeffs", c.overhead_coefficients())
skips = sum(x["skip"] for x in log); print("rounds", len(log), "skipped", skips)
fs = [sum(x["forecast"][:3]) for x in log if x["forecast"]]
print("forecast sum3 mean", statistics.mean(fs) if fs else None)
for x in log[::max(1, len(log)//40)]:
    print(x)
if len(sys.argv) > 1:  # the per-round log as JSON
    json.dump(log, open(sys.argv[1], "w"))
