"""Phase split of the drafter's replayed rounds, as ``bench_small_trees cost`` replays them.

Run from a checkout's root: ``PYTHONPATH=$PWD python <this file> --budgets 3 --passes 2 [--q4head]``.
q4 target, shipped drafter (bfloat16, int4 linears), ``dartree-pruned`` W = 12, rows B + 1, 2 prompts
each of GSM8K and MT-Bench, 48 greedy tokens; one warm-up pass then ``--passes`` timed ones. Per
round (medians, ms; with the calls per round): context append, block forward, output projection,
tree build and its parts (Domino scorer calls, candidates, prune); ``--q4head`` swaps the output
projection for an int4 copy (Q4_1) to time it; ``--prof`` prints a torch.profiler table.
"""
import argparse
import json
import statistics
import time

import torch
from benchmarks.bench_small_trees import _prompts, _engine, _TimedClient
from services.drafter.model import load_drafter
from services.models.registry import DEFAULT_DRAFTER_DIR, resolve_target
from services.replay import replay_rounds
from services.training.heldout import greedy_turns
from services.params import SpecParams
from services.verifier.target import TargetModel
from services.weights import compute_dtype, drafter_dtype

ap = argparse.ArgumentParser()
ap.add_argument("--budgets", type=int, nargs="+", default=[3])
ap.add_argument("--passes", type=int, default=3)
ap.add_argument("--prof", action="store_true")
ap.add_argument("--stack", action="store_true")
ap.add_argument("--q4head", action="store_true")
a = ap.parse_args()
torch.set_num_threads(1)
tdir = resolve_target(None)
ddt = drafter_dtype(compute_dtype("q4"))
drafter = load_drafter(DEFAULT_DRAFTER_DIR, dtype=ddt)
target = TargetModel.from_pretrained(tdir, drafter.config.target_layer_ids, weights="q4")
turns = greedy_turns(target, _prompts(tdir, ["gsm8k", "mt-bench"], 2), 48)
eng = _engine(target, drafter, ddt, 0, packed=True)
inner = eng.drafter
svc = getattr(inner, "service", None) or getattr(inner, "svc", None) or getattr(inner, "_svc", None)
assert svc is not None, vars(inner).keys()
ph = {}
def wrap(obj, name, key):
    f = getattr(obj, name)
    def g(*args, **kw):
        t0 = time.perf_counter(); r = f(*args, **kw); ph.setdefault(key, []).append(time.perf_counter() - t0); return r
    setattr(obj, name, g)
wrap(svc, "append_context", "append")
wrap(svc, "_block_forward", "block")
lm = svc.lm_head
if a.q4head:
    from services.weights import Int4Linear, quantize_q4_1
    lm = Int4Linear(quantize_q4_1(lm.weight.detach()), None, torch.bfloat16)
    lm.weight = lm.scale_zeros
class T(torch.nn.Module):
    def __init__(s, m): super().__init__(); s.m = m; s.weight = m.weight
    def forward(s, x):
        t0 = time.perf_counter(); y = s.m(x); ph.setdefault("proj", []).append(time.perf_counter() - t0); return y
svc.lm_head = T(lm)
wrap(svc, "_build", "build")
import sys

import services.drafter.service as S
import services.tree.dartree  # noqa: F401 (the submodule, shadowed by the function on services.tree)

DT = sys.modules["services.tree.dartree"]
for nm in ("root_state", "score", "advance"):
    wrap(S.DominoScorer, nm, "sc." + nm)
orig_init = S.DominoScorer.__init__
def init(self, *a, **k):
    t0 = time.perf_counter(); orig_init(self, *a, **k); ph.setdefault("sc.init", []).append(time.perf_counter() - t0)
S.DominoScorer.__init__ = init
for nm in ("candidates", "_prune_settled", "select_nodes", "top_b"):
    wrap(DT, nm, "dt." + nm)
wrap(svc, "_to_target_ids", "to_target")

eng.drafter = _TimedClient(eng.drafter)
def one_pass(b, tag):
    spec = SpecParams("dartree-pruned", budget=b, width=12)
    for k, t in enumerate(turns):
        for rr in replay_rounds(eng, t.prompt_ids, t.ref, t.finish, spec, f"{tag}-{b}-{k}"):
            pass
out = {}
with torch.inference_mode():
    for b in a.budgets:
        one_pass(b, "warm")
        ph.clear(); eng.drafter.seconds = []
        for p in range(a.passes):
            one_pass(b, f"p{p}")
        med = {k: (round(1e3 * statistics.median(v), 3), round(len(v)/len(eng.drafter.seconds), 2)) for k, v in ph.items()}
        med["total"] = round(1e3 * statistics.median(eng.drafter.seconds), 3)
        med["rounds"] = len(eng.drafter.seconds)
        out[b] = med
        print(b, med, flush=True)
        if a.prof:
            from torch.profiler import profile, ProfilerActivity
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=a.stack) as pr:
                one_pass(b, "prof")
            if a.stack:
                print(pr.key_averages(group_by_stack_n=5).table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
            else:
                print(pr.key_averages().table(sort_by="self_cpu_time_total", row_limit=45))
                print(pr.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=40, max_shapes_column_width=90))
print(json.dumps(out))
