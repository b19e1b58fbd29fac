"""The verifier's admission limit: free KV slots + ``max_waiting`` queue places, counted per message.

Every admission decision sees the requests accepted before it in the same inbox batch and the ones
already running, so a burst arriving at once never overfills the queue.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager

import pytest
import zmq

from gateway.engine_client import EngineError, ZmqEngineClient
from services import protocol as p
from services.verifier.config import EngineConfig, VerifierWorkerConfig
from services.verifier.worker import VerifierWorker
from services.wire import ServerIO, new_epoch

from .fakes import verifier_info

try:
    from tests.doubles.engine import FakeEngine
except ImportError:  # the worker doubles' older home
    from .fakes import FakeEngine


@pytest.fixture
def sockdir():
    d = tempfile.mkdtemp(prefix="dt-", dir="/tmp")  # short: ipc paths are limited to 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@contextmanager
def running_verifier(sockdir, engine, max_running: int = 8, **cfg):
    """A verifier worker on ``ipc://`` with its event loop on a thread."""
    ctx = zmq.Context()
    endpoint = f"ipc://{sockdir}/verifier.sock"
    config = VerifierWorkerConfig(engine=EngineConfig(max_running=max_running), **cfg)
    worker = VerifierWorker(engine, verifier_info(400, epoch=new_epoch()), config)
    io = ServerIO(ctx, endpoint, "verifier", on_message=worker.on_io_message,
                  on_error=lambda r: worker.metrics.ipc_errors.labels("gateway").inc(), inbox=worker.inbox,
                  refuse=lambda reason: p.HelloAck(p.PROTOCOL_VERSION, False, worker.info, reason))
    worker.send = io.send
    io.start()
    stop = threading.Event()
    thread = threading.Thread(target=worker.event_loop, args=(stop,), daemon=True)
    thread.start()
    try:
        yield worker, endpoint
    finally:
        stop.set()
        thread.join(5)
        io.close()
        ctx.destroy(linger=0)


async def connected_client(endpoint) -> ZmqEngineClient:
    client = ZmqEngineClient(endpoint, p.PeerInfo(role="gateway", epoch="g"), ping_interval_s=0.05,
                             ping_timeout_s=1.0)
    await client.start()
    for _ in range(200):
        if client.ready:
            break
        await asyncio.sleep(0.01)
    return client


def gen(rid: str) -> p.Generate:
    return p.Generate(rid, [5, 6], p.SamplingParams(max_tokens=16), p.SpecParams())


def _gauges(worker) -> tuple[float, float]:
    r = worker.metrics.registry
    return r.get_sample_value("dartree_num_requests_running"), r.get_sample_value("dartree_num_requests_waiting")


def _worker(max_running: int, max_waiting: int, rounds: int = 5) -> tuple[VerifierWorker, list]:
    sent: list = []
    worker = VerifierWorker(FakeEngine(rounds=[[1]] * rounds), verifier_info(400),
                            VerifierWorkerConfig(engine=EngineConfig(max_running=max_running), max_waiting=max_waiting),
                            send=lambda identity, msg: sent.append(msg))
    return worker, sent


def _refused(sent: list) -> list[p.RequestError]:
    return [m for m in sent if isinstance(m, p.RequestError)]


def test_a_burst_in_one_inbox_batch_takes_free_slots_plus_queue_places_only():
    worker, sent = _worker(max_running=2, max_waiting=1)
    worker.post(b"c", gen("a"))
    worker.run_once()  # "a" runs (prefill round): one slot left, the queue empty
    assert list(worker._running) == ["a"] and not _refused(sent)
    for rid in "bcde":  # all four sit in the inbox when the loop next looks
        worker.post(b"c", gen(rid))
    worker._recv(block=False, timeout=0)
    assert len(worker._waiting) == 2, "1 free slot + 1 queue place"
    refused = _refused(sent)
    assert sorted(e.request_id for e in refused) == ["d", "e"]
    assert {(e.status, e.code) for e in refused} == {(429, "overloaded")}
    worker._admit()
    worker._update_gauges()
    assert _gauges(worker) == (2, 1)


def test_no_queue_refuses_beyond_the_free_slots():
    worker, sent = _worker(max_running=3, max_waiting=0)
    worker.post(b"c", gen("a"))
    worker.run_once()
    for rid in "bcde":
        worker.post(b"c", gen(rid))
    worker.run_once()
    assert sorted(worker._running) == ["a", "b", "c"] and not worker._waiting
    assert sorted(e.request_id for e in _refused(sent)) == ["d", "e"]


def test_a_place_freed_by_a_finished_request_is_reused():
    worker, sent = _worker(max_running=1, max_waiting=1, rounds=2)
    for rid in "ab":
        worker.post(b"c", gen(rid))
    worker.run_once()
    worker.post(b"c", gen("c"))
    worker.run_once()  # full: 1 running + 1 waiting
    assert [e.request_id for e in _refused(sent)] == ["c"]
    worker.run_once()  # "a" finishes, "b" is admitted: the queue place is free again
    worker.post(b"c", gen("d"))
    worker.run_once()
    assert [e.request_id for e in _refused(sent)] == ["c"]
    assert [e.gen.request_id for e in worker._waiting] == ["d"] or "d" in worker._running


def test_burst_over_zmq_accepts_two_refuses_two_with_429(sockdir):
    """Own server ``--max-running 2 --max-waiting 1``, one request running, a burst of 4 at once:
    2 accepted (1 free slot + 1 queue place), 2 refused with 429; the gauges never exceed the limits."""
    engine = FakeEngine(rounds=[[1]] * 6, step_delay_s=0.1)
    with running_verifier(sockdir, engine, max_running=2, max_waiting=1) as (worker, endpoint):
        async def go():
            client = await connected_client(endpoint)

            async def one(rid):
                try:
                    return len([c async for c in client.generate(gen(rid))])
                except EngineError as err:
                    return err.status

            first = asyncio.create_task(one("a"))
            deadline = time.monotonic() + 5
            while "a" not in worker._running and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            burst = [asyncio.create_task(one(rid)) for rid in "bcde"]
            peak = (0.0, 0.0)
            while not all(t.done() for t in burst) and time.monotonic() < deadline:
                peak = tuple(map(max, peak, _gauges(worker)))
                await asyncio.sleep(0.002)
            out = await asyncio.gather(first, *burst)
            await client.close()
            return out, peak

        out, (running, waiting) = asyncio.run(go())
        assert out[0] == 6
        assert sorted(out[1:]) == [6, 6, 429, 429], out
        assert (running, waiting) == (2, 1), "peak gauges"
