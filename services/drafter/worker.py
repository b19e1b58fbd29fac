"""The drafter process: a ROUTER on an I/O thread, a compute loop calling :class:`DrafterService`.

Loop (docs/design.md "Worker processes"): recv (inbox queue) -> dispatch by message type (HELLO,
DRAFT_BATCH, RELEASE) -> compute -> send (through the I/O thread). PINGs are answered on the I/O
thread so liveness never waits behind a draft. A malformed message is logged, counted and dropped;
an exception inside a draft becomes an error reply for that request only. Torch is imported by
:func:`run_drafter_process`, not at import.

Stopping: the first SIGTERM (or the supervisor's drain signal) drains: the drafter keeps serving
drafts (the verifier may be draining its requests) but answers pings "not ready" (so no new
request is admitted), and exits once no request holds a context and no draft came for
:data:`DRAIN_IDLE_S`, or at ``drain_timeout_s``; a second SIGTERM (or the supervisor's stop-now
signal) stops it at once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.metrics import DrafterMetrics
from services.protocol import (
    PROTOCOL_VERSION,
    DraftReply,
    Hello,
    HelloAck,
    MessageType,
    PeerInfo,
    Pong,
    check_compatible,
    check_hello_version,
    config_eos_token_id,
    special_token_ids,
    tokenizer_hash,
)
from services.devices import is_out_of_memory, release_device_cache
from services.runtime import check_device, check_dtype, trim_heap
from services.transport_config import TransportConfig
from services.wire import Decoded

log = logging.getLogger("drafter")
DRAIN_IDLE_S = 5.0  # a draining drafter exits after this long without contexts and without drafts (a queued
# request of a draining verifier may still need one after its prefill; supervised, the drafter is told to stop
# at once when the verifier is gone, so this never delays a server shutdown)


@dataclass(frozen=True)
class DrafterWorkerConfig:
    """Drafter process settings (CLI ``--field-name``, env ``DARTREE_FIELD_NAME``).

    Attributes:
        target: target model (name or local HF dir) whose embedding / lm_head the drafter borrows.
        drafter: drafter checkpoint directory ("" = the shipped default drafter).
        drafter_endpoint: where the drafter listens ("" = the default ipc:// socket).
        device, dtype: where and in which precision the drafter runs (every draft job carries
            its tree knobs, resolved by the verifier).
        transport: the CUDA-IPC tensor pool (used only on a CUDA device) and ``metrics_host``
            (:class:`~services.transport_config.TransportConfig`, shared with the verifier; one flag each).
        packed_gemm: on a float32 CPU, pre-pack GEMM weights for the round's fixed row counts
            (``services/cpu_gemm.py``: same numerics, ~1.2x faster rounds on the CI CPU).
        drafter_metrics_port: the drafter's Prometheus endpoint's port (0 = off; its host:
            ``transport.metrics_host``); served by the verifier process when the drafter runs inside
            it (``--drafter-placement``).
        max_tensor_bytes: largest tensor frame accepted.
        drain_timeout_s: on SIGTERM, how long the drafter may keep serving the requests in flight.
        compile: the drafter's block forward through ``torch.compile`` (warm-up at start, logged;
            :class:`services.drafter.service.DrafterService`); ``dartree serve --compile`` sets it
            together with the verifier's.
        cuda_graphs: the drafter's block forward through CUDA graphs captured at start
            (:mod:`services.drafter.graphed_block`; calls outside their grid run eagerly). None (auto):
            on for a CUDA device unless ``compile``; True on another device is refused at start.
        drafter_threads: the drafter's intra-op CPU threads. In a drafter process (0 = auto: 1 on
            a machine with at most 2 cores, else half of them; the verifier shares the cores and its
            own threads keep spinning for a while after each step; see :func:`drafter_threads`).
            Inside the verifier (``--drafter-placement verifier``): 0 = the verifier's own threads,
            N = N threads while drafting.
        ngram_draft: ``on``: every drafted tree also gets a chain of up to 4 nodes continuing the
            request's longest repeated 3- or 2-gram of its prompt and output (free: no drafter
            forward; pays where text repeats: summaries, code edits, quoting answers); ``off``: the
            drafter's tree alone. A DFlash, Domino or DSpark drafter (not EAGLE-3).
    """

    target: str = "smollm2-135m-instruct"
    drafter: str = ""
    drafter_endpoint: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    transport: TransportConfig = TransportConfig()
    packed_gemm: bool = True
    drafter_metrics_port: int = 8002
    max_tensor_bytes: int = 1 << 30
    drain_timeout_s: float = 30.0
    log_level: str = "INFO"
    compile: bool = False
    drafter_threads: int = 0
    cuda_graphs: bool | None = None
    ngram_draft: str = "off"

    def __post_init__(self) -> None:
        # the CLI's --compile is unset (None, "auto") by default: auto leaves the drafter eager
        object.__setattr__(self, "compile", bool(self.compile))
        check_dtype(self.dtype)
        check_device(self.device)
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"--cuda-graphs needs a CUDA device (got --device {self.device}); "
                             "leave it unset or pass --no-cuda-graphs")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.ngram_draft not in ("on", "off"):
            raise ValueError(f"ngram_draft must be 'on' or 'off' (got {self.ngram_draft!r})")
        if not 0 <= self.drafter_threads <= 1024:
            raise ValueError(f"drafter_threads must be in [0, 1024] (0 = auto; got {self.drafter_threads})")


def drafter_threads(setting: int, device: str, cores: int | None) -> int | None:
    """The drafter process's intra-op thread count for ``--drafter-threads`` (None: leave torch's default).

    ``setting`` > 0 is taken as given. Auto (0) on CPU: 1 thread on a machine with at most 2 cores,
    else half of them. At one request the drafter and the verifier take turns, and the verifier's
    OpenMP threads spin-wait for a while after each parallel region, so a drafter using every core
    competes with them: on the project's 2-core VM the drafter's compute per drafted round fell
    from 9.4 + 5.1 ms (block + tree build, 2 threads) to 6.3 + 3.5 ms (1 thread) and the default
    server's GSM8K ratio over ``ar`` through HTTP rose from 1.047x to 1.137x
    (benchmarks/results/2026-12-04-drafter-threads/). A CUDA
    drafter keeps torch's default (its host threads only launch kernels).

    Args:
        setting: the configured value (0 = auto); device: the drafter's device; cores:
            ``os.cpu_count()`` (None = unknown: 1 thread).
    """
    if setting > 0:
        return setting
    if not device.startswith("cpu"):
        return None
    return 1 if not cores or cores <= 2 else cores // 2


class DrafterWorker:
    """Per-process drafter state: the service, the verifier's epoch, live request contexts.

    Args:
        service: a ``DrafterService`` (or any object with ``draft_batch``/``release``/``num_contexts``).
        info: this drafter's handshake info.
        transport: a :class:`services.ipc_pool.TensorTransport`.
        send: ``send(identity, msg, frames)`` (the I/O thread's :meth:`ServerIO.send`).
        release_memory: called after a message is handled (and dropped, its frames with it) when
            that message carried at least ``release_after_bytes`` of features (a prompt's, 11.8 MB
            for 2,041 rows of SmolLM2's 2,880 bfloat16 features) or released the last context
            (default :func:`services.runtime.trim_heap`: glibc keeps the freed heap of a prompt's
            context temporaries and frames resident otherwise).
        release_after_bytes: features bytes of one draft batch that make :attr:`release_memory` due.
    """

    def __init__(self, service, info: PeerInfo, transport, metrics: DrafterMetrics | None = None,
                 send: Callable | None = None, release_memory: Callable[[], None] | None = None,
                 release_after_bytes: int = 1 << 20):
        self.service, self.info, self.transport = service, info, transport
        self._release_memory = release_memory or trim_heap
        self.release_after_bytes = release_after_bytes
        self._release_due = False
        self.metrics = metrics or DrafterMetrics()
        self.send = send
        self.inbox: queue.Queue = queue.Queue()
        self._verifier_epoch: str | None = None
        self._contexts: set[str] = set()
        self.draining = False
        self._drain_deadline = 0.0
        self._last_draft = 0.0  # monotonic time of the last draft handled
        self._handlers = {MessageType.HELLO: self._hello, MessageType.DRAFT_BATCH: self._draft_batch,
                          MessageType.RELEASE: self._release}

    # ------------------------------------------------------------------------------ I/O thread

    def on_io_message(self, identity: bytes, dec: Decoded):
        """Answer PINGs on the I/O thread; queue what the compute loop handles; drop the rest."""
        if dec.type == MessageType.PING:
            return Pong(dec.msg.nonce, self.info.epoch, ready=not self.draining, draining=self.draining,
                        detail="the drafter is draining" if self.draining else "")
        if dec.type in self._handlers:
            return None
        log.warning("dropped an unexpected %s message", dec.type.name)
        self.metrics.ipc_errors.labels("verifier").inc()
        return False

    # ------------------------------------------------------------------------- compute thread

    def event_loop(self, stop: threading.Event) -> None:
        """recv -> dispatch -> compute -> send, until ``stop`` is set or a drain is over (:meth:`drained`)."""
        while not stop.is_set() and not self.drained():
            self.run_once()

    def run_once(self, timeout: float = 0.1) -> None:
        """Handle one queued message (waiting up to ``timeout`` seconds for one), then, when it made
        it due, drop the message (its frames) and call ``release_memory``."""
        try:
            identity, dec = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return
        self.handle(identity, dec)
        del dec  # its frames go before the heap is trimmed
        if self._release_due:
            self._release_due = False
            self._release_memory()

    def begin_drain(self, timeout_s: float) -> None:
        """Keep serving drafts, report "not ready", end when idle or after ``timeout_s`` seconds (idempotent)."""
        if not self.draining:
            self.draining, self._drain_deadline = True, time.monotonic() + timeout_s
            log.info("draining: %d request contexts live, up to %.0f s", len(self._contexts), timeout_s)

    def drained(self) -> bool:
        """Draining and either idle (no context, no draft for :data:`DRAIN_IDLE_S`) or past the deadline."""
        if not self.draining:
            return False
        now = time.monotonic()
        if now > self._drain_deadline:
            log.warning("drain timeout: stopping with %d request contexts live", len(self._contexts))
            return True
        return not self._contexts and now - self._last_draft >= DRAIN_IDLE_S

    def handle(self, identity: bytes, dec: Decoded) -> None:
        self.metrics.calls.labels(dec.type.name.lower()).inc()
        self._handlers[dec.type](identity, dec)
        self.metrics.contexts.set(len(self._contexts))

    def _hello(self, identity: bytes, dec: Decoded) -> None:
        hello: Hello = dec.msg
        reason = check_hello_version(hello.protocol_version) or check_compatible(self.info, hello.info)
        if reason is None:
            if self._verifier_epoch not in (None, hello.info.epoch):
                log.warning("a new verifier (epoch %s) connected: dropping %d stale contexts", hello.info.epoch,
                            len(self._contexts))
                for rid in list(self._contexts):
                    self._forget(rid)
            self._verifier_epoch = hello.info.epoch
            self.transport.attach(hello.info.pool)
        else:
            log.error("refusing verifier: %s", reason)
        self.send(identity, HelloAck(PROTOCOL_VERSION, reason is None, self.info, reason or ""))

    def _draft_batch(self, identity: bytes, dec: Decoded) -> None:
        """Several requests' drafts in one drafter forward; one :class:`DraftReply` per job."""
        jobs = dec.msg.jobs
        self._last_draft = time.monotonic()
        self.metrics.batch_jobs.observe(len(jobs))
        try:
            # a frame is viewed, not copied: the service reads features only inside draft_batch (its
            # context keeps their K/V) and the frames live until this message is handled; a CUDA-IPC
            # pool slot is copied out, as the peer rewrites it after num_slots further tensors
            feats = self.transport.unpack([j.features for j in jobs], dec.frames,
                                          copy=self.transport.kind != "frames")
        except Exception as exc:  # malformed frames: every job fails, the drafter keeps serving
            results = [exc] * len(jobs)
        else:
            results = self._draft_jobs(jobs, feats)
            self._release_due |= sum(getattr(f, "nbytes", 0) for f in feats) >= self.release_after_bytes
        for j, res in zip(jobs, results):
            frames: list = []
            if isinstance(res, BaseException):
                log.warning("draft failed: %s: %s", type(res).__name__, res)
                self.metrics.errors.inc()
                if is_out_of_memory(res):  # the verifier reports it (metric, readiness detail)
                    self.metrics.out_of_memory.inc()
                reply = DraftReply(j.request_id, j.round_id, self.info.epoch,
                                   error=f"{type(res).__name__}: {res}"[:4000])
            else:
                tree, timings = res
                self._contexts.add(j.request_id)
                metas, frames = self.transport.pack([tree.draft_tokens, tree.parents, tree.depths, tree.scores])
                reply = DraftReply(j.request_id, j.round_id, self.info.epoch, tuple(metas), timings)
                for phase, seconds in timings.items():
                    self.metrics.seconds.labels(phase).observe(seconds)
            self.send(identity, reply, frames)
        if any(isinstance(r, BaseException) and is_out_of_memory(r) for r in results):
            release_device_cache()  # the next batch starts from what is really in use

    def _draft_jobs(self, jobs: list, feats: list) -> list:
        """``service.draft_batch`` over the wire jobs (their knobs' ranges were checked on decode:
        :class:`TreeKnobs` checks itself); the service answers a job it cannot draft with its error."""
        return self.service.draft_batch([_Job(j, f) for j, f in zip(jobs, feats)])

    def _release(self, identity: bytes, dec: Decoded) -> None:
        self._forget(dec.msg.request_id)

    def _forget(self, request_id: str) -> None:
        self.service.release(request_id)
        had = bool(self._contexts)
        self._contexts.discard(request_id)
        self._release_due |= had and not self._contexts


class _Job:
    """A wire :class:`DraftRequest` as ``DrafterService.draft_batch``'s job: its features tensor
    attached (the fields of the verifier's ``DraftJob``; the knobs are the message's own
    :class:`~services.spec.TreeKnobs`)."""

    def __init__(self, msg, features):
        self.request_id, self.committed_ids, self.root_token = msg.request_id, msg.committed_ids, msg.root_token
        self.start, self.max_depth, self.features = msg.start, msg.max_depth, features
        self.method, self.spec = msg.method, msg.knobs


# ------------------------------------------------------------------------------------ process entry

def check_drafter_dir(path: str | Path) -> Path:
    """``path`` as a drafter checkpoint directory; FileNotFoundError (one line) without its config.json."""
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"drafter directory {str(path)!r} has no config.json")
    return path


def drafter_info(service, target_dir: Path, epoch: str, device: str, transport) -> PeerInfo:
    """This drafter's handshake info from the service and the target directory."""
    info = service.info()
    return PeerInfo(role="drafter", epoch=epoch, tokenizer_hash=tokenizer_hash(target_dir),
                    vocab_size=int(info["vocab_size"]), eos_token_id=config_eos_token_id(target_dir),
                    special_token_ids=special_token_ids(target_dir), block_size=int(info["block_size"]),
                    feature_dim=int(info["feature_dim"]), max_position=int(info["max_position"]),
                    target_layer_ids=tuple(int(i) for i in info.get("target_layer_ids") or
                                           getattr(getattr(service, "cfg", None), "target_layer_ids", ())),
                    model=str(info.get("description", "")), methods=tuple(info["methods"]), device=device,
                    pool=transport.export(), context_bytes=int(info.get("context_bytes", 0)))


def run_drafter_process(config: DrafterWorkerConfig, parent_pid: int | None = None) -> None:
    """Entry of the drafter process (blocking until SIGTERM, or SIGINT when run alone)."""
    import zmq

    from services.devices import bind_device
    from services.ipc_pool import make_transport
    from services.runtime import on_stop_signals, prepare_process, start_metrics_server
    from services.wire import ServerIO, ipc_endpoint, new_epoch

    prepare_process("dartree-drafter", config.log_level, parent_pid)
    config = dataclasses.replace(config, device=bind_device(config.device))  # "cuda" -> "cuda:N", set_device
    threads = drafter_threads(config.drafter_threads, config.device, os.cpu_count())
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
        log.info("drafter uses %d CPU thread%s", threads, "" if threads == 1 else "s")
    from services.drafter.build import build_from_config
    from services.startup import memory_line, object_memory_parts, phase

    with phase("drafter", "drafter loaded"):
        service, target_dir = build_from_config(config)
    from services.weights import release_freed_memory

    release_freed_memory()  # the float32 checkpoint tensors and the full borrowed lm_head, gone since loading
    log.info("%s", memory_line("drafter", object_memory_parts(service)))
    link = config.transport
    transport = make_transport(config.device, link.cuda_ipc, link.ipc_slots, link.ipc_slot_bytes)
    info = drafter_info(service, target_dir, new_epoch(), config.device, transport)
    metrics = DrafterMetrics(drafter=info.model)
    if getattr(service, "ngram", None) is not None:
        metrics.track_ngram(service.ngram.counts)
    start_metrics_server(config.drafter_metrics_port, link.metrics_host, metrics.registry)
    stop = threading.Event()
    ctx = zmq.Context()
    worker = DrafterWorker(service, info, transport, metrics)
    on_stop_signals(lambda: worker.begin_drain(config.drain_timeout_s), stop.set, supervised=parent_pid is not None)
    endpoint = config.drafter_endpoint or ipc_endpoint("drafter")
    io = ServerIO(ctx, endpoint, "drafter", on_message=worker.on_io_message,
                  on_error=lambda reason: metrics.ipc_errors.labels("verifier").inc(),
                  refuse=lambda reason: HelloAck(PROTOCOL_VERSION, False, info, reason),
                  max_tensor_bytes=config.max_tensor_bytes, inbox=worker.inbox)
    worker.send = io.send
    io.start()
    log.info("drafter ready on %s (block %d, methods %s)", endpoint, info.block_size, ", ".join(info.methods))
    try:
        worker.event_loop(stop)
    finally:
        io.close()
        ctx.destroy(linger=0)
        log.info("drafter stopped")
