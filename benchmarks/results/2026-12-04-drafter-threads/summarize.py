import json, glob, statistics, sys
rows = {}
for f in sorted(glob.glob(sys.argv[1] + "/r*-threads*.json")):
    d = json.load(open(f)); name = f.split("/")[-1][:-5]
    rows[name] = d
    print(name, "  ".join(f"{ds} {d['groups'][ds + ' pass all']['ratio']:.3f} (ar {d['groups'][ds + ' pass all']['tokens_per_s_ar']:.1f}, tau {d['groups'][ds + ' pass all']['tau']})" for ds in d["datasets"]),
          "same", sum(r["same_tokens"] for r in d["rows"]), "/", len(d["rows"]))
for th in (1, 2):
    for ds in ("mt-bench", "gsm8k", "sharegpt"):
        sel = [d for n, d in rows.items() if n.endswith(f"threads{th}")]
        spec = sum(r["spec"]["tokens"] for d in sel for r in d["rows"] if r["dataset"] == ds)
        ss = sum(r["spec"]["seconds"] for d in sel for r in d["rows"] if r["dataset"] == ds)
        ar = sum(r["ar"]["tokens"] for d in sel for r in d["rows"] if r["dataset"] == ds)
        sa = sum(r["ar"]["seconds"] for d in sel for r in d["rows"] if r["dataset"] == ds)
        paired = statistics.median(r["spec"]["tokens_per_s"] / r["ar"]["tokens_per_s"] for d in sel for r in d["rows"] if r["dataset"] == ds)
        print(f"threads {th} {ds:9s} pooled {spec/ss/(ar/sa):.3f}x  paired median {paired:.3f}  spec {spec/ss:.1f} ar {ar/sa:.1f} tok/s  runs {len(sel)}")
