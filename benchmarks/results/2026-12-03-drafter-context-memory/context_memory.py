"""Resident memory of the drafter's contexts alone: 8 requests of ~2,000 positions, in-place buffers vs concatenation.

One process per storage (``--storage new|old``): loads the default drafter as the server runs it,
then for ``--streams`` requests appends a ``--context``-row prompt (bfloat16 features, as they
arrive) and drafts ``--rounds`` rounds of ``--rows`` committed rows each, every round one batched
block over all requests (B = 3 rows), as the server's steps do. ``new``: the service's
``append_context`` / ``block_logits_batch``; ``old``: the concatenating storage and the zero-padded
batch of ``append_bench.py``. Prints RSS (MB) after loading, after the prompts, at the end, and the
process's peak (``ru_maxrss``); the last stdout line is one JSON object.

    python benchmarks/results/2026-12-03-drafter-context-memory/context_memory.py --storage new
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from append_bench import old_append, old_batch  # noqa: E402


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--storage", choices=["new", "old"], required=True)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--context", type=int, default=2041)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from services.drafter.build import build_from_config as build_drafter_service
    from services.drafter.worker import DrafterWorkerConfig
    from services.weights import release_freed_memory

    svc, _ = build_drafter_service(DrafterWorkerConfig(dtype="bfloat16"))
    release_freed_memory()
    res = {"storage": args.storage, "streams": args.streams, "context": args.context, "rounds": args.rounds,
           "rss_loaded_mb": rss_mb()}
    g = torch.Generator().manual_seed(0)
    fdim, store, new = svc.cfg.feature_dim, {}, args.storage == "new"
    rids = [f"r{i}" for i in range(args.streams)]
    with torch.inference_mode():
        for rid in rids:  # each prompt's features arrive in their own frame
            f = torch.randn(args.context, fdim, generator=g).to(svc.dtype)
            svc.append_context(rid, f, args.context) if new else old_append(svc, store, rid, f, args.context)
        res["rss_prompts_mb"] = rss_mb()
        start = args.context
        for _ in range(args.rounds):
            for rid in rids:
                f = torch.randn(args.rows, fdim, generator=g).to(svc.dtype)
                svc.append_context(rid, f, start + args.rows) if new else old_append(svc, store, rid, f, start + args.rows)
            start += args.rows
            jobs = [(rid, 5, start) for rid in rids]
            svc.block_logits_batch(jobs, 3) if new else old_batch(svc, store, jobs)
    res["rss_end_mb"] = rss_mb()
    res["rss_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{args.storage}: RSS loaded {res['rss_loaded_mb']:.0f} MB, after prompts {res['rss_prompts_mb']:.0f}, "
          f"end {res['rss_end_mb']:.0f}, peak {res['rss_peak_mb']:.0f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
