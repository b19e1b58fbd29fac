"""CPU seconds each process of a running ``dartree serve`` spends per streamed token (plain decoding).

    dartree serve --port 8011 &        # the default server
    python benchmarks/results/2026-12-04-step-bookkeeping/cpu_per_token.py --url http://127.0.0.1:8011 --requests 8

Streams ``--requests`` chat requests one after another (``"speculative": {"method": "ar"}``, T = 0,
128 tokens, EOS ignored) and reads each server process's user + system CPU time (psutil) before
and after: CPU ms per token of the gateway and the verifier, and the client's decode rate.
"""

import argparse
import json
import time

import httpx
import psutil

PROMPTS = ["Explain how a hash table works.", "Write a short story about a robot who learns to paint.",
           "What are the benefits of regular exercise?", "Natalia sold clips to 48 of her friends in April, and "
           "then she sold half as many clips in May. How many clips did Natalia sell altogether?"]


def server_processes() -> dict[str, psutil.Process]:
    out = {}
    for p in psutil.process_iter(["name"]):
        for role in ("gateway", "verifier", "drafter"):
            if p.info["name"] and p.info["name"].startswith(f"dartree-{role}"[:15]):
                out[role] = p
    return out


def cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


ap = argparse.ArgumentParser()
ap.add_argument("--url", default="http://127.0.0.1:8011")
ap.add_argument("--requests", type=int, default=8)
a = ap.parse_args()
procs = server_processes()
before = {k: cpu(p) for k, p in procs.items()}
tokens, rates = 0, []
with httpx.Client(timeout=300) as c:
    for i in range(a.requests):
        body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                "max_tokens": 128, "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}, "speculative": {"method": "ar"}}
        times, n = [], 0
        with c.stream("POST", a.url + "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    d = json.loads(line[6:])
                    if d.get("usage"):
                        n = d["usage"]["completion_tokens"]
                    elif d.get("choices"):
                        times.append(time.perf_counter())
        tokens += n
        rates.append((n - 1) / (times[-1] - times[0]))
after = {k: cpu(p) for k, p in procs.items()}
print(json.dumps({"tokens": tokens, "decode_tok_s_median": sorted(rates)[len(rates) // 2],
                  "cpu_ms_per_token": {k: round(1000 * (after[k] - before[k]) / tokens, 3) for k in procs}}))
