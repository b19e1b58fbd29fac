"""The verifier worker hands freed heap back once each time its request table empties after a step
and stays empty for ``release_idle_s`` (glibc keeps a load's freed heap pages resident otherwise),
never while requests run and not between back-to-back requests."""

from __future__ import annotations

import dataclasses

from services import protocol as p
from services.verifier.worker import VerifierWorker, VerifierWorkerConfig
from tests.doubles import FakeEngine

from .fakes import verifier_info


def _worker(engine, idle_s: float = 0.0):
    calls, sent = [], []
    worker = VerifierWorker(engine, verifier_info(400), VerifierWorkerConfig(),
                            send=lambda identity, msg: sent.append(msg),
                            release_memory=lambda: calls.append(len(worker._running) + len(worker._waiting)),
                            release_idle_s=idle_s)
    return worker, calls, sent


def _gen(rid: str) -> p.Generate:
    return p.Generate(rid, [5, 6], p.SamplingParams(max_tokens=16), p.SpecParams())


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


def test_a_request_within_the_idle_delay_cancels_the_release():
    engine = FakeEngine(rounds=[[5], [6]])
    worker, calls, _ = _worker(engine, idle_s=0.3)
    worker.post(b"a", _gen("a"))
    for _ in range(5):
        worker.run_once(idle_timeout=0.01)
    assert not worker._has_work() and calls == []  # idle, but not for 0.3 s yet
    worker.post(b"b", _gen("b"))  # back to back: no release in between
    for _ in range(5):
        worker.run_once(idle_timeout=0.01)
    assert calls == []
    for _ in range(60):
        worker.run_once(idle_timeout=0.01)
        if calls:
            break
    assert calls == [0]  # once, after 0.3 s idle


class _PrefillEngine(FakeEngine):
    """A step that runs a request's first round (its prefill) reports prompt-chunk rows."""

    def step_batch(self, request_ids):
        first = sum(self.active.get(rid) == 0 for rid in request_ids)
        out = super().step_batch(request_ids)
        self.last_step = dataclasses.replace(self.last_step, prefill_tokens=64 * first)
        return out


def test_memory_is_released_after_each_prefill_step_only():
    engine = _PrefillEngine(rounds=[[5], [6], [7], [8]])
    worker, calls, _ = _worker(engine, idle_s=60.0)  # the idle release stays out of the way
    worker.post(b"a", _gen("a"))
    worker.post(b"b", _gen("b"))
    worker.run_once(idle_timeout=0.01)  # both prefill
    assert calls == [2]  # after the step, both requests still running
    for _ in range(2):
        worker.run_once(idle_timeout=0.01)  # decode-only steps
    assert calls == [2]
    worker.post(b"c", _gen("c"))
    worker.run_once(idle_timeout=0.01)  # a and b finish, c prefills
    assert calls == [2, 1]
    worker.run_once(idle_timeout=0.01)
    assert calls == [2, 1]
