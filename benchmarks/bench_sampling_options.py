"""What logit processors and a grammar cost per decode step, on the real target.

One chat prompt is decoded greedily (``ignore_eos``) by the in-process engine under four settings,
interleaved per repeat (a shared machine drifts):

- ``plain``: no option;
- ``processors``: presence / frequency / repetition penalties and a ``logit_bias`` entry;
- ``grammar``: a JSON schema whose one string field needs at least 4,000 characters (the grammar
  stays open for the whole run: every step is masked);
- ``both``: the two together.

Each setting runs with ``ar`` (one row per step) and, with ``--budget``, ``dartree-pruned`` at
that fixed budget (B + 1 verify rows: one mask per row). ``--concurrency C`` runs C copies of the
request in one batch (every step verifies C rows for ``ar``: C processor passes and C grammar
masks). Reported per step, from the engine's own stats: ``step_ms`` (median wall time of a decode
step in which all C requests decode), ``sampling_ms`` (median over those steps of the ``sampling``
phase summed over the batch: processors, grammar masks and sampling; 0 for ``plain``, which skips
it) and ``overhead_pct`` = ``step_ms`` over ``plain``'s, minus 1.

``--tau-tokens N`` adds the acceptance question: greedy generations of up to N tokens for
:data:`JSON_PROMPTS` (chat prompts that ask for a JSON object), with and without the JSON schema
:data:`PERSON` as ``response_format``, under ``dartree-pruned`` at the engine's default knobs
(``--spec-policy`` picks the fixed default or the goodput policy): the schema as served (at most 20
spaces / newlines per gap, ``--json-whitespace flexible``), as compact JSON (``--json-whitespace
compact``) and with free whitespace. Reported per setting:
``tau`` (emitted tokens per decode step, bonus included), tokens, steps, ``grammar_masked`` (draft
nodes the grammar forbade) and how many answers parse as JSON.

Usage: ``python -m benchmarks.bench_sampling_options [--weights q4] [--threads 1] [--tokens 48]
[--repeats 3] [--budget 8] [--concurrency 1] [--tau-tokens 0] [--spec-policy fixed] [--out DIR]``. Prints a table; the last stdout line is one JSON object
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
JSON_PROMPTS = ("Describe a fictional person as a JSON object with the keys name, age, city and hobbies.",
                "Return a JSON object for a new user account: name, age, city and a list of hobbies.",
                "Give me a JSON record of a famous scientist with name, age at death, city of birth and "
                "hobbies.")
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"},
                                           "hobbies": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}


def sampling(name: str, tokens: int, grammar: str):
    """The :class:`SamplingParams` of setting ``name``."""
    from services.params import SamplingParams

    kw = dict(max_tokens=tokens, ignore_eos=True)
    if name in ("processors", "both"):
        kw.update(PROCESSORS)
    if name in ("grammar", "both"):
        kw["grammar"] = grammar
    return SamplingParams(**kw)


def run_once(engine, ids: list[int], params, method: str, budget: int | None,
             concurrency: int = 1) -> tuple[list[float], list[float], int]:
    """``(step seconds, sampling seconds, masked draft nodes)`` of the decode steps of ``concurrency``
    identical generations batched together (steps where one of them prefills are left out)."""
    from services.params import SpecParams

    live = [f"bench{i}" for i in range(concurrency)]
    for rid in live:
        engine.add_request(rid, ids, params, SpecParams(method, budget=budget))
    steps, samp, masked = [], [], 0
    while live:
        outs = engine.step_batch(live)
        decoding = len(outs) == len(live) == concurrency
        step_samp = 0.0
        for rid, out in outs.items():
            if isinstance(out, BaseException):
                raise out
            decoding = decoding and out is not None and not out.is_prefill
            if out is not None and not out.is_prefill:
                step_samp += out.timings.get("sampling", 0.0)
                masked += out.grammar_masked
            if out is not None and out.finish_reason is not None:
                live = [r for r in live if r != rid]
        if decoding:
            steps.append(engine.last_step.wall_seconds)
            samp.append(step_samp)
    return steps, samp, masked


def tau_rows(engine, tok, a, weights: str) -> list[dict]:
    """Acceptance with and without the :data:`PERSON` schema on :data:`JSON_PROMPTS` (greedy)."""
    from gateway.tools import json_schema_grammar
    from services.generate import encode
    from services.params import SamplingParams, SpecParams

    import llguidance

    grammars = {"plain": None, "schema (served: whitespace <= 20)": json_schema_grammar(PERSON),
                "schema, compact": json_schema_grammar(PERSON, "compact"),
                "schema, free whitespace": llguidance.LLMatcher.grammar_from_json_schema(
                    PERSON, defaults={"whitespace_flexible": True})}
    rows = []
    for name, grammar in grammars.items():
        tokens = steps = masked = parsed = 0
        for i, prompt in enumerate(JSON_PROMPTS):
            params = SamplingParams(max_tokens=a.tau_tokens, grammar=grammar)
            ids = []
            for out in engine.generate(f"tau{i}", encode(tok, prompt, chat=True), params, SpecParams("dartree-pruned")):
                ids += out.token_ids
                if not out.is_prefill:
                    tokens += len(out.token_ids)
                    steps += 1
                    masked += out.grammar_masked
            parsed += _is_json(tok.decode(ids))
        rows.append({"weights": weights, "method": "dartree-pruned", "policy": a.spec_policy, "setting": name,
                     "tau": round(tokens / max(steps, 1), 3), "tokens": tokens, "steps": steps,
                     "grammar_masked": masked, "parsed_json": f"{parsed}/{len(JSON_PROMPTS)}"})
    return rows


def _is_json(text: str) -> bool:
    """Whether ``text`` (a fenced code block's body, when fenced) parses as JSON."""
    body = text.strip()
    if body.startswith("```"):
        body = body.split("\n", 1)[-1].rsplit("```", 1)[0]
    try:
        json.loads(body)
        return True
    except ValueError:
        return False


def measure(a) -> tuple[list[dict], list[dict]]:
    """Every (method, setting) step row, interleaved over ``a.repeats``, and the tau rows."""
    from gateway.tools import json_schema_grammar
    from services.generate import build_inprocess, encode
    from services.models.registry import resolve_target
    from services.weights import choose_weights, compute_dtype

    fmt = choose_weights(a.weights, resolve_target(None))
    engine, tok, _ = build_inprocess(None, None, compute_dtype(fmt), weights=fmt, spec_policy=a.spec_policy)
    if a.concurrency > engine.config.max_running:
        raise SystemExit(f"--concurrency {a.concurrency} is over the engine's {engine.config.max_running} KV slots")
    taus = tau_rows(engine, tok, a, fmt) if a.tau_tokens else []
    ids = encode(tok, PROMPT, chat=True)
    grammar = json_schema_grammar(LONG_TEXT)
    methods = [("ar", None)] + ([("dartree-pruned", a.budget)] if a.budget else [])
    acc: dict = {}
    for rep in range(a.repeats + 1 if a.repeats else 0):  # repeat 0 warms up (packing, grammar tokenizer)
        for method, budget in methods:
            for name in SETTINGS:
                steps, samp, masked = run_once(engine, ids, sampling(name, a.tokens, grammar), method, budget,
                                               a.concurrency)
                if rep:
                    row = acc.setdefault((method, name), {"steps": [], "samp": [], "masked": 0})
                    row["steps"] += steps
                    row["samp"] += samp
                    row["masked"] += masked
    rows = []
    for (method, name), r in acc.items():
        base = statistics.median(acc[(method, "plain")]["steps"])
        step = statistics.median(r["steps"])
        rows.append({"weights": fmt, "method": method, "budget": dict(methods)[method],
                     "concurrency": a.concurrency, "setting": name,
                     "step_ms": round(step * 1e3, 2), "sampling_ms": round(statistics.median(r["samp"]) * 1e3, 3),
                     "overhead_pct": round((step / base - 1) * 100, 1), "steps": len(r["steps"]),
                     "grammar_masked": r["masked"]})
    return rows, taus


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", default="q4", help="target weight format (services.weights)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=48, help="tokens per generation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=8, help="dartree-pruned budget (0: ar only)")
    ap.add_argument("--concurrency", type=int, default=1, help="identical requests batched per step")
    ap.add_argument("--tau-tokens", type=int, default=0, help="max tokens of the tau runs (0: skip them)")
    ap.add_argument("--spec-policy", default="fixed", choices=("fixed", "goodput"),
                    help="the engine's tree policy for requests that leave the knobs unset (the tau runs)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    torch.set_num_threads(a.threads)
    rows, taus = measure(a)
    print(f"{'method':16} {'c':>2} {'setting':11} {'step ms':>8} {'sampling ms':>11} {'overhead':>8} {'masked':>7}")
    for r in rows:
        print(f"{r['method']:16} {r['concurrency']:2d} {r['setting']:11} {r['step_ms']:8.2f} {r['sampling_ms']:11.3f} "
              f"{r['overhead_pct']:7.1f}% {r['grammar_masked']:7d}")
    for r in taus:
        print(f"tau {r['method']} ({r['policy']}) {r['setting']:23} tau {r['tau']:.3f}  tokens {r['tokens']}  "
              f"steps {r['steps']}  masked {r['grammar_masked']}  json {r['parsed_json']}")
    result = {"bench": "sampling_options", "threads": a.threads, "tokens": a.tokens, "repeats": a.repeats,
              "concurrency": a.concurrency, "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "rows": rows, "tau": taus}
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "sampling_options.json").write_text(json.dumps(result, indent=1) + "\n")
        md = ["| method | c | setting | step ms | sampling ms | overhead vs plain | grammar-masked drafts |",
              "|---|---|---|---|---|---|---|"]
        md += [f"| {r['method']} | {r['concurrency']} | {r['setting']} | {r['step_ms']} | {r['sampling_ms']} | "
               f"{r['overhead_pct']} % | {r['grammar_masked']} |" for r in rows]
        if taus:
            md += ["", "| method | policy | setting | tau | tokens | steps | grammar-masked drafts | parses as JSON |",
                   "|---|---|---|---|---|---|---|---|"]
            md += [f"| {r['method']} | {r['policy']} | {r['setting']} | {r['tau']} | {r['tokens']} | {r['steps']} | "
                   f"{r['grammar_masked']} | {r['parsed_json']} |" for r in taus]
        (a.out / "sampling_options.md").write_text("\n".join(md) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
