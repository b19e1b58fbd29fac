"""Per-request attention call: torch's CPU SDPA vs the grouped two-GEMM attention, rows x KV length.

One call as the runner makes it per request and layer (SmolLM2-135M's 9 query / 3 KV heads, head
dim 64, K/V strided views of a slot cache, a causal mask over the last ``R`` positions). Prints the
median microseconds per call of each formulation and their ratio, then (``--invariance``) how many
rows differ bitwise from their 1-row call and how many calls change when masked columns are
appended; the last stdout line is one JSON object.

    python -m benchmarks.bench_decode_attention --threads 1
    python -m benchmarks.bench_decode_attention --threads 2 --dtypes bfloat16 --invariance
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from services.verifier.attention import additive_mask, grouped_attention

HQ, HKV, DH = 9, 3, 64
G = HQ // HKV
SCALE = DH ** -0.5
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _case(rows: int, length: int, dtype, pad: int = 0, seed: int = 0):
    """``(query [1, Hq, R, Dh], key, value [1, Hkv, L + pad, Dh], mask [1, 1, R, L + pad])``."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(1, rows, HQ, DH, generator=g).to(dtype).transpose(1, 2)
    cache = torch.randn(2, 1, HKV, 4096 + 512, DH, generator=g).to(dtype)
    mask = torch.zeros(1, 1, rows, length + pad, dtype=torch.bool)
    for r in range(rows):
        mask[0, 0, r, :length - rows + r + 1] = True
    return query, cache[0, :, :, :length + pad], cache[1, :, :, :length + pad], mask


def _sdpa(q, k, v, mask, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)


def _grouped(q, k, v, mask, bias):
    return grouped_attention(q, k, v, bias, SCALE)


IMPLS = {"sdpa": _sdpa, "grouped": _grouped}


def _time_us(fn, args, blocks: int, block_s: float) -> float:
    """Median over ``blocks`` of the mean microseconds per call in a block of ~``block_s`` seconds."""
    fn(*args)
    t = time.perf_counter()
    fn(*args)
    n = max(3, int(block_s / max(time.perf_counter() - t, 1e-6)))
    means = []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(n):
            fn(*args)
        means.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(means)


def _args(rows, length, dtype, pad=0, seed=0):
    q, k, v, m = _case(rows, length, dtype, pad, seed)
    return q, k, v, m, additive_mask(m, G)


def _invariance(fn, dtype, rows_list, lengths) -> dict:
    """Rows differing bitwise from their 1-row call, and calls changed by 64 / 448 appended masked columns."""
    rows_bad = rows_total = pad_bad = pad_total = 0
    for length in lengths:
        for rows in rows_list:
            if rows > length:
                continue
            q, k, v, m, b = _args(rows, length, dtype, seed=rows)
            out = fn(q, k, v, m, b)
            for r in range(rows):
                solo = fn(q[:, :, r:r + 1], k, v, m[:, :, r:r + 1], additive_mask(m[:, :, r:r + 1], G))
                rows_total += 1
                rows_bad += not torch.equal(solo[:, :, 0], out[:, :, r])
            for pad in (64, 448):
                pad_total += 1
                pad_bad += not torch.equal(fn(*_args(rows, length, dtype, pad, seed=rows)), out)
    return dict(rows_differ=rows_bad, rows_total=rows_total, pad_differ=pad_bad, pad_total=pad_total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 9, 13, 17])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--blocks", type=int, default=5, help="timing blocks per cell (median taken)")
    ap.add_argument("--block-s", type=float, default=0.01, help="seconds per timing block")
    ap.add_argument("--invariance", action="store_true", help="also count bitwise row / padding invariance")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    result = dict(threads=a.threads, torch=torch.__version__, cells=[], invariance={})
    for name in a.dtypes:
        dtype = DTYPES[name]
        print(f"\n{name}, {a.threads} thread(s): us per call, sdpa / grouped (ratio = sdpa / grouped)")
        print("rows \\ L " + "".join(f"{length:>18d}" for length in a.lengths))
        for rows in a.rows:
            line = f"{rows:8d} "
            for length in a.lengths:
                if rows > length:
                    line += f"{'-':>18s}"
                    continue
                args = _args(rows, length, dtype)
                us = {k: _time_us(f, args, a.blocks, a.block_s) for k, f in IMPLS.items()}
                result["cells"].append(dict(dtype=name, rows=rows, kv_length=length, **{f"{k}_us": round(v, 1)
                                                                                        for k, v in us.items()}))
                line += f"{us['sdpa']:7.0f}/{us['grouped']:5.0f} {us['sdpa'] / us['grouped']:4.1f}"
            print(line, flush=True)
        if a.invariance:
            for k, f in IMPLS.items():
                inv = _invariance(f, dtype, list(range(1, 18)), [32, 128, 512, 1024, 2048])
                result["invariance"][f"{name}/{k}"] = inv
                print(f"{name} {k:8s} rows differing from their 1-row call {inv['rows_differ']}/{inv['rows_total']}, "
                      f"calls changed by appended masked columns {inv['pad_differ']}/{inv['pad_total']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
