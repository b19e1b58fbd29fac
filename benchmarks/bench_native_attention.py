"""One layer's slot attention call of a compiled step: the fused kernel vs the ATen-call op vs Python.

``dartree_native::slot_attention`` (the fused kernel, :mod:`services.verifier.native`) against
``dartree_native::slot_attention_aten`` (the Python body's ATen calls from C++) and the Python body
itself (:func:`services.verifier.runner._slot_attention_eager`), on SmolLM2-135M's attention shape
(9 query / 3 KV heads, head dim 64, bfloat16 cache): one request of ``R`` causal rows (1 = an ``ar``
step, 9 = a 9-node tree verify) at the end of ``L`` KV columns. Prints the median microseconds per
call (slot writes included, the per-step set-up not); the last stdout line is one JSON object.

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
from services.verifier import native
from services.verifier import runner as R
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
    parts = R._request_parts(p, HQ // HKV, torch.bfloat16)  # an additive bias whatever the dtype
    q = torch.randn(1, rows, HQ, DH, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(1, rows, HKV, DH, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(1, rows, HKV, DH, generator=g).to(dtype).transpose(1, 2)
    return cache, p, parts, (q, k, v)


def _time_us(fn, blocks: int, block_s: float) -> float:
    """Median over ``blocks`` of the mean microseconds per call in a block of ~``block_s`` seconds."""
    fn()
    t = time.perf_counter()
    fn()
    n = max(3, int(block_s / max(time.perf_counter() - t, 1e-6)))
    means = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        means.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(means)


def _cell(rows: int, length: int, dtype: torch.dtype, blocks: int, block_s: float) -> dict:
    cache, p, parts, (q, k, v) = _setup(rows, length, dtype)
    layer, scale = torch.tensor(0), DH ** -0.5
    out = {}
    R._native_step(cache, parts)
    try:
        for name, op in (("fused", torch.ops.dartree_native.slot_attention),
                         ("aten", torch.ops.dartree_native.slot_attention_aten)):
            if name == "aten" and dtype == torch.float32:
                continue  # the ATen-call op serves the grouped (bfloat16 / float16) path only
            out[name] = _time_us(lambda: op(q, k, v, layer, scale), blocks, block_s)
    finally:
        torch.ops.dartree_native.clear_step()
    if dtype != torch.float32:
        R._ACTIVE.step = (cache, p, parts, "dense")
        try:
            out["python"] = _time_us(lambda: R._slot_attention_eager(0, q, k, v, None, scaling=scale), blocks, block_s)
        finally:
            R._ACTIVE.step = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 9])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--blocks", type=int, default=5, help="timing blocks per cell (median taken)")
    ap.add_argument("--block-s", type=float, default=0.05, help="seconds per timing block")
    a = ap.parse_args()
    if not native.load(build=True):
        raise SystemExit("dartree: the native slot attention is not available here")
    torch.set_num_threads(a.threads)
    result = dict(threads=a.threads, torch=torch.__version__, dtype=a.dtype, cells=[])
    print(f"{a.dtype}, {a.threads} thread(s): us per layer call")
    print(f"{'rows':>5} {'L':>6} {'fused':>8} {'aten':>8} {'python':>8}")
    with torch.inference_mode():
        for rows in a.rows:
            for length in a.lengths:
                us = _cell(rows, length, DTYPES[a.dtype], a.blocks, a.block_s)
                result["cells"].append(dict(rows=rows, kv_length=length, **{f"{k}_us": round(t, 1) for k, t in us.items()}))
                print(f"{rows:5d} {length:6d} " + " ".join(f"{us.get(k, float('nan')):8.1f}"
                                                          for k in ("fused", "aten", "python")), flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
