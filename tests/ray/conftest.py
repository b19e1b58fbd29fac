"""A local Ray cluster per Ray test module (2 CPUs, loopback, no dashboard) and helpers to run the app.

Every test here skips, with the reason, when ray[serve] is not installed.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray", reason="ray[serve] is not installed (pip install -r requirements-ray.txt)")
serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install -r requirements-ray.txt)")

from services.ray_config import RayAppConfig, ScaleConfig, UnitSpec  # noqa: E402
from services.ray_serve import APP_NAME, REPLICA_HEADER, build_app  # noqa: E402
from services.runtime import free_loopback_ports  # noqa: E402
from tests.service.tiny import TINY_FLAGS, make_tiny_models  # noqa: E402

__all__ = ["APP_NAME", "REPLICA_HEADER", "RayAppConfig", "ScaleConfig", "UnitSpec", "run_app", "serve", "unit_flags",
           "replica_states"]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return make_tiny_models(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster per test module (2 CPUs, no dashboard, loopback; stopped after the module, so
    no Ray process outlives the Ray tests) and Serve's proxy on a free port; its URL."""
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="WARNING",
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}})
    for attempt in range(3):  # a port free when chosen can still be taken before the proxy binds it
        (port,) = free_loopback_ports(1)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            break
        except Exception:  # noqa: BLE001 - Ray wraps the bind error in its own task error
            serve.shutdown()
            if attempt == 2:
                raise
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def unit_flags(target_dir: Path, *extra: str) -> tuple[str, ...]:
    return (*TINY_FLAGS, "--target", str(target_dir), "--drafter", "none", "--max-running", "4",
            "--drain-timeout-s", "20", *extra)


def run_app(base: str, config: RayAppConfig, timeout: float = 240.0) -> str:
    """``serve.run`` the app and wait until the proxy routes to it; the base URL."""
    serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if httpx.get(base + "/health/ready", timeout=5, trust_env=False).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the Ray app was not ready within {timeout:.0f} s: {serve.status()}")


def replica_states() -> dict[str, int]:
    """``{"RUNNING": n, ...}`` of the unit deployment of the app (empty when the app is gone)."""
    app = serve.status().applications.get(APP_NAME)
    if app is None or "DartreeReplica" not in app.deployments:
        return {}
    return {str(getattr(k, "value", k)): v for k, v in app.deployments["DartreeReplica"].replica_states.items()}
