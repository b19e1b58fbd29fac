"""Two probes of the decode attention's bfloat16 GEMMs at SmolLM2-135M's shape (9 query heads, 3 KV
heads, head dim 64), 2 threads.

    python benchmarks/results/2026-12-05-serving-overhead/attention_probe.py sdpa
    python benchmarks/results/2026-12-05-serving-overhead/attention_probe.py shapes {grow,pad64,fixed}

``sdpa``: µs a call of the grouped formulation (services/verifier/attention.py: two oneDNN bmm
and a float32 softmax) against torch's CPU SDPA on the same grouped layout, 1 and 4 rows, 50 to
1,000 KV columns; then how often a tree row (its path's columns, one masked sibling among them)
equals the same row computed over its path alone (a different, stricter check than the runner's
invariance: the columns are compacted) in each formulation.

``shapes``: ms a 30-layer step of the grouped attention when the KV length grows by one every step
(``grow``: every step a new GEMM shape, a oneDNN primitive created for it), when it is rounded up to
a multiple of 64 (``pad64``: what the runner's ``kv_bucket`` does) and when it stays fixed. Run each
mode in its own process (oneDNN's primitive cache is per process).
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
DT = torch.bfloat16


def grouped(q, k, v, bias, scale):
    hq, rows, dh = q.shape[1], q.shape[2], q.shape[3]
    hkv = k.shape[0]
    qq = q.select(0, 0).reshape(hkv, hq // hkv * rows, dh)
    s = torch.bmm(k, qq.transpose(1, 2))
    p = torch.softmax(torch.add(bias, s.transpose(1, 2), alpha=scale), -1).to(q.dtype)
    return torch.bmm(p, v).view(1, hq, rows, dh)


def sdpa(q, k, v, bias, scale):
    hq, rows, dh = q.shape[1], q.shape[2], q.shape[3]
    hkv = k.shape[0]
    qq = q.select(0, 0).reshape(1, hkv, hq // hkv * rows, dh)
    out = F.scaled_dot_product_attention(qq, k.unsqueeze(0), v.unsqueeze(0), attn_mask=bias.to(DT), scale=scale)
    return out.view(1, hq, rows, dh)


def timed(f, *args, n=1000):
    for _ in range(100):
        f(*args)
    t = time.perf_counter()
    for _ in range(n):
        f(*args)
    return (time.perf_counter() - t) / n * 1e6


def probe_sdpa() -> None:
    for length in (50, 200, 300, 500, 600, 800, 1000):
        for rows in (1, 4):
            q = torch.randn(1, 9, rows, 64, dtype=DT)
            k, v = torch.randn(3, length, 64, dtype=DT), torch.randn(3, length, 64, dtype=DT)
            bias = torch.zeros(3 * rows, length)
            g = min(timed(grouped, q, k, v, bias, 0.125) for _ in range(2))
            s = min(timed(sdpa, q, k, v, bias, 0.125) for _ in range(2))
            print(f"L {length:5d} rows {rows}: grouped {g:6.1f} us  sdpa {s:6.1f} us", flush=True)
    torch.manual_seed(0)
    for f in (grouped, sdpa):
        differ = 0
        for _ in range(50):
            n = int(torch.randint(20, 700, ()).item())
            k, v = torch.randn(3, n + 4, 64, dtype=DT), torch.randn(3, n + 4, 64, dtype=DT)
            q = torch.randn(1, 9, 4, 64, dtype=DT)
            visible = [[n], [n + 1], [n, n + 2], [n, n + 2, n + 3]]  # a root child, its sibling, a chain
            mask = torch.full((4, n + 4), float("-inf"))
            mask[:, :n] = 0
            for r, cols in enumerate(visible):
                mask[r, cols] = 0
            tree_out = f(q, k, v, mask.repeat(3, 1), 0.125)
            idx = list(range(n)) + visible[3]
            alone = f(q[:, :, 3:4], k[:, idx], v[:, idx], torch.zeros(3, len(idx)), 0.125)
            differ += not torch.equal(alone[:, :, 0], tree_out[:, :, 3])
        print(f"{f.__name__}: the path's last row differs from the row over its path alone in {differ} of 50")


def probe_shapes(mode: str) -> None:
    k, v = torch.randn(3, 2400, 64, dtype=DT), torch.randn(3, 2400, 64, dtype=DT)
    q = torch.randn(3, 3, 64, dtype=DT)
    bias = torch.zeros(3, 2400)

    def step(length):
        for _ in range(30):
            s = torch.bmm(k[:, :length], q.transpose(1, 2))
            p = torch.softmax(torch.add(bias[:, :length], s.transpose(1, 2), alpha=0.125), -1).to(DT)
            torch.bmm(p, v[:, :length])

    step(64)
    t = time.perf_counter()
    for i in range(300):
        length = 300 + i
        if mode == "pad64":
            length = (length + 63) // 64 * 64
        step(300 if mode == "fixed" else length)
    print(f"{mode}: {(time.perf_counter() - t) / 300 * 1e3:.3f} ms a 30-layer step")


if __name__ == "__main__":
    if sys.argv[1] == "sdpa":
        probe_sdpa()
    else:
        probe_shapes(sys.argv[2])
