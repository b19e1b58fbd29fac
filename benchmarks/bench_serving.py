"""Serving table of ``dartree bench`` (paper Table 4): aggregate completion tokens/s through the HTTP API.

For each method and each concurrency level ``c`` (1, 2, 4, 8), ``requests_per_level(c)`` non-streaming
``POST /v1/completions`` requests (``speculative: {"method": ...}``, T = 0) are sent with at most
``c`` in flight (httpx + asyncio). Aggregate throughput = Σ ``usage.completion_tokens`` / wall time
from the first send to the last response; speedup = throughput / ``ar``'s at the same ``c``.
Bounded in count (requests per level) and time (a deadline per level; unfinished requests are
cancelled and reported). Loopback servers only.

The two DARTree rows: "fixed" sends ``budget``/``width`` (they always win over any schedule); the
"schedule" row sends neither, so the server decides. It is a load-dependent schedule only if the
server was started with one, e.g. ``dartree serve --tree-schedule 1:16x12,2:12x8,4:8x6,8:4x4``
(or ``DARTREE_TREE_SCHEDULE``); otherwise the row measures the server's default B/W. The bench reads
the schedule from the verifier's ``dartree_info{tree_schedule=...}`` metric
(``--serving-verifier-metrics``, default the verifier's default port) and labels the row with what
it found. Every running request shares one batched step (engine v2), so a smaller B under load
makes steps lighter; whether that pays depends on τ(B) against the step cost.
"""

from __future__ import annotations

import asyncio
import os
import time
from urllib.parse import urlparse

LOOPBACK = ("127.0.0.1", "localhost", "::1")
CONCURRENCY = (1, 2, 4, 8)
VERIFIER_METRICS = "http://127.0.0.1:8001/metrics"  # the verifier's default metrics endpoint


def serving_methods(budget: int, width: int, schedule: str | None = None,
                    methods: list[str] | None = None) -> list[tuple[str, dict]]:
    """(label, ``speculative`` object) per row; the last row leaves B/W to the server, labelled by
    ``schedule`` (the server's ``--tree-schedule``: "" = none, None = could not be read).

    ``methods`` (``--serving-methods``, e.g. ``eagle3`` for a server holding an EAGLE-3 drafter): rows
    ``ar`` plus each named method at the fixed B / W instead of the default Domino-drafter rows."""
    if methods:
        return [("ar", {"method": "ar"})] + [(f"{m} (fixed B={budget}, W={width})",
                                              {"method": m, "budget": budget, "width": width})
                                             for m in methods if m != "ar"]
    server_row = ("server B/W schedule " + schedule if schedule else
                  "server default B/W, no schedule" if schedule == "" else "server B/W, schedule unknown")
    return [("ar", {"method": "ar"}), ("domino", {"method": "domino"}), ("ddtree", {"method": "ddtree"}),
            (f"dartree-pruned (fixed B={budget}, W={width})",
             {"method": "dartree-pruned", "budget": budget, "width": width}),
            (f"dartree-pruned ({server_row})", {"method": "dartree-pruned"})]


def check_loopback(url: str, flag: str = "--serving") -> str:
    """``url`` without a trailing slash.

    Raises:
        ValueError: not http(s), or the host is not a loopback address.
    """
    u = urlparse(url)
    if u.scheme not in ("http", "https") or u.hostname not in LOOPBACK:
        raise ValueError(f"{flag} must be a loopback http URL such as http://127.0.0.1:8000 (got {url!r})")
    return url.rstrip("/")


def read_server_schedule(metrics_url: str, transport=None) -> str | None:
    """The verifier's ``--tree-schedule`` from its ``dartree_info`` metric ("" = none; None = unreadable)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with httpx.Client(timeout=5.0, transport=transport, trust_env=False) as client:
            r = client.get(check_loopback(metrics_url, "--serving-verifier-metrics"))
        r.raise_for_status()
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError):
        return None
    for fam in families:
        for sample in fam.samples:
            if sample.name == "dartree_info" and sample.labels.get("role") == "verifier":
                return sample.labels.get("tree_schedule", "")
    return None


async def _one(client, url: str, body: dict, headers: dict) -> dict:
    t0 = time.perf_counter()
    r = await client.post(f"{url}/v1/completions", json=body, headers=headers)
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:200]}", "latency_s": dt}
    usage = r.json().get("usage") or {}
    return {"completion_tokens": int(usage.get("completion_tokens", 0)), "latency_s": dt}


async def run_level(client, url: str, spec: dict, prompts: list[str], concurrency: int, n_requests: int,
                    max_tokens: int, deadline_s: float, headers: dict) -> dict:
    """Send ``n_requests`` requests, ``concurrency`` at a time; aggregate tokens/s."""
    sem = asyncio.Semaphore(concurrency)

    async def task(i: int) -> dict:
        async with sem:
            body = {"prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "temperature": 0.0,
                    "speculative": spec}
            return await _one(client, url, body, headers)

    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(task(i)) for i in range(n_requests)]
    done, pending = await asyncio.wait(tasks, timeout=deadline_s)
    for p in pending:
        p.cancel()
    wall = time.perf_counter() - t0
    results = [d.result() for d in done if not d.cancelled() and d.exception() is None]
    errors = [r["error"] for r in results if "error" in r]
    errors += [repr(d.exception()) for d in done if not d.cancelled() and d.exception() is not None]
    toks = sum(r.get("completion_tokens", 0) for r in results)
    lat = [r["latency_s"] for r in results if "error" not in r]
    return {"requests": n_requests, "completed": len(lat), "cancelled": len(pending), "errors": errors[:5],
            "num_errors": len(errors), "completion_tokens": toks, "wall_s": wall,
            "tokens_per_s": toks / wall if wall > 0 and toks else None,
            "mean_latency_s": sum(lat) / len(lat) if lat else None}


async def run_serving_async(url: str, prompts: list[str], methods: list[tuple[str, dict]], concurrency=CONCURRENCY,
                            requests_per_level=lambda c: 2 * c, max_tokens: int = 128, deadline_s: float = 300.0,
                            api_key: str | None = None, transport=None, schedule: str | None = None) -> dict:
    """The whole serving table: ``{"table": {label: {c: row}}, ...}`` with speedups over ``ar``."""
    import httpx

    url = check_loopback(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(concurrency) + 2)
    table: dict[str, dict] = {}
    async with httpx.AsyncClient(timeout=deadline_s, limits=limits, transport=transport, trust_env=False) as client:
        for label, spec in methods:
            warm = await _one(client, url, {"prompt": prompts[0], "max_tokens": 8, "temperature": 0.0,
                                            "speculative": spec}, headers)
            if "error" in warm:
                table[label] = {"error": warm["error"]}
                continue
            table[label] = {str(c): await run_level(client, url, spec, prompts, c, requests_per_level(c), max_tokens,
                                                    deadline_s, headers) for c in concurrency}
    ar = table.get("ar", {})
    for label, per in table.items():
        for c, row in per.items():
            if not isinstance(row, dict) or "tokens_per_s" not in row:
                continue
            base = ar.get(c, {}).get("tokens_per_s") if isinstance(ar.get(c), dict) else None
            row["speedup"] = row["tokens_per_s"] / base if base and row["tokens_per_s"] else None
    return {"url": url, "concurrency": list(concurrency), "max_tokens": max_tokens, "table": table,
            "server_tree_schedule": schedule, "note": _note(schedule)}


def _note(schedule: str | None) -> str:
    server = (f"the verifier's --tree-schedule {schedule} picks B/W per round from its running count"
              if schedule else "the server has no --tree-schedule, so its default B/W apply at every load"
              if schedule == "" else "the server's --tree-schedule could not be read (verifier metrics "
              "unreachable), so it is unknown whether a schedule applies")
    return (f"T = 0, non-streaming; the last dartree-pruned row sends no budget/width: {server}. All running "
            "requests share one batched verify forward per step")


def run_serving(url: str, prompts: list[str], budget: int, width: int, max_tokens: int, deadline_s: float,
                requests_factor: int = 2, api_key: str | None = None, transport=None,
                verifier_metrics: str | None = VERIFIER_METRICS, methods: list[str] | None = None) -> dict:
    """Synchronous entry used by ``benchmarks.bench`` (``verifier_metrics`` None: schedule unknown)."""
    key = api_key if api_key is not None else os.environ.get("DARTREE_API_KEY")
    schedule = read_server_schedule(verifier_metrics, transport) if verifier_metrics else None
    return asyncio.run(run_serving_async(url, prompts, serving_methods(budget, width, schedule, methods),
                                         requests_per_level=lambda c: max(1, requests_factor * c),
                                         max_tokens=max_tokens, deadline_s=deadline_s, api_key=key,
                                         transport=transport, schedule=schedule))
