"""Where a warm chat turn's time to first token goes: the prefix cache's floor on short conversations.

A turn ``t >= 2`` of a ShareGPT conversation (``benchmarks.bench_prefix_cache``'s workload, one
conversation at a time) reuses the previous turns' positions and prefills the new suffix in one
step. Its TTFT splits into ``add_request`` (slot choice, prefix match), the step's target forward
(``StepStats.forward_seconds``) and the rest of the step (sampling the first token, bookkeeping).
For comparison, per turn: the cold TTFT of the same prompt (a cache-off engine) and the TTFT of a
cold prompt as long as the suffix alone (what one step of that many rows costs with no KV behind it).
If TTFT(warm) ~ TTFT(suffix alone), the gap between the warm / cold ratio and ``1 - hit`` is the
fixed cost of one forward, not per-request overhead. Then one warm step under ``torch.profiler``.

    python -m benchmarks.profile_warm_turn --weights q4 --threads 2

Prints a table and, as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def build_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_warm_turn", description=__doc__.split("\n")[0])
    p.add_argument("--weights", default="q4", help="target weight format (float32, bfloat16, q4)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--conversations", type=int, default=2, help="ShareGPT conversations")
    p.add_argument("--turns", type=int, default=4, help="human turns per conversation")
    p.add_argument("--turn-cap", type=int, default=192, help="tokens kept of each human turn")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn (greedy)")
    p.add_argument("--budget", type=int, default=8, help="tree budget (dartree-pruned)")
    a = p.parse_args(argv)
    if min(a.threads, a.conversations, a.turns, a.turn_cap, a.max_tokens, a.budget) < 1:
        p.error("counts must be >= 1")
    return a


def first_token(engine, rid: str, ids: list[int], sampling, spec) -> dict:
    """Admit ``rid`` and step it alone until its first token; finish it untimed. Seconds of
    ``add_request``, of the steps, of their forwards; the prompt tokens not prefilled; the tokens."""
    t0 = time.perf_counter()
    engine.add_request(rid, ids, sampling, spec)
    add_s, step_s, fwd_s, out = time.perf_counter() - t0, 0.0, 0.0, None
    while out is None:
        t0 = time.perf_counter()
        out = engine.step_batch([rid])[rid]
        step_s += time.perf_counter() - t0
        fwd_s += engine.last_step.forward_seconds
    tokens, cached = list(out.token_ids), out.cached_tokens
    while out.finish_reason is None:  # one round per step: a decode round always emits
        out = engine.step_batch([rid])[rid]
        if isinstance(out, BaseException):
            raise out
        tokens += out.token_ids
    return {"add_s": add_s, "step_s": step_s, "forward_s": fwd_s, "ttft_s": add_s + step_s, "cached": cached,
            "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    a = build_args(argv)
    import torch

    from benchmarks.bench_prefix_cache import sharegpt_workload
    from services.generate import build_inprocess
    from services.models.registry import resolve_target
    from services.spec import TreeKnobs, default_tree_knobs
    from services.verifier.build import build_engine
    from services.params import SamplingParams, SpecParams
    from services.verifier.engine import EngineConfig
    from services.weights import resolve_cli_weights

    torch.set_num_threads(a.threads)
    weights, dtype = resolve_cli_weights(a.weights, None, resolve_target(None))
    defaults = TreeKnobs(a.budget, None, None, None).filled_from(default_tree_knobs("cpu"))
    loaded, tok, _ = build_inprocess(None, None, dtype, defaults, weights=weights, spec_policy="fixed")
    target, drafter, depth = loaded.target, loaded.drafter, loaded.max_draft_depth
    del loaded
    engines = {m: build_engine(target, drafter, EngineConfig(max_context=2048, max_running=2, prefix_cache=m == "warm"),
                               max_draft_depth=depth, policy="fixed", defaults=defaults) for m in ("warm", "cold")}
    sampling, spec = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True), SpecParams("dartree-pruned", budget=a.budget)
    convs = sharegpt_workload(tok, a.conversations, a.turns, a.turn_cap)
    for k in (1, 8, 24, 64, 128, 192, 256):  # warm-up: lazy GEMM packs of these row counts, first-touch KV
        for e in engines.values():
            first_token(e, f"w{k}", [100 + i % 50 for i in range(k + 1)], SamplingParams(max_tokens=2), spec)
    rows, n = [], 0
    for c, conv in enumerate(convs):
        history = []
        for t, text in enumerate(conv["turns"]):
            history.append({"role": "user", "content": text})
            ids = list(tok(tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)["input_ids"])
            n += 1
            warm = first_token(engines["warm"], f"r{n}", ids, sampling, spec)
            history.append({"role": "assistant", "content": tok.decode(warm["tokens"], skip_special_tokens=True)})
            if t == 0:
                continue
            cold = first_token(engines["cold"], f"c{n}", ids, sampling, spec)
            suffix = first_token(engines["cold"], f"s{n}", ids[warm["cached"]:], sampling, spec)
            rows.append({"conv": c, "turn": t + 1, "prompt": len(ids), "cached": warm["cached"],
                         **{f"warm_{k}": v for k, v in warm.items() if k != "tokens"},
                         "cold_ttft_s": cold["ttft_s"], "suffix_ttft_s": suffix["ttft_s"],
                         "same": warm["tokens"] == cold["tokens"]})
    print("| conv | turn | prompt | cached | 1 - h | add ms | step ms | forward ms | rest ms | warm TTFT ms "
          "| suffix-alone TTFT ms | cold TTFT ms | warm / cold | same |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['conv']} | {r['turn']} | {r['prompt']} | {r['cached']} | {1 - r['cached'] / r['prompt']:.2f} | "
              f"{r['warm_add_s'] * 1e3:.2f} | {r['warm_step_s'] * 1e3:.1f} | {r['warm_forward_s'] * 1e3:.1f} | "
              f"{(r['warm_step_s'] - r['warm_forward_s']) * 1e3:.1f} | {r['warm_ttft_s'] * 1e3:.1f} | "
              f"{r['suffix_ttft_s'] * 1e3:.1f} | {r['cold_ttft_s'] * 1e3:.1f} | "
              f"{r['warm_ttft_s'] / r['cold_ttft_s']:.2f} | {r['same']} |")
    profile_warm_step(engines["warm"], convs[0], tok, sampling, spec)
    print(json.dumps({"rows": rows}))
    return 0


def profile_warm_step(engine, conv: dict, tok, sampling, spec) -> None:
    """One warm turn-2 step of ``conv`` under ``torch.profiler``: its ten costliest ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    history = [{"role": "user", "content": conv["turns"][0]}]
    ids = list(tok(tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"])
    answer = first_token(engine, "p1", ids, sampling, spec)["tokens"]
    history += [{"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)},
                {"role": "user", "content": conv["turns"][1]}]
    ids = list(tok(tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.add_request("p2", ids, sampling, spec)
        engine.step_batch(["p2"])
    engine.abort("p2")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    sys.exit(main())
