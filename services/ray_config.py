"""Settings of the Ray Serve scale-out (``dartree serve-ray``), without importing Ray.

``ScaleConfig`` (replicas, autoscaling, resources, health checks), ``RayAppConfig`` (unit + scale),
the ``serve-ray`` flags and their parsing; ``services/ray_serve.py`` builds the application from them.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import asdict, dataclass, field

from services.ray_unit import UnitSpec

__all__ = ["RayAppConfig", "ScaleConfig", "UnitSpec", "add_serve_ray_args", "config_from_args", "config_from_cli",
           "describe"]


@dataclass(frozen=True)
class ScaleConfig:
    """How many units, on what, and how Ray watches them.

    Attributes:
        replicas: fixed replica count (ignored when ``max_replicas`` is set: autoscaling).
        min_replicas, max_replicas: autoscaling bounds (``max_replicas`` 0 = no autoscaling).
        target_ongoing_requests: autoscaling target of ongoing requests per replica.
        upscale_delay_s, downscale_delay_s: how long the autoscaler waits before acting.
        num_cpus, num_gpus: Ray resources of one replica (its unit runs in the replica's share; one GPU
            per unit on GPU nodes).
        max_ongoing_requests: requests routed to one replica at once (0 = the unit's ``--max-running``).
        health_check_period_s, health_check_timeout_s: Ray's health check of a replica.
        graceful_shutdown_timeout_s: how long Ray lets a stopping replica drain (0 = unit drain + 30 s).
    """

    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int = 0
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_ongoing_requests: int = 0
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    graceful_shutdown_timeout_s: float = 0.0

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1 (got {self.replicas})")
        if self.max_replicas and not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= --min-replicas <= --max-replicas (got {self.min_replicas}, "
                             f"{self.max_replicas})")
        if self.max_replicas < 0 or self.target_ongoing_requests <= 0:
            raise ValueError("--max-replicas must be >= 0 and --target-ongoing-requests > 0")
        if self.num_cpus < 0 or self.num_gpus < 0 or self.max_ongoing_requests < 0:
            raise ValueError("--num-cpus, --num-gpus and --max-ongoing-requests must be >= 0")
        if self.health_check_period_s <= 0 or self.health_check_timeout_s <= 0:
            raise ValueError("health check period and timeout must be > 0")

    def deployment_options(self, unit_max_running: int, drain_timeout_s: float) -> dict:
        """Keyword arguments of ``Deployment.options`` for these settings."""
        opts = dict(ray_actor_options={"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
                    max_ongoing_requests=self.max_ongoing_requests or unit_max_running,
                    health_check_period_s=self.health_check_period_s,
                    health_check_timeout_s=self.health_check_timeout_s,
                    graceful_shutdown_timeout_s=self.graceful_shutdown_timeout_s or drain_timeout_s + 30)
        if self.max_replicas:
            opts["autoscaling_config"] = dict(min_replicas=self.min_replicas, max_replicas=self.max_replicas,
                                              initial_replicas=max(self.min_replicas, 1),
                                              target_ongoing_requests=self.target_ongoing_requests,
                                              upscale_delay_s=self.upscale_delay_s,
                                              downscale_delay_s=self.downscale_delay_s)
        else:
            opts["num_replicas"] = self.replicas
        return opts


@dataclass(frozen=True)
class RayAppConfig:
    """One Ray Serve application: the unit, the scaling, where replicas write their unit logs."""

    unit: UnitSpec = field(default_factory=UnitSpec)
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    log_dir: str = ""


# ---------------------------------------------------------------------------------- dartree serve-ray
def add_serve_ray_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``dartree serve-ray``; everything after ``--`` is passed to each unit's ``dartree serve``."""
    d = ScaleConfig()
    p.add_argument("--replicas", type=int, default=d.replicas, help="fixed number of units (default: 1)")
    p.add_argument("--min-replicas", type=int, default=d.min_replicas, help="autoscaling lower bound (default: 1)")
    p.add_argument("--max-replicas", type=int, default=d.max_replicas,
                   help="autoscaling upper bound; > 0 turns autoscaling on (default: 0, off)")
    p.add_argument("--target-ongoing-requests", type=float, default=d.target_ongoing_requests,
                   help="autoscaling target: ongoing requests per replica (default: 2)")
    p.add_argument("--num-cpus", type=float, default=d.num_cpus, help="CPUs reserved per replica (default: 1)")
    p.add_argument("--num-gpus", type=float, default=d.num_gpus, help="GPUs per replica (default: 0; 1 on GPU nodes)")
    p.add_argument("--max-ongoing-requests", type=int, default=0,
                   help="requests routed to one replica at once (default: the unit's --max-running)")
    p.add_argument("--health-check-period-s", type=float, default=d.health_check_period_s,
                   help="seconds between Ray's /health/generate checks of a replica (default: 10)")
    p.add_argument("--http-host", default="127.0.0.1", help="Ray Serve HTTP proxy address (default: 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=8000, help="Ray Serve HTTP proxy port (default: 8000)")
    p.add_argument("--unit-host", default="127.0.0.1",
                   help="address each unit listens on (its metrics too; a node IP on a cluster)")
    p.add_argument("--ray-address", default="",
                   help="Ray cluster to join ('auto' = the running one; default: start a local one)")
    p.add_argument("--log-dir", default="", help="directory for each unit's log (default: discard)")
    p.add_argument("unit_flags", nargs=argparse.REMAINDER,
                   help="-- then dartree serve flags for every unit (e.g. -- --drafter none --max-running 4)")


def config_from_cli(a: argparse.Namespace) -> RayAppConfig:
    """The app config of ``dartree serve-ray`` flags.

    Raises:
        ValueError: a bad value or unit flag (one line).
    """
    flags = a.unit_flags[1:] if a.unit_flags[:1] == ["--"] else a.unit_flags
    scale = ScaleConfig(replicas=a.replicas, min_replicas=a.min_replicas, max_replicas=a.max_replicas,
                        target_ongoing_requests=a.target_ongoing_requests, num_cpus=a.num_cpus, num_gpus=a.num_gpus,
                        max_ongoing_requests=a.max_ongoing_requests, health_check_period_s=a.health_check_period_s)
    if not 0 < a.http_port < 65536:
        raise ValueError(f"--http-port must be in 1..65535 (got {a.http_port})")
    return RayAppConfig(UnitSpec(tuple(flags), host=a.unit_host), scale, a.log_dir)


def describe(s: ScaleConfig) -> str:
    if s.max_replicas:
        return f"autoscaling {s.min_replicas}..{s.max_replicas} replicas"
    return f"{s.replicas} replica{'s' if s.replicas > 1 else ''}"


def config_from_args(args: dict) -> RayAppConfig:
    """The app config of a Ray Serve ``args`` mapping (``serve run ... key=value``, a serve config's
    ``args:``): string or typed values of :class:`ScaleConfig` fields, plus ``unit_flags`` (a
    shell-quoted string of ``dartree serve`` flags), ``unit_host`` ("auto" = the node's IP),
    ``retry_budget_s`` and ``log_dir``.

    Raises:
        ValueError: an unknown key, a bad value or a bad unit flag (one line).
    """
    args = dict(args)
    unit_kw = {"flags": tuple(shlex.split(str(args.pop("unit_flags", ""))))}
    if "unit_host" in args:
        unit_kw["host"] = str(args.pop("unit_host"))
    if "retry_budget_s" in args:
        unit_kw["retry_budget_s"] = float(args.pop("retry_budget_s"))
    log_dir = str(args.pop("log_dir", ""))
    types = {f: type(v) for f, v in asdict(ScaleConfig()).items()}
    unknown = sorted(set(args) - set(types))
    if unknown:
        raise ValueError(f"unknown app argument(s): {', '.join(unknown)} (known: {', '.join(sorted(types))}, "
                         "unit_flags, unit_host, retry_budget_s, log_dir)")
    try:
        scale = ScaleConfig(**{k: types[k](v) for k, v in args.items()})
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad app argument: {e}") from None
    return RayAppConfig(UnitSpec(**unit_kw), scale, log_dir)
