"""The outputs of ``gpu_check``: the PNG (round time per phase; predicted speedup per budget), the
human table, the environment and the JSON's ``skipped`` lines."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch

from benchmarks.gpu_check.engines import PHASES

REPO = Path(__file__).resolve().parents[2]
COLORS = {"draft": "tab:blue", "tree_build": "tab:orange", "verify": "tab:green", "commit": "tab:red",
          "other": "tab:gray"}


def plot(cells: list[dict], predicted: list[dict], path: Path, title: str) -> str | None:
    """Two rows of panels, one column per shape: stacked bars of the phases per (method, B), and the
    predicted speedup against B per τ source and data set; returns why no PNG was written
    (matplotlib missing), else None."""
    try:
        import matplotlib
    except ImportError as e:
        return f"png: matplotlib cannot be imported ({e})"

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(c["shape"] for c in cells)) or ["-"]
    fig, axes = plt.subplots(2, len(names), figsize=(6 * len(names), 8.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        _phase_bars(ax, [c for c in cells if c["shape"] == name and c.get("status") == "ok"], name)
    for ax, name in zip(axes[1], names):
        _speedup_lines(ax, [p for p in predicted if p["shape"] == name and p["speedup"] is not None], name)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _phase_bars(ax, ok: list[dict], name: str) -> None:
    labels = [_label(c) + (f"\nB={c['budget']}" if c["budget"] else "") for c in ok]
    bottom = [0.0] * len(ok)
    for p in ("draft", "tree_build", "verify", "commit", "other"):
        vals = [c["phase_ms"]["round"] - sum(c["phase_ms"][q] for q in PHASES[:4]) if p == "other"
                else c["phase_ms"][p] for c in ok]
        vals = [max(0.0, v) for v in vals]
        ax.bar(range(len(ok)), vals, bottom=bottom, color=COLORS[p], label=p)
        bottom = [x + v for x, v in zip(bottom, vals)]
    ax.set_xticks(range(len(ok)), labels, fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("ms per round")
    ax.set_title(name)
    ax.legend(fontsize=7)


def _speedup_lines(ax, rows: list[dict], name: str) -> None:
    for key in dict.fromkeys((r["source"], r["dataset"]) for r in rows):
        pts = sorted((r["budget"], r["speedup"]) for r in rows if (r["source"], r["dataset"]) == key)
        ax.plot([b for b, _ in pts], [s for _, s in pts], marker="o", label=f"{key[0]}: {key[1]}")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    budgets = sorted({r["budget"] for r in rows})
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("tree budget B")
    ax.set_ylabel("predicted speedup (c = 1)")
    ax.set_title(f"{name}: tau x t_step(1 row) / t_round(B)" if rows else f"{name}: no prediction")
    if rows:
        ax.legend(fontsize=6)



def _label(cell: dict) -> str:
    return cell.get("method", "-") + ("+graphs" if cell.get("graphs") else "")


def env_info(device: str) -> dict:
    """Python, torch, transformers and CUDA versions, the device (and GPU name), the git commit."""
    from importlib import metadata

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": metadata.version("transformers"), "cuda": torch.version.cuda, "device": device,
            "torch_threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                     text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["git"] = None
    return info


def print_table(res: dict) -> None:
    """The human table: one line per cell, per graph probe, per verify-curve point, per prediction,
    per served run, and the tests' summary."""
    cells, probes, curves, tests = res["breakdown"], res["graph_probe"], res["verify_curve"], res["tests"]
    print(f"{'shape':<14}{'method':<23}{'B':>4}{'draft':>8}{'build':>8}{'verify':>8}{'commit':>8}{'round':>8}")
    for c in cells:
        if c.get("status") != "ok":
            print(f"{c['shape']:<14}{_label(c):<23}{c.get('budget') or '-':>4}  {c['status']}: "
                  f"{c.get('error', '')}")
            continue
        ph = c["phase_ms"]
        print(f"{c['shape']:<14}{_label(c):<23}{c['budget'] or '-':>4}"
              + "".join(f"{ph[p]:8.2f}" for p in PHASES))
    for p in probes:
        print(f"graph probe {p['shape']} rows={p['rows']}: eager {p.get('eager_ms', float('nan')):.2f} ms, "
              f"graph {p.get('graph_ms') if p.get('graph_ms') is None else round(p['graph_ms'], 2)} ms "
              f"{p.get('error', '')}")
    for c in curves:
        print(f"verify {c['shape']} {c['mode']:<15} rows={c.get('rows', '-')}: " + (
            f"{c['ms']:.2f} ms ({c['ratio_to_one_row']:.2f}x one row), vs dense {c['max_abs_diff_vs_dense']}"
            if c.get("status") == "ok" else f"{c.get('status', 'error')}: {c.get('error', '')}"))
    for p in res["predicted"]["speedup"]:
        if p["speedup"] is not None:
            print(f"predicted {p['shape']} {p['source']}:{p['dataset']} B={p['budget']}: tau {p['tau']:.2f}, "
                  f"round {p['t_round_ms']:.2f} ms vs step {p['t_step1_ms']:.2f} ms -> {p['speedup']:.2f}x")
    for r in res["served"].get("runs", []):
        print(f"served ({'mps' if r['mps'] else 'no mps'}, {r['transport']}): {r['status']}, ready in "
              f"{r.get('ready_s', float('nan')):.1f} s, {r.get('equal', 0)}/{r['concurrent']} streams equal ar "
              + (f"{r.get('error', '')}" if r["status"] == "error" else ""))
    print(f"tests: {tests.get('summary', tests['status'])}")


def skipped_parts(res: dict, png_skip: str | None) -> list[str]:
    """What did not run, one line each with its reason (the JSON's ``skipped``)."""
    from benchmarks.gpu_check.compat import skipped_lines

    tests, served = res["tests"], res["served"]
    out = [] if tests["status"] != "not run" else ["tests: --no-tests"]
    if tests["status"] == "skipped":
        out.append(f"tests: {tests.get('summary', 'no test ran')} (no CUDA device)")
    out += skipped_lines(res["compat"])
    out += [f"cell {c['shape']} {_label(c)} B={c.get('budget')}: {c.get('error')}" for c in res["breakdown"]
            if c.get("status") == "skipped"]
    out += [f"verify curve {c['shape']} {c['mode']} rows={c.get('rows')}: {c.get('error')}"
            for c in res["verify_curve"] if c.get("status") == "skipped"]
    out += [f"predicted speedup, {name} tau: {src['reason']}" for name, src in res["predicted"]["tau_sources"].items()
            if src["status"] != "ok"]
    if served["status"] == "not run":
        out.append(f"served: {served['reason']}")
    elif served.get("mps", {}).get("status") not in (None, "measured"):
        out.append(f"mps: {served['mps']['status']} ({served['mps'].get('reason', '')})")
    return out + ([png_skip] if png_skip else [])
