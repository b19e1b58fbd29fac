"""Compiled steps (``EngineConfig(compile=True)``): the same tokens as eager steps.

``slow``: inductor compiles two graphs of the tiny model (a minute or more on 2 cores). Run with
``pytest -m slow tests/engine/test_compile.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.testing import block_logits_one, tiny_drafter, tiny_service, tiny_target
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import EngineConfig, SpecEngine
from tests.engine.test_batched import _run_batched

pytestmark = pytest.mark.slow
V = 128


def _tokens(engine, rid, prompt, method, n=16):
    return [t for o in engine.generate(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                                       SpecParams(method)) for t in o.token_ids]


def test_compiled_steps_equal_eager_steps():
    target = tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2, max_position_embeddings=256)
    service = tiny_service(target, tiny_drafter(target, seed=3, block_size=6))
    eager = SpecEngine(target, InprocDrafterClient(service), EngineConfig(max_running=4), max_draft_depth=5)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, V - 1) for _ in range(rng.randrange(3, 12))] for _ in range(3)]
    ref = {(i, m): _tokens(eager, f"e{i}{m}", p, m) for i, p in enumerate(prompts) for m in ("ar", "dartree-pruned")}
    compiled = SpecEngine(target, InprocDrafterClient(service), EngineConfig(max_running=4, compile=True),
                          max_draft_depth=5)
    assert compiled.runner.compiled and compiled.runner.warm_up((1, 7)) > 0
    for (i, m), want in ref.items():
        assert _tokens(compiled, f"c{i}{m}", prompts[i], m) == want, (i, m)
    # batched steps through the compiled graphs: three requests at once equal each alone
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    got, sizes = _run_batched(compiled, {0: [(f"b{i}", p, sampling, SpecParams("dartree-pruned"))
                                             for i, p in enumerate(prompts)]})
    assert max(sizes) == 3
    assert [got[f"b{i}"] for i in range(3)] == [ref[(i, "dartree-pruned")] for i in range(3)]
    # the reference (HF) paths of the target stay eager and still work after compiled steps
    assert torch.isfinite(target.teacher_forced(prompts[0])[1]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_packed_linears_run_the_pack_as_one_opaque_op(monkeypatch, dtype):
    """Under torch.compile a pre-packed linear (services.cpu_gemm: oneDNN bf16, MKL float32) is the
    opaque op ``dartree::packed_linear``, whose eager body runs the pack: same values as eager, pack
    used (inductor cannot lower either pack; the float32 one used to fail to compile)."""
    from torch import nn

    from services import cpu_gemm

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.SiLU(), nn.Linear(48, 16, bias=False)).to(dtype)
    if dtype == torch.bfloat16:
        if not cpu_gemm.onednn_bf16_available():
            pytest.skip("no oneDNN bf16 on this CPU/build")
        assert cpu_gemm.pack_linears_bf16(model) > 0
        cls = cpu_gemm.OneDNNLinear
    else:
        if not cpu_gemm.packing_available():
            pytest.skip("no MKL packed sgemm")
        assert cpu_gemm.pack_linears(model, [8]) > 0
        cls = cpu_gemm.PackedLinear
    x = torch.randn(5, 32).to(dtype)
    with torch.inference_mode():
        want = model(x)
        calls = []
        real = cls._packed
        monkeypatch.setattr(cls, "_packed", lambda self, a: calls.append(a.shape) or real(self, a))
        torch._dynamo.reset()
        got = torch.compile(model, dynamic=True, fullgraph=True)(x)  # fullgraph: a graph break fails
    assert torch.equal(got, want) and len(calls) == 2


def _traced_ops(num_layers: int) -> int:
    from torch._dynamo.utils import counters

    target = tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=num_layers, max_position_embeddings=256)
    service = tiny_service(target, tiny_drafter(target, seed=3, block_size=6))
    torch._dynamo.reset()
    counters.clear()
    engine = SpecEngine(target, InprocDrafterClient(service), EngineConfig(max_running=2, compile=True),
                        max_draft_depth=5)
    engine.runner.warm_up((1, 7))
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]
    return counters["stats"]["calls_captured"]


def test_compiled_layers_are_traced_once_and_reused(monkeypatch):
    """The HF modules' compiled path (models the lean step does not cover; here the lean step is
    switched off): each decoder layer is a nested compile region: dynamo traces one layer per graph and stamps it
    out for the others (the warm-up of a 30-layer target would otherwise trace 30 copies): four more
    layers add a call site per layer and graph (~2 ops each), not a layer's ~50 ops each (without the
    regions 4 layers captured 780 ops and 2 layers 468). Three graphs: one row, many rows, many rows
    with one logit row."""
    monkeypatch.setenv("DARTREE_LEAN_STEP", "0")
    two = _traced_ops(2)
    assert _traced_ops(6) - two < 0.25 * two


@pytest.mark.parametrize("fmt", ["q4", "bfloat16"])
def test_compiled_steps_are_lossless_per_weight_format(tmp_path, fmt):
    """The 4-bit and oneDNN-bf16 linears inside compiled layer regions (the int4 kernel through
    ``quantized::int4mm_packed_weight_cpu`` with the group size as a tensor, the bf16 pack as an
    opaque op). Compiled bf16 arithmetic is not bitwise eager's (inductor keeps fused intermediates
    in float32), so the reference is the compiled model's own plain decoding: every method, and
    three requests batched, emit exactly the compiled ``ar`` tokens (the one-row graph and the
    many-row graph agree)."""
    from services import cpu_gemm, weights as W
    from services.testing import tiny_gguf_target_dir
    from services.verifier.target import TargetModel

    if fmt == "q4" and not W.int4_kernel_available() or fmt == "bfloat16" and not cpu_gemm.onednn_bf16_available():
        pytest.skip(f"no {fmt} kernels in this torch build / CPU")
    target = TargetModel.from_pretrained(tiny_gguf_target_dir(tmp_path), [0, 1], weights=fmt)
    vocab = target.config.vocab_size
    service = tiny_service(target, tiny_drafter(target, seed=3, block_size=6))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, vocab - 1) for _ in range(rng.randrange(3, 12))] for _ in range(3)]
    torch._dynamo.reset()
    compiled = SpecEngine(target, InprocDrafterClient(service), EngineConfig(max_running=4, compile=True),
                          max_draft_depth=5)
    compiled.runner.warm_up((1, 7))
    ref = {i: _tokens(compiled, f"a{i}", p, "ar") for i, p in enumerate(prompts)}
    for i, p in enumerate(prompts):
        for m in ("dflash", "ddtree", "dartree-pruned"):
            assert _tokens(compiled, f"c{i}{m}", p, m) == ref[i], (i, m)
    got, sizes = _run_batched(compiled, {0: [(f"b{i}", p, SamplingParams(max_tokens=16, ignore_eos=True),
                                              SpecParams("dartree-pruned")) for i, p in enumerate(prompts)]})
    assert max(sizes) == 3 and [got[f"b{i}"] for i in range(3)] == [ref[i] for i in range(3)]


def test_compiled_drafter_block_matches_eager_and_stays_lossless():
    """``DrafterService(compile=True)``: after :meth:`warm_up` no further graph is compiled as contexts
    grow (views of reallocated context buffers) and requests batch; block logits equal eager ones
    within float32 rounding; an engine drafting with it emits exactly plain decoding's tokens for
    every method (T = 0)."""
    import torch._dynamo

    from services.drafter.service import DrafterService

    target = tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2, max_position_embeddings=256)
    drafter = tiny_drafter(target, seed=3, block_size=6)
    eager = DrafterService(drafter, target.embed_tokens(), target.lm_head(), packed_gemm=False)
    comp = DrafterService(drafter, target.embed_tokens(), target.lm_head(), packed_gemm=False, compile=True,
                          context_chunk=8)  # buffers grow (and the batch scratch with them) between calls
    torch._dynamo.reset()
    assert comp.warm_up() > 0 and comp.num_contexts() == 0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(0)
    fdim = drafter.config.feature_dim
    starts = {"a": 0, "b": 0}
    for n_a, n_b in ((20, 9), (3, 1), (1, 5)):
        for rid, n in (("a", n_a), ("b", n_b)):
            feats = torch.randn(n, fdim, generator=g)
            starts[rid] += n
            want = block_logits_one(eager, rid, feats, 7, starts[rid])
            got = block_logits_one(comp, rid, feats, 7, starts[rid])
            torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)
        jobs = [("a", 5, starts["a"]), ("b", 9, starts["b"])]
        for (_, want), (_, got) in zip(eager.block_logits_batch(jobs), comp.block_logits_batch(jobs)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no recompiles after warm-up
    engine = SpecEngine(target, InprocDrafterClient(tiny_service(target, drafter)), EngineConfig(max_running=2),
                        max_draft_depth=5)
    comp_engine = SpecEngine(target, InprocDrafterClient(comp), EngineConfig(max_running=2), max_draft_depth=5)
    prompt = [5, 9, 17, 33, 2, 40]
    ref = _tokens(engine, "ref", prompt, "ar", n=24)
    for m in ("ddtree", "dartree-pruned", "dflash"):
        assert _tokens(comp_engine, f"c-{m}", prompt, m, n=24) == ref, m


_COLD_PROBE = """
import sys
from types import SimpleNamespace
from services.testing import tiny_target
from services.verifier.runner import ModelRunner
from services.verifier.process import compiled_cold
target = tiny_target("llama", vocab_size=128, hidden_size=32, num_layers=2, max_position_embeddings=256)
runner = ModelRunner(target, num_slots=2, capacity=64, compile=True)
runner.warm_up((1, 5))
print("cold", compiled_cold(SimpleNamespace(runner=runner)))
"""


def test_a_second_start_loads_the_compiled_steps_from_the_disk_cache(tmp_path):
    """The premise of ``restart_after_compile``: a start on a cold inductor cache compiles (and
    saves) graphs; the next process over the same cache compiles none."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[2]
    counts = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _COLD_PROBE], env=env, cwd=root, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        counts.append(int(out.stdout.split("cold")[-1]))
    assert counts[0] > 0 and counts[1] == 0, counts
