"""Per-process memory table (markdown) of ``measure.py`` JSONs: idle, serving peak, after the load.

    python table.py before.json after.json ...
"""

from __future__ import annotations

import json
import sys

ORDER = ("supervisor", "resource_tracker", "forkserver", "gateway", "verifier", "drafter")


def rows(path: str) -> tuple[str, dict, dict]:
    d = json.load(open(path))
    procs: dict = {}
    for phase in ("idle", "serving_peak", "after_load"):
        for name, v in d[phase].items():
            key = "forkserver" if "multiprocessing.fork" in name else name
            procs.setdefault(key, {})[phase] = v
    return d["label"], procs, d


def main() -> None:
    print("| process | run | idle RSS | idle USS | idle PSS | peak RSS | peak USS | peak PSS | after-load PSS |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    runs = [rows(p) for p in sys.argv[1:]]
    for name in ORDER:
        for label, procs, _ in runs:
            v = procs.get(name, {})
            cells = [f"{v[ph][k]:,.0f}" if ph in v else "" for ph, k in (
                ("idle", "rss_mb"), ("idle", "uss_mb"), ("idle", "pss_mb"), ("serving_peak", "rss_mb"),
                ("serving_peak", "uss_mb"), ("serving_peak", "pss_mb"), ("after_load", "pss_mb"))]
            print(f"| {name} | {label} | " + " | ".join(cells) + " |")
    for label, _, d in runs:
        t = [d["idle_total"], d["serving_peak_total"], d["after_load_total"]]
        print(f"| **total** | {label} | {t[0]['rss_mb']:,.0f} | {t[0]['uss_mb']:,.0f} | **{t[0]['pss_mb']:,.0f}** | "
              f"{t[1]['rss_mb']:,.0f} | {t[1]['uss_mb']:,.0f} | **{t[1]['pss_mb']:,.0f}** | {t[2]['pss_mb']:,.0f} |")
    print()
    print("| run | ready | 8 streams took | load average before / after |")
    print("|---|---:|---:|---|")
    for label, _, d in runs:
        print(f"| {label} | {d['ready_s']:.1f} s | {d['load_s']:.0f} s | "
              f"{d['load_before'][0]:.2f} / {d['load_after'][0]:.2f} |")


if __name__ == "__main__":
    main()
