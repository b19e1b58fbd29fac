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

Every flag is a field of a frozen config dataclass (``--max-running`` <-> ``max_running``,
:mod:`services.config_cli`) and is
also read from ``DARTREE_<FIELD>`` (``DARTREE_MAX_RUNNING=4``); a flag beats the variable, and a
bad variable is an argparse error like a bad flag (exit 2). Before spawning anything, ``plan``
checks every setting, the listening addresses (free, distinct) and the drafter directory: a bad one
is a one-line error. The supervisor starts the workers (on CPU forked from one forkserver that
imported torch and the worker modules once, so they share those pages; ``spawn`` with CUDA), waits
until ``/health/ready``, prints the URL; a worker that dies before that stops the server with the worker's
error line; after that a dead worker is restarted (its in-flight requests end with a clean error:
the peers detect the disconnect). On SIGINT/SIGTERM it drains the gateway (503 for new requests,
in-flight ones finish within ``drain_timeout_s``, then end with a ``server_shutdown`` error) before
stopping the workers; a second signal ends the in-flight requests at once.

Signals between processes: the supervisor tells a worker to drain with
:data:`services.runtime.DRAIN_SIGNAL` and to stop now with :data:`~services.runtime.STOP_NOW_SIGNAL`,
never with SIGTERM, so a SIGTERM that reaches every process (systemd ``KillMode=control-group``, a
container runtime signalling the group) is one "drain" everywhere: each worker's own first SIGTERM
drains (the gateway finishes its requests, the verifier its table, the drafter keeps drafting until
no request needs it) and nothing counts it twice. A SIGTERM to one worker alone drains that worker
(in-flight requests finish, new ones get 503 meanwhile); it then exits 0 and is restarted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
import typing
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from gateway.config import GatewayConfig
from services.command_line import Parser, run_command
from services.drafter.worker import DrafterWorkerConfig
from services.config_cli import add_config_args, config_from_args, given_by
from services.devices import normalize_device
from services.runtime import DRAIN_SIGNAL, STOP_NOW_SIGNAL, error_line, worker_context
from services.spec import Method, preferred_method
from services.verifier.config import VerifierWorkerConfig
from services.verifier.process import RESTART_AFTER_COMPILE_EXIT

log = logging.getLogger("dartree.serve")


@dataclass(frozen=True)
class SupervisorConfig:
    """Supervisor-only settings.

    Attributes:
        startup_timeout_s: how long to wait for readiness (model conversion and loading included).
        drain_timeout_s: SIGTERM drain budget of the gateway (and then the workers).
        max_restarts: restarts of one worker within ``restart_window_s`` before giving up on it (the
            gateway or verifier: the server stops; the drafter: it serves on without speculation).
        restart_window_s: the sliding window, in seconds, over which ``max_restarts`` counts a worker's restarts.
        drafter: drafter checkpoint ("" = the default drafter if present, "none" = no drafter: AR only).
        start_method: how workers start: ``auto`` (a forkserver that imported torch and the worker
            modules once, so workers share those pages, on CPU; ``spawn`` with CUDA), ``forkserver``
            or ``spawn`` (a fresh interpreter per worker).
        drafter_placement: where the drafter runs: ``process`` (its own worker process, reached over
            ZeroMQ: restarted on its own, may draft while the target verifies with ``--overlap``),
            ``verifier`` (inside the verifier process, called between steps: no transport, no
            second process taking turns on the cores) or ``auto`` (``verifier`` on a CPU device
            without ``--overlap`` or ``--drafter-endpoint``, else ``process``).
    """

    startup_timeout_s: float = 900.0
    drain_timeout_s: float = 30.0
    max_restarts: int = 5
    restart_window_s: float = 300.0
    drafter: str = ""
    start_method: str = "auto"
    drafter_placement: str = "auto"


# what ``dartree serve`` does, in its --help and ``dartree --help``
SERVE_DESCRIPTION = "start the gateway, the verifier and the drafter (in the verifier on CPU), supervised"


def resolve_drafter_placement(setting: str, device: str, overlap: bool, drafter_endpoint: str,
                              source: str = "--drafter-placement", overlap_source: str = "--overlap") -> str:
    """``process`` or ``verifier`` for ``--drafter-placement`` (docs/design.md, "Drafter placement").

    ``auto`` is ``verifier`` on a CPU device unless ``--overlap`` (which needs a drafter drafting
    while the target verifies) or an explicit ``--drafter-endpoint`` asks for a drafter process;
    ``process`` on any other device (CUDA IPC between the two processes, the drafter on its own
    stream). On the project's 2-core CPU the default server through HTTP ran GSM8K at 1.19x plain
    decoding with the drafter in the verifier against 1.08x with a drafter process, MT-Bench 0.98x
    vs 0.97x, ShareGPT 1.09x vs 1.01x (benchmarks/results/2026-12-04-drafter-placement/): a round
    saves the ZeroMQ hops and the serialisation (~0.8 ms) and the two processes no longer take
    turns on the same cores.

    ``source`` and ``overlap_source`` name where ``setting`` and ``overlap`` came from (the flag or
    its ``DARTREE_*`` variable) in the error.

    Raises:
        ValueError: an unknown ``setting``, or ``verifier`` together with ``--overlap`` or
            ``--drafter-endpoint`` (one line).
    """
    from services.runtime import DRAFTER_PLACEMENTS

    if setting not in DRAFTER_PLACEMENTS:
        raise ValueError(f"{source} must be one of {', '.join(DRAFTER_PLACEMENTS)} (got {setting!r})")
    if setting == "auto":
        return "verifier" if device.startswith("cpu") and not overlap and not drafter_endpoint else "process"
    if setting == "verifier" and overlap:
        raise ValueError(f"{overlap_source} needs a drafter process, but {source} is 'verifier': pass "
                         f"--drafter-placement process (or drop {overlap_source})")
    if setting == "verifier" and drafter_endpoint:
        raise ValueError(f"--drafter-endpoint names a drafter process's address, but {source} is 'verifier': "
                         "pass --drafter-placement process (or drop --drafter-endpoint)")
    return setting


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
    from services.verifier.process import run_verifier_process

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
    from services.verifier.process import run_verifier_process

    os.setpgrp()
    run_verifier_process(config, parent_pid)


def _verifier_drafter_entry(configs: tuple[VerifierWorkerConfig, DrafterWorkerConfig], parent_pid: int) -> None:
    """The verifier process with the drafter inside it (``--drafter-placement verifier``)."""
    import functools

    from services.colocated import inproc_drafter
    from services.verifier.process import run_verifier_process

    os.setpgrp()
    run_verifier_process(configs[0], parent_pid, drafter=functools.partial(inproc_drafter, configs[1]))


def _drafter_entry(config: DrafterWorkerConfig, parent_pid: int) -> None:
    from services.drafter.worker import run_drafter_process

    os.setpgrp()
    run_drafter_process(config, parent_pid)


# Errors a worker reports as one line (bad configuration, missing files, refused peers); anything
# else is a bug and keeps its traceback.
_ONE_LINE_ERRORS = (ValueError, OSError, RuntimeError, ImportError)


def _child_main(entry: typing.Callable, config, parent_pid: int, errors) -> None:
    """Run a worker ``entry``; a failure is sent to the supervisor as one line (``errors``: a pipe end)."""
    from services.runtime import restore_stop_signals

    restore_stop_signals()
    try:
        entry(config, parent_pid)
        _ignore_stop_signals()  # stopped: a late drain/stop signal must not kill the exit (code 0)
    except SystemExit as e:
        if e.code not in (None, 0):
            _report(errors, error_line(e) if not isinstance(e.code, int) else f"exited with code {e.code}")
        raise
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except BaseException as e:
        _report(errors, error_line(e))
        if not isinstance(e, _ONE_LINE_ERRORS):
            raise  # a bug: its traceback belongs in the log
        logging.getLogger("dartree.serve").error("%s", error_line(e))
        raise SystemExit(2) from None


def _ignore_stop_signals() -> None:
    """Ignore SIGTERM and the supervisor's signals from now on: Python restores the default action
    (terminate) of signals it handled while the interpreter shuts down, so a signal arriving then
    would turn a clean exit into "killed by a signal"."""
    for sig in (signal.SIGTERM, DRAIN_SIGNAL, STOP_NOW_SIGNAL):
        signal.signal(sig, signal.SIG_IGN)


def _report(errors, line: str) -> None:
    with contextlib.suppress(OSError):
        errors.send(line)


@dataclass
class _Child:
    name: str
    entry: typing.Callable
    config: object
    proc: mp.process.BaseProcess | None = None
    restarts: deque = dataclasses.field(default_factory=deque)
    errors: typing.Any = None  # the read end of the child's error pipe


class StartupError(RuntimeError):
    """A worker failed before the server was ever ready (a configuration problem: no restarts)."""


class Supervisor:
    """Owns the child processes: start, readiness, restart on death, ordered drain.

    A worker that exits with an error before the server was ever ready stops the whole server with
    that worker's error line (:class:`StartupError`): start-up failures are configuration problems
    that a restart repeats (a worker killed by a signal is restarted instead). After readiness a dead
    worker is restarted (``max_restarts`` within ``restart_window_s``); past that a dead gateway or
    verifier stops the server, while a drafter is left dead and the verifier serves on without
    speculation (the same tokens; docs/design.md, "A drafter failure never fails a request").
    """

    def __init__(self, sup: SupervisorConfig, gateway: GatewayConfig, verifier: VerifierWorkerConfig,
                 drafter: DrafterWorkerConfig | None):
        self.sup, self.gateway_cfg = sup, gateway
        self._ctx = worker_context(sup.start_method, verifier.device)
        if drafter is not None and sup.drafter_placement == "verifier":  # one process drafts and verifies
            children = [_Child("verifier", _verifier_drafter_entry, (verifier, drafter))]
        else:
            children = [] if drafter is None else [_Child("drafter", _drafter_entry, drafter)]
            children.append(_Child("verifier", _verifier_entry, verifier))
        children.append(_Child("gateway", _gateway_entry, gateway))
        self.children = {c.name: c for c in children}
        self._stopping = False
        self._signals = 0
        self._current: _Child | None = None  # the child shutdown() is stopping
        self.announced = False  # "serving on" printed: the server was ready once
        self.failure: str | None = None  # why the server gave up (start-up or too many restarts)

    @property
    def url(self) -> str:
        host = self.gateway_cfg.host if self.gateway_cfg.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.gateway_cfg.port}"

    def _spawn(self, child: _Child) -> None:
        child.errors, send_end = self._ctx.Pipe(duplex=False)
        child.proc = self._ctx.Process(target=_child_main, args=(child.entry, child.config, os.getpid(), send_end),
                                       name=f"dartree-{child.name}", daemon=False)
        child.proc.start()
        send_end.close()
        log.info("started %s (pid %d)", child.name, child.proc.pid)

    def _last_error(self, child: _Child) -> str:
        line = exit_text(child.proc.exitcode)
        try:
            while child.errors.poll():
                line = child.errors.recv()
        except (EOFError, OSError):
            pass
        return line

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def run(self) -> int:
        """Start everything, wait for readiness, supervise until a stop signal; the exit code
        (0: stopped by a signal; 1: gave up after readiness; 2: a worker failed to start)."""
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        for child in self.children.values():
            self._spawn(child)
        deadline = time.monotonic() + self.sup.startup_timeout_s
        code = 0
        while not self._stopping:
            try:
                if not self._reap():
                    code = 1
                    break
            except StartupError as e:
                self.failure, code = str(e), 2
                break
            if not self.announced and self.ready():
                print(f"[dartree] serving on {self.url}/v1 (OpenAI-compatible; metrics at {self.url}/metrics)",
                      flush=True)
                self.announced = True
            if not self.announced and time.monotonic() > deadline:
                self.failure = f"not ready after {self.sup.startup_timeout_s:.0f} s"
                code = 1
                break
            time.sleep(0.5)
        self.shutdown()
        return code

    def _on_signal(self, signum, frame) -> None:
        self._signals += 1
        if self._signals > 1:
            # stop now: the worker being stopped skips the rest of its drain (the gateway ends its
            # in-flight requests with a server_shutdown error); no SIGKILL needed
            log.warning("second signal: stopping now")
            self._tell(self._current, STOP_NOW_SIGNAL)
        self._stopping = True

    @staticmethod
    def _tell(child: "_Child | None", sig: int) -> None:
        if child is not None and child.proc is not None and child.proc.is_alive():
            with contextlib.suppress(OSError):
                os.kill(child.proc.pid, sig)

    def _reap(self) -> bool:
        """Restart dead children; ``False`` when one died too often.

        Raises:
            StartupError: a child died before the server was ever ready.
        """
        for child in self.children.values():
            proc = child.proc
            if proc is None or proc.is_alive() or self._stopping:
                continue
            why = self._last_error(child)
            if not self.announced and child.name == "verifier" and proc.exitcode == RESTART_AFTER_COMPILE_EXIT \
                    and _restarts_after_compile(child.config):
                # its first compile is on disk now: once more, loading it, without the compiler's state
                log.info("starting the verifier again: its compiled steps load from the disk cache now")
                child.config = _no_restart_after_compile(child.config)
                self._spawn(child)
                continue
            # exited by itself before the server was ever ready: a configuration problem, no restarts.
            # Killed by a signal (exitcode < 0) is not: the readiness poll runs every 0.5 s, so a worker
            # killed just after clients saw /health/ready can still look "not started" here.
            if not self.announced and (proc.exitcode or 0) > 0:
                raise StartupError(f"the {child.name} failed to start: {why}")
            now = time.monotonic()
            while child.restarts and now - child.restarts[0] > self.sup.restart_window_s:
                child.restarts.popleft()
            if len(child.restarts) >= self.sup.max_restarts:
                too_often = (f"the {child.name} died {len(child.restarts) + 1} times within "
                             f"{self.sup.restart_window_s:.0f} s; last error: {why}")
                if child.name == "drafter":  # speculation is lossless: the verifier serves on without it
                    log.error("%s; serving without speculation from now on (restart the server to draft again)",
                              too_often)
                    child.proc = None
                    continue
                self.failure = too_often
                log.error("%s; stopping the server", too_often)
                return False
            log.error("%s died (%s); restarting it", child.name, why)
            child.restarts.append(now)
            self._spawn(child)
        return True

    def shutdown(self) -> None:
        """Drain the gateway first (in-flight requests finish), then the verifier, then stop the drafter
        (its only client is gone by then). Workers get the drain / stop-now signals, never SIGTERM."""
        self._stopping = True
        order = ["gateway", "verifier", "drafter"]
        budgets = {"gateway": self.sup.drain_timeout_s + 10, "verifier": 15.0, "drafter": 10.0}
        for name in order:
            child = self.children.get(name)
            if child is None or child.proc is None:
                continue
            if child.proc.is_alive():
                log.info("stopping %s", name)
                self._current = child
                now = self._signals > 1 or name == "drafter"  # told to stop now / nothing left to draft for
                self._tell(child, STOP_NOW_SIGNAL if now else DRAIN_SIGNAL)
                child.proc.join(budgets[name])
                if child.proc.is_alive():
                    log.warning("%s did not stop in time; killing it", name)
                    child.proc.kill()
                    child.proc.join(5)
            log.info("%s %s", name, exit_text(child.proc.exitcode))


def _restarts_after_compile(config) -> bool:
    """Whether a verifier child's config still lets it end for a restart after its first compile."""
    return (config[0] if isinstance(config, tuple) else config).restart_after_compile is not False


def _no_restart_after_compile(config):
    """A verifier child's config (or ``(verifier, drafter)`` configs) with ``restart_after_compile``
    off: the restarted process serves whatever its warm-up finds (a cache that cannot keep the
    compiled steps must not restart it forever)."""
    if isinstance(config, tuple):
        return (dataclasses.replace(config[0], restart_after_compile=False),) + config[1:]
    return dataclasses.replace(config, restart_after_compile=False)


def exit_text(code: int | None) -> str:
    """How a worker ended, for the logs: ``exited with code N``, or for a process a signal ended
    (``multiprocessing``'s negative exit codes) ``was stopped by SIGNAME (code -N)``."""
    if code is None:
        return "has not exited"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was stopped by {name} (code {code})"
    return f"exited with code {code}"


def _default_drafter_present() -> bool:
    from services.models.registry import DEFAULT_DRAFTER_DIR

    return (DEFAULT_DRAFTER_DIR / "config.json").is_file()


def check_listen(host: str, port: int, what: str, host_flag: str = "--host") -> None:
    """ValueError (one line) unless a TCP listener could bind ``host:port`` now (port 0: off, not checked);
    ``what`` names the port's flag, ``host_flag`` the host's (an address that does not resolve).

    Run before anything is spawned: a busy port must not let another server answer our readiness probe.
    """
    import socket

    if not port:
        return
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"{host_flag}: {host!r} is not a usable address ({getattr(e, 'strerror', None) or e})") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and prometheus_client do
        try:
            sock.bind(addr)
        except OSError as e:
            busy = " (is another server running? pick another port)" if e.errno == errno.EADDRINUSE else ""
            raise ValueError(f"{what}: cannot listen on {host}:{port}: {e.strerror}{busy}") from None


def preflight(args: argparse.Namespace, use_drafter: bool) -> None:
    """Checks that need no model and no child: listening addresses free and distinct, drafter dir, and
    a default method the drafter (or, without one, AR-only mode) serves.

    Raises:
        ValueError, FileNotFoundError: the first failed check, in one line.
    """
    from services.drafter.worker import check_drafter_dir

    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device; "
                             "use --device cpu")
    listeners = [(args.host, args.port, "--port", "--host"),
                 (args.metrics_host, args.verifier_metrics_port, "--verifier-metrics-port", "--metrics-host")]
    if use_drafter:
        listeners.append((args.metrics_host, args.drafter_metrics_port, "--drafter-metrics-port", "--metrics-host"))
    ports = [p for _, p, _, _ in listeners if p]
    if len(ports) != len(set(ports)):
        raise ValueError(f"the gateway and metrics ports must differ (got {', '.join(map(str, ports))})")
    for host, port, what, host_flag in listeners:
        check_listen(host, port, what, host_flag)
    if use_drafter and args.drafter:
        check_drafter_dir(args.drafter)
    if use_drafter:  # the drafter's kind fixes the methods served: refuse an unserved default before spawning
        from services.drafter.config import drafter_kind
        from services.models.registry import DEFAULT_DRAFTER_DIR
        from services.protocol import served_methods

        ddir = Path(args.drafter) if args.drafter else DEFAULT_DRAFTER_DIR
        kind = drafter_kind(ddir)
        served = served_methods(kind)
        if args.default_method not in served:
            best = preferred_method(served)
            source = given_by(args, "default_method") or "the default; change it with --default-method"
            raise ValueError(f"the default method {args.default_method!r} ({source}) is not served by "
                             f"the {kind} drafter in {ddir} (it serves: {', '.join(served)}); pass e.g. "
                             f"--default-method {best}")
    elif args.default_method != Method.AR and (source := given_by(args, "default_method")):
        # AR-only mode serves 'ar' alone: a default method given by flag or env (even the default value
        # given explicitly) would be silently ignored; left unset, AR-only mode serves 'ar' as documented
        raise ValueError(f"the default method {args.default_method!r} ({source}) needs a drafter, but "
                         f"none runs (--drafter none, or no trained drafter found); pass --drafter DIR or "
                         f"--default-method ar")


def _resolve_model(args: argparse.Namespace) -> tuple[str, str, str, str]:
    """``(target dir, format, activation dtype name, drafter dtype name)``, chosen once here so that
    both workers agree (:func:`services.weights.resolve_cli_weights`; a non-default ``--dtype`` pins
    the format). ``auto`` on CPU (the default) runs in a throw-away child process
    (:func:`services.startup.choose_in_child`: it may convert the default target and load every
    candidate format to time them), so the supervisor never holds a model and, with the default
    settings, never imports torch (~200 MB of RSS); a concrete ``--weights`` / ``--dtype`` or a
    non-CPU device is resolved here. Raises ValueError (one line) for a format that cannot run here."""
    from services.models.registry import resolve_target

    dtype = args.dtype if args.dtype != "float32" else None
    if (args.weights or "auto") == "auto" and not dtype and args.device.startswith("cpu"):
        from services.startup import choose_in_child

        return choose_in_child(args.target, "auto", None, args.device, args.log_level,
                               start_method=args.start_method)
    from services.weights import resolve_cli_weights

    target = str(resolve_target(args.target))
    fmt, act = resolve_cli_weights(args.weights, dtype, target, args.device)
    act_name = str(act).removeprefix("torch.")
    return target, fmt, act_name, _drafter_dtype_name(act_name, args.device)


def plan(args: argparse.Namespace) -> tuple[SupervisorConfig, GatewayConfig, VerifierWorkerConfig,
                                           DrafterWorkerConfig | None, Path | None]:
    """Resolve the configs of one ``serve``: shared endpoints in a private runtime dir, the target
    converted once (here, not racing in two workers), the drafter or AR-only mode.

    Raises:
        ValueError, FileNotFoundError: a bad setting (one line), before anything is created or spawned.
    """
    from services.startup import check_fits, phase
    from services.wire import ipc_endpoint, runtime_dir

    if args.drafter.strip().lower() == "none":  # "none" in any case means no drafter, never a directory
        args.drafter = "none"
    if args.drafter_endpoint.strip().lower() == "none":  # the verifier's "no drafter": the same as --drafter none
        if args.drafter != "none" and given_by(args, "drafter"):
            raise ValueError(f"--drafter-endpoint none runs no drafter, but {given_by(args, 'drafter')} names one "
                             f"({args.drafter}): drop one of the two")
        args.drafter, args.drafter_endpoint = "none", ""
    args.device = normalize_device(args.device)  # "cuda" -> "cuda:N" once: every worker names the same device
    sup = config_from_args(SupervisorConfig, args)
    # every config is built once before the target is resolved and the runtime dir exists: a bad value
    # fails here, in one line, with nothing to clean up
    config_from_args(GatewayConfig, args)
    config_from_args(VerifierWorkerConfig, args)
    config_from_args(DrafterWorkerConfig, args)
    _name_models(args)  # may download from the hub: after every setting was checked
    sup = dataclasses.replace(sup, drafter=args.drafter)
    use_drafter = bool(sup.drafter != "none" and (sup.drafter or _default_drafter_present()))
    placement = sup.drafter_placement
    if use_drafter:  # without a drafter the placement means nothing (and --overlap has nothing to overlap)
        placement = resolve_drafter_placement(placement, args.device, args.overlap, args.drafter_endpoint,
                                              given_by(args, "drafter_placement") or "--drafter-placement",
                                              given_by(args, "overlap") or "--overlap")
        sup = dataclasses.replace(sup, drafter_placement=placement)
    preflight(args, use_drafter)
    with phase("supervisor", "target and weight format resolved"):
        target, fmt, act_dtype, drafter_dtype = _resolve_model(args)
    if args.device.startswith("cpu"):  # refuse a KV cache the RAM cannot hold, naming the flags (one line)
        from services.memory_plan import DEFAULT_MAX_RUNNING

        check_fits(Path(target), fmt or act_dtype, act_dtype, args.max_running or DEFAULT_MAX_RUNNING,
                   args.max_context, args.prefill_chunk)
    if not use_drafter and sup.drafter != "none":
        log.warning("no trained drafter found (pass --drafter DIR); serving with plain decoding (method 'ar')")
    if use_drafter:
        log.info("drafter placement: %s%s", placement, " (auto)" if given_by(args, "drafter_placement") is None else "")
    rt = None
    drafter_process = use_drafter and placement == "process"
    if not args.verifier_endpoint or (not args.drafter_endpoint and drafter_process):
        rt = runtime_dir(unique=True)
    try:
        endpoints = {"verifier_endpoint": args.verifier_endpoint or ipc_endpoint("verifier", rt)}
        # a drafter inside the verifier has no endpoint ("" in both configs: nothing binds or connects)
        endpoints["drafter_endpoint"] = ("none" if not use_drafter else
                                         (args.drafter_endpoint or ipc_endpoint("drafter", rt)) if drafter_process
                                         else "")
        gateway = config_from_args(GatewayConfig, args, target=target,
                                   verifier_endpoint=endpoints["verifier_endpoint"],
                                   served_model_name=args.served_model_name or Path(args.target).name)
        vover = {"target": target, "weights": fmt, "dtype": act_dtype, **endpoints}
        if not use_drafter:
            vover["default_method"] = Method.AR.value
        verifier = config_from_args(VerifierWorkerConfig, args, **vover)
        drafter = config_from_args(DrafterWorkerConfig, args, target=target, drafter=sup.drafter,
                                   dtype=drafter_dtype,
                                   drafter_endpoint=endpoints["drafter_endpoint"]) if use_drafter else None
    except BaseException:
        if rt is not None:
            shutil.rmtree(rt, ignore_errors=True)
        raise
    return sup, gateway, verifier, drafter, rt


def _name_models(args: argparse.Namespace) -> None:
    """Resolve ``--target`` / ``--drafter`` by name (local directories or hub ids) and pair them
    (:func:`services.models.pairing.resolve_pair`), in ``args``: both become local directories (the
    drafter ``none`` when plain decoding runs without one) and an unset ``--served-model-name`` the
    name given. Raises ValueError / RuntimeError (one line) for a target or drafter refused."""
    from services.models.pairing import resolve_pair
    from services.models.registry import served_name

    pair = resolve_pair(args.target, args.drafter, max_context=args.max_context,
                        ar_only=args.default_method == Method.AR)
    if pair.note:
        log.info("%s (--default-method ar)", pair.note)
    args.drafter = pair.drafter
    if pair.target_dir is not None:
        args.served_model_name = args.served_model_name or served_name(args.target)
        args.target = str(pair.target_dir)


def _drafter_dtype_name(act_dtype: str, device: str) -> str:
    """The drafter worker's dtype name next to a target with activations ``act_dtype``
    (:func:`services.weights.drafter_dtype`: float32 on a CPU without native bf16)."""
    import torch

    from services.weights import drafter_dtype

    return str(drafter_dtype(getattr(torch, act_dtype), device)).removeprefix("torch.")


def serve_main(args: argparse.Namespace) -> int:
    """``dartree serve``: returns the process exit code.

    Raises:
        ValueError, FileNotFoundError: a bad setting found before start (the CLI prints it in one line).
    """
    from services.runtime import setup_logging

    setup_logging(args.log_level)
    rt = None
    try:
        sup, gateway, verifier, drafter, rt = plan(args)
        print("[dartree] configuration:", flush=True)
        for cfg in (sup, gateway, verifier, drafter):
            if cfg is not None:
                shown = {k: ("***" if k == "api_key" and v else v) for k, v in dataclasses.asdict(cfg).items()}
                print(f"  {type(cfg).__name__}: " + ", ".join(f"{k}={v!r}" for k, v in shown.items()), flush=True)
        supervisor = Supervisor(sup, gateway, verifier, drafter)
        code = supervisor.run()
        if supervisor.failure:
            print(f"dartree: error: {supervisor.failure}", file=sys.stderr, flush=True)
        return code
    finally:
        if rt is not None:
            shutil.rmtree(rt, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m services.serve FLAGS``: the same as ``dartree serve FLAGS``."""
    parser = Parser(prog="dartree serve", description=SERVE_DESCRIPTION)
    add_serve_args(parser)
    return run_command(serve_main, parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
