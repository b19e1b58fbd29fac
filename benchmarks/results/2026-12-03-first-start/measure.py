"""Ready time, start-up phases and resident memory of a default ``dartree serve``, idle and under 8 streams.

Starts ``.venv/bin/dartree serve`` (only the ports given), polls ``/health/ready`` every 0.1 s, reads
the start-up phase and memory lines from its log, samples RSS / USS / PSS of every process of the
server (supervisor, gateway, verifier, drafter, multiprocessing's resource tracker) idle, then while
``--streams`` chat requests stream at once (each a different ~``--prompt-tokens``-token document from
``docs/``, ``max_tokens`` ``--max-tokens``, temperature 0), then stops the server with SIGINT (its
pid) and writes one JSON.

    python benchmarks/results/2026-12-03-first-start/measure.py --label restart --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))  # services.models.registry (cache root)
PHASE_RE = re.compile(r"start-up (\w+): (.+) ([0-9.]+) s$")
MEM_RE = re.compile(r"resident memory (\w+): (.+)$")


def role(p: psutil.Process, supervisor: int) -> str:
    """``supervisor``, ``gateway``, ``verifier``, ``drafter``, ``resource_tracker`` or the command line."""
    if p.pid == supervisor:
        return "supervisor"
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return "gone"
    for name in ("gateway", "verifier", "drafter"):  # the kernel keeps 15 characters of a process title
        if f"dartree-{name}" in cmd or f"dartree-{name}"[:15] == p.name()[:15]:
            return name
    if "resource_tracker" in cmd:
        return "resource_tracker"
    return cmd[:60]


def snapshot(supervisor: int) -> dict[str, dict[str, float]]:
    """``{role: {"rss_mb", "uss_mb", "pss_mb"}}`` of the supervisor and all its descendants."""
    out = {}
    try:
        root = psutil.Process(supervisor)
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            m = p.memory_full_info()
        except psutil.Error:
            continue
        name = role(p, supervisor)
        if name in out:
            name = f"{name}-{p.pid}"
        out[name] = {"pid": p.pid, "rss_mb": m.rss / 2**20, "uss_mb": m.uss / 2**20, "pss_mb": m.pss / 2**20}
    return out


def totals(snap: dict) -> dict[str, float]:
    return {k: round(sum(v[k] for v in snap.values()), 1) for k in ("rss_mb", "uss_mb", "pss_mb")}


def prompts(n: int, tokens: int) -> list[dict]:
    """``n`` distinct documents of ``docs/`` cut to ``tokens`` tokens each (the served target's tokenizer)."""
    from tokenizers import Tokenizer

    from services.models.registry import cache_root

    tok = Tokenizer.from_file(str(cache_root() / "smollm2-135m-instruct" / "tokenizer.json"))
    texts = []
    for f in sorted((REPO / "docs").glob("*.md")):
        ids = tok.encode(f.read_text()).ids
        if len(ids) >= tokens:
            texts.append((f.name, tok.decode(ids[:tokens])))
    while len(texts) < n:  # too few long documents: two halves of different ones
        texts.append((f"{texts[0][0]}+{texts[-1][0]}", texts[-1][1][: len(texts[-1][1]) // 2] + texts[0][1][len(texts[0][1]) // 2:]))
    return [{"source": name, "messages": [{"role": "user", "content": "Summarise this document in one paragraph.\n\n" + text}]}
            for name, text in texts[:n]]


def stream_one(url: str, body: dict, out: list, i: int) -> None:
    t0 = time.perf_counter()
    first, usage, chunks = None, None, 0
    with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            if ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                chunks += 1
                first = first or time.perf_counter() - t0
    out[i] = {"ttft_s": first, "total_s": time.perf_counter() - t0, "usage": usage, "chunks": chunks}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=18700)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=None, help="sent as min_tokens (long generations past EOS)")
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--after-load-s", type=float, default=0.0,
                    help="seconds between the last stream and the after-load sample (the verifier trims its heap after 1 s idle)")
    ap.add_argument("--serve-flag", action="append", default=[], help="extra dartree serve flag (repeatable)")
    args = ap.parse_args()
    port = args.port
    cmd = [str(REPO / ".venv/bin/dartree"), "serve", "--port", str(port), "--verifier-metrics-port", str(port + 1),
           "--drafter-metrics-port", str(port + 2), *args.serve_flag]
    log_path = Path(args.out).with_suffix(".log")
    url = f"http://127.0.0.1:{port}"
    result: dict = {"label": args.label, "command": " ".join(cmd[1:]), "load_before": os.getloadavg()}
    with open(log_path, "w") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            ready = None
            while proc.poll() is None and time.monotonic() - t0 < 600:
                try:
                    if httpx.get(url + "/health/ready", timeout=1).status_code == 200:
                        ready = time.monotonic() - t0
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            result["ready_s"] = ready
            if ready is None:
                raise SystemExit(f"not ready (exit code {proc.poll()}); see {log_path}")
            time.sleep(args.idle_s)
            result["idle"] = snapshot(proc.pid)
            result["idle_total"] = totals(result["idle"])
            bodies = [{"model": "smollm2-135m-instruct", "messages": p["messages"], "max_tokens": args.max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                       **({"min_tokens": args.min_tokens} if args.min_tokens else {})}
                      for p in prompts(args.streams, args.prompt_tokens)]
            result["prompt_sources"] = [p["source"] for p in prompts(args.streams, args.prompt_tokens)]
            outs: list = [None] * len(bodies)
            threads = [threading.Thread(target=stream_one, args=(url, b, outs, i)) for i, b in enumerate(bodies)]
            peak: dict = {}
            peak_total = {"rss_mb": 0.0, "uss_mb": 0.0, "pss_mb": 0.0}
            t_load = time.perf_counter()
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                snap = snapshot(proc.pid)
                for k, v in snap.items():
                    if v["rss_mb"] > peak.get(k, {}).get("rss_mb", 0):
                        peak[k] = v
                tot = totals(snap)
                peak_total = {k: max(peak_total[k], tot[k]) for k in tot}
                time.sleep(0.25)
            for t in threads:
                t.join()
            result["load_s"] = time.perf_counter() - t_load
            result["streams"] = outs
            result["serving_peak"] = peak
            result["serving_peak_total"] = peak_total
            time.sleep(args.after_load_s)
            result["after_load"] = snapshot(proc.pid)
            result["after_load_total"] = totals(result["after_load"])
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    result["load_after"] = os.getloadavg()
    text = log_path.read_text()
    result["phases"] = [m.groups() for line in text.splitlines() if (m := PHASE_RE.search(line))]
    result["memory_lines"] = [m.group(0) for line in text.splitlines() if (m := MEM_RE.search(line))]
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result.get(k) for k in ("label", "ready_s", "idle_total", "serving_peak_total")}))
    for ph in result["phases"]:
        print("  phase", *ph)
    for k, v in result["idle"].items():
        print(f"  idle {k:18s} rss {v['rss_mb']:7.1f} uss {v['uss_mb']:7.1f} pss {v['pss_mb']:7.1f}")
    for k, v in result["serving_peak"].items():
        print(f"  peak {k:18s} rss {v['rss_mb']:7.1f} uss {v['uss_mb']:7.1f} pss {v['pss_mb']:7.1f}")
    for s in result["streams"]:
        print("  stream", s and {"ttft_s": round(s["ttft_s"] or 0, 2), "total_s": round(s["total_s"], 2),
                                 "usage": s["usage"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
