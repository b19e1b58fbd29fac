"""The plan of one ``dartree serve``: every setting checked, the models named and resolved, the
processes' configs built, before anything is spawned.

Its functions (:mod:`services.serve` calls :func:`plan`; ``dartree serve-ray`` uses :func:`check_listen`)::

    plan(args: argparse.Namespace) -> (SupervisorConfig, GatewayConfig, VerifierWorkerConfig,
                                       DrafterWorkerConfig | None, runtime dir | None)
    preflight(args, use_drafter) -> None                       # listeners, drafter dir, default method
    resolve_drafter_placement(setting, device, overlap, drafter_endpoint) -> "process" | "verifier"
    check_listen(host, port, what) -> None                     # a TCP listener could bind host:port now

A bad setting is a one-line ValueError (or FileNotFoundError) raised before the runtime directory
exists or any worker is started. Torch-free at import; :func:`plan` imports torch only to resolve a
concrete weight format or a non-CPU device (:func:`_resolve_model`).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from gateway.config import GatewayConfig
from services.config_cli import config_from_args, given_by
from services.devices import normalize_device
from services.drafter.worker import DrafterWorkerConfig
from services.spec import Method, preferred_method
from services.verifier.config import VerifierWorkerConfig

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
    """Checks that need no model and no child: a CUDA device torch sees, listening addresses free and
    distinct, drafter dir, and a default method the drafter (or, without one, AR-only mode) serves.

    Raises:
        ValueError, FileNotFoundError: the first failed check, in one line.
    """
    from services.drafter.worker import check_drafter_dir

    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device; "
                             "use --device cpu")
    _check_listeners(args, use_drafter)
    if use_drafter and args.drafter:
        check_drafter_dir(args.drafter)
    _check_default_method(args, use_drafter)


def _check_listeners(args: argparse.Namespace, use_drafter: bool) -> None:
    """The gateway's and the metrics endpoints' ports: distinct, and each free now (:func:`check_listen`).

    Raises:
        ValueError: two equal ports, or one that cannot be bound (one line naming its flag).
    """
    listeners = [(args.host, args.port, "--port", "--host"),
                 (args.metrics_host, args.verifier_metrics_port, "--verifier-metrics-port", "--metrics-host")]
    if use_drafter:
        listeners.append((args.metrics_host, args.drafter_metrics_port, "--drafter-metrics-port", "--metrics-host"))
    ports = [p for _, p, _, _ in listeners if p]
    if len(ports) != len(set(ports)):
        raise ValueError(f"the gateway and metrics ports must differ (got {', '.join(map(str, ports))})")
    for host, port, what, host_flag in listeners:
        check_listen(host, port, what, host_flag)


def _check_default_method(args: argparse.Namespace, use_drafter: bool) -> None:
    """The default method is one the drafter's kind serves (read from its config.json, no torch), or,
    without a drafter, not another method given explicitly.

    Raises:
        ValueError: an unserved default method, naming the flag or variable that gave it (one line).
    """
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


@dataclass(frozen=True)
class _Resolved:
    """What :func:`_resolve_model` chose: the target directory, its weight format, the activations'
    and the drafter's dtype names."""

    target: str
    weights: str
    dtype: str
    drafter_dtype: str


def plan(args: argparse.Namespace) -> tuple[SupervisorConfig, GatewayConfig, VerifierWorkerConfig,
                                           DrafterWorkerConfig | None, Path | None]:
    """Resolve the configs of one ``serve``: shared endpoints in a private runtime dir, the target
    converted once (here, not racing in two workers), the drafter or AR-only mode.

    Returns:
        ``(supervisor, gateway, verifier, drafter or None, runtime dir or None)``; the caller removes
        the runtime dir (the ipc:// sockets' home) when the server stops.

    Raises:
        ValueError, FileNotFoundError: a bad setting (one line), before anything is created or spawned.
    """
    from services.startup import check_fits, phase

    sup = _checked_settings(args)
    _name_models(args)  # may download from the hub: after every setting was checked
    sup = dataclasses.replace(sup, drafter=args.drafter)
    use_drafter = bool(sup.drafter != "none" and (sup.drafter or _default_drafter_present()))
    if use_drafter:  # without a drafter the placement means nothing (and --overlap has nothing to overlap)
        placement = resolve_drafter_placement(sup.drafter_placement, args.device, args.overlap,
                                              args.drafter_endpoint,
                                              given_by(args, "drafter_placement") or "--drafter-placement",
                                              given_by(args, "overlap") or "--overlap")
        sup = dataclasses.replace(sup, drafter_placement=placement)
    preflight(args, use_drafter)
    with phase("supervisor", "target and weight format resolved"):
        model = _Resolved(*_resolve_model(args))
    if args.device.startswith("cpu"):  # refuse a KV cache the RAM cannot hold, naming the flags (one line)
        from services.memory_plan import DEFAULT_MAX_RUNNING

        check_fits(Path(model.target), model.weights or model.dtype, model.dtype,
                   args.max_running or DEFAULT_MAX_RUNNING, args.max_context, args.prefill_chunk)
    if not use_drafter and sup.drafter != "none":
        log.warning("no trained drafter found (pass --drafter DIR); serving with plain decoding (method 'ar')")
    if use_drafter:
        log.info("drafter placement: %s%s", sup.drafter_placement,
                 " (auto)" if given_by(args, "drafter_placement") is None else "")
    return (sup, *_worker_configs(args, sup, use_drafter, model))


def _checked_settings(args: argparse.Namespace) -> SupervisorConfig:
    """Normalise ``--drafter`` / ``--drafter-endpoint`` "none" and the device in ``args``, then build
    every config once, so that a bad value fails in one line before anything exists to clean up.

    Raises:
        ValueError: a refused setting, or ``--drafter-endpoint none`` next to an explicit ``--drafter``.
    """
    if args.drafter.strip().lower() == "none":  # "none" in any case means no drafter, never a directory
        args.drafter = "none"
    if args.drafter_endpoint.strip().lower() == "none":  # the verifier's "no drafter": the same as --drafter none
        if args.drafter != "none" and given_by(args, "drafter"):
            raise ValueError(f"--drafter-endpoint none runs no drafter, but {given_by(args, 'drafter')} names one "
                             f"({args.drafter}): drop one of the two")
        args.drafter, args.drafter_endpoint = "none", ""
    args.device = normalize_device(args.device)  # "cuda" -> "cuda:N" once: every worker names the same device
    sup = config_from_args(SupervisorConfig, args)
    config_from_args(GatewayConfig, args)
    config_from_args(VerifierWorkerConfig, args)
    config_from_args(DrafterWorkerConfig, args)
    return sup


def _worker_configs(args: argparse.Namespace, sup: SupervisorConfig, use_drafter: bool, model: _Resolved
                    ) -> tuple[GatewayConfig, VerifierWorkerConfig, DrafterWorkerConfig | None, Path | None]:
    """The three workers' configs on ``model``, with their endpoints (ipc:// sockets in a fresh private
    runtime dir unless given; a drafter inside the verifier has none), and that dir (None: not made).

    Raises:
        ValueError: a refused setting (the runtime dir is removed first).
    """
    from services.wire import ipc_endpoint, runtime_dir

    rt = None
    drafter_process = use_drafter and sup.drafter_placement == "process"
    if not args.verifier_endpoint or (not args.drafter_endpoint and drafter_process):
        rt = runtime_dir(unique=True)
    try:
        endpoints = {"verifier_endpoint": args.verifier_endpoint or ipc_endpoint("verifier", rt)}
        # a drafter inside the verifier has no endpoint ("" in both configs: nothing binds or connects)
        endpoints["drafter_endpoint"] = ("none" if not use_drafter else
                                         (args.drafter_endpoint or ipc_endpoint("drafter", rt)) if drafter_process
                                         else "")
        gateway = config_from_args(GatewayConfig, args, target=model.target,
                                   verifier_endpoint=endpoints["verifier_endpoint"],
                                   served_model_name=args.served_model_name or Path(args.target).name)
        vover = {"target": model.target, "weights": model.weights, "dtype": model.dtype, **endpoints}
        if not use_drafter:
            vover["default_method"] = Method.AR.value
        verifier = config_from_args(VerifierWorkerConfig, args, **vover)
        drafter = config_from_args(DrafterWorkerConfig, args, target=model.target, drafter=sup.drafter,
                                   dtype=model.drafter_dtype,
                                   drafter_endpoint=endpoints["drafter_endpoint"]) if use_drafter else None
    except BaseException:
        if rt is not None:
            shutil.rmtree(rt, ignore_errors=True)
        raise
    return gateway, verifier, drafter, rt


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

