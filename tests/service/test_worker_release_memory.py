"""The verifier worker hands freed heap back once each time its request table empties after a step
(glibc keeps a load's freed heap pages resident otherwise), never while requests run."""

from __future__ import annotations

from services import protocol as p
from services.verifier.worker import VerifierWorker, VerifierWorkerConfig
from tests.doubles import FakeEngine

from .fakes import fake_params, verifier_info


def _worker(engine):
    calls, sent = [], []
    worker = VerifierWorker(engine, verifier_info(400), VerifierWorkerConfig(), params=fake_params,
                            send=lambda identity, msg: sent.append(msg),
                            release_memory=lambda: calls.append(len(worker._running) + len(worker._waiting)))
    return worker, calls, sent


def _gen(rid: str) -> p.Generate:
    return p.Generate(rid, [5, 6], p.SamplingSpec(max_tokens=16), p.SpecSpec())


def test_memory_is_released_once_when_the_last_request_leaves():
    engine = FakeEngine(rounds=[[5], [6, 7], [8]])
    worker, calls, sent = _worker(engine)
    worker.post(b"a", _gen("a"))
    worker.post(b"b", _gen("b"))
    for _ in range(20):
        worker.run_once(idle_timeout=0.01)
        if not calls:
            assert worker._has_work() or not engine.steps  # nothing released while requests run
    assert calls == [0]  # once, with the table empty
    assert sum(1 for m in sent if getattr(m, "finish_reason", None)) == 2
    worker.post(b"c", _gen("c"))
    for _ in range(10):
        worker.run_once(idle_timeout=0.01)
    assert calls == [0, 0]  # the next load empties it again


def test_nothing_is_released_on_idle_iterations():
    worker, calls, _ = _worker(FakeEngine())
    for _ in range(5):
        worker.run_once(idle_timeout=0.01)
    assert calls == []
