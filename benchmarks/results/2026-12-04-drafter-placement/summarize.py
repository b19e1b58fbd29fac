"""Pooled and per-run ratios of an A/B of ``bench_small_trees http`` runs named ``rN-ARM.json`` in DIR
(``python summarize.py DIR``; the drafter-placement and compiled-steps A/Bs)."""
import glob
import json
import statistics
import sys

runs = {}
for f in sorted(glob.glob(sys.argv[1] + "/r*-*.json")):
    name = f.split("/")[-1][:-5]
    runs[name] = d = json.load(open(f))
    print(name, "  ".join(f"{ds} {d['groups'][ds + ' pass all']['ratio']:.3f} (ar {d['groups'][ds + ' pass all']['tokens_per_s_ar']:.1f},"
                          f" tau {d['groups'][ds + ' pass all']['tau']})" for ds in d["datasets"]),
          "same", sum(r["same_tokens"] for r in d["rows"]), "/", len(d["rows"]))
for arm in dict.fromkeys(n.split("-", 1)[1] for n in runs):  # the arms, as the files name them
    sel = [d for n, d in runs.items() if n.endswith("-" + arm)]
    for ds in ("mt-bench", "gsm8k", "sharegpt"):
        rows = [r for d in sel for r in d["rows"] if r["dataset"] == ds]
        spec = sum(r["spec"]["tokens"] for r in rows) / sum(r["spec"]["seconds"] for r in rows)
        ar = sum(r["ar"]["tokens"] for r in rows) / sum(r["ar"]["seconds"] for r in rows)
        paired = statistics.median(r["spec"]["tokens_per_s"] / r["ar"]["tokens_per_s"] for r in rows)
        per_run = " / ".join(f"{d['groups'][ds + ' pass all']['ratio']:.3f}" for d in sel)
        phases = {}
        for d in sel:
            for k, v in d["groups"][ds + " pass all"]["ms_per_round"]["spec"].items():
                phases.setdefault(k, []).append(v)
        ph = ", ".join(f"{k} {statistics.mean(v):.2f}" for k, v in phases.items() if k in ("draft", "tree_build", "ipc", "draft_wait", "verify", "outside"))
        print(f"{arm:8s} {ds:9s} pooled {spec / ar:.3f}x  paired median {paired:.3f}  spec {spec:.1f} ar {ar:.1f} tok/s"
              f"  runs {per_run}  ms/round: {ph}")
