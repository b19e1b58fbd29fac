"""A drafter context append (DrafterService.append_context) of n prompt positions, int4 context
projections vs their dense copies, one service each, alternating; 2 threads.

    python benchmarks/results/2026-12-05-cpu-ceiling/catch_up.py
"""
import sys, time, statistics, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
torch.set_num_threads(2)
from services.drafter.model import load_drafter
from services.drafter import build as B, service as S
from services.models.registry import DEFAULT_DRAFTER_DIR, resolve_target
from services.verifier.target import TargetModel
target = TargetModel.from_pretrained(resolve_target(None), [1, 8, 14, 20, 27], weights="q4")
svcs = {}
for arm, rows in (("int4", None), ("dense", S.CATCH_UP_DENSE_ROWS)):
    drafter = load_drafter(DEFAULT_DRAFTER_DIR, dtype=torch.bfloat16)
    embed, head = B.borrow_target_io(target.embed_tokens(), target.lm_head(), torch.bfloat16)
    svcs[arm] = S.DrafterService(drafter, embed, head, packed_gemm=True, catch_up_rows=rows)
F = svcs["int4"].cfg.feature_dim
res = {}
for n in (8, 16, 64, 128, 512, 2048):
    feats = torch.randn(n, F, dtype=torch.bfloat16)
    for rep in range(6):
        for arm in (("int4", "dense") if rep % 2 == 0 else ("dense", "int4")):
            svc = svcs[arm]
            t = time.perf_counter()
            svc.append_context("r", feats, n)
            res.setdefault((arm, n), []).append(time.perf_counter() - t)
            svc.release("r")
    a, b = statistics.median(res[("int4", n)][1:]) * 1e3, statistics.median(res[("dense", n)][1:]) * 1e3
    print(f"append of {n:5d} positions: int4 {a:8.3f} ms ({a / n * 1e3:5.1f} us a position), "
          f"dense {b:8.3f} ms ({b / n * 1e3:5.1f} us), dense/int4 {b / a:.2f}")
