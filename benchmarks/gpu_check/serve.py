"""The served part of ``gpu_check``: ``dartree serve`` on a tiny random-weight model, 8 concurrent streams.

Question answered: on this machine, do the gateway, the verifier and the drafter, started as a user
starts them (``python -m services.serve``, the entry of ``dartree serve``: a supervisor and its
worker processes, the drafter in its own process: ``--drafter-placement process``), serve 8
concurrent streamed completions at T = 0 whose token ids equal plain decoding (``"speculative":
{"method": "ar"}``) on the same server, and how long does the server take to be ready? On a CUDA
device the two workers share feature tensors over CUDA IPC (``--cuda-ipc``); on the CPU they use
the normal frame transport. The model is :func:`services.tiny_models.make_tiny_models` (byte-level
tokenizer, a 4-layer llama target and its DARTree drafter, random weights) in a scratch folder.

With an MPS control daemon on the machine (``nvidia-cuda-mps-control``) the served part runs twice
on a CUDA device: without MPS, then with a private MPS daemon (its own pipe and log folders, given
to the server through ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``), stopped afterwards.

Everything the check starts is stopped at the end: SIGTERM to the supervisor (the drain), then
SIGKILL to the supervisor and every worker process it had started that is still alive.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ("The quick brown fox", "Hello world, this is", "Emoji party time", "STOP here. END of",
           "你好，世界", "A test of the server", "jumps over the lazy dog", "This is a test.")
SPEC_METHOD = "dartree-pruned"
MPS_CONTROL = "nvidia-cuda-mps-control"


def serve_command(device: str, target: Path, drafter: Path, ports: tuple[int, int, int]) -> list[str]:
    """The ``dartree serve`` command line (as ``python -m services.serve``) for the tiny pair on ``ports``
    (gateway, verifier metrics, drafter metrics): the drafter in its own process, 8 running requests."""
    port, vport, dport = ports
    cmd = [sys.executable, "-m", "services.serve", "--port", str(port), "--verifier-metrics-port", str(vport),
           "--drafter-metrics-port", str(dport), "--target", str(target), "--drafter", str(drafter),
           "--device", device, "--drafter-placement", "process", "--served-model-name", "tiny",
           "--default-temperature", "0", "--max-running", str(len(PROMPTS)), "--budget", "8"]
    return cmd + (["--cuda-ipc"] if device.startswith("cuda") else [])


def descendants(pid: int) -> dict[int, str]:
    """``{pid: comm}`` of every live descendant of ``pid`` (Linux ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    names = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        children.setdefault(int(rest[1]), []).append(int(stat.parent.name))
        names[int(stat.parent.name)] = name
    out, todo = {}, list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out[p] = names.get(p, "?")
        todo += children.get(p, [])
    return out


def stop_all(proc: subprocess.Popen, workers: dict[int, str], drain_s: float = 20.0) -> list[str]:
    """SIGTERM the supervisor, wait ``drain_s``, then SIGKILL it and any of ``workers`` (pids it had
    started) still alive; returns the names of the processes that had to be killed."""
    killed = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(drain_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            killed.append("supervisor")
    settle = time.monotonic() + 3.0  # workers exit with their supervisor: give them a moment
    while time.monotonic() < settle and any(Path(f"/proc/{pid}").exists() for pid in workers):
        time.sleep(0.1)
    for pid, name in workers.items():
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/comm").read_text().strip() != name[:15]:
                continue  # the pid was reused by another process
            os.kill(pid, signal.SIGKILL)
            killed.append(name)
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    return killed


def wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> float:
    """Poll ``/health/ready`` until 200; seconds waited.

    Raises:
        RuntimeError: the supervisor exited; TimeoutError: not ready within ``timeout`` s.
    """
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(base + "/health/ready", timeout=2, trust_env=False).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the server was not ready within {timeout:.0f} s")


async def stream_one(client, base: str, prompt: str, method: str, max_tokens: int) -> list[int]:
    """One streamed completion at T = 0; its token ids.

    Raises:
        RuntimeError: a non-200 answer or an error event (its message).
    """
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "return_token_ids": True, "ignore_eos": True, "speculative": {"method": method}}
    ids: list[int] = []
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"error event: {ev['error'].get('message')}")
            for ch in ev.get("choices") or []:
                ids += ch.get("token_ids") or []
    return ids


async def concurrent_streams(base: str, method: str, max_tokens: int, timeout: float) -> dict:
    """:data:`PROMPTS` as concurrent streams of ``method``: ``ids`` per prompt, wall seconds, tokens/s.

    Raises:
        asyncio.TimeoutError: not all answered within ``timeout`` s; RuntimeError: a request failed.
    """
    import httpx

    limits = httpx.Limits(max_connections=len(PROMPTS) + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        ids = await asyncio.wait_for(asyncio.gather(*(stream_one(client, base, p, method, max_tokens)
                                                      for p in PROMPTS)), timeout)
        wall = time.perf_counter() - t0
    tokens = sum(len(x) for x in ids)
    return {"method": method, "ids": list(ids), "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


def compare(ar: dict, spec: dict) -> dict:
    """Token-for-token comparison of the ``spec`` streams with the ``ar`` streams of the same prompts."""
    mismatches = []
    for prompt, a, s in zip(PROMPTS, ar["ids"], spec["ids"]):
        if a != s:
            first = next((i for i, (x, y) in enumerate(zip(a, s)) if x != y), min(len(a), len(s)))
            mismatches.append({"prompt": prompt, "ar_tokens": len(a), "spec_tokens": len(s), "first_difference": first})
    return {"requests": len(PROMPTS), "equal": len(PROMPTS) - len(mismatches), "mismatches": mismatches}


def served_run(device: str, models: tuple[Path, Path], work: Path, max_tokens: int, timeout: float,
               env: dict[str, str] | None = None) -> dict:
    """One server start, the ``ar`` and ``dartree-pruned`` streams, the stop (module docstring).

    Returns:
        ``status`` (``ok`` when every stream equals plain decoding, else ``failed`` / ``error``),
        ``ready_s``, ``processes`` (worker names), ``pids`` (supervisor first), ``transport``,
        per-method ``wall_s`` / ``tokens`` / ``tokens_per_s``, the comparison, ``killed`` and, when
        not ok, the ``error`` and the log tail.
    """
    from services.runtime import free_loopback_ports

    ports = tuple(free_loopback_ports(3))
    base, log = f"http://127.0.0.1:{ports[0]}", work / f"serve-{ports[0]}.log"
    res: dict = {"device": device, "transport": "cuda_ipc" if device.startswith("cuda") else "frames",
                 "spec_method": SPEC_METHOD, "max_tokens": max_tokens, "concurrent": len(PROMPTS)}
    deadline = time.monotonic() + timeout
    with open(log, "w") as out:
        proc = subprocess.Popen(serve_command(device, *models, ports), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)
    workers: dict[int, str] = {}
    try:
        res["ready_s"] = wait_ready(base, proc, timeout)
        workers = descendants(proc.pid)
        res["processes"] = sorted(set(workers.values()))
        res["pids"] = [proc.pid, *sorted(workers)]
        runs = {m: asyncio.run(concurrent_streams(base, m, max_tokens, max(5.0, deadline - time.monotonic())))
                for m in ("ar", SPEC_METHOD)}
        res.update({m: {k: v for k, v in r.items() if k != "ids"} for m, r in runs.items()})
        res.update(compare(runs["ar"], runs[SPEC_METHOD]))
        res["status"] = "ok" if not res["mismatches"] else "failed"
    except Exception as e:  # noqa: BLE001 (reported in the JSON; the check goes on)
        res.update(status="error", error=f"{type(e).__name__}: {e}"[:500])
    finally:
        workers.update(descendants(proc.pid) if proc.poll() is None else {})
        res["killed"] = stop_all(proc, workers)
    if res["status"] != "ok":
        res["log_tail"] = log.read_text(errors="replace")[-3000:]
    return res


def mps_daemon(work: Path) -> tuple[dict[str, str], callable]:
    """Start a private MPS control daemon; returns the environment that points a process at it and the
    function that stops it.

    Raises:
        RuntimeError: the daemon did not start (its output).
    """
    pipe, logs = work / "mps-pipe", work / "mps-log"
    pipe.mkdir(exist_ok=True)
    logs.mkdir(exist_ok=True)
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    r = subprocess.run([MPS_CONTROL, "-d"], env={**os.environ, **env}, capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise RuntimeError(f"{MPS_CONTROL} -d failed ({r.returncode}): {(r.stdout + r.stderr).strip()[:300]}")

    def stop() -> None:
        subprocess.run([MPS_CONTROL], input="quit\n", env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=30)

    return env, stop


def served_check(device: str, max_tokens: int, timeout: float) -> dict:
    """The served part: one run, and a second under MPS where the machine has it (module docstring).

    Returns:
        ``{"runs": [run, ...], "mps": {"status": ...}, "status": "ok" | "failed" | "error"}``; each run as
        :func:`served_run`, with ``"mps": true/false``.
    """
    from services.tiny_models import make_tiny_models

    work = Path(tempfile.mkdtemp(prefix="dartree-gpucheck-serve-"))
    try:
        models = make_tiny_models(work / "models")
        runs = [{**served_run(device, models, work, max_tokens, timeout), "mps": False}]
        mps = mps_status(device)
        if mps["status"] == "available":
            try:
                env, stop = mps_daemon(work)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                mps = {"status": "error", "reason": f"{type(e).__name__}: {e}"[:300]}
            else:
                try:
                    runs.append({**served_run(device, models, work, max_tokens, timeout, env), "mps": True})
                finally:
                    stop()
                mps = {"status": "measured"}
        status = "ok" if all(r["status"] == "ok" for r in runs) else (
            "error" if any(r["status"] == "error" for r in runs) else "failed")
        return {"status": status, "runs": runs, "mps": mps}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def mps_status(device: str) -> dict:
    """``available`` on a CUDA device with ``nvidia-cuda-mps-control`` on the PATH, else ``not available``
    and why."""
    if not device.startswith("cuda"):
        return {"status": "not available", "reason": f"not a CUDA device ({device})"}
    if shutil.which(MPS_CONTROL) is None:
        return {"status": "not available", "reason": f"{MPS_CONTROL} is not on the PATH"}
    return {"status": "available"}
