"""Op-level profile of a small tree's draft, warm (back to back): the drafter's block forward and
draft-vocabulary projection over B + 1 rows against 150 context positions, and the Domino tree build
(``dartree-pruned``, the CPU's default knobs at budget B), q4 target's borrowed embedding / lm_head,
bfloat16 drafter with int4 linears as served, 2 threads.

    python benchmarks/results/2026-12-05-cpu-ceiling/draft_profile.py B
"""
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
torch.set_num_threads(2)
from torch.profiler import profile  # noqa: E402

from services.drafter import build as B, service as S  # noqa: E402
from services.drafter.model import load_drafter  # noqa: E402
from services.models.registry import DEFAULT_DRAFTER_DIR, resolve_target  # noqa: E402
from services.spec import TreeKnobs, default_tree_knobs  # noqa: E402
from services.verifier.target import TargetModel  # noqa: E402

B = int(sys.argv[1]) if len(sys.argv) > 1 else 3
drafter = load_drafter(DEFAULT_DRAFTER_DIR, dtype=torch.bfloat16)
target = TargetModel.from_pretrained(resolve_target(None), drafter.config.target_layer_ids, weights="q4")
embed, head = B.borrow_target_io(target.embed_tokens(), target.lm_head(), torch.bfloat16)
svc = S.DrafterService(drafter, embed, head, packed_gemm=True)
kn = default_tree_knobs("cpu")
spec = TreeKnobs(budget=B, width=kn.width, depth_bonus=kn.depth_bonus, candidates=kn.candidates)


def median_ms(f, n=200):
    for _ in range(20):
        f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


with torch.inference_mode():
    svc.append_context("r", torch.randn(150, svc.cfg.feature_dim, dtype=torch.bfloat16), 150)
    hd, base = svc.block_logits_batch([("r", 100, 150)], B)[0]
    block = lambda: svc.block_logits_batch([("r", 100, 150)], B)  # noqa: E731
    build = lambda: svc._build("dartree-pruned", spec, hd[:B], base[:B], 100)  # noqa: E731
    tree = build()
    print(f"B = {B}: block forward + projection {median_ms(block):.2f} ms, tree build {median_ms(build):.2f} ms "
          f"(tree depths {tree.depths.tolist()})")
    for name, f in (("block forward + projection", block), ("tree build", build)):
        with profile() as p:
            for _ in range(50):
                f()
        print(f"\n{name}, 50 calls:")
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
