"""The gateway's link to the verifier: requests out, rounds in, one asyncio.Queue per request.

:class:`ZmqEngineClient` talks to the verifier process over a ``zmq.asyncio`` DEALER; it
handshakes (refusing a mismatched verifier), pings for readiness, fails every in-flight request
fast when the verifier disconnects, restarts (new epoch) or stops answering, and sends an
:class:`~services.protocol.Abort` when a consumer stops early (client disconnect, deadline, stop
string). :class:`InprocEngineClient` is the same interface over an in-process verifier worker
(tests, debugging; docs/design.md "Two transports"). Torch-free.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from services.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Generate,
    Hello,
    HelloAck,
    MessageType,
    PeerInfo,
    Ping,
    Pong,
    ProtocolError,
    RequestError,
    RoundChunk,
    check_compatible,
    check_hello_version,
)
from services.wire import decode, encode, make_socket, version_mismatch

log = logging.getLogger(__name__)


# how long rounds of an aborted request are still counted as discarded (the verifier drops the
# request at its next step, so its late rounds arrive within a few steps)
DISCARD_WINDOW_S = 60.0


class EngineError(Exception):
    """The engine refused or failed a request; carries the HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 local: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.local = local  # raised by the gateway's side of the link (the verifier may still hold the request)


class EngineClient(ABC):
    """What the gateway needs from the engine."""

    info: PeerInfo | None = None   # the verifier's handshake info (model, context, methods, limits)
    # the reason sent when a request's reader stops early: a client that went away, unless the gateway
    # cut its in-flight requests at the drain timeout ("shutdown", :meth:`Gateway.cut_in_flight`)
    early_close_reason: str = "client"
    # called with (abort reason, token count) for the tokens of rounds that arrive after a request was
    # aborted (no client receives them); the gateway counts them in dartree_discarded_tokens_total
    on_discarded: Callable[[str, int], None] | None = None

    @property
    @abstractmethod
    def ready(self) -> bool:
        """Handshake done, verifier answering, model loaded, not draining (a down drafter only slows decoding)."""

    @property
    def detail(self) -> str:
        """Why not ready; while ready, the verifier's notice ("" when none), e.g. that it decodes
        without speculation while the drafter is down."""
        return ""

    async def start(self) -> None:
        """Connect (called once inside the running event loop)."""

    async def close(self) -> None:
        """Disconnect."""

    @abstractmethod
    def generate(self, gen: Generate, deadline: float | None = None) -> AsyncIterator[RoundChunk]:
        """Rounds of ``gen`` until one has a ``finish_reason``; raises :class:`EngineError`.

        Closing the iterator early aborts the request in the engine (reason :attr:`early_close_reason`);
        past ``deadline`` (monotonic seconds) the request is aborted and a 504 :class:`EngineError` raised.
        """

    @abstractmethod
    def abort(self, request_id: str, reason: str = "client") -> None:
        """Abort a request (idempotent, never blocks)."""


class _QueueClient(EngineClient):
    """Request table shared by both transports: one queue per request id."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue] = {}
        self._aborted: set[str] = set()
        self._discarding: dict[str, tuple[str, float]] = {}  # aborted rid -> (reason, monotonic time)

    @abstractmethod
    def _send(self, msg) -> None: ...

    def _deliver(self, msg) -> None:
        if isinstance(msg, RoundChunk):
            q = self._queues.get(msg.request_id)
            if q is not None:
                q.put_nowait(msg)
            else:
                self._discard(msg)
        elif isinstance(msg, RequestError):
            q = self._queues.get(msg.request_id)
            if q is not None:
                q.put_nowait(EngineError(msg.status, msg.message, msg.param, msg.code))

    def _fail_all(self, status: int, message: str, code: str) -> None:
        for q in self._queues.values():
            q.put_nowait(EngineError(status, message, None, code, local=True))

    async def generate(self, gen: Generate, deadline: float | None = None) -> AsyncIterator[RoundChunk]:
        if not self.ready:
            raise EngineError(503, f"the engine is not ready: {self.detail}", None, "engine_unavailable")
        rid = gen.request_id
        if rid in self._queues:
            raise EngineError(400, f"request id {rid!r} is already in flight", None, "duplicate_request_id")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        done, reason = False, None
        try:
            self._send(gen)
            while True:
                try:
                    item = await (q.get() if deadline is None
                                  else asyncio.wait_for(q.get(), max(0.0, deadline - time.monotonic())))
                except TimeoutError:
                    done = True
                    self.abort(rid, "deadline")
                    raise EngineError(504, "the request ran past its deadline", None, "timeout") from None
                if isinstance(item, EngineError):
                    # a verifier's RequestError: it already dropped the request. A link failure (hung or
                    # lost verifier): it may resume and decode for nobody, so it gets an abort too.
                    done, reason = not item.local, "error"
                    raise item
                if item.finish_reason is not None:
                    done = True
                yield item
                if done:
                    return
        finally:
            self._queues.pop(rid, None)
            if not done:
                self.abort(rid, reason or self.early_close_reason)
            while not q.empty():  # rounds that arrived after the reader stopped
                item = q.get_nowait()
                if isinstance(item, RoundChunk):
                    self._discard(item)
            self._aborted.discard(rid)

    def abort(self, request_id: str, reason: str = "client") -> None:
        if request_id in self._aborted:
            return
        self._aborted.add(request_id)
        now = time.monotonic()
        for rid in [r for r, (_, t) in self._discarding.items() if now - t > DISCARD_WINDOW_S]:
            del self._discarding[rid]
        self._discarding[request_id] = (reason, now)
        self._send(Abort(request_id, reason))

    def _discard(self, chunk: RoundChunk) -> None:
        """Count the tokens of a round of an aborted request, which no reader takes."""
        entry = self._discarding.get(chunk.request_id)
        if entry is None:
            return
        if chunk.finish_reason is not None:
            del self._discarding[chunk.request_id]
        if chunk.token_ids and self.on_discarded is not None:
            self.on_discarded(entry[0], len(chunk.token_ids))


class ZmqEngineClient(_QueueClient):
    """DEALER to the verifier's ROUTER, driven by three tasks: reader, pinger, connection monitor."""

    def __init__(self, endpoint: str, local: PeerInfo, ping_interval_s: float = 1.0, ping_timeout_s: float = 3.0):
        super().__init__()
        self.endpoint, self.local = endpoint, local
        self.ping_interval_s, self.ping_timeout_s = ping_interval_s, ping_timeout_s
        self._epoch = ""
        self._handshaken = False
        self._last_pong = 0.0
        self._pong: Pong | None = None
        self._detail = "connecting to the verifier"
        self._nonce = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._sock = None
        self._monitor = None

    @property
    def ready(self) -> bool:
        return (self._handshaken and self._pong is not None and self._pong.ready and not self._pong.draining
                and time.monotonic() - self._last_pong <= self.ping_timeout_s)

    @property
    def detail(self) -> str:
        if self.ready:
            return self._pong.detail
        if self._handshaken and self._pong is not None:
            if self._pong.draining:
                return "the verifier is draining"
            if not self._pong.ready:
                return self._pong.detail or "the verifier is not ready"
        return self._detail

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER, self.endpoint, bind=False)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._tasks = [asyncio.create_task(c) for c in (self._read(), self._ping(), self._watch())]
        self._send(Hello(PROTOCOL_VERSION, self.local))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all(503, "the gateway is shutting down", "shutdown")
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(0)
            self._ctx.term()

    def _send(self, msg) -> None:
        if self._sock is None or self._sock.closed:
            return  # closed (gateway shutdown): nothing to tell the verifier any more
        fut = self._sock.send_multipart(encode(msg))
        if not fut.done():
            fut.add_done_callback(lambda f: f.exception())  # keep errors from being "never retrieved"

    def _lost(self, reason: str) -> None:
        if self._handshaken:
            log.warning("verifier link lost: %s; failing %d in-flight requests", reason, len(self._queues))
        self._handshaken = False
        self._detail = reason
        self._fail_all(503, reason, "engine_unavailable")

    async def _read(self) -> None:
        while True:
            parts = await self._sock.recv_multipart(copy=False)
            try:
                dec = decode(parts)
            except ProtocolError as exc:
                log.warning("dropped a malformed message from the verifier: %s", exc)
                reason = version_mismatch(parts)
                if reason:
                    self._detail, self._handshaken = reason, False
                continue
            if dec.type == MessageType.HELLO_ACK:
                self._on_hello_ack(dec.msg)
            elif dec.type == MessageType.PONG:
                self._on_pong(dec.msg)
            else:
                self._deliver(dec.msg)

    def _on_hello_ack(self, ack: HelloAck) -> None:
        if self._handshaken and ack.ok and ack.info.epoch == self._epoch:
            return  # an answer to a Hello that was queued while the verifier was starting
        reason = check_hello_version(ack.protocol_version)
        reason = reason or (None if ack.ok else f"the verifier refused this gateway: {ack.reason}")
        reason = reason or check_compatible(self.local, ack.info)
        if reason:
            log.error("verifier handshake refused: %s", reason)
            self._detail, self._handshaken = reason, False
            return
        if self._epoch and ack.info.epoch != self._epoch:
            self._fail_all(503, "the verifier restarted", "engine_restarted")
        self.info, self._epoch, self._handshaken = ack.info, ack.info.epoch, True
        self._last_pong = time.monotonic()
        log.info("connected to verifier %s (model %s, context %d)", self.endpoint, ack.info.model,
                 ack.info.max_context)
        self._send(Ping(next(self._nonce)))

    def _on_pong(self, pong: Pong) -> None:
        if pong.epoch != self._epoch:
            self._lost("the verifier restarted")
            self._send(Hello(PROTOCOL_VERSION, self.local))
            return
        self._pong, self._last_pong = pong, time.monotonic()

    async def _ping(self) -> None:
        while True:
            slept = time.monotonic()
            await asyncio.sleep(self.ping_interval_s)
            # Woken this late, this process's own loop was blocked: pongs may be waiting unread in the
            # socket, so the silence says nothing about the verifier; judge at the next ping.
            stalled = time.monotonic() - slept - self.ping_interval_s > self.ping_timeout_s / 2
            if not self._handshaken:
                self._send(Hello(PROTOCOL_VERSION, self.local))
                continue
            if stalled:
                log.warning("the gateway's event loop was blocked for %.1f s", time.monotonic() - slept)
            elif time.monotonic() - self._last_pong > self.ping_timeout_s:
                self._lost(f"the verifier did not answer for {self.ping_timeout_s:g} s")
                continue
            self._send(Ping(next(self._nonce)))

    async def _watch(self) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._lost("lost the connection to the verifier")
            elif event == zmq.EVENT_CONNECTED and not self._handshaken:
                self._send(Hello(PROTOCOL_VERSION, self.local))


class InprocEngineClient(_QueueClient):
    """The same interface over an in-process worker (a verifier worker running on its own thread).

    Args:
        post: hands a message to the worker (thread-safe).
        hello: answers a :class:`Hello` synchronously.
        status: returns a :class:`Pong` snapshot.
    The worker's replies must be passed to :meth:`deliver_threadsafe`.
    """

    def __init__(self, post: Callable[[object], None], hello: Callable[[Hello], HelloAck],
                 status: Callable[[], Pong], local: PeerInfo):
        super().__init__()
        self._post, self._hello, self._status, self.local = post, hello, status, local
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        ack = self._hello(Hello(PROTOCOL_VERSION, self.local))
        reason = None if ack.ok else ack.reason
        reason = reason or check_compatible(self.local, ack.info)
        if reason:
            raise RuntimeError(f"in-process engine refused: {reason}")
        self.info = ack.info

    @property
    def ready(self) -> bool:
        pong = self._status()
        return self.info is not None and pong.ready and not pong.draining

    @property
    def detail(self) -> str:
        return self._status().detail if self.ready else (self._status().detail or "draining")

    def _send(self, msg) -> None:
        self._post(msg)

    def deliver_threadsafe(self, msg) -> None:
        """Called from the worker's thread with a RoundChunk or RequestError."""
        self._loop.call_soon_threadsafe(self._deliver, msg)
