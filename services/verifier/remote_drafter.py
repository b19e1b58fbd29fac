"""``ZmqDrafterClient``: the engine's :class:`DrafterClient` over ZMQ to a drafter process.

Called on the verifier's compute thread, which needs each reply before it can verify, so the
DEALER socket lives on that thread (a hop through an I/O thread would add latency to every round
and overlap nothing). Every wait has a deadline and also watches the socket monitor: a drafter
that dies, restarts (new epoch) or hangs raises :class:`DrafterUnavailable` quickly instead of
blocking the loop. The engine then decodes those rounds plainly and resends the lost contexts once the drafter is back
(``SpecEngine.set_drafter_up``); a new process is re-handshaken.
Torch is imported lazily (the module is importable by torch-free tooling).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import zmq

from services.ipc_pool import FrameTransport, TensorTransport
from services.protocol import (
    PROTOCOL_VERSION,
    DraftBatch,
    DraftReply,
    DraftRequest,
    Hello,
    HelloAck,
    MessageType,
    PeerInfo,
    Ping,
    Pong,
    ProtocolError,
    Release,
    check_compatible,
    check_hello_version,
)
from services.wire import decode, drain_monitor, encode, make_socket, version_mismatch

log = logging.getLogger(__name__)


class DrafterUnavailable(RuntimeError):
    """The drafter did not answer in time, disconnected, or restarted (its contexts are gone)."""


class DrafterDisconnected(DrafterUnavailable):
    """The connection to the drafter process we handshook with was lost (it exited or restarted)."""


class DrafterRefused(RuntimeError):
    """The drafter refused the handshake (mismatched pair): the verifier must not serve."""


class DrafterError(RuntimeError):
    """The drafter answered a draft request with an error."""


class ZmqDrafterClient:
    """Request/reply to a drafter's ROUTER, with handshake, deadlines and restart detection.

    Args:
        endpoint: the drafter's endpoint (``ipc://`` or ``tcp://``).
        local: this verifier's handshake info (``pool`` is filled from ``transport``).
        transport: how tensors travel (frames on CPU, CUDA-IPC pools on one GPU).
        timeout_s: deadline of one draft round trip.
    """

    def __init__(self, endpoint: str, local: PeerInfo, transport: TensorTransport | None = None,
                 timeout_s: float = 30.0, ctx: zmq.Context | None = None):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self.transport = transport or FrameTransport()
        self.local = local
        self.peer: PeerInfo | None = None
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER, endpoint, bind=False)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._round = itertools.count(1)
        self._req_epoch: dict[str, str] = {}
        self._pending: set[int] = set()      # round ids submitted and not yet collected
        self._stash: dict[int, object] = {}  # replies of pending rounds that arrived early
        self._gone = threading.Event()       # the heartbeat's verdict: the drafter is not answering

    # ----------------------------------------------------------------------------- handshake

    def connect(self, wait_s: float = 60.0, hello_timeout_s: float = 2.0) -> PeerInfo:
        """Handshake, retrying until ``wait_s`` (the drafter may still be loading).

        Raises:
            DrafterRefused: version or compatibility mismatch.
            DrafterUnavailable: no answer within ``wait_s``.
        """
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return self._handshake(min(hello_timeout_s, max(0.05, deadline - time.monotonic())))
            except DrafterUnavailable:
                if time.monotonic() >= deadline:
                    raise
                log.info("waiting for the drafter at %s ...", self.endpoint)

    def _handshake(self, timeout_s: float) -> PeerInfo:
        drain_monitor(self._monitor)  # a disconnect before this handshake was of an earlier drafter process
        local = PeerInfo(**{**_fields(self.local), "pool": self.transport.export()})
        self._sock.send_multipart(encode(Hello(PROTOCOL_VERSION, local)))
        ack: HelloAck = self._wait(lambda d: d.type == MessageType.HELLO_ACK, timeout_s, "handshake").msg
        reason = check_hello_version(ack.protocol_version)
        reason = reason or (None if ack.ok else ack.reason)
        reason = reason or check_compatible(self.local, ack.info)
        if reason:
            raise DrafterRefused(f"drafter at {self.endpoint} refused: {reason}")
        if self.peer is not None and self.peer.epoch != ack.info.epoch:
            log.warning("drafter restarted (epoch %s -> %s): in-flight requests lose their context",
                        self.peer.epoch, ack.info.epoch)
        self.transport.attach(ack.info.pool)
        self.peer = ack.info
        return ack.info

    # ---------------------------------------------------------------------------- DrafterClient

    def submit(self, jobs) -> list[tuple[int, str, float]]:
        """Send the drafts of ``jobs`` (:class:`services.verifier.drafter_client.DraftJob`) in one
        :class:`DraftBatch` message (one drafter forward); :meth:`collect` each reply later (the
        drafter computes meanwhile).

        Returns:
            one handle ``(round id, request id, send time)`` per job.
        Raises:
            DrafterUnavailable: the drafter restarted since one of these requests' first draft.
        """
        t0 = time.perf_counter()
        if self.peer is None:
            self._handshake(min(self.timeout_s, 2.0))
        msgs, handles = [], []
        for j in jobs:
            if self._req_epoch.setdefault(j.request_id, self.peer.epoch) != self.peer.epoch:
                raise DrafterUnavailable("the drafter restarted; this request's drafter context is lost")
        metas, frames = self.transport.pack([j.features for j in jobs])
        for j, meta in zip(jobs, metas):
            round_id = next(self._round)
            msgs.append(DraftRequest(j.request_id, round_id, list(j.committed_ids), meta, int(j.root_token),
                                     int(j.start), str(j.method), j.spec, max_depth=j.max_depth))
            handles.append((round_id, j.request_id, t0))
        self._sock.send_multipart(encode(DraftBatch(msgs), frames), copy=False)
        self._pending.update(h[0] for h in handles)
        return handles

    def collect(self, handle: tuple[int, str, float]):
        """The ``(DraftTree, timings incl. "ipc")`` of a submitted draft; the deadline counts from
        its submission.

        Raises:
            DrafterUnavailable: no reply by the deadline, disconnect, or the drafter restarted.
            DrafterError: the drafter reported an error for this request.
        """
        round_id, request_id, t0 = handle
        try:
            dec = self._stash.pop(round_id, None)
            if dec is None:
                left = self.timeout_s - (time.perf_counter() - t0)
                dec = self._wait(lambda d: d.type == MessageType.DRAFT_REPLY and d.msg.round_id == round_id,
                                 left, f"draft for {request_id}", nominal_s=self.timeout_s)
        finally:
            self._pending.discard(round_id)
        reply: DraftReply = dec.msg
        if self.peer is None or reply.epoch != self.peer.epoch:
            self.peer = None
            raise DrafterUnavailable("the drafter restarted; this request's drafter context is lost")
        if reply.error:
            raise DrafterError(f"drafter: {reply.error}")
        tree = self._tree(reply, dec.frames)
        timings = dict(reply.timings)
        timings["ipc"] = max(0.0, time.perf_counter() - t0 - sum(timings.values()))
        return tree, timings

    def discard(self, handle: tuple[int, str, float]) -> None:
        """Forget a submitted draft: its reply is dropped when it arrives."""
        self._pending.discard(handle[0])
        self._stash.pop(handle[0], None)

    def info(self) -> dict:
        """The drafter's handshake fields (``{}`` before the first handshake)."""
        return _fields(self.peer) if self.peer is not None else {}

    def release(self, request_id: str) -> None:
        """Forget a request's drafter context (fire and forget; idempotent)."""
        self._req_epoch.pop(request_id, None)
        try:
            self._sock.send_multipart(encode(Release(request_id)), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("release of %s not sent (drafter queue full)", request_id)

    def ping(self, timeout_s: float = 1.0) -> bool:
        """Is the drafter answering (and the same process we handshook with)? A lost connection to
        the process we knew (it restarted since the last call) is retried once with a fresh
        handshake, so a drafter that is already back reads as reachable."""
        for retry in (False, True):
            try:
                if self.peer is None:
                    self._handshake(timeout_s)
                nonce = next(self._round)
                self._sock.send_multipart(encode(Ping(nonce)))
                pong: Pong = self._wait(lambda d: d.type == MessageType.PONG and d.msg.nonce == nonce,
                                        timeout_s, "ping").msg
                break
            except DrafterDisconnected as exc:
                if not retry:
                    continue
                log.warning("drafter ping failed: %s", exc)
                return False
            except (DrafterUnavailable, DrafterRefused) as exc:
                log.warning("drafter ping failed: %s", exc)
                return False
        if pong.epoch != self.peer.epoch:
            self.peer = None  # restarted: the next call re-handshakes
            return False
        return pong.ready

    def set_available(self, ok: bool) -> None:
        """The drafter heartbeat's verdict (any thread). While ``ok`` is False a draft being waited
        for gives up within 0.1 s (``DrafterUnavailable``) instead of waiting for its deadline: a
        hung drafter then costs the running requests one heartbeat verdict, not the whole draft
        deadline, and they go on decoding plainly."""
        if ok:
            self._gone.clear()
        else:
            self._gone.set()

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        if self._own_ctx:
            self._ctx.term()

    # ------------------------------------------------------------------------------- internals

    def _wait(self, match, timeout_s: float, what: str, nominal_s: float | None = None):
        """The first received message satisfying ``match`` within ``timeout_s`` (``nominal_s``: the
        deadline named in the error); replies of other submitted drafts are kept for their
        :meth:`collect`, anything else (stale replies) is dropped."""
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        drafting = what.startswith("draft")  # a draft wait also ends at the heartbeat's verdict
        while True:
            left = deadline - time.monotonic()
            gone = drafting and self._gone.is_set()
            if left <= 0 or gone:
                self.peer = None
                self._pending.clear()
                self._stash.clear()
                if gone:
                    raise DrafterUnavailable(f"the drafter stopped answering its heartbeat ({what})")
                raise DrafterUnavailable(f"no answer from the drafter within {nominal_s or timeout_s:g} s ({what})")
            events = dict(poller.poll(int(min(left, 0.1 if drafting else left) * 1000) + 1))
            if self._monitor in events and zmq.EVENT_DISCONNECTED in drain_monitor(self._monitor):
                self.peer = None
                raise DrafterDisconnected(f"lost the connection to the drafter ({what})")
            if self._sock in events:
                parts = self._sock.recv_multipart(copy=False)
                try:
                    dec = decode(parts)
                except ProtocolError as exc:
                    log.warning("dropped a malformed message from the drafter: %s", exc)
                    reason = version_mismatch(parts)
                    if reason:
                        raise DrafterRefused(f"drafter at {self.endpoint} refused: {reason}") from None
                    continue
                if match(dec):
                    return dec
                if dec.type == MessageType.DRAFT_REPLY and dec.msg.round_id in self._pending:
                    self._stash[dec.msg.round_id] = dec  # another submitted draft: keep it for its collect

    def _tree(self, reply: DraftReply, frames):
        from services.tree import DraftTree

        if len(reply.tree) != 4:
            raise DrafterError(f"draft reply carries {len(reply.tree)} tensors, expected 4")
        tokens, parents, depths, scores = self.transport.unpack(reply.tree, frames, copy=True)
        return DraftTree(tokens.long(), parents.long(), depths.long(), scores.float())


def _fields(info: PeerInfo) -> dict:
    return {f: getattr(info, f) for f in info.__struct_fields__}


class DrafterHeartbeat:
    """The drafter's liveness, independent of the compute thread: a thread with its own DEALER pings
    the drafter every ``interval_s`` and calls ``on_result(ok, detail)`` with its verdict.

    The compute thread's draft calls can wait up to the draft deadline on a hung drafter; this
    heartbeat does not wait behind them, so readiness follows a hung (or draining) drafter within
    ``interval_s + misses * timeout_s`` seconds whether or not requests are running. The verdict is
    False when ``misses`` pings in a row got no Pong within ``timeout_s`` (one late Pong of a busy
    drafter does not flap readiness) or at once when the drafter answers that it is not ready
    (draining); True at the first ready Pong.

    Args:
        endpoint: the drafter's endpoint; ctx: a ZMQ context (thread-safe; the socket stays on the thread).
        interval_s: seconds between pings; timeout_s: how long one ping waits for its Pong.
        on_result: called on the heartbeat thread with ``(ok, detail)`` ("" when ok).
    """

    def __init__(self, endpoint: str, ctx: zmq.Context, interval_s: float, timeout_s: float,
                 on_result, misses: int = 2) -> None:
        self.endpoint, self.ctx, self.interval_s, self.timeout_s = endpoint, ctx, interval_s, timeout_s
        self.misses = misses
        self.on_result = on_result
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drafter-heartbeat", daemon=True)

    def start(self) -> "DrafterHeartbeat":
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread (its socket is closed by it)."""
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 1.0)

    def _run(self) -> None:
        sock = make_socket(self.ctx, zmq.DEALER, self.endpoint, bind=False)
        nonce, missed = itertools.count(1), 0
        try:
            while not self._stop.is_set():
                t0 = time.monotonic()
                answered, ok, detail = self._ping(sock, next(nonce))
                missed = 0 if answered else missed + 1
                if answered or missed >= self.misses:
                    self.on_result(ok, detail)
                self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))
        finally:
            sock.close(0)

    def _ping(self, sock, nonce: int) -> tuple[bool, bool, str]:
        """``(answered, ready, detail)`` of one ping."""
        try:
            sock.send_multipart(encode(Ping(nonce)), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False, False, "the drafter is not reachable"
        deadline = time.monotonic() + self.timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                break
            try:
                dec = decode(sock.recv_multipart(copy=False))
            except ProtocolError:
                continue
            if dec.type == MessageType.PONG and dec.msg.nonce == nonce:
                pong: Pong = dec.msg
                return True, pong.ready, "" if pong.ready else (pong.detail or "the drafter is not ready")
        return False, False, f"the drafter did not answer {self.misses} pings within {self.timeout_s:g} s each"
