"""CPU time per streamed token of every thread of the default ``dartree serve``, and the verifier's
own round timers, over 8 plain-decoding (``ar``) requests of 128 tokens at c = 1.

    python benchmarks/results/2026-12-05-serving-overhead/cpu_per_token.py [--out-dir DIR] [--py-spy PATH]
        [-- extra dartree serve flags]

Per thread: (utime + stime) from ``/proc/<pid>/task/<tid>/stat`` before and after the requests,
divided by the tokens streamed. Round timers: the verifier's Prometheus counters
(``dartree_round_seconds_sum{phase=...}``) before and after, per round. With ``--py-spy`` a
``py-spy record --nonblocking -f raw`` of the verifier (or ``--spy-thread dartree-gateway``) runs
during the requests and its raw stacks go to ``DIR/<thread>.raw``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks/results/2026-12-04-ar-vs-llamacpp"))

from ab_http import chat_prompts, stream, wait_ready  # noqa: E402
from services.runtime import free_loopback_ports  # noqa: E402


def tree(pid: int) -> list[int]:
    out = [pid]
    for c in glob.glob(f"/proc/{pid}/task/*/children"):
        for x in open(c).read().split():
            out += tree(int(x))
    return out


def snap(root: int) -> dict:
    res = {}
    for pid in tree(root):
        for t in glob.glob(f"/proc/{pid}/task/*"):
            try:
                st = open(t + "/stat").read()
            except OSError:
                continue
            name = st[st.index("(") + 1:st.rindex(")")]
            f = st[st.rindex(")") + 2:].split()
            res[(pid, int(t.split("/")[-1]), name)] = int(f[11]) + int(f[12])
    return res


def counters(text: str) -> dict:
    d = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        k, v = line.rsplit(" ", 1)
        try:
            d[k] = float(v)
        except ValueError:
            pass
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent))
    ap.add_argument("--py-spy", help="path of a py-spy binary: record the thread below during the requests")
    ap.add_argument("--spy-thread", default="dartree-verifie", help="thread name (15 characters) of the process to record")
    ap.add_argument("serve_args", nargs="*")
    a = ap.parse_args()
    prompts = [text for _, _, text in chat_prompts(["gsm8k", "mt-bench"], 4)]
    port, vport, dport = free_loopback_ports(3)
    out = Path(a.out_dir)
    p = subprocess.Popen([sys.executable, "-m", "services.serve", "--port", str(port), "--verifier-metrics-port",
                          str(vport), "--drafter-metrics-port", str(dport), *a.serve_args],
                         stdout=open(out / "cpu-serve.log", "w"), stderr=subprocess.STDOUT, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    wait_ready(p, base + "/health/ready", "cpu-serve.log")

    try:
        with httpx.Client(timeout=600) as c:
            stream(c, base, prompts[0], 16, True)
            m0 = counters(httpx.get(f"http://127.0.0.1:{vport}/metrics").text)
            before = snap(p.pid)
            spy = None
            if a.py_spy:
                pid = next(k[0] for k in before if k[2].startswith(a.spy_thread))
                spy = subprocess.Popen([a.py_spy, "record", "-p", str(pid), "-d", "7", "-r", "400", "--nonblocking",
                                        "-f", "raw", "-o", str(out / f"{a.spy_thread}.raw")],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            total, rates = 0, []
            for t in prompts:
                r = stream(c, base, t, 128, True)  # "ar", tokens counted by return_token_ids
                total += r["tokens"]
                rates.append(r["decode_tokens_per_s"])
            after = snap(p.pid)
            if spy:
                spy.wait()
            m1 = counters(httpx.get(f"http://127.0.0.1:{vport}/metrics").text)
        hz = os.sysconf("SC_CLK_TCK")
        print(f"tokens {total}, decode tokens/s median {sorted(rates)[len(rates) // 2]:.1f}")
        for k, v in after.items():
            d = (v - before.get(k, 0)) / hz
            if d > 0.005:
                print(f"  pid {k[0]} thread {k[2]:16s} cpu {d:6.2f} s = {d / total * 1e3:5.2f} ms a token")
        rounds = m1.get('dartree_round_seconds_count{phase="total"}', 0) - m0.get('dartree_round_seconds_count{phase="total"}', 0)
        for phase in ("verify", "draft_wait", "commit", "total"):
            key = f'dartree_round_seconds_sum{{phase="{phase}"}}'
            if rounds and key in m1:
                print(f"  round {phase:10s} {(m1[key] - m0.get(key, 0)) / rounds * 1e3:6.3f} ms")
    finally:
        p.terminate()
        p.wait(60)


if __name__ == "__main__":
    main()
