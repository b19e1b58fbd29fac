"""Tensor transport between drafter and verifier: CUDA-IPC slot pools on one GPU, zero-copy frames on CPU.

Both paths sit behind :class:`TensorTransport`:

- :class:`FrameTransport` (CPU, or GPUs that cannot share memory): each tensor becomes one ZMQ side
  frame described by ``TensorMeta(dtype, shape)``; the receiver views the frame without copying.
- :class:`CudaIpcTransport` (drafter and verifier on the same GPU, docs/design.md "Co-located drafter and verifier"): each side
  pre-allocates a ring of equal slots on the GPU and exports its CUDA-IPC handle **once** in the
  handshake (``PeerInfo.pool``); the peer opens it once. Per message only ``(slot, dtype, shape)``
  travels; the sender copies device-to-device into the slot and synchronises its stream before
  sending. A tensor larger than a slot falls back to a frame, so every message still works.

Slot lifetime: a slot is rewritten after ``num_slots`` further tensors, so the receiver copies out
(``unpack(copy=True)``, the default) or finishes with the view before replying. The pool tensor lives
as long as the transport (torch's IPC rule: the producer keeps the memory alive while peers use it).
Importable without torch; torch is imported when a transport is used.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from services.protocol import PoolHandle, ProtocolError, TensorMeta
from services.wire import frame_to_tensor, tensor_to_frame


class TensorTransport(ABC):
    """Packs tensors into ``(metas, frames)`` for a message and unpacks them on the other side."""

    kind: str

    def export(self) -> PoolHandle | None:
        """This side's pool handle for the handshake (``None``: nothing to share)."""
        return None

    def attach(self, peer: PoolHandle | None) -> None:
        """Open the peer's pool (called once after the handshake)."""

    @abstractmethod
    def pack(self, tensors: Sequence) -> tuple[list[TensorMeta], list]:
        """Metadata for each tensor and the side frames to send with the message."""

    @abstractmethod
    def unpack(self, metas: Sequence[TensorMeta], frames: Sequence, copy: bool = True) -> list:
        """Tensors (on this side's device) for the metadata and frames of a received message."""


class FrameTransport(TensorTransport):
    """Zero-copy ZMQ side frames (CPU memory); results are moved to ``device``."""

    kind = "frames"

    def __init__(self, device: str = "cpu"):
        self.device = device

    def pack(self, tensors: Sequence) -> tuple[list[TensorMeta], list]:
        metas, frames = [], []
        for t in tensors:
            meta, buf = tensor_to_frame(t)
            metas.append(meta)
            frames.append(buf)
        return metas, frames

    def unpack(self, metas: Sequence[TensorMeta], frames: Sequence, copy: bool = True) -> list:
        out, it = [], iter(frames)
        for meta in metas:
            if meta.slot >= 0:
                raise ProtocolError("a pool slot arrived on a link without a CUDA-IPC pool")
            t = frame_to_tensor(meta, next(it), copy=copy and self.device == "cpu")
            out.append(t if self.device == "cpu" else t.to(self.device))
        return out


class CudaIpcTransport(TensorTransport):
    """Pre-allocated CUDA-IPC slot ring for sending; the peer's ring opened once for receiving.

    Args:
        device: this side's CUDA device, e.g. ``"cuda:0"`` (``"cuda"`` is normalised to the current
            device's index, :func:`services.devices.normalize_device`: a tensor on ``cuda:0`` must
            compare equal to the pool's device or it is sent as a frame).
        num_slots: slots in the send ring (>= 2 x tensors per message in flight).
        slot_bytes: bytes per slot (rounded up to 512).
    """

    kind = "cuda_ipc"

    def __init__(self, device: str = "cuda:0", num_slots: int = 16, slot_bytes: int = 8 << 20):
        import torch

        from services.devices import normalize_device

        self.device = torch.device(normalize_device(device))
        self.num_slots = num_slots
        self.slot_bytes = (slot_bytes + 511) // 512 * 512
        self._pool = torch.empty(num_slots * self.slot_bytes, dtype=torch.uint8, device=self.device)  # [S*bytes]
        self._next = 0
        self._peer = None  # [S*bytes] uint8 view of the peer's pool
        self._peer_slot_bytes = 0
        self._send_via_pool = False  # only once the peer showed (by exporting its own) that it maps pools
        self._frames = FrameTransport(str(self.device))

    def export(self) -> PoolHandle:
        storage = self._pool.untyped_storage()
        (device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = storage._share_cuda_()
        return PoolHandle(device=int(device), handle=bytes(handle), size_bytes=int(size),
                          offset_bytes=int(offset), ref_counter_handle=bytes(rc_handle),
                          ref_counter_offset=int(rc_offset), event_handle=bytes(ev_handle or b""),
                          event_sync_required=bool(ev_sync), num_slots=self.num_slots,
                          slot_bytes=self.slot_bytes)

    def attach(self, peer: PoolHandle | None) -> None:
        self._send_via_pool = peer is not None
        if peer is None:
            return
        import torch

        torch.cuda._lazy_init()
        storage = torch.UntypedStorage._new_shared_cuda(
            peer.device, peer.handle, peer.size_bytes, peer.offset_bytes, peer.ref_counter_handle,
            peer.ref_counter_offset, peer.event_handle or None, peer.event_sync_required)
        typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
        self._peer = torch._utils._rebuild_tensor(typed, 0, (peer.size_bytes,), (1,))
        self._peer_slot_bytes = peer.slot_bytes

    def pack(self, tensors: Sequence) -> tuple[list[TensorMeta], list]:
        import torch

        metas, frames, used = [], [], False
        for t in tensors:
            t = t.detach()
            if not self._send_via_pool or t.device != self.device or t.numel() * t.element_size() > self.slot_bytes:
                meta, buf = tensor_to_frame(t)
                metas.append(meta)
                frames.append(buf)
                continue
            slot, nbytes = self._next, t.numel() * t.element_size()
            self._next = (self._next + 1) % self.num_slots
            start = slot * self.slot_bytes
            self._pool[start:start + nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
            metas.append(TensorMeta(str(t.dtype).removeprefix("torch."), tuple(t.shape), slot))
            used = True
        if used:
            torch.cuda.current_stream(self.device).synchronize()  # the peer reads right after receipt
        return metas, frames

    def unpack(self, metas: Sequence[TensorMeta], frames: Sequence, copy: bool = True) -> list:
        import torch

        out, it = [], iter(frames)
        for meta in metas:
            if meta.slot < 0:
                out.append(self._frames.unpack([meta], [next(it)], copy=copy)[0])
                continue
            if self._peer is None or meta.slot * self._peer_slot_bytes + meta.nbytes > self._peer.numel():
                raise ProtocolError(f"pool slot {meta.slot} is outside the peer's pool")
            if meta.nbytes > self._peer_slot_bytes:
                raise ProtocolError(f"a {meta.nbytes}-byte tensor does not fit a {self._peer_slot_bytes}-byte slot")
            start = meta.slot * self._peer_slot_bytes
            view = self._peer[start:start + meta.nbytes].view(getattr(torch, meta.dtype)).view(meta.shape)
            view = view.clone() if copy else view
            out.append(view if view.device == self.device else view.to(self.device))
        return out


def make_transport(device: str, cuda_ipc: bool = True, num_slots: int = 16, slot_bytes: int = 8 << 20
                   ) -> TensorTransport:
    """CUDA-IPC pools for a CUDA device (when ``cuda_ipc``), zero-copy frames otherwise."""
    if device.startswith("cuda") and cuda_ipc:
        return CudaIpcTransport(device, num_slots, slot_bytes)
    return FrameTransport(device)
