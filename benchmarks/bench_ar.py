"""AR per-token latency: our engine's ``ar`` loop vs a bare HF forward loop vs ``model.generate``.

Question answered: how much overhead does the speculative engine add when it decodes plainly
(goal: <= 5 % over the bare loop)? Batch 1, greedy, a fixed prompt, ``--tokens`` new tokens
(EOS ignored), median of ``--repeats`` runs per dtype. Prints a table; the last stdout line is
one JSON object.

Usage: ``python -m benchmarks.bench_ar [--tokens 128] [--repeats 3] [--dtypes float32 bfloat16]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

PROMPT = "Explain, step by step, how a hash table handles collisions."


def bare_loop(model, ids: list[int], n: int, cache_kw: str) -> float:
    """Seconds per token of a minimal prefill + argmax decode loop over a DynamicCache."""
    from services.hf_compat import new_dynamic_cache

    with torch.inference_mode():
        cache = new_dynamic_cache(model.config)
        out = model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        tok = out.logits[0, -1].argmax()
        t0 = time.perf_counter()
        for _ in range(n - 1):
            out = model(input_ids=tok.view(1, 1), use_cache=True, **{cache_kw: cache})
            tok = out.logits[0, -1].argmax()
        return (time.perf_counter() - t0) / (n - 1)


def hf_generate(model, ids: list[int], n: int) -> float:
    """Seconds per token of ``model.generate`` (prefill excluded by subtracting a 1-token run)."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, do_sample=False, pad_token_id=0)
        t1 = time.perf_counter()
        model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / (n - 1)


def engine_ar(engine, ids: list[int], n: int) -> float:
    """Seconds per token of our engine with method ``ar`` (decode clock after the prefill step)."""
    from services.params import SamplingParams, SpecParams

    t0 = None
    count = 0
    for out in engine.generate("bench-ar", ids, SamplingParams(max_tokens=n, ignore_eos=True), SpecParams("ar")):
        if out.is_prefill:
            t0 = time.perf_counter()
        else:
            count += len(out.token_ids)
    return (time.perf_counter() - t0) / count


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    a = ap.parse_args(argv)
    from services.generate import build_inprocess, encode

    rows = []
    for dt in a.dtypes:
        engine, tok, _ = build_inprocess(None, None, getattr(torch, dt))
        model = engine.target.model
        kw = engine.target._cache_kw
        ids = encode(tok, PROMPT, chat=True)
        res = {"bare_loop": [], "hf_generate": [], "engine_ar": []}
        for _ in range(a.repeats):
            res["bare_loop"].append(bare_loop(model, ids, a.tokens, kw))
            res["hf_generate"].append(hf_generate(model, ids, a.tokens))
            res["engine_ar"].append(engine_ar(engine, ids, a.tokens))
        med = {k: statistics.median(v) * 1000 for k, v in res.items()}
        rows.append({"dtype": dt, **{f"{k}_ms": round(v, 2) for k, v in med.items()},
                     "engine_overhead_pct": round(100 * (med["engine_ar"] / med["bare_loop"] - 1), 2)})
    print(f"{'dtype':10} {'bare loop ms/tok':>17} {'HF generate':>12} {'engine ar':>10} {'overhead':>9}")
    for r in rows:
        print(f"{r['dtype']:10} {r['bare_loop_ms']:17.2f} {r['hf_generate_ms']:12.2f} {r['engine_ar_ms']:10.2f} "
              f"{r['engine_overhead_pct']:8.1f}%")
    print(json.dumps({"bench": "ar_overhead", "tokens": a.tokens, "repeats": a.repeats, "rows": rows,
                      "torch": torch.__version__, "machine": platform.machine(),
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
