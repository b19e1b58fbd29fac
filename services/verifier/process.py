"""The verifier process's entry: the drafter link, the engine build, the worker and its serving loop.

:func:`run_verifier_process` is what ``dartree serve`` starts as its verifier child (or runs alone,
``dartree verifier``): it opens the drafter (a drafter process over ZeroMQ,
the drafter built inside this process, or none), builds the engine (:func:`services.verifier.build.build_verifier`:
target, memory plan, KV cache, CUDA graphs, policy), wraps it in a :class:`~services.verifier.worker.VerifierWorker`
with its metrics and drafter heartbeat, and serves the gateway's socket until drained. Torch is
imported by :func:`run_verifier_process` only.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

from services.metrics import VerifierMetrics
from services.protocol import PROTOCOL_VERSION, HelloAck, PeerInfo
from services.spec import Method, parse_tree_schedule, request_tree_limits
from services.verifier.config import VerifierWorkerConfig
from services.verifier.worker import VerifierWorker

log = logging.getLogger("verifier")
RESTART_AFTER_COMPILE_EXIT = 75  # exit code: "start me again, my compiled steps are on disk now"
DRAFTER_PING_TIMEOUT_S = 1.0  # a drafter heartbeat ping without a Pong by then: not ready


def verifier_info(target_dir, engine, target, epoch: str, config: VerifierWorkerConfig, methods: tuple[str, ...],
                  drafter: PeerInfo | None) -> PeerInfo:
    """This verifier's handshake info (for the gateway)."""
    from services.protocol import Limits, special_token_ids, tokenizer_hash

    budget, width, candidates = request_tree_limits(config.max_request_budget)
    limits = Limits(max_context=engine.max_context, max_prompt_tokens=engine.max_context - 1,
                    max_tokens=engine.max_context - 1, max_budget=budget, max_running=config.engine.max_running,
                    max_waiting=config.max_waiting, max_width=width, max_candidates=candidates)
    return PeerInfo(role="verifier", epoch=epoch, tokenizer_hash=tokenizer_hash(target_dir),
                    vocab_size=engine.vocab_size, eos_token_id=int(engine.eos_token_ids[0]) if engine.eos_token_ids
                    else -1, special_token_ids=special_token_ids(target_dir),
                    block_size=drafter.block_size if drafter else 0, feature_dim=target.feature_dim,
                    target_layer_ids=tuple(target.target_layer_ids), max_context=engine.max_context,
                    model=target_dir.name, methods=methods, limits=limits, device=config.device)


def _connect_drafter(config: VerifierWorkerConfig, target_dir, ctx, epoch: str):
    """``(client, drafter info)`` of the drafter process at ``config.drafter_endpoint`` (the caller
    handles ``"none"``: no drafter)."""
    from services.ipc_pool import make_transport
    from services.protocol import config_eos_token_id, special_token_ids, tokenizer_hash
    from services.verifier.remote_drafter import ZmqDrafterClient
    from services.wire import ipc_endpoint

    local = PeerInfo(role="verifier", epoch=epoch, tokenizer_hash=tokenizer_hash(target_dir),
                     eos_token_id=config_eos_token_id(target_dir), special_token_ids=special_token_ids(target_dir))
    link = config.transport
    transport = make_transport(config.device, link.cuda_ipc, link.ipc_slots, link.ipc_slot_bytes)
    client = ZmqDrafterClient(config.drafter_endpoint or ipc_endpoint("drafter"), local, transport,
                              config.draft_timeout_s, ctx)
    peer = client.connect(wait_s=config.drafter_wait_s)
    log.info("drafter connected (block %d, methods %s)", peer.block_size, ", ".join(peer.methods))
    return client, peer


def compiled_cold(engine) -> int:
    """How many graphs this process's compiled steps compiled rather than loaded from inductor's disk
    cache (torch's ``fxgraph_cache_miss`` counter; 0 for eager steps and for a warm cache)."""
    if not engine.runner.compiled:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_miss"])


def run_verifier_process(config: VerifierWorkerConfig, parent_pid: int | None = None,
                         drafter: Callable | None = None) -> None:
    """Entry of the verifier process (blocking until drained after SIGTERM).

    Args:
        config: the verifier's settings; parent_pid: the supervisor's pid (the process stops when
            it is gone; None: run alone).
        drafter: ``drafter(epoch) -> (client, drafter info, drafter metrics)`` builds the drafter
            inside this process (``--drafter-placement verifier``;
            :func:`services.colocated.inproc_drafter`, which the supervisor binds to the drafter's
            config: this package never imports the drafter's); None: the drafter process at
            ``config.drafter_endpoint`` (or none at all when that is ``"none"``).
    """
    import zmq

    from services.devices import bind_device
    from services.runtime import on_stop_signals, prepare_process
    from services.wire import new_epoch

    prepare_process("dartree-verifier", config.log_level, parent_pid)
    config = dataclasses.replace(config, device=bind_device(config.device))  # "cuda" -> "cuda:N", set_device
    epoch, ctx, stop = new_epoch(), zmq.Context(), threading.Event()
    inproc = drafter is not None
    drafter_client, drafter = _open_drafter(config, drafter, ctx, epoch)
    from services.verifier.build import build_verifier

    engine, target, target_dir = build_verifier(config, drafter_client, drafter)
    # what runs: the engine's limits as built (on CUDA the memory plan's max_running / context)
    config = dataclasses.replace(config, engine=engine.config)
    restart = config.restart_after_compile if config.restart_after_compile is not None else parent_pid is not None
    if restart and (missed := compiled_cold(engine)):
        log.info("the compiled steps were built from a cold cache (%d graphs compiled and saved to disk): "
                 "exiting for the supervisor to start the verifier again without the compiler's in-memory state",
                 missed)
        raise SystemExit(RESTART_AFTER_COMPILE_EXIT)
    worker = _make_worker(config, engine, target, target_dir, epoch, drafter_client, drafter, inproc)
    from services.verifier.compile_swap import start_background_compile

    worker.step_swap = start_background_compile(config, engine, drafter)
    heartbeat = None if inproc else _start_heartbeat(config, ctx, drafter_client, worker)
    on_stop_signals(worker.begin_drain, stop.set, supervised=parent_pid is not None)
    try:
        _serve(config, ctx, worker, stop)
    finally:
        if heartbeat is not None:
            heartbeat.close()
        if worker.step_swap is not None:
            worker.step_swap.close()
        if drafter_client is not None and not inproc:
            drafter_client.close()
        ctx.destroy(linger=0)
        log.info("verifier stopped")


def _open_drafter(config: VerifierWorkerConfig, build_inproc: Callable | None, ctx, epoch: str):
    """``(client, drafter info)``: built in this process (``build_inproc``), connected to the drafter
    process at ``config.drafter_endpoint``, or ``(None, None)`` when that is ``"none"``."""
    from services.models.registry import resolve_target
    from services.startup import phase

    if build_inproc is not None:
        client, info, _ = build_inproc(epoch)
        return client, info
    if config.drafter_endpoint == "none":
        return None, None
    with phase("verifier", "drafter connected"):
        return _connect_drafter(config, resolve_target(config.target), ctx, epoch)


def _make_worker(config: VerifierWorkerConfig, engine, target, target_dir, epoch: str, drafter_client, drafter,
                 inproc: bool) -> VerifierWorker:
    """The worker over a built engine: its served methods checked, its info and metrics (the metrics
    server started).

    Raises:
        SystemExit: the default method is not served.
    """
    from services.runtime import start_metrics_server

    methods = (Method.AR.value,) + tuple(m for m in (drafter.methods if drafter else ()) if m != Method.AR)
    if config.default_method not in methods:
        raise SystemExit(f"default method {config.default_method!r} is not served (available: {', '.join(methods)})")
    info = verifier_info(target_dir, engine, target, epoch, config, methods, drafter)
    metrics = VerifierMetrics(model=info.model, default_method=config.default_method, spec_policy=config.spec_policy,
                              tree_schedule=str(parse_tree_schedule(config.tree_schedule) or ""))
    metrics.compiled_step.set(int(engine.runner.compiled))
    start_metrics_server(config.verifier_metrics_port, config.transport.metrics_host, metrics.registry)
    # the idle ping also re-handshakes a restarted drafter; a drafter in this process always answers
    ping = (lambda: True) if inproc else (lambda: drafter_client.ping(1.0)) if drafter_client else None
    return VerifierWorker(engine, info, config, metrics, drafter_ping=ping)


def _start_heartbeat(config: VerifierWorkerConfig, ctx, drafter_client, worker: VerifierWorker):
    """The drafter process's liveness, off the compute thread (readiness never waits on a round);
    None without a drafter process."""
    if drafter_client is None:
        return None
    from services.verifier.remote_drafter import DrafterHeartbeat

    def on_heartbeat(ok: bool, detail: str) -> None:
        drafter_client.set_available(ok)  # a draft being waited for gives up at once
        worker.on_drafter_heartbeat(ok, detail)

    return DrafterHeartbeat(drafter_client.endpoint, ctx, config.health_interval_s, DRAFTER_PING_TIMEOUT_S,
                            on_heartbeat).start()


def _serve(config: VerifierWorkerConfig, ctx, worker: VerifierWorker, stop: threading.Event) -> None:
    """Serve the gateway's socket until ``stop`` (after a drain); then save the policy's calibration
    and close the socket."""
    from services.wire import ServerIO, ipc_endpoint

    info, metrics = worker.info, worker.metrics
    endpoint = config.verifier_endpoint or ipc_endpoint("verifier")
    io = ServerIO(ctx, endpoint, "verifier", on_message=worker.on_io_message,
                  on_error=lambda reason: metrics.ipc_errors.labels("gateway").inc(),
                  refuse=lambda reason: HelloAck(PROTOCOL_VERSION, False, info, reason), inbox=worker.inbox)
    worker.send = io.send
    io.start()
    log.info("verifier ready on %s (model %s, context %d, methods %s)", endpoint, info.model, info.max_context,
             ", ".join(info.methods))
    try:
        worker.event_loop(stop)
    finally:
        worker.engine.policy.flush()  # what this start learnt is the next one's starting calibration
        io.close()
