"""Load test of a running (or self-started) ``dartree serve``: N concurrent streaming clients for D seconds.

Question answered: under sustained concurrent streaming load with mixed lengths and temperatures,
does the server stay correct (zero errors; every greedy answer equal to its solo answer), is its
memory stable (RSS growth of gateway, verifier and drafter after warm-up), and what is the latency
distribution (TTFT, inter-event latency, end to end)?

Procedure: (1) solo phase: each prompt is requested alone, greedy, non-streaming, at the longest
``--max-tokens`` (greedy at a shorter length is its prefix); (2) load phase: ``--clients`` asyncio
clients (httpx, loopback only) loop for ``--duration`` seconds, each sending one streaming request
at a time drawn from the mix (prompts x ``--max-tokens`` x ``--temperatures``); greedy streamed
token ids are compared with the solo ones;
(3) at the deadline no client starts a new request; requests still in flight may finish within
``--request-timeout`` more seconds and are counted (any still running then are cancelled and
counted as errors of kind ``unfinished``); (4) RSS of the three processes is sampled every second
(psutil); growth = last-25%-window mean / mean of the samples right after warm-up - 1.
Bounded: the run ends by the deadline plus ``--request-timeout``; the client count and the
duration are fixed. Reported: TTFT percentiles (for a queued request, mostly its wait in the
verifier's queue), inter-event and end-to-end latency, and errors by kind.

Usage::

    # against a server that is already running (pass its supervisor pid for the RSS figures)
    python -m benchmarks.load_test --url http://127.0.0.1:8000 --server-pid <pid of `dartree serve`>
    # the full run (SmolLM2 + the shipped drafter; starts and stops its own server)
    python -m benchmarks.load_test --serve --clients 32 --duration 180 --warmup 30
    # CI smoke (tiny random models; see tests/reliability/test_load.py)
    python -m benchmarks.load_test --serve --target DIR --drafter DIR --clients 8 --duration 60

Human-readable lines go to stderr; the last stdout line is one JSON object with ``"ok"``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from urllib.parse import urlparse

LOOPBACK = ("127.0.0.1", "localhost", "::1")
PROMPTS = [
    "Write a haiku about speculative decoding.",
    "Explain, step by step, how a hash table handles collisions.",
    "def fibonacci(n):",
    "What is 17 * 23? Show your work.",
    "Translate to French: The cat sleeps on the warm windowsill.",
    "List three uses of a binary search tree.",
    "你好，请介绍一下你自己。",
    "Summarize the plot of Hamlet in two sentences.",
]
PROCESS_NAMES = {"gateway": "dartree-gateway", "verifier": "dartree-verifie", "drafter": "dartree-drafter"}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def check_loopback(url: str) -> str:
    u = urlparse(url)
    if u.scheme != "http" or u.hostname not in LOOPBACK:
        raise SystemExit(f"--url must be a loopback http URL (got {url!r})")
    return url.rstrip("/")


def percentiles(xs: list[float]) -> dict:
    """p50/p90/p99/max/mean in milliseconds (None when empty)."""
    if not xs:
        return {"n": 0}
    s = sorted(xs)

    def q(p: float) -> float:
        return round(1000 * s[min(len(s) - 1, int(p * (len(s) - 1) + 0.5))], 2)

    return {"n": len(s), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": round(1000 * s[-1], 2),
            "mean": round(1000 * statistics.fmean(s), 2)}


# ------------------------------------------------------------------------------------------ server

@contextmanager
def serve(args):
    """:func:`services.testing.start_server` with the load test's limits; yields ``(url, supervisor pid)``."""
    from services.testing import start_server

    flags = ["--max-concurrent-requests", str(max(64, 2 * args.clients)), "--max-running", str(args.max_running),
             "--max-waiting", str(max(64, 2 * args.clients)), *args.serve_arg]
    _log(f"[load] starting dartree serve {' '.join(flags)} (log {args.serve_log})")
    with start_server(*flags, log=args.serve_log, target=args.target or None, drafter=args.drafter or None,
                      ready_timeout=args.startup_timeout, stop_timeout=90) as srv:
        yield srv.base, srv.proc.pid


class RssSampler:
    """Samples the RSS (MiB) of the gateway, verifier and drafter children of a supervisor pid every second."""

    def __init__(self, supervisor_pid: int | None, interval: float = 1.0):
        self.interval = interval
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._procs = self._find(supervisor_pid) if supervisor_pid else {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _find(pid: int) -> dict:
        import psutil

        found = {}
        for child in psutil.Process(pid).children(recursive=True):
            try:
                name = child.name()
            except psutil.NoSuchProcess:
                continue
            for role, comm in PROCESS_NAMES.items():
                if name == comm:
                    found[role] = child
        return found

    def sample(self) -> dict[str, float]:
        out = {}
        for role, p in self._procs.items():
            try:
                out[role] = p.memory_info().rss / 2**20
            except Exception:  # noqa: BLE001 - a dead worker shows up as missing
                pass
        return out

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(self.interval):
            self.samples.append((time.monotonic() - t0, self.sample()))

    def start(self) -> "RssSampler":
        self.samples.append((0.0, self.sample()))
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def report(self, warmup: float) -> dict:
        """Per process: MiB after warm-up, at the end, peak, growth (fraction)."""
        out = {}
        for role in self._procs:
            series = [(t, s[role]) for t, s in self.samples if role in s]
            post = [v for t, v in series if t >= warmup]
            if len(post) < 4:
                out[role] = {"samples": len(series)}
                continue
            k = max(2, len(post) // 4)
            base, end = statistics.fmean(post[:k]), statistics.fmean(post[-k:])
            out[role] = {"mib_start": round(series[0][1], 1), "mib_after_warmup": round(base, 1),
                         "mib_end": round(end, 1), "mib_peak": round(max(v for _, v in series), 1),
                         "growth": round(end / base - 1.0, 4), "samples": len(series)}
        return out


# ------------------------------------------------------------------------------------------ clients

def mix(args) -> list[dict]:
    """All request kinds of the workload (prompt x max_tokens x temperature)."""
    return [{"prompt": p, "max_tokens": n, "temperature": t}
            for p in PROMPTS[:args.prompts] for n in args.max_tokens for t in args.temperatures]


async def _solo(client, url: str, headers: dict, kind: dict, extra: dict) -> list[int]:
    r = await client.post(url + "/v1/completions", headers=headers, json={
        **kind, **extra, "return_token_ids": True, "stream": False})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def _error(stats: dict, kind: str, message: str) -> None:
    """Record one failed (or wrong) request: its kind for the counts, its message for the samples."""
    stats["errors"].append((kind, message[:200]))


async def _stream_one(client, url: str, headers: dict, body: dict, stats: dict) -> list[int] | None:
    """One streaming request; records latencies into ``stats``; returns the token ids or None on error."""
    t0 = time.perf_counter()
    first, last, ids, usage = None, None, [], None
    try:
        async with client.stream("POST", url + "/v1/completions", headers=headers, json=body) as r:
            if r.status_code != 200:
                _error(stats, f"http_{r.status_code}", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                ev = json.loads(line[6:])
                if "error" in ev:
                    err = ev["error"]
                    _error(stats, f"error_event:{err.get('code')}", f"error event: {err.get('message')}")
                    return None
                if ev.get("usage"):
                    usage = ev["usage"]
                if not ev.get("choices"):
                    continue
                now = time.perf_counter()
                ch = ev["choices"][0]
                ids += ch.get("token_ids") or []
                if ch.get("text") or ch.get("token_ids"):
                    if first is None:
                        first = now
                        stats["ttft"].append(now - t0)
                    elif last is not None:
                        stats["itl"].append(now - last)
                    last = now
    except Exception as exc:  # noqa: BLE001 - every client-side failure is an error of the run
        _error(stats, type(exc).__name__, f"{type(exc).__name__}: {exc}")
        return None
    stats["e2e"].append(time.perf_counter() - t0)
    stats["tokens"] += len(ids)
    if usage is not None and usage.get("completion_tokens") != len(ids):
        _error(stats, "usage_mismatch", f"usage {usage.get('completion_tokens')} != {len(ids)} streamed ids")
    return ids


async def run_load(url: str, args, headers: dict) -> dict:
    """Solo answers, then ``args.clients`` looping clients until the deadline, then the drain of in-flight requests."""
    import httpx

    kinds = mix(args)
    extra = {"speculative": {"method": args.method}} if args.method else {}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=min(5.0, args.request_timeout))  # as the OpenAI client
    stats = {"errors": [], "ttft": [], "itl": [], "e2e": [], "tokens": 0, "requests": 0, "greedy_checked": 0,
             "greedy_mismatches": 0, "active": 0, "in_flight_at_deadline": 0, "unfinished": 0}
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        # greedy with max_tokens n is the first n tokens of greedy with more (or all of it, if EOS came
        # first): one solo answer per prompt, at the longest max_tokens, is the reference of every length
        solo, longest = {}, max(args.max_tokens)
        t_solo = time.perf_counter()
        if 0.0 in args.temperatures:
            for p in PROMPTS[:args.prompts]:
                solo[p] = await _solo(client, url, headers, {"prompt": p, "max_tokens": longest, "temperature": 0.0},
                                      extra)
        _log(f"[load] solo answers: {len(solo)} in {time.perf_counter() - t_solo:.1f} s")

        deadline = time.monotonic() + args.duration
        rng = random.Random(args.seed)

        async def worker(i: int) -> None:
            local = random.Random(rng.random())
            await asyncio.sleep(local.uniform(0, min(1.0, args.duration / 10)))  # staggered start
            while time.monotonic() < deadline:  # no new request after the deadline
                k = local.choice(kinds)
                body = {**k, **extra, "stream": True, "return_token_ids": True,
                        "stream_options": {"include_usage": True}}
                if k["temperature"] > 0:
                    body["seed"] = local.randrange(2**31)
                stats["requests"] += 1
                stats["active"] += 1
                try:
                    ids = await _stream_one(client, url, headers, body, stats)
                except asyncio.CancelledError:
                    stats["unfinished"] += 1
                    _error(stats, "unfinished", f"still running {args.request_timeout:g} s after the deadline")
                    raise
                finally:
                    stats["active"] -= 1
                if ids is not None and k["temperature"] == 0:
                    stats["greedy_checked"] += 1
                    if ids != solo[k["prompt"]][:k["max_tokens"]]:
                        stats["greedy_mismatches"] += 1
                        _error(stats, "greedy_mismatch", f"greedy answer differs from solo ({k['prompt'][:30]!r}, "
                                                         f"{k['max_tokens']})")

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker(i)) for i in range(args.clients)]
        await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        stats["in_flight_at_deadline"] = stats["active"]
        _log(f"[load] deadline: {stats['active']} requests in flight; waiting up to {args.request_timeout:g} s")
        _, pending = await asyncio.wait(tasks, timeout=args.request_timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.perf_counter() - t0
    return {**stats, "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="", help="a running server (loopback); default: --serve")
    ap.add_argument("--server-pid", type=int, default=0, help="pid of `dartree serve` (for RSS) with --url")
    ap.add_argument("--serve", action="store_true", help="start (and stop) a server for the run")
    ap.add_argument("--target", default="", help="--target of the started server (default: SmolLM2)")
    ap.add_argument("--drafter", default="", help="--drafter of the started server (default: the shipped one)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra flag for the started server")
    ap.add_argument("--serve-log", default="/tmp/dartree-load-serve.log")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--max-running", type=int, default=8, help="--max-running of the started server")
    ap.add_argument("--api-key", default=os.environ.get("DARTREE_API_KEY", ""))
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds excluded from the RSS baseline")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.0, 0.7, 1.0])
    ap.add_argument("--method", default="", help="speculative.method of every request (default: the server's)")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="client timeout of one request, in seconds (httpx read/write/pool; connect: 5 s), and\n"
                         "how long in-flight requests may still run after --duration (then they are cut and\n"
                         "counted as errors); default 600 s, the OpenAI Python client's default timeout")
    ap.add_argument("--max-rss-growth", type=float, default=0.10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not args.url and not args.serve:
        args.serve = True
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def run(url: str, pid: int | None) -> dict:
        sampler = RssSampler(pid).start()
        try:
            res = asyncio.run(run_load(url, args, headers))
        finally:
            sampler.stop()
        res["rss"] = sampler.report(args.warmup)
        return res

    if args.serve:
        with serve(args) as (url, pid):
            res = run(url, pid)
    else:
        url = check_loopback(args.url)
        res = run(url, args.server_pid or None)

    growth = {k: v.get("growth") for k, v in res["rss"].items() if v.get("growth") is not None}
    summary = {
        "bench": "load_test", "url": url, "clients": args.clients, "duration_s": args.duration,
        "wall_s": round(res["wall_s"], 1), "requests": res["requests"], "completed": len(res["e2e"]),
        "in_flight_at_deadline": res["in_flight_at_deadline"], "unfinished": res["unfinished"],
        "request_timeout_s": args.request_timeout,
        "errors": len(res["errors"]), "errors_by_kind": dict(Counter(kind for kind, _ in res["errors"])),
        "error_samples": [msg for _, msg in res["errors"][:5]],
        "greedy_checked": res["greedy_checked"], "greedy_mismatches": res["greedy_mismatches"],
        "completion_tokens": res["tokens"], "tokens_per_s": round(res["tokens"] / res["wall_s"], 1),
        "ttft_ms": percentiles(res["ttft"]), "itl_ms": percentiles(res["itl"]), "e2e_ms": percentiles(res["e2e"]),
        "rss": res["rss"], "max_rss_growth": args.max_rss_growth,
        "mix": {"prompts": args.prompts, "max_tokens": args.max_tokens, "temperatures": args.temperatures,
                "method": args.method or "server default"},
    }
    summary["ok"] = bool(summary["errors"] == 0 and summary["greedy_mismatches"] == 0 and summary["completed"] > 0
                         and all(g < args.max_rss_growth for g in growth.values()))
    _log(f"[load] {summary['requests']} requests ({summary['completed']} completed, "
         f"{summary['in_flight_at_deadline']} in flight at the deadline, {summary['unfinished']} cut after "
         f"{args.request_timeout:g} s more), {summary['errors']} errors {summary['errors_by_kind']}, "
         f"{summary['greedy_checked']} greedy checked / {summary['greedy_mismatches']} mismatches, "
         f"{summary['tokens_per_s']} tok/s")
    for name, what in (("ttft_ms", "TTFT (queue wait + prefill)"), ("itl_ms", "inter-event"),
                       ("e2e_ms", "end to end")):
        _log(f"[load] {what} ms: {summary[name]}")
    for role, r in summary["rss"].items():
        _log(f"[load] rss {role}: {r}")
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
