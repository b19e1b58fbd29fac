"""Median engine step at a long context: one request, q4 SmolLM2-135M, in process.

Prefills a ~``--context``-token prompt, then times ``--tokens`` decode steps of each method
(``ar``; ``dartree-pruned`` with ``--budget`` nodes = budget + 1 verify rows). Prints a table and,
as the last line, one JSON object. Attention path: set ``DARTREE_GROUPED_ATTENTION=0`` for SDPA.

    python benchmarks/results/2026-12-03-decode-attention/long_step.py --threads 2 --context 2000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from services.generate import build_inprocess
from services.params import SamplingParams, SpecParams

TEXT = ("A hash table stores keys in buckets chosen by a hash function; when two keys land in the same "
        "bucket the table resolves the collision by chaining or by open addressing. ")


def run(engine, rid, ids, n, spec):
    """``(prefill seconds, [step wall s], [forward s], [rows])`` of one request's decode steps."""
    engine.add_request(rid, ids, SamplingParams(max_tokens=n, ignore_eos=True), spec)
    walls, fwd, rows, prefill = [], [], [], 0.0
    while True:
        t0 = time.perf_counter()
        out = engine.step_batch([rid])[rid]
        if out is None or out.is_prefill:
            prefill += time.perf_counter() - t0
            if out is None:
                continue
        else:
            walls.append(engine.last_step.wall_seconds)
            fwd.append(engine.last_step.forward_seconds)
            rows.append(engine.last_step.rows)
        if out.finish_reason is not None:
            return prefill, walls, fwd, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--budget", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    engine, tok, _ = build_inprocess(None, None, torch.bfloat16, weights="q4")
    text = tok.encode(TEXT * (a.context // 20 + 4))
    run(engine, "warm", text[40:104], 4, SpecParams("ar"))
    ids = text[:a.context]
    res = dict(grouped_attention=os.environ.get("DARTREE_GROUPED_ATTENTION", "1") != "0", threads=a.threads,
               context=len(ids), methods={})
    methods = (("ar", SpecParams("ar")), (f"dartree-pruned/{a.budget}", SpecParams("dartree-pruned", budget=a.budget)))
    for i, (method, spec) in enumerate(methods):  # each its own prompt start: no prefix-cache hit
        prefill, walls, fwd, rows = run(engine, method, text[i + 1:i + 1 + a.context], a.tokens, spec)
        res["methods"][method] = dict(prefill_s=round(prefill, 3), steps=len(walls),
                                      step_ms=round(1000 * statistics.median(walls), 2),
                                      forward_ms=round(1000 * statistics.median(fwd), 2),
                                      rows=statistics.median(rows))
        print(f"{method:20s} context {len(ids)}: prefill {prefill:.2f} s, median step "
              f"{1000 * statistics.median(walls):.1f} ms (forward {1000 * statistics.median(fwd):.1f} ms, "
              f"{statistics.median(rows)} rows, {len(walls)} steps)", flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
