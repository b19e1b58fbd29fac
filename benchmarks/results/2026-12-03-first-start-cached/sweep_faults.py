"""Per row count of the start-up cost sweep: its forward's time and the minor page faults it took,
over a few interleaved rounds, in a runner built as the verifier builds it (q4, 8 KV slots).

    python benchmarks/results/2026-12-03-first-start-cached/sweep_faults.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    from services.cpu_gemm import lazy_packing_paused
    from services.models.registry import resolve_target
    from services.verifier.build import make_runner, time_forward
    from services.verifier.cost_model import SWEEP_ROWS
    from services.verifier.engine import EngineConfig
    from services.verifier.target import TargetModel
    from services.weights import release_freed_memory

    target = TargetModel.from_pretrained(resolve_target(None), None, weights="q4")
    runner = make_runner(target, EngineConfig(max_running=8))
    release_freed_memory()
    with lazy_packing_paused():
        for i in range(args.rounds + 1):
            line = []
            for r in SWEEP_ROWS:
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                s = time_forward(runner, r)
                line.append(f"{r}:{s * 1e3:.0f}/{resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}")
            print(("warm-up " if i == 0 else f"round {i}  ") + "  ".join(line), flush=True)


if __name__ == "__main__":
    main()
