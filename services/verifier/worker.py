"""The verifier process: request table, FIFO admission, one planned ``SpecEngine.step`` per loop.

Loop (docs/design.md, "Worker processes"), on the compute thread: recv (drain the inbox filled by
the gateway I/O thread) ->
schedule (admit FIFO while fewer than ``max_running`` run; every running request, in an order
that rotates each step) -> plan (``scheduler.make_plan``: the engine's candidates, each decode
round's tree knobs from the engine's policy, the row budget) -> run it (``engine.step(plan)``) ->
send each request's
:class:`RoundChunk`. Aborts take effect at the next step boundary and free the engine's KV cache
and the drafter context. Hello and Ping are answered on the I/O thread (readiness never waits
behind a step). Torch is imported by :func:`run_verifier_process` only.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from services.devices import is_out_of_memory
from services.memory_plan import DEFAULT_MAX_RUNNING
from services.metrics import VerifierMetrics
from services.protocol import (
    METHODS,
    PROTOCOL_VERSION,
    Abort,
    Generate,
    HelloAck,
    MessageType,
    PeerInfo,
    Pong,
    RequestError,
    RoundChunk,
    TokenLogprobs,
    check_compatible,
    check_hello_version,
)
from services.runtime import WEIGHT_CHOICES, check_device, check_dtype, drop_file_pages, trim_heap
from services.spec import (DEFAULT_MAX_REQUEST_BUDGET, DEFAULT_METHOD, DEFAULT_POLICY, MAX_BUDGET, POLICIES,
                           Method, check_tree_knobs, parse_tree_schedule, request_tree_limits)
from services.verifier.remote_drafter import DrafterError, DrafterUnavailable
from services.verifier.scheduler import OverlapGroups, StepPlan, make_plan
from services.wire import Decoded

log = logging.getLogger("verifier")
RESTART_AFTER_COMPILE_EXIT = 75  # exit code: "start me again, my compiled steps are on disk now"
DRAFTER_PING_TIMEOUT_S = 1.0  # a drafter heartbeat ping without a Pong by then: not ready
_PARAM_RE = re.compile(r"(speculative\.\w+|max_tokens|temperature|top_p|top_k|prompt|stop_token_ids|logprobs)")


@dataclass(frozen=True)
class VerifierWorkerConfig:
    """Verifier process settings (CLI ``--field-name``, env ``DARTREE_FIELD_NAME``).

    Attributes:
        target: target model (default name or local HF directory).
        verifier_endpoint: where the verifier listens for the gateway ("" = default ipc:// socket).
        drafter_endpoint: the drafter's endpoint ("" = default ipc:// socket; "none" = no drafter, AR only).
        device, dtype: where and in which precision the target runs.
        compile: run the target's batched steps through ``torch.compile`` (warm-up at start, logged;
            about a minute the first time on a small CPU, seconds once inductor's disk cache under the
            state directory is warm). None (auto): compiled for a q4 llama target on CPU
            (:func:`services.verifier.runner.auto_compile`), eager otherwise.
        weights: the target's weight format (``services/weights.py``): float32, bfloat16, q4 (the
            GGUF's 4-bit blocks, bfloat16 activations) or auto (the fastest here, measured once and
            cached); a concrete format overrides ``dtype``.
        max_running: requests decoded concurrently, each in its own KV slot, all in one batched step
            (unset: 8 on CPU; on CUDA planned from the device's free memory, at most 8: see
            docs/memory-plan.md); max_waiting: queued beyond that (429 after).
        max_context: context window (0 = the target's; on CUDA the longest that fits when that
            does not).
        gpu_memory_utilization: on CUDA, the fraction of the device's memory the server may use
            (weights, KV cache, feature history, drafter contexts, step buffers); the start-up plan
            derives or checks the running requests and the context window against it
            (docs/memory-plan.md).
        prefill_chunk: prompt tokens a request prefills per step (chunked prefill rides along with the
            running requests' rounds); max_step_tokens: rows one step may hold (verify rows + chunks;
            requests beyond it wait for the next step, the order rotates so none starves);
            kv_bucket: a step reads the KV cache up to its longest context rounded up to this.
        overlap: split the running drafting requests into two groups that take turns: while the
            target verifies one group, the drafter drafts the other's next trees (submitted right
            after their commit); ``ar`` requests run in every step. Same tokens; pays off when the
            drafter has its own core / GPU stream.
        default_method: method when a request names none (must be one the drafter serves).
        spec_policy: ``goodput`` (default): per step, each request's tree budget (0 = plain decoding,
            no drafter call) is chosen to maximise expected emitted tokens per second of the whole
            step, from calibrated per-node acceptance and a measured step cost model
            (``services/verifier/policy.py``); ``fixed``: every drafting request drafts and verifies
            its whole tree every round (the behaviour before the policy existed).
        spec_max_budget: the goodput policy's B_max, the budget of its drafter calls and the most nodes
            it verifies per request (0 = ``budget``, the default tree budget).
        max_request_budget: the largest tree a request may ask for in ``speculative``: budget and
            width up to it, candidates up to it or 64; the gateway refuses more with a 400 naming the
            knob. One request's tree is verified in the step all running requests share, so this
            bounds what one client can cost the others.
        cost_sweep: with ``goodput``, time a few target forwards at start-up (1-8, 9, 17, 33 rows and
            on to B + 1 of the budget, e.g. 65 on CUDA, timed with CUDA events there; a few seconds,
            cached per machine / model / dtype in ``~/.cache/dartree/cost_model.json`` when its
            repeats agree; on a busy CPU a rule-based curve, not cached).
        tree_schedule: manual override, load-dependent tree budget/width, ``"1:16x12,2:12x8,4:8x6,8:4x4"``
            (``N:BxW`` = at >= N running requests, B nodes and width W; only for requests that leave
            budget/width unset). "" = off. With ``goodput`` the pick is the drafter call's budget and the
            policy may still verify fewer nodes (docs/configuration.md, "Tree defaults").
        budget, width, depth_bonus, candidates: the default tree knobs, for what a request leaves
            unset (None = :func:`services.spec.default_tree_knobs` of ``device``: B=8 on CPU, 64 on
            CUDA; W=12, beta=-0.2, K=64). The policy resolves every draft's knobs from them and
            the drafter receives resolved knobs only; the GEMM packs are sized by ``budget``.
        draft_timeout_s: deadline of one drafter round trip; drafter_wait_s: how long to wait for the
            drafter at start; health_interval_s: period of the drafter heartbeat (a thread of its own,
            so a hung drafter is seen within this period + 2 s even while requests run, and
            the verifier decodes without speculation until it answers again).
        drain_timeout_s: on SIGTERM, how long running requests may finish.
        cuda_ipc, ipc_slots, ipc_slot_bytes: CUDA-IPC pool for features (CUDA devices only).
        packed_gemm: on a float32 CPU, pack the target's GEMM weights for the step sizes of the
            batched steps (4, B + 1 doubling up to max_running x (B + 1), a chain method's block + 1
            rows), each on the first step of that size (``services/cpu_gemm.py``: same numerics;
            SmolLM2: ~0.5 GB per step size used).
        verifier_metrics_port, metrics_host: Prometheus endpoint (port 0 = off).
        prefix_cache: a finished request's KV slot keeps its conversation (KV and target features);
            a request whose prompt starts with it prefills only the rest (chat turns resend the whole
            conversation). Same tokens as a cold prefill, speculation included.
        prefix_cache_mib: memory bound, in MiB, on what cached prefixes hold beyond the reserved KV
            slots: one target feature row per cached position (SmolLM2-135M with the default
            drafter: 11.25 KiB a position in float32) plus its token id; past it the least recently
            used prefixes are evicted (a running request's KV never is). 0 keeps no prefix.
        restart_after_compile: when a start compiled the target's steps from a cold cache (the
            warm-up wrote inductor's disk cache), end the process right after the warm-up so that the
            supervisor starts it again: the restarted process loads the compiled steps from the disk
            cache in seconds and holds none of the compiler's in-memory state (~50 MB on SmolLM2-135M).
            None (auto): only under ``dartree serve``'s supervisor, which restarts it once.
    """

    target: str = "smollm2-135m-instruct"
    verifier_endpoint: str = ""
    drafter_endpoint: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    weights: str = "auto"
    max_running: int | None = None
    max_waiting: int = 64
    max_context: int = 0
    prefill_chunk: int = 256
    max_step_tokens: int = 512
    kv_bucket: int = 64
    overlap: bool = False
    compile: bool | None = None
    default_method: str = DEFAULT_METHOD
    spec_policy: str = DEFAULT_POLICY
    spec_max_budget: int = 0
    max_request_budget: int = DEFAULT_MAX_REQUEST_BUDGET
    cost_sweep: bool = True
    tree_schedule: str = ""
    budget: int | None = None
    width: int | None = None
    depth_bonus: float | None = None
    candidates: int | None = None
    draft_timeout_s: float = 30.0
    drafter_wait_s: float = 600.0
    health_interval_s: float = 1.0
    drain_timeout_s: float = 30.0
    cuda_ipc: bool = True
    ipc_slots: int = 16
    ipc_slot_bytes: int = 8 << 20
    packed_gemm: bool = True
    verifier_metrics_port: int = 8001
    metrics_host: str = "127.0.0.1"
    log_level: str = "INFO"
    prefix_cache: bool = True
    prefix_cache_mib: int = 256
    restart_after_compile: bool | None = None
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.max_running is None and not self.device.startswith("cuda"):  # CUDA: the memory plan sets it
            object.__setattr__(self, "max_running", DEFAULT_MAX_RUNNING)
        if (self.max_running is not None and self.max_running < 1) or self.max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        if self.prefix_cache_mib < 0:
            raise ValueError(f"prefix_cache_mib must be >= 0 (got {self.prefix_cache_mib})")
        for name in ("prefill_chunk", "max_step_tokens", "kv_bucket"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        check_dtype(self.dtype)
        check_device(self.device)
        if self.weights not in WEIGHT_CHOICES:
            raise ValueError(f"weights {self.weights!r} is not supported (choose from {', '.join(WEIGHT_CHOICES)})")
        if self.default_method not in METHODS:
            raise ValueError(f"unknown default_method {self.default_method!r} (choose from {', '.join(METHODS)})")
        parse_tree_schedule(self.tree_schedule, MAX_BUDGET, self.max_running)  # ValueError: one line
        check_tree_knobs(self.budget, self.width, self.depth_bonus, self.candidates, prefix="")
        if self.spec_policy not in POLICIES:
            raise ValueError(f"unknown spec_policy {self.spec_policy!r} (choose from {', '.join(POLICIES)})")
        if not 0 <= self.spec_max_budget <= MAX_BUDGET:
            raise ValueError(f"spec_max_budget must be in [0, {MAX_BUDGET}] (got {self.spec_max_budget})")
        request_tree_limits(self.max_request_budget)  # ValueError: one line


@dataclass
class _Entry:
    """One request in the table."""

    identity: bytes          # the gateway connection to answer
    gen: Generate
    arrival: float
    method: str
    rounds: int = 0
    started: bool = False    # entered a step (queue time observed)
    spec_stats: dict = field(default_factory=dict)


class VerifierWorker:
    """Request table and scheduling around an engine (``add_request`` / ``step`` / ``abort``).

    Args:
        engine: a ``SpecEngine`` (or a fake with the same four methods).
        info: this verifier's handshake info (model, context, methods, limits, default spec).
        config: limits and defaults.
        send: ``send(identity, msg)`` to the gateway (the I/O thread's :meth:`ServerIO.send`).
        drafter_ping: returns whether the drafter answers (called when idle); None = no drafter.
        release_memory: called once when the table has stayed empty for ``release_idle_s``
            seconds after a step (default :func:`services.runtime.trim_heap`: glibc's
            ``malloc_trim``; no ``gc.collect()``, which holds a spawned worker's GIL for ~200 ms).
            glibc keeps
            the heap pages a load freed resident: after 8 streams of ~2,000 tokens on SmolLM2-135M
            q4, 85 MB of the verifier's RSS (benchmarks/results/2026-12-03-serving-memory). Not
            during a load (its memory is live) and not between back-to-back requests (a request
            arriving within ``release_idle_s`` cancels it).
        release_idle_s: idle seconds before ``release_memory`` runs.

    ``release_memory`` also runs after every step that prefilled prompt chunks: glibc would keep
    the pages of each chunk's freed temporaries (activations, feature slices) resident while the
    KV and the kept features grow through the prefill, where the serving peak sits (8 prompts of
    ~2,000 tokens: the verifier's peak 977 -> 922 MB PSS). One trim took 1.4-8.7 ms (median
    3.4 ms over the 31 prompt-chunk steps of that load, each ~2 s on a 2-core CPU); decode-only
    steps never trim (benchmarks/results/2026-12-03-serving-memory-trim).
    """

    def __init__(self, engine, info: PeerInfo, config: VerifierWorkerConfig, metrics: VerifierMetrics | None = None,
                 send: Callable | None = None, drafter_ping: Callable[[], bool] | None = None,
                 release_memory: Callable[[], None] | None = None,
                 release_idle_s: float = 1.0):
        self.engine, self.info, self.config = engine, info, config
        self._release_memory = release_memory or trim_heap
        self._release_idle_s = release_idle_s
        self._release_at: float | None = None  # when the idle table's heap is handed back
        self.metrics = metrics or VerifierMetrics()
        self.send = send
        self.inbox: queue.Queue = queue.Queue()
        self.drafter_ok = True
        self.drafter_detail = ""  # why the drafter is not ok (set with drafter_ok by the heartbeat)
        self.drafter_oom = (0, "")  # drafts failed for lack of the drafter's device memory: (count, last error)
        self.metrics.drafter_up.set(1 if drafter_ping is not None else 0)  # 0 without a drafter at all
        self._heartbeat_seen = False  # a DrafterHeartbeat reports (then the idle ping defers to it)
        self.draining = False
        self._drafter_ping = drafter_ping
        self.tree_schedule = parse_tree_schedule(config.tree_schedule)
        self._last_ping = 0.0
        self._waiting: deque[_Entry] = deque()
        self._running: dict[str, _Entry] = {}
        self._order: deque[str] = deque()  # round-robin order of running ids
        self._groups = OverlapGroups()     # overlap: the two groups of drafting requests that take turns
        self._handlers = {MessageType.GENERATE: self._on_generate, MessageType.ABORT: self._on_abort}

    # ------------------------------------------------------------------------------ I/O thread

    def post(self, identity: bytes, msg) -> None:
        """Queue a Generate/Abort for the compute loop without a socket (the in-process transport,
        docs/design.md "Two transports")."""
        from services.protocol import MESSAGE_TYPES

        self.inbox.put((identity, Decoded(MESSAGE_TYPES[type(msg)], msg, [])))

    def on_io_message(self, identity: bytes, dec: Decoded):
        """Hello/Ping answered here; Generate/Abort go to the compute loop; anything else dropped."""
        if dec.type == MessageType.PING:
            return self.status(dec.msg.nonce)
        if dec.type == MessageType.HELLO:
            return self.hello(dec.msg)
        if dec.type in self._handlers:
            return None
        log.warning("dropped an unexpected %s message", dec.type.name)
        self.metrics.ipc_errors.labels("gateway").inc()
        return False

    def hello(self, hello) -> HelloAck:
        reason = check_hello_version(hello.protocol_version) or check_compatible(self.info, hello.info)
        if reason:
            log.error("refusing a gateway: %s", reason)
        return HelloAck(PROTOCOL_VERSION, reason is None, self.info, reason or "")

    def status(self, nonce: int = 0) -> Pong:
        """A :class:`Pong` snapshot. Ready whether or not the drafter answers: while it is down every
        round is a plain round (same tokens, slower; ``SpecEngine.set_drafter_up``), and ``detail``
        says so."""
        detail = "" if self.drafter_ok else \
            f"decoding without speculation: {self.drafter_detail or 'the drafter is not answering'}"
        if self.drafter_oom[0]:  # never silent: readiness says so until the server restarts
            oom = f"the drafter ran out of device memory {self.drafter_oom[0]} time(s) (last: {self.drafter_oom[1]})"
            detail = f"{detail}; {oom}" if detail else oom
        return Pong(nonce, self.info.epoch, ready=True, draining=self.draining,
                    num_running=len(self._running), num_waiting=len(self._waiting), detail=detail)

    # ------------------------------------------------------------------------- compute thread

    def event_loop(self, stop: threading.Event) -> None:
        """Run until ``stop``; after :meth:`begin_drain`, until the table is empty or the drain times out."""
        drain_deadline = None
        while not stop.is_set():
            if self.draining:
                drain_deadline = drain_deadline or time.monotonic() + self.config.drain_timeout_s
                if not self._has_work():
                    break
                if time.monotonic() > drain_deadline:
                    log.warning("drain timeout: failing %d requests", len(self._running) + len(self._waiting))
                    break
            try:
                self.run_once()
            except Exception:  # a bug in scheduling must not kill the process: fail the table, go on
                log.exception("verifier loop error; failing all requests")
                self.fail_all(500, "internal error in the verifier", "internal_error")
        self.fail_all(503, "the server is shutting down", "shutdown")

    def begin_drain(self) -> None:
        """Refuse new requests (503 ``draining``), finish the ones in the table, then leave the loop (idempotent)."""
        if not self.draining:
            log.info("draining: %d running, %d waiting", len(self._running), len(self._waiting))
        self.draining = True

    def run_once(self, idle_timeout: float = 0.05) -> None:
        """One loop iteration: recv -> schedule -> one batched step (every running request) -> send."""
        self._recv(block=not self._has_work(), timeout=idle_timeout)
        self._admit()
        order = self._schedule()
        if order:
            self._step_batch(order)
            if getattr(self.engine.last_step, "prefill_tokens", 0):  # see the class docstring
                self._release_memory()
        self._update_gauges()
        if not self._has_work():
            now = time.monotonic()
            if order:  # the last request just left: hand the freed heap back once it stays idle
                self._release_at = now + self._release_idle_s
            if self._release_at is not None and now >= self._release_at:
                self._release_at = None
                self._release_memory()
            self._check_drafter()
        else:
            self._release_at = None

    def fail_all(self, status: int, message: str, code: str) -> None:
        """Abort every request with an error (shutdown, fatal engine error)."""
        for entry in list(self._waiting) + list(self._running.values()):
            self._error(entry, status, message, None, code)
            self.engine.abort(entry.gen.request_id)
        self._waiting.clear()
        self._running.clear()
        self._order.clear()
        self._update_gauges()

    def _has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def _recv(self, block: bool, timeout: float) -> None:
        try:
            item = self.inbox.get(timeout=timeout) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            identity, dec = item
            self._handlers[dec.type](identity, dec.msg)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _on_generate(self, identity: bytes, gen: Generate) -> None:
        rid = gen.request_id
        entry = _Entry(identity, gen, time.monotonic(), gen.spec.method or self.config.default_method)
        if self.draining:
            return self._error(entry, 503, "the server is draining", None, "draining")
        if rid in self._running or any(e.gen.request_id == rid for e in self._waiting):
            return self._error(entry, 400, f"request id {rid!r} is already in flight", None, "duplicate_request_id")
        # room = free slots + queue places, counting the running requests and every request accepted
        # before this one (in this inbox batch too: they sit in _waiting until the next _admit)
        if len(self._running) + len(self._waiting) >= self.config.max_running + self.config.max_waiting:
            return self._error(entry, 429, "the verifier queue is full; retry later", None, "overloaded")
        self._waiting.append(entry)

    def _on_abort(self, identity: bytes, abort: Abort) -> None:
        rid = abort.request_id
        entry = self._running.get(rid)
        if entry is not None:
            self._drop(rid)
            self.engine.abort(rid)
        else:
            before = len(self._waiting)
            self._waiting = deque(e for e in self._waiting if e.gen.request_id != rid)
            if len(self._waiting) == before:
                return  # already finished: nothing to free
            self._update_gauges()
        self.metrics.aborts.labels(abort.reason).inc()
        if abort.reason == "stop_string":  # a normal finish: the gateway matched a stop string
            log.info("finished %s at a stop string", rid)
        else:
            log.info("aborted %s (%s)", rid, abort.reason)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_running:
            entry = self._waiting.popleft()
            rid = entry.gen.request_id
            try:  # the wire's params as they are, the method filled in (services.params)
                spec = msgspec.structs.replace(entry.gen.spec, method=entry.method)
                self.engine.add_request(rid, list(entry.gen.prompt_ids), entry.gen.sampling, spec)
            except ValueError as exc:
                m = _PARAM_RE.search(str(exc))
                param = getattr(exc, "param", None) or (m.group(1) if m else None)
                self._error(entry, 400, str(exc), param, "invalid_value")
                continue
            self._running[rid] = entry
            self._order.append(rid)

    def _schedule(self) -> list[str]:
        """Every running request in priority order, rotated one place per step: a step that cannot
        hold them all (``max_step_tokens``) starts from a different request next time (no starvation).
        With ``overlap``: the drafting requests form two balanced groups that take turns (``ar``
        requests join every step)."""
        order = list(self._order)
        self._order.rotate(-1)
        if not self.config.overlap:
            return order
        return self._groups.pick(order, {r for r in order if self._running[r].method != Method.AR})

    def _plan(self, order: list[str]) -> StepPlan:
        """The step's plan over ``order`` (:func:`make_plan`: the engine's candidates, its policy's
        knobs, the row budget), run as it is by ``engine.step``."""
        e = self.engine
        return make_plan(e.candidates(order), e.policy, e.config.max_step_tokens, e.config.prefill_chunk,
                         e.num_active())

    def _step_batch(self, order: list[str]) -> None:
        """One engine step over ``order`` (the plan this worker makes); each request's result is sent
        as its own chunk."""
        try:
            results = self.engine.step(self._plan(order))
        except Exception as exc:  # the shared forward failed: the engine freed every request of the step
            log.exception("batched step failed for %d requests", len(order))
            for rid in order:
                entry = self._running.get(rid)
                if entry is not None:
                    self._drop(rid)
                    self._step_failed(entry, exc)
            return
        self._observe_step(self.engine.last_step)
        for rid, out in results.items():
            entry = self._running[rid]
            if not entry.started:
                entry.started = True
                self.metrics.queue.observe(time.monotonic() - entry.arrival)
            if isinstance(out, BaseException):
                self._drop(rid)
                self._step_failed(entry, out)
            elif out is not None:
                self._deliver(rid, entry, out)

    def _observe_step(self, st) -> None:
        if not st.requests:
            return
        m = self.metrics
        m.step_requests.observe(st.requests)
        m.step_rows.observe(st.rows)
        m.prefill_chunk_tokens.inc(st.prefill_tokens)
        m.drafter_wait.inc(st.draft_wait_seconds)
        m.drafter_busy.inc(st.draft_seconds)
        m.step_seconds.observe(st.forward_seconds)
        if st.decoding:
            m.observe_policy_step(st.speculating, st.predicted_seconds, st.wall_seconds)

    def _deliver(self, rid: str, entry: _Entry, out) -> None:
        """Count a request's round and send its chunk (dropping it first when it finished)."""
        entry.rounds += 1
        self._observe(entry, out)
        if out.finish_reason is not None:
            self._drop(rid)  # before sending: the table (and gauges) never outlive the last chunk
        self.send(entry.identity, RoundChunk(rid, list(out.token_ids), out.finish_reason,
                                             num_draft_tokens=out.num_draft_tokens, accept_length=out.accept_length,
                                             logprobs=_wire_logprobs(out.logprobs),
                                             stop_token_id=out.stop_token_id))

    def tree_knobs(self) -> tuple[int, int] | None:
        """``(budget, width)`` the schedule picks at the current running count (None = no pick), for
        the gauges (the engine's policy applies the same schedule to each request)."""
        return self.tree_schedule.pick(len(self._running)) if self.tree_schedule else None

    def _step_failed(self, entry: _Entry, exc: Exception) -> None:
        if isinstance(exc, DrafterUnavailable):
            self._set_drafter(False, str(exc))
            log.error("drafter unavailable: %s", exc)
            self._error(entry, 503, f"the drafter is unavailable: {exc}", None, "drafter_unavailable")
        elif isinstance(exc, DrafterError) and is_out_of_memory(str(exc)):
            log.error("%s (lower --max-running, --max-context or --gpu-memory-utilization)", exc)
            self.drafter_oom = (self.drafter_oom[0] + 1, str(exc)[:200])
            self.metrics.drafter_oom.inc()
            self._error(entry, 500, str(exc), None, "drafter_out_of_memory")
        elif isinstance(exc, DrafterError):
            log.error("%s", exc)
            self._error(entry, 500, str(exc), None, "drafter_error")
        else:
            log.exception("engine step failed for %s", entry.gen.request_id)
            self._error(entry, 500, "internal error in the verifier", None, "internal_error")
        self.metrics.aborts.labels("error").inc()

    def _observe(self, entry: _Entry, out) -> None:
        if out.is_prefill:
            self.metrics.observe_prefill(len(out.token_ids), out.prefill_seconds)
            return
        self.metrics.observe_round(entry.method, out.num_draft_tokens, out.accept_length, list(out.accepted_per_depth),
                                   len(out.token_ids), dict(out.timings), out.prefill_seconds,
                                   getattr(out, "grammar_masked", 0), out.finish_reason)
        predicted = out.predicted_tau if out.finish_reason is None else None
        self.metrics.observe_policy_round(entry.method, out.num_draft_tokens, predicted, out.accept_length + 1)

    def _drop(self, rid: str) -> None:
        if self._running.pop(rid, None) is not None:
            self._order.remove(rid)
            self._groups.forget(rid)
        self._update_gauges()

    def _error(self, entry: _Entry, status: int, message: str, param: str | None, code: str) -> None:
        self.send(entry.identity, RequestError(entry.gen.request_id, status, message[:4000], param, code))

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self._running))
        self.metrics.waiting.set(len(self._waiting))
        nfree = self.engine.num_free_slots()
        self.metrics.kv_slots.labels("free").set(nfree)
        self.metrics.kv_slots.labels("used").set(self.config.max_running - nfree)
        prefix = getattr(self.engine, "prefix_cache_stats", None)
        if prefix is not None:
            self.metrics.observe_prefix_cache(*prefix())
            self.metrics.prefix_bytes.set(self.engine.runner.cache.prefix.nbytes())
            self.metrics.observe_graph_eager_steps(self.engine.runner.num_eager_steps)
        budget, width = self.tree_knobs() or (0, 0)
        self.metrics.scheduled_budget.set(budget)
        self.metrics.scheduled_width.set(width)

    def on_drafter_heartbeat(self, ok: bool, detail: str) -> None:
        """The heartbeat thread's verdict on the drafter (see ``DrafterHeartbeat``); feeds the status,
        the engine and the gauge."""
        self._heartbeat_seen = True
        if ok != self.drafter_ok:
            log.info("drafter is %s", "reachable again" if ok else f"not ready: {detail}")
        self._set_drafter(ok, detail)

    def _set_drafter(self, ok: bool, detail: str) -> None:
        """Record the drafter's state for the status, the engine (plain rounds while it is down)
        and the ``dartree_drafter_up`` gauge."""
        self.drafter_ok, self.drafter_detail = ok, detail
        self.engine.set_drafter_up(ok)
        self.metrics.drafter_up.set(1 if ok else 0)

    def _check_drafter(self) -> None:
        """The idle compute thread's own ping (it also re-handshakes a restarted drafter, so the next
        draft does not). Skipped while the heartbeat says the drafter is down: a ping of a dead
        drafter blocks this thread up to its 1 s deadline, which a request arriving meanwhile would
        wait for (the heartbeat says when the drafter is back)."""
        if self._drafter_ping is None or time.monotonic() - self._last_ping < self.config.health_interval_s:
            return
        if self._heartbeat_seen and not self.drafter_ok:
            return
        self._last_ping = time.monotonic()
        ok = self._drafter_ping()
        if ok != self.drafter_ok:
            log.info("drafter is %s", "reachable again" if ok else "unreachable")
        self._set_drafter(ok, "" if ok else "the drafter is not answering")


def _wire_logprobs(lp) -> TokenLogprobs | None:
    """The engine's ``TokenLogprobs`` (a dataclass) as the wire struct."""
    return None if lp is None else TokenLogprobs(list(lp.logprobs), [list(r) for r in lp.top_ids],
                                                 [list(r) for r in lp.top_logprobs])


# ------------------------------------------------------------------------------------ process entry

def verifier_info(target_dir, engine, target, epoch: str, config: VerifierWorkerConfig, methods: tuple[str, ...],
                  drafter: PeerInfo | None) -> PeerInfo:
    """This verifier's handshake info (for the gateway)."""
    from services.protocol import Limits, special_token_ids, tokenizer_hash

    budget, width, candidates = request_tree_limits(config.max_request_budget)
    limits = Limits(max_context=engine.max_context, max_prompt_tokens=engine.max_context - 1,
                    max_tokens=engine.max_context - 1, max_budget=budget, max_running=config.max_running,
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
    transport = make_transport(config.device, config.cuda_ipc, config.ipc_slots, config.ipc_slot_bytes)
    client = ZmqDrafterClient(config.drafter_endpoint or ipc_endpoint("drafter"), local, transport,
                              config.draft_timeout_s, ctx)
    peer = client.connect(wait_s=config.drafter_wait_s)
    log.info("drafter connected (block %d, methods %s)", peer.block_size, ", ".join(peer.methods))
    return client, peer


def build_engine(config: VerifierWorkerConfig, drafter_client, drafter: PeerInfo | None):
    """Load the target (tapping the drafter's layers) and wrap it in a ``SpecEngine``: ``(engine, target, dir)``."""
    import torch

    from services.models.registry import resolve_target
    from services.verifier.build import build_engine as assemble
    from services.verifier.engine import EngineConfig
    from services.verifier.runner import auto_compile
    from services.verifier.target import TargetModel

    from services.startup import phase
    from services.weights import resolve_cli_weights

    target_dir = resolve_target(config.target)
    layer_ids = list(drafter.target_layer_ids) if drafter and drafter.target_layer_ids else None
    weights, _ = resolve_cli_weights(config.weights, config.dtype if config.dtype != "float32" else None,
                                     target_dir, config.device)  # the supervisor passes a concrete one
    with phase("verifier", f"target weights loaded ({weights or config.dtype})"):
        target = TargetModel.from_pretrained(target_dir, layer_ids, dtype=getattr(torch, config.dtype),
                                             device=config.device, weights=weights)
    if drafter is not None and drafter.feature_dim and drafter.feature_dim != target.feature_dim:
        raise RuntimeError(f"drafter expects {drafter.feature_dim}-wide features, the target taps {target.feature_dim}")
    compile = auto_compile(target) if config.compile is None else config.compile
    running, context = engine_limits(config, target, drafter, drafter_client, compile)
    engine_config = EngineConfig(max_context=context, max_running=running,
                                 prefill_chunk=config.prefill_chunk, max_step_tokens=config.max_step_tokens,
                                 kv_bucket=config.kv_bucket, overlap=config.overlap, compile=compile,
                                 prefix_cache=config.prefix_cache)
    with phase("verifier", "engine built (KV cache, GEMM packs, step cost model)"):
        engine = assemble(target, drafter_client, engine_config,
                          max_draft_depth=drafter.block_size if drafter and drafter.block_size else 16,
                          drafter_max_position=(drafter.max_position or None) if drafter else None,
                          policy=config.spec_policy, defaults=default_knobs(config),
                          schedule=parse_tree_schedule(config.tree_schedule),
                          max_budget=config.spec_max_budget or None, cost_sweep=config.cost_sweep,
                          cost_key=(target_dir.name, str(target.weights), config.device),
                          packed_gemm=config.packed_gemm)
    if drafter is not None and hasattr(engine.policy, "attach_store"):  # the goodput policy's calibration
        from services.verifier.calibration_store import CalibrationStore, calibration_key

        engine.policy.attach_store(CalibrationStore(calibration_key(
            target_dir.name, str(target.weights), config.device, drafter_tag(drafter))))
    cache = engine.runner.cache
    cache.prefix.max_bytes = config.prefix_cache_mib * 2**20
    log.info("KV cache: %d slots x %d positions, %.2f GiB reserved (%s, %s; %s)", cache.num_slots, cache.capacity,
             cache.nbytes() / 2**30, target.weights, config.device,
             "allocated on the device" if config.device.startswith("cuda") else "pages committed as used")
    from services.weights import release_freed_memory

    release_freed_memory()  # what the engine build freed (the cost sweep's activations) leaves the RSS
    # the q4 packs file's pages: the lean step's fused copies superseded most of them; the linears
    # still read (o/down projections) fault theirs back at the first step
    log.info("weight file pages dropped: %.0f MB resident before", drop_file_pages() / 2**20)
    log_memory(target, engine)
    return engine, target, target_dir


def engine_limits(config: VerifierWorkerConfig, target, drafter: PeerInfo | None, drafter_client,
                  compile: bool) -> tuple[int, int | None]:
    """``(max_running, max_context)`` of the engine: the config's on CPU (context None = the
    target's); on CUDA, after both models loaded, the memory plan's (derived or checked, logged:
    :func:`services.memory_plan.plan_verifier_memory`; CUDA graphs with ``compile``).

    Raises:
        ValueError: the limits do not fit the device (one line naming the flag).
    """
    if not config.device.startswith("cuda"):
        return config.max_running, config.max_context or None
    from services.memory_plan import plan_verifier_memory

    mem = plan_verifier_memory(config, target, drafter, graphed=compile,
                               transport=getattr(drafter_client, "transport", None))
    return mem.max_running, mem.max_context


def compiled_cold(engine) -> int:
    """How many graphs this process's compiled steps compiled rather than loaded from inductor's disk
    cache (torch's ``fxgraph_cache_miss`` counter; 0 for eager steps and for a warm cache)."""
    if not engine.runner.compiled:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_miss"])


def drafter_tag(drafter: PeerInfo) -> str:
    """The drafter as its handshake describes it (description, block, tapped layers, methods): the
    key of its saved acceptance calibration."""
    layers = ",".join(str(i) for i in drafter.target_layer_ids)
    name = (drafter.model or "drafter").rstrip("/").rsplit("/", 1)[-1]  # a directory: its name, not the machine's path
    return f"{name}|K{drafter.block_size}|L{layers}|{','.join(drafter.methods)}"


def default_knobs(config: VerifierWorkerConfig):
    """The verifier's default :class:`~services.spec.TreeKnobs`: the config's, each unset one from
    :func:`services.spec.default_tree_knobs` of its device."""
    from services.spec import TreeKnobs, default_tree_knobs

    knobs = TreeKnobs(config.budget, config.width, config.depth_bonus, config.candidates)
    return knobs.filled_from(default_tree_knobs(config.device))


def log_memory(target, engine) -> None:
    """One line: the verifier's resident memory by part (weights, GEMM packs, KV cache, prefix cache)."""
    from services.cpu_gemm import packed_bytes
    from services.startup import kv_committed_bytes, mb, memory_line, module_bytes, prefix_cache_part

    cache = engine.runner.cache
    log.info("%s", memory_line("verifier", {
        "weights": module_bytes(target.model), "GEMM packs": packed_bytes(target.model),
        "KV cache": f"{mb(kv_committed_bytes(cache))} written of {mb(cache.nbytes())} reserved in "
                    f"{str(cache.dtype).removeprefix('torch.')}",
        "prefix cache": prefix_cache_part(cache.prefix)}))


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
    from services.models.registry import resolve_target
    from services.runtime import on_stop_signals, prepare_process, start_metrics_server
    from services.wire import ServerIO, ipc_endpoint, new_epoch

    prepare_process("dartree-verifier", config.log_level, parent_pid)
    config = dataclasses.replace(config, device=bind_device(config.device))  # "cuda" -> "cuda:N", set_device
    epoch, ctx, stop = new_epoch(), zmq.Context(), threading.Event()
    from services.startup import phase

    inproc = drafter is not None
    if inproc:
        drafter_client, drafter, _ = drafter(epoch)
    elif config.drafter_endpoint == "none":
        drafter_client, drafter = None, None
    else:
        with phase("verifier", "drafter connected"):
            drafter_client, drafter = _connect_drafter(config, resolve_target(config.target), ctx, epoch)
    engine, target, target_dir = build_engine(config, drafter_client, drafter)
    if config.max_running is None:  # planned from the device's memory (services/memory_plan.py)
        config = dataclasses.replace(config, max_running=engine.config.max_running)
    restart = config.restart_after_compile if config.restart_after_compile is not None else parent_pid is not None
    if restart and (missed := compiled_cold(engine)):
        log.info("the compiled steps were built from a cold cache (%d graphs compiled and saved to disk): "
                 "exiting for the supervisor to start the verifier again without the compiler's in-memory state",
                 missed)
        raise SystemExit(RESTART_AFTER_COMPILE_EXIT)
    methods = (Method.AR.value,) + tuple(m for m in (drafter.methods if drafter else ()) if m != Method.AR)
    if config.default_method not in methods:
        raise SystemExit(f"default method {config.default_method!r} is not served (available: {', '.join(methods)})")
    info = verifier_info(target_dir, engine, target, epoch, config, methods, drafter)
    metrics = VerifierMetrics(model=info.model, default_method=config.default_method, spec_policy=config.spec_policy,
                              tree_schedule=str(parse_tree_schedule(config.tree_schedule) or ""))
    start_metrics_server(config.verifier_metrics_port, config.metrics_host, metrics.registry)
    # the idle ping also re-handshakes a restarted drafter; a drafter in this process always answers
    ping = (lambda: True) if inproc else (lambda: drafter_client.ping(1.0)) if drafter_client else None
    worker = VerifierWorker(engine, info, config, metrics, drafter_ping=ping)
    heartbeat = None
    if drafter_client is not None and not inproc:  # drafter liveness off the compute thread (readiness never waits on a round)
        from services.verifier.remote_drafter import DrafterHeartbeat

        def on_heartbeat(ok: bool, detail: str) -> None:
            drafter_client.set_available(ok)  # a draft being waited for gives up at once
            worker.on_drafter_heartbeat(ok, detail)

        heartbeat = DrafterHeartbeat(drafter_client.endpoint, ctx, config.health_interval_s, DRAFTER_PING_TIMEOUT_S,
                                     on_heartbeat).start()
    on_stop_signals(worker.begin_drain, stop.set, supervised=parent_pid is not None)
    endpoint = config.verifier_endpoint or ipc_endpoint("verifier")
    io = ServerIO(ctx, endpoint, "verifier", on_message=worker.on_io_message,
                  on_error=lambda reason: metrics.ipc_errors.labels("gateway").inc(),
                  refuse=lambda reason: HelloAck(PROTOCOL_VERSION, False, info, reason), inbox=worker.inbox)
    worker.send = io.send
    io.start()
    log.info("verifier ready on %s (model %s, context %d, methods %s)", endpoint, info.model, info.max_context,
             ", ".join(methods))
    try:
        worker.event_loop(stop)
    finally:
        if hasattr(engine.policy, "flush"):
            engine.policy.flush()  # what this start learnt is the next one's starting calibration
        io.close()
        if heartbeat is not None:
            heartbeat.close()
        if drafter_client is not None and not inproc:
            drafter_client.close()
        ctx.destroy(linger=0)
        log.info("verifier stopped")
