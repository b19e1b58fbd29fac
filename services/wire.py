"""How protocol messages travel: msgpack framing with zero-copy tensor side frames, ZMQ sockets,
private ``ipc://`` runtime directories, and the I/O thread that keeps sockets off the compute thread.

Torch-free at import: tensors (torch or numpy) are converted lazily inside the tensor helpers.
A message is ``[type byte, msgpack body, *tensor frames]``; :func:`decode` validates the type tag,
body size, schema, and that every side frame has exactly the bytes its :class:`TensorMeta` says.
"""

from __future__ import annotations

import logging
import os
import queue
import stat
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from services.protocol import (
    DTYPE_SIZES,
    MAX_BODY_BYTES,
    MAX_TENSOR_FRAMES,
    MESSAGE_CLASSES,
    MESSAGE_TYPES,
    DraftBatch,
    MessageType,
    ProtocolError,
    TensorMeta,
    check_hello_version,
    peek_protocol_version,
)

log = logging.getLogger(__name__)

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {t: msgspec.msgpack.Decoder(cls) for t, cls in MESSAGE_CLASSES.items()}
DEFAULT_MAX_TENSOR_BYTES = 1 << 30
SOCKET_HWM = 100_000
IPC_PATH_MAX = 107  # sun_path limit on Linux, minus the terminating NUL


# ------------------------------------------------------------------------------------------ framing

@dataclass
class Decoded:
    """A validated message: its type, the struct, and its tensor side frames (buffers)."""

    type: MessageType
    msg: Any
    frames: list


def encode(msg: msgspec.Struct, frames: Sequence = ()) -> list:
    """``[type byte, body, *frames]`` for ``msg``; ``frames`` are buffers (sent zero-copy)."""
    tag = MESSAGE_TYPES[type(msg)]
    return [bytes((tag,)), _ENCODER.encode(msg), *frames]


def _buf(part) -> memoryview | bytes:
    return part.buffer if isinstance(part, zmq.Frame) else part


def decode(parts: Sequence, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> Decoded:
    """Validate and decode ``[type, body, *frames]`` (zmq Frames or bytes).

    Raises:
        ProtocolError: unknown type, oversize body, schema violation, or frames that do not match
        their metadata.
    """
    if len(parts) < 2:
        raise ProtocolError(f"message has {len(parts)} frames, expected at least 2")
    tag = bytes(_buf(parts[0]))
    if len(tag) != 1 or tag[0] not in MessageType._value2member_map_:
        raise ProtocolError(f"unknown message type tag {tag[:8]!r}")
    mtype = MessageType(tag[0])
    body = _buf(parts[1])
    if len(body) > MAX_BODY_BYTES[mtype]:
        raise ProtocolError(f"{mtype.name} body of {len(body)} bytes is over the {MAX_BODY_BYTES[mtype]} limit")
    frames = [_buf(p) for p in parts[2:]]
    if len(frames) > MAX_TENSOR_FRAMES[mtype]:
        raise ProtocolError(f"{mtype.name} carries {len(frames)} side frames, at most {MAX_TENSOR_FRAMES[mtype]}")
    try:
        msg = _DECODERS[mtype].decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {mtype.name}: {exc}") from None
    _check_frames(mtype, _tensor_metas(msg), frames, max_tensor_bytes)
    return Decoded(mtype, msg, frames)


def version_mismatch(parts: Sequence) -> str | None:
    """For an undecodable HELLO/HELLO_ACK: the protocol-version reason, if that is the cause."""
    if len(parts) < 2 or bytes(_buf(parts[0])) not in (bytes((MessageType.HELLO,)), bytes((MessageType.HELLO_ACK,))):
        return None
    version = peek_protocol_version(bytes(_buf(parts[1])))
    return None if version is None else check_hello_version(version)


def _tensor_metas(msg) -> list[TensorMeta]:
    if isinstance(msg, DraftBatch):  # job i's features in frame i
        return [j.features for j in msg.jobs]
    return list(getattr(msg, "tree", ()))


def _check_frames(mtype: MessageType, metas: list[TensorMeta], frames: list, max_bytes: int) -> None:
    framed = [m for m in metas if m.slot < 0]
    if len(framed) != len(frames):
        raise ProtocolError(f"{mtype.name} describes {len(framed)} framed tensors but carries {len(frames)} frames")
    for meta in metas:
        if meta.dtype not in DTYPE_SIZES:
            raise ProtocolError(f"{mtype.name}: dtype {meta.dtype!r} is not allowed on the wire")
        if meta.nbytes > max_bytes:
            raise ProtocolError(f"{mtype.name}: tensor of {meta.nbytes} bytes is over the {max_bytes} limit")
    for meta, frame in zip(framed, frames):
        if len(frame) != meta.nbytes:
            raise ProtocolError(f"{mtype.name}: frame of {len(frame)} bytes for a {meta.dtype}{list(meta.shape)} tensor")


# ------------------------------------------------------------------------------ tensors <-> frames

def tensor_to_frame(t) -> tuple[TensorMeta, Any]:
    """``(TensorMeta, buffer)`` for a torch tensor (any device; copied to CPU if needed) or numpy array.

    The buffer shares memory with the (contiguous, CPU) tensor; zmq keeps it alive until sent.
    """
    if type(t).__module__.startswith("torch"):
        import torch

        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        return TensorMeta(dtype, tuple(t.shape)), t.reshape(-1).view(torch.uint8).numpy().data
    import numpy as np

    arr = np.ascontiguousarray(t)
    return TensorMeta(arr.dtype.name, tuple(arr.shape)), arr.reshape(-1).view(np.uint8).data


def frame_to_tensor(meta: TensorMeta, buf, copy: bool = False):
    """A torch tensor viewing (or, with ``copy``, copying) a received frame."""
    import torch

    dtype = getattr(torch, meta.dtype)
    if meta.nbytes == 0:
        return torch.empty(meta.shape, dtype=dtype)
    with warnings.catch_warnings():  # zmq frames are read-only; we never write through the view
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    out = flat.view(dtype).view(meta.shape)
    return out.clone() if copy else out


def frame_to_array(meta: TensorMeta, buf):
    """A read-only numpy array viewing a received frame (no bfloat16 in numpy)."""
    import numpy as np

    if meta.dtype == "bfloat16":
        raise ProtocolError("bfloat16 frames need torch (frame_to_tensor)")
    return np.frombuffer(buf, dtype=np.dtype(meta.dtype)).reshape(meta.shape)


# ----------------------------------------------------------------------------- endpoints, sockets

def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"runtime dir {path} belongs to uid {st.st_uid}, not to this user")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def runtime_dir(unique: bool = False) -> Path:
    """Private (mode 0700) directory for ``ipc://`` sockets.

    ``$XDG_RUNTIME_DIR/dartree`` or ``/tmp/dartree-<uid>``; with ``unique`` (``dartree serve``) a
    per-supervisor directory ``...-<pid>`` so two servers never share sockets.
    """
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(xdg) / "dartree" if xdg and Path(xdg).is_dir() else Path(f"/tmp/dartree-{os.getuid()}")
    if unique:
        _remove_stale_runtime_dirs(base)
        base = base.with_name(f"{base.name}-{os.getpid()}")
    return _private_dir(base)


def _remove_stale_runtime_dirs(base: Path) -> None:
    """Remove this user's ``<base>-<pid>`` directories whose supervisor no longer runs: a supervisor
    removes its own at exit, but one killed with SIGKILL left it (and its sockets) behind for good.
    A directory whose pid is alive (whoever runs it now) is kept; failures are ignored."""
    import shutil

    for path in base.parent.glob(f"{base.name}-*"):
        pid = path.name[len(base.name) + 1:]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            if path.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # PermissionError: a live process of another user has that pid
            continue


def ipc_endpoint(name: str, directory: Path | None = None) -> str:
    """``ipc://<runtime dir>/<name>.sock``."""
    return f"ipc://{(directory or runtime_dir()) / name}.sock"


def _prepare_bind(endpoint: str) -> None:
    if not endpoint.startswith("ipc://"):
        return
    path = Path(endpoint[len("ipc://"):])
    if len(str(path).encode()) > IPC_PATH_MAX:
        raise ValueError(f"ipc path {path} is longer than {IPC_PATH_MAX} bytes; set a shorter XDG_RUNTIME_DIR")
    _private_dir(path.parent)
    if path.exists() and stat.S_ISSOCK(path.stat().st_mode):
        path.unlink()  # stale socket of a dead predecessor (restart)


def make_socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool,
                max_message_bytes: int = DEFAULT_MAX_TENSOR_BYTES + (16 << 20)) -> zmq.Socket:
    """A configured socket (no linger, large HWM, inbound size cap) bound or connected to ``endpoint``."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SOCKET_HWM)
    sock.setsockopt(zmq.RCVHWM, SOCKET_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if bind:
        _prepare_bind(endpoint)
        sock.bind(endpoint)
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint[len("ipc://"):], 0o600)
    else:
        sock.connect(endpoint)
    return sock


def new_epoch() -> str:
    """Random id of one process start; peers notice restarts when it changes."""
    return uuid.uuid4().hex[:12]


def drain_monitor(monitor: zmq.Socket) -> list[int]:
    """Pending events (``zmq.EVENT_*``) on a socket monitor, without blocking."""
    from zmq.utils.monitor import recv_monitor_message

    events = []
    while monitor.poll(0):
        events.append(int(recv_monitor_message(monitor)["event"]))
    return events


# ---------------------------------------------------------------------------------------- I/O thread

class ServerIO:
    """A bound ROUTER served by an I/O thread; the compute thread never touches it.

    Inbound messages are decoded on the I/O thread. ``on_message(identity, decoded)`` runs there
    and returns an immediate reply (a struct, e.g. a Pong), ``False`` (handled, no reply) or
    ``None``: the message is then put on :attr:`inbox` as ``(identity, Decoded)``. ``refuse(reason)``
    builds the HelloAck sent to a peer whose HELLO is undecodable because of another protocol version. The compute thread replies with
    :meth:`send`, which hands the frames to the I/O thread through an ``inproc`` PUSH/PULL pair.
    Malformed messages are logged, counted with ``on_error`` and dropped.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, name: str,
                 on_message: Callable[[bytes, Decoded], Any] | None = None,
                 on_error: Callable[[str], None] | None = None,
                 max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES, inbox: queue.Queue | None = None,
                 refuse: Callable[[str], Any] | None = None):
        self.ctx, self.endpoint, self.name = ctx, endpoint, name
        self.inbox: queue.Queue = inbox if inbox is not None else queue.Queue()
        self._on_message = on_message or (lambda ident, dec: None)
        self._on_error = on_error or (lambda reason: None)
        self._refuse = refuse
        self._max_tensor_bytes = max_tensor_bytes
        self._out_addr = f"inproc://{name}-out-{uuid.uuid4().hex[:8]}"
        self._local = threading.local()
        self._stop = threading.Event()
        self._router = make_socket(ctx, zmq.ROUTER, endpoint, bind=True,
                                   max_message_bytes=max_tensor_bytes + (16 << 20))
        self._pull = ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, SOCKET_HWM)
        self._pull.bind(self._out_addr)
        self._thread = threading.Thread(target=self._run, name=f"{name}-io", daemon=True)

    def start(self) -> "ServerIO":
        self._thread.start()
        return self

    def send(self, identity: bytes, msg: msgspec.Struct, frames: Sequence = ()) -> None:
        """Queue ``msg`` for ``identity`` (thread-safe: one PUSH socket per calling thread)."""
        if self._stop.is_set():
            log.debug("%s: closed; dropped an outbound %s", self.name, type(msg).__name__)
            return
        push = getattr(self._local, "push", None)
        if push is None:
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.setsockopt(zmq.SNDHWM, SOCKET_HWM)
            push.connect(self._out_addr)
            self._local.push = push
        try:  # never block the compute thread: the queue is only full if the I/O thread is gone
            push.send_multipart([identity, *encode(msg, frames)], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.error("%s: outbound queue full; dropped a %s", self.name, type(msg).__name__)

    def close(self) -> None:
        """Stop the I/O thread (this thread's PUSH socket is closed too; others close with the context)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        push = getattr(self._local, "push", None)
        if push is not None:
            push.close(0)
            self._local.push = None

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    if sock is self._router:
                        self._recv_one()
                    else:
                        self._router.send_multipart(self._pull.recv_multipart(copy=False), copy=False)
            flush_until = time.monotonic() + 0.5  # replies queued before close (e.g. shutdown errors)
            while time.monotonic() < flush_until and self._pull.poll(50):
                self._router.send_multipart(self._pull.recv_multipart(copy=False), copy=False)
        finally:
            self._router.close(0)
            self._pull.close(0)

    def _recv_one(self) -> None:
        parts = self._router.recv_multipart(copy=False)
        identity = parts[0].bytes
        try:
            decoded = decode(parts[1:], self._max_tensor_bytes)
        except ProtocolError as exc:
            log.warning("%s: dropped a malformed message: %s", self.name, exc)
            self._on_error(str(exc))
            reason = version_mismatch(parts[1:])
            if reason and self._refuse is not None:  # tell a peer of another version why it is refused
                self._router.send_multipart([identity, *encode(self._refuse(reason))], copy=False)
            return
        try:
            reply = self._on_message(identity, decoded)
        except Exception:  # an I/O-thread handler must never kill the socket loop
            log.exception("%s: handler failed on %s", self.name, decoded.type.name)
            return
        if reply is None:
            self.inbox.put((identity, decoded))
        elif reply is not False:
            self._router.send_multipart([identity, *encode(reply)], copy=False)
