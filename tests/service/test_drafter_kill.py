"""A drafter process killed with SIGKILL, then replaced by a new one on the same endpoint, against the
verifier's real :class:`~services.verifier.remote_drafter.ZmqDrafterClient` (no models: a context-
checking fake service in a spawned process).

What the verifier's compute thread relies on: a draft in flight to a killed drafter ends at once
(not at the draft deadline), and a draft that reaches the new process before the verifier noticed
the restart (the new drafter refuses it: it holds no context for the request) reads as the drafter
being unavailable (a plain round, then a resync), never as a drafter error that would fail the request.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time

import pytest

from services import protocol as p
from services.ipc_pool import FrameTransport
from tests.doubles import FakeDrafterService

torch = pytest.importorskip("torch")
DEADLINE_S = 30.0  # the client's draft deadline: a wait that ends by it was not noticed at all


class ContextCheckingService(FakeDrafterService):
    """:class:`FakeDrafterService` that keeps the real service's context contract (a job's features
    continue the request's context exactly, else the job fails as ``DrafterService.append_context``
    does) and hangs ``hang_s`` on every draft but a request's first."""

    def _draft(self, job):
        have, n = self.contexts.get(job.request_id, 0), len(job.committed_ids)
        if have != job.start - n:
            raise ValueError(f"drafter context of {job.request_id!r} holds {have} positions, expected {job.start - n}")
        return super()._draft(job)

    def draft_batch(self, jobs) -> list:
        if all(j.request_id not in self.contexts for j in jobs):
            hang, self.hang_s = self.hang_s, 0.0
            try:
                return super().draft_batch(jobs)
            finally:
                self.hang_s = hang
        return super().draft_batch(jobs)


def serve_drafter(endpoint: str, hang_s: float) -> None:
    """Process entry: a drafter worker over :class:`ContextCheckingService` on ``endpoint``, until killed."""
    from pathlib import Path

    import zmq

    from services.drafter.worker import DrafterWorker, drafter_info
    from services.wire import ServerIO, new_epoch

    ctx, transport, service = zmq.Context(), FrameTransport(), ContextCheckingService(hang_s=hang_s)
    worker = DrafterWorker(service, drafter_info(service, Path(tempfile.gettempdir()), new_epoch(), "cpu", transport),
                           transport)
    io = ServerIO(ctx, endpoint, "drafter", on_message=worker.on_io_message, on_error=lambda reason: None,
                  inbox=worker.inbox)
    worker.send = io.send
    io.start()
    worker.event_loop(threading.Event())


@pytest.fixture
def endpoint():
    d = tempfile.mkdtemp(prefix="dk-", dir="/tmp")  # short: ipc paths are limited to 107 bytes
    yield f"ipc://{d}/drafter.sock"
    shutil.rmtree(d, ignore_errors=True)


def _start(endpoint: str, hang_s: float = 0.0) -> mp.process.BaseProcess:
    proc = mp.get_context("spawn").Process(target=serve_drafter, args=(endpoint, hang_s), daemon=True)
    proc.start()
    return proc


def _kill(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)


def _job(committed_ids: list[int], start: int):
    """Request "r"'s draft: ``committed_ids`` are its context positions ``[start - n, start)``."""
    from services.testing import draft_job

    return draft_job("r", committed_ids, torch.zeros(len(committed_ids), 8), 9, start,
                     p.SpecParams(method="dartree-pruned", budget=3), None)


def _client(endpoint: str):
    from services.verifier.remote_drafter import ZmqDrafterClient

    return ZmqDrafterClient(endpoint, p.PeerInfo(role="verifier", epoch="v1", vocab_size=400), FrameTransport(),
                            DEADLINE_S)


def test_a_draft_in_flight_to_a_killed_drafter_ends_at_once(endpoint):
    from services.verifier.remote_drafter import DrafterDisconnected

    proc = _start(endpoint, hang_s=DEADLINE_S * 2)
    client = _client(endpoint)
    try:
        client.connect(wait_s=120)
        tree, _ = client.collect(client.submit([_job([1], 1)])[0])  # the context: one position
        assert tree.num_nodes == 3
        handle = client.submit([_job([2], 2)])[0]  # the drafter hangs on it
        killer = threading.Timer(0.3, _kill, (proc,))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(DrafterDisconnected, match="lost the connection"):
            client.collect(handle)
        assert time.monotonic() - t0 < DEADLINE_S / 3  # the disconnect, not the deadline
        killer.join()
    finally:
        client.close()
        if proc.is_alive():
            _kill(proc)


def test_a_draft_that_reaches_the_restarted_drafter_reads_as_unavailable_then_resyncs(endpoint):
    """The sequence of a drafter restart between two rounds: the next round's draft continues the
    old context and goes to the new process, which refuses it; the request must see the drafter as
    unavailable (a plain round; a ``DrafterError`` would fail the request), and its resync (the
    whole history, after ``release``) drafts again."""
    from services.verifier.remote_drafter import DrafterUnavailable

    first = _start(endpoint)
    client = _client(endpoint)
    second = None
    try:
        client.connect(wait_s=120)
        old = client.info()["epoch"]
        client.collect(client.submit([_job([1], 1)])[0])
        _kill(first)  # between rounds: nothing of this client is waiting
        second = _start(endpoint)
        handle = client.submit([_job([2], 2)])[0]  # queued until the new process is up
        with pytest.raises(DrafterUnavailable):  # the lost connection or the new epoch; not a DrafterError
            client.collect(handle)
        client.release("r")  # what the engine does for every request when the drafter is lost
        deadline = time.monotonic() + 120
        while not client.ping(2.0):  # the new process answers (its start-up: seconds)
            assert time.monotonic() < deadline, "the new drafter never answered"
        assert client.info()["epoch"] != old
        tree, _ = client.collect(client.submit([_job([1, 2], 2)])[0])  # the resync: the whole history
        assert tree.num_nodes == 3
        tree, _ = client.collect(client.submit([_job([3], 3)])[0])  # and the next round continues it
        assert tree.num_nodes == 3
    finally:
        client.close()
        for proc in (first, second):
            if proc is not None and proc.is_alive():
                _kill(proc)
