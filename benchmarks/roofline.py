"""Roofline of tree speculation: predicted speedup over plain decoding from τ(B), c(M) and d(B).

One round of a B-node tree emits τ(B) tokens (replayed) and costs one verify forward of ``M = B + 1``
rows, ``c(M)`` one-row steps, plus the draft, ``d(B)`` steps (drafter block forward, output projection,
tree build). Plain decoding emits one token per one-row step, so

    speedup(B) = τ(B) / (c(B + 1) + d(B))          and the best point is max over B (B = 0: 1.0)

(docs/roofline.md; per-request overheads outside the forward and the draft are left out: they are
paid by both and shrink the ratio towards 1). Inputs: the two JSON files of
:mod:`benchmarks.bench_small_trees` (``tau`` and ``cost``), optionally bench results JSONs of the τ
protocol at larger budgets (``--protocol``, table 1 of ``dartree bench``), which enter only the
memory-bound model below (no draft cost was measured for them here).

For each measured weight format: its own c and d (in its own one-row steps), the speedup over its
own plain decoding and over plain decoding in the ``cost`` file's unit format (q4 by default: the
fastest plain decoding, so the one a user compares against). Then a memory-bound accelerator model:
``c(M) = 1`` for every M (a verify of a few dozen rows reads the same weights as one row) with an
assumed draft cost ``--gpu-draft`` steps (default 0.15: the drafter reads ~0.13 of the target's
weight bytes for SmolLM2-135M; kernel-launch latency is not modelled).

    python -m benchmarks.roofline --tau tau.json --cost cost.json [--protocol results-B64.json ...] [--out roofline.md]

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


def speedups(tau: dict, cost: dict, fmt: str, unit_scale: float) -> list[dict]:
    """Rows ``{B, L, tau, c, d, speedup, speedup_vs_unit}`` of one format, every (B, L) with a draft time.

    ``unit_scale`` = the format's one-row forward over the unit format's (so a speedup over the unit
    format's plain decoding is ``speedup / unit_scale``)."""
    f = cost["formats"][fmt]
    rows = []
    for key, dr in sorted(f["draft"].items(), key=lambda kv: tuple(int(x) for x in kv[0].split("/"))):
        b, block = (int(x) for x in key.split("/"))
        if (b, block) not in tau or str(b + 1) not in f["c"]:
            continue
        t, c, d = tau[(b, block)]["mean"], f["c"][str(b + 1)], dr["d"]
        s = t / (c + d)
        rows.append({"B": b, "L": block, "tau": t, "c": c, "d": d, "speedup": round(s, 3),
                     "speedup_vs_unit": round(s / unit_scale, 3)})
    return rows


def gpu_rows(tau: dict, protocol: dict, draft: float) -> list[dict]:
    """The memory-bound model: ``c = 1`` for every row count, draft ``draft`` steps, full block only."""
    full = max(block for _, block in tau) if tau else 16
    pts = {b: v["mean"] for (b, block), v in tau.items() if block == full}
    pts.update({b: v["mean"] for b, v in protocol.items()})
    return [{"B": b, "tau": round(t, 3), "c": 1.0, "d": draft, "speedup": round(t / (1.0 + draft), 3)}
            for b, t in sorted(pts.items())]


def report(tau: dict, cost: dict, protocol: dict, gpu_draft: float) -> tuple[str, dict]:
    unit = cost["unit"]
    one = {w: f["forward_ms"]["1"] for w, f in cost["formats"].items()}
    lines = [f"Machine: {cost['machine']['processor']}, torch {cost['machine']['torch']}, "
             f"{cost['machine']['threads']} thread(s); unit step: {unit} one-row forward = {cost['unit_ms']} ms.", ""]
    lines += ["| format | 1-row ms | " + " | ".join(f"c({r})" for r in cost["rows"]) + " |",
              "|---|---:|" + "---:|" * len(cost["rows"])]
    for w, f in cost["formats"].items():
        lines.append(f"| {w} | {one[w]:.1f} | " + " | ".join(f"{f['c'][str(r)]:.2f}" for r in cost["rows"]) + " |")
    out = {"formats": {}, "gpu": None}
    for w in cost["formats"]:
        rows = speedups(tau, cost, w, one[w] / one[unit] if unit in one else 1.0)
        out["formats"][w] = rows
        lines += ["", f"**{w}** (drafter {cost['formats'][w]['drafter_dtype']}): speedup = τ / (c(B+1) + d), "
                  f"in {w} one-row steps; last column over {unit} plain decoding", "",
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
    return "\n".join(lines) + "\n", out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tau", required=True, help="bench_small_trees tau JSON")
    ap.add_argument("--cost", required=True, help="bench_small_trees cost JSON")
    ap.add_argument("--protocol", nargs="*", default=[], help="dartree bench results JSONs (τ at other budgets)")
    ap.add_argument("--gpu-draft", type=float, default=0.15, help="assumed draft cost of the memory-bound model (steps)")
    ap.add_argument("--out", default=None, help="write the markdown report here")
    a = ap.parse_args(argv)
    text, out = report(load_tau(a.tau), json.loads(Path(a.cost).read_text()), load_protocol(a.protocol), a.gpu_draft)
    print(text)
    if a.out:
        Path(a.out).write_text(text)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
