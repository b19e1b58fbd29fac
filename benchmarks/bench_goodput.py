"""Goodput policy vs ``ar`` vs fixed budgets, side by side in one process.

In-process batched serving without HTTP: the engine's ``step_batch`` with ``c`` requests in flight
(a finished request is replaced by the next prompt), as the verifier worker runs it. Per
(dataset, c, setting): aggregate tokens/s (emitted tokens / wall time of the level), tau, the
fraction of rounds without a drafter call, and the calibration error of the goodput policy
(per request, over its rounds after the first 8: |mean predicted tau - mean realised tau|,
the calibration goal, and the mean per-round |predicted - realised|, which a round's randomness keeps high). T = 0 output
of every setting is checked token for token against ``ar``.

    python -m benchmarks.bench_goodput --datasets gsm8k --concurrency 1 4 --prompts 4 --max-tokens 64 \\
        --fixed-budgets 4 8 [--repeats 3] [--weak-drafter] [--out benchmarks/results/<dir>]

``--repeats N`` runs ``ar`` and the goodput policy N times each, interleaved, and reports each one's
median run (all runs' tokens/s are kept in the JSON); fixed budgets run once.

``--weak-drafter`` perturbs the shipped drafter's weights with Gaussian noise (a deliberately weak
drafter: the policy should fall back to about ``ar`` by itself).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _prompts(tok, dataset: str, n: int) -> list[list[int]]:
    from services.datasets import load_eval
    from services.generate import encode

    return [encode(tok, p.turns[0], True) for p in load_eval(dataset, n)]


def run_level(engine, prompts: list[list[int]], c: int, method: str, budget: int | None, max_tokens: int) -> dict:
    """All ``prompts`` through ``engine`` with ``c`` in flight; returns tokens/s, tau and per-request stats.

    ``step_ms``: the decode steps' mean wall time split into the target forward, the wait for the
    drafts (an in-process drafter drafts inside it) and the rest (``other``: sampling, tree
    buffers, walk, commit, scheduling), in ms per step, from ``engine.last_step``; steps that
    prefilled a prompt chunk are left out."""
    from services.params import SamplingParams, SpecParams

    queue = list(enumerate(prompts))
    live: dict[str, dict] = {}
    done: dict[int, dict] = {}
    emitted = rounds = drafted = 0
    split = {"wall": 0.0, "forward": 0.0, "draft_wait": 0.0, "steps": 0}
    t0 = time.perf_counter()
    while queue or live:
        while queue and len(live) < c:
            i, ids = queue.pop(0)
            rid = f"{method}-{budget}-{c}-{i}-{time.monotonic_ns()}"
            engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=False),
                               SpecParams(method, budget=budget))
            live[rid] = {"i": i, "tokens": [], "rounds": []}
        outs = engine.step_batch(list(live))
        st_ = engine.last_step
        if st_.requests and not st_.prefill_tokens:
            split["wall"] += st_.wall_seconds
            split["forward"] += st_.forward_seconds
            split["draft_wait"] += st_.draft_wait_seconds
            split["steps"] += 1
        for rid, out in outs.items():
            if isinstance(out, BaseException):
                raise out
            if out is None:
                continue
            st = live[rid]
            st["tokens"] += out.token_ids
            if not out.is_prefill:
                rounds += 1
                drafted += int(out.drafted)
                emitted += len(out.token_ids)
                if out.finish_reason is None:
                    st["rounds"].append((out.predicted_tau, out.accept_length + 1, out.num_draft_tokens))
            if out.finish_reason is not None:
                done[st["i"]] = live.pop(rid)
    wall = time.perf_counter() - t0
    total = sum(len(d["tokens"]) for d in done.values())
    errs, errs_spec, bias = [], [], []
    for d in done.values():
        pr = [(p, r) for p, r, _ in d["rounds"][8:] if p is not None]
        if pr:  # the calibration goal: |mean predicted tau - mean realised tau| per request after 8 rounds
            bias.append(abs(statistics.mean(p for p, _ in pr) - statistics.mean(r for _, r in pr)))
        late = [(abs(p - r), n) for p, r, n in d["rounds"][8:] if p is not None]
        if late:
            errs.append(statistics.mean(e for e, _ in late))
        spec = [e for e, n in late if n > 0]  # rounds that verified nodes (a plain round's 1.0 is always right)
        if spec:
            errs_spec.append(statistics.mean(spec))
    return {"tokens_per_s": total / wall, "wall_s": wall, "tokens": total, "rounds": rounds,
            "tau": emitted / rounds if rounds else 0.0, "plain_round_fraction": 1 - drafted / rounds if rounds else 1.0,
            "calib_tau_error_per_request": statistics.mean(bias) if bias else None,
            "calib_error_per_request": statistics.mean(errs) if errs else None,
            "calib_error_spec_rounds": statistics.mean(errs_spec) if errs_spec else None,
            "step_ms": _step_ms(split), "outputs": {i: d["tokens"] for i, d in done.items()}}


def _step_ms(split: dict) -> dict:
    """Mean ms per decode step: wall, forward, draft wait and the rest (``other``)."""
    n = split["steps"]
    if not n:
        return {}
    out = {k: round(1e3 * split[k] / n, 3) for k in ("wall", "forward", "draft_wait")}
    out["other"] = round(out["wall"] - out["forward"] - out["draft_wait"], 3)
    out["steps"] = n
    return out


def plot(res: dict, path: Path) -> None:
    """tokens/s vs concurrency, one line per setting (ar, fixed budgets, goodput), one panel per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(lv["dataset"] for lv in res["levels"]))
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 3.6), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        levels = [lv for lv in res["levels"] if lv["dataset"] == ds]
        labels = [k for k, v in levels[0].items() if isinstance(v, dict)]
        for lbl in labels:
            ax.plot([lv["c"] for lv in levels], [lv[lbl]["tokens_per_s"] for lv in levels], marker="o",
                    label=lbl, linewidth=2.5 if lbl == "goodput" else 1.2)
        ax.set_title(f"{ds} ({res['args'].get('weights', 'float32')} weights)")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("tokens/s (all requests)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(res: dict) -> str:
    """The README's table of a run: per dataset, each setting's tokens/s at every c, the goodput
    policy's share of rounds without a drafter call, goodput / max(ar, best fixed), and a summary line."""
    levels = res["levels"]
    settings = [k for k, v in levels[0].items() if isinstance(v, dict)]
    cal = [s for s in settings if s.startswith("calibration")]
    out = ["| dataset | c | " + " | ".join(f"{s} tok/s" for s in settings)
           + " | goodput: rounds without a draft | goodput / max(ar, best fixed) |"
           + "".join(f" {s}: per-request \\|mean predicted − mean realised τ\\| |" for s in cal),
           "|" + "---|" * (len(settings) + 4 + len(cal))]
    for ds in dict.fromkeys(lv["dataset"] for lv in levels):
        ls = [lv for lv in levels if lv["dataset"] == ds]
        cells = [" / ".join(f"{lv[s]['tokens_per_s']:.1f}" for lv in ls) for s in settings]
        plain = " / ".join(f"{100 * lv['goodput']['plain_round_fraction']:.1f} %" for lv in ls)
        ratio = " / ".join(f"{lv['goodput_vs_best']:.2f}" for lv in ls)
        cs = " / ".join(str(lv["c"]) for lv in ls)
        calib = "".join(" " + " / ".join("–" if lv[s]["calib_tau_error_per_request"] is None
                                          else f"{lv[s]['calib_tau_error_per_request']:.3f}" for lv in ls) + " |"
                        for s in cal)
        out.append(f"| {ds} | {cs} | " + " | ".join(cells) + f" | {plain} | {ratio} |" + calib)
    ratios = [lv["goodput_vs_best"] for lv in levels]
    reps = res.get("args", {}).get("repeats", 1)
    if reps > 1:
        out.append(f"\n`ar` and goodput: the median of {reps} interleaved runs each; fixed budgets: one run.")
    out.append(f"\ngoodput / max(ar, best fixed): mean {sum(ratios) / len(ratios):.3f}, min {min(ratios):.3f}, "
               f"{sum(r >= 0.97 for r in ratios)} of {len(ratios)} points >= 0.97")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", nargs="+", default=["gsm8k"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--method", default="dartree-pruned")
    ap.add_argument("--fixed-budgets", type=int, nargs="*", default=[8])
    ap.add_argument("--weak-drafter", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--weights", default=None, help="target weight format (services/weights.py; default: "
                    "$DARTREE_WEIGHTS or auto, measured on this machine)")
    ap.add_argument("--optimism", type=float, default=None,
                    help="the goodput policy's forecast optimism (posterior standard deviations; default: the policy's)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run ar and goodput this many times each, interleaved, and report the median run "
                         "(single runs of 8 prompts vary by ~2 %%)")
    ap.add_argument("--calibration-budget", type=int, default=None,
                    help="also run the goodput policy with this explicit budget (every round drafts and "
                         "verifies B nodes), to measure its calibration where it would not draft by itself")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    if a.calibration_budget is not None and a.calibration_budget < 1:
        ap.error("--calibration-budget must be >= 1")

    import torch

    from services.generate import build_inprocess
    from services.verifier.build import build_engine
    from services.verifier.engine import EngineConfig
    from services.verifier.policy import FixedPolicy

    from services.models.registry import resolve_target
    from services.weights import choose_weights, compute_dtype, default_weights

    if a.threads:
        torch.set_num_threads(a.threads)
    weights = choose_weights(a.weights or default_weights(), resolve_target(None))
    a.weights = weights
    engine0, tok, note = build_inprocess(None, None, compute_dtype(weights), weights=weights)
    if a.weak_drafter:
        torch.manual_seed(0)
        with torch.no_grad():
            for p in engine0.drafter.service.drafter.parameters():
                if p.ndim >= 2:
                    p.add_(torch.randn_like(p) * p.std() * 1.0)
        note += " (weights perturbed: weak drafter)"
    c_max = max(a.concurrency)
    defaults = engine0.policy.defaults  # the CPU defaults dartree generate uses
    engine = build_engine(engine0.target, engine0.drafter, EngineConfig(max_running=c_max),
                          max_draft_depth=engine0.max_draft_depth, policy="goodput", defaults=defaults,
                          cost_key=("smollm2-135m-instruct", weights, "cpu"))
    fixed = FixedPolicy(defaults=defaults)
    goodput = engine.policy
    if a.optimism is not None:
        goodput.optimism = a.optimism
    settings = [("ar", "ar", None, fixed)] + [(f"fixed B={b}", a.method, b, fixed) for b in a.fixed_budgets] + [
        ("goodput", a.method, None, goodput)]
    if a.calibration_budget is not None:  # the goodput policy's own predictions on every round (an explicit budget drafts always)
        import copy  # its own policy object: its rounds must not teach the measured goodput policy

        from services.verifier.policy import GoodputPolicy
        settings.append((f"calibration B={a.calibration_budget}", a.method, a.calibration_budget,
                         GoodputPolicy(cost=copy.deepcopy(goodput.cost), max_budget=goodput.max_budget)))
    res = {"note": note, "machine": "shared 2-core CPU (another benchmark may have been running)",
           "args": vars(a), "levels": []}
    for ds in a.datasets:
        prompts = _prompts(tok, ds, a.prompts)
        run_level(engine, prompts[:1], 1, "ar", None, 8)  # warm-up
        for c in a.concurrency:
            row = {"dataset": ds, "c": c}
            ref = None
            runs: dict[str, list[dict]] = {}
            for rep in range(a.repeats):  # ar and goodput interleaved; fixed budgets once (never close here)
                for label, method, budget, pol in settings:
                    if rep and label.startswith(("fixed", "calibration")):
                        continue
                    engine.policy = pol
                    r = run_level(engine, prompts, c, method, budget, a.max_tokens)
                    outs = r.pop("outputs")
                    if ref is None:
                        ref = outs
                    r["equals_ar"] = outs == ref
                    r["diverged_requests"] = sum(outs.get(i) != ref.get(i) for i in ref)
                    runs.setdefault(label, []).append(r)
                    print(f"{ds} c={c} {label:12s} {r['tokens_per_s']:6.2f} tok/s tau {r['tau']:.2f} "
                          f"plain {r['plain_round_fraction']:.2f} |mean pred - mean real tau| {r['calib_tau_error_per_request']} "
                          f"per-round |err| {r['calib_error_per_request']} "
                          f"(spec rounds {r['calib_error_spec_rounds']}) "
                          f"equals_ar {r['equals_ar']}", flush=True)
            for label, *_ in settings:  # the median run by tokens/s (of 1, 2 or 3 ...: the lower middle)
                rs = sorted(runs[label], key=lambda x: x["tokens_per_s"])
                r = dict(rs[(len(rs) - 1) // 2])
                r["tokens_per_s_runs"] = [x["tokens_per_s"] for x in runs[label]]
                row[label] = r
            best = max(row[lbl]["tokens_per_s"] for lbl, *_ in settings
                       if lbl != "goodput" and not lbl.startswith("calibration"))
            row["goodput_vs_best"] = row["goodput"]["tokens_per_s"] / best
            print(f"{ds} c={c} goodput / max(ar, best fixed) = {row['goodput_vs_best']:.3f}", flush=True)
            res["levels"].append(row)
            if a.out:  # after every level: a run cut short keeps what it measured
                out = Path(a.out)
                out.mkdir(parents=True, exist_ok=True)
                name = "results-weak.json" if a.weak_drafter else "results.json"
                (out / name).write_text(json.dumps(res, indent=1))
                (out / name.replace(".json", ".md")).write_text(markdown(res))
    if a.out and res["levels"]:
        plot(res, Path(a.out) / ("goodput-weak.png" if a.weak_drafter else "goodput.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
