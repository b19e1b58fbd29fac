"""Plain decoding in process: ms a token, the target forward, and the step's time outside it.

    python benchmarks/results/2026-12-04-step-bookkeeping/outside.py [--runs 3] [--tokens 128]

Default server configuration (q4, compiled steps where ``auto_compile`` says so), 2 threads, greedy,
EOS ignored; one line per run (``benchmarks.bench_step.engine_stats``): ``outside`` = ms a token
minus the median one-row forward (plan, tree buffers, pack, walk, commit, sampling).
"""

import argparse

import torch

from benchmarks.bench_step import PROMPT, engine_stats
from services.generate import build_inprocess, encode
from services.weights import compute_dtype

ap = argparse.ArgumentParser()
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--tokens", type=int, default=128)
a = ap.parse_args()
torch.set_num_threads(2)
engine, tok, _ = build_inprocess(None, None, compute_dtype("q4"), weights="q4", compile=None)
ids = encode(tok, PROMPT, chat=True)
engine_stats(engine, ids, 16, "ar")  # warm-up
for _ in range(a.runs):
    r = engine_stats(engine, ids, a.tokens, "ar")
    fwd = r["forward_ms"][1]
    print(f"ms/token {r['ms_per_token']:.3f} forward {fwd:.3f} outside {r['ms_per_token'] - fwd:.3f}", flush=True)
