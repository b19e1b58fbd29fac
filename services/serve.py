"""``dartree serve``: start, supervise and drain the gateway, verifier and drafter processes.

Functions the CLI (``services/cli.py``) calls::

    add_serve_args(parser: argparse.ArgumentParser) -> None     # all flags of the three + supervisor
    add_gateway_args(parser: argparse.ArgumentParser) -> None
    add_verifier_args(parser: argparse.ArgumentParser) -> None
    add_drafter_args(parser: argparse.ArgumentParser) -> None
    serve_main(args: argparse.Namespace) -> int                 # blocks until stopped; exit code
    gateway_main(args: argparse.Namespace) -> int
    verifier_main(args: argparse.Namespace) -> int
    drafter_main(args: argparse.Namespace) -> int

Every flag is a field of a frozen config dataclass (``--max-running`` <-> ``max_running``) and is
also read from ``DARTREE_<FIELD>`` (``DARTREE_MAX_RUNNING=4``); a flag beats the variable.
The supervisor spawns the workers (``spawn``: safe with CUDA), waits until ``/health/ready``,
prints the URL, restarts a worker that dies (its in-flight requests end with a clean error: the
peers detect the disconnect), and on SIGINT/SIGTERM drains the gateway (503 for new requests,
in-flight ones finish within ``drain_timeout_s``) before stopping the workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
import types
import typing
import urllib.request
from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path

from gateway.config import GatewayConfig
from services.drafter.worker import DrafterWorkerConfig
from services.verifier.worker import VerifierWorkerConfig

log = logging.getLogger("dartree.serve")


@dataclass(frozen=True)
class SupervisorConfig:
    """Supervisor-only settings.

    Attributes:
        startup_timeout_s: how long to wait for readiness (model conversion and loading included).
        drain_timeout_s: SIGTERM drain budget of the gateway (and then the workers).
        max_restarts: restarts of one worker within ``restart_window_s`` before giving up.
        drafter: drafter checkpoint ("" = the default drafter if present, "none" = no drafter: AR only).
    """

    startup_timeout_s: float = 900.0
    drain_timeout_s: float = 30.0
    max_restarts: int = 5
    restart_window_s: float = 300.0
    drafter: str = ""


# ------------------------------------------------------------------------------------ config <-> CLI

def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _parser_type(tp):
    """argparse ``type`` for a field annotation (``int | None`` accepts "none")."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        inner = next(a for a in args if a is not type(None))
        return lambda s: None if s.lower() in ("none", "") else inner(s)
    return tp


def _env_default(name: str, tp, default):
    raw = os.environ.get(f"DARTREE_{name.upper()}")
    if raw is None:
        return default
    if tp is bool:
        if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise SystemExit(f"DARTREE_{name.upper()}={raw!r} is not a boolean")
        return raw.lower() in ("1", "true", "yes")
    try:
        return _parser_type(tp)(raw)
    except ValueError:
        raise SystemExit(f"DARTREE_{name.upper()}={raw!r} is not a valid {tp}") from None


def add_config_args(parser: argparse.ArgumentParser, *classes) -> None:
    """One ``--field-name`` flag per dataclass field (shared names once); env vars give defaults."""
    seen: dict[str, object] = {}
    for cls in classes:
        hints = _hints(cls)
        for f in fields(cls):
            if f.name in seen:
                continue
            seen[f.name] = f.default
            tp = hints[f.name]
            default = _env_default(f.name, tp, f.default)
            flag = "--" + f.name.replace("_", "-")
            help_text = f"(env DARTREE_{f.name.upper()}; default: {default!r})"
            if tp is bool:
                parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                    help=help_text)
            else:
                parser.add_argument(flag, dest=f.name, type=_parser_type(tp), default=default, help=help_text)


def config_from_args(cls, args: argparse.Namespace, **overrides):
    """``cls`` built from the parsed flags it has (plus ``overrides``)."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)


def add_gateway_args(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, GatewayConfig)


def add_verifier_args(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, VerifierWorkerConfig)


def add_drafter_args(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, DrafterWorkerConfig)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, GatewayConfig, VerifierWorkerConfig, DrafterWorkerConfig, SupervisorConfig)


# ---------------------------------------------------------------------------------- standalone mains

def gateway_main(args: argparse.Namespace) -> int:
    from gateway.server import run_gateway

    run_gateway(config_from_args(GatewayConfig, args))
    return 0


def verifier_main(args: argparse.Namespace) -> int:
    from services.verifier.worker import run_verifier_process

    run_verifier_process(config_from_args(VerifierWorkerConfig, args))
    return 0


def drafter_main(args: argparse.Namespace) -> int:
    from services.drafter.worker import run_drafter_process

    run_drafter_process(config_from_args(DrafterWorkerConfig, args))
    return 0


# ---------------------------------------------------------------------------------------- supervisor

def _gateway_entry(config: GatewayConfig, parent_pid: int) -> None:
    from gateway.server import run_gateway
    from services.runtime import exit_with_parent, set_process_title

    os.setpgrp()  # Ctrl-C reaches the supervisor only; it sequences the drain
    set_process_title("dartree-gateway")
    exit_with_parent(parent_pid)
    run_gateway(config)


def _verifier_entry(config: VerifierWorkerConfig, parent_pid: int) -> None:
    from services.verifier.worker import run_verifier_process

    os.setpgrp()
    run_verifier_process(config, parent_pid)


def _drafter_entry(config: DrafterWorkerConfig, parent_pid: int) -> None:
    from services.drafter.worker import run_drafter_process

    os.setpgrp()
    run_drafter_process(config, parent_pid)


@dataclass
class _Child:
    name: str
    entry: typing.Callable
    config: object
    proc: mp.process.BaseProcess | None = None
    restarts: deque = dataclasses.field(default_factory=deque)


class Supervisor:
    """Owns the child processes: start, readiness, restart on death, ordered drain."""

    def __init__(self, sup: SupervisorConfig, gateway: GatewayConfig, verifier: VerifierWorkerConfig,
                 drafter: DrafterWorkerConfig | None):
        self.sup, self.gateway_cfg = sup, gateway
        self._ctx = mp.get_context("spawn")
        children = [] if drafter is None else [_Child("drafter", _drafter_entry, drafter)]
        children += [_Child("verifier", _verifier_entry, verifier), _Child("gateway", _gateway_entry, gateway)]
        self.children = {c.name: c for c in children}
        self._stopping = False
        self._signals = 0

    @property
    def url(self) -> str:
        host = self.gateway_cfg.host if self.gateway_cfg.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.gateway_cfg.port}"

    def _spawn(self, child: _Child) -> None:
        child.proc = self._ctx.Process(target=child.entry, args=(child.config, os.getpid()),
                                       name=f"dartree-{child.name}", daemon=False)
        child.proc.start()
        log.info("started %s (pid %d)", child.name, child.proc.pid)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def run(self) -> int:
        """Start everything, wait for readiness, supervise until a stop signal; the exit code."""
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        for child in self.children.values():
            self._spawn(child)
        deadline = time.monotonic() + self.sup.startup_timeout_s
        announced = False
        code = 0
        while not self._stopping:
            if not self._reap():
                code = 1
                break
            if not announced and self.ready():
                print(f"[dartree] serving on {self.url}/v1 (OpenAI-compatible; metrics at {self.url}/metrics)",
                      flush=True)
                announced = True
            if not announced and time.monotonic() > deadline:
                log.error("not ready after %.0f s; stopping", self.sup.startup_timeout_s)
                code = 1
                break
            time.sleep(0.5)
        self.shutdown()
        return code

    def _on_signal(self, signum, frame) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second signal: stopping now")
            for child in self.children.values():
                if child.proc is not None and child.proc.is_alive():
                    child.proc.kill()
        self._stopping = True

    def _reap(self) -> bool:
        """Restart dead children; ``False`` when one died too often."""
        for child in self.children.values():
            proc = child.proc
            if proc is None or proc.is_alive() or self._stopping:
                continue
            now = time.monotonic()
            while child.restarts and now - child.restarts[0] > self.sup.restart_window_s:
                child.restarts.popleft()
            if len(child.restarts) >= self.sup.max_restarts:
                log.error("%s died %d times within %.0f s; giving up", child.name, len(child.restarts) + 1,
                          self.sup.restart_window_s)
                return False
            log.error("%s died (exit code %s); restarting it", child.name, proc.exitcode)
            child.restarts.append(now)
            self._spawn(child)
        return True

    def shutdown(self) -> None:
        """Drain the gateway first (in-flight requests finish), then stop the workers."""
        self._stopping = True
        order = ["gateway", "verifier", "drafter"]
        budgets = {"gateway": self.sup.drain_timeout_s + 10, "verifier": 15.0, "drafter": 10.0}
        for name in order:
            child = self.children.get(name)
            if child is None or child.proc is None or not child.proc.is_alive():
                continue
            log.info("stopping %s", name)
            child.proc.terminate()
            child.proc.join(budgets[name])
            if child.proc.is_alive():
                log.warning("%s did not stop in time; killing it", name)
                child.proc.kill()
                child.proc.join(5)


def _default_drafter_present() -> bool:
    from services.models.registry import DEFAULT_DRAFTER_DIR

    return (DEFAULT_DRAFTER_DIR / "config.json").is_file()


def plan(args: argparse.Namespace) -> tuple[SupervisorConfig, GatewayConfig, VerifierWorkerConfig,
                                           DrafterWorkerConfig | None, Path | None]:
    """Resolve the configs of one ``serve``: shared endpoints in a private runtime dir, the target
    converted once (here, not racing in two workers), the drafter or AR-only mode."""
    from services.models.registry import resolve_target
    from services.wire import ipc_endpoint, runtime_dir

    sup = config_from_args(SupervisorConfig, args)
    target = str(resolve_target(args.target))
    rt = None
    endpoints = {}
    if not args.verifier_endpoint or (not args.drafter_endpoint and sup.drafter != "none"):
        rt = runtime_dir(unique=True)
    endpoints["verifier_endpoint"] = args.verifier_endpoint or ipc_endpoint("verifier", rt)
    use_drafter = sup.drafter != "none" and (sup.drafter or _default_drafter_present())
    if not use_drafter and sup.drafter != "none":
        log.warning("no trained drafter found (pass --drafter DIR); serving with plain decoding (method 'ar')")
    endpoints["drafter_endpoint"] = (args.drafter_endpoint or ipc_endpoint("drafter", rt)) if use_drafter else "none"
    gateway = config_from_args(GatewayConfig, args, target=target, verifier_endpoint=endpoints["verifier_endpoint"],
                               served_model_name=args.served_model_name or Path(args.target).name)
    vover = {"target": target, **endpoints}
    if not use_drafter:
        vover["default_method"] = "ar"
    verifier = config_from_args(VerifierWorkerConfig, args, **vover)
    drafter = config_from_args(DrafterWorkerConfig, args, target=target, drafter=sup.drafter,
                               drafter_endpoint=endpoints["drafter_endpoint"]) if use_drafter else None
    return sup, gateway, verifier, drafter, rt


def serve_main(args: argparse.Namespace) -> int:
    """``dartree serve``: returns the process exit code."""
    from services.runtime import setup_logging

    setup_logging(args.log_level)
    sup, gateway, verifier, drafter, rt = plan(args)
    print("[dartree] configuration:", flush=True)
    for cfg in (sup, gateway, verifier, drafter):
        if cfg is not None:
            shown = {k: ("***" if k == "api_key" and v else v) for k, v in dataclasses.asdict(cfg).items()}
            print(f"  {type(cfg).__name__}: " + ", ".join(f"{k}={v!r}" for k, v in shown.items()), flush=True)
    try:
        return Supervisor(sup, gateway, verifier, drafter).run()
    finally:
        if rt is not None:
            shutil.rmtree(rt, ignore_errors=True)


if __name__ == "__main__":  # pragma: no cover - convenience: python -m services.serve
    p = argparse.ArgumentParser(prog="dartree serve")
    add_serve_args(p)
    sys.exit(serve_main(p.parse_args()))
