"""What logit processors and a grammar cost per decode step, on the real target.

One chat prompt is decoded greedily (``ignore_eos``) by the in-process engine under four settings,
interleaved per repeat (a shared machine drifts):

- ``plain``: no option;
- ``processors``: presence / frequency / repetition penalties and a ``logit_bias`` entry;
- ``grammar``: a JSON schema whose one string field needs at least 4,000 characters (the grammar
  stays open for the whole run: every step is masked);
- ``both``: the two together.

Each setting runs with ``ar`` (one row per step) and, with ``--budget``, ``dartree-pruned`` at
that fixed budget (B + 1 verify rows: one mask per row). Reported per step, from the engine's own
stats: ``step_ms`` (median wall time of a decode step), ``sampling_ms`` (median of the round's
``sampling`` phase: processors, grammar masks and sampling; 0 for ``plain``, which skips it) and
``overhead_pct`` = ``step_ms`` over ``plain``'s, minus 1.

Usage: ``python -m benchmarks.bench_sampling_options [--weights q4] [--threads 1] [--tokens 48]
[--repeats 3] [--budget 8] [--out DIR]``. Prints a table; the last stdout line is one JSON object
(also written to ``DIR/sampling_options.json`` with a markdown table). Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch

PROMPT = "Write a long story about a lighthouse keeper, as JSON."
LONG_TEXT = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4000}},
             "required": ["story"], "additionalProperties": False}
PROCESSORS = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={13: 1.0})
SETTINGS = ("plain", "processors", "grammar", "both")


def sampling(name: str, tokens: int, grammar: str):
    """The :class:`SamplingParams` of setting ``name``."""
    from services.verifier.engine import SamplingParams

    kw = dict(max_tokens=tokens, ignore_eos=True)
    if name in ("processors", "both"):
        kw.update(PROCESSORS)
    if name in ("grammar", "both"):
        kw["grammar"] = grammar
    return SamplingParams(**kw)


def run_once(engine, ids: list[int], params, method: str, budget: int | None) -> tuple[list[float], list[float], int]:
    """``(step seconds, sampling seconds, masked draft nodes)`` of the decode steps of one generation."""
    from services.verifier.engine import SpecParams

    engine.add_request("bench", ids, params, SpecParams(method, budget=budget))
    steps, samp, masked = [], [], 0
    while True:
        out = engine.step_batch(["bench"])["bench"]
        if isinstance(out, BaseException):
            raise out
        if out is None:
            continue
        if not out.is_prefill:
            steps.append(engine.last_step.wall_seconds)
            samp.append(out.timings.get("sampling", 0.0))
            masked += out.grammar_masked
        if out.finish_reason is not None:
            return steps, samp, masked


def measure(a) -> list[dict]:
    """Every (method, setting) row, interleaved over ``a.repeats``."""
    from gateway.tools import json_schema_grammar
    from services.generate import build_inprocess, encode
    from services.models.registry import resolve_target
    from services.weights import choose_weights, compute_dtype

    fmt = choose_weights(a.weights, resolve_target(None))
    engine, tok, _ = build_inprocess(None, None, compute_dtype(fmt), weights=fmt)
    ids = encode(tok, PROMPT, chat=True)
    grammar = json_schema_grammar(LONG_TEXT)
    methods = [("ar", None)] + ([("dartree-pruned", a.budget)] if a.budget else [])
    acc: dict = {}
    for rep in range(a.repeats + 1):  # repeat 0 warms up (packing, first grammar tokenizer build)
        for method, budget in methods:
            for name in SETTINGS:
                steps, samp, masked = run_once(engine, ids, sampling(name, a.tokens, grammar), method, budget)
                if rep:
                    row = acc.setdefault((method, name), {"steps": [], "samp": [], "masked": 0})
                    row["steps"] += steps
                    row["samp"] += samp
                    row["masked"] += masked
    rows = []
    for (method, name), r in acc.items():
        base = statistics.median(acc[(method, "plain")]["steps"])
        step = statistics.median(r["steps"])
        rows.append({"weights": fmt, "method": method, "budget": dict(methods)[method], "setting": name,
                     "step_ms": round(step * 1e3, 2), "sampling_ms": round(statistics.median(r["samp"]) * 1e3, 3),
                     "overhead_pct": round((step / base - 1) * 100, 1), "steps": len(r["steps"]),
                     "grammar_masked": r["masked"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", default="q4", help="target weight format (services.weights)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=48, help="tokens per generation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=8, help="dartree-pruned budget (0: ar only)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = measure(a)
    print(f"{'method':16} {'setting':11} {'step ms':>8} {'sampling ms':>11} {'overhead':>8} {'masked':>7}")
    for r in rows:
        print(f"{r['method']:16} {r['setting']:11} {r['step_ms']:8.2f} {r['sampling_ms']:11.3f} "
              f"{r['overhead_pct']:7.1f}% {r['grammar_masked']:7d}")
    result = {"bench": "sampling_options", "threads": a.threads, "tokens": a.tokens, "repeats": a.repeats,
              "torch": torch.__version__, "machine": platform.processor() or platform.machine(), "rows": rows}
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "sampling_options.json").write_text(json.dumps(result, indent=1) + "\n")
        md = ["| method | setting | step ms | sampling ms | overhead vs plain | grammar-masked drafts |",
              "|---|---|---|---|---|---|"]
        md += [f"| {r['method']} | {r['setting']} | {r['step_ms']} | {r['sampling_ms']} | {r['overhead_pct']} % | "
               f"{r['grammar_masked']} |" for r in rows]
        (a.out / "sampling_options.md").write_text("\n".join(md) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
