"""Streams 8 ~2,000-token chat requests (measure.py's prompts) at a running server and samples the
verifier's and drafter's memory by mapping kind (smaps_parts.py) every 0.5 s; prints the peak
sample, every 10th sample and the parts after the load; writes the samples to a JSON.

    python drive_series.py http://127.0.0.1:PORT series.json
"""
import importlib.util, json, sys, threading, time, psutil
sys.path.insert(0, "benchmarks/results/2026-12-03-serving-memory")
from smaps_parts import parts
spec = importlib.util.spec_from_file_location("measure", "benchmarks/results/2026-12-03-first-start/measure.py")
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
url = sys.argv[1]
pids = {p.info["name"][8:11]: p.pid for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("dartree-") and p.info["name"][8:11] in ("ver", "dra")}
bodies = [{"model": "smollm2-135m-instruct", "messages": p["messages"], "max_tokens": 64, "temperature": 0, "stream": True}
          for p in m.prompts(8, 2000)]
outs = [None] * 8
th = [threading.Thread(target=m.stream_one, args=(url, b, outs, i)) for i, b in enumerate(bodies)]
t0 = time.monotonic()
for t in th: t.start()
series = []
while any(t.is_alive() for t in th):
    row = {"t": round(time.monotonic() - t0, 1)}
    for k, pid in pids.items():
        d = parts(pid, 0)
        row[k] = {kk: v["rss_mb"] for kk, v in d.items() if kk in ("heap", "anon_large", "arena")}
        row[k]["total"] = round(sum(v["rss_mb"] for v in d.values()))
    series.append(row); time.sleep(0.5)
peak = max(series, key=lambda r: r["ver"]["total"] + r["dra"]["total"])
print("peak", peak)
for r in series[::10]: print(r)
print("after", {k: {kk: v["rss_mb"] for kk, v in parts(pid, 0).items()} for k, pid in pids.items()})
json.dump(series, open(sys.argv[2], "w"))
