"""Where a draft round's time goes: the drafter service's context append, block forward, draft-vocabulary
projection and tree build, per budget B (q4 target with compiled steps, bfloat16 drafter as served,
2 threads, GSM8K prompts replayed, each draft after a (B + 1)-row target forward as in the engine).

    python benchmarks/results/2026-12-05-draft-phase-split/draft_split.py 1 2 3
"""
import statistics, sys, time, functools
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
torch.set_num_threads(2)
from benchmarks.bench_small_trees import _prompts, _TimedClient
from services.drafter.model import load_drafter
from services.drafter import service as S
from services.models.registry import DEFAULT_DRAFTER_DIR, resolve_target
from services.replay import replay_rounds
from services.training.heldout import greedy_turns
from services.verifier.build import build_engine, make_runner, time_forward
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SpecParams
from services.verifier.engine import EngineConfig
from services.verifier.target import TargetModel
tdir = resolve_target(None)
prompts = _prompts(tdir, ["gsm8k"], 3)
drafter = load_drafter(DEFAULT_DRAFTER_DIR, dtype=torch.bfloat16)
target = TargetModel.from_pretrained(tdir, drafter.config.target_layer_ids, weights="q4")
runner = make_runner(target, EngineConfig(compile=True))
runner.warm_up((1, 2, 3, 4))
turns = greedy_turns(target, prompts, 48)
embed, head = S.borrow_target_io(target.embed_tokens(), target.lm_head(), torch.bfloat16)
svc = S.DrafterService(drafter, embed, head, packed_gemm=True)
T = {}
def timed(name, f):
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T.setdefault(name, []).append(time.perf_counter() - t); return r
    return g
svc.append_context = timed("append_context", svc.append_context)
svc._block_forward = timed("block_forward", svc._block_forward)
svc.lm_head.forward = timed("lm_head", svc.lm_head.forward)
svc._build = timed("build", svc._build)
svc.drafter.context_kv_packed = timed("context_kv", svc.drafter.context_kv_packed)
eng = build_engine(target, InprocDrafterClient(svc), max_draft_depth=svc.block_rows, packed_gemm=False)
eng.drafter = _TimedClient(eng.drafter)
for b in [int(x) for x in sys.argv[1:]]:
    for rep in range(2):
        T.clear(); eng.drafter.seconds = []
        eng.drafter.before = lambda rows=b + 1: time_forward(runner, rows)
        for k, t in enumerate(turns):
            for rr in replay_rounds(eng, t.prompt_ids, t.ref, t.finish, SpecParams("dartree-pruned", budget=b, width=12), f"{b}-{rep}-{k}"):
                pass
    tot = statistics.median(eng.drafter.seconds) * 1e3
    print(f"B={b}: round {tot:.2f} ms; " + ", ".join(f"{n} {statistics.median(v)*1e3:.2f}" for n, v in T.items()), flush=True)
