"""Aggregation for ``dartree bench``: cell summaries, speedups, the lossless check, and results.md.

Definitions (docs/algorithms.md §6):

- ``tau``: per sample (one (prompt, turn)) the mean tokens emitted per speculative round, bonus
  included; the cell reports the macro mean over samples (``tau``) and the micro mean over rounds.
- ``TPOT``: ``Σ decode time / Σ tokens after the first`` over the cell (micro, as DART);
  ``tpot_macro_ms`` is the mean of per-sample TPOTs (DDT's aggregation).
- ``speedup = TPOT(ar) / TPOT(method)`` for the same dataset and temperature, AR measured by the
  same loop (``speedup_macro`` uses the macro TPOTs).
- Position-wise acceptance: ``Pr(L >= t)`` with ``L`` = accepted draft tokens of a round
  (bonus excluded), i.e. the probability that draft depth ``t`` is accepted.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from pathlib import Path

TABLE2_METHODS = ("dartree-pruned", "dartree-fixed", "seqheap", "domino-ddtree", "ddtree", "domino")
TABLE3_METHODS = ("dspark", "dspark-dartree")  # the paper's Table 3: DSpark-Markov alone vs + DARTree
TABLE4_METHODS = ("eagle3", "dartree-pruned", "ddtree")  # Table 4: EAGLE-3's 64-node tree next to ours
DATASET_LABELS = {"gsm8k": "GSM8K", "math500": "MATH-500", "aime25": "AIME25", "humaneval": "HumanEval",
                  "mt-bench": "MT-Bench", "sharegpt": "ShareGPT", "mbpp": "MBPP", "alpaca": "Alpaca"}


def write_result(res: dict, out: str | Path | None) -> dict:
    """A benchmark's result, the way every script ends: written to ``out`` as indented JSON (its
    folder made; None or "": no file) and printed as the last stdout line, one JSON line. Returns ``res``.

    Raises:
        OSError: ``out`` cannot be written. TypeError: ``res`` holds a value JSON cannot encode.
    """
    text = json.dumps(res)  # first: a value JSON cannot encode leaves no half-written file
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=2))
    print(text)
    return res


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def phase_stats(acc: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """``{phase: {mean_ms, std_ms, n}}`` from ``[n, Σx, Σx²]`` accumulators (seconds)."""
    out = {}
    for p, (n, s, ss) in acc.items():
        if n:
            mean = s / n
            out[p] = {"mean_ms": 1000 * mean, "std_ms": 1000 * math.sqrt(max(0.0, ss / n - mean * mean)), "n": int(n)}
    return out


def merge_phase(accs: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for acc in accs:
        for p, v in acc.items():
            cur = out.setdefault(p, [0, 0.0, 0.0])
            for i in range(3):
                cur[i] += v[i]
    return out


def accept_curve(hist: dict[str, int]) -> list[float]:
    """``[Pr(L >= t) for t = 1 .. max L]`` from ``{L: rounds}``."""
    h = {int(k): v for k, v in hist.items()}
    total = sum(h.values())
    if not total or not h:
        return []
    top = max(1, max(h))
    return [sum(v for k, v in h.items() if k >= t) / total for t in range(1, top + 1)]


def depth_fractions(hist: dict[str, int]) -> dict[str, float]:
    total = sum(hist.values())
    return {k: v / total for k, v in sorted(hist.items(), key=lambda kv: int(kv[0]))} if total else {}


def summarize(cell: dict) -> dict:
    """Summary numbers of one finished cell (no token ids)."""
    samples = [s for s in cell.get("samples", []) if "skipped" not in s]
    taus = [s["tau"] for s in samples if s.get("tau") is not None]
    dec = sum(s["decode_s"] for s in samples)
    after = sum(s["tokens_after_first"] for s in samples)
    tpots = [s["decode_s"] / s["tokens_after_first"] for s in samples if s["tokens_after_first"] > 0]
    rounds = sum(s["rounds"] for s in samples)
    ttft = _mean([s["ttft_s"] for s in samples])
    tokens = sum(s["num_tokens"] for s in samples)
    wall = sum(s["ttft_s"] + s["decode_s"] for s in samples)
    trees = cell.get("num_trees", 0)
    if any(s.get("replay") for s in samples):  # --tau-replay: acceptance only, nothing was timed
        dec = wall = 0.0
        tpots, ttft = [], None
    return {
        "num_samples": len(samples), "num_tokens": tokens, "num_rounds": rounds,
        "tau": _mean(taus), "tau_micro": (sum(s["taus_sum"] for s in samples) / rounds) if rounds else None,
        "tpot_ms": 1000 * dec / after if after and dec > 0 else None,
        "tpot_macro_ms": 1000 * _mean(tpots) if tpots else None,
        "ttft_ms": 1000 * ttft if ttft is not None else None,
        "decode_tokens_per_s": after / dec if dec > 0 else None,
        "e2e_tokens_per_s": tokens / wall if wall > 0 else None,
        "round_ms": phase_stats(cell.get("phase", {})),
        "accept_curve": accept_curve(cell.get("accept_hist", {})),
        "depth_fraction": depth_fractions(cell.get("depth_hist", {})),
        "mean_tree_nodes": (sum(cell.get("depth_hist", {}).values()) / trees) if trees else None,
        "finish": dict(Counter(s.get("finish") for s in samples)),
        "skipped": len(cell.get("samples", [])) - len(samples),
    }


def add_speedups(rows: list[dict]) -> None:
    """Fill ``speedup`` / ``speedup_macro`` of every ok row from the ``ar`` row of its dataset and T."""
    ar = {(r["dataset"], r["temperature"], r["n_prompts"]): r["summary"] for r in rows
          if r["method"] == "ar" and r.get("status") == "ok"}
    for r in rows:
        s = r.get("summary")
        base = ar.get((r["dataset"], r["temperature"], r["n_prompts"]))
        if not s or not base:
            continue
        s["speedup"] = (base["tpot_ms"] / s["tpot_ms"]) if base.get("tpot_ms") and s.get("tpot_ms") else None
        s["speedup_macro"] = (base["tpot_macro_ms"] / s["tpot_macro_ms"]
                              if base.get("tpot_macro_ms") and s.get("tpot_macro_ms") else None)


def lossless_check(cells: dict[tuple, dict], labels: list[str], load_tokens=None) -> dict[str, dict]:
    """Compare every method's T=0 outputs with ``ar``'s, sample by sample (by token-id digest).

    Args:
        cells: ``{(label, dataset): cell}`` at T=0, including ``("ar", dataset)``; samples carry
            ``token_sha`` (see :func:`slim_cell`) or ``token_ids``.
        load_tokens: optional ``(cell, uid, turn) -> token ids`` to locate the first differing token.
    Returns:
        ``{label: {checked, mismatches, examples: [{uid, turn, first_diff, len, ar_len}]}}``.
    """
    out = {}
    for m in labels:
        if m == "ar":
            continue
        checked = mism = 0
        examples = []
        for (label, ds), cell in cells.items():
            if label != m or ("ar", ds) not in cells:
                continue
            ar_cell = cells[("ar", ds)]
            ref = {(s["uid"], s["turn"]): s for s in ar_cell["samples"] if "skipped" not in s}
            for s in cell["samples"]:
                r = ref.get((s["uid"], s["turn"]))
                if r is None or "skipped" in s:
                    continue
                checked += 1
                if token_digest(s) != token_digest(r):
                    mism += 1
                    if len(examples) < 10:
                        ex = {"uid": s["uid"], "turn": s["turn"], "len": s["num_tokens"], "ar_len": r["num_tokens"]}
                        if load_tokens is not None:
                            a, b = load_tokens(cell, s["uid"], s["turn"]), load_tokens(ar_cell, s["uid"], s["turn"])
                            if a is not None and b is not None:
                                ex["first_diff"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                                                        min(len(a), len(b)))
                        examples.append(ex)
        out[m] = {"checked": checked, "mismatches": mism, "examples": examples}
    return out


def token_digest(sample: dict) -> str:
    if "token_sha" in sample:
        return sample["token_sha"]
    return hashlib.sha1(json.dumps(sample.get("token_ids", [])).encode()).hexdigest()


def slim_cell(cell: dict) -> dict:
    """The cell with each sample's ``token_ids`` replaced by a digest (keeps memory flat in big runs)."""
    samples = []
    for s in cell.get("samples", []):
        if "token_ids" in s:
            s = {k: v for k, v in s.items() if k != "token_ids"} | {"token_sha": token_digest(s)}
        samples.append(s)
    return {**cell, "samples": samples}


def knob_text(knobs: dict) -> str:
    """``B=64 W=12 β=-0.2 K=64`` (only the knobs present)."""
    names = {"budget": "B", "width": "W", "depth_bonus": "β", "candidates": "K"}
    return " ".join(f"{names[k]}={knobs[k]:g}" for k in names if k in knobs) or "-"


def _f(x, fmt: str = "{:.2f}", na: str = "n/a") -> str:
    return na if x is None else fmt.format(x)


def table1(rows: list[dict], methods: list[str], datasets: list[str], temperature: float) -> dict:
    """``{method: {dataset | "mean": {tau, speedup}}}`` for one temperature (main-stage rows)."""
    out: dict[str, dict] = {}
    for m in methods:
        per = {}
        for ds in datasets:
            r = next((r for r in rows if r["method"] == m and r["dataset"] == ds
                      and r["temperature"] == temperature), None)
            s = r.get("summary") if r and r.get("status") == "ok" else None
            per[ds] = {"tau": s.get("tau") if s else None, "speedup": s.get("speedup") if s else None,
                       "status": r.get("status") if r else "missing", "reason": (r or {}).get("reason")}
        per["mean"] = {"tau": _mean([v["tau"] for v in per.values()]),
                       "speedup": _mean([v["speedup"] for v in per.values()])}
        out[m] = per
    return out


def table2(rows: list[dict], cells: dict, temperature: float, methods=TABLE2_METHODS) -> dict:
    """Ablation: per method, mean tau / speedup over datasets and pooled round time ± std per phase."""
    out = {}
    for m in methods:
        rs = [r for r in rows if r["method"] == m and r["temperature"] == temperature and r.get("status") == "ok"]
        if not rs:
            continue
        phase = phase_stats(merge_phase([cells[r["file"]]["phase"] for r in rs if r["file"] in cells]))
        out[m] = {"tau": _mean([r["summary"]["tau"] for r in rs]),
                  "speedup": _mean([r["summary"].get("speedup") for r in rs]),
                  "mean_tree_nodes": _mean([r["summary"].get("mean_tree_nodes") for r in rs]),
                  "round_ms": phase, "datasets": [r["dataset"] for r in rs]}
    return out


_KERNELS = {  # what every method and the HF peers share, per --weights (services/weights.py, services/cpu_gemm.py)
    "float32": "float32 weights pre-packed for the verify / draft row counts (services/cpu_gemm.py; every method "
               "and the HF peers share them)",
    "bfloat16": "bfloat16 linears pre-packed for oneDNN (services/cpu_gemm.py; every method and the HF peers share "
                "them)",
    "q4": "the GGUF's Q4_1 linears kept 4-bit (torch's int4 CPU kernel), the Q8_0 lm_head as a oneDNN-packed "
          "bfloat16 linear (services/weights.py; every method and the HF peers share them)",
}


def render_markdown(res: dict) -> str:
    """results.md: header, lossless check, Table 1 per temperature, Table 2, latency, sweeps, serving."""
    cfg, lines = res["config"], []
    lines += [f"# DARTree Serve benchmark: {res['date']}, {res['machine_id']}", "",
              f"Command: `{res['command']}`", "",
              f"- Target: `{cfg['target']}` (weights {cfg.get('weights', cfg['dtype'])}"
              f"{', steps compiled (--compile; HF peers eager)' if cfg.get('compile') else ''}); "
              f"{res.get('drafter_note', '')}",
              f"- Prompts per dataset: {cfg['prompts']}; max new tokens: {cfg['max_new_tokens']}; "
              f"temperatures: {cfg['temperatures']}; seed {cfg['seed']}",
              f"- Tree knobs: {knob_text(cfg['knobs'])}",
              f"- Machine: {res['machine'].get('platform')}, {res['machine'].get('cpu_count')} CPUs, "
              f"device {res['machine'].get('device')}, torch threads {res['machine'].get('torch_threads')}",
              "- Kernels: " + (_KERNELS.get(cfg.get("weights"), _KERNELS["float32"]) if cfg.get("packed_gemm", True)
                               else "plain F.linear (--no-packed-gemm)"),
              "- Versions: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items())]
    if cfg.get("llama_cpp"):
        lc = cfg["llama_cpp"]
        lines.append(f"- llama.cpp peer: `{lc['gguf']}`, {lc['threads']} threads, n_ctx {lc['n_ctx']}")
    lines.append("")
    for name, why in res.get("unavailable", {}).items():
        lines.append(f"- **{DATASET_LABELS.get(name, name)} not run**: {why}")
    lines += ["", "τ = mean tokens per speculative round incl. the bonus (macro over samples); speedup = AR TPOT / "
              "method TPOT (decode clock after the first token, AR measured by the same loop). The peers (HF "
              "`generate`, HF prompt lookup, llama.cpp `llama-cpp` on the same GGUF and thread count) are greedy "
              "only (n/a at T > 0); a `llama-cpp` speedup above 1 means llama.cpp decodes faster than our `ar`.", ""]
    if res.get("replayed"):
        lines += ["**τ replay** (`--tau-replay`): the T = 0 cells of " + ", ".join(f"`{c}`" for c in res["replayed"])
                  + " replayed acceptance against `ar`'s greedy output with the engine's drafter and tree builders "
                  "(one teacher-forced target forward per sample instead of a verify per round; equal to the "
                  "engine round for round, tests/bench/test_replay.py). They measure τ, acceptance and tree "
                  "shapes only: no speedup, and they are not part of the lossless check.", ""]
    ll = res.get("lossless", {})
    if ll:
        lines += ["## Lossless check (T = 0: token ids equal to `ar`)", "", "| Method | samples | mismatches |",
                  "|---|---:|---:|"]
        lines += [f"| {m} | {v['checked']} | {v['mismatches']} |" for m, v in ll.items()]
        lines.append("")
    for m, v in res.get("peer_agreement", {}).items():
        if v["checked"]:
            lines += [f"`{m}` runs llama.cpp's own kernels on the GGUF's Q4_1 weights (8-bit activations, f16 KV), "
                      f"not our target's kernels, so it is not held to the lossless check: "
                      f"{v['checked'] - v['mismatches']}/{v['checked']} samples token-identical to `ar`.", ""]
    for t, tab in res.get("table1", {}).items():
        dss = [d for d in res["config"]["datasets"]]
        lines += [f"## Table 1: τ and speedup, T = {t}", "",
                  "| Method | " + " | ".join(f"{DATASET_LABELS.get(d, d)} τ | {DATASET_LABELS.get(d, d)} ×"
                                             for d in dss + ["mean"]) + " |",
                  "|---|" + "---:|" * (2 * (len(dss) + 1))]
        for m, per in tab.items():
            cells = []
            for d in dss + ["mean"]:
                v = per.get(d, {})
                cells += [_f(v.get("tau")), _f(v.get("speedup"), "{:.2f}×")]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    for key, title in (("table3", "Table 3: DSpark (Markov head) chain vs + DARTree"),
                       ("table4", "Table 4: EAGLE-3 dynamic tree")):
        for t, tab in res.get(key, {}).items():
            dss = list(res["config"]["datasets"])
            lines += [f"## {title}, T = {t}", "", "| Method | " + " | ".join(
                f"{DATASET_LABELS.get(d, d)} τ" for d in dss + ["mean"]) + " |", "|---|" + "---:|" * (len(dss) + 1)]
            lines += [f"| {m} | " + " | ".join(_f(per.get(d, {}).get("tau")) for d in dss + ["mean"]) + " |"
                      for m, per in tab.items()]
            lines.append("")
    for t, tab in res.get("table2", {}).items():
        if not tab:
            continue
        lines += [f"## Table 2: ablation, T = {t} (mean over datasets; round time pooled over rounds, ms ± std)", "",
                  "| Method | τ | speedup | nodes/tree | round | draft | tree build | verify | commit |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for m, v in tab.items():
            ph = v["round_ms"]
            cols = [_f(ph.get(p, {}).get("mean_ms"), "{:.1f}") + " ± " + _f(ph.get(p, {}).get("std_ms"), "{:.1f}")
                    if p in ph else "n/a" for p in ("total", "draft", "tree_build", "verify", "commit")]
            lines.append(f"| {m} | {_f(v['tau'])} | {_f(v['speedup'], '{:.2f}×')} | "
                         f"{_f(v.get('mean_tree_nodes'), '{:.1f}')} | " + " | ".join(cols) + " |")
        lines.append("")
    lat = res.get("latency", {})
    if lat:
        lines += ["## Latency (mean over datasets)", "",
                  "| Method | T | TTFT ms | TPOT ms | decode tok/s | end-to-end tok/s |",
                  "|---|---:|---:|---:|---:|---:|"]
        for key, v in lat.items():
            m, t = key.rsplit("@", 1)
            lines.append(f"| {m} | {t} | {_f(v['ttft_ms'], '{:.1f}')} | {_f(v['tpot_ms'], '{:.2f}')} | "
                         f"{_f(v['decode_tokens_per_s'], '{:.1f}')} | {_f(v['e2e_tokens_per_s'], '{:.1f}')} |")
        lines.append("")
    sw = res.get("sweeps", {})
    for name, pts in sw.items():
        if name == "best" or not pts:
            continue
        lines += [f"## Sweep: {name}", "", "| Method | knobs | τ | speedup | round ms |", "|---|---|---:|---:|---:|"]
        for p in pts:
            lines.append(f"| {p['method']} | {knob_text(p['knobs'])} | {_f(p.get('tau'))} | "
                         f"{_f(p.get('speedup'), '{:.2f}×')} | {_f(p.get('round_ms'), '{:.1f}')} |")
        lines.append("")
    if sw.get("best"):
        b = sw["best"]
        lines += [f"**Speedup-optimal sweep point:** {b['method']} {knob_text(b['knobs'])}: "
                  f"speedup {_f(b.get('speedup'))}×, τ {_f(b.get('tau'))}", ""]
    srv = res.get("serving")
    if srv:
        lines += ["## Serving (HTTP /v1/completions, aggregate completion tokens/s; speedup over `ar`)", "",
                  f"Server: {srv.get('url')}; {srv.get('note', '')}", ""]
        conc = srv.get("concurrency", [])
        lines += ["| Method | " + " | ".join(f"c={c} tok/s | c={c} ×" for c in conc) + " |",
                  "|---|" + "---:|" * (2 * len(conc))]
        for m, per in srv.get("table", {}).items():
            cols = []
            for c in conc:
                v = per.get(str(c), {})
                cols += [_f(v.get("tokens_per_s"), "{:.1f}"), _f(v.get("speedup"), "{:.2f}×")]
            lines.append(f"| {m} | " + " | ".join(cols) + " |")
        lines.append("")
    if res.get("figures"):
        lines += ["## Figures", ""] + [f"- [{f}]({f})" for f in res["figures"]] + [""]
    return "\n".join(lines)
