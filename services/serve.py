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
bad variable is an argparse error like a bad flag (exit 2). Before spawning anything, :func:`services.serve_plan.plan`
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

from gateway.config import GatewayConfig
from services.command_line import Parser, run_command
from services.drafter.worker import DrafterWorkerConfig
from services.config_cli import add_config_args, config_from_args
from services.runtime import DRAIN_SIGNAL, STOP_NOW_SIGNAL, error_line, worker_context
from services.serve_plan import SupervisorConfig, plan
from services.verifier.config import VerifierWorkerConfig
from services.verifier.process import RESTART_AFTER_COMPILE_EXIT

log = logging.getLogger("dartree.serve")

# what ``dartree serve`` does, in its --help and ``dartree --help``
SERVE_DESCRIPTION = "start the gateway, the verifier and the drafter (in the verifier on CPU), supervised"


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
