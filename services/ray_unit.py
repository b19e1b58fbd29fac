"""One ``dartree serve`` unit as a child process of a Ray Serve replica, and the HTTP proxy to it.

Ray-free and torch-free (``services/ray_serve.py`` wraps it in a deployment; the tests drive it
directly too). Functions and classes::

    UnitSpec(flags, host, ...)                  # what to start: ``dartree serve`` flags + where it listens
    check_unit_flags(flags) -> argparse.Namespace   # ValueError (one line) on a bad or reserved flag
    Unit(spec)                                  # start(), wait_ready(), proxy(), check_health(), stop()
    main(argv)                                  # ``python -m services.ray_unit --parent-pid N -- FLAGS``

A unit owns its ports (free ones on ``host``, picked at start) and, through ``dartree serve``, its
own private ipc runtime directory (``services.wire.runtime_dir(unique=True)``, named by the
supervisor's pid), so several units on one host never share a socket. The child watches its parent
(the replica): when the replica dies without stopping it, the unit drains itself (SIGTERM).

Retries: a request whose answer has not started (a transport error, or a 503 whose code says the
engine is restarting or not ready, :data:`RETRY_CODES`) is sent again once the unit is ready, within ``retry_budget_s``: the
supervisor restarts a worker killed with ``kill -9`` in seconds, and a request that had not started
streaming is then answered instead of lost. A stream that has started is never retried (its error
event reaches the client as the unit sent it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.memory_plan import DEFAULT_MAX_RUNNING

REPO = Path(__file__).resolve().parents[1]
# flags the replica sets itself (each unit gets free ports); passing one is a one-line error
RESERVED_FLAGS = ("--port", "--host", "--verifier-metrics-port", "--drafter-metrics-port", "--metrics-host",
                  "--verifier-endpoint", "--drafter-endpoint")
# 503 codes of the gateway that mean the request did not start because the engine is (re)starting
# (``service_unavailable``: refused at admission while not ready): safe to send the request again
RETRY_CODES = frozenset({"engine_unavailable", "engine_restarted", "service_unavailable"})
# request headers passed to the unit (the rest, e.g. Ray's own, stay behind)
FORWARD_HEADERS = ("authorization", "content-type", "accept", "x-request-id")


@dataclass(frozen=True)
class UnitSpec:
    """What a replica starts.

    Attributes:
        flags: ``dartree serve`` flags (``--target DIR``, ``--drafter none``, ``--max-running 4``, ...),
            without the reserved address flags (:data:`RESERVED_FLAGS`).
        host: address the unit's gateway and metrics listen on (loopback by default; a node IP on a
            cluster, so Prometheus can scrape the unit's registries; "auto": the replica's node IP).
        startup_timeout_s: seconds to wait for ``/health/ready`` (model conversion and loading included).
        retry_budget_s: how long a request that has not started is retried while the unit recovers.
        health_timeout_s: deadline of one ``/health/generate`` probe.
        drain_timeout_s: SIGTERM drain budget of the unit (its in-flight requests finish), then SIGKILL.
        env: extra environment of the unit.
    """

    flags: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    startup_timeout_s: float = 900.0
    retry_budget_s: float = 60.0
    health_timeout_s: float = 20.0
    drain_timeout_s: float = 30.0
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        check_unit_flags(self.flags)
        if self.startup_timeout_s <= 0 or self.retry_budget_s < 0 or self.health_timeout_s <= 0:
            raise ValueError("startup_timeout_s and health_timeout_s must be > 0 and retry_budget_s >= 0")


def check_unit_flags(flags: tuple[str, ...] | list[str]) -> argparse.Namespace:
    """Parse ``flags`` as ``dartree serve`` would; the parsed namespace.

    Raises:
        ValueError: an unknown or malformed flag, or one of :data:`RESERVED_FLAGS` (one line).
    """
    from services.serve import add_serve_args

    for f in flags:
        if f.split("=", 1)[0] in RESERVED_FLAGS:
            raise ValueError(f"{f.split('=', 1)[0]} is set by each replica (every unit gets its own free ports)")
    parser = argparse.ArgumentParser(prog="dartree serve", add_help=False, exit_on_error=False)
    add_serve_args(parser)
    try:
        args, unknown = parser.parse_known_args(list(flags))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(f"bad unit flag: {e}") from None
    if unknown:
        raise ValueError(f"unknown dartree serve flag(s) for the unit: {' '.join(unknown)}")
    return args


def free_ports(host: str, n: int) -> list[int]:
    """``n`` distinct TCP ports free on ``host`` right now."""
    import socket

    socks = [socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class UnitError(RuntimeError):
    """The unit did not start, or is gone."""


class Unit:
    """One ``dartree serve`` child process on free ports, and an async HTTP client to its gateway.

    Attributes:
        base: the gateway's URL; ports: ``{"gateway", "verifier", "drafter"}`` (drafter 0 without one).
    """

    def __init__(self, spec: UnitSpec, log_path: str | Path | None = None):
        self.spec = spec
        args = check_unit_flags(spec.flags)
        self.has_drafter = args.drafter != "none"
        self.max_running = args.max_running or DEFAULT_MAX_RUNNING  # unset: the CPU default (CUDA plans its own)
        gw, vm, dm = free_ports(spec.host, 3)
        self.ports = {"gateway": gw, "verifier": vm, "drafter": dm if self.has_drafter else 0}
        self._drafter_port = dm  # passed even without a drafter (then unused)
        shown = f"[{spec.host}]" if ":" in spec.host else spec.host
        self.base = f"http://{shown}:{gw}"
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self._client: httpx.AsyncClient | None = None

    # ------------------------------------------------------------------------------ lifecycle
    def command(self) -> list[str]:
        """The unit's command line (the parent-watching launcher around ``dartree serve``)."""
        return [sys.executable, "-m", "services.ray_unit", "--parent-pid", str(os.getpid()), "--",
                "--host", self.spec.host, "--metrics-host", self.spec.host, "--port", str(self.ports["gateway"]),
                "--verifier-metrics-port", str(self.ports["verifier"]),
                "--drafter-metrics-port", str(self._drafter_port),
                "--drain-timeout-s", str(self.spec.drain_timeout_s), *self.spec.flags]

    def start(self) -> None:
        """Spawn the unit (returns at once; :meth:`wait_ready` waits)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.spec.env}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.command(), cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        finally:
            if self.log_path:
                out.close()

    def wait_ready(self) -> float:
        """Block until ``/health/ready`` is 200; seconds waited.

        Raises:
            UnitError: the unit exited, or was not ready within ``startup_timeout_s`` (then it is stopped).
        """
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.spec.startup_timeout_s:
            if self.proc is None or self.proc.poll() is not None:
                raise UnitError(f"the unit exited with code {self.proc.returncode if self.proc else None}"
                                f"{self._log_hint()}")
            try:
                if httpx.get(self.base + "/health/ready", timeout=2, trust_env=False).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise UnitError(f"the unit was not ready within {self.spec.startup_timeout_s:.0f} s{self._log_hint()}")

    def _log_hint(self) -> str:
        if not self.log_path or not self.log_path.is_file():
            return ""
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:]
        return f": {tail[0]}" if tail else ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM (the unit drains: in-flight requests finish), SIGKILL after ``timeout`` (default: the
        drain budget + 20 s); the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.spec.drain_timeout_s + 20 if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(base_url=self.base, timeout=httpx.Timeout(None, connect=5.0),
                                             limits=limits, trust_env=False)
        return self._client

    # ------------------------------------------------------------------------------ health
    async def check_health(self) -> None:
        """The deep probe: ``/health/generate`` (a 2-token generation through the unit).

        Raises:
            UnitError: the unit exited, or the probe failed (status and reason in the message).
        """
        if not self.alive:
            raise UnitError(f"the unit exited with code {self.proc.returncode if self.proc else None}")
        try:
            r = await self.client.get("/health/generate", timeout=self.spec.health_timeout_s)
        except httpx.HTTPError as e:
            raise UnitError(f"/health/generate failed: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise UnitError(f"/health/generate answered {r.status_code}: {r.text[:200]}")

    async def _wait_ready_async(self, deadline: float) -> bool:
        while time.monotonic() < deadline and self.alive:
            with contextlib.suppress(httpx.HTTPError):
                if (await self.client.get("/health/ready", timeout=2)).status_code == 200:
                    return True
            await asyncio.sleep(0.2)
        return False

    # ------------------------------------------------------------------------------ proxy
    async def open(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        """Send a request to the unit and return the response with its body not yet read (the caller
        streams it and must ``aclose`` it). A request that has not started is retried (see the module
        docstring) while the unit recovers.

        Raises:
            UnitError: the unit is gone or did not recover within ``retry_budget_s`` (never started).
        """
        deadline = time.monotonic() + self.spec.retry_budget_s
        fwd = {k: v for k, v in headers.items() if k.lower() in FORWARD_HEADERS}
        last = "no attempt"
        while True:
            try:
                r = await self.client.send(self.client.build_request(method, path, content=body, headers=fwd),
                                           stream=True)
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code != 503:
                    return r
                raw = await r.aread()
                await r.aclose()
                code = _error_code(raw)
                if code not in RETRY_CODES:
                    return httpx.Response(503, content=raw, headers={"content-type": "application/json"})
                last = f"503 {code}"
            if not await self._wait_ready_async(deadline):
                raise UnitError(f"the unit did not recover within {self.spec.retry_budget_s:.0f} s ({last})")


def _error_code(raw: bytes) -> str | None:
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return json.loads(raw)["error"]["code"]
    return None


async def relay(r: httpx.Response) -> AsyncIterator[bytes]:
    """The response body as it arrives (SSE events pass through unchanged); closes ``r`` at the end,
    also when the client goes away (the unit then sees the disconnect and aborts the request)."""
    try:
        async for chunk in r.aiter_raw():
            yield chunk
    finally:
        await r.aclose()


# ---------------------------------------------------------------------------------- child launcher
def _watch_parent(parent_pid: int, period_s: float = 1.0) -> None:
    """SIGTERM this process (the supervisor drains) once ``parent_pid`` is no longer our parent."""
    while True:
        time.sleep(period_s)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)
            return


def main(argv: list[str] | None = None) -> int:
    """``python -m services.ray_unit --parent-pid N -- SERVE_FLAGS``: ``dartree serve`` that drains
    itself when its parent (the Ray replica) dies."""
    ap = argparse.ArgumentParser(prog="python -m services.ray_unit")
    ap.add_argument("--parent-pid", type=int, required=True, help="pid of the replica that owns this unit")
    ap.add_argument("flags", nargs=argparse.REMAINDER, help="dartree serve flags (after --)")
    a = ap.parse_args(argv)
    flags = a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    threading.Thread(target=_watch_parent, args=(a.parent_pid,), daemon=True, name="parent-watch").start()
    from services.serve import main as serve_main

    return serve_main(flags)


if __name__ == "__main__":
    sys.exit(main())
