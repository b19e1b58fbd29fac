"""Verifier and drafter workers over real ZMQ ``ipc://`` sockets, with fake engines (threads, no models)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager

import msgspec
import pytest
import zmq

from gateway.engine_client import EngineError, ZmqEngineClient
from services import protocol as p
from services.drafter.worker import DrafterWorker, drafter_info
from services.ipc_pool import FrameTransport
from services.spec import TreeKnobs
from services.verifier.config import EngineConfig, VerifierWorkerConfig
from services.verifier.worker import VerifierWorker
from services.wire import ServerIO, decode, encode, new_epoch

from tests.doubles import FakeDrafterService, FakeEngine

from .fakes import verifier_info


@pytest.fixture
def sockdir():
    d = tempfile.mkdtemp(prefix="dt-", dir="/tmp")  # short: ipc paths are limited to 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _run(ctx, worker, io, endpoint):
    """Wire a worker to its socket I/O, run its event loop on a thread, tear both down after."""
    worker.send = io.send
    io.start()
    stop = threading.Event()
    thread = threading.Thread(target=worker.event_loop, args=(stop,), daemon=True)
    thread.start()
    try:
        yield worker, io, endpoint
    finally:
        stop.set()
        thread.join(5)
        io.close()
        ctx.destroy(linger=0)


@contextmanager
def running_verifier(sockdir, engine, max_running: int = 8, **cfg):
    ctx = zmq.Context()
    endpoint = f"ipc://{sockdir}/verifier.sock"
    config = VerifierWorkerConfig(engine=EngineConfig(max_running=max_running), **cfg)
    worker = VerifierWorker(engine, verifier_info(400, epoch=new_epoch()), config)
    io = ServerIO(ctx, endpoint, "verifier", on_message=worker.on_io_message,
                  on_error=lambda r: worker.metrics.ipc_errors.labels("gateway").inc(), inbox=worker.inbox,
                  refuse=lambda reason: p.HelloAck(p.PROTOCOL_VERSION, False, worker.info, reason))
    yield from _run(ctx, worker, io, endpoint)


def gateway_info(**kw) -> p.PeerInfo:
    return p.PeerInfo(role="gateway", epoch="g", **kw)


async def connected_client(endpoint, **kw) -> ZmqEngineClient:
    client = ZmqEngineClient(endpoint, gateway_info(**kw), ping_interval_s=0.05, ping_timeout_s=1.0)
    await client.start()
    for _ in range(200):
        if client.ready or "mismatch" in client.detail:
            break
        await asyncio.sleep(0.01)
    return client


def gen(rid: str, prompt=(5, 6), max_tokens: int = 16) -> p.Generate:
    return p.Generate(rid, list(prompt), p.SamplingParams(max_tokens=max_tokens), p.SpecParams())


# ----------------------------------------------------------------------------------------- verifier

def test_generate_streams_rounds_and_frees_state(sockdir):
    engine = FakeEngine()
    with running_verifier(sockdir, engine) as (worker, io, endpoint):
        async def go():
            client = await connected_client(endpoint)
            assert client.ready and client.info.max_context == 256
            chunks = [c async for c in client.generate(gen("r1"))]
            await client.close()
            return chunks

        chunks = asyncio.run(go())
        assert [c.token_ids for c in chunks] == engine.rounds
        assert [c.finish_reason for c in chunks] == [None, None, None, "stop"]
        assert engine.num_active() == 0
        r = worker.metrics.registry
        assert r.get_sample_value("dartree_num_requests_running") == 0
        # the first (prefill) round is not a speculative round
        assert r.get_sample_value("dartree_spec_rounds_total", {"method": "dartree-pruned"}) == 3
        assert r.get_sample_value("dartree_spec_acceptance_length_sum", {"method": "dartree-pruned"}) == 6


def test_every_step_holds_every_running_request_in_rotating_order(sockdir):
    engine = FakeEngine(rounds=[[1]] * 6, step_delay_s=0.01)
    with running_verifier(sockdir, engine) as (worker, io, endpoint):
        async def go():
            client = await connected_client(endpoint)

            async def one(rid):
                return [c async for c in client.generate(gen(rid))]

            out = await asyncio.gather(one("a"), one("b"))
            await client.close()
            return out

        a, b = asyncio.run(go())
        assert len(a) == len(b) == 6
        both = [s for s in engine.batches if len(s) == 2]
        assert len(both) >= 4, engine.batches  # once both run, every step holds both
        firsts = [s[0] for s in both[:4]]
        assert all(x != y for x, y in zip(firsts, firsts[1:])), engine.batches  # the order rotates


def test_admission_limit_queues_fifo_then_refuses_with_429(sockdir):
    engine = FakeEngine(rounds=[[1]] * 5, step_delay_s=0.02)
    with running_verifier(sockdir, engine, max_running=1, max_waiting=1) as (worker, io, endpoint):
        async def go():
            client = await connected_client(endpoint)

            async def one(rid):
                try:
                    return len([c async for c in client.generate(gen(rid))])
                except EngineError as err:
                    return err.status

            tasks = []
            for rid in "abc":
                tasks.append(asyncio.create_task(one(rid)))
                await asyncio.sleep(0.01)
            out = await asyncio.gather(*tasks)
            await client.close()
            return out

        assert asyncio.run(go()) == [5, 5, 429]
        assert engine.steps.index("b") > engine.steps.index("a")


def test_client_abort_frees_the_request_at_the_next_round(sockdir):
    engine = FakeEngine(rounds=[[1]] * 200, step_delay_s=0.005)
    with running_verifier(sockdir, engine) as (worker, io, endpoint):
        async def go():
            client = await connected_client(endpoint)
            stream = client.generate(gen("long"))
            async for _ in stream:
                break
            await stream.aclose()
            for _ in range(100):
                if engine.num_active() == 0:
                    break
                await asyncio.sleep(0.01)
            await client.close()

        asyncio.run(go())
        assert engine.num_active() == 0 and engine.aborted == ["long"]
        assert worker.metrics.registry.get_sample_value("dartree_aborts_total", {"reason": "client"}) == 1
        assert worker.metrics.registry.get_sample_value("dartree_num_requests_running") == 0


@pytest.mark.parametrize("engine, status, param", [
    (FakeEngine(), 400, "prompt"),
    (FakeEngine(fail_on_step=1), 500, None),
])
def test_engine_errors_become_request_errors(sockdir, engine, status, param):
    with running_verifier(sockdir, engine) as (worker, io, endpoint):
        async def go():
            client = await connected_client(endpoint)
            try:
                with pytest.raises(EngineError) as info:
                    async for _ in client.generate(gen("x", prompt=(399,) if status == 400 else (5,))):
                        pass
                engine.fail_on_step = None
                # the worker keeps serving
                ok = [c async for c in client.generate(gen("y"))]
            finally:
                await client.close()
            return info.value, ok

        err, ok = asyncio.run(go())
        assert err.status == status and err.param == param and "Traceback" not in err.message
        assert ok[-1].finish_reason == "stop" and engine.num_active() == 0


def test_drafter_unavailable_is_503(sockdir):
    from services.verifier.remote_drafter import DrafterUnavailable

    engine = FakeEngine(fail_on_step=1, fail_with=DrafterUnavailable("no answer within 1 s"))
    with running_verifier(sockdir, engine) as (worker, io, endpoint):
        async def go():
            client = await connected_client(endpoint)
            with pytest.raises(EngineError) as info:
                async for _ in client.generate(gen("x")):
                    pass
            await client.close()
            return info.value

        err = asyncio.run(go())
        assert err.status == 503 and err.code == "drafter_unavailable"


def test_verifier_death_fails_in_flight_requests_fast(sockdir):
    engine = FakeEngine(rounds=[[1]] * 500, step_delay_s=0.01)
    with running_verifier(sockdir, engine) as (worker, io, endpoint):
        async def go():
            client = await connected_client(endpoint)
            t0 = None
            with pytest.raises(EngineError) as info:
                async for _ in client.generate(gen("x")):
                    if t0 is None:
                        t0 = time.monotonic()
                        io.close()  # the verifier's socket goes away mid-stream
            dt = time.monotonic() - t0
            ready = client.ready
            await client.close()
            return info.value, dt, ready

        err, dt, ready = asyncio.run(go())
        assert err.status == 503 and dt < 2.0 and not ready


def test_mismatched_gateway_is_refused(sockdir):
    with running_verifier(sockdir, FakeEngine()) as (worker, io, endpoint):
        async def go():
            client = await connected_client(endpoint, tokenizer_hash="other", vocab_size=999)
            out = client.ready, client.detail
            await client.close()
            return out

        ready, detail = asyncio.run(go())
        assert not ready and "mismatch" in detail


def test_malformed_messages_are_dropped_and_the_worker_keeps_serving(sockdir):
    with running_verifier(sockdir, FakeEngine()) as (worker, io, endpoint):
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.connect(endpoint)
        raw.send_multipart([b"\x63", b"junk"])
        raw.send_multipart([bytes((p.MessageType.GENERATE,)), b"\xc1"])
        raw.send_multipart([bytes((p.MessageType.GENERATE,)), msgspec.msgpack.encode(["", [1], [5], []])])
        raw.send_multipart(encode(p.Pong(1, "x", True)))  # a valid message of the wrong direction
        same_layout = msgspec.msgpack.encode([p.PROTOCOL_VERSION + 1, ["gateway", "e"]])
        raw.send_multipart([bytes((p.MessageType.HELLO,)), same_layout])
        other_layout = msgspec.msgpack.encode([p.PROTOCOL_VERSION + 1, {"a": "new layout"}])
        raw.send_multipart([bytes((p.MessageType.HELLO,)), other_layout])
        raw.send_multipart(encode(p.Ping(9)))
        replies = []
        while raw.poll(2000):
            replies.append(decode(raw.recv_multipart()).msg)
            if isinstance(replies[-1], p.Pong):
                break
        raw.close(0)
        ctx.destroy()
        acks = [r for r in replies if isinstance(r, p.HelloAck)]
        assert len(acks) == 2 and all(not a.ok and "protocol version mismatch" in a.reason for a in acks)
        assert replies[-1].nonce == 9
        errors = worker.metrics.registry.get_sample_value("dartree_ipc_errors_total", {"peer": "gateway"})
        assert errors == 5

        async def go():
            client = await connected_client(endpoint)
            out = [c async for c in client.generate(gen("after"))]
            await client.close()
            return out

        assert asyncio.run(go())[-1].finish_reason == "stop"


def test_drain_finishes_running_refuses_new_and_exits(sockdir):
    engine = FakeEngine(rounds=[[1]] * 10, step_delay_s=0.01)
    with running_verifier(sockdir, engine) as (worker, io, endpoint):
        async def go():
            client = await connected_client(endpoint)
            stream = client.generate(gen("running"))
            first = await anext(stream)
            worker.begin_drain()
            rest = [c async for c in stream]
            await asyncio.sleep(0.1)
            await client.close()
            return [first, *rest]

        out = asyncio.run(go())
        assert out[-1].finish_reason == "stop" and len(out) == 10
        assert worker.status().draining


# ------------------------------------------------------------------------------------------ drafter

@contextmanager
def running_drafter(sockdir, service, name="drafter"):
    ctx = zmq.Context()
    endpoint = f"ipc://{sockdir}/{name}.sock"
    transport = FrameTransport()
    from pathlib import Path

    info = drafter_info(service, Path(sockdir), new_epoch(), "cpu", transport)
    worker = DrafterWorker(service, info, transport)
    io = ServerIO(ctx, endpoint, "drafter", on_message=worker.on_io_message,
                  on_error=lambda r: worker.metrics.ipc_errors.labels("verifier").inc(), inbox=worker.inbox)
    yield from _run(ctx, worker, io, endpoint)


def drafter_client(endpoint, timeout_s=5.0, **kw):
    from services.verifier.remote_drafter import ZmqDrafterClient

    local = p.PeerInfo(role="verifier", epoch="v1", vocab_size=kw.pop("vocab_size", 400), **kw)
    return ZmqDrafterClient(endpoint, local, FrameTransport(), timeout_s)


def _spec(method="dartree-pruned", budget=3):
    return p.SpecParams(method=method, budget=budget)


def _job(request_id, committed_ids, features, root_token, start, spec, max_depth=None):
    from services.testing import draft_job

    return draft_job(request_id, committed_ids, features, root_token, start, spec, max_depth)


def _draft(client, *job, **kw):
    """One request's draft through the client: submit a batch of one, collect its tree."""
    return client.collect(client.submit([_job(*job, **kw)])[0])


def test_drafter_round_trip_over_ipc(sockdir):
    torch = pytest.importorskip("torch")
    service = FakeDrafterService()
    with running_drafter(sockdir, service) as (worker, io, endpoint):
        client = drafter_client(endpoint)
        peer = client.connect(wait_s=5)
        assert peer.block_size == 4 and peer.target_layer_ids == (1, 2)
        feats = torch.randn(3, 8)
        tree, timings = _draft(client, "r1", [7, 8, 9], feats, 9, 3, _spec(budget=3), max_depth=2)
        assert tree.draft_tokens.tolist() == [10, 11] and tree.parents.tolist() == [-1, 0]
        assert tree.depths.tolist() == [1, 2] and tree.scores.dtype == torch.float32
        assert set(timings) == {"draft", "tree_build", "ipc"} and timings["ipc"] >= 0
        rid, committed, got, root, start, method, max_depth = service.calls[0]
        assert (rid, committed, root, start, method, max_depth) == ("r1", [7, 8, 9], 9, 3, "dartree-pruned", 2)
        assert torch.equal(got, feats)
        assert client.ping()
        client.release("r1")
        for _ in range(100):
            if not service.contexts:
                break
            time.sleep(0.01)
        assert service.contexts == {} and worker.metrics.registry.get_sample_value("dartree_drafter_contexts") == 0
        client.close()


def test_drafter_refuses_a_mismatched_verifier(sockdir):
    from services.verifier.remote_drafter import DrafterRefused

    with running_drafter(sockdir, FakeDrafterService()) as (worker, io, endpoint):
        client = drafter_client(endpoint, vocab_size=401)
        with pytest.raises(DrafterRefused, match="vocab size"):
            client.connect(wait_s=5)
        client.close()


def test_hung_drafter_hits_the_deadline(sockdir):
    torch = pytest.importorskip("torch")
    from services.verifier.remote_drafter import DrafterUnavailable

    with running_drafter(sockdir, FakeDrafterService(hang_s=3.0)) as (worker, io, endpoint):
        client = drafter_client(endpoint, timeout_s=0.3)
        client.connect(wait_s=5)
        t0 = time.monotonic()
        with pytest.raises(DrafterUnavailable, match="within 0.3 s"):
            _draft(client, "r", [1], torch.zeros(1, 8), 1, 1, _spec())
        assert time.monotonic() - t0 < 2.0  # the deadline, not the 3 s hang (slack for a busy machine)
        client.close()


def test_a_draft_wait_ends_at_the_heartbeats_verdict_not_the_deadline(sockdir):
    """A hung drafter: once the heartbeat says it is not answering (``set_available(False)``, from
    another thread), the wait for a draft ends within 0.1 s, not at its 30 s deadline; a verdict of
    True lets the next draft through."""
    torch = pytest.importorskip("torch")
    from services.verifier.remote_drafter import DrafterUnavailable

    service = FakeDrafterService(hang_s=1.5)
    with running_drafter(sockdir, service) as (worker, io, endpoint):
        client = drafter_client(endpoint, timeout_s=30.0)
        client.connect(wait_s=5)
        timer = threading.Timer(0.3, client.set_available, (False,))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(DrafterUnavailable, match="heartbeat"):
            _draft(client, "r", [1], torch.zeros(1, 8), 1, 1, _spec())
        assert time.monotonic() - t0 < 1.2  # the verdict (0.3 s), not the 1.5 s hang or the 30 s deadline
        client.set_available(True)
        service.hang_s = 0.0
        tree, _ = _draft(client, "r2", [1], torch.zeros(1, 8), 1, 1, _spec())
        assert tree.num_nodes > 0
        client.close()


def test_drafter_error_is_reported_and_the_drafter_keeps_serving(sockdir):
    torch = pytest.importorskip("torch")
    from services.verifier.remote_drafter import DrafterError

    service = FakeDrafterService(fail=True)
    with running_drafter(sockdir, service) as (worker, io, endpoint):
        client = drafter_client(endpoint)
        client.connect(wait_s=5)
        with pytest.raises(DrafterError, match="scripted drafter failure"):
            _draft(client, "r", [1], torch.zeros(1, 8), 1, 1, _spec())
        service.fail = False
        tree, _ = _draft(client, "r2", [1], torch.zeros(1, 8), 1, 1, _spec())
        assert tree.num_nodes == 3
        client.close()


def test_drafter_views_received_feature_frames_without_copying():
    """A DRAFT_BATCH's features reach the service as views of the received frames (no copy per frame)."""
    torch = pytest.importorskip("torch")

    class Recording(FakeDrafterService):
        def draft_batch(self, jobs):
            self.seen = [j.features for j in jobs]
            return super().draft_batch(jobs)

    service, transport = Recording(), FrameTransport()
    info = p.PeerInfo(role="drafter", epoch="d1", vocab_size=400)
    worker = DrafterWorker(service, info, transport, send=lambda *a: None)
    feats = [torch.arange(16.0).view(2, 8), torch.ones(1, 8)]
    metas, frames = transport.pack(feats)
    frames = [bytes(f) for f in frames]  # the received frames
    jobs = [p.DraftRequest(f"r{i}", 1, [1] * len(f), m, 1, len(f), "dartree-pruned",
                           TreeKnobs(3, 12, -0.2, 64)) for i, (f, m) in enumerate(zip(feats, metas))]
    worker.handle(b"v", decode(encode(p.DraftBatch(jobs), frames)))
    for got, want, frame in zip(service.seen, feats, frames):
        assert torch.equal(got, want)
        assert got.data_ptr() == torch.frombuffer(frame, dtype=torch.uint8).data_ptr()


def test_drafter_restart_loses_old_contexts_but_serves_new_requests(sockdir):
    torch = pytest.importorskip("torch")
    from services.verifier.remote_drafter import DrafterUnavailable

    with running_drafter(sockdir, FakeDrafterService()) as (worker, io, endpoint):
        client = drafter_client(endpoint)
        client.connect(wait_s=5)
        _draft(client, "old", [1], torch.zeros(1, 8), 1, 1, _spec())
    with running_drafter(sockdir, FakeDrafterService()) as (worker, io, endpoint):  # new process, new epoch
        with pytest.raises(DrafterUnavailable):
            _draft(client, "old", [2], torch.zeros(1, 8), 2, 2, _spec())
        with pytest.raises(DrafterUnavailable):  # the disconnect or the new epoch is noticed for old contexts
            _draft(client, "old", [2], torch.zeros(1, 8), 2, 2, _spec())
        tree, _ = _draft(client, "new", [1], torch.zeros(1, 8), 1, 1, _spec())
        assert tree.num_nodes == 3 and client.ping()
        client.close()


def test_a_drafter_that_restarted_quickly_answers_the_first_ping(sockdir):
    """The old process's disconnect, still queued on the socket monitor, must not make the first
    ping to the new drafter read as unreachable (readiness would drop to 503 for a health interval)."""
    with running_drafter(sockdir, FakeDrafterService()) as (worker, io, endpoint):
        client = drafter_client(endpoint)
        client.connect(wait_s=5)
        assert client.ping()
    with running_drafter(sockdir, FakeDrafterService()):  # a new process, up before the next ping
        time.sleep(0.3)  # the reconnect has happened; the disconnect event waits on the monitor
        assert client.ping()
        assert client.ping()
    client.close()


def test_new_verifier_epoch_drops_stale_drafter_contexts(sockdir):
    torch = pytest.importorskip("torch")
    service = FakeDrafterService()
    with running_drafter(sockdir, service) as (worker, io, endpoint):
        a = drafter_client(endpoint)
        a.connect(wait_s=5)
        _draft(a, "leaky", [1], torch.zeros(1, 8), 1, 1, _spec())
        a.close()
        from services.verifier.remote_drafter import ZmqDrafterClient

        b = ZmqDrafterClient(endpoint, p.PeerInfo(role="verifier", epoch="v2"), FrameTransport(), 5.0)
        b.connect(wait_s=5)
        assert service.contexts == {}
        b.close()


def test_overlap_schedule_alternates_two_balanced_groups():
    """With ``overlap`` the running requests split into two groups that take turns (disjoint, covering
    everyone every two steps, sizes differing by at most one), rebalanced when requests leave; without
    it every running request is offered to every step, starting one place later each time."""
    from services.verifier.worker import _Entry

    def worker(overlap):
        w = VerifierWorker(FakeEngine(), verifier_info(400, epoch=new_epoch()),
                           VerifierWorkerConfig(drafter_endpoint="none", engine=EngineConfig(overlap=overlap)))
        for rid in "abcde":
            w._running[rid] = _Entry(b"", gen(rid), 0.0, "dartree-pruned")
            w._order.append(rid)
        return w

    plain = worker(False)
    assert plain._schedule() == list("abcde") and plain._schedule() == list("bcdea")
    w = worker(True)
    for _ in range(3):
        g1, g2 = w._schedule(), w._schedule()
        assert set(g1) | set(g2) == set("abcde") and not set(g1) & set(g2)
        assert abs(len(g1) - len(g2)) <= 1
    for rid in [r for r in "abcde" if w._groups.group[r] == 0]:
        w._drop(rid)  # a whole group finishes: the rest must be split again
    g1, g2 = w._schedule(), w._schedule()
    assert g1 and g2 and not set(g1) & set(g2) and set(g1) | set(g2) == set(w._running)
    w._running["p"] = _Entry(b"", gen("p"), 0.0, "ar")  # plain decoding drafts nothing: every step
    w._order.append("p")
    g1, g2 = w._schedule(), w._schedule()
    assert "p" in g1 and "p" in g2 and (set(g1) - {"p"}) & (set(g2) - {"p"}) == set()

def test_submitted_drafts_are_collected_in_any_order_and_discarded_ones_dropped(sockdir):
    """The overlap path over ZMQ: several drafts in flight at once, collected out of order (early
    replies are kept for their collect, not dropped), a ping in between loses none, and a discarded
    draft's late reply is dropped."""
    torch = pytest.importorskip("torch")
    service = FakeDrafterService()
    with running_drafter(sockdir, service) as (worker, io, endpoint):
        client = drafter_client(endpoint)
        client.connect(wait_s=5)
        hs = {rid: client.submit([_job(rid, [7, 8], torch.randn(2, 8), 9, 2 + i, _spec(budget=3), max_depth=2)])[0]
              for i, rid in enumerate(["a", "b", "c", "d"])}
        assert client.ping()
        client.discard(hs.pop("c"))
        for rid in ["d", "a", "b"]:
            tree, timings = client.collect(hs[rid])
            assert tree.num_nodes == 2 and "draft" in timings
        assert [c[0] for c in service.calls] == ["a", "b", "c", "d"]  # the drafter served them in order
        for _ in range(100):  # c's reply arrives (or arrived) and is dropped, never stashed
            client.ping(0.2)
            if not client._pending and not client._stash:
                break
        assert not client._pending and not client._stash
        client.close()


# ------------------------------------------------------------------- drafter heartbeat and drain (issue 17)
def _wait_for(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_drafter_heartbeat_runs_off_the_compute_thread_and_sees_a_hang_and_a_drain(sockdir):
    """The heartbeat answers while a draft occupies the drafter's compute loop, says "not ready" while
    the drafter drains, and "not answering" once its socket is silent (a hung process)."""
    torch = pytest.importorskip("torch")
    from services.verifier.remote_drafter import DrafterHeartbeat

    seen: list[tuple[bool, str]] = []
    with running_drafter(sockdir, FakeDrafterService(hang_s=1.5)) as (worker, io, endpoint):
        ctx = zmq.Context()
        hb = DrafterHeartbeat(endpoint, ctx, interval_s=0.1, timeout_s=0.3,
                              on_result=lambda ok, d: seen.append((ok, d)))
        hb.start()
        client = drafter_client(endpoint)
        client.connect(wait_s=5)
        box = {}
        t = threading.Thread(target=lambda: box.update(r=_draft(client, "r", [1], torch.zeros(1, 8), 1, 1, _spec())))
        t.start()  # the compute loop is busy for 1.5 s
        time.sleep(0.5)
        n = len(seen)
        assert _wait_for(lambda: len(seen) > n + 2) and all(ok for ok, _ in seen[n:])
        t.join(5)
        worker.begin_drain(60)
        assert _wait_for(lambda: seen[-1] == (False, "the drafter is draining"))
        io.close()  # nothing answers any more
        assert _wait_for(lambda: not seen[-1][0] and "did not answer 2 pings" in seen[-1][1])
        hb.close()
        client.close()
        ctx.destroy(linger=0)


def test_a_draining_drafter_serves_until_no_request_needs_it(sockdir, monkeypatch):
    torch = pytest.importorskip("torch")
    import services.drafter.worker as dw

    monkeypatch.setattr(dw, "DRAIN_IDLE_S", 0.3)
    service = FakeDrafterService()
    ctx = zmq.Context()
    endpoint = f"ipc://{sockdir}/drafter.sock"
    from pathlib import Path

    transport = FrameTransport()
    worker = DrafterWorker(service, drafter_info(service, Path(sockdir), new_epoch(), "cpu", transport), transport)
    io = ServerIO(ctx, endpoint, "drafter", on_message=worker.on_io_message, inbox=worker.inbox)
    worker.send = io.send
    io.start()
    stop = threading.Event()
    loop = threading.Thread(target=worker.event_loop, args=(stop,), daemon=True)
    loop.start()
    client = drafter_client(endpoint)
    client.connect(wait_s=5)
    _draft(client, "r", [1], torch.zeros(1, 8), 1, 1, _spec())
    worker.begin_drain(60)
    time.sleep(0.6)
    assert loop.is_alive()  # a request still holds a context: keep serving it
    tree, _ = _draft(client, "r", [2], torch.zeros(1, 8), 2, 2, _spec())
    assert tree.draft_tokens.numel() > 0
    assert not client.ping()  # "not ready" while draining: no new request is admitted
    client.release("r")
    loop.join(5)
    assert not loop.is_alive()  # no context, no draft for DRAIN_IDLE_S: done
    client.close()
    io.close()
    ctx.destroy(linger=0)


def test_draft_batch_over_zmq_one_message_one_reply_per_job(sockdir):
    """``submit`` sends one DraftBatch; the drafter drafts the jobs in one
    ``draft_batch`` call and answers each job on its own, a failing job with its own error."""
    torch = pytest.importorskip("torch")
    from services.verifier.remote_drafter import DrafterError

    service = FakeDrafterService(fail_ids=("bad",))
    with running_drafter(sockdir, service) as (worker, io, endpoint):
        client = drafter_client(endpoint)
        client.connect(wait_s=5)
        jobs = [_job(rid, [7, 8], torch.randn(2, 8), 9 + i, 2, _spec(budget=2 + i), max_depth=3)
                for i, rid in enumerate(["a", "bad", "c"])]
        handles = client.submit(jobs)
        assert client.collect(handles[2])[0].draft_tokens.tolist() == [12, 13, 14]
        with pytest.raises(DrafterError, match="scripted failure of bad"):
            client.collect(handles[1])
        assert client.collect(handles[0])[0].draft_tokens.tolist() == [10, 11]
        assert service.batches == [["a", "bad", "c"]]
        assert worker.metrics.registry.get_sample_value("dartree_drafter_batch_jobs_sum") == 3
        client.close()


@pytest.mark.parametrize("setting, device, cores, want", [
    (0, "cpu", 2, 1), (0, "cpu", 1, 1), (0, "cpu", None, 1), (0, "cpu", 16, 8), (0, "cpu", 3, 1),
    (3, "cpu", 2, 3), (0, "cuda", 16, None), (0, "cuda:1", 2, None), (2, "cuda", 16, 2)])
def test_drafter_threads_auto_and_explicit(setting, device, cores, want):
    from services.drafter.worker import drafter_threads

    assert drafter_threads(setting, device, cores) == want


def test_drafter_verdicts_keep_the_verifier_ready_and_reach_engine_and_gauge():
    """The heartbeat's "not answering" leaves the verifier ready with the reason in its status, turns
    the engine's drafting off and the gauge to 0; "answering" turns both back; no drafter: gauge 0."""
    from services.metrics import DRAFTER_UP

    def gauge(worker) -> float:
        return worker.metrics.registry.get_sample_value(DRAFTER_UP)

    engine = FakeEngine()
    worker = VerifierWorker(engine, verifier_info(400, epoch=new_epoch()), VerifierWorkerConfig(), drafter_ping=lambda: True)
    assert gauge(worker) == 1 and worker.status().ready and worker.status().detail == ""
    worker.on_drafter_heartbeat(False, "the drafter did not answer 2 pings within 1 s each")
    pong = worker.status()
    assert pong.ready and pong.detail == "decoding without speculation: the drafter did not answer 2 pings within 1 s each"
    assert gauge(worker) == 0 and engine.drafter_up == [False]
    worker.on_drafter_heartbeat(True, "")
    assert worker.status().detail == "" and gauge(worker) == 1 and engine.drafter_up == [False, True]
    alone = VerifierWorker(FakeEngine(), verifier_info(400, epoch=new_epoch()), VerifierWorkerConfig())
    assert gauge(alone) == 0
