"""Would float32 attention GEMMs make the q4 step cheaper without losing row invariance?

    python benchmarks/results/2026-12-05-cpu-ceiling/attention_f32_probe.py

SmolLM2-135M's shapes (3 KV heads, 3 query heads each, head dim 64), 2 threads. Part 1: is a row's
float32 result bitwise the same alone and among R rows, for the grouped formulation the runner uses
(``k @ q^T``, ``p @ v``) and for one with the rows moved into the batch dimension (every GEMM then has
the same shape, G rows)? Is it the same with masked columns appended? Part 2: the cost of the
bfloat16 GEMM pair the runner calls against the row-batched float32 pair including the casts of the
bfloat16 KV cache (the cache stays bfloat16: float32 would double its memory).
"""
import statistics
import time

import torch

torch.manual_seed(0)
torch.set_num_threads(2)
G, H, D = 3, 3, 64


def qk_rows(K, q, R):  # q [H, G*R, D] (row g*R + r) -> scores [H, R, L, G], one G-row GEMM per (head, row)
    qr = q.view(H, G, R, D).transpose(1, 2).reshape(H * R, G, D)
    Kr = K[:, None].expand(H, R, *K.shape[1:]).reshape(H * R, *K.shape[1:])
    return torch.bmm(Kr, qr.transpose(1, 2)).view(H, R, K.shape[1], G)


def pv_rows(P, V, R):  # P [H, R, G, L] -> [H, R, G, D]
    Vr = V[:, None].expand(H, R, *V.shape[1:]).reshape(H * R, *V.shape[1:])
    return torch.bmm(P.reshape(H * R, G, -1), Vr).view(H, R, G, D)


def timed(f, n=1000):
    for _ in range(50):
        f()
    ts = []
    for _ in range(n):
        a = time.perf_counter()
        f()
        ts.append(time.perf_counter() - a)
    return statistics.median(ts) * 1e6


with torch.inference_mode():
    grouped = {"k @ q^T": 0, "p @ v": 0}
    batched = tot = 0
    for L in (64, 100, 192, 257, 512, 1000):
        K, V = torch.randn(H, L, D), torch.randn(H, L, D)
        for R in (2, 3, 4, 5, 8, 9, 17, 32):
            q = torch.randn(H, G * R, D)
            P = torch.softmax(torch.randn(H, G * R, L), -1)
            s_all, o_all = torch.bmm(K, q.transpose(1, 2)), torch.bmm(P, V)
            s_b, o_b = qk_rows(K, q, R), pv_rows(P.view(H, G, R, L).transpose(1, 2).contiguous(), V, R)
            for r in range(R):
                tot += 1
                sel = torch.arange(G) * R + r
                grouped["k @ q^T"] += not torch.equal(torch.bmm(K, q[:, sel].transpose(1, 2)), s_all[:, :, sel])
                grouped["p @ v"] += not torch.equal(torch.bmm(P[:, sel], V), o_all[:, sel])
                s1 = qk_rows(K, q[:, sel].contiguous(), 1)
                o1 = pv_rows(P[:, sel].contiguous().view(H, 1, G, L), V, 1)
                batched += (not torch.equal(s1[:, 0], s_b[:, r])) or (not torch.equal(o1[:, 0], o_b[:, r]))
    print(f"float32, a row alone vs among R rows ({tot} cases): grouped GEMMs differ "
          f"{grouped['k @ q^T']} (k @ q^T) / {grouped['p @ v']} (p @ v); rows in the batch dimension differ {batched}")
    same = n = 0
    for L0 in (60, 100, 190, 250, 500, 1000):
        for L in (L0 + 1, L0 + 4, ((L0 + 63) // 64) * 64 + 64):
            K, V, q = torch.randn(H, L, D), torch.randn(H, L, D), torch.randn(H, G, D)
            P = torch.softmax(torch.randn(H, G, L0), -1)
            Pp = torch.cat([P, torch.zeros(H, G, L - L0)], -1)
            n += 1
            same += (torch.equal(torch.bmm(P, V[:, :L0]), torch.bmm(Pp, V))
                     and torch.equal(torch.bmm(K[:, :L0], q.transpose(1, 2)), torch.bmm(K, q.transpose(1, 2))[:, :L0]))
    print(f"float32, masked columns appended: {same} of {n} calls bitwise unchanged")
    for L in (192, 512, 2048):
        Kb, Vb = torch.randn(H, L, D, dtype=torch.bfloat16), torch.randn(H, L, D, dtype=torch.bfloat16)
        for R in (1, 4):
            qb = torch.randn(H, G * R, D, dtype=torch.bfloat16)
            Pb = torch.softmax(torch.randn(H, G * R, L), -1).bfloat16()

            def bf16_pair():
                torch.bmm(Kb, qb.transpose(1, 2))
                torch.bmm(Pb, Vb)

            def f32_rows():
                s = qk_rows(Kb.float(), qb.float(), R)
                o = pv_rows(Pb.float().view(H, G, R, L).transpose(1, 2), Vb.float(), R)
                return s, o.bfloat16()

            print(f"L = {L:4d}, {R} row(s): bfloat16 pair {timed(bf16_pair):6.1f} us, "
                  f"float32 row-batched with casts {timed(f32_rows):6.1f} us")
