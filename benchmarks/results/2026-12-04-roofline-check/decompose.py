"""Each fixed setting's verify and draft, measured in the e2e run (engine step timings) next to the
cost sweep's c(B + 1) and d(B, L), in the same run's `ar` forward / the sweep's one-row forward.

    python decompose.py cost-verify.json e2e-q4.json e2e-bfloat16.json
"""
import json
import sys

cost = json.load(open(sys.argv[1]))
print("| format | setting | τ (run) | c(B+1) run / sweep | d run / sweep | e (ms) |")
print("|---|---|---:|---:|---:|---:|")
for path in sys.argv[2:]:
    e2e = json.load(open(path))
    f = cost["formats"][e2e["weights"]]
    ar = e2e["settings"]["ar"]["step_ms"]
    for label, m in e2e["settings"].items():
        if not label.startswith("fixed"):
            continue
        b, block = (int(x.split("=")[1]) for x in label.split()[1:3])
        st = m["step_ms"]
        c_run, d_run = st["forward"] / ar["forward"], st["draft_wait"] / ar["forward"]
        c_sw, d_sw = f["c"][str(b + 1)], f["draft"][f"{b}/{block}"]["d"]
        print(f"| {e2e['weights']} | {label} | {m['tau']:.2f} | {c_run:.2f} / {c_sw:.2f} | {d_run:.2f} / {d_sw:.2f} "
              f"| {st['other'] - ar['other']:.2f} |")
