"""The drafter's block forward (2 rows over a 150-position context) plus its one-row projection, eager
or through ``torch.compile`` (``DrafterService(compile=True)``), warm (back to back) and cold (after
a 2-row target step), then a torch.profiler table.

    python benchmarks/results/2026-12-05-draft-phase-split/block_compile.py            # eager
    python benchmarks/results/2026-12-05-draft-phase-split/block_compile.py compiled   # compiled
"""
from pathlib import Path
import sys, time, statistics, torch
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
torch.set_num_threads(2)
from services.drafter.model import load_drafter
from services.drafter import service as S
from services.models.registry import DEFAULT_DRAFTER_DIR, resolve_target
from services.verifier.build import make_runner, time_forward
from services.verifier.engine import EngineConfig
from services.verifier.target import TargetModel
tdir = resolve_target(None)
drafter = load_drafter(DEFAULT_DRAFTER_DIR, dtype=torch.bfloat16)
target = TargetModel.from_pretrained(tdir, drafter.config.target_layer_ids, weights="q4")
runner = make_runner(target, EngineConfig(compile=True)); runner.warm_up((1, 2))
embed, head = S.borrow_target_io(target.embed_tokens(), target.lm_head(), torch.bfloat16)
svc = S.DrafterService(drafter, embed, head, packed_gemm=True, compile=len(sys.argv) > 1)
if svc.compiled: print("warm-up", svc.warm_up())
n = 150
with torch.inference_mode():
    svc.append_context("r", torch.randn(n, svc.cfg.feature_dim).to(torch.bfloat16), n)
    def one(cold):
        if cold: time_forward(runner, 2)
        t = time.perf_counter(); svc._block("r", 5, n, logit_rows=1); return time.perf_counter() - t
    for cold in (False, True):
        ts = [one(cold) for _ in range(60)]
        print("cold" if cold else "warm", "block+head ms %.3f" % (1e3 * statistics.median(ts[10:])))
    from torch.profiler import profile, ProfilerActivity
    for _ in range(5): one(False)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(50): one(False)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
