"""Verify cost vs tree size on the default target: how many draft nodes a round can afford.

Times ``TargetModel.verify`` (one forward with the 4-D tree mask) for random trees of N draft
nodes over a committed context of ``--context`` tokens, relative to a 1-token (AR) step, with plain
``F.linear`` weights and with float32 weights pre-packed for exactly ``N + 1`` rows
(``services/cpu_gemm.py``; ``--no-packed`` skips that column).
Prints a table; the last stdout line is one JSON object.
Usage: ``python -m benchmarks.bench_verify [--sizes 0 4 8 16 32 64] [--repeats 20] [--dtype float32]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def random_tree(n: int, gen: torch.Generator):
    """A random prefix-closed tree of n nodes with distinct sibling tokens."""
    from services.tree.draft_tree import tree_from_parents

    parents = [-1] + [int(torch.randint(-1, i, (), generator=gen)) for i in range(1, n)] if n else []
    tokens = [1000 + i for i in range(n)]
    return tree_from_parents(tokens, parents)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[0, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-packed", dest="packed", action="store_false", help="skip the pre-packed column")
    a = ap.parse_args(argv)
    from services.hf_compat import crop_cache, quiet_progress_bars
    from services.models.registry import resolve_target
    from services.tree import derive_buffers
    from services.verifier.target import TargetModel

    quiet_progress_bars()
    target = TargetModel.from_pretrained(resolve_target(None), dtype=getattr(torch, a.dtype))
    gen = torch.Generator().manual_seed(0)
    cache = target.new_cache()
    target.prefill(torch.randint(100, 40000, (a.context,), generator=gen).tolist(), cache)
    def timed(n: int) -> float:
        times = []
        for _ in range(a.repeats):
            buf = derive_buffers(random_tree(n, gen), 42)
            t0 = time.perf_counter()
            target.verify(buf, cache, a.context)
            times.append(time.perf_counter() - t0)
            crop_cache(cache, a.context)
        return round(1000 * statistics.median(times), 2)

    rows = [{"nodes": n, "verify_ms": timed(n)} for n in a.sizes]
    if a.packed:
        for r in rows:  # packs accumulate: each size runs on its own exact pack (N + 1 rows)
            if r["nodes"] >= 1 and target.pack_gemm([r["nodes"] + 1]):
                r["packed_ms"] = timed(r["nodes"])
    base = rows[0]["verify_ms"]
    for r in rows:
        r["x_ar_step"] = round(r["verify_ms"] / base, 2)
        if "packed_ms" in r:
            r["packed_x_ar_step"] = round(r["packed_ms"] / base, 2)
    print(f"{'nodes':>6} {'verify ms':>10} {'x AR step':>10} {'packed ms':>10} {'x AR step':>10}")
    for r in rows:
        print(f"{r['nodes']:6d} {r['verify_ms']:10.2f} {r['x_ar_step']:10.2f} {r.get('packed_ms', float('nan')):10.2f}"
              f" {r.get('packed_x_ar_step', float('nan')):10.2f}")
    print(json.dumps({"bench": "verify_cost", "context": a.context, "dtype": a.dtype, "rows": rows,
                      "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine()}))


if __name__ == "__main__":
    main()
