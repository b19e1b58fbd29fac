"""Compiled steps built off the critical path (services/verifier/compile_swap.py): the server starts
on the eager step, swaps the compiled one in only while no request runs, keeps serving eagerly after
a failed build (one log line), and a later start loads the steps from inductor's disk cache."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from torch._dynamo.utils import counters

from services import protocol as p
from services.testing import tiny_target
from services.verifier import compile_swap, warm_steps
from services.verifier.build import build_engine
from services.verifier.config import EngineConfig, VerifierWorkerConfig
from services.verifier.worker import VerifierWorker
from tests.service.fakes import verifier_info

V = 128
PROMPT = [5, 9, 17, 33, 2, 40, 7]


@pytest.fixture
def inductor_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return tmp_path / "inductor"


def _target():
    return tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2, max_position_embeddings=256)


def _engine(target):
    return build_engine(target, None, EngineConfig(max_running=2, compile=True), policy="fixed", cost_sweep=False,
                        compile_off_path=True)


class _Built:
    """A background build that reports success once ``done`` is set (the swap then loads, or here
    compiles, the steps in this process)."""

    def __init__(self):
        self.done, self.closed, self.started = False, False, time.monotonic()

    def poll(self):
        return ("ok", 0.0, 0) if self.done else None

    def close(self):
        self.closed = True


def _explode(job):
    """An injected compile failure (the child's entry)."""
    raise RuntimeError("injected compile failure\nsecond line that must not reach the log")


def _worker(engine, swap, sent):
    config = VerifierWorkerConfig(engine=EngineConfig(max_running=2))
    return VerifierWorker(engine, verifier_info(V), config, send=lambda ident, msg: sent.append(msg), step_swap=swap)


def _generate(rid: str, n: int) -> p.Generate:
    return p.Generate(rid, PROMPT, p.SamplingParams(max_tokens=n, ignore_eos=True), p.SpecParams("ar"))


def _drain(worker) -> None:
    """Run the worker until what was posted has finished."""
    worker.run_once(idle_timeout=0)
    while worker._has_work():
        worker.run_once(idle_timeout=0)


def _tokens(sent, rid: str) -> list[int]:
    return [t for m in sent if isinstance(m, p.RoundChunk) and m.request_id == rid for t in m.token_ids]


def test_in_flight_requests_finish_on_eager_and_new_ones_run_compiled(inductor_dir):
    """A request that started on the eager step finishes on it with the eager tokens; a request
    arriving once the compiled step is ready waits for it to finish (bounded), then runs compiled;
    the eager step's cached prefixes are dropped at the swap; a later start loads the steps from
    inductor's disk cache (no graph compiled) instead of deferring them."""
    engine = _engine(_target())
    runner = engine.runner
    assert not runner.compiled and runner.deferred_rows == (1, 2)
    sent: list = []
    built = _Built()
    swap = compile_swap.StepSwap(runner, built, warm_steps.steps_key(runner.target, runner.deferred_rows),
                                 hold_s=600)
    worker = _worker(engine, swap, sent)
    kinds: dict[str, set[bool]] = {}  # request id -> step kinds (compiled?) it ran on
    step = engine.step

    def recording_step(plan):
        for rid in worker._running:
            kinds.setdefault(rid, set()).add(runner.compiled)
        return step(plan)

    engine.step = recording_step
    worker.post(b"g", _generate("alone", 12))  # the eager reference
    _drain(worker)
    worker.post(b"g", _generate("inflight", 12))
    for _ in range(3):
        worker.run_once(idle_timeout=0)
    assert "inflight" in worker._running
    built.done = True  # the compiled step is ready while "inflight" runs
    worker.post(b"g", _generate("after", 12))
    while "inflight" in worker._running:
        worker.run_once(idle_timeout=0)
        assert not runner.compiled and "after" not in worker._running  # held until "inflight" finished
    worker.run_once(idle_timeout=0)
    assert runner.compiled and swap.state == "compiled" and len(runner.cache.prefix) == 0
    assert worker.metrics.registry.get_sample_value("dartree_compiled_step") == 1 and worker.status().detail == ""
    _drain(worker)
    assert kinds == {"alone": {False}, "inflight": {False}, "after": {True}}
    assert _tokens(sent, "inflight") == _tokens(sent, "alone") and len(_tokens(sent, "alone")) == 12
    assert len(_tokens(sent, "after")) == 12
    assert warm_steps.cache_is_warm(swap.key)
    # a restart: the steps are warm on disk, so they load at start (no compile, nothing deferred)
    before = int(counters["inductor"]["fxgraph_cache_miss"])
    again = _engine(_target())
    assert again.runner.compiled and again.runner.deferred_rows is None
    assert int(counters["inductor"]["fxgraph_cache_miss"]) == before


def test_a_failed_background_compile_leaves_the_eager_step_with_one_log_line(inductor_dir, caplog):
    """The child's compile raises: one warning line (no traceback), the eager step serves on and
    its requests complete; the readiness detail says why; the child's output is in compile.log."""
    engine = _engine(_target())
    rows = engine.runner.deferred_rows
    job = compile_swap.CompileJob(VerifierWorkerConfig(), None, rows, None, 1)
    build = compile_swap.BackgroundCompile(job, entry=_explode)
    swap = compile_swap.StepSwap(engine.runner, build, warm_steps.steps_key(engine.runner.target, rows))
    sent: list = []
    worker = _worker(engine, swap, sent)
    caplog.set_level(logging.INFO, logger="verifier")
    deadline = time.monotonic() + 300
    while swap.state == "compiling" and time.monotonic() < deadline:
        worker.run_once(idle_timeout=0.2)
    lines = [r for r in caplog.records if r.name == "verifier" and r.levelno >= logging.WARNING]
    assert swap.state == "eager" and len(lines) == 1 and lines[0].exc_info is None
    assert "injected compile failure" in lines[0].getMessage() and "second line" not in lines[0].getMessage()
    assert "injected compile failure" in (inductor_dir / compile_swap.CHILD_LOG).read_text()
    assert "compiled step could not be built" in worker.status().detail
    worker.post(b"g", _generate("r", 5))
    _drain(worker)
    assert len(_tokens(sent, "r")) == 5 and not engine.runner.compiled
    assert not warm_steps.cache_is_warm(swap.key)  # not remembered: the next start tries again


def test_a_failed_load_at_the_swap_leaves_the_runner_eager(inductor_dir, caplog, monkeypatch):
    """The child succeeded but loading the compiled step in the verifier fails: the runner is eager
    as before (same tokens as before the attempt), one warning line, the warm record dropped."""
    engine = _engine(_target())
    runner = engine.runner
    sent: list = []
    built = _Built()
    swap = compile_swap.StepSwap(runner, built, warm_steps.steps_key(runner.target, runner.deferred_rows))
    warm_steps.remember_warm(swap.key, 1.0)
    worker = _worker(engine, swap, sent)
    worker.post(b"g", _generate("before", 8))
    _drain(worker)

    def broken(rows):
        raise RuntimeError("injected load failure")

    monkeypatch.setattr(runner, "warm_up", broken)
    caplog.set_level(logging.INFO, logger="verifier")
    built.done = True
    worker.run_once(idle_timeout=0)
    lines = [r for r in caplog.records if r.name == "verifier" and r.levelno >= logging.WARNING]
    assert swap.state == "eager" and len(lines) == 1 and "injected load failure" in lines[0].getMessage()
    assert not runner.compiled and runner.lean is not None and not runner.lean.compiled
    assert not warm_steps.cache_is_warm(swap.key)
    worker.post(b"g", _generate("after", 8))
    _drain(worker)
    assert _tokens(sent, "after") == _tokens(sent, "before")


def test_the_goodput_cost_model_is_swept_again_on_the_compiled_step(inductor_dir, caplog, monkeypatch):
    """The goodput policy's start-up sweep timed the eager step; at the swap its forward model is
    timed again on the compiled step (every row count again, under the compiled step's own cache
    key, each forward with logits for all its rows) and replaces the eager samples."""
    from services.verifier import build

    engine = build_engine(_target(), None, EngineConfig(max_running=2, compile=True), policy="goodput",
                          max_budget=3, compile_off_path=True)
    runner, cost = engine.runner, engine.policy.cost
    assert not runner.compiled and cost.resweep is not None
    timed: list[tuple[bool, int, bool]] = []  # (compiled?, rows, every row's logits?)
    execute = runner.execute

    def recording_execute(segments, *args, **kwargs):
        timed.append((runner.compiled, segments[0].num_rows, not args and kwargs.get("logit_rows") is None))
        return execute(segments, *args, **kwargs)

    monkeypatch.setattr(runner, "execute", recording_execute)
    cost._table[1] = 123.0  # an eager sample the compiled sweep must replace
    eager_key = build.sweep_key("m", "q4", "cpu", runner)
    built = _Built()
    swap = compile_swap.StepSwap(runner, built, warm_steps.steps_key(runner.target, runner.deferred_rows))
    caplog.set_level(logging.INFO, logger="verifier")
    built.done = True
    assert swap.tick(engine, 0) and runner.compiled
    swept = {rows for compiled, rows, all_rows in timed if compiled and all_rows}
    assert swept >= {1, 2, 3, 4, 9}  # the warm-up runs 1 and 2 rows only
    assert cost._table.get(1, 0.0) < 1.0 and set(cost._seed) >= {1, 2, 3, 4}
    assert any("step cost model of the compiled step" in r.getMessage() for r in caplog.records)
    assert build.sweep_key("m", "q4", "cpu", runner) != eager_key


def test_admissions_are_held_at_most_hold_s():
    """Once the compiled step is ready, new requests wait for the running ones only ``hold_s``."""
    swap = compile_swap.StepSwap(runner=None, build=_Built(), key="k", hold_s=0.2)
    assert not swap.holds_admissions(1)  # still compiling: nothing held
    swap.state = "ready"
    assert swap.holds_admissions(1) and not swap.holds_admissions(0)
    assert swap.holds_admissions(1)
    time.sleep(0.25)
    assert not swap.holds_admissions(1)


@pytest.mark.slow
def test_a_restart_loads_what_the_child_compiled(tmp_path, monkeypatch):
    """The real child compiles the steps to disk; the verifier's swap then compiles none
    (``compiled_cold`` == 0 in a fresh process over the same cache)."""
    from types import SimpleNamespace

    from services.verifier.worker import compiled_cold

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    from tests.service.tiny import make_tiny_models

    target_dir, _ = make_tiny_models(tmp_path / "models")
    config = VerifierWorkerConfig(target=str(target_dir), weights="float32",
                                  engine=EngineConfig(max_context=0, max_running=2, compile=True))
    job = compile_swap.CompileJob(config, None, (1, 2), None, torch.get_num_threads())
    build = compile_swap.BackgroundCompile(job)
    while (msg := build.poll()) is None:
        time.sleep(0.5)
    assert msg[0] == "ok" and msg[2] > 0, msg
    from services.verifier.build import load_target, make_runner

    target, _ = load_target(config, None)
    runner = make_runner(target, EngineConfig(max_running=2, compile=False))
    counters.clear()
    runner.use_compiled((1, 2))
    assert runner.compiled and compiled_cold(SimpleNamespace(runner=runner)) == 0
