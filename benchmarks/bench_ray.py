"""Ray Serve scale-out: added latency of the Ray path at c = 1, and load balance over replicas at c = 4.

Starts a local Ray cluster (loopback) and ``dartree serve-ray``'s app with ``--replicas`` units, then:

1. Latency at c = 1: ``--latency-requests`` streaming completions (``max_tokens``, T = 0), alternating
   between the Ray proxy and one replica's own gateway (found through ``/metrics/targets``), so both
   paths see the same unit, model and machine load. Per request: TTFT (send -> first token event) and
   per-token time ((last event - first event) / (completion tokens - 1)). Reported: medians per path
   and the Ray path's added latency in % (median ratio - 1), and the median of the paired differences
   (each Ray request against the direct one sent right before or after it).
2. Load balance: ``--balance-requests`` completions at c = ``--concurrency`` through the proxy; requests
   per replica from the ``x-dartree-replica`` response header; max / min.

Last stdout line = JSON (also written to ``--out``). Example (SmolLM2, plain decoding)::

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.bench_ray --unit-flags "--drafter none" \\
        --out benchmarks/results/2026-11-30-ray/ray_vs_direct.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import platform
import shlex
import statistics
import time
from pathlib import Path

import httpx

PROMPTS = ["Write a haiku about the sea.", "What is 17 * 23?", "Name three primes.", "def fibonacci(n):",
           "Explain a hash map in one sentence.", "The capital of France is"]


async def stream_one(client: httpx.AsyncClient, base: str, prompt: str, max_tokens: int, model: str) -> dict:
    """One streaming completion; TTFT and per-token seconds (``tokens`` = completion tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            if ev.get("choices") and ev["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
    return {"ttft_s": first - t0, "per_token_s": (last - first) / max(tokens - 1, 1), "tokens": tokens}


async def latency(ray_base: str, direct_base: str, n: int, max_tokens: int, model: str) -> dict:
    out = {"ray": [], "direct": []}
    async with httpx.AsyncClient(timeout=600, trust_env=False) as c:
        for base in (ray_base, direct_base):  # warm-up, not counted
            await stream_one(c, base, PROMPTS[0], 4, model)
        for i in range(n):
            order = [("ray", ray_base), ("direct", direct_base)]
            for name, base in (order if i % 2 == 0 else order[::-1]):
                out[name].append(await stream_one(c, base, PROMPTS[i % len(PROMPTS)], max_tokens, model))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("ttft_s", "per_token_s")} for k, v in out.items()}
    added = {m: med["ray"][m] / med["direct"][m] - 1 for m in ("ttft_s", "per_token_s")}
    # requests are paired (back to back, alternating order): the median of the pair differences is less
    # sensitive to the machine's load drifting than the difference of the medians
    paired = {m: statistics.median(r[m] - d[m] for r, d in zip(out["ray"], out["direct"]))
              for m in ("ttft_s", "per_token_s")}
    return {"requests_per_path": n, "max_tokens": max_tokens, "median": med, "ray_added_fraction": added,
            "paired_median_difference_s": paired,
            "paired_added_fraction": {m: paired[m] / med["direct"][m] for m in paired}, "samples": out}


async def balance(base: str, n: int, concurrency: int, max_tokens: int, model: str) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, trust_env=False) as c:
        async def one(i: int) -> str:
            async with sem:
                r = await c.post(base + "/v1/completions", json={"model": model, "prompt": PROMPTS[i % len(PROMPTS)],
                                                                  "max_tokens": max_tokens, "temperature": 0})
                r.raise_for_status()
                return r.headers["x-dartree-replica"]
        t0 = time.perf_counter()
        replicas = await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    counts = collections.Counter(replicas)
    return {"requests": n, "concurrency": concurrency, "max_tokens": max_tokens, "per_replica": dict(counts),
            "max_over_min": max(counts.values()) / min(counts.values()) if len(counts) > 1 else None,
            "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--num-cpus", type=float, default=1.0, help="Ray CPUs per replica")
    ap.add_argument("--unit-flags", default="--drafter none", help="dartree serve flags of every unit")
    ap.add_argument("--latency-requests", type=int, default=12, help="per path, at c = 1")
    ap.add_argument("--latency-max-tokens", type=int, default=32)
    ap.add_argument("--balance-requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--balance-max-tokens", type=int, default=16)
    ap.add_argument("--out", default="", help="write the JSON here too")
    a = ap.parse_args(argv)

    import ray
    from ray import serve

    from services.ray_config import RayAppConfig, ScaleConfig, UnitSpec
    from services.ray_serve import APP_NAME, build_app
    from services.runtime import free_loopback_ports

    (port,) = free_loopback_ports(1)
    base = f"http://127.0.0.1:{port}"
    ray.init(num_cpus=max(2, int(a.num_cpus * a.replicas + 0.999)), include_dashboard=False,
             _node_ip_address="127.0.0.1", logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = RayAppConfig(UnitSpec(tuple(shlex.split(a.unit_flags))),
                           ScaleConfig(replicas=a.replicas, num_cpus=a.num_cpus))
        t0 = time.monotonic()
        serve.run(build_app(cfg), name=APP_NAME, route_prefix="/")
        started = time.monotonic() - t0
        groups = []
        while len({g["labels"]["replica"] for g in groups}) < a.replicas:
            groups = httpx.get(base + "/metrics/targets", timeout=30, trust_env=False).json()
            time.sleep(1)
        gateway = next(g["targets"][0] for g in groups if g["labels"]["process"] == "gateway")
        model = httpx.get(base + "/v1/models", timeout=30, trust_env=False).json()["data"][0]["id"]
        lat = asyncio.run(latency(base, f"http://{gateway}", a.latency_requests, a.latency_max_tokens, model))
        bal = asyncio.run(balance(base, a.balance_requests, a.concurrency, a.balance_max_tokens, model))
        serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    result = {"bench": "ray_vs_direct", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs, no GPU; shared with other work",
              "ray": ray.__version__, "replicas": a.replicas, "unit_flags": a.unit_flags,
              "ray_serve_env": {k: v for k, v in __import__("os").environ.items() if k.startswith("RAY_SERVE_")},
              "app_start_s": started, "latency_c1": lat, "balance": bal}
    line = json.dumps(result)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    med = lat["median"]
    print(f"c=1 TTFT median: ray {med['ray']['ttft_s'] * 1e3:.1f} ms, direct {med['direct']['ttft_s'] * 1e3:.1f} ms "
          f"({lat['ray_added_fraction']['ttft_s']:+.1%}); per token: ray {med['ray']['per_token_s'] * 1e3:.2f} ms, "
          f"direct {med['direct']['per_token_s'] * 1e3:.2f} ms ({lat['ray_added_fraction']['per_token_s']:+.1%})")
    pm = lat["paired_median_difference_s"]
    print(f"paired median difference (ray - direct): TTFT {pm['ttft_s'] * 1e3:+.1f} ms "
          f"({lat['paired_added_fraction']['ttft_s']:+.1%}), per token {pm['per_token_s'] * 1e3:+.2f} ms "
          f"({lat['paired_added_fraction']['per_token_s']:+.1%})")
    print(f"balance over {bal['requests']} at c={bal['concurrency']}: {bal['per_replica']} "
          f"(max/min {bal['max_over_min']})")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
