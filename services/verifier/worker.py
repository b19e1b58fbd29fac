"""The verifier process: request table, FIFO admission, one planned ``SpecEngine.step`` per loop.

Loop (docs/design.md, "Worker processes"), on the compute thread: recv (drain the inbox filled by
the gateway I/O thread) ->
schedule (admit FIFO while fewer than ``max_running`` run; every running request, in an order
that rotates each step) -> plan (``scheduler.make_plan``: the engine's candidates, each decode
round's tree knobs from the engine's policy, the row budget) -> run it (``engine.step(plan)``) ->
send each request's
:class:`RoundChunk`. Aborts take effect at the next step boundary and free the engine's KV cache
and the drafter context. Hello and Ping are answered on the I/O thread (readiness never waits
behind a step). The process entry (engine build, drafter link, serving) is
:mod:`services.verifier.process`, which imports torch in :func:`~services.verifier.process.run_verifier_process` only.
"""

from __future__ import annotations

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
from services.metrics import VerifierMetrics
from services.protocol import (
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
from services.runtime import trim_heap
from services.spec import Method, parse_tree_schedule
from services.verifier.config import VerifierWorkerConfig
from services.verifier.remote_drafter import DrafterError, DrafterUnavailable
from services.verifier.scheduler import OverlapGroups, StepPlan, make_plan
from services.wire import Decoded

log = logging.getLogger("verifier")
_PARAM_RE = re.compile(r"(speculative\.\w+|max_tokens|temperature|top_p|top_k|prompt|stop_token_ids|logprobs)")


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
        step_swap: the compiled step being built off the critical path
            (:class:`services.verifier.compile_swap.StepSwap`), swapped in by :meth:`run_once` when no
            request runs; None: the engine's step stays as built.

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
                 release_idle_s: float = 1.0, step_swap=None):
        self.engine, self.info, self.config = engine, info, config
        self.step_swap = step_swap
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
        if self.step_swap is not None and self.step_swap.detail:
            detail = f"{detail}; {self.step_swap.detail}" if detail else self.step_swap.detail
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
        self._swap_step()
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
        if len(self._running) + len(self._waiting) >= self.config.engine.max_running + self.config.max_waiting:
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

    def _swap_step(self) -> None:
        """Swap the compiled step in when it is ready and no request runs (``step_swap``)."""
        if self.step_swap is not None and self.step_swap.tick(self.engine, len(self._running)):
            self.metrics.compiled_step.set(1)

    def _admit(self) -> None:
        if self.step_swap is not None and self.step_swap.holds_admissions(len(self._running)):
            return  # the compiled step is ready: the running requests finish first (bounded)
        while self._waiting and len(self._running) < self.config.engine.max_running:
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
        if not self.config.engine.overlap:
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
        m.round_walks.labels(walk="device").inc(st.device_rounds)
        m.round_walks.labels(walk="host").inc(st.decoding - st.device_rounds)
        m.round_reads.inc(st.round_reads)
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
        self.metrics.kv_slots.labels("used").set(self.config.engine.max_running - nfree)
        prefix = getattr(self.engine, "prefix_cache_stats", None)
        if prefix is not None:
            self.metrics.observe_prefix_cache(*prefix())
            pc = self.engine.runner.cache.prefix
            self.metrics.prefix_bytes.set(pc.nbytes())
            self.metrics.observe_prefix_ram(pc.ram.stats.saved, pc.ram.stats.hit_tokens, pc.ram.stats.evictions,
                                            pc.ram.nbytes())
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
