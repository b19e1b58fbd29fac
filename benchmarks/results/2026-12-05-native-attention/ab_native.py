"""In-process A/B: the compiled q4 step with the native slot attention against the Python body.

    python benchmarks/results/2026-12-05-native-attention/ab_native.py 8

Two engines in one process (each loads the q4 target and compiles its own steps): ``native`` (the
default, ``dartree_native::slot_attention``) and ``python`` (built with the native op switched off:
the opaque ``dartree::slot_attention`` whose body is Python). Plain decoding of 128 tokens a run,
the arms alternating (ABBA ...), then 64 tokens with each to check that they emit the same tokens.
"""
import statistics
import sys

import torch

from benchmarks.bench_step import PROMPT, engine_stats
from services.generate import build_inprocess, encode
from services import native_lib as native
from services.params import SamplingParams, SpecParams
from services.weights import compute_dtype

torch.set_num_threads(2)
engines = {}
engines["native"], tok, _ = build_inprocess(None, None, compute_dtype("q4"), weights="q4", compile=None)
assert engines["native"].runner.native, "the native op did not load"
native.ENABLED = False
engines["python"], _, _ = build_inprocess(None, None, compute_dtype("q4"), weights="q4", compile=None)
assert not engines["python"].runner.native
ids = encode(tok, PROMPT, chat=True)
for e in engines.values():
    engine_stats(e, ids, 16, "ar")  # warm-up
res = {"native": [], "python": []}
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    for name in ("native", "python") if rep % 2 == 0 else ("python", "native"):
        r = engine_stats(engines[name], ids, 128, "ar")
        res[name].append((r["ms_per_token"], r["forward_ms"][1]))
        print(name, round(r["ms_per_token"], 3), round(r["forward_ms"][1], 3), flush=True)
for name, v in res.items():
    print(name, "median ms/token", round(statistics.median(x for x, _ in v), 3),
          "median forward", round(statistics.median(f for _, f in v), 3))
pairs = [p / n for (n, _), (p, _) in zip(res["native"], res["python"])]
print("python / native ms per token, per pair:", [round(x, 3) for x in pairs])


def tokens(engine, rid):
    engine.add_request(rid, ids, SamplingParams(max_tokens=64, ignore_eos=True), SpecParams("ar"))
    out = []
    while True:
        o = engine.step_batch([rid])[rid]
        if o is None:
            continue
        out += o.token_ids
        if o.finish_reason:
            return out


print("same tokens native/python:", tokens(engines["native"], "t-n") == tokens(engines["python"], "t-p"))
