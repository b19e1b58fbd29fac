"""Served-path overhead: ``dartree serve`` (gateway + ZeroMQ + tensor transport) vs the in-process engine.

Question answered: at batch 1, how much time per speculative round does serving add
over ``services.generate.build_inprocess`` (goal: <= 2 % of the round time), and how much time to
first token does the gateway add (goal: <= 5 ms)?

Procedure: the same target, drafter, method and prompt token ids, greedy, ``ignore_eos`` so every
run has the same length. For each repeat and prompt, (a) in process: prefill time and the wall
time of the speculative rounds (``engine.step`` after the prefill); (b) served: one streaming
request with the prompt as token ids; the client measures TTFT (first event) and the time to the
last event; the verifier's /metrics give its round count and its own round time (which includes
the drafter round trip). Token ids must agree (lossless), so both paths run the same rounds.
Reported (medians over repeats x prompts):

- ``round_ms`` in process and served; ``overhead_ms`` and ``overhead_pct`` per round;
- the split: ``drafter_link_ms`` (verifier-measured round - in-process round: ZMQ to the drafter +
  feature transport) and ``gateway_link_ms`` (client-measured - verifier-measured: verifier ->
  gateway ZMQ, detokenization, SSE);
- ``ttft_added_ms`` = served TTFT - in-process prefill.

Usage::

    python -m benchmarks.bench_served                     # SmolLM2 + the shipped drafter, float32, CPU
    python -m benchmarks.bench_served --tiny --repeats 1  # smoke: tiny random models (seconds)

Human-readable lines go to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from services.runtime import free_loopback_ports

PROMPTS = ["Explain, step by step, how a hash table handles collisions.",
           "Write a short poem about the sea.",
           "def quicksort(arr):",
           "List the planets of the solar system in order from the sun."]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` (with these labels) in a Prometheus text page (0.0 if none)."""
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and \
                all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.split()[-1])
    return total


def inprocess_run(engine, prompt_ids: list[int], args) -> dict:
    from services.params import SamplingParams, SpecParams

    rid = uuid.uuid4().hex
    engine.add_request(rid, prompt_ids, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
                       SpecParams(args.method))
    ids, rounds = [], 0
    t0 = time.perf_counter()
    out = engine.next_output(rid)  # prefill + first token
    t1 = time.perf_counter()
    ids += out.token_ids
    while out.finish_reason is None:
        out = engine.next_output(rid)
        ids += out.token_ids
        rounds += 1
    t2 = time.perf_counter()
    return {"ids": ids, "rounds": rounds, "ttft_s": t1 - t0, "decode_s": t2 - t1}


def served_run(client, base: str, vmetrics: str, prompt_ids: list[int], args) -> dict:
    import httpx

    before = httpx.get(vmetrics, timeout=10).text
    body = {"prompt": prompt_ids, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "speculative": {"method": args.method}}
    ids, first = [], None
    t0 = time.perf_counter()
    with client.stream("POST", base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"])
            got = ev["choices"][0].get("token_ids") or []
            if got and first is None:
                first = time.perf_counter()
            ids += got
            last = time.perf_counter()
    after = httpx.get(vmetrics, timeout=10).text
    rounds = metric_sum(after, "dartree_spec_rounds_total") - metric_sum(before, "dartree_spec_rounds_total")
    vtotal = (metric_sum(after, "dartree_round_seconds_sum", phase="total")
              - metric_sum(before, "dartree_round_seconds_sum", phase="total"))
    vprefill = (metric_sum(after, "dartree_round_seconds_sum", phase="prefill")
                - metric_sum(before, "dartree_round_seconds_sum", phase="prefill"))
    # the prefill round is observed under "prefill" (and under "total" only for speculative rounds)
    return {"ids": ids, "rounds": int(rounds), "ttft_s": first - t0, "decode_s": last - first,
            "verifier_round_total_s": vtotal, "verifier_prefill_s": vprefill}


def tiny_models() -> tuple[str, str]:
    """Tiny random target + drafter on disk (the test fixture's), for a smoke run."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from services.tiny_models import make_tiny_models

    root = Path(tempfile.mkdtemp(prefix="dartree-bench-served-"))
    t, d = make_tiny_models(root)
    return str(t), str(d)


def main(argv: list[str] | None = None) -> int:
    import subprocess

    import httpx
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="", help="target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--drafter", default="", help="drafter directory (default: the shipped drafter)")
    ap.add_argument("--tiny", action="store_true", help="smoke run on tiny random models")
    ap.add_argument("--method", default="dartree-pruned")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--serve-log", default="/tmp/dartree-bench-served.log")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    if args.tiny:
        args.target, args.drafter = tiny_models()
        args.max_tokens = min(args.max_tokens, 48)

    from services.generate import build_inprocess

    engine, tok, note = build_inprocess(args.target or None, args.drafter or None, torch.float32)
    _log(f"[served] in-process engine ready ({note})")
    prompts = [tok.encode(p) for p in PROMPTS[:args.prompts]]
    if args.tiny:  # the tiny target has a 256-token window
        prompts = [p[:32] for p in prompts]

    port, vport, dport = free_loopback_ports(3)
    cmd = [sys.executable, "-m", "services.serve", "--port", str(port), "--verifier-metrics-port", str(vport),
           "--drafter-metrics-port", str(dport), "--default-temperature", "0", "--dtype", "float32",
           "--default-method", args.method, "--log-level", "WARNING"]
    if args.target:
        cmd += ["--target", args.target]
    if args.drafter:
        cmd += ["--drafter", args.drafter]
    base, vmetrics = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{vport}/metrics"
    log = open(args.serve_log, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1],
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rows: list[dict] = []
    try:
        deadline = time.monotonic() + args.startup_timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited ({proc.returncode}); see {args.serve_log}")
            try:
                if httpx.get(base + "/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"server not ready in {args.startup_timeout:.0f} s; see {args.serve_log}")
            time.sleep(0.5)
        _log(f"[served] server ready at {base}")
        with httpx.Client(timeout=600) as client:
            served_run(client, base, vmetrics, prompts[0], args)  # warm-up both paths
            inprocess_run(engine, prompts[0], args)
            for rep in range(args.repeats):
                for i, ids in enumerate(prompts):
                    a = inprocess_run(engine, ids, args)
                    b = served_run(client, base, vmetrics, ids, args)
                    if a["ids"] != b["ids"]:
                        at = next((k for k, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y),
                                  min(len(a["ids"]), len(b["ids"])))
                        _log(f"[served] WARNING: prompt {i}: served tokens differ from in-process at {at}")
                    rows.append({"prompt": i, "repeat": rep, "same_tokens": a["ids"] == b["ids"],
                                 "rounds_inproc": a["rounds"], "rounds_served": b["rounds"],
                                 "round_ms_inproc": 1000 * a["decode_s"] / max(a["rounds"], 1),
                                 "round_ms_served": 1000 * b["decode_s"] / max(b["rounds"], 1),
                                 "round_ms_verifier": 1000 * b["verifier_round_total_s"] / max(b["rounds"], 1),
                                 "ttft_ms_inproc": 1000 * a["ttft_s"], "ttft_ms_served": 1000 * b["ttft_s"],
                                 "prefill_ms_verifier": 1000 * b["verifier_prefill_s"]})
                    _log(f"[served] rep {rep} prompt {i}: rounds {a['rounds']}/{b['rounds']}, round ms "
                         f"{rows[-1]['round_ms_inproc']:.2f} in-process / {rows[-1]['round_ms_verifier']:.2f} verifier "
                         f"/ {rows[-1]['round_ms_served']:.2f} served; TTFT ms {rows[-1]['ttft_ms_inproc']:.1f} / "
                         f"{rows[-1]['ttft_ms_served']:.1f}")
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()

    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_ms_inproc") or
           k.endswith("_ms_served") or k.endswith("_ms_verifier")}
    overhead = med["round_ms_served"] - med["round_ms_inproc"]
    result = {
        "bench": "bench_served", "target": args.target or "smollm2-135m-instruct", "drafter": note,
        "method": args.method, "max_tokens": args.max_tokens, "prompts": len(prompts), "repeats": args.repeats,
        "tiny": args.tiny, "same_tokens": all(r["same_tokens"] for r in rows),
        "round_ms": {"inproc": round(med["round_ms_inproc"], 3), "verifier": round(med["round_ms_verifier"], 3),
                     "served": round(med["round_ms_served"], 3)},
        "overhead_ms": round(overhead, 3), "overhead_pct": round(100 * overhead / med["round_ms_inproc"], 2),
        "drafter_link_ms": round(med["round_ms_verifier"] - med["round_ms_inproc"], 3),
        "gateway_link_ms": round(med["round_ms_served"] - med["round_ms_verifier"], 3),
        "ttft_ms": {"inproc": round(med["ttft_ms_inproc"], 2), "served": round(med["ttft_ms_served"], 2)},
        "ttft_added_ms": round(med["ttft_ms_served"] - med["ttft_ms_inproc"], 2),
        "goals": {"overhead_pct<=2": None, "ttft_added_ms<=5": None},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
        "date": time.strftime("%Y-%m-%d"),
    }
    result["goals"] = {"overhead_pct<=2": result["overhead_pct"] <= 2.0, "ttft_added_ms<=5": result["ttft_added_ms"] <= 5}
    _log(f"[served] round: in-process {result['round_ms']['inproc']} ms, served {result['round_ms']['served']} ms "
         f"(+{result['overhead_ms']} ms = {result['overhead_pct']} %; drafter link {result['drafter_link_ms']} ms, "
         f"gateway link {result['gateway_link_ms']} ms); TTFT added {result['ttft_added_ms']} ms")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
