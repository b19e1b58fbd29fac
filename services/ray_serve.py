"""Scale-out on Ray Serve: N replicas of one ``dartree serve`` unit behind Ray's HTTP proxy.

Each replica (:class:`DartreeReplica`) starts one unit (gateway + verifier + drafter, on one GPU or
on CPU cores, ``services/ray_unit.py``) on free ports and proxies the OpenAI routes to it
(``/v1/completions``, ``/v1/chat/completions`` with SSE streaming passed through, ``/v1/models``,
the health routes). Ray does the rest:

- routing: Ray's request router (power of two choices on queue length), with
  ``max_ongoing_requests`` = the unit's ``--max-running`` (more wait at the proxy, not in a unit);
- autoscaling on ongoing requests (``min_replicas`` .. ``max_replicas``, ``target_ongoing_requests``);
- health: Ray calls :meth:`DartreeReplica.check_health` every ``health_check_period_s``; it runs the
  unit's ``/health/generate`` (a real 2-token generation) and raises when it fails or the unit is
  gone, and after 3 failures in a row Ray replaces the replica (a worker killed alone is restarted
  by the unit's supervisor in seconds, well within that);
- shutdown: Ray stops routing to a replica, waits for its ongoing requests, then calls ``__del__``,
  which drains the unit (SIGTERM).

Metrics: every unit serves its three Prometheus registries on its own ports; ``GET /metrics/targets``
returns them for all live replicas in Prometheus ``http_sd`` form with ``replica`` and ``process``
labels (kept by :class:`MetricsTargets`, one small deployment the replicas heartbeat into).
Ray's own metrics (``ray_serve_*``) come from Ray's metrics export port.

Entry points: ``dartree serve-ray`` (:func:`serve_ray_main`), and ``serve run
services.ray_serve:app_builder`` / ``deploy/ray/serve_config.yaml`` (:func:`app_builder`).
"""

# no ``from __future__ import annotations``: Ray Serve's class ingress hands the methods to FastAPI,
# which must see real annotations (``request: Request``), not strings
import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import threading
import time

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from services.command_line import Parser, run_command
from services.memory_plan import DEFAULT_MAX_RUNNING
from services.ray_config import (RayAppConfig, UnitSpec, add_serve_ray_args, config_from_args, config_from_cli,
                                 describe)
from services.ray_unit import Unit, UnitError, check_unit_flags, relay

log = logging.getLogger("dartree.ray")
APP_NAME = "dartree"
REPLICA_HEADER = "x-dartree-replica"


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000,
                  logging_config={"enable_access_log": False})
class MetricsTargets:
    """Which units are alive and where their registries are: replicas heartbeat here (on each health
    check); an entry not refreshed within ``ttl_s`` is dropped (a replica that died)."""

    def __init__(self, ttl_s: float = 60.0):
        self.ttl_s = ttl_s
        self._seen: dict[str, tuple[float, list[dict]]] = {}

    def register(self, replica: str, groups: list[dict]) -> None:
        self._seen[replica] = (time.monotonic(), groups)

    def unregister(self, replica: str) -> None:
        self._seen.pop(replica, None)

    def targets(self) -> list[dict]:
        """Prometheus ``http_sd`` target groups of every live replica."""
        now = time.monotonic()
        self._seen = {k: v for k, v in self._seen.items() if now - v[0] <= self.ttl_s}
        return [g for _, (_, groups) in sorted(self._seen.items()) for g in groups]


api = FastAPI(title="DARTree Serve on Ray", docs_url=None, redoc_url=None)


@serve.deployment
@serve.ingress(api)
class DartreeReplica:
    """One replica = one DARTree unit; the OpenAI routes are proxied to it (see the module docstring).

    Raises (constructor):
        UnitError: the unit failed to start (Ray retries the replica).
    """

    def __init__(self, spec: UnitSpec, targets=None, log_dir: str = ""):
        self.replica = serve.get_replica_context().replica_id.unique_id
        if spec.host == "auto":  # the node's IP: Prometheus on the cluster can scrape the unit's registries
            import ray

            spec = dataclasses.replace(spec, host=ray.util.get_node_ip_address())
        log_path = os.path.join(log_dir, f"unit-{self.replica}.log") if log_dir else None
        self.unit = Unit(spec, log_path)
        self.unit.start()
        waited = self.unit.wait_ready()
        self.targets = targets
        print(f"[dartree] replica {self.replica}: unit ready at {self.unit.base} in {waited:.1f} s "
              f"(pid {self.unit.proc.pid})", flush=True)

    def _groups(self) -> list[dict]:
        host = self.unit.spec.host if ":" not in self.unit.spec.host else f"[{self.unit.spec.host}]"
        return [{"targets": [f"{host}:{port}"], "labels": {"replica": self.replica, "process": name}}
                for name, port in self.unit.ports.items() if port]

    async def check_health(self) -> None:
        """Ray's health check: the unit's deep probe; heartbeats the metrics targets.

        Raises:
            UnitError: the probe failed or the unit is gone (Ray replaces the replica after 3 in a row).
        """
        await self.unit.check_health()
        if self.targets is not None:
            try:  # a slow or restarting registry must not make a healthy unit look sick
                await asyncio.wait_for(self.targets.register.remote(self.replica, self._groups()), timeout=5.0)
            except Exception as e:  # noqa: BLE001
                log.warning("replica %s: metrics targets heartbeat failed: %s", self.replica, e)

    async def _proxy(self, request: Request) -> Response:
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        try:
            r = await self.unit.open(request.method, path, await request.body(), dict(request.headers))
        except UnitError as e:
            return JSONResponse({"error": {"message": f"replica unavailable: {e}", "type": "service_unavailable",
                                           "param": None, "code": "replica_unavailable"}}, status_code=503,
                                headers={REPLICA_HEADER: self.replica})
        headers = {k: v for k, v in r.headers.items() if k.lower() in ("content-type", "x-request-id",
                                                                       "retry-after", "www-authenticate")}
        headers[REPLICA_HEADER] = self.replica
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(relay(r), status_code=r.status_code, headers=headers)
        body = await r.aread()
        await r.aclose()
        return Response(body, status_code=r.status_code, headers=headers)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._proxy(request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._proxy(request)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self._proxy(request)

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> Response:
        return await self._proxy(request)

    @api.api_route("/health", methods=["GET", "HEAD"])
    async def health_ready(self, request: Request) -> Response:
        """The replica's unit's ``/health`` (its readiness: 200, or 503 with the reason)."""
        return await self._proxy(request)

    @api.api_route("/health/{which}", methods=["GET", "HEAD"])
    async def health(self, which: str, request: Request) -> Response:
        return await self._proxy(request)

    @api.get("/metrics/targets")
    async def metrics_targets(self) -> Response:
        """Prometheus ``http_sd`` JSON: every live replica's gateway, verifier and drafter registries."""
        if self.targets is None:
            return JSONResponse(self._groups())
        await self.targets.register.remote(self.replica, self._groups())
        return JSONResponse(await self.targets.targets.remote())

    async def __del__(self):
        """Ray stops the replica: drain the unit (its in-flight requests finish), unregister."""
        if self.targets is not None:
            try:  # the registry may be stopped first when the whole app is deleted: do not wait for it
                await asyncio.wait_for(self.targets.unregister.remote(self.replica), timeout=2.0)
            except Exception:  # noqa: BLE001 - best effort; a stale entry expires after its ttl
                pass
        await self.unit.aclose()
        code = await asyncio.to_thread(self.unit.stop)
        print(f"[dartree] replica {self.replica}: unit stopped (exit code {code})", flush=True)


# ---------------------------------------------------------------------------------- building the app
def build_app(config: RayAppConfig):
    """The Ray Serve application (``serve.run(build_app(...))``).

    Raises:
        ValueError: a bad unit flag or scale setting (one line).
    """
    args = check_unit_flags(config.unit.flags)
    opts = config.scale.deployment_options(args.max_running or DEFAULT_MAX_RUNNING, config.unit.drain_timeout_s)
    targets = MetricsTargets.bind(ttl_s=max(60.0, 6 * config.scale.health_check_period_s))
    return DartreeReplica.options(**opts).bind(config.unit, targets, config.log_dir)


def app_builder(args: dict):
    """``serve run services.ray_serve:app_builder replicas=2 unit_flags="--drafter none"`` and the
    ``deploy/ray/serve_config.yaml`` / RayService entry (keys: :func:`services.ray_config.config_from_args`).

    Raises:
        ValueError: an unknown key or a bad value (one line).
    """
    return build_app(config_from_args(args))


# ---------------------------------------------------------------------------------- dartree serve-ray
def serve_ray_main(a: argparse.Namespace) -> int:
    """``dartree serve-ray``: start (or join) Ray, run the app, block until SIGINT/SIGTERM, then drain.

    Raises:
        ValueError: a bad setting (one line), before Ray starts.
    """
    import ray

    from services.serve_plan import check_listen

    config = config_from_cli(a)
    app = build_app(config)
    if not a.ray_address:
        check_listen(a.http_host, a.http_port, "--http-port", "--http-host")
    ray.init(address=a.ray_address or None, include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": a.http_host, "port": a.http_port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        print(f"[dartree] serving on http://{a.http_host}:{a.http_port}/v1 through Ray Serve "
              f"({describe(config.scale)}; metrics targets at /metrics/targets)", flush=True)
        stop.wait()
        print("[dartree] draining the replicas", flush=True)
        serve.delete(APP_NAME)
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    """``python -m services.ray_serve FLAGS``: the same as ``dartree serve-ray FLAGS``."""
    parser = Parser(prog="dartree serve-ray", description="N units behind Ray Serve")
    add_serve_ray_args(parser)
    return run_command(serve_ray_main, parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
