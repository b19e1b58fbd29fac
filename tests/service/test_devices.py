"""Device strings normalised once (``cuda`` -> ``cuda:N``), the worker's device bound, and the goodput
cost sweep on a GPU machine: CUDA-event timing, rows up to B + 1, no CPU-share judge on CUDA; on CPU
the share counts the threads the step can really run on. ``torch.cuda`` is a stand-in here."""

from __future__ import annotations

import pytest

from services import timing
from services.devices import bind_device, cuda_event_seconds, normalize_device
from services.verifier.cost_model import (SWEEP_ROWS, load_cached, rule_curve, save_cached, startup_sweep,
                                          sweep_rows)


class FakeCuda:
    """What :mod:`services.devices` calls of ``torch.cuda``: ``count`` devices, ``current`` the
    current one once CUDA is initialised."""

    def __init__(self, count: int = 2, current: int = 1, initialized: bool = False):
        self.count, self.current, self.initialized = count, current, initialized
        self.set_to: list[int] = []

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def is_initialized(self) -> bool:
        return self.initialized

    def current_device(self) -> int:
        assert self.initialized, "querying the current device initialises CUDA"
        return self.current

    def set_device(self, index: int) -> None:
        self.set_to.append(index)


class NoCudaAccess:
    def __getattr__(self, name):
        raise AssertionError(f"torch.cuda.{name} touched for a CPU device")


# ------------------------------------------------------------------------------------- device strings

def test_cuda_without_an_index_is_the_current_device():
    assert normalize_device("cuda", FakeCuda()) == "cuda:0"  # a fresh process: device 0, no CUDA context made
    assert normalize_device("cuda", FakeCuda(current=1, initialized=True)) == "cuda:1"
    assert normalize_device("cuda:1", FakeCuda()) == "cuda:1"
    assert normalize_device("cpu", NoCudaAccess()) == "cpu"


def test_bad_devices_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--device cuda:2: only 2 CUDA device\(s\) are visible"):
        normalize_device("cuda:2", FakeCuda(count=2))
    with pytest.raises(ValueError, match="--device cuda: this torch sees no CUDA device; use --device cpu"):
        normalize_device("cuda", FakeCuda(count=0))
    with pytest.raises(ValueError, match="not supported"):
        normalize_device("gpu", FakeCuda())


def test_bind_device_sets_the_normalised_device():
    cuda = FakeCuda()
    assert bind_device("cuda", cuda) == "cuda:0" and cuda.set_to == [0]
    assert bind_device("cuda:1", cuda) == "cuda:1" and cuda.set_to == [0, 1]
    assert bind_device("cpu", NoCudaAccess()) == "cpu"


def test_cuda_event_seconds_reads_the_events_not_the_host_clock():
    class Event:
        clock = [0.0]

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = Event.clock[0]

        def synchronize(self):
            assert self.at is not None

        def elapsed_time(self, other):  # milliseconds, as torch's
            return other.at - self.at

    class Cuda:
        pass

    cuda = Cuda()
    cuda.Event = Event

    def work():
        Event.clock[0] += 12.5  # the device ran 12.5 ms of kernels
        return "out"

    assert cuda_event_seconds(work, cuda) == (pytest.approx(0.0125), "out")


# ----------------------------------------------------------------------------------------- cost sweep

def test_sweep_rows_reach_b_plus_one():
    assert sweep_rows(8) == SWEEP_ROWS and sweep_rows(32) == SWEEP_ROWS
    assert sweep_rows(64) == (1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 33, 65)
    assert sweep_rows(100) == SWEEP_ROWS + (65, 101)
    assert sweep_rows(256) == SWEEP_ROWS + (65, 129, 257)
    with pytest.raises(ValueError):
        sweep_rows(0)


@pytest.fixture
def sixteen_threads(monkeypatch):
    """A 16-CPU machine without a CPU quota; the fake clock's CPU seconds = wall x ``busy[0]``."""
    monkeypatch.setattr(timing.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(timing, "cpu_quota", lambda: None)
    busy = [1.0]
    clock = [0.0]

    def wall():
        clock[0] += 0.001
        return clock[0]

    monkeypatch.setattr(timing, "wall_seconds", wall)
    monkeypatch.setattr(timing, "cpu_seconds", lambda: clock[0] * busy[0])
    return busy


def gpu_forward(rows: int) -> float:
    return 0.010 + 0.00002 * rows  # 65 rows: 1.13 one-row steps


def test_a_cuda_sweep_on_a_16_thread_machine_is_not_judged_by_the_cpu_share(tmp_path, sixteen_threads):
    """One host thread launches and waits: 1/16 of the threads' CPU time. On CUDA that is no sign of
    a busy machine: the sweep is accepted, cached, and covers 65 rows; the same timings judged as
    a CPU sweep are rejected by the share rule (what every GPU start got before)."""
    path, rows = tmp_path / "c.json", sweep_rows(64)
    sixteen_threads[0] = 1.0
    samples, source = startup_sweep(gpu_forward, "gpu", "bfloat16", path=path, rows=rows, threads=16, device="cuda:0")
    assert source == "sweep" and [r for r, _ in samples] == list(rows)
    assert dict(samples)[65] == pytest.approx(gpu_forward(65)) and load_cached("gpu", path) == samples
    samples, source = startup_sweep(gpu_forward, "cpu", "bfloat16", path=path, rows=rows, threads=16, device="cpu")
    assert "got 6% of 16 thread(s)' CPU time" in source and load_cached("cpu", path) is None


def test_a_cpu_share_counts_the_threads_the_quota_lets_the_step_use(tmp_path, sixteen_threads, monkeypatch):
    """A container with a 2-CPU quota on a 16-CPU host, torch at 16 threads: 2 CPU seconds a second
    is all of it (accepted); 1 a second is half of it (another process: rejected)."""
    monkeypatch.setattr(timing, "cpu_quota", lambda: 2.0)
    assert timing.usable_threads(16) == 2
    sixteen_threads[0] = 2.0
    _, source = startup_sweep(gpu_forward, "k2", "q4", path=tmp_path / "c.json", threads=16)
    assert source == "sweep"
    sixteen_threads[0] = 1.0
    _, source = startup_sweep(gpu_forward, "k1", "q4", path=tmp_path / "c.json", threads=16)
    assert "got 50% of 2 thread(s)' CPU time" in source


def test_cgroup_quota_is_read_from_cpu_max(tmp_path, monkeypatch):
    v2 = tmp_path / "cpu.max"
    monkeypatch.setattr(timing, "CGROUP_CPU_MAX", (str(v2), (str(tmp_path / "q"), str(tmp_path / "p"))))
    v2.write_text("250000 100000\n")
    assert timing.cgroup_cpu_quota() == 2.5
    v2.write_text("max 100000\n")
    assert timing.cgroup_cpu_quota() is None
    v2.unlink()
    (tmp_path / "q").write_text("-1\n")
    (tmp_path / "p").write_text("100000\n")
    assert timing.cgroup_cpu_quota() is None
    (tmp_path / "q").write_text("300000\n")
    assert timing.cgroup_cpu_quota() == 3.0


def test_a_cached_sweep_that_stops_short_of_b_plus_one_is_taken_again(tmp_path, sixteen_threads):
    path = tmp_path / "c.json"
    save_cached("gpu", [(r, gpu_forward(r)) for r in SWEEP_ROWS], path)  # an older start: up to 33 rows
    calls = []

    def run(rows):
        calls.append(rows)
        return gpu_forward(rows)

    samples, source = startup_sweep(run, "gpu", "bfloat16", path=path, rows=sweep_rows(64), device="cuda:0")
    assert source == "cached sweep stops at 33 rows, short of 65; sweep" and 65 in calls and dict(samples)[65] == pytest.approx(gpu_forward(65))


def test_the_cuda_rule_curve_prices_a_65_row_verify_near_one_step():
    cuda = dict(rule_curve(0.010, "bfloat16", sweep_rows(64), device="cuda:0"))
    cpu = dict(rule_curve(0.010, "bfloat16", sweep_rows(64)))
    assert cuda[65] == pytest.approx(0.010 * 1.096) and cpu[65] == pytest.approx(0.010 * 2.92)


@pytest.mark.gpu
def test_a_cuda_ipc_pool_built_for_bare_cuda_sends_through_its_slots():
    """``--device cuda`` used to make a pool on ``torch.device("cuda")``, which a tensor on ``cuda:0``
    never equals: every tensor went out as a host frame."""
    import torch

    from services.ipc_pool import CudaIpcTransport

    t = CudaIpcTransport("cuda", num_slots=2, slot_bytes=4096)
    assert str(t.device) == normalize_device("cuda")
    t._send_via_pool = True  # as after a handshake with a peer that maps pools (another process)
    metas, frames = t.pack([torch.ones(4, device="cuda")])
    assert metas[0].slot == 0 and frames == []


def test_serve_plans_every_worker_on_cuda_with_its_index(tmp_path, monkeypatch):
    """``dartree serve --device cuda``: the supervisor normalises the flag once, so the verifier's and
    the drafter's configs (and so their CUDA-IPC pools) name ``cuda:0``."""
    import argparse
    import shutil

    import torch

    from services import devices
    from services.serve import add_serve_args
    from services.serve_plan import plan

    from .tiny import make_tiny_models

    target, drafter = make_tiny_models(tmp_path)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    for name in ("DARTREE_DRAFTER_PLACEMENT", "DARTREE_OVERLAP", "DARTREE_DRAFTER_ENDPOINT", "DARTREE_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(devices, "_torch_cuda", lambda: FakeCuda(count=1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the preflight's own check
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--target", str(target), "--drafter", str(drafter), "--weights", "float32",
                              "--device", "cuda", "--port", "18451", "--verifier-metrics-port", "18452",
                              "--drafter-metrics-port", "18453"])
    sup, _gateway, verifier, drafter_cfg, rt = plan(args)
    if rt is not None:
        shutil.rmtree(rt, ignore_errors=True)
    assert verifier.device == drafter_cfg.device == "cuda:0" and sup.drafter_placement == "process"
    assert verifier.engine.max_running is None  # planned by the verifier from the device's memory
