"""On a CPU without native bfloat16 GEMMs the drafter runs in float32 next to a bfloat16 / q4 target
(services.weights.drafter_dtype).

There a bfloat16 drafter cost 2.4-2.7x a float32 one per round (94 vs 36 ms at B = 8 on an AVX2-only
VM, more than a whole q4 ``ar`` step). With native bf16 (AVX-512-bf16 / AMX) and on CUDA it keeps
the activations' dtype. The tests pin the CPU's answer with a monkeypatch.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from services import cpu_gemm
from services.weights import drafter_dtype
from tests.service.tiny import make_tiny_models


@pytest.fixture
def no_native_bf16(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "onednn_bf16_available", lambda: False)


@pytest.mark.parametrize("native_bf16", [False, True])
def test_drafter_dtype_is_float32_on_a_cpu_without_native_bf16_else_the_activations(monkeypatch, native_bf16):
    monkeypatch.setattr(cpu_gemm, "onednn_bf16_available", lambda: native_bf16)
    assert drafter_dtype(torch.float32, "cpu") is torch.float32
    assert drafter_dtype(torch.bfloat16, "cpu") is (torch.bfloat16 if native_bf16 else torch.float32)
    for act in (torch.float32, torch.bfloat16):
        assert drafter_dtype(act, "cuda") is act
        assert drafter_dtype(act, "cuda:1") is act


def test_serve_plans_a_float32_drafter_worker_next_to_a_bfloat16_target(tmp_path, monkeypatch, no_native_bf16):
    from services.serve import add_serve_args
    from services.serve_plan import plan

    target, drafter = make_tiny_models(tmp_path)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--target", str(target), "--drafter", str(drafter), "--weights", "bfloat16",
                              "--port", "18431", "--verifier-metrics-port", "18432",
                              "--drafter-metrics-port", "18433"])
    _sup, _gw, verifier, dcfg, rt = plan(args)
    try:
        assert verifier.dtype == "bfloat16" and dcfg.dtype == "float32"
    finally:
        if rt is not None:
            import shutil

            shutil.rmtree(rt, ignore_errors=True)


def test_inprocess_engine_runs_a_float32_drafter_on_float32_copies_of_the_target_io(tmp_path, no_native_bf16):
    from services.generate import build_inprocess
    from services.params import SamplingParams, SpecParams

    target, drafter = make_tiny_models(tmp_path)
    engine, _tok, _note = build_inprocess(str(target), str(drafter), torch.bfloat16, weights="bfloat16")
    svc = engine.drafter.service
    assert next(svc.drafter.parameters()).dtype is torch.float32
    assert svc.embed.weight.dtype is torch.float32 and svc.lm_head.weight.dtype is torch.float32
    assert engine.target.embed_tokens().weight.dtype is torch.bfloat16  # the target itself is untouched
    out = list(engine.generate("r", [1, 2, 3, 4], SamplingParams(max_tokens=8), SpecParams("dartree-pruned",
                                                                                           budget=4)))
    assert sum(len(o.token_ids) for o in out) == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_borrowed_io_is_shared_when_the_dtypes_agree_and_equal_copies_otherwise(dtype):
    from services.drafter.build import borrow_target_io

    emb = torch.nn.Embedding(10, 4).to(torch.bfloat16)
    head = torch.nn.Linear(4, 10, bias=False).to(torch.bfloat16)
    e, h = borrow_target_io(emb, head, dtype)
    if dtype is torch.bfloat16:
        assert e is emb and h is head
    else:
        assert e.weight.dtype is dtype and h.weight.dtype is dtype
        assert torch.equal(e.weight, emb.weight.float()) and torch.equal(h.weight, head.weight.float())
        assert not e.weight.requires_grad and not h.weight.requires_grad
