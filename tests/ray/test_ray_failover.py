"""Ray Serve scale-out under faults and load (``slow``: several minutes on 2 cores).

- kill -9 of one unit's verifier while 4 clients send requests (2 streaming): every request that had
  not started streaming is answered 200 (the replica retries it once the supervisor restarted the
  verifier); a stream cut after it started ends with an error event and ``[DONE]``; the unit serves
  again (restarted by its supervisor, or replaced by Ray if its health check failed first).
- kill -9 of a unit's supervisor (nothing restarts it): Ray's health check fails and Ray replaces the
  replica (a new replica id, two running); requests get 200 or a clean 503 meanwhile, 200 after.
- autoscaling: 1 replica -> 2 under load (target 1 ongoing request) -> back to 1 when the load stops.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from .conftest import APP_NAME, RayAppConfig, ScaleConfig, UnitSpec, replica_states, run_app, serve, unit_flags

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _listener_pid(port: int) -> int:
    """The pid listening on 127.0.0.1:``port`` (one of this test's unit processes)."""
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
            return c.pid
    raise LookupError(f"nobody listens on port {port}")


def _targets(base: str) -> dict[str, dict[str, int]]:
    groups = httpx.get(base + "/metrics/targets", timeout=30, trust_env=False).json()
    out: dict[str, dict[str, int]] = {}
    for g in groups:
        out.setdefault(g["labels"]["replica"], {})[g["labels"]["process"]] = int(g["targets"][0].rsplit(":", 1)[1])
    return out


def _wait(cond, timeout: float, what: str, period: float = 0.5):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = cond()
        if value:
            return value
        time.sleep(period)
    raise TimeoutError(f"{what} did not happen within {timeout:.0f} s (replicas: {replica_states()})")


class Load:
    """Clients sending completions at ``concurrency`` on a thread until :meth:`stop` (with ``streams``,
    every second client streams). Any non-200 answer is an error: a request that had not started
    (a non-streaming one, or a stream before its first event) must be answered."""

    def __init__(self, base: str, concurrency: int, max_tokens: int = 24, streams: bool = False):
        self.base, self.concurrency, self.max_tokens, self.streams = base, concurrency, max_tokens, streams
        self.cut_streams = 0
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _client_loop(self, c: httpx.AsyncClient, i: int) -> None:
        stream = self.streams and i % 2 == 1  # odd clients stream
        while not self._stop.is_set():
            body = {"model": "tiny", "prompt": f"load {i}", "max_tokens": self.max_tokens, "ignore_eos": True,
                    "stream": stream}
            r = await c.post("/v1/completions", json=body)
            self.statuses.append(r.status_code)
            if r.status_code != 200:
                self.errors.append(r.text[:300])
            elif stream and '"error"' in r.text:
                self.cut_streams += 1  # started streaming, then cut by the kill: allowed (an error event)
                if not r.text.rstrip().endswith("data: [DONE]"):
                    self.errors.append("a cut stream did not end with [DONE]: " + r.text[-300:])

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.base, timeout=180, trust_env=False) as c:
            await asyncio.gather(*(self._client_loop(c, i) for i in range(self.concurrency)))

    def __enter__(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(240)

    def __exit__(self, *exc):
        self.stop()


@pytest.fixture
def fresh(cluster):
    yield cluster
    if APP_NAME in serve.status().applications:
        serve.delete(APP_NAME)


def replica_ids() -> set[str]:
    """Ids of the live unit replicas (Serve names each replica actor ``...#DartreeReplica#<id>``)."""
    import ray

    actors = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"].rsplit("#", 1)[-1] for a in actors if "DartreeReplica" in a["name"]}


def _has_listener(port: int) -> bool:
    try:
        _listener_pid(port)
        return True
    except LookupError:
        return False


def _unit_serves(ports: dict[str, int]) -> bool:
    """Whether the unit on ``ports`` is ready and answers a completion itself (not through Ray)."""
    base = f"http://127.0.0.1:{ports['gateway']}"
    try:
        if httpx.get(base + "/health", timeout=5, trust_env=False).status_code != 200:
            return False
        r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "back", "max_tokens": 4},
                       timeout=60, trust_env=False)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def _healed(victim: str, ports: dict[str, int], old_verifier: int) -> str | None:
    """How the unit recovered from its verifier's death: "restart" (a new verifier process listens on
    its port and the unit answers a completion itself), "replacement" (Ray replaced the replica and
    two run), or None (not yet)."""
    try:
        restarted = _listener_pid(ports["verifier"]) != old_verifier
    except LookupError:
        restarted = False
    if restarted and _unit_serves(ports):
        return "restart"
    if victim not in replica_ids() and replica_states().get("RUNNING") == 2:
        return "replacement"
    return None


def _served_after(base: str, n: int = 6) -> list[int]:
    """Statuses of ``n`` sequential completions through Ray (after a recovery: all must be 200)."""
    return [httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": f"after {i}", "max_tokens": 4},
                       timeout=120, trust_env=False).status_code for i in range(n)]


def _unit_supervisor(gateway_port: int) -> psutil.Process:
    """The unit's supervisor: the ``python -m services.ray_unit`` process the replica started (its
    command line carries the gateway's ``--port``); nothing restarts it when it dies."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "services.ray_unit" in cmd and "--port" in cmd and cmd[cmd.index("--port") + 1] == str(gateway_port):
            return p
    raise LookupError(f"no unit supervisor with --port {gateway_port}")


def _two_replicas(base: str) -> dict[str, dict[str, int]]:
    return _wait(lambda: _targets(base) if len(_targets(base)) == 2 else None, 60, "two replicas registered")


def test_kill_9_verifier_loses_nothing_and_the_unit_serves_again(fresh, tiny):
    """kill -9 of one unit's verifier under load (2 of 4 clients streaming): every request that had not
    started is answered 200, a stream cut after it started ends with an error event and ``[DONE]``,
    and the unit serves again, whichever heals it first: its supervisor's restart of the verifier
    (the same replica answers on its own port) or Ray's replacement of the replica."""
    scale = ScaleConfig(replicas=2, num_cpus=0.5, health_check_period_s=2, health_check_timeout_s=10)
    base = run_app(fresh, RayAppConfig(UnitSpec(unit_flags(tiny[0])), scale))
    victim, ports = sorted(_two_replicas(base).items())[0]
    verifier = _listener_pid(ports["verifier"])
    with Load(base, 4, streams=True) as load:
        _wait(lambda: len(load.statuses) >= 4, 120, "answers before the kill")
        os.kill(verifier, signal.SIGKILL)
        healed = _wait(lambda: _healed(victim, ports, verifier), 180, "the unit serving again")
        seen = len(load.statuses)
        _wait(lambda: len(load.statuses) >= seen + 4, 120, "answers after the recovery")
    assert not load.errors, load.errors[:3]
    assert all(s == 200 for s in load.statuses), sorted(set(load.statuses))
    assert healed in ("restart", "replacement")
    assert _served_after(base) == [200] * 6


def test_a_unit_that_cannot_heal_is_replaced_by_ray(fresh, tiny):
    """kill -9 of a unit's supervisor: no process restarts it, the replica's health check fails and Ray
    replaces the replica (a new replica id, two running). Meanwhile requests are answered or get a
    clean 503 (never a hang or another status); afterwards every request is answered; the dead unit's
    workers exit with their supervisor (nothing listens on its ports)."""
    scale = ScaleConfig(replicas=2, num_cpus=0.5, health_check_period_s=2, health_check_timeout_s=10)
    base = run_app(fresh, RayAppConfig(UnitSpec(unit_flags(tiny[0])), scale))
    victim, ports = sorted(_two_replicas(base).items())[0]
    supervisor = _unit_supervisor(ports["gateway"])
    with Load(base, 2) as load:
        _wait(lambda: len(load.statuses) >= 2, 120, "answers before the kill")
        supervisor.kill()
        _wait(lambda: victim not in replica_ids() and replica_states().get("RUNNING") == 2, 180,
              "the replacement of the dead replica")
    assert load.statuses and all(s in (200, 503) for s in load.statuses), sorted(set(load.statuses))
    assert _served_after(base) == [200] * 6
    assert victim not in _two_replicas(base)
    _wait(lambda: not any(_has_listener(p) for p in ports.values() if p), 60, "the dead unit's workers exiting")


def test_autoscaling_from_one_to_two_replicas_under_load_and_back(fresh, tiny):
    scale = ScaleConfig(min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=1,
                        downscale_delay_s=5, num_cpus=0.5, health_check_period_s=2, health_check_timeout_s=20)
    base = run_app(fresh, RayAppConfig(UnitSpec(unit_flags(tiny[0])), scale))
    assert replica_states().get("RUNNING") == 1
    with Load(base, 6) as load:
        _wait(lambda: replica_states().get("RUNNING") == 2, 180, "the scale-up to 2 replicas")
    assert load.statuses and not load.errors, load.errors[:3]
    _wait(lambda: replica_states() == {"RUNNING": 1}, 180, "the scale-down to 1 replica")
    r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4}, timeout=60,
                   trust_env=False)
    assert r.status_code == 200, r.text
