"""A/B of the compiled step's fused-kernel threads: 1-, 2-, 4- and 8-row forwards after 160
positions, both arms' runners in one process, alternating (needs serial.diff applied: the
DARTREE_SERIAL_FUSED_KERNELS switch).

    git apply benchmarks/results/2026-12-05-cpu-ceiling/serial-fused-kernels/serial.diff
    python benchmarks/results/2026-12-05-cpu-ceiling/serial-fused-kernels/rows_ab.py 8
"""
import os, sys, statistics, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
torch.set_num_threads(2)
from services.models.registry import resolve_target, DEFAULT_DRAFTER_DIR
from services.drafter.model import load_drafter
from services.verifier.build import make_runner
from services.verifier.engine import EngineConfig
from services.verifier.target import TargetModel
from services.tree.batch import causal_segment
d = load_drafter(DEFAULT_DRAFTER_DIR, dtype=torch.bfloat16)
runners = {}
for arm in ("serial", "omp"):
    os.environ["DARTREE_SERIAL_FUSED_KERNELS"] = "1" if arm == "serial" else "0"
    target = TargetModel.from_pretrained(resolve_target(None), d.config.target_layer_ids, weights="q4")
    r = make_runner(target, EngineConfig(compile=True))
    r.warm_up((1, 2, 3, 4))
    slot = r.cache.alloc()
    r.execute([causal_segment(list(range(100, 260)), 0, slot)], torch.tensor([159]))
    runners[arm] = (r, slot)


def fwd(arm, rows):
    r, slot = runners[arm]
    return r.execute([causal_segment([0] * rows, 160, slot)], torch.tensor(list(range(rows)))).seconds

res = {(a, n): [] for a in runners for n in (1, 2, 4, 8)}
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    for a in (("serial", "omp") if rep % 2 == 0 else ("omp", "serial")):
        for n in (1, 2, 4, 8):
            ts = [fwd(a, n) for _ in range(15)]
            res[(a, n)].append(statistics.median(ts))
for n in (1, 2, 4, 8):
    s, o = statistics.median(res[("serial", n)]) * 1e3, statistics.median(res[("omp", n)]) * 1e3
    print(f"{n} rows: serial {s:.3f} ms, omp {o:.3f} ms, serial/omp {s/o:.3f}")
