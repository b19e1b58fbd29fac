"""Is the engine's draft slower than the sweep's replay because of the target forward between two drafts?

Drafts two GSM8K prompts through the in-process q4 engine (fixed B = 3), keeps the last draft job's
drafter context, then times the same block forward + tree build 120 times right after a one-row
target step of another request (as in the engine) and 60 times back to back (as in the old replay).
From a checkout: ``PYTHONPATH=$PWD python cold_vs_warm.py THREADS``."""
import time, statistics, torch, sys
from services.generate import build_inprocess
from benchmarks.bench_goodput import _prompts, run_level
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
engine, tok, note = build_inprocess(None, None, torch.bfloat16, weights="q4")
svc = engine.drafter.service
jobs_seen = []
orig = svc.draft_batch
def capture(jobs):
    jobs_seen.append(jobs)
    return orig(jobs)
svc.draft_batch = capture
svc.release = lambda rid: None
prompts = _prompts(tok, "gsm8k", 4)
run_level(engine, prompts[:2], 1, "dartree-pruned", 3, 48)
svc.draft_batch = orig
# replay the last job of a request: its context already appended, so only block + build run
import copy
job = jobs_seen[-1][0]
from services.drafter.service import _reach
@torch.inference_mode()
def one():
    (hd, base), = svc.block_logits_batch([(job.request_id, job.root_token, job.start)], _reach(job))
    depth = base.shape[0] if job.max_depth is None else max(0, min(job.max_depth, base.shape[0]))
    return svc._build(job.method, job.spec, hd[:depth], base[:depth], job.root_token)
print("tree nodes", one().num_nodes)
runner = engine.runner
ids = torch.tensor([[1]]); 
def target_forward():
    engine.step_batch  # noqa
    # a one-row ar forward of another request: use the engine
warm, cold = [], []
# cold: a full ar step of another request between drafts
from services.params import SamplingParams, SpecParams
engine.add_request("bg", prompts[3], SamplingParams(max_tokens=400, ignore_eos=True), SpecParams("ar"))
engine.step_batch(["bg"])
for i in range(60):
    engine.step_batch(["bg"])
    t0 = time.perf_counter(); one(); cold.append(time.perf_counter() - t0)
for i in range(60):
    t0 = time.perf_counter(); one(); warm.append(time.perf_counter() - t0)
for i in range(60):
    engine.step_batch(["bg"])
    t0 = time.perf_counter(); one(); cold.append(time.perf_counter() - t0)
print(f"after a target step: median {1e3*statistics.median(cold):.3f} ms; back to back: {1e3*statistics.median(warm):.3f} ms")
