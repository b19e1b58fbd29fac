"""Where the engine's draft phase goes at c = 1 (q4, 1 thread, fixed B = 3, six GSM8K prompts x 64 tokens):
the engine's job preparation, the drafter's context append, block forward and tree build, each timed by a
wrapper. Run from a checkout: ``PYTHONPATH=$PWD python draft_path.py``."""
import time, statistics, torch, functools
from services.generate import build_inprocess
from benchmarks.bench_goodput import _prompts, run_level
torch.set_num_threads(1)
engine, tok, note = build_inprocess(None, None, torch.bfloat16, weights="q4")
T = {}
def wrap(obj, name, key):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); T.setdefault(key, []).append(time.perf_counter() - t0); return r
    setattr(obj, name, g)
wrap(engine, "_draft_job", "draft_job")
wrap(engine, "_submit", "submit")
svc = engine.drafter.service
wrap(svc, "draft_batch", "draft_batch")
wrap(svc, "append_context", "append_context")
wrap(svc, "_block", "block")
wrap(svc, "_build", "build")
prompts = _prompts(tok, "gsm8k", 6)
run_level(engine, prompts[:1], 1, "dartree-pruned", 3, 16)
T.clear()
r = run_level(engine, prompts, 1, "dartree-pruned", 3, 64)
print("tau", r["tau"], r["step_ms"])
for k, v in T.items():
    print(f"{k:15s} n {len(v):4d} median {1e3*statistics.median(v):.3f} ms mean {1e3*statistics.mean(v):.3f}")
