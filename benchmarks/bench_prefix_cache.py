"""Prefix caching on multi-turn chat: TTFT per turn and τ with the cache on and off.

Users share one long system prompt and each holds a conversation of several turns; every request
resends the whole conversation (as chat clients do). Each configuration runs the same conversations
in the same order on one in-process engine (``services.verifier.build``), once with the prefix cache
on and once off (the engine's ``runner.cache.prefix.enabled`` switch; the cache is emptied between
runs), one request at a time. The assistant turns fed back are the model's own greedy answers, and
the two runs must produce the same tokens (the cache never changes output): a mismatch is reported.

    python -m benchmarks.bench_prefix_cache --weights q4 --threads 2 --out benchmarks/results/<date>-prefix-cache

Writes ``results.json`` (one row per request) and ``README.md`` (the per-turn table) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

SYSTEM_PARAGRAPH = (
    "You are the support assistant of a small bakery cooperative. The cooperative runs four shops, "
    "bakes bread, pastries and cakes every morning, takes custom orders for weddings and birthdays, "
    "and delivers within the city on weekdays. Answer politely and briefly, say when you do not know, "
    "never invent prices, and point customers to the order form for custom cakes. "
)
QUESTIONS = [
    "Do you deliver on Saturdays?",
    "Can I order a gluten-free birthday cake for twelve people?",
    "Which shop opens earliest?",
    "What should I write in the order form for a wedding cake?",
    "Do you sell day-old bread at a discount?",
]


def build_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_prefix_cache", description=__doc__.split("\n")[0])
    p.add_argument("--weights", default="q4", help="target weight format (float32, bfloat16, q4)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--methods", nargs="+", default=["ar", "dartree-pruned"], help="methods to run")
    p.add_argument("--budget", type=int, default=8, help="tree budget of the speculative methods")
    p.add_argument("--system-tokens", type=int, default=2000, help="approximate system-prompt length in tokens")
    p.add_argument("--users", type=int, default=2, help="conversations sharing the system prompt")
    p.add_argument("--turns", type=int, default=3, help="user turns per conversation")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--out", type=Path, required=True, help="results folder")
    a = p.parse_args(argv)
    if min(a.threads, a.users, a.turns, a.max_tokens, a.system_tokens) < 1:
        p.error("--threads, --users, --turns, --max-tokens and --system-tokens must be >= 1")
    return a


def run_conversations(engine, tok, method: str, budget: int, system: str, users: int, turns: int,
                      max_tokens: int, cache_on: bool) -> list[dict]:
    """Every user's turns in order, one request at a time: one row per request (TTFT in seconds,
    prompt and hit tokens, generated ids, drafted / accepted counts)."""
    from services.verifier.engine import SamplingParams, SpecParams

    cache = engine.runner.cache
    cache.prefix.enabled = cache_on
    for slot in range(cache.num_slots):  # start empty: nothing cached from an earlier run
        if cache.prefix.entry(slot) is not None:
            cache.prefix.drop(slot)
    rows, history = [], {u: [{"role": "system", "content": system}] for u in range(users)}
    for turn in range(turns):
        for u in range(users):
            history[u].append({"role": "user", "content": QUESTIONS[(u + turn) % len(QUESTIONS)]})
            text = tok.apply_chat_template(history[u], add_generation_prompt=True, tokenize=False)
            ids = list(tok(text, add_special_tokens=False)["input_ids"])
            q0, h0 = engine.prefix_cache_stats()[:2]
            spec = SpecParams(method, budget=budget) if method != "ar" else SpecParams("ar")
            t0, ttft, out_ids, drafted, accepted, rounds = time.perf_counter(), None, [], 0, 0, 0
            for out in engine.generate(f"{method}-{cache_on}-{u}-{turn}", ids,
                                       SamplingParams(max_tokens=max_tokens, ignore_eos=True), spec):
                if ttft is None and out.token_ids:
                    ttft = time.perf_counter() - t0
                out_ids += out.token_ids
                if not out.is_prefill:
                    rounds += 1
                    drafted += out.num_draft_tokens
                    accepted += out.accept_length
            q1, h1 = engine.prefix_cache_stats()[:2]
            history[u].append({"role": "assistant", "content": tok.decode(out_ids, skip_special_tokens=True)})
            rows.append({"method": method, "cache": cache_on, "user": u, "turn": turn + 1, "prompt_tokens": len(ids),
                         "hit_tokens": h1 - h0, "queried_tokens": q1 - q0, "ttft_s": ttft,
                         "total_s": time.perf_counter() - t0, "tokens": out_ids, "rounds": rounds,
                         "drafted": drafted, "accepted": accepted})
    return rows


def summarise(rows: list[dict], methods: list[str], turns: int) -> list[dict]:
    """Per method and turn: mean TTFT with the cache off and on, their ratio, the hit rate and τ."""
    table = []
    for m in methods:
        for t in range(1, turns + 1):
            off = [r for r in rows if r["method"] == m and r["turn"] == t and not r["cache"]]
            on = [r for r in rows if r["method"] == m and r["turn"] == t and r["cache"]]
            mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
            tau = lambda rs: (sum(len(r["tokens"]) - 1 for r in rs) / max(1, sum(r["rounds"] for r in rs)))  # noqa: E731
            table.append({"method": m, "turn": t, "prompt_tokens": round(mean([r["prompt_tokens"] for r in on])),
                          "ttft_off_s": mean([r["ttft_s"] for r in off]), "ttft_on_s": mean([r["ttft_s"] for r in on]),
                          "ratio": mean([r["ttft_s"] for r in on]) / mean([r["ttft_s"] for r in off]),
                          "hit_rate": sum(r["hit_tokens"] for r in on) / max(1, sum(r["queried_tokens"] for r in on)),
                          "tau_off": tau(off), "tau_on": tau(on),
                          "same_tokens": all(a["tokens"] == b["tokens"] for a, b in zip(off, on))})
    return table


def render(table: list[dict], a: argparse.Namespace, machine: str) -> str:
    """The results README: what ran, the command, the per-turn table."""
    lines = ["# Prefix caching on multi-turn chat", "",
             f"SmolLM2-135M-Instruct, `--weights {a.weights}`, {a.threads} threads, {machine}. {a.users} users "
             f"share a ~{a.system_tokens}-token system prompt; {a.turns} turns each, {a.max_tokens} tokens per "
             "turn, one request at a time, greedy. TTFT in seconds (mean over users); τ = tokens per round "
             "after the first token (bonus included).", "",
             "```", "python -m benchmarks.bench_prefix_cache " + " ".join(sys.argv[1:]), "```", "",
             "| method | turn | prompt tokens | TTFT off | TTFT on | on / off | hit rate | τ off | τ on | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['method']} | {r['turn']} | {r['prompt_tokens']} | {r['ttft_off_s']:.2f} | "
                     f"{r['ttft_on_s']:.2f} | {r['ratio']:.2f} | {r['hit_rate']:.2f} | {r['tau_off']:.2f} | "
                     f"{r['tau_on']:.2f} | {'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point: build the engine once, run every method with the cache off then on, write results."""
    a = build_args(argv)
    import torch

    from services.generate import build_inprocess
    from services.models.registry import resolve_target
    from services.spec import TreeKnobs, default_tree_knobs
    from services.weights import resolve_cli_weights

    torch.set_num_threads(a.threads)
    weights, dtype = resolve_cli_weights(a.weights, None, resolve_target(None))
    defaults = TreeKnobs(a.budget, None, None, None).filled_from(default_tree_knobs("cpu"))
    engine, tok, _ = build_inprocess(None, None, dtype, defaults, weights=weights, spec_policy="fixed")
    n = len(tok(SYSTEM_PARAGRAPH)["input_ids"])
    system = SYSTEM_PARAGRAPH * max(1, round(a.system_tokens / n))
    rows = []
    for m in a.methods:
        for cache_on in (False, True):
            rows += run_conversations(engine, tok, m, a.budget, system, a.users, a.turns, a.max_tokens, cache_on)
    table = summarise(rows, a.methods, a.turns)
    a.out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}"
    (a.out / "results.json").write_text(json.dumps({"rows": rows, "table": table}, indent=1))
    (a.out / "README.md").write_text(render(table, a, machine))
    print(render(table, a, machine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
