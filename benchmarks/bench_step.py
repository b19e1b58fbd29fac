"""Step cost per weight format, side by side with llama.cpp on the same GGUF.

For each ``--weights`` format the in-process engine decodes one chat prompt with ``ar`` and with
``dartree-pruned`` at fixed budgets (8 and 16 draft nodes: 9- and 17-row verifies), and reports
from the engine's own per-step stats (:class:`services.verifier.engine.StepStats`):

- ``ar_ms``: wall ms per ``ar`` token (the whole step: forward + sampling + commit + bookkeeping),
  ``ar_tok_s`` its inverse, and ``overhead_pct``: the share of the step outside the target forward;
- ``verify9_x`` / ``verify17_x``: median forward of a 9-/17-row verify over the median 1-row forward;
- ``bare_ms``: a bare HF prefill + argmax loop over the same model (no engine), for reference;
- ``llama_cpp_ms``: llama.cpp (``llama-cpp-python``, optional) decoding the very GGUF file the target
  comes from, greedy, same prompt token ids and thread count, one run after each of our ``ar`` runs
  (interleaved: a shared machine's speed drifts by tens of percent over minutes);
  ``vs_llama_cpp`` = its ms / our ``ar_ms`` (the goal is >= 0.6), ``vs_llama_cpp_paired`` = the
  median over repeats of each pair's ratio (llama.cpp's run right after ours: robust to drift).

Usage: ``python -m benchmarks.bench_step [--weights float32 bfloat16 q4] [--threads 2] [--tokens 64]
[--repeats 3] [--out DIR]``. Prints a table; the last stdout line is one JSON object (also written
to ``DIR/step_cost.json`` with a markdown table). Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

PROMPT = "Explain, step by step, how a hash table handles collisions."


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def engine_stats(engine, ids: list[int], tokens: int, method: str, budget: int | None = None) -> dict:
    """Per-step stats of one greedy generation: wall / forward ms per step and per row count."""
    from services.params import SamplingParams, SpecParams

    walls, fwd = [], {}
    emitted = 0
    spec = SpecParams(method, budget=budget)
    engine.add_request("bench-step", ids, SamplingParams(max_tokens=tokens, ignore_eos=True), spec)
    t0, done = None, False
    while not done:
        out = engine.step_batch(["bench-step"])["bench-step"]
        if isinstance(out, BaseException):
            raise out
        if out is None:
            continue
        st = engine.last_step
        if out.is_prefill:
            t0 = time.perf_counter()
        else:
            walls.append(st.wall_seconds)
            fwd.setdefault(st.rows, []).append(st.forward_seconds)
            emitted += len(out.token_ids)
        done = out.finish_reason is not None
    wall = time.perf_counter() - t0
    return {"ms_per_token": 1000 * wall / max(emitted, 1), "step_ms": 1000 * _median(walls),
            "forward_ms": {r: 1000 * _median(v) for r, v in fwd.items()}, "steps": len(walls), "emitted": emitted}


def llama_cpp_peer(gguf: Path, n_ctx: int, threads: int):
    """A loaded llama.cpp model over ``gguf`` (``threads`` threads), or None when ``llama-cpp-python``
    is not installed or the file does not load (``make bench-deps``; printed, one line)."""
    from benchmarks.bench_llama import PeerUnavailableError, load_llama

    try:
        return load_llama(gguf, n_ctx, threads)
    except PeerUnavailableError as e:
        print(f"llama-cpp: unavailable ({e})", flush=True)
        return None


def llama_cpp_ms(llm, ids: list[int], n: int) -> dict:
    """llama.cpp greedy decode of ``n`` tokens after the prompt ``ids`` (ms per token, prompt excluded;
    :func:`benchmarks.bench_llama.llama_turn`, EOS ignored)."""
    from benchmarks.bench_llama import llama_turn

    rec = llama_turn(llm, ids, n, eos_ids=())
    return {"ms_per_token": 1000 * rec["decode_s"] / max(rec["rounds"], 1), "prefill_ms": 1000 * rec["ttft_s"]}


def measure_format(fmt: str, ids_prompt: str, a, compile: bool = False, peer=None) -> dict:
    """All engine-side numbers of one weight format (``compile``: steps through torch.compile).

    ``peer``: a loaded llama.cpp model (:func:`llama_cpp_peer`) or None; when given, one llama.cpp run
    follows each of our ``ar`` runs (interleaved, so both see the same machine state), and the row
    gets ``llama_cpp_ms`` (median of those runs) and ``vs_llama_cpp`` = ``llama_cpp_ms / ar_ms``.
    """
    from services.generate import build_inprocess, encode
    from services.models.registry import resolve_target
    from services.weights import choose_weights, compute_dtype

    fmt = choose_weights(fmt, resolve_target(None))
    t0 = time.perf_counter()
    engine, tok, _ = build_inprocess(None, None, compute_dtype(fmt), weights=fmt)
    engine.target.pack_gemm([17])  # float32: the 17-row verify packed too (no-op for other formats)
    if compile:
        from services.verifier.build import build_engine
        from services.verifier.engine import EngineConfig

        torch._dynamo.reset()  # a fresh recompile budget per model (the HF forward frame is shared)

        engine = build_engine(engine.target, engine.drafter, EngineConfig(compile=True),
                              max_draft_depth=engine.max_draft_depth, defaults=engine.policy.defaults,
                              packed_gemm=False)  # packed above; the build warms up rows 1 and B + 1
        engine.runner.warm_up((1, 9, 17))
        warm_s = engine.runner.warm_up_seconds
    load_s = time.perf_counter() - t0
    ids = encode(tok, ids_prompt, chat=True)
    engine_stats(engine, ids, 8, "ar")  # warm-up
    runs = {"ar": [], "b8": [], "b16": []}
    peer_runs = []
    for _ in range(a.repeats):
        runs["ar"].append(engine_stats(engine, ids, a.tokens, "ar"))
        if peer is not None:
            peer_runs.append(llama_cpp_ms(peer, ids, a.tokens))
        runs["b8"].append(engine_stats(engine, ids, a.tokens, "dartree-pruned", 8))
        runs["b16"].append(engine_stats(engine, ids, a.tokens, "dartree-pruned", 16))
    ar_ms = _median([r["ms_per_token"] for r in runs["ar"]])
    step = _median([r["step_ms"] for r in runs["ar"]])
    fwd1 = _median([r["forward_ms"].get(1, float("nan")) for r in runs["ar"]])

    def rows(k: str, r: int) -> float:
        return _median([x["forward_ms"][r] for x in runs[k] if r in x["forward_ms"]])

    from benchmarks.bench_ar import bare_loop

    bare = 1000 * _median([bare_loop(engine.target.model, ids, a.tokens, engine.target._cache_kw)
                           for _ in range(a.repeats)])
    return {"weights": fmt + (" compiled" if compile else ""), "load_s": round(load_s, 1),
            **({"compile_warm_up_s": round(warm_s, 1)} if compile else {}), "ar_ms": round(ar_ms, 2), "ar_tok_s": round(1000 / ar_ms, 1),
            "ar_step_ms": round(step, 2), "ar_forward_ms": round(fwd1, 2),
            "overhead_pct": round(100 * (1 - fwd1 / step), 1),
            "verify9_ms": round(rows("b8", 9), 2), "verify9_x": round(rows("b8", 9) / fwd1, 2),
            "verify17_ms": round(rows("b16", 17), 2), "verify17_x": round(rows("b16", 17) / fwd1, 2),
            "bare_ms": round(bare, 2), "prompt_tokens": len(ids),
            **({"llama_cpp_ms": round(_median([r["ms_per_token"] for r in peer_runs]), 2),
                "llama_cpp_prefill_ms": round(_median([r["prefill_ms"] for r in peer_runs]), 1),
                "vs_llama_cpp": round(_median([r["ms_per_token"] for r in peer_runs]) / ar_ms, 2),
                # each llama.cpp run right after one of ours: the median of those pairs' ratios is
                # robust to a VM's drift of tens of percent over minutes
                "vs_llama_cpp_paired": round(_median([q["ms_per_token"] / r["ms_per_token"]
                                                      for q, r in zip(peer_runs, runs["ar"])]), 2)}
               if peer_runs else {})}, ids


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", nargs="+", default=["float32", "bfloat16", "q4"])
    ap.add_argument("--threads", type=int, default=None, help="torch and llama.cpp threads (default: torch's)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    ap.add_argument("--compile", action="store_true", help="also measure each format with torch.compile'd steps "
                    "(load_s then includes the compile warm-up)")
    ap.add_argument("--out", default=None, help="directory for step_cost.json and step_cost.md")
    a = ap.parse_args(argv)
    from services.hf_compat import quiet_progress_bars
    from services.models.registry import GGUF_FILE, _gguf_dir

    quiet_progress_bars()
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    rows, ids = [], None
    llm = llama_cpp_peer(_gguf_dir() / GGUF_FILE, 4096, threads) if a.llama_cpp else None
    for fmt in a.weights:
        for comp in (False, True) if a.compile else (False,):
            row, ids = measure_format(fmt, PROMPT, a, comp, peer=llm)
            rows.append(row)
            print(json.dumps(row), flush=True)
    peer = None
    if llm is not None:
        ms = [r["llama_cpp_ms"] for r in rows]
        peer = {"ms_per_token": round(_median(ms), 2), "ms_per_token_by_row": ms,
                "prefill_ms": round(_median([r["llama_cpp_prefill_ms"] for r in rows]), 1), "gguf": GGUF_FILE}
    head = f"{'weights':18} {'ar ms/tok':>9} {'tok/s':>6} {'overhead':>8} {'9-row x':>8} {'17-row x':>9} " \
           f"{'bare HF ms':>10} {'vs llama.cpp':>12} {'paired':>6}"
    print(head)
    for r in rows:
        print(f"{r['weights']:18} {r['ar_ms']:9.2f} {r['ar_tok_s']:6.1f} {r['overhead_pct']:7.1f}% {r['verify9_x']:8.2f} "
              f"{r['verify17_x']:9.2f} {r['bare_ms']:10.2f} {r.get('vs_llama_cpp', float('nan')):12.2f} "
              f"{r.get('vs_llama_cpp_paired', float('nan')):6.2f}")
    if peer:
        print(f"llama.cpp {peer['ms_per_token']:9.2f} {1000 / peer['ms_per_token']:6.1f}  ({GGUF_FILE}, {threads} threads)")
    result = {"bench": "step_cost", "tokens": a.tokens, "repeats": a.repeats, "threads": threads, "rows": rows,
              "llama_cpp": peer, "torch": torch.__version__, "machine": platform.machine(),
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "step_cost.json").write_text(json.dumps(result, indent=1))
        md = ["| weights | ar ms/token | tok/s | overhead outside forward | 9-row verify / ar forward | "
              "17-row / ar | bare HF loop ms | llama.cpp ms (interleaved) | llama.cpp ms / ours | median of paired ratios |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        md += [f"| {r['weights']} | {r['ar_ms']} | {r['ar_tok_s']} | {r['overhead_pct']} % | {r['verify9_x']} | "
               f"{r['verify17_x']} | {r['bare_ms']} | {r.get('llama_cpp_ms', 'n/a')} | {r.get('vs_llama_cpp', 'n/a')} | "
               f"{r.get('vs_llama_cpp_paired', 'n/a')} |"
               for r in rows]
        if peer:
            md.append(f"| llama.cpp ({GGUF_FILE}), median of all runs | {peer['ms_per_token']} | "
                      f"{round(1000 / peer['ms_per_token'], 1)} | | | | | | 1.00 | |")
        (out / "step_cost.md").write_text("\n".join(md) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
