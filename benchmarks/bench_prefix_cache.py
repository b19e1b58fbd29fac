"""Prefix caching on multi-turn chat: TTFT per turn, hit rate, τ and throughput, cache on vs off.

Two workloads, each a set of conversations whose every request resends the whole conversation (as
chat clients do); the assistant turns fed back are the model's own greedy answers:

- ``sharegpt``: ShareGPT conversations with at least ``--sharegpt-turns`` human turns
  (:func:`services.datasets.sharegpt_conversations`, the first ones in file order), their human turns
  in order, each cut to ``--turn-cap`` tokens so that the conversation fits the context; one
  conversation at a time (``--sharegpt-concurrency``, default 1).
- ``system``: ``--users`` users share a ~``--system-tokens`` system prompt and ask ``--turns``
  questions each; ``--concurrency`` conversations in flight in one engine (batched steps: a user's
  next turn is queued when its answer is done, a new request is admitted whenever fewer than
  ``--concurrency`` run). With ``--users`` above ``--max-running`` every slot is taken: a user whose
  prefix sits in a running slot copies it (prefix sharing across slots).
- ``choices`` (``--choices n``, 0 = off): one request of the system prompt plus a question with
  ``n`` choices, i.e. ``n`` identical prompts admitted together (the gateway runs each choice as
  its own engine request).

The baseline engine (``--baseline``) is ``off`` (no prefix cache) or ``inplace`` (the prefix cache
without sharing across slots: a prefix is reused only by the request that takes its slot).

Both cache modes run side by side, interleaved step by step: two engines over the same loaded
target and drafter (:func:`services.verifier.build.build_engine`), one with the prefix cache and
one with the baseline, each with its own conversations (its own answers), and the driver alternates one
batched step of each (who goes first alternates too). Each engine's clock is the sum of its own
``add_request`` and ``step_batch`` seconds, so the two see the same machine over the same minutes.
TTFT = own-clock seconds from admission to the step that emits the first token; tokens/s =
generated tokens / own-clock seconds of the whole workload; hit rate = prompt tokens not prefilled
(reused or copied: ``RoundOutput.cached_tokens``) / prompt tokens; prefill rows = prompt rows the
engine's steps ran (``StepStats.prefill_tokens``); τ = tokens per decode round after the first token (bonus
included). The two engines' tokens are compared request by request: a request that parts from the
cache-off run where both had the same prompt is reported with the cache-off position's logit gap
(the cold HF prefill of the prompt and the common tokens: the two runs' tokens' logits).

    python -m benchmarks.bench_prefix_cache --weights q4 --threads 2 --out benchmarks/results/<date>-prefix-cache/q4

Writes ``results.json`` (one row per request, the summaries) and ``README.md`` (the tables) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import deque
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
    "Are your croissants made with butter?",
    "Can I pick up an order after six in the evening?",
    "Do you bake anything without nuts?",
]
MODES = ("off", "on")


def build_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_prefix_cache", description=__doc__.split("\n")[0])
    p.add_argument("--weights", default="q4", help="target weight format (float32, bfloat16, q4)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--methods", nargs="+", default=["dartree-pruned"], help="methods to run")
    p.add_argument("--budget", type=int, default=8, help="tree budget of the speculative methods")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn (greedy, EOS ignored)")
    p.add_argument("--workloads", nargs="+", default=["sharegpt", "system"], choices=["sharegpt", "system", "choices"])
    p.add_argument("--baseline", default="off", choices=["off", "inplace"],
                   help="the engine compared with the prefix cache: none, or in-place reuse only (no sharing)")
    p.add_argument("--choices", type=int, default=4, help="choices of the 'choices' workload's one request")
    p.add_argument("--sharegpt", type=int, default=2, help="ShareGPT conversations")
    p.add_argument("--sharegpt-turns", type=int, default=4, help="human turns per ShareGPT conversation")
    p.add_argument("--turn-cap", type=int, default=192, help="tokens kept of each ShareGPT human turn")
    p.add_argument("--sharegpt-concurrency", type=int, default=1, help="ShareGPT conversations in flight")
    p.add_argument("--system-tokens", type=int, default=2000, help="approximate system-prompt length in tokens")
    p.add_argument("--users", type=int, default=8, help="conversations sharing the system prompt")
    p.add_argument("--turns", type=int, default=2, help="user turns per system-prompt conversation")
    p.add_argument("--concurrency", type=int, default=4, help="system-prompt conversations in flight")
    p.add_argument("--max-context", type=int, default=4096, help="context window of the engines")
    p.add_argument("--max-running", type=int, default=8, help="KV slots per engine")
    p.add_argument("--ties", type=int, default=4, help="divergences whose logit gap is measured")
    p.add_argument("--out", type=Path, required=True, help="results folder")
    a = p.parse_args(argv)
    if min(a.threads, a.users, a.turns, a.max_tokens, a.system_tokens, a.sharegpt_turns, a.turn_cap,
           a.concurrency, a.sharegpt_concurrency, a.max_running) < 1 or a.sharegpt < 0:
        p.error("counts must be >= 1 (--sharegpt >= 0)")
    if max(a.concurrency, a.sharegpt_concurrency) > a.max_running or \
            ("choices" in a.workloads and not 1 <= a.choices <= a.max_running):
        p.error("--concurrency and --choices must be in [1, --max-running]")
    return a


# --------------------------------------------------------------------------------- workloads

def sharegpt_workload(tok, n: int, turns: int, cap: int) -> list[dict]:
    """The first ``n`` ShareGPT conversations with ``>= turns`` non-empty human turns: ``[{"system":
    None, "turns": [text, ...]}]``, each human turn cut to its first ``cap`` tokens."""
    from services.datasets import sharegpt_conversations

    out = []
    for conv in sharegpt_conversations(limit=2000):
        human = [(t.get("value") or "").strip() for t in conv if t.get("from") == "human"]
        if len(human) < turns or not all(human[:turns]):
            continue
        cut = [tok.decode(tok(h, add_special_tokens=False)["input_ids"][:cap]) for h in human[:turns]]
        out.append({"system": None, "turns": cut})
        if len(out) == n:
            return out
    raise ValueError(f"found only {len(out)} ShareGPT conversations with {turns} human turns")


def system_workload(tok, users: int, turns: int, system_tokens: int) -> list[dict]:
    """``users`` conversations over one ~``system_tokens`` system prompt, ``turns`` questions each."""
    n = len(tok(SYSTEM_PARAGRAPH)["input_ids"])
    system = SYSTEM_PARAGRAPH * max(1, round(system_tokens / n))
    return [{"system": system, "turns": [QUESTIONS[(u + t) % len(QUESTIONS)] for t in range(turns)]}
            for u in range(users)]


def choices_workload(tok, n: int, system_tokens: int) -> list[dict]:
    """``n`` identical one-turn conversations (the ``n`` choices of one request), run at concurrency ``n``."""
    return [dict(c, turns=c["turns"][:1]) for c in system_workload(tok, 1, 1, system_tokens) * n]


# ------------------------------------------------------------------------------------ driver

class _Side:
    """One engine's run of a workload: its conversations (with its own answers), its queue, its clock."""

    def __init__(self, mode: str, engine, convs: list[dict]):
        self.mode, self.engine, self.convs = mode, engine, convs
        self.history = [([{"role": "system", "content": c["system"]}] if c["system"] else []) for c in convs]
        self.ready = deque((i, 0) for i in range(len(convs)))
        self.running: dict[str, dict] = {}
        self.rows: list[dict] = []
        self.clock = 0.0
        self.prefill_rows = 0

    def done(self) -> bool:
        return not self.ready and not self.running


def _clear(engine) -> None:
    """Forget every cached prefix (the next workload starts cold)."""
    pc = engine.runner.cache.prefix
    for slot in range(engine.runner.cache.num_slots):
        pc.drop(slot)


def run_workload(engines: dict, tok, convs: list[dict], method: str, budget: int, max_tokens: int,
                 concurrency: int, tag: str) -> list[dict]:
    """Run ``convs`` on every engine of ``engines`` (``{"off": e, "on": e}``), interleaved step by
    step; one row per request (own-clock TTFT and latency in seconds, prompt / hit tokens, tokens,
    rounds, drafted / accepted) plus a ``{"mode", "workload", "clock_s", "tokens"}`` total per engine."""
    from services.params import SamplingParams, SpecParams

    spec = SpecParams(method, budget=budget) if method != "ar" else SpecParams("ar")
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sides = [_Side(m, engines[m], convs) for m in MODES]
    for s in sides:
        _clear(s.engine)
    k = 0
    while not all(s.done() for s in sides):
        for s in (sides if k % 2 == 0 else sides[::-1]):
            if s.done():
                continue
            while s.ready and len(s.running) < concurrency:
                i, t = s.ready.popleft()
                s.history[i].append({"role": "user", "content": s.convs[i]["turns"][t]})
                text = tok.apply_chat_template(s.history[i], add_generation_prompt=True, tokenize=False)
                ids = list(tok(text, add_special_tokens=False)["input_ids"])
                rid = f"{tag}-{method}-{s.mode}-{i}-{t}"
                start = s.clock
                t0 = time.perf_counter()
                s.engine.add_request(rid, ids, sampling, spec)
                s.clock += time.perf_counter() - t0
                s.running[rid] = {"workload": tag, "method": method, "mode": s.mode, "conv": i, "turn": t + 1,
                                  "prompt": ids, "prompt_tokens": len(ids), "hit_tokens": 0, "start": start, "ttft_s": None, "tokens": [], "rounds": 0, "drafted": 0,
                                  "accepted": 0}
            t0 = time.perf_counter()
            last = s.engine.last_step
            res = s.engine.step_batch(list(s.running))
            s.clock += time.perf_counter() - t0
            s.prefill_rows += s.engine.last_step.prefill_tokens if s.engine.last_step is not last else 0
            for rid, out in res.items():
                if isinstance(out, BaseException):
                    raise out
                if out is None:
                    continue
                r = s.running[rid]
                if r["ttft_s"] is None and out.token_ids:
                    r["ttft_s"] = s.clock - r["start"]
                r["tokens"] += out.token_ids
                if out.is_prefill:
                    r["hit_tokens"] = out.cached_tokens
                else:
                    r["rounds"] += 1
                    r["drafted"] += out.num_draft_tokens
                    r["accepted"] += out.accept_length
                if out.finish_reason is not None:
                    del s.running[rid]
                    r["latency_s"] = s.clock - r.pop("start")
                    s.rows.append(r)
                    i, t = r["conv"], r["turn"]
                    s.history[i].append({"role": "assistant", "content": tok.decode(r["tokens"],
                                                                                    skip_special_tokens=True)})
                    if t < len(s.convs[i]["turns"]):
                        s.ready.append((i, t))
        k += 1
    rows = [r for s in sides for r in s.rows]
    totals = [{"workload": tag, "method": method, "mode": s.mode, "clock_s": s.clock,
               "tokens": sum(len(r["tokens"]) for r in s.rows), "prefill_rows": s.prefill_rows} for s in sides]
    return rows + totals


# ------------------------------------------------------------------------------------ checks

def divergences(rows: list[dict]) -> list[dict]:
    """Requests whose cache-on tokens part from the cache-off run's: ``{"workload", "method", "conv",
    "turn", "same_prompt", "at", "off_token", "on_token", "prompt"}`` (``at``: first differing
    generated position; ``same_prompt`` False when an earlier turn had already parted)."""
    req = [r for r in rows if "conv" in r]
    off = {(r["workload"], r["method"], r["conv"], r["turn"]): r for r in req if r["mode"] == "off"}
    out = []
    for r in req:
        if r["mode"] != "on":
            continue
        o = off[(r["workload"], r["method"], r["conv"], r["turn"])]
        if o["tokens"] == r["tokens"]:
            continue
        at = next(j for j, (a, b) in enumerate(zip(o["tokens"], r["tokens"])) if a != b)
        out.append({"workload": r["workload"], "method": r["method"], "conv": r["conv"], "turn": r["turn"],
                    "same_prompt": o["prompt"] == r["prompt"], "at": at, "off_token": o["tokens"][at],
                    "on_token": r["tokens"][at], "prompt": o["prompt"] + o["tokens"][:at]})
    return out


def logit_gaps(target, divs: list[dict], limit: int) -> None:
    """Fill ``gap`` (cold HF prefill's logit of the off token minus that of the on token) and
    ``top_gap`` (its top-1 minus top-2 logit) for the first ``limit`` divergences with equal prompts."""
    import torch

    for d in [d for d in divs if d["same_prompt"]][:limit]:
        logits, _ = target.prefill(d["prompt"], target.new_cache())
        top2 = torch.topk(logits, 2).values
        d["gap"] = float(logits[d["off_token"]] - logits[d["on_token"]])
        d["top_gap"] = float(top2[0] - top2[1])


# ---------------------------------------------------------------------------------- summaries

def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _tau(rs: list[dict]) -> float:
    return sum(len(r["tokens"]) - 1 for r in rs) / max(1, sum(r["rounds"] for r in rs))


def summarise(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """``(per_turn, per_workload)``: per workload, method and turn the mean TTFT off / on, their ratio,
    the hit rate, τ off / on and whether every request's tokens matched; per workload and method the
    hit rate, τ, tokens/s off / on and matching requests."""
    req = [r for r in rows if "conv" in r]
    tot = [r for r in rows if "clock_s" in r]
    per_turn, per_work = [], []
    for w, m in dict.fromkeys((r["workload"], r["method"]) for r in req):
        sel = [r for r in req if r["workload"] == w and r["method"] == m]
        for t in sorted({r["turn"] for r in sel}):
            off = sorted((r for r in sel if r["turn"] == t and r["mode"] == "off"), key=lambda r: r["conv"])
            on = sorted((r for r in sel if r["turn"] == t and r["mode"] == "on"), key=lambda r: r["conv"])
            per_turn.append({"workload": w, "method": m, "turn": t, "requests": len(on),
                             "prompt_tokens": round(_mean([r["prompt_tokens"] for r in on])),
                             "ttft_off_s": _mean([r["ttft_s"] for r in off]), "ttft_on_s": _mean([r["ttft_s"] for r in on]),
                             "hit_rate": sum(r["hit_tokens"] for r in on) / max(1, sum(r["prompt_tokens"] for r in on)),
                             "tau_off": _tau(off), "tau_on": _tau(on),
                             "same": sum(a["tokens"] == b["tokens"] for a, b in zip(off, on))})
            per_turn[-1]["ratio"] = per_turn[-1]["ttft_on_s"] / per_turn[-1]["ttft_off_s"]
        clock = {r["mode"]: r for r in tot if r["workload"] == w and r["method"] == m}
        on = [r for r in sel if r["mode"] == "on"]
        off = {(r["conv"], r["turn"]): r["tokens"] for r in sel if r["mode"] == "off"}
        per_work.append({"workload": w, "method": m, "requests": len(on),
                         "hit_rate": sum(r["hit_tokens"] for r in on) / max(1, sum(r["prompt_tokens"] for r in on)),
                         "tau_off": _tau([r for r in sel if r["mode"] == "off"]), "tau_on": _tau(on),
                         "tps_off": clock["off"]["tokens"] / clock["off"]["clock_s"],
                         "tps_on": clock["on"]["tokens"] / clock["on"]["clock_s"],
                         "clock_off_s": clock["off"]["clock_s"], "clock_on_s": clock["on"]["clock_s"],
                         "prefill_off": clock["off"]["prefill_rows"], "prefill_on": clock["on"]["prefill_rows"],
                         "same": sum(off[(r["conv"], r["turn"])] == r["tokens"] for r in on)})
    return per_turn, per_work


def render(per_turn: list[dict], per_work: list[dict], divs: list[dict], a: argparse.Namespace,
           machine: str, conc: dict) -> str:
    """The results README: what ran, the command, the tables, the divergences."""
    off = "in-place" if a.baseline == "inplace" else "off"
    lines = ["# Prefix caching on multi-turn chat", "",
             f"SmolLM2-135M-Instruct, `--weights {a.weights}`, {a.threads} threads, {machine}; greedy, "
             f"{a.max_tokens} tokens per turn (EOS ignored), tree budget {a.budget}, {a.max_running} KV slots. "
             f"Cache on and {off} (the baseline) run interleaved step by step on two engines over one loaded model; "
             "times are each engine's own step seconds. TTFT: mean over the turn's requests, seconds.", "",
             "```", "python -m benchmarks.bench_prefix_cache " + " ".join(sys.argv[1:]), "```", "",
             f"| workload | c | method | requests | hit rate | prefill rows {off} | prefill rows on | τ {off} | τ on "
             f"| tok/s {off} | tok/s on | on / {off} | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in per_work:
        lines.append(f"| {r['workload']} | {conc[r['workload']]} | {r['method']} | {r['requests']} | "
                     f"{r['hit_rate']:.2f} | {r['prefill_off']} | {r['prefill_on']} | {r['tau_off']:.2f} | "
                     f"{r['tau_on']:.2f} | {r['tps_off']:.1f} | "
                     f"{r['tps_on']:.1f} | {r['tps_on'] / r['tps_off']:.2f} | {r['same']}/{r['requests']} |")
    lines += ["", f"| workload | method | turn | prompt tokens | TTFT {off} | TTFT on | on / {off} | hit rate | τ {off} "
              "| τ on | same tokens |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in per_turn:
        lines.append(f"| {r['workload']} | {r['method']} | {r['turn']} | {r['prompt_tokens']} | {r['ttft_off_s']:.2f} | "
                     f"{r['ttft_on_s']:.2f} | {r['ratio']:.2f} | {r['hit_rate']:.2f} | {r['tau_off']:.2f} | "
                     f"{r['tau_on']:.2f} | {r['same']}/{r['requests']} |")
    if divs:
        lines += ["", f"Divergences (cache on vs {off}; gap = cold prefill's logit of the {off} token minus the on "
                  "token's, top gap = its top-1 minus top-2):", "",
                  "| workload | method | conv | turn | same prompt | at token | gap | top gap |", "|---|---|---|---|---|---|---|---|"]
        for d in divs:
            gap = f"{d['gap']:.3f}" if "gap" in d else "-"
            top = f"{d['top_gap']:.3f}" if "top_gap" in d else "-"
            lines.append(f"| {d['workload']} | {d['method']} | {d['conv']} | {d['turn']} | "
                         f"{'yes' if d['same_prompt'] else 'no'} | {d['at']} | {gap} | {top} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Entry point: load the model once, build a cache-on and a cache-off engine over it, run each
    workload and method interleaved, write the results."""
    a = build_args(argv)
    t_start = time.perf_counter()
    import torch

    from services.generate import build_inprocess
    from services.models.registry import resolve_target
    from services.spec import TreeKnobs, default_tree_knobs
    from services.verifier.build import build_engine
    from services.verifier.engine import EngineConfig
    from services.weights import resolve_cli_weights

    torch.set_num_threads(a.threads)
    weights, dtype = resolve_cli_weights(a.weights, None, resolve_target(None))
    defaults = TreeKnobs(a.budget, None, None, None).filled_from(default_tree_knobs("cpu"))
    loaded, tok, _ = build_inprocess(None, None, dtype, defaults, weights=weights, spec_policy="fixed")
    target, drafter, depth = loaded.target, loaded.drafter, loaded.max_draft_depth
    del loaded  # its KV reservation; the two engines below reserve their own
    engines = {m: build_engine(target, drafter, EngineConfig(max_context=a.max_context, max_running=a.max_running,
                                                             prefix_cache=(m == "on" or a.baseline == "inplace")),
                               max_draft_depth=depth, policy="fixed", defaults=defaults) for m in MODES}
    if a.baseline == "inplace":  # no copy is ever worth it: a prefix is reused only in its own slot
        engines["off"].runner.cache.prefix.min_copy = 10**9
    work = {}
    if "sharegpt" in a.workloads and a.sharegpt:
        work["sharegpt"] = (sharegpt_workload(tok, a.sharegpt, a.sharegpt_turns, a.turn_cap), a.sharegpt_concurrency)
    if "system" in a.workloads:
        work["system"] = (system_workload(tok, a.users, a.turns, a.system_tokens), a.concurrency)
    if "choices" in a.workloads:
        work["choices"] = (choices_workload(tok, a.choices, a.system_tokens), a.choices)
    warm = [{"system": None, "turns": [SYSTEM_PARAGRAPH * 2]} for _ in range(a.max_running)]
    t0 = time.perf_counter()
    for m in a.methods:  # warm-up (lazy GEMM packs, first-touch KV pages): not reported
        run_workload(engines, tok, warm, m, a.budget, 8, a.max_running, "warm-up")
    print(f"loaded and warmed up in {time.perf_counter() - t_start:.0f} s (warm-up {time.perf_counter() - t0:.0f} s)",
          flush=True)
    rows, divs = [], []
    machine = f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}"
    conc = {tag: c for tag, (_, c) in work.items()}
    for m in a.methods:
        for tag, (convs, c) in work.items():
            t0 = time.perf_counter()
            rows += run_workload(engines, tok, convs, m, a.budget, a.max_tokens, c, tag)
            print(f"{tag} {m}: {time.perf_counter() - t0:.0f} s", flush=True)
            write(rows, divs, a, machine, conc)  # partial results survive a time limit
    divs = divergences(rows)
    t0 = time.perf_counter()
    logit_gaps(target, divs, a.ties)
    print(f"{len(divs)} divergences, logit gaps in {time.perf_counter() - t0:.0f} s", flush=True)
    print(write(rows, divs, a, machine, conc))
    return 0


def write(rows: list[dict], divs: list[dict], a: argparse.Namespace, machine: str, conc: dict) -> str:
    """Write ``results.json`` and ``README.md`` under ``--out`` (prompts left out); returns the README."""
    per_turn, per_work = summarise(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    strip = lambda ds: [{k: v for k, v in d.items() if k != "prompt"} for d in ds]  # noqa: E731
    (a.out / "results.json").write_text(json.dumps({"per_turn": per_turn, "per_workload": per_work,
                                                    "divergences": strip(divs), "rows": strip(rows)}, indent=1))
    text = render(per_turn, per_work, divs, a, machine, conc)
    (a.out / "README.md").write_text(text)
    return text

if __name__ == "__main__":
    sys.exit(main())
