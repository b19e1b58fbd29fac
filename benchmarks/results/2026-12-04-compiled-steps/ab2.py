"""In process, interleaved: eager lean step vs the compiled one with and without inductor's size asserts
(q4, 2 threads, 64-token ar runs, 6 repeats). ``python benchmarks/results/2026-12-04-compiled-steps/ab2.py``."""
import sys, statistics, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
torch.set_num_threads(2)
from services.generate import build_inprocess, encode
from services.weights import compute_dtype
from benchmarks.bench_step import engine_stats, PROMPT
from services.verifier import runner as R
from services.verifier import lean_step as LS
engine, tok, _ = build_inprocess(None, None, compute_dtype("q4"), weights="q4", compile=False)
run = engine.runner; tgt = engine.target
eager = run.lean
def mk(opts):
    l = LS.LeanLlamaStep(tgt.model, R._compiled_lean_attention, tgt._taps, tgt.target_layer_ids, compiled=True)
    return l, torch.compile(l.__call__, options=opts)
base = {"guard_filter_fn": R._step_guards, "emulate_precision_casts": True}
arms = {"eager": (eager, eager), "asserts": mk(base), "no-asserts": mk(base | {"size_asserts": False, "scalar_asserts": False})}
ids = encode(tok, PROMPT, chat=True)
res = {a: [] for a in arms}
for rep in range(6):
    for a, (lean, call) in arms.items():
        run.lean, run._lean_call = lean, call
        engine_stats(engine, ids, 8, "ar")
        res[a].append(engine_stats(engine, ids, 64, "ar")["ms_per_token"])
for a, v in res.items():
    print(a, [round(x, 2) for x in v], "median", round(statistics.median(v), 2))
