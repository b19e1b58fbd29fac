"""Roofline of tree speculation: predicted speedup over plain decoding from τ(B), c(M) and d(B).

One round of a B-node tree emits τ(B) tokens (replayed) and costs one verify forward of ``M = B + 1``
rows, ``c(M)`` one-row steps, plus the draft, ``d(B)`` steps (drafter block forward, output projection,
tree build). Plain decoding emits one token per one-row step, so

    speedup(B) = τ(B) (1 + o) / (c(B + 1) + d(B) + o + e)     and the best point is max over B (B = 0: 1.0)

where ``o`` is the per-step work outside the target forward (sampling, commit, the engine's
bookkeeping) in one-row steps, paid once per round by both, and ``e`` what a round that verifies a
tree adds to it (its tree buffers and mask, the walk, the commit of several tokens). Both come
from an ``e2e`` run (``--e2e``): ``o`` = the ``ar`` steps' mean time outside their forward, ``e`` =
the fixed settings' mean time outside forward and draft, less ``o`` (engine step timings, ms, the
same ms for every format); an ``e2e`` file without step timings gives ``o`` = the ``ar`` step's
wall time minus the one-row forward and ``e`` = 0; no ``e2e`` run, both 0 (docs/roofline.md).
Inputs: the two JSON files of
:mod:`benchmarks.bench_small_trees` (``tau`` and ``cost``), optionally bench results JSONs of the τ
protocol at larger budgets (``--protocol``, table 1 of ``dartree bench``), which enter only the
memory-bound model below (no draft cost was measured for them here).

For each measured weight format: its own c and d (in its own one-row steps), the speedup over its
own plain decoding and over plain decoding in the ``cost`` file's unit format (q4 by default: the
fastest plain decoding, so the one a user compares against). Then a memory-bound accelerator model:
``c(M) = 1`` for every M (a verify of a few dozen rows reads the same weights as one row) with an
assumed draft cost ``--gpu-draft`` steps (default 0.15: the drafter reads ~0.13 of the target's
weight bytes for SmolLM2-135M; kernel-launch latency is not modelled).

    python -m benchmarks.roofline --tau tau.json --cost cost.json [--e2e e2e.json] [--protocol results-B64.json ...] \\
        [--out roofline.md]

Prints a markdown report (also ``--out``) and, on the last stdout line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_tau(path: str) -> dict[tuple[int, int], dict]:
    """``{(B, L): {"mean": τ, dataset: τ, ...}}`` from a ``bench_small_trees tau`` file."""
    data = json.loads(Path(path).read_text())
    return {(c["budget"], c["block"]): {"mean": c["tau_mean"], **{k: v["tau"] for k, v in c["datasets"].items()}}
            for c in data["cells"]}


def load_protocol(paths: list[str]) -> dict[int, dict]:
    """``{B: {"mean": τ, dataset: τ}}`` of ``dartree-pruned`` at T = 0 from ``dartree bench`` results JSONs."""
    out = {}
    for p in paths:
        d = json.loads(Path(p).read_text())
        row = d["table1"]["0"]["dartree-pruned"]
        out[int(d["config"]["knobs"]["budget"])] = {k: v["tau"] for k, v in row.items()}
    return out


def predict(t: float, c: float, d: float, o: float, e: float = 0.0) -> float:
    """Speedup over plain decoding of rounds emitting ``t`` tokens for a verify of ``c``, a draft of
    ``d``, a per-step overhead of ``o`` and a tree round's extra overhead ``e``, in one-row steps."""
    return t * (1 + o) / (c + d + o + e)


def speedups(tau: dict, cost: dict, fmt: str, overhead_ms: float = 0.0, dataset: str = "mean",
             tree_ms: float = 0.0) -> list[dict]:
    """Rows ``{B, L, tau, c, d, o, e, speedup, speedup_vs_unit}`` of one format, every (B, L) with a
    draft time (``o`` = ``overhead_ms`` and ``e`` = ``tree_ms`` in the format's one-row steps;
    ``speedup_vs_unit``: over the unit format's plain decoding, whose step is its one-row forward
    plus the same ``overhead_ms``)."""
    f = cost["formats"][fmt]
    one = f["forward_ms"]["1"]
    unit_one = cost["formats"].get(cost["unit"], f)["forward_ms"]["1"]
    o, e = overhead_ms / one, tree_ms / one
    rows = []
    for key, dr in sorted(f["draft"].items(), key=lambda kv: tuple(int(x) for x in kv[0].split("/"))):
        b, block = (int(x) for x in key.split("/"))
        if (b, block) not in tau or str(b + 1) not in f["c"]:
            continue
        t, c, d = tau[(b, block)][dataset], f["c"][str(b + 1)], dr["d"]
        s = predict(t, c, d, o, e)
        rows.append({"B": b, "L": block, "tau": t, "c": c, "d": d, "o": round(o, 3), "e": round(e, 3),
                     "speedup": round(s, 3),
                     "speedup_vs_unit": round(s * (unit_one + overhead_ms) / (one + overhead_ms), 3)})
    return rows


def gpu_rows(tau: dict, protocol: dict, draft: float) -> list[dict]:
    """The memory-bound model: ``c = 1`` for every row count, draft ``draft`` steps, full block only."""
    full = max(block for _, block in tau) if tau else 16
    pts = {b: v["mean"] for (b, block), v in tau.items() if block == full}
    pts.update({b: v["mean"] for b, v in protocol.items()})
    return [{"B": b, "tau": round(t, 3), "c": 1.0, "d": draft, "speedup": round(t / (1.0 + draft), 3)}
            for b, t in sorted(pts.items())]


def overhead_of(e2e: dict | None, cost: dict) -> float:
    """Milliseconds of an ``ar`` step outside its forward: the engine's step timings of the ``e2e``
    run (``step_ms.other``), else its ``ar`` step's wall time minus the cost file's one-row forward
    (0 without an ``e2e`` run)."""
    if not e2e:
        return 0.0
    ar = e2e["settings"]["ar"]
    if ar.get("step_ms"):
        return max(ar["step_ms"]["other"], 0.0)
    return max(1e3 / ar["tokens_per_s"] - cost["formats"][e2e["weights"]]["forward_ms"]["1"], 0.0)


def tree_overhead_of(e2e: dict | None) -> float:
    """Milliseconds a round that verifies a tree spends outside its forward and its draft beyond an
    ``ar`` step's: the mean over the ``e2e`` run's fixed settings of ``step_ms.other`` less the
    ``ar`` setting's (0 without step timings)."""
    if not e2e or not e2e["settings"]["ar"].get("step_ms"):
        return 0.0
    base = e2e["settings"]["ar"]["step_ms"]["other"]
    extra = [m["step_ms"]["other"] - base for label, m in e2e["settings"].items()
             if label.startswith("fixed") and m.get("step_ms")]
    return max(sum(extra) / len(extra), 0.0) if extra else 0.0


def check_e2e(tau: dict, cost: dict, e2e: dict, overhead_ms: float, tree_ms: float = 0.0) -> list[dict]:
    """Predicted vs measured speedup of each fixed ``B=.. L=..`` setting of an ``e2e`` run (τ of its datasets)."""
    out = []
    rows = {}
    for ds in e2e["datasets"]:
        for r in speedups(tau, cost, e2e["weights"], overhead_ms, ds, tree_ms):
            rows.setdefault((r["B"], r["L"]), []).append(r["speedup"])
    for label, m in e2e["settings"].items():
        if not label.startswith("fixed"):
            continue
        b, block = (int(x.split("=")[1]) for x in label.split()[1:3])
        if (b, block) in rows:
            pred = sum(rows[(b, block)]) / len(rows[(b, block)])
            out.append({"setting": label, "predicted": round(pred, 3), "measured": m["vs_ar"],
                        "measured_paired": m["vs_ar_paired"], "error": round(pred / m["vs_ar"] - 1, 3)})
    return out


def report(tau: dict, cost: dict, protocol: dict, gpu_draft: float, e2e: dict | None = None) -> tuple[str, dict]:
    unit = cost["unit"]
    one = {w: f["forward_ms"]["1"] for w, f in cost["formats"].items()}
    o_ms, e_ms = overhead_of(e2e, cost), tree_overhead_of(e2e)
    lines = [f"Machine: {cost['machine']['processor']}, torch {cost['machine']['torch']}, "
             f"{cost['machine']['threads']} thread(s); unit step: {unit} one-row forward = {cost['unit_ms']} ms; "
             f"per-step overhead o = {o_ms:.1f} ms, a tree round's extra e = {e_ms:.1f} ms"
             + (" (from the e2e run's step timings)." if e2e else " (no e2e run: 0)."), ""]
    lines += ["| format | 1-row ms | " + " | ".join(f"c({r})" for r in cost["rows"]) + " |",
              "|---|---:|" + "---:|" * len(cost["rows"])]
    for w, f in cost["formats"].items():
        lines.append(f"| {w} | {one[w]:.1f} | " + " | ".join(f"{f['c'][str(r)]:.2f}" for r in cost["rows"]) + " |")
    out = {"overhead_ms": round(o_ms, 2), "tree_overhead_ms": round(e_ms, 2), "formats": {}, "gpu": None, "e2e": None}
    for w in cost["formats"]:
        rows = speedups(tau, cost, w, o_ms, tree_ms=e_ms)
        out["formats"][w] = rows
        lines += ["", f"**{w}** (drafter {cost['formats'][w]['drafter_dtype']}, o = {o_ms / one[w]:.2f}, "
                  f"e = {e_ms / one[w]:.2f}): "
                  f"speedup = τ (1 + o) / (c(B+1) + d + o + e), in {w} one-row steps, τ the mean over datasets; "
                  f"last column over {unit} plain decoding", "",
                  f"| B | L | τ | c(B+1) | d | speedup | vs {unit} `ar` |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['B']} | {r['L']} | {r['tau']:.2f} | {r['c']:.2f} | {r['d']:.2f} | "
                         f"**{r['speedup']:.2f}×** | {r['speedup_vs_unit']:.2f}× |")
        best = max(rows, key=lambda r: r["speedup"], default=None)
        if best:
            lines.append(f"\nbest: B = {best['B']}, L = {best['L']}: {best['speedup']:.2f}× "
                         f"({'plain decoding wins' if best['speedup'] < 1 else 'speculation pays'})")
    g = gpu_rows(tau, protocol, gpu_draft)
    out["gpu"] = g
    lines += ["", f"**memory-bound accelerator** (c(M) = 1, assumed d = {gpu_draft}): speedup = τ / (1 + d)", "",
              "| B | τ | speedup |", "|---:|---:|---:|"]
    lines += [f"| {r['B']} | {r['tau']:.2f} | {r['speedup']:.2f}× |" for r in g]
    if e2e:
        chk = check_e2e(tau, cost, e2e, o_ms, e_ms)
        out["e2e"] = chk
        lines += ["", f"**predicted vs measured** ({e2e['weights']}, {', '.join(e2e['datasets'])}, c = 1, τ of "
                  "those datasets)", "", "| setting | predicted | measured (median) | paired | predicted / measured - 1 |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['setting']} | {r['predicted']:.2f}× | {r['measured']:.2f}× | {r['measured_paired']:.2f}× | "
                  f"{100 * r['error']:+.1f} % |" for r in chk]
    return "\n".join(lines) + "\n", out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tau", required=True, help="bench_small_trees tau JSON")
    ap.add_argument("--cost", required=True, help="bench_small_trees cost JSON")
    ap.add_argument("--protocol", nargs="*", default=[], help="dartree bench results JSONs (τ at other budgets)")
    ap.add_argument("--e2e", default=None, help="bench_small_trees e2e JSON (the per-step overhead; predicted vs measured)")
    ap.add_argument("--gpu-draft", type=float, default=0.15, help="assumed draft cost of the memory-bound model (steps)")
    ap.add_argument("--out", default=None, help="write the markdown report here")
    a = ap.parse_args(argv)
    e2e = json.loads(Path(a.e2e).read_text()) if a.e2e else None
    text, out = report(load_tau(a.tau), json.loads(Path(a.cost).read_text()), load_protocol(a.protocol),
                       a.gpu_draft, e2e)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
