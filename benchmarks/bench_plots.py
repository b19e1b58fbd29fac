"""Figures of ``dartree bench`` (matplotlib, Agg backend, PNG), numbered as in the paper.

Every function takes the aggregated results dict (see ``benchmarks.bench``) and an output
directory, writes at most one PNG, and returns its file name (``None`` when there is no data).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PHASE_COLORS = {"draft": "#4c72b0", "tree_build": "#dd8452", "verify": "#55a868", "commit": "#c44e52"}
ACCEPT_COLOR, NODE_COLOR = "#2ca02c", "#dbe5f1"


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def fig_speedup(res: dict, out: Path) -> str | None:
    """Fig. 2: speedup over ``ar`` per dataset per method, one panel per temperature."""
    tabs = {t: tab for t, tab in res.get("table1", {}).items()}
    if not tabs:
        return None
    dss = list(res["config"]["datasets"]) + ["mean"]
    fig, axes = plt.subplots(len(tabs), 1, figsize=(max(8, 1.4 * len(dss) + 3), 3.6 * len(tabs)), squeeze=False)
    for ax, (t, tab) in zip(axes[:, 0], tabs.items()):
        methods = [m for m, per in tab.items() if m != "ar" and any(per[d].get("speedup") for d in dss)]
        w = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            ys = [tab[m][d].get("speedup") or 0.0 for d in dss]
            ax.bar([j + i * w - 0.4 + w / 2 for j in range(len(dss))], ys, w, label=m)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(dss)), dss)
        ax.set_ylabel("speedup over ar (×)")
        ax.set_title(f"Speedup per dataset, T = {t}")
        if methods:
            ax.legend(fontsize=7, ncol=min(5, len(methods)))
    return _save(fig, out, "fig2_speedup.png")


def fig_round_breakdown(res: dict, out: Path) -> str | None:
    """Fig. 1a: mean wall time of one round per method, stacked draft / tree_build / verify / commit."""
    rb = res.get("round_breakdown", {})
    t = next(iter(rb), None)
    if t is None or not rb[t]:
        return None
    methods = list(rb[t])
    fig, ax = plt.subplots(figsize=(max(6, 1.0 * len(methods) + 2), 4))
    bottom = [0.0] * len(methods)
    for p, c in PHASE_COLORS.items():
        ys = [rb[t][m].get(p, {}).get("mean_ms", 0.0) for m in methods]
        if not any(ys) and p != "verify":
            continue
        ax.bar(methods, ys, bottom=bottom, color=c, label=p)
        bottom = [b + y for b, y in zip(bottom, ys)]
    rest = [max(0.0, rb[t][m].get("total", {}).get("mean_ms", 0.0) - b) for m, b in zip(methods, bottom)]
    if any(r > 1e-3 for r in rest):
        ax.bar(methods, rest, bottom=bottom, color="#bbbbbb", hatch="//", label="other / unsplit (HF peers)")
    ax.set_ylabel("ms per round")
    ax.set_title(f"Latency breakdown of one round (T = {t}, pooled over datasets)")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8)
    return _save(fig, out, "fig1a_round_breakdown.png")


def _sweep_panel(ax, pts: list[dict], key: str, label: str) -> None:
    timed = any(p.get("speedup") for p in pts)  # --tau-replay sweeps have τ only: no empty speedup axis
    ax2 = ax.twinx() if timed else None
    for i, m in enumerate(sorted({p["method"] for p in pts})):
        ps = sorted((p for p in pts if p["method"] == m), key=lambda p: p["knobs"][key])
        xs = [p["knobs"][key] for p in ps]
        c = f"C{i}"
        ax.plot(xs, [p.get("tau") or float("nan") for p in ps], "o-", color=c, label=f"{m} τ")
        if ax2 is not None:
            ax2.plot(xs, [p.get("speedup") or float("nan") for p in ps], "s--", color=c, label=f"{m} speedup")
    ax.set_xlabel(label)
    ax.set_ylabel("τ (solid)" if timed else "τ (replayed, no timing)")
    h1, l1 = ax.get_legend_handles_labels()
    if ax2 is not None:
        ax2.set_ylabel("speedup × (dashed)")
        h2, l2 = ax2.get_legend_handles_labels()
        h1, l1 = h1 + h2, l1 + l2
    ax.legend(h1, l1, fontsize=7)


def fig_sweeps(res: dict, out: Path, keys: tuple[tuple[str, str], ...], name: str, title: str) -> str | None:
    """Figs. 4 / 6: τ and speedup vs one knob per panel (knobs named in ``keys``)."""
    sw = res.get("sweeps", {})
    panels = [(k, lbl) for k, lbl in keys if sw.get(k)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (k, lbl) in zip(axes[0], panels):
        _sweep_panel(ax, sw[k], k, lbl)
        ax.set_title(f"{title}: vs {lbl}")
    return _save(fig, out, name)


def fig_acceptance(res: dict, out: Path) -> str | None:
    """Fig. 5: position-wise acceptance ``Pr(L >= t)`` per method, one panel per temperature."""
    acc = res.get("acceptance", {})
    if not any(acc.values()):
        return None
    fig, axes = plt.subplots(1, len(acc), figsize=(5.5 * len(acc), 4), squeeze=False)
    for ax, (t, per) in zip(axes[0], acc.items()):
        n = max([2] + [len(c) + 1 for c in per.values()])  # pad with the zeros beyond the longest accept
        for m, curve in per.items():
            if curve:
                ys = list(curve) + [0.0] * (n - len(curve))
                ax.plot(range(1, n + 1), ys, "o-", ms=3, label=m)
        ax.set_xlabel("draft depth t")
        ax.set_ylabel("Pr(L ≥ t)")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"Position-wise acceptance, T = {t}")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return _save(fig, out, "fig5_acceptance.png")


def fig_depth(res: dict, out: Path, methods=("ddtree", "dartree-pruned")) -> str | None:
    """Fig. 7: node-depth distribution of verification trees, DDTree vs DARTree."""
    dd = {m: v for m, v in res.get("depth_fraction", {}).items() if m in methods and v}
    if not dd:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.8 / len(dd)
    for i, (m, frac) in enumerate(dd.items()):
        xs = [int(k) for k in frac]
        ax.bar([x + i * w - 0.4 + w / 2 for x in xs], list(frac.values()), w, label=m)
    ax.set_xlabel("node depth")
    ax.set_ylabel("fraction of tree nodes")
    ax.set_title("Node-depth distribution of verification trees (T = 0)")
    ax.legend()
    return _save(fig, out, "fig7_depth_distribution.png")


def _layout(parents: list[int]) -> tuple[list[float], float]:
    """y of every node (leaves consecutive in DFS order, parents centred) and of the root."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    ys: dict[int, float] = {}
    nxt = [0.0]

    def place(n: int) -> float:
        kids = children.get(n, [])
        if not kids:
            ys[n] = nxt[0]
            nxt[0] += 1
        else:
            ys[n] = sum(place(k) for k in kids) / len(kids)
        return ys[n]

    root_y = place(-1)
    return [ys[i] for i in range(len(parents))], root_y


def _label(text: str, limit: int = 9) -> str:
    s = text.replace("\n", "\\n").replace("\t", "\\t").replace(" ", "␣")
    s = s.replace("$", r"\$")
    return (s[:limit] + "…") if len(s) > limit else s


def fig_tree(rec: dict, title: str, out: Path, name: str) -> str | None:
    """Figs. 8-11: one verification tree laid out by depth, accepted path in green, token text on nodes."""
    parents, depths = rec["parents"], rec["depths"]
    if not parents:
        return None
    ys, root_y = _layout(parents)
    leaves = max(ys) + 1 if ys else 1
    maxd = max(depths)
    fig, ax = plt.subplots(figsize=(min(40, max(8.0, 1.25 * (maxd + 1) + 1)), min(30, 0.3 * leaves + 1.5)))
    acc = set(rec.get("accepted_nodes", []))
    for i, p in enumerate(parents):
        px, py = (0, root_y) if p < 0 else (depths[p], ys[p])
        on = i in acc and (p < 0 or p in acc)
        ax.plot([px, depths[i]], [py, ys[i]], color=ACCEPT_COLOR if on else "#999999", lw=2.2 if on else 0.7,
                zorder=1)
    box = dict(boxstyle="round,pad=0.25", lw=0.6)
    ax.text(0, root_y, _label(rec["root_text"]), ha="center", va="center", fontsize=7, zorder=2,
            bbox={**box, "fc": "#fff2cc", "ec": "k"})
    for i, t in enumerate(rec["texts"]):
        ax.text(depths[i], ys[i], _label(t), ha="center", va="center", fontsize=6.5, zorder=2,
                bbox={**box, "fc": "#c7e9c0" if i in acc else NODE_COLOR, "ec": ACCEPT_COLOR if i in acc else "#666"})
    path = rec.get("accepted_nodes", [])
    acc_txt = " ".join(repr(rec["texts"][i]) for i in path) or "(none)"
    bonus_txt = repr(rec.get("bonus_text")) if rec.get("bonus") is not None else "n/a"
    ax.set_xlim(-0.7, maxd + 0.7)
    ax.set_ylim(-1, leaves)
    ax.invert_yaxis()
    ax.set_xticks(range(maxd + 1))
    ax.set_xlabel("depth (0 = root, the last committed token)")
    ax.set_yticks([])
    for s in ("top", "right", "left"):
        ax.spines[s].set_visible(False)
    ax.set_title(f"{title}: {len(parents)} nodes, τ = {len(path) + 1}\naccepted (green): {_label(acc_txt, 80)}"
                 f"; bonus: {_label(bonus_txt, 20)}", fontsize=9)
    return _save(fig, out, name)


def make_figures(res: dict, examples: dict[str, list[dict]], out: Path) -> list[str]:
    """Write every figure there is data for; return their file names."""
    out.mkdir(parents=True, exist_ok=True)
    names = [fig_speedup(res, out), fig_round_breakdown(res, out),
             fig_sweeps(res, out, (("width", "width W"), ("budget", "budget B")), "fig4_sweep_width_budget.png",
                        "DARTree-pruned"),
             fig_acceptance(res, out),
             fig_sweeps(res, out, (("depth_bonus", "depth bonus β"), ("candidates", "candidate cap K")),
                        "fig6_sweep_beta_candidates.png", "DARTree-pruned"),
             fig_depth(res, out)]
    labels = {"ddtree": "DDTree", "dartree-pruned": "DARTree-pruned"}
    n = 8
    for m in ("ddtree", "dartree-pruned"):
        ex = examples.get(m) or []
        if ex:
            rec = ex[0]
            names.append(fig_tree(rec, f"{labels[m]} verification tree ({rec.get('where', '')}, round {rec['round']})",
                                  out, f"fig{n}_tree_{m}.png"))
            n += 1
    return [x for x in names if x]
