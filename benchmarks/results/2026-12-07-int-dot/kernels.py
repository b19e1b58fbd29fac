"""torch's weight-only int4 / int8 CPU kernels against the integer-dot kernels, op by op.

One "model" of SmolLM2-135M's shapes (30 layers x the fused qkv 960x576, o 576x576, fused gate/up
3072x576, down 576x1536 int4 linears; the 49,152x576 int8 lm_head), random Q4_1 blocks: 53 MB of
int4 + 28 MB of int8, more than the 32 MB L3, so every call reads its weight from memory as a step
does. Each repeat runs the 120 linears then the head, torch's ops and ours interleaved; medians of
the repeats (ms for the 120 linears and for the head).

    python benchmarks/results/2026-12-07-int-dot/kernels.py --rows 1 2 4 5 9 64 --repeats 9 --out kernels.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from services import int_dot
from services.gguf_blocks import Q4Blocks
from services.q4_weights import Int4Linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def model(layers: int):
    g = torch.Generator().manual_seed(0)
    mats = []
    for _ in range(layers):
        for n, k in SHAPES:
            q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
            d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half().float()
            m = (-torch.rand(n, k // 32, generator=g) * 0.08).half().float()
            t = Int4Linear(Q4Blocks(q, d, m), kernel="torch")
            qw, dm = int_dot.pack_q4(q, d, m)
            mats.append((k, t.packed, t.scale_zeros, qw, dm))
    q8 = torch.randint(-127, 128, (49152, 576), generator=g).to(torch.int8)
    s = (torch.rand(49152, generator=g) * 0.01).bfloat16()
    return mats, (q8, s, int_dot.pack_q8(q8))


def one(kind: str, rows: int, mats, head) -> tuple[float, float]:
    xs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
    t0 = time.perf_counter()
    for k, packed, sz, qw, dm in mats:
        if kind == "torch":
            torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k], packed, 32, sz)
        else:
            torch.ops.dartree_native.q4_mm(xs[k], qw, dm)
    t1 = time.perf_counter()
    q8, s, p8 = head
    if kind == "torch":
        torch.ops.aten._weight_int8pack_mm(xs[576], q8, s)
    else:
        torch.ops.dartree_native.q8_mm(xs[576], p8, s)
    return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 9, 64])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if not int_dot.enabled():
        raise SystemExit("the integer-dot kernels do not run here (native library not built, or no VNNI)")
    mats, head = model(30)
    res = []
    for rows in a.rows:
        got = {"torch": [], "int_dot": []}
        for _ in range(a.repeats):
            for kind in got:
                got[kind].append(one(kind, rows, mats, head))
        row = {"rows": rows}
        for kind, v in got.items():
            row[f"{kind}_linears_ms"] = round(statistics.median(x for x, _ in v), 3)
            row[f"{kind}_head_ms"] = round(statistics.median(y for _, y in v), 3)
        res.append(row)
        print(json.dumps(row))
    out = {"threads": a.threads, "torch": torch.__version__, "isa": int_dot.isa(), "results": res}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
