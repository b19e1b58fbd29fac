"""Tensor transports: CPU zero-copy frames here; the CUDA-IPC pool across two processes on a GPU."""

from __future__ import annotations

import multiprocessing as mp

import msgspec
import pytest

from services.ipc_pool import FrameTransport, make_transport
from services.protocol import DraftReply, PoolHandle, ProtocolError, TensorMeta
from services.wire import decode, encode

torch = pytest.importorskip("torch")


def test_frame_transport_round_trips_through_a_message():
    t = FrameTransport()
    tensors = [torch.randn(4, 6).to(torch.bfloat16), torch.arange(5), torch.zeros(0, dtype=torch.float32),
               torch.tensor([True, False])]
    metas, frames = t.pack(tensors)
    dec = decode([bytes(x) for x in encode(DraftReply("r", 1, "e", tuple(metas)), frames)])
    out = t.unpack(dec.msg.tree, dec.frames)
    for a, b in zip(tensors, out):
        assert a.dtype == b.dtype and torch.equal(a, b)
    out[0][0, 0] = 1.0  # copy=True: writable, independent of the frame


def test_frame_transport_refuses_pool_slots():
    with pytest.raises(ProtocolError, match="CUDA-IPC pool"):
        FrameTransport().unpack([TensorMeta("float32", (2,), slot=0)], [])


def test_cpu_device_gets_frames():
    assert isinstance(make_transport("cpu"), FrameTransport)


def _child(conn) -> None:
    """Peer process: open the parent's pool, read a tensor from it, send one back through its own pool."""
    import torch

    from services.ipc_pool import CudaIpcTransport

    peer = msgspec.msgpack.decode(conn.recv_bytes(), type=PoolHandle)
    mine = CudaIpcTransport("cuda:0", num_slots=4, slot_bytes=1 << 16)
    mine.attach(peer)
    conn.send_bytes(msgspec.msgpack.encode(mine.export()))
    metas = msgspec.msgpack.decode(conn.recv_bytes(), type=list[TensorMeta])
    (x,) = mine.unpack(metas, [])
    back, frames = mine.pack([x * 2, torch.ones(1 << 15, device="cuda:0")])  # the second is over a slot
    conn.send_bytes(msgspec.msgpack.encode(back))
    conn.send_bytes(bytes(frames[0]))
    conn.recv_bytes()  # keep the pool alive until the parent has read it


@pytest.mark.gpu
def test_cuda_ipc_pool_across_processes():
    from services.ipc_pool import CudaIpcTransport

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child,))
    proc.start()
    try:
        mine = CudaIpcTransport("cuda:0", num_slots=4, slot_bytes=1 << 16)
        parent.send_bytes(msgspec.msgpack.encode(mine.export()))
        mine.attach(msgspec.msgpack.decode(parent.recv_bytes(), type=PoolHandle))
        x = torch.arange(12, dtype=torch.bfloat16, device="cuda:0").view(3, 4)
        metas, frames = mine.pack([x])
        assert metas[0].slot >= 0 and frames == []  # only (slot, dtype, shape) travels
        parent.send_bytes(msgspec.msgpack.encode(metas))
        back = msgspec.msgpack.decode(parent.recv_bytes(), type=list[TensorMeta])
        big = parent.recv_bytes()
        doubled, ones = mine.unpack(back, [big])
        assert back[0].slot >= 0 and back[1].slot == -1  # oversize fell back to a frame
        assert torch.equal(doubled, x * 2) and doubled.device.type == "cuda"
        assert ones.device.type == "cuda" and float(ones.sum()) == 1 << 15
        parent.send_bytes(b"done")
    finally:
        proc.join(30)
    assert proc.exitcode == 0


def _drafter_side(conn) -> None:
    """Drafter process of the feature path: open the verifier's pool, take DraftBatch messages as the
    drafter worker does (``unpack([job.features ...], frames)``), answer each batch with one
    DraftReply whose tensors (per-job row sums, and job 0's features echoed) ride in its own pool."""
    import torch

    from services.ipc_pool import CudaIpcTransport

    mine = CudaIpcTransport("cuda:0", num_slots=4, slot_bytes=1 << 14)
    mine.attach(msgspec.msgpack.decode(conn.recv_bytes(), type=PoolHandle))
    conn.send_bytes(msgspec.msgpack.encode(mine.export()))
    while (n := int(conn.recv_bytes())) > 0:
        dec = decode([conn.recv_bytes() for _ in range(n)])
        feats = mine.unpack([j.features for j in dec.msg.jobs], dec.frames, copy=True)
        sums = torch.stack([f.float().sum(1).sum() for f in feats])
        metas, frames = mine.pack([sums, feats[0]])
        parts = encode(DraftReply(dec.msg.jobs[0].request_id, dec.msg.jobs[0].round_id, "e", tuple(metas)), frames)
        conn.send_bytes(str(len(parts)).encode())
        for p in parts:
            conn.send_bytes(bytes(p))


@pytest.mark.gpu
def test_cuda_ipc_feature_path_of_draft_batches():
    """Verifier -> drafter features through the CUDA-IPC pool inside real DraftBatch messages, as the
    workers send them: bf16 [L, F] feature blocks of several jobs, one too big for a slot (it falls
    back to a side frame between pooled ones), and more tensors than slots over three batches (the
    ring wraps; copy-on-receipt keeps every batch exact)."""
    from services.ipc_pool import CudaIpcTransport
    from services.protocol import DraftBatch, DraftRequest
    from services.spec import TreeKnobs

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_drafter_side, args=(child,))
    proc.start()
    try:
        verifier = CudaIpcTransport("cuda:0", num_slots=4, slot_bytes=1 << 14)
        parent.send_bytes(msgspec.msgpack.encode(verifier.export()))
        verifier.attach(msgspec.msgpack.decode(parent.recv_bytes(), type=PoolHandle))
        gen = torch.Generator(device="cuda").manual_seed(0)
        for round_id, rows in enumerate([(3, 50, 7), (1, 2, 4), (9, 60, 1)]):  # 50 / 60 rows x 96 x 2 B > a slot
            feats = [torch.randn(r, 96, device="cuda", generator=gen).to(torch.bfloat16) for r in rows]
            metas, frames = verifier.pack(feats)
            assert [m.slot >= 0 for m in metas] == [r * 96 * 2 <= 1 << 14 for r in rows] and len(frames) == 1
            jobs = [DraftRequest(f"r{i}", round_id, [5] * r, m, 5, 10, "ddtree", TreeKnobs(4, 2, -0.2, 8))
                    for i, (r, m) in enumerate(zip(rows, metas))]
            parts = encode(DraftBatch(jobs), frames)
            parent.send_bytes(str(len(parts)).encode())
            for p in parts:
                parent.send_bytes(bytes(p))
            reply = decode([parent.recv_bytes() for _ in range(int(parent.recv_bytes()))])
            assert reply.msg.round_id == round_id and all(m.slot >= 0 for m in reply.msg.tree)
            sums, echo = verifier.unpack(reply.msg.tree, reply.frames)
            torch.testing.assert_close(sums, torch.stack([f.float().sum(1).sum() for f in feats]))
            assert echo.dtype == torch.bfloat16 and torch.equal(echo, feats[0])
        parent.send_bytes(b"0")
    finally:
        proc.join(30)
    assert proc.exitcode == 0
