"""The compiled q4 lean step with inductor's C++ wrapper (``cpp_wrapper``) against the default Python
wrapper. ``cpp`` needs the decoder layers inlined (inductor has no C++ codegen for
``invoke_subgraph``, the nested compile regions), ``inl`` inlines them with the Python wrapper,
``py`` is the served step. Each mode in its own process and inductor cache:

    TORCHINDUCTOR_CACHE_DIR=/tmp/ind-MODE python benchmarks/results/2026-12-05-draft-phase-split/cpp_wrapper.py MODE
"""
from pathlib import Path
import sys, time, statistics, torch
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
torch.set_num_threads(2)
mode = sys.argv[1]
if mode in ("cpp", "inl"):  # layers inlined: no nested compile regions
    torch.compiler.nested_compile_region = lambda f: f
if mode == "cpp":
    import torch._inductor.config as ic
    ic.cpp_wrapper = True
from services.models.registry import resolve_target
from services.verifier.build import make_runner
from services.verifier.engine import EngineConfig
from services.verifier.target import TargetModel
from services.tree.batch import causal_segment
from services.drafter.model import load_drafter
from services.models.registry import DEFAULT_DRAFTER_DIR
tdir = resolve_target(None)
drafter = load_drafter(DEFAULT_DRAFTER_DIR, dtype=torch.bfloat16)
target = TargetModel.from_pretrained(tdir, drafter.config.target_layer_ids, weights="q4")
runner = make_runner(target, EngineConfig(compile=True))
t0 = time.perf_counter()
runner.warm_up((1, 4))
print("warm-up", round(time.perf_counter() - t0, 1), "s", flush=True)
times = []
for rep in range(6):
    slot = runner.cache.alloc()
    n = 120
    runner.execute([causal_segment([3] * n, 0, slot)], torch.tensor([n - 1])); runner.cache.extend(slot, n)
    for i in range(64):
        t = time.perf_counter()
        runner.execute([causal_segment([5], n, slot)])
        if rep: times.append(time.perf_counter() - t)
        runner.cache.extend(slot, 1); n += 1
    runner.cache.free(slot)
print(mode, "step median %.3f ms, p10 %.3f" % (1e3 * statistics.median(times), 1e3 * sorted(times)[len(times)//10]))
