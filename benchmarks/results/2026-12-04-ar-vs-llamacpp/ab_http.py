"""Plain decoding through HTTP: the default ``dartree serve`` (request method ``ar``) against
llama-cpp-python's OpenAI server on the same GGUF, same threads, c = 1, interleaved.

Both servers run side by side (each idle while the other answers); per prompt the order of the two
alternates. Each request streams a chat-templated prompt (the same text to both) at T = 0 with
``max_tokens``; decode tokens/s = (tokens - 1) / (last token time - first token time) at the client,
so prefill (TTFT) is excluded; end to end = tokens / wall. Our server counts tokens by
``return_token_ids``, llama.cpp's by stream chunks (one a token).

    python benchmarks/results/2026-12-04-ar-vs-llamacpp/ab_http.py --prompts 8 --passes 2 --out ab-http.json

Needs ``llama-cpp-python[server]`` (``make bench-deps`` and ``pip install starlette-context
pydantic-settings``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from benchmarks.bench_llama import default_gguf  # noqa: E402
from benchmarks.bench_small_trees import _machine, _prompts  # noqa: E402
from services.models.registry import resolve_target  # noqa: E402
from services.runtime import free_loopback_ports  # noqa: E402


def wait_ready(proc, url: str, log: str) -> None:
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"not ready in 900 s; see {log}")


def stop_all(procs: list) -> None:
    """Terminate the servers, then wait up to 60 s each (kill past that)."""
    for pr in procs:
        pr.terminate()
    for pr in procs:
        try:
            pr.wait(60)
        except subprocess.TimeoutExpired:
            pr.kill()


def stream(client, base: str, text: str, max_tokens: int, ours: bool) -> dict:
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if ours:
        body |= {"speculative": {"method": "ar"}, "return_token_ids": True}
    times, toks, pieces = [], 0, []
    t0 = time.perf_counter()
    with client.stream("POST", base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"])
            ch = ev["choices"][0] if ev.get("choices") else {}
            n = len(ch.get("token_ids") or []) if ours else (1 if ch.get("text") else 0)
            if n:
                now = time.perf_counter()
                times += [now] * n
                toks += n
                pieces.append(ch.get("text", ""))
    wall = time.perf_counter() - t0
    decode = (toks - 1) / (times[-1] - times[0]) if toks > 2 and times[-1] > times[0] else None
    return {"tokens": toks, "wall_s": round(wall, 4), "ttft_s": round(times[0] - t0, 4) if times else None,
            "decode_tokens_per_s": round(decode, 3) if decode else None,
            "e2e_tokens_per_s": round(toks / wall, 3), "text": "".join(pieces)}


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The protocol's flags (shared with ``2026-12-05-serving-overhead/ab_arms.py``)."""
    ap.add_argument("--datasets", nargs="+", default=["gsm8k", "mt-bench"])
    ap.add_argument("--prompts", type=int, default=8, help="per dataset")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--serve-args", default="", help="extra flags for dartree serve (default: none)")
    ap.add_argument("--out", required=True)


def chat_prompts(datasets: list[str], n: int) -> list[tuple[str, str, str]]:
    """``(dataset, uid, chat-templated text)`` of the first ``n`` prompts of each dataset."""
    from transformers import AutoTokenizer

    target = resolve_target("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(str(target))
    return [(ds, uid, tok.decode(ids)) for ds in datasets for uid, ids in _prompts(target, [ds], n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    add_common_args(ap)
    a = ap.parse_args()
    prompts = chat_prompts(a.datasets, a.prompts)
    port, vport, dport, lport = free_loopback_ports(4)
    gguf = default_gguf()
    ours_cmd = [sys.executable, "-m", "services.serve", "--port", str(port), "--verifier-metrics-port", str(vport),
                "--drafter-metrics-port", str(dport), *a.serve_args.split()]
    llama_cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", str(a.threads),
                 "--n_threads_batch", str(a.threads), "--n_ctx", "4096", "--port", str(lport), "--host", "127.0.0.1"]
    out_dir = Path(a.out).resolve().parent
    procs = []
    try:
        t0 = time.monotonic()
        procs.append(subprocess.Popen(ours_cmd, stdout=open(out_dir / "serve.log", "w"), stderr=subprocess.STDOUT,
                                      cwd=REPO))
        wait_ready(procs[-1], f"http://127.0.0.1:{port}/health/ready", "serve.log")
        print(f"dartree serve ready in {time.monotonic() - t0:.0f} s", flush=True)
        procs.append(subprocess.Popen(llama_cmd, stdout=open(out_dir / "llama-server.log", "w"),
                                      stderr=subprocess.STDOUT))
        wait_ready(procs[-1], f"http://127.0.0.1:{lport}/v1/models", "llama-server.log")
        bases = {"dartree": f"http://127.0.0.1:{port}", "llama.cpp": f"http://127.0.0.1:{lport}"}
        rows = []
        with httpx.Client(timeout=600) as client:
            for name, base in bases.items():  # warm-up
                stream(client, base, prompts[-1][2], 16, name == "dartree")
            for p in range(a.passes):
                for i, (ds, uid, text) in enumerate(prompts):
                    order = ("dartree", "llama.cpp") if (i + p) % 2 == 0 else ("llama.cpp", "dartree")
                    r = {}
                    for name in order:
                        time.sleep(0.5)  # the other server's OpenMP threads back to sleep
                        r[name] = stream(client, bases[name], text, a.max_tokens, name == "dartree")
                    same = r["dartree"]["text"] == r["llama.cpp"]["text"]
                    for x in r.values():
                        x.pop("text")
                    rows.append({"dataset": ds, "uid": uid, "pass": p, "first": order[0], "same_text": same, **r})
                    d, ll = r["dartree"]["decode_tokens_per_s"], r["llama.cpp"]["decode_tokens_per_s"]
                    print(f"pass {p} {ds:9s} {uid[:14]:14s} dartree {d} llama.cpp {ll} tok/s decode "
                          f"({(d or 0) / (ll or 1):.2f}x) same text {same}", flush=True)
    finally:
        stop_all(procs)
    def pooled(arm, key):
        xs = [r[arm] for r in rows if r[arm]["decode_tokens_per_s"]]
        if key == "decode":
            return sum(x["tokens"] - 1 for x in xs) / sum((x["tokens"] - 1) / x["decode_tokens_per_s"] for x in xs)
        return sum(x["tokens"] for x in xs) / sum(x["wall_s"] for x in xs)
    summary = {}
    for key in ("decode", "e2e"):
        ours, theirs = pooled("dartree", key), pooled("llama.cpp", key)
        paired = statistics.median(r["dartree"][f"{key}_tokens_per_s"] / r["llama.cpp"][f"{key}_tokens_per_s"]
                                   for r in rows if r["dartree"]["decode_tokens_per_s"]
                                   and r["llama.cpp"]["decode_tokens_per_s"])
        summary[key] = {"dartree_tokens_per_s": round(ours, 2), "llama_cpp_tokens_per_s": round(theirs, 2),
                        "ratio_pooled": round(ours / theirs, 3), "ratio_median_paired": round(paired, 3)}
        print(f"{key}: dartree {ours:.2f} tok/s, llama.cpp {theirs:.2f} tok/s = {ours / theirs:.3f}x "
              f"(paired median {paired:.3f}x)", flush=True)
    res = {"bench": "ar-vs-llamacpp-http", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "dartree_cmd": " ".join(ours_cmd[1:]), "llama_cmd": " ".join(llama_cmd[1:]), "gguf": str(gguf),
           "threads": a.threads, "max_tokens": a.max_tokens, "passes": a.passes, "machine": _machine(),
           "summary": summary, "rows": rows}
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
