"""One layer's slot attention call of a compiled step: the fused kernel vs the ATen-call op vs Python.

``dartree_native::slot_attention`` (the fused kernel, :mod:`services.native_lib`) against
``dartree_native::slot_attention_aten`` (the Python body's ATen calls from C++) and the Python body
itself (:func:`services.verifier.slot_attention.slot_attention_eager`), on SmolLM2-135M's attention shape
(9 query / 3 KV heads, head dim 64, bfloat16 cache): one request of ``R`` causal rows (1 = an ``ar``
step, 9 = a 9-node tree verify) at the end of ``L`` KV columns. Prints the median microseconds per
call and the best one (slot writes included, the per-step set-up not); the last stdout line is one
JSON object.

    python -m benchmarks.bench_native_attention --threads 2
    python -m benchmarks.bench_native_attention --rows 1 9 --lengths 256 1024 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from services.tree.batch import causal_segment, pack_segments
from services import native_lib as native
from services.verifier import slot_attention as SA
from services.verifier.kv_cache import SlotKVCache

HQ, HKV, DH = 9, 3, 64
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _setup(rows: int, length: int, dtype: torch.dtype):
    """A one-slot cache of ``length`` columns, the step's parts and its ``q, k, v``."""
    g = torch.Generator().manual_seed(0)
    cache = SlotKVCache(1, HKV, DH, 1, length, dtype, "cpu")
    for t in cache.keys + cache.values:
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    p = pack_segments([causal_segment(list(range(rows)), length - rows, 0)], 64, length)
    parts = SA.request_parts(p, HQ // HKV, torch.bfloat16)  # an additive bias whatever the dtype
    q = torch.randn(1, rows, HQ, DH, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, rows, HKV, DH, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(1, rows, HKV, DH, generator=g).to(dtype).transpose(1, 2)
    return cache, p, parts, (q, k, v)


def _time_us(fns: dict, reps: int) -> dict:
    """Per callable: ``(median, best)`` microseconds of one call over ``reps`` rounds, the callables
    interleaved within each round (on a shared machine the best is the steadier figure)."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t) * 1e6)
    return {k: (statistics.median(v), min(v)) for k, v in times.items()}


def _cell(rows: int, length: int, dtype: torch.dtype, reps: int) -> dict:
    cache, p, parts, (q, k, v) = _setup(rows, length, dtype)
    layer, scale = torch.tensor(0), DH ** -0.5
    fns = {"fused": lambda: torch.ops.dartree_native.slot_attention(q, k, v, layer, scale)}
    if dtype != torch.float32:  # the ATen-call op and the Python body serve the grouped (bf16 / fp16) path only
        fns["aten"] = lambda: torch.ops.dartree_native.slot_attention_aten(q, k, v, layer, scale)
        fns["python"] = lambda: SA.slot_attention_eager(0, q, k, v, None, scaling=scale)
    SA.native_step(cache, parts)
    SA.ACTIVE.step = (cache, p, parts, "dense")
    try:
        return _time_us(fns, reps)
    finally:
        SA.ACTIVE.step = None
        torch.ops.dartree_native.clear_step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 9])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--reps", type=int, default=200, help="timed calls per op and cell")
    a = ap.parse_args()
    if not native.load(build=True):
        raise SystemExit("dartree: the native slot attention is not available here")
    torch.set_num_threads(a.threads)
    result = dict(threads=a.threads, torch=torch.__version__, dtype=a.dtype, cells=[])
    print(f"{a.dtype}, {a.threads} thread(s): us per layer call, median / best of {a.reps}")
    print(f"{'rows':>5} {'L':>6} {'fused':>14} {'aten':>14} {'python':>14}")
    with torch.inference_mode():
        for rows in a.rows:
            for length in a.lengths:
                us = _cell(rows, length, DTYPES[a.dtype], a.reps)
                result["cells"].append(dict(rows=rows, kv_length=length, **{f"{k}_us": [round(m, 1), round(b, 1)]
                                                                            for k, (m, b) in us.items()}))
                print(f"{rows:5d} {length:6d} " + " ".join(f"{'%.0f / %.0f' % us[k] if k in us else '-':>14}"
                                                          for k in ("fused", "aten", "python")), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
