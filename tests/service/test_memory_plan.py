"""The GPU memory plan (services/memory_plan.py): literal plans for the paper's targets (Qwen3-4B and
Qwen3-8B shapes from their config.json) on an 80 GiB and a 24 GiB device with injected free memory,
the flags derived or checked, refusals that name the flag, and the verifier's wiring (drafter context
bytes from the handshake, CUDA-IPC rings, the logged block)."""

from __future__ import annotations

import argparse
import logging
from types import SimpleNamespace

import pytest
import torch

from services.config_cli import config_from_args
from services.memory_plan import (SHAPES, MemoryNeeds, TargetShape, drafter_bytes, plan_memory, plan_verifier_memory,
                                  segment_room)
from services.protocol import PeerInfo
from services.verifier.config import EngineConfig, VerifierWorkerConfig

GIB = 2**30
IPC = 2 * 16 * (8 << 20)       # both processes' CUDA-IPC rings at the defaults
PREFIX = 256 * 2**20           # --prefix-cache-mib 256


def needs(name: str) -> MemoryNeeds:
    """A served target with a DFlash-b16-shaped drafter (5 layers at the target's width, 5 tapped layers),
    bfloat16, CUDA graphs on, the default step and prefix-cache settings."""
    t = TargetShape.from_config(SHAPES[name])
    return MemoryNeeds(t, 2, 5 * t.hidden, drafter_bytes(t, 5), segment_room(256), extra_slots=1, step_rows=512,
                       ipc_bytes=IPC, prefix_cache_bytes=PREFIX)


def test_the_shapes_per_position():
    four, eight = (TargetShape.from_config(SHAPES[n]) for n in ("qwen3-4b", "qwen3-8b"))
    assert four.kv_bytes_per_position(2) == eight.kv_bytes_per_position(2) == 36 * 2 * 8 * 128 * 2 == 147_456
    assert four.parameters() == 4_022_468_096 and eight.parameters() == 8_190_735_360  # 4.0B, 8.2B
    assert drafter_bytes(four, 5) == 2 * 8 * 128 * 2 * 6 == 24_576
    assert segment_room(256) == 1025 and segment_room(2048) == 2048


def test_qwen3_4b_on_80_gib():
    p = plan_memory(needs("qwen3-4b"), free=70 * GIB, total=80 * GIB)
    assert (p.max_running, p.max_context, p.slots) == (8, 35840, 9)
    assert p.budget == 62 * GIB
    assert p.parts == {"KV cache": 9 * (35840 + 1025) * 147_456,  # 48,923,688,960
                       "feature history": 9 * 35840 * 5 * 2560 * 2,
                       "drafter contexts": 9 * 35840 * 24_576,
                       "step activations (CUDA graph pool)": 539_099_648,
                       "IPC slots": IPC, "prefix cache": PREFIX}
    assert p.planned() <= p.budget and p.derived == ("--max-running", "--max-context")


def test_padded_steps_plan_their_gathers_and_the_eager_steps_past_the_grid():
    """With CUDA graphs a slot adds one layer's K and V twice (the graph pool's gather and an eager
    step's), and the eager steps past the grid get activations of their own besides the pool."""
    from dataclasses import replace

    plain, padded = needs("qwen3-4b"), replace(needs("qwen3-4b"), padded_steps=True)
    assert plain.per_slot(4096)["padded-step K/V gathers"] == 0
    assert padded.per_slot(4096)["padded-step K/V gathers"] == 2 * (4096 + 1025) * 2 * 8 * 128 * 2
    step = padded.fixed(4096)["step activations (CUDA graph pool)"]
    assert padded.fixed(4096)["eager steps past the graph grid"] == step == plain.fixed(4096)[
        "step activations (CUDA graph pool)"] and plain.fixed(4096)["eager steps past the graph grid"] == 0
    p, q = (plan_memory(n, free=70 * GIB, total=80 * GIB) for n in (plain, padded))
    assert q.max_context < p.max_context and q.planned() <= q.budget


def test_qwen3_4b_on_24_gib_takes_fewer_slots_rather_than_a_short_context():
    p = plan_memory(needs("qwen3-4b"), free=14 * GIB, total=24 * GIB)
    assert (p.max_running, p.max_context, p.slots) == (5, 8192, 6)
    assert p.parts["KV cache"] == 6 * (8192 + 1025) * 147_456 == 8_154_611_712
    assert p.planned() <= p.budget < p.planned() + p.parts["KV cache"] // 6  # a sixth request would not fit


def test_qwen3_8b_on_80_gib():
    p = plan_memory(needs("qwen3-8b"), free=60 * GIB, total=80 * GIB)
    assert (p.max_running, p.max_context, p.slots) == (8, 27648, 9)
    assert p.parts["KV cache"] == 9 * (27648 + 1025) * 147_456 == 38_052_052_992
    assert p.parts["feature history"] == 9 * 27648 * 5 * 4096 * 2


def test_qwen3_8b_on_24_gib_is_refused_then_fits_one_request_at_a_higher_utilization():
    with pytest.raises(ValueError, match=r"not even one request with a 2048-token context fits.*"
                                         r"raise --gpu-memory-utilization"):
        plan_memory(needs("qwen3-8b"), free=4 * GIB, total=24 * GIB)
    p = plan_memory(needs("qwen3-8b"), free=4 * GIB, total=24 * GIB, utilization=0.98)
    assert (p.max_running, p.max_context, p.slots) == (1, 5376, 2)


def test_given_flags_are_checked_and_refusals_name_them():
    n = needs("qwen3-4b")
    p = plan_memory(n, 14 * GIB, 24 * GIB, max_running=2, max_context=16384)  # fits: kept as given
    assert (p.max_running, p.max_context, p.derived) == (2, 16384, ())
    with pytest.raises(ValueError) as e:  # today's default: 8 slots at the full window
        plan_memory(n, 14 * GIB, 24 * GIB, max_running=8, max_context=40960)
    msg = str(e.value)
    assert msg.startswith("--max-running 8 at --max-context 40960 needs 70.12 GiB of device memory, 11.60 GiB are "
                          "left for them (--gpu-memory-utilization 0.9 of 24.00 GiB, 10.00 GiB in use")
    assert msg.endswith("lower --max-context to 5632 (or raise --gpu-memory-utilization)") and "\n" not in msg
    with pytest.raises(ValueError, match=r"^--max-context 40960: one request needs 16.36 GiB .* "
                                         r"lower --max-context to 27904 or less$"):
        plan_memory(n, 14 * GIB, 24 * GIB, max_context=40960)  # with the CUDA-graph scratch slot
    assert plan_memory(n, 14 * GIB, 24 * GIB, max_context=4096).max_running == 8  # derived, at most 8
    assert plan_memory(n, 14 * GIB, 24 * GIB, max_context=16384).max_running == 2
    with pytest.raises(ValueError, match=r"^--max-running 64 leaves room for a context of 0 tokens .* "
                                         r"lower --max-running to 19 or less$"):
        plan_memory(n, 14 * GIB, 24 * GIB, max_running=64)
    assert plan_memory(n, 14 * GIB, 24 * GIB, max_running=2).max_context == 18432
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization must be in \(0, 1\]"):
        plan_memory(n, 14 * GIB, 24 * GIB, utilization=1.5)


def test_the_verifier_plans_from_the_handshake_and_logs_one_block(caplog):
    """The drafter's context bytes come from its handshake; both CUDA-IPC rings, already allocated when
    the plan runs, are added back to the free memory and planned as a part."""
    cfg = SHAPES["qwen3-4b"]
    target = SimpleNamespace(config=SimpleNamespace(to_dict=lambda: dict(cfg)), dtype=torch.bfloat16,
                             feature_dim=5 * 2560, max_context=40960, device="cuda:0")
    drafter = PeerInfo(role="drafter", epoch="e", context_bytes=24_576)
    transport = SimpleNamespace(kind="cuda_ipc", num_slots=16, slot_bytes=8 << 20)
    config = VerifierWorkerConfig(device="cuda:0")
    assert config.engine.max_running is None  # planned on CUDA
    with caplog.at_level(logging.INFO, logger="verifier"):
        p = plan_verifier_memory(config, target, drafter, graphed=True, transport=transport,
                                 probe=lambda dev: (70 * GIB - IPC, 80 * GIB))
    # as test_qwen3_4b_on_80_gib, less the padded steps' gathers and eager activations
    assert (p.max_running, p.max_context) == (8, 34048)
    block = [r.getMessage() for r in caplog.records if "GPU memory plan" in r.getMessage()]
    assert len(block) == 1 and "--max-running 8 (derived), --max-context 34048 (derived), 9 KV slots" in block[0]
    assert "padded-step K/V gathers" in block[0] and "eager steps past the graph grid" in block[0]
    p = plan_verifier_memory(config, target, None, graphed=False, probe=lambda dev: (70 * GIB, 80 * GIB))
    assert "drafter contexts" not in p.parts and "feature history" not in p.parts and p.slots == p.max_running


def test_the_config_flag_and_the_cpu_default():
    assert VerifierWorkerConfig().engine.max_running == 8
    assert VerifierWorkerConfig(engine=EngineConfig(max_running=3)).engine.max_running == 3
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization must be in \(0, 1\] \(got 0.0\)"):
        config_from_args(VerifierWorkerConfig, argparse.Namespace(gpu_memory_utilization=0.0))


def test_the_drafter_reports_its_context_bytes_per_position():
    """What the service reports is what its context buffer holds a position, plus one layer's share
    of the batch scratch (eager)."""
    from services.testing import tiny_service, tiny_target

    service = tiny_service(tiny_target())
    service.append_context("r", torch.randn(8, service.cfg.feature_dim), 8)
    buf = service._ctx["r"]  # [L, 2, Hkv, cap, Dh]
    layers, per_position = buf.shape[0], buf.nbytes // buf.shape[3]
    assert service.info()["context_bytes"] == per_position * (layers + 1) // layers


def test_a_drafter_out_of_memory_is_a_metric_and_a_readiness_detail():
    """A draft that failed for lack of the drafter's device memory ends its request with a
    ``drafter_out_of_memory`` error, counts in the metric, and readiness says so (still ready:
    other requests are served); any other drafter error does neither."""
    from services import protocol as p
    from services.devices import is_out_of_memory
    from services.metrics import DRAFTER_OOM
    from services.verifier.remote_drafter import DrafterError
    from services.verifier.worker import VerifierWorker
    from tests.doubles import FakeEngine

    from .fakes import verifier_info

    oom = DrafterError("drafter: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    engine = FakeEngine(fail_on_step=1, fail_with=oom)
    sent = []
    worker = VerifierWorker(engine, verifier_info(400), VerifierWorkerConfig(),
                            send=lambda identity, msg: sent.append(msg))
    worker.post(b"c", p.Generate("a", [5, 6], p.SamplingParams(max_tokens=4), p.SpecParams()))
    for _ in range(3):
        worker.run_once(idle_timeout=0.01)
    errors = [m for m in sent if isinstance(m, p.RequestError)]
    assert [(e.status, e.code) for e in errors] == [(500, "drafter_out_of_memory")]
    assert worker.metrics.registry.get_sample_value(DRAFTER_OOM) == 1
    pong = worker.status()
    assert pong.ready and pong.detail.startswith("the drafter ran out of device memory 1 time(s) (last: drafter: "
                                                 "OutOfMemoryError: CUDA out of memory.")
    assert is_out_of_memory(MemoryError()) and not is_out_of_memory(DrafterError("drafter: ValueError: bad knob"))


def test_the_drafter_counts_its_out_of_memory_drafts_and_says_so_in_the_reply():
    from services import protocol as p
    from services.devices import is_out_of_memory
    from services.drafter.worker import DrafterWorker
    from services.ipc_pool import FrameTransport
    from services.metrics import DRAFTER_ERRORS, DRAFTER_OUT_OF_MEMORY
    from services.spec import TreeKnobs
    from services.wire import decode, encode
    from tests.doubles import FakeDrafterService

    class OutOfMemoryService(FakeDrafterService):
        def _draft(self, job):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    replies, transport = [], FrameTransport()
    worker = DrafterWorker(OutOfMemoryService(), p.PeerInfo(role="drafter", epoch="d", vocab_size=400), transport,
                           send=lambda identity, msg, frames=(): replies.append(msg))
    metas, frames = transport.pack([torch.ones(2, 8)])
    job = p.DraftRequest("a", 1, [1, 1], metas[0], 2, 2, "dartree-pruned", TreeKnobs(3, 12, -0.2, 64))
    worker.inbox.put((b"v", decode(encode(p.DraftBatch([job]), [bytes(f) for f in frames]))))
    worker.run_once(timeout=1)
    assert [r.error for r in replies] == ["OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    assert is_out_of_memory(replies[0].error)
    reg = worker.metrics.registry
    assert reg.get_sample_value(DRAFTER_OUT_OF_MEMORY) == 1 and reg.get_sample_value(DRAFTER_ERRORS) == 1


def test_the_engine_limits_come_from_the_plan_on_cuda_only(monkeypatch):
    from services import memory_plan
    from services.verifier.build import engine_limits

    cfg = SHAPES["qwen3-4b"]
    target = SimpleNamespace(config=SimpleNamespace(to_dict=lambda: dict(cfg)), dtype=torch.bfloat16,
                             feature_dim=5 * 2560, max_context=40960, device="cuda:0")
    drafter = PeerInfo(role="drafter", epoch="e", context_bytes=24_576)
    assert engine_limits(VerifierWorkerConfig(engine=EngineConfig(max_context=4096, max_running=None)), target, drafter,
                         None, True) == (8, 4096)  # CPU
    monkeypatch.setattr(memory_plan, "device_memory", lambda device: (14 * GIB, 24 * GIB))
    assert engine_limits(VerifierWorkerConfig(device="cuda:0"), target, drafter, None, True) == (5, 8192)
    given = VerifierWorkerConfig(device="cuda:0", engine=EngineConfig(max_running=8, max_context=40960))
    with pytest.raises(ValueError, match=r"^--max-running 8 at --max-context 40960 needs .* lower --max-context to"):
        engine_limits(given, target, drafter, None, True)


def test_an_in_process_drafter_out_of_memory_reads_as_the_drafter_process_error():
    """With the drafter inside the verifier, its out-of-memory error reaches the worker as a drafter
    process's would (a DrafterError naming it: the same error code, metric and readiness detail)."""
    from services.metrics import DRAFTER_OUT_OF_MEMORY, DrafterMetrics
    from services.verifier.drafter_client import InprocDrafterClient
    from services.verifier.remote_drafter import DrafterError

    class OutOfMemoryService:
        def draft_batch(self, jobs):
            return [torch.cuda.OutOfMemoryError("CUDA out of memory.")] * len(jobs)

        def num_contexts(self):
            return 0

    metrics = DrafterMetrics()
    client = InprocDrafterClient(OutOfMemoryService(), metrics)
    (handle,) = client.submit([object()])
    with pytest.raises(DrafterError, match=r"^drafter: OutOfMemoryError: CUDA out of memory\.$"):
        client.collect(handle)
    assert metrics.registry.get_sample_value(DRAFTER_OUT_OF_MEMORY) == 1
