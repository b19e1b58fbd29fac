"""Time of the drafter's context append and batched block, in-place buffers vs the concatenating storage.

Loads the default drafter as the server runs it (bfloat16, int4 linears on this CPU), builds
``--streams`` contexts of ``--context`` positions, then times ``--rounds`` appends of ``--rows``
positions per context: the service's in-place ``append_context`` against the former storage (each
layer's K/V re-joined with ``torch.cat`` at every append, reproduced here from the same
``context_kv``), one request's block (a view of its buffer against the concatenated context),
and the batched block of all contexts: the service's ``block_logits_batch`` (layer
scratch) against a freshly allocated zero-padded copy of every layer (the former batch). Medians in
ms at ``--threads`` threads; the last stdout line is one JSON object.

    python benchmarks/results/2026-12-03-drafter-context-memory/append_bench.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def old_append(svc, store: dict, rid: str, feats: torch.Tensor, start: int) -> None:
    """The former ``append_context`` storage: per-layer K/V concatenated at every append."""
    n = feats.shape[0]
    kv = svc.drafter.context_kv(feats[None], torch.arange(start - n, start))
    old = store.get(rid)
    store[rid] = [(k.contiguous(), v.contiguous()) for k, v in kv] if old is None else [
        (torch.cat([ok, k], 2), torch.cat([ov, v], 2)) for (ok, ov), (k, v) in zip(old, kv)]


def old_batch(svc, store: dict, jobs: list) -> torch.Tensor:
    """The former batched block: a zero-padded copy of every layer's contexts, then the forward."""
    c, n, q = svc.cfg, len(jobs), svc.rows_for(3)  # the rows and logit rows of a B = 3 call
    lens = [store[rid][0][0].shape[2] for rid, *_ in jobs]
    cmax, ctx = max(lens), []
    for li in range(len(svc.drafter.layers)):
        k0 = store[jobs[0][0]][li][0]
        k = k0.new_zeros(n, k0.shape[1], cmax, k0.shape[3])
        v = torch.zeros_like(k)
        for i, (rid, *_rest) in enumerate(jobs):
            k[i, :, :lens[i]], v[i, :, :lens[i]] = store[rid][li][0][0], store[rid][li][1][0]
        ctx.append((k, v))
    mask = (torch.arange(cmax)[None, None, :] < torch.tensor(lens)[:, None, None]).expand(n, q, cmax)
    ids = torch.tensor([[root] + [c.mask_token_id] * (q - 1) for _, root, _ in jobs])
    pos = torch.stack([torch.arange(start, start + q) for _, _, start in jobs])
    h = svc._block_forward(svc.embed(ids).to(svc.dtype), pos, ctx, mask)
    hd = h if c.shift_label else h[:, 1:]
    return svc.lm_head(hd[:, :3].to(svc.lm_head.weight.dtype)).float()


def old_single(svc, store: dict, rid: str, root: int, start: int) -> torch.Tensor:
    """The former one-request block: the forward over the concatenated (contiguous) context."""
    c, q = svc.cfg, svc.rows_for(3)
    ids = torch.tensor([root] + [c.mask_token_id] * (q - 1))
    h = svc._block_forward(svc.embed(ids).to(svc.dtype)[None], torch.arange(start, start + q), store[rid])[0]
    hd = h if c.shift_label else h[1:]
    return svc.lm_head(hd[:3].to(svc.lm_head.weight.dtype)).float()


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--context", type=int, default=2000, help="positions of each context before the timed appends")
    ap.add_argument("--rows", type=int, default=2, help="positions appended per round (committed tokens)")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from services.drafter.build import build_from_config as build_drafter_service
    from services.drafter.worker import DrafterWorkerConfig

    svc, _ = build_drafter_service(DrafterWorkerConfig(dtype="bfloat16"))
    g = torch.Generator().manual_seed(0)
    fdim, total = svc.cfg.feature_dim, args.context + args.rows * (args.rounds + 1)
    feats = {f"r{i}": torch.randn(total, fdim, generator=g).to(svc.dtype) for i in range(args.streams)}
    store: dict = {}
    res: dict = {"threads": args.threads, "streams": args.streams, "context": args.context, "rows": args.rows}
    with torch.inference_mode():
        for rid, f in feats.items():
            svc.append_context(rid, f[:args.context], args.context)
            old_append(svc, store, rid, f[:args.context], args.context)
        pos = {"new": args.context, "old": args.context}

        def step(which: str) -> None:
            s, n = pos[which], args.rows
            for rid, f in feats.items():
                if which == "new":
                    svc.append_context(rid, f[s:s + n], s + n)
                else:
                    old_append(svc, store, rid, f[s:s + n], s + n)
            pos[which] = s + n

        for which in ("new", "old", "new", "old"):  # interleaved, the first pair a warm-up
            res[f"append_{which}_ms"] = median_ms(lambda: step(which), args.rounds // 2) / args.streams
        jobs = [(rid, 5, pos["new"]) for rid in feats]
        old_jobs = [(rid, 5, pos["old"]) for rid in feats]
        for _ in range(2):
            res["single_new_ms"] = median_ms(lambda: svc.block_logits_batch(jobs[:1], 3), 9)
            res["single_old_ms"] = median_ms(lambda: old_single(svc, store, *old_jobs[0]), 9)
            res["batch_new_ms"] = median_ms(lambda: svc.block_logits_batch(jobs, 3), 5)
            res["batch_old_ms"] = median_ms(lambda: old_batch(svc, store, old_jobs), 5)
    print(f"{args.streams} contexts of {args.context}+ positions, {args.rows} rows per append, {args.threads} thread(s)")
    print(f"  append per context: in place {res['append_new_ms']:.3f} ms, concatenating {res['append_old_ms']:.3f} ms")
    print(f"  one request's block (B = 3 rows): view {res['single_new_ms']:.2f} ms, contiguous {res['single_old_ms']:.2f} ms")
    print(f"  batched block (B = 3 rows): layer scratch {res['batch_new_ms']:.2f} ms, padded copy {res['batch_old_ms']:.2f} ms")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
