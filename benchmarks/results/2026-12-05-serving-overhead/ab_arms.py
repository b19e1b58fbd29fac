"""Plain decoding through HTTP: several ``dartree serve`` arms (each its own environment) and
llama-cpp-python's OpenAI server on the same GGUF, same threads, c = 1, run side by side.

All servers are up at once, each idle while another answers; per prompt the order of the arms
rotates. Each request streams a chat-templated prompt (the same text to every arm) at T = 0 with
``max_tokens``; decode tokens/s = (tokens - 1) / (last - first token time) at the client (TTFT
excluded). Ratios are to llama.cpp: pooled over requests and the median of per-prompt pairs.

    python benchmarks/results/2026-12-05-serving-overhead/ab_arms.py --arm default= \
        --arm spin10k=GOMP_SPINCOUNT=10000 --prompts 8 --passes 2 --out OUT.json

``--arm NAME=VAR=VALUE[,VAR=VALUE]`` (``NAME=`` for the environment as it is; ``VAR=`` unsets VAR).
Needs ``llama-cpp-python[server]`` (``make bench-deps`` and ``pip install starlette-context
pydantic-settings``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks/results/2026-12-04-ar-vs-llamacpp"))

from ab_http import add_common_args, chat_prompts, stop_all, stream, wait_ready  # noqa: E402
from benchmarks.bench_llama import default_gguf  # noqa: E402
from benchmarks.bench_small_trees import _machine  # noqa: E402
from services.runtime import free_loopback_ports  # noqa: E402


def arm_env(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition("=")
    env = dict(os.environ)
    for item in filter(None, rest.split(",")):
        var, _, value = item.partition("=")
        if value:
            env[var] = value
        else:
            env.pop(var, None)
    return name, env


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", action="append", required=True, help="NAME=VAR=VALUE[,VAR=VALUE] (repeatable)")
    add_common_args(ap)  # --serve-args go to every arm
    a = ap.parse_args()
    prompts = chat_prompts(a.datasets, a.prompts)
    arms = [arm_env(s) for s in a.arm]
    out_dir = Path(a.out).resolve().parent
    gguf = default_gguf()
    procs, bases, cmds = [], {}, {}
    try:
        for name, env in arms:
            port, vport, dport = free_loopback_ports(3)
            cmd = [sys.executable, "-m", "services.serve", "--port", str(port), "--verifier-metrics-port", str(vport),
                   "--drafter-metrics-port", str(dport), *a.serve_args.split()]
            t0 = time.monotonic()
            procs.append(subprocess.Popen(cmd, stdout=open(out_dir / f"serve-{name}.log", "w"),
                                          stderr=subprocess.STDOUT, cwd=REPO, env=env))
            wait_ready(procs[-1], f"http://127.0.0.1:{port}/health/ready", f"serve-{name}.log")
            print(f"{name}: ready in {time.monotonic() - t0:.0f} s", flush=True)
            bases[name], cmds[name] = f"http://127.0.0.1:{port}", " ".join(cmd[1:])
        (lport,) = free_loopback_ports(1)
        llama_cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", str(a.threads),
                     "--n_threads_batch", str(a.threads), "--n_ctx", "4096", "--port", str(lport), "--host", "127.0.0.1"]
        procs.append(subprocess.Popen(llama_cmd, stdout=open(out_dir / "llama-server.log", "w"),
                                      stderr=subprocess.STDOUT))
        wait_ready(procs[-1], f"http://127.0.0.1:{lport}/v1/models", "llama-server.log")
        bases["llama.cpp"] = f"http://127.0.0.1:{lport}"
        names = list(bases)
        rows = []
        with httpx.Client(timeout=600) as client:
            for name, base in bases.items():  # warm-up
                stream(client, base, prompts[-1][2], 16, name != "llama.cpp")
            k = 0
            for p in range(a.passes):
                for ds, uid, text in prompts:
                    order = names[k % len(names):] + names[:k % len(names)]
                    k += 1
                    r = {}
                    for name in order:
                        time.sleep(0.5)  # the other servers' OpenMP threads back to sleep
                        r[name] = stream(client, bases[name], text, a.max_tokens, name != "llama.cpp")
                        r[name].pop("text")
                    rows.append({"dataset": ds, "uid": uid, "pass": p, "order": order, **r})
                    print(f"pass {p} {ds:9s} {uid[:14]:14s} " + " ".join(
                        f"{n} {r[n]['decode_tokens_per_s']}" for n in names), flush=True)
    finally:
        stop_all(procs)

    def pooled(arm):
        xs = [r[arm] for r in rows if r[arm]["decode_tokens_per_s"]]
        return sum(x["tokens"] - 1 for x in xs) / sum((x["tokens"] - 1) / x["decode_tokens_per_s"] for x in xs)

    ref = pooled("llama.cpp")
    summary = {"llama.cpp": {"decode_tokens_per_s": round(ref, 2)}}
    for name, _ in arms:
        ours = pooled(name)
        paired = statistics.median(r[name]["decode_tokens_per_s"] / r["llama.cpp"]["decode_tokens_per_s"]
                                   for r in rows if r[name]["decode_tokens_per_s"]
                                   and r["llama.cpp"]["decode_tokens_per_s"])
        summary[name] = {"decode_tokens_per_s": round(ours, 2), "ratio_pooled": round(ours / ref, 3),
                         "ratio_median_paired": round(paired, 3)}
        print(f"{name}: {ours:.2f} tok/s decode = {ours / ref:.3f}x llama.cpp ({ref:.2f}), paired median "
              f"{paired:.3f}x", flush=True)
    res = {"bench": "ar-arms-vs-llamacpp-http", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "arms": a.arm, "dartree_cmds": cmds, "llama_cmd": " ".join(llama_cmd[1:]), "gguf": str(gguf),
           "threads": a.threads, "max_tokens": a.max_tokens, "passes": a.passes, "machine": _machine(),
           "summary": summary, "rows": rows}
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
