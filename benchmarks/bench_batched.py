"""Batched-serving benchmark (engine v2, paper Table 4 layout): a real ``dartree serve`` per setting,
streaming requests at concurrency 1, 2, 4, 8, 16, every method side by side.

Per (method, c): ``requests_factor * c`` streaming ``/v1/completions`` requests (chat-formatted
GSM8K prompts, T = 0, ``max_tokens`` new tokens), at most ``c`` in flight. Reported: aggregate
completion tokens/s (sum of usage / wall time of the level), speedup over ``ar`` at the same ``c``,
TTFT p50 / p90 (send -> first content event), mean inter-token time per request (decode time /
(tokens - 1)), and from the verifier's metrics over the level: mean requests and rows per step, and
the fraction of drafter compute hidden behind other forwards (``1 - wait / busy``).

    python -m benchmarks.bench_batched --out benchmarks/results/<date>-serving-batched \\
        [--methods ar dartree-pruned ...] [--concurrency 1 2 4 8 16] [--serve-flags "--overlap"]

Each setting starts its own server (SmolLM2 + the shipped drafter by default) on loopback ports and
stops it after; nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

from services.spec import DFLASH_METHODS as METHODS  # the Domino drafter's methods


def prompts(n: int) -> list[str]:
    """Chat-formatted GSM8K prompts (the evaluation subset the other benchmarks use)."""
    from transformers import AutoTokenizer

    from services.datasets import load_eval
    from services.models.registry import resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))
    return [tok.apply_chat_template([{"role": "user", "content": p.turns[0]}], tokenize=False,
                                    add_generation_prompt=True) for p in load_eval("gsm8k", n)]


async def _one(client, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    first = last = None
    toks = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return {"error": str(ev["error"])[:200]}
            if ev.get("choices") and ev["choices"][0].get("text"):
                now = time.perf_counter()
                first = first or now
                last = now
            if ev.get("usage"):
                toks = ev["usage"]["completion_tokens"]
    if first is None:
        return {"error": "no content"}
    return {"ttft": first - t0, "tokens": toks, "itl": (last - first) / max(1, toks - 1), "e2e": last - t0}


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


async def level(url: str, vmetrics: str, method: str, c: int, n: int, ps: list[str], max_tokens: int,
                deadline_s: float) -> dict:
    """One (method, concurrency) cell."""
    import httpx

    spec = {"method": method}
    sem = asyncio.Semaphore(c)
    async with httpx.AsyncClient(timeout=deadline_s, limits=httpx.Limits(max_connections=c + 4),
                                 trust_env=False) as client:
        async def task(i):
            async with sem:
                return await _one(client, url, {"prompt": ps[i % len(ps)], "max_tokens": max_tokens,
                                                "temperature": 0.0, "stream": True, "ignore_eos": True,
                                                "stream_options": {"include_usage": True}, "speculative": spec})

        before = (await client.get(vmetrics)).text
        t0 = time.perf_counter()
        res = await asyncio.wait_for(asyncio.gather(*(task(i) for i in range(n))), deadline_s)
        wall = time.perf_counter() - t0
        after = (await client.get(vmetrics)).text
    ok = [r for r in res if "error" not in r]
    d = {k: _metric(after, k) - _metric(before, k) for k in (
        "dartree_step_requests_sum", "dartree_step_requests_count", "dartree_step_rows_sum",
        "dartree_verifier_drafter_wait_seconds_total", "dartree_verifier_drafter_busy_seconds_total")}
    steps = d["dartree_step_requests_count"]
    busy = d["dartree_verifier_drafter_busy_seconds_total"]
    ttft = sorted(r["ttft"] for r in ok)
    return {"requests": n, "completed": len(ok), "errors": [r["error"] for r in res if "error" in r][:3],
            "tokens": sum(r["tokens"] for r in ok), "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_p50_s": statistics.median(ttft) if ttft else None,
            "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))] if ttft else None,
            "itl_mean_s": statistics.mean(r["itl"] for r in ok) if ok else None,
            "requests_per_step": d["dartree_step_requests_sum"] / steps if steps else None,
            "rows_per_step": d["dartree_step_rows_sum"] / steps if steps else None,
            "drafter_busy_s": busy,
            "drafter_hidden": 1 - d["dartree_verifier_drafter_wait_seconds_total"] / busy if busy > 0 else None}


def run_setting(label: str, serve_flags: list[str], methods, conc, factor, max_tokens, ps, deadline_s,
                out: Path, threads: int | None = None) -> dict:
    """Start a server with ``serve_flags`` and measure every (method, c) against it."""
    from services.testing import start_server

    table: dict = {}
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    with start_server(*serve_flags, log=out / f"serve-{label}.log", ready_timeout=600, env=env) as srv:
        vm = f"http://127.0.0.1:{srv.metrics_ports[0]}/metrics"
        for m in methods:
            asyncio.run(level(srv.base, vm, m, 1, 1, ps, 8, deadline_s))  # warm-up
            table[m] = {}
            for c in conc:
                row = asyncio.run(level(srv.base, vm, m, c, factor * c, ps, max_tokens, deadline_s))
                table[m][str(c)] = row
                print(f"[{label}] {m:15s} c={c:2d}: {row['tokens_per_s']:6.1f} tok/s  ttft p50 "
                      f"{row['ttft_p50_s'] or 0:.3f}s  itl {1000 * (row['itl_mean_s'] or 0):.1f} ms  "
                      f"req/step {row['requests_per_step'] or 0:.2f}  hidden {row['drafter_hidden']}", flush=True)
    for m, per in table.items():
        for c, row in per.items():
            base = table.get("ar", {}).get(c, {}).get("tokens_per_s")
            row["speedup"] = row["tokens_per_s"] / base if base else None
    return table


def write_report(res: dict, out: Path) -> None:
    """results.md (one table per setting) and a tokens/s-vs-concurrency figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [f"# Batched serving, {res['date']}", "", f"Command: `{res['command']}`", "",
             f"Machine: {res['machine']}; git {res['git']}; server threads per process: "
             f"{res.get('threads') or 'torch default'}; {res['note']}", ""]
    fig, axes = plt.subplots(1, len(res["settings"]), figsize=(6 * len(res["settings"]), 4), squeeze=False)
    for ax, (label, s) in zip(axes[0], res["settings"].items()):
        conc = s["concurrency"]
        lines += [f"## {label} (`dartree serve {' '.join(s['flags'])}`)", "",
                  "| method | " + " | ".join(f"c={c} tok/s (×ar)" for c in conc) + " | TTFT p50 c=1 / c=max | "
                  "hidden draft c>=2 |", "|---|" + "---:|" * (len(conc) + 2)]
        for m, per in s["table"].items():
            cells = [f"{per[str(c)]['tokens_per_s']:.1f} ({per[str(c)]['speedup']:.2f}×)" for c in conc]
            hid = [per[str(c)]["drafter_hidden"] for c in conc if c >= 2 and per[str(c)]["drafter_hidden"] is not None]
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {per[str(conc[0])]['ttft_p50_s']:.2f} / "
                         f"{per[str(conc[-1])]['ttft_p50_s']:.2f} s | "
                         + (f"{min(hid):.0%}–{max(hid):.0%}" if hid else "n/a") + " |")
            ax.plot(conc, [per[str(c)]["tokens_per_s"] for c in conc], marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_title(label)
        ax.legend(fontsize=7)
        lines.append("")
    fig.tight_layout()
    fig.savefig(out / "serving_batched.png", dpi=110)
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--requests-factor", type=int, default=2, help="requests per level = factor × c")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--deadline-s", type=float, default=900.0)
    p.add_argument("--setting", action="append", nargs=2, metavar=("LABEL", "FLAGS"),
                   help='a server setting: label and `dartree serve` flags (repeatable); default: '
                        '"batched" with --max-running 16')
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS of every server process (default: torch's, = cores); 1 = one core each "
                        "for the verifier and the drafter")
    p.add_argument("--note", default="")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    settings = a.setting or [["batched", "--max-running 16"]]
    ps = prompts(a.prompts)
    res = {"date": time.strftime("%Y-%m-%d"), "command": "python -m benchmarks.bench_batched " + " ".join(
        argv if argv is not None else __import__("sys").argv[1:]),
           "machine": f"{platform.platform()}, {__import__('os').cpu_count()} CPUs",
           "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "note": a.note, "threads": a.threads, "settings": {}}
    for label, flags in settings:
        fl = flags.split()
        res["settings"][label] = {"flags": fl, "concurrency": a.concurrency,
                                  "table": run_setting(label, fl, a.methods, a.concurrency, a.requests_factor,
                                                       a.max_tokens, ps, a.deadline_s, a.out, a.threads)}
        (a.out / "results.json").write_text(json.dumps(res, indent=1))
    write_report(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
