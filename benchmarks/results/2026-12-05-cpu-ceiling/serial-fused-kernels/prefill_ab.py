"""The same A/B for prompt chunks: four 256-row chunks (positions 160 to 1,184), alternating arms
(needs serial.diff applied, as rows_ab.py).

    python benchmarks/results/2026-12-05-cpu-ceiling/serial-fused-kernels/prefill_ab.py
"""
import statistics
from pathlib import Path

import torch

src = (Path(__file__).resolve().parent / "rows_ab.py").read_text()
exec(src.split("\n\ndef fwd")[0])  # the two arms' runners, each with 160 positions in a slot


def chunk(arm, rows, start):
    r, slot = runners[arm]  # noqa: F821 (made by rows_ab.py's set-up)
    return r.execute([causal_segment(list(range(100, 100 + rows)), start, slot)],  # noqa: F821
                     torch.tensor([rows - 1])).seconds


res = {a: [] for a in runners}  # noqa: F821
for rep in range(6):
    for a in (("serial", "omp") if rep % 2 == 0 else ("omp", "serial")):
        res[a].append(sum(chunk(a, 256, s) for s in (160, 416, 672, 928)))
for a, v in res.items():
    print(a, "4 chunks of 256 rows (160..1184 positions): median", round(statistics.median(v) * 1e3, 1), "ms")
