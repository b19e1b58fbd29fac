"""Weight formats (``--weights``): the GGUF's own Q4_1 blocks served 4-bit, and the auto choice.

Oracles: gguf's own quantizer/dequantizer (the byte layout), the HF weights of a directory made from
the same GGUF (transformers' loader semantics, q/k un-permuted), the exact dequantization ``d*q+m``
(the served values differ by bfloat16 rounding of the block constants only), and the engine's plain
decoding with the same q4 model (the lossless guarantee is relative to the weights served).
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch


from services.protocol import DFLASH_METHODS as METHODS  # the methods a DFlash + Domino drafter serves
from services.testing import REPO, tiny_gguf_target_dir, tiny_service
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import EngineConfig, SpecEngine
from services.verifier.target import TargetModel
from services import int_dot, timing
from services import weight_choice as WC
from services import gguf_blocks as GB
from services import q4_weights as Q4
from services import weight_formats as WF
from services import weights as W
from tests.doubles import OracleDrafter
from tests.engine.test_batched import _run_batched

pytestmark = pytest.mark.skipif(not W.int4_kernel_available(), reason="torch without the int4 CPU kernel")
V = 128


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tiny_gguf_target_dir(tmp_path_factory.mktemp("q4target"))


@pytest.fixture(scope="module")
def q4_target(gguf_dir):
    return TargetModel.from_pretrained(gguf_dir, [0, 1], weights="q4")


@pytest.fixture(scope="module")
def bf16_target(gguf_dir):
    return TargetModel.from_pretrained(gguf_dir, [0, 1], weights="bfloat16")


def test_bf16_formats_serve_dense_linears_through_onednn_packs(gguf_dir, bf16_target, monkeypatch):
    """Under ``bfloat16`` every linear, under ``q4`` with the int8 lm_head switched off the dense
    lm_head, is oneDNN-packed where the CPU has bf16 support (services.cpu_gemm); the packed call
    equals plain ``F.linear`` on the weight."""
    from services.cpu_gemm import OneDNNLinear, onednn_bf16_available

    if not onednn_bf16_available():
        pytest.skip("no oneDNN bf16 on this CPU/build")
    dense = [m for m in bf16_target.model.modules() if isinstance(m, torch.nn.Linear)]
    assert dense and all(isinstance(m, OneDNNLinear) and m._onednn_pack is not None for m in dense)
    monkeypatch.setenv("DARTREE_INT8_LM_HEAD", "0")
    head = TargetModel.from_pretrained(gguf_dir, [0, 1], weights="q4").lm_head()
    assert isinstance(head, OneDNNLinear) and head._onednn_pack is not None
    x = torch.randn(9, head.in_features).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight))


needs_int8 = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int8pack_mm"),
                                reason="torch without the weight-only int8 CPU kernel")


@needs_int8
def test_q4_lm_head_is_int8_rows_of_the_tied_weight(q4_target):
    """``q4`` serves its lm_head as int8 with one bfloat16 scale per row (services.weights.Int8RowLinear):
    the weight stays the embedding's, each int8 value is the weight over its row's scale rounded
    (so within half a scale step of the weight), and a call is the int8 values times the scale."""
    head = q4_target.lm_head()
    assert isinstance(head, W.Int8RowLinear)
    if q4_target.model.config.tie_word_embeddings:
        assert head.weight is q4_target.embed_tokens().weight  # tied: no second dense copy
    assert "q8_weight" not in q4_target.model.state_dict() and "lm_head.q8_weight" not in q4_target.model.state_dict()
    w = head.weight.detach().float()
    q, scale = head.int8_rows()
    scale = scale.float()
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (w.shape[0],)
    assert int(q.abs().max()) == 127  # each row's largest magnitude maps to +-127
    assert torch.allclose(scale, w.abs().amax(1) / 127, rtol=2 ** -7, atol=0)  # (from the exact values: below)
    assert (q.float() * scale[:, None] - w).abs().le(scale[:, None] * 0.5 + 1e-6 + w.abs() * 2 ** -8).all()
    assert head.nbytes() == q.numel() + 2 * scale.numel()
    x = torch.randn(5, head.in_features).to(torch.bfloat16)
    with torch.inference_mode():
        ref = x.float() @ (q.float() * scale[:, None]).T
        if head.q8_packed is not None:  # the integer-dot kernel: its reference's bits, 8-bit activations
            assert torch.equal(head(x), int_dot.q8_reference(x, head.q8_packed, head.q8_scale))
            assert float((head(x).float() - ref).norm()) <= 0.02 * float(ref.norm())
        else:
            assert torch.allclose(head(x).float(), ref, rtol=2 ** -6, atol=1e-3)


@needs_int8
def test_int8_lm_head_is_quantised_from_the_ggufs_exact_values(gguf_dir, q4_target):
    """The int8 rows come from the GGUF's Q8_0 output weights (their exact dequantization, which the
    float32 HF weights of the fixture are), not from the bfloat16-rounded served weight."""
    f32 = W.load_causal_lm(gguf_dir, "float32").lm_head.weight.detach()
    rows = W.read_gguf_output_rows(W.gguf_source(gguf_dir), tuple(f32.shape))
    assert rows is not None and torch.equal(rows(0, f32.shape[0]), f32)
    assert torch.equal(rows(3, 7), f32[3:7])
    head = q4_target.lm_head()
    scale = (f32.abs().amax(1) / 127).to(torch.bfloat16)
    assert torch.equal(head.q8_scale, scale)
    assert torch.equal(head.int8_rows()[0], torch.round(f32 / scale.float()[:, None]).clamp(-127, 127).to(torch.int8))
    assert W.read_gguf_output_rows(W.gguf_source(gguf_dir), (f32.shape[0], f32.shape[1] + 32)) is None  # wrong shape


@needs_int8
def test_int8_lm_head_rows_do_not_depend_on_the_call(q4_target):
    """Each row of an int8 lm_head call is bitwise that row's result alone, for every row count a
    step can give it (tree verifies, batched slots): what keeps speculation lossless under ``q4``."""
    head = q4_target.lm_head()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(130, head.in_features, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        solo = torch.cat([head(x[i:i + 1]) for i in range(len(x))])
        for m in (*range(2, 18), 33, 64, 65, 130):
            used = len(x) - len(x) % m
            got = torch.cat([head(x[i:i + m]) for i in range(0, used, m)])
            assert torch.equal(got, solo[:used]), m


@needs_int8
def test_int8_lm_head_follows_its_weight_and_can_be_switched_off(gguf_dir, monkeypatch):
    """A weight changed in place after quantising makes the module run the dense weight (never stale
    int8 values); ``DARTREE_INT8_LM_HEAD=0`` leaves the lm_head dense."""
    model = W.load_causal_lm(gguf_dir, "q4")
    head = model.lm_head
    x = torch.randn(3, head.in_features).to(torch.bfloat16)
    with torch.inference_mode():
        head.weight.mul_(2)
        assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight))
    assert head.requantize() == head.nbytes()
    with torch.inference_mode():
        assert not torch.equal(head(x), torch.nn.functional.linear(x, head.weight))  # int8 again
    assert not isinstance(W.load_causal_lm(gguf_dir, "bfloat16").lm_head, W.Int8RowLinear)  # q4 only
    monkeypatch.setenv("DARTREE_INT8_LM_HEAD", "0")
    assert not isinstance(W.load_causal_lm(gguf_dir, "q4").lm_head, W.Int8RowLinear)


def test_parse_q4_1_matches_ggufs_dequantizer():
    import gguf
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    raw = quantize(w, gguf.GGMLQuantizationType.Q4_1)
    b = W.parse_q4_1(raw)
    assert b.q.shape == (48, 96) and b.d.shape == (48, 3) and int(b.q.min()) >= 0 and int(b.q.max()) <= 15
    ref = dequantize(raw, gguf.GGMLQuantizationType.Q4_1).reshape(48, 96)
    assert torch.equal(b.dequantize(), torch.from_numpy(ref))
    with pytest.raises(ValueError, match="blocks"):
        W.parse_q4_1(raw[:, :-1])


def test_gguf_linears_equal_the_hf_weights_made_from_them(gguf_dir):
    """q/k rows are stored permuted (llama.cpp); after un-permuting, d*q+m is bit-equal to the HF
    directory's float32 weights (what transformers' GGUF loader produced for the default target)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(gguf_dir)
    blocks, skipped = W.read_gguf_linears(gguf_dir / "model.gguf", ref.config)
    assert not skipped and len(blocks) == 7 * ref.config.num_hidden_layers
    for name, b in blocks.items():
        assert torch.equal(b.dequantize(), ref.get_submodule(name).weight), name


@pytest.mark.parametrize("kernel", ["torch", "int_dot"])
def test_int4_linear_serves_the_blocks_up_to_bf16_constants(gguf_dir, kernel):
    """torch's kernel serves the blocks with bfloat16 block constants; the integer-dot kernel serves
    them exactly against 8-bit activations (services.int_dot). Either way each row ignores the others."""
    from transformers import AutoModelForCausalLM

    if kernel == "int_dot" and int_dot.isa() is None:
        pytest.skip("the native library is not built here")
    ref = AutoModelForCausalLM.from_pretrained(gguf_dir)
    blocks, _ = W.read_gguf_linears(gguf_dir / "model.gguf", ref.config)
    b = blocks["model.layers.1.mlp.down_proj"]
    lin = W.Int4Linear(b, None, torch.bfloat16, kernel=kernel)
    exact = b.dequantize()
    served = lin.dequantized()
    span = exact.abs().amax(1, keepdim=True)
    err = ((served - exact).abs() / span).max().item()
    x = torch.randn(5, lin.in_features, dtype=torch.bfloat16)
    y = lin(x)
    assert y.shape == (5, lin.out_features) and y.dtype == torch.bfloat16
    if kernel == "torch":
        assert 0 < err <= 2 ** -6  # bf16 rounding of d and m + 8d, nothing more
        torch.testing.assert_close(y.float(), x.float() @ served.T, atol=3e-2, rtol=3e-2)
    else:
        assert err == 0 and torch.equal(y, int_dot.q4_reference(x, lin.qw, lin.dm))
        want = x.float() @ exact.T
        assert float((y.float() - want).norm()) <= 0.02 * float(want.norm())  # 8-bit activations
    rows = torch.cat([lin(x[i:i + 1]) for i in range(5)])  # each row's result ignores the others
    assert torch.equal(y, rows)
    with pytest.raises(ValueError, match="out_features % 16"):
        W.Int4Linear(W.Q4Blocks(b.q[:8], b.d[:8], b.m[:8]))


def _bump_q4_kernels(monkeypatch) -> None:
    """The ``q4`` format's kernels one version newer (its cached packs' key changes)."""
    fmt = WF.FORMATS["q4"]
    monkeypatch.setitem(WF.FORMATS, "q4", dataclasses.replace(fmt, kernels_version=fmt.kernels_version + 1))


def test_q4_packs_are_cached_per_key_and_reused(gguf_dir, monkeypatch, tmp_path):
    """The first q4 load packs the GGUF's blocks and keeps the packs; a restart reads them instead of
    the GGUF and serves bitwise the same model; another key (a new kernels version) or a corrupt file
    packs again from the GGUF."""
    monkeypatch.setenv("DARTREE_CACHE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("DARTREE_INT8_LM_HEAD", "0")  # the packs alone here (the int8 head's file: below)
    read, real = [], W.read_gguf_linears
    monkeypatch.setattr(Q4, "read_gguf_linears", lambda *a: read.append(1) or real(*a))
    first = W.load_causal_lm(gguf_dir, "q4")
    (path,) = (tmp_path / "state" / "q4").glob("*.safetensors")
    second = W.load_causal_lm(gguf_dir, "q4")
    assert len(read) == 1                                      # the restart did not read the GGUF
    mods = [(a, b) for a, b in zip(first.modules(), second.modules()) if isinstance(a, W.Int4Linear)]
    assert len(mods) == 2 * 7 and all(isinstance(b, W.Int4Linear) and b.kernel == a.kernel
                                      and all(torch.equal(x, y) for x, y in zip(a.buffers(), b.buffers()))
                                      for a, b in mods)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.inference_mode():
        assert torch.equal(first(input_ids=ids).logits, second(input_ids=ids).logits)
    path.write_bytes(b"truncated")                             # corrupt: packed again, file rewritten
    W.load_causal_lm(gguf_dir, "q4")
    assert len(read) == 2 and W.load_causal_lm(gguf_dir, "q4") is not None and len(read) == 2
    _bump_q4_kernels(monkeypatch)  # another key: packed again
    W.load_causal_lm(gguf_dir, "q4")
    assert len(read) == 3 and len(list((tmp_path / "state" / "q4").glob("*.safetensors"))) == 2


@needs_int8
def test_int8_lm_head_is_cached_per_key_and_reused(gguf_dir, monkeypatch, tmp_path):
    """The first q4 load quantises the lm_head from the GGUF and keeps the int8 rows beside the q4
    packs; a restart reads them (no quantising) and gets the same values; another key quantises again."""
    monkeypatch.setenv("DARTREE_CACHE_DIR", str(tmp_path / "state"))
    made, real = [], W.Int8RowLinear.requantize
    monkeypatch.setattr(W.Int8RowLinear, "requantize", lambda self, *a, **k: made.append(1) or real(self, *a, **k))
    first = W.load_causal_lm(gguf_dir, "q4").lm_head
    assert len(made) == 1 and len(list((tmp_path / "state" / "q4").glob("*.safetensors"))) == 2
    second = W.load_causal_lm(gguf_dir, "q4").lm_head
    assert len(made) == 1 and isinstance(second, W.Int8RowLinear)
    assert all(torch.equal(a, b) for a, b in zip(first.int8_rows(), second.int8_rows()))
    # owned, 64-byte aligned memory, not a view into the file's mapping (a compiled step crashed on that)
    rows = second.q8_weight if second.q8_packed is None else second.q8_packed
    assert rows.data_ptr() % 64 == 0 and second.q8_scale.data_ptr() % 64 == 0
    x = torch.randn(3, first.in_features).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(first(x), second(x))
    _bump_q4_kernels(monkeypatch)
    W.load_causal_lm(gguf_dir, "q4")
    assert len(made) == 2 and len(list((tmp_path / "state" / "q4").glob("*.safetensors"))) == 4


def test_a_q4_load_parses_the_gguf_once(gguf_dir, monkeypatch, tmp_path):
    """With nothing cached, the q4 linears and the int8 lm_head come from one parse of the GGUF
    (``one_gguf_reader``), and the parse is not kept after the load."""
    import gguf

    monkeypatch.setenv("DARTREE_CACHE_DIR", str(tmp_path / "state"))
    parsed, real = [], gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda *a, **k: parsed.append(1) or real(*a, **k))
    model = W.load_causal_lm(gguf_dir, "q4")
    assert len(parsed) == 1 and GB._READERS is None
    if hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        assert isinstance(model.lm_head, W.Int8RowLinear)


def test_q4_target_replaces_every_linear(q4_target):
    mods = dict(q4_target.model.named_modules())
    q4 = [n for n, m in mods.items() if isinstance(m, W.Int4Linear)]
    assert len(q4) == 14 and q4_target.weights == "q4" and q4_target.dtype == torch.bfloat16
    assert not any(isinstance(m, torch.nn.Linear) for n, m in mods.items() if ".layers." in n)
    # the integer-dot kernels wherever they run (the spine tests below then exercise them)
    assert {mods[n].kernel for n in q4} == {"int_dot" if int_dot.enabled() else "torch"}


@pytest.mark.parametrize("fmt", ["q4", "bfloat16"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_equals_plain_decoding_per_format(request, fmt, seed):
    """T = 0: every method with a random drafter, and an oracle drafter (full accepts, KV compaction),
    emit exactly the q4 model's own plain decoding (``ar``, same kernels); likewise the bfloat16
    model with its oneDNN-packed linears."""
    target = request.getfixturevalue({"q4": "q4_target", "bfloat16": "bf16_target"}[fmt])
    rng = random.Random(seed)
    prompt = [rng.randrange(3, V - 1) for _ in range(7)]
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    engine = SpecEngine(target, InprocDrafterClient(tiny_service(target, seed=seed)), max_draft_depth=8)

    def run(eng, method):
        return [t for o in eng.generate("r", prompt, sampling, SpecParams(method)) for t in o.token_ids]

    ref = run(engine, "ar")
    for method in METHODS:
        assert run(engine, method) == ref, method
    oracle = OracleDrafter({"r": prompt + ref}, depth=4, distractors=2, vocab_size=V, seed=seed)
    assert run(SpecEngine(target, oracle, max_draft_depth=4), "dartree-pruned") == ref


@pytest.mark.parametrize("fmt", ["q4", "bfloat16"])
def test_batched_equals_solo_per_format(request, fmt):
    target = request.getfixturevalue({"q4": "q4_target", "bfloat16": "bf16_target"}[fmt])
    rng = random.Random(7)
    service = tiny_service(target, seed=5)
    reqs = [(f"r{i}", [rng.randrange(3, V - 1) for _ in range(rng.randrange(3, 20))], METHODS[i % len(METHODS)])
            for i in range(6)]
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)

    def solo(prompt, method):
        eng = SpecEngine(target, InprocDrafterClient(service), EngineConfig(max_running=1), max_draft_depth=8)
        return [t for o in eng.generate("s", prompt, sampling, SpecParams(method)) for t in o.token_ids]

    eng = SpecEngine(target, InprocDrafterClient(service), EngineConfig(max_running=8), max_draft_depth=8)
    got, sizes = _run_batched(eng, {0: [(rid, prompt, sampling, SpecParams(method)) for rid, prompt, method in reqs]})
    assert max(sizes) == len(reqs)  # all six shared a step
    for rid, prompt, method in reqs:
        assert got[rid] == solo(prompt, method), (rid, method)


def test_q4_needs_a_gguf_and_a_cpu(tmp_path):
    from services.testing import tiny_causal_lm

    plain = tmp_path / "plain"
    tiny_causal_lm("llama", hidden_size=64, intermediate_size=128).save_pretrained(plain)
    assert W.available_formats(plain) == ["float32", "bfloat16"]
    with pytest.raises(ValueError, match="GGUF"):
        W.choose_weights("q4", plain)
    with pytest.raises(ValueError, match="GGUF"):
        W.load_causal_lm(plain, "q4")
    with pytest.raises(ValueError, match="CPU only"):
        W.choose_weights("q4", plain, device="cuda")
    with pytest.raises(ValueError, match="not supported"):
        W.choose_weights("int3", plain)
    assert W.choose_weights("bfloat16", plain) == "bfloat16"
    assert W.compute_dtype("q4") == torch.bfloat16 and W.compute_dtype("float32") == torch.float32


@pytest.fixture
def avx2_only(monkeypatch, tmp_path):
    """An AVX2-only CPU (no native bf16), a private state directory, and an idle machine: the timing
    process gets all its threads' CPU time (:func:`services.timing.busy_reason` sees no competitor)."""
    monkeypatch.setattr(WC, "cpu_info", lambda: ("Test EPYC", {"avx2", "fma", "sse4_2"}))
    monkeypatch.setenv("DARTREE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(timing, "cpu_seconds", lambda: timing.wall_seconds() * 1024)
    return tmp_path / "cache" / "weights_choice.json"


def _scripted(monkeypatch, per_round: list[float], outliers: dict[tuple[int, int], float] | None = None,
              per_step: dict[int, list[float]] | None = None) -> list[float]:
    """Make the interleaved timer return ``per_round`` (float32 1-row, 9-row, q4 1-row, 9-row: steps
    0-3) at every call of each step (the warm-up included), ``per_step`` (step -> its successive times)
    for the steps it names, and ``outliers`` ((step, its k-th call) -> ms) instead at those calls; each
    step still runs. Returns the log of returned times."""
    got: list[float] = []
    index: dict[int, int] = {}   # the callable -> its step (the warm-up round runs them in order)
    alive: list = []             # every callable seen, kept alive: a freed one's id must not be reused
    calls: dict[int, int] = {}

    def fake(fn):
        fn()
        if id(fn) not in index:
            alive.append(fn)
        step = index.setdefault(id(fn), len(index)) % len(per_round)  # a new measurement: new callables
        k = calls[step] = calls.get(step, -1) + 1
        ms = per_step[step][k % len(per_step[step])] if per_step and step in per_step else per_round[step]
        got.append((outliers or {}).get((step, k), ms))
        return got[-1]

    monkeypatch.setattr(WC, "_time_call", fake)
    monkeypatch.setattr(WC, "step_limit_ms", lambda model: 1e9)  # the floor has its own test
    return got


def test_no_bfloat16_candidate_without_native_bf16(gguf_dir, monkeypatch):
    monkeypatch.setattr(WC, "cpu_info", lambda: ("Test EPYC", {"avx2", "fma", "avx512f"}))
    assert not WC.native_bf16() and WC.candidate_formats(W.available_formats(gguf_dir)) == ["float32", "q4"]
    assert not WC.cpu_capabilities()["native_bf16"]
    for flag in ("avx512_bf16", "amx_bf16"):
        monkeypatch.setattr(WC, "cpu_info", lambda flag=flag: ("Test Xeon", {"avx2", "avx512f", flag}))
        assert WC.candidate_formats(W.available_formats(gguf_dir)) == ["float32", "bfloat16", "q4"]
    monkeypatch.setattr(WC, "cpu_info", lambda: ("Test EPYC", {"avx2"}))
    assert WC.rule_choice(WC.candidate_formats(W.available_formats(gguf_dir)))[0] == "q4"
    assert WC.rule_choice(["float32", "bfloat16"])[0] == "bfloat16" and WC.rule_choice(["float32"])[0] == "float32"


def test_auto_measures_interleaved_once_then_uses_the_cache(gguf_dir, avx2_only, monkeypatch):
    got = _scripted(monkeypatch, [5.0, 10.0, 2.0, 4.0])
    assert W.choose_weights("auto", gguf_dir) == "q4"
    assert len(got) == 4 * 5  # 2 formats x 2 row counts x (1 warm-up + 4 timed rounds: all reproduced), one attempt
    (entry,) = json.loads(avx2_only.read_text()).values()
    assert entry["choice"] == "q4" and entry["ms"] == {"float32": {"1-row": 5.0, "9-row": 10.0},
                                                       "q4": {"1-row": 2.0, "9-row": 4.0}}
    assert W.choose_weights("auto", gguf_dir) == "q4" and len(got) == 20  # the cache: no new measurement
    got.clear()
    _scripted(monkeypatch, [1.0, 2.0, 2.0, 4.0])
    assert W.choose_weights("auto", gguf_dir, cache=False) == "float32"  # measured again, float32 faster
    assert W.choose_weights("auto", gguf_dir, remeasure=True) == "float32"
    assert json.loads(avx2_only.read_text())[next(iter(json.loads(avx2_only.read_text())))]["choice"] == "float32"


def test_a_competing_process_gets_the_rules_answer_and_caches_nothing(gguf_dir, avx2_only, monkeypatch, caplog):
    """Another process shares the cores: every step still reproduces its times (slower ones, as on the
    2-core VM: 46.1 / 46.3 ms instead of 23.6 next to one busy loop), float32 even looks faster, but the
    timing process got half its threads' CPU time. Both attempts are rejected, the rule's answer (q4)
    is served and nothing is cached."""
    got = _scripted(monkeypatch, [1.0, 2.0, 2.0, 4.0])
    monkeypatch.setattr(timing, "cpu_seconds", lambda: timing.wall_seconds() * 0.5)
    with caplog.at_level("INFO", logger="services.weights"):
        assert W.choose_weights("auto", gguf_dir) == "q4"
    assert len(got) == 2 * 4 * 5 and not avx2_only.exists()  # 2 attempts x (warm-up + 4 rounds) x 4 steps
    (line,) = [r.getMessage() for r in caplog.records if "weights auto" in r.getMessage()]
    assert "by rule" in line and "another process on the cores" in line and "not cached" in line


def test_repeats_that_never_agree_get_the_rules_answer(gguf_dir, avx2_only, monkeypatch, caplog):
    """The q4 one-row step never repeats a time within 15 % (each call 1.3x the one before): after 10
    rounds per attempt, both attempts are rejected and nothing is cached."""
    got = _scripted(monkeypatch, [1.0, 2.0, 2.0, 4.0], per_step={2: [2.0 * 1.3 ** k for k in range(40)]})
    with caplog.at_level("INFO", logger="services.weights"):
        assert W.choose_weights("auto", gguf_dir) == "q4"
    assert len(got) == 2 * 4 * 11 and not avx2_only.exists()
    (line,) = [r.getMessage() for r in caplog.records if "weights auto" in r.getMessage()]
    assert "by rule" in line and "q4 1-row repeats never within 15%" in line


def test_an_idle_vm_with_slow_phases_and_spikes_caches(gguf_dir, avx2_only, monkeypatch):
    """The repeats of an idle 2-core VM (the q4 one-row times recorded there: phases at 1.0-1.6x the
    fastest, a lone fastest call) plus a 50x spike: the old spread rules rejected such a measurement;
    the fastest times reproduced are accepted and cached, and the format faster in every round wins."""
    vm = [32.0, 22.0, 19.0, 25.0, 30.0, 30.0, 30.0, 34.0, 34.0, 32.0]  # recorded, ms
    per_step = {0: [1.5 * t for t in vm], 1: [2.5 * t for t in vm[3:] + vm[:3]],  # float32: slower in every round
                2: vm, 3: [2.0 * t for t in vm[5:] + vm[:5]]}
    got = _scripted(monkeypatch, [0.0] * 4, outliers={(2, 3): 1000.0}, per_step=per_step)
    assert W.choose_weights("auto", gguf_dir) == "q4"
    (entry,) = json.loads(avx2_only.read_text()).values()
    # q4 1-row ran 22, 19, (spike), 30, 30: 19 and 22 stand alone (16 % apart); 30 is the fastest reproduced
    assert entry["ms"]["q4"]["1-row"] == 30.0
    assert 4 * 5 <= len(got) <= 4 * 11


def test_fastest_reproduced_ignores_slow_repeats_and_lone_fast_ones():
    assert timing.fastest_reproduced([20.0, 20.5, 40.0, 41.0, 400.0]) == 20.5
    assert timing.fastest_reproduced([19.0, 25.0, 30.0, 30.5]) == 30.5  # 19 and 25 stand alone
    assert timing.fastest_reproduced([10.0, 20.0, 40.0]) is None and not timing.reproduced([1.0])
    assert timing.fastest_reproduced([0.0, 0.0]) is None


def test_a_cached_emulated_bfloat16_choice_is_measured_again(gguf_dir, avx2_only, monkeypatch):
    key = WC.machine_key(gguf_dir, torch.get_num_threads(), WF.kernels_version())
    avx2_only.parent.mkdir(parents=True)
    avx2_only.write_text(json.dumps({key: {"choice": "bfloat16", "ms": {}, "when": "2026-12-01T00:00:00"}}))
    got = _scripted(monkeypatch, [5.0, 10.0, 2.0, 4.0])
    assert W.choose_weights("auto", gguf_dir) == "q4" and got


def test_judge_rejects_a_step_far_above_the_models_floor(gguf_dir):
    def timed(times, share=1.0):
        return timing.Timings(times, share, 2)

    steady = timed({("float32", 1): [30.0] * 5, ("float32", 9): [50.0] * 5,
                    ("q4", 1): [1900.0, 1905.0, 1910.0, 1904.0, 1902.0], ("q4", 9): [2400.0] * 5})
    assert "q4 one-row step 1902.0 ms is above" in WC.judge(steady, {"float32": 500.0, "q4": 180.0})
    assert WC.judge(steady, {"float32": 500.0, "q4": 5000.0}) is None
    assert "9-row repeats never within" in WC.judge(timed({("q4", 1): [20.0] * 5,
                                                           ("q4", 9): [25.0, 40.0, 60.0, 90.0]}), {})
    assert WC.judge(timed({("q4", 1): [20.0] * 5, ("q4", 9): [25.0, 25.0, 40.0, 25.0, 25.0]}), {}) is None
    assert "another process" in WC.judge(timed({("q4", 1): [20.0] * 5}, share=0.6), {})
    model = W.load_causal_lm(gguf_dir, "q4")
    floor = WC.step_floor_ms(model)
    assert 0 < floor < 50 and WC.step_limit_ms(model) == pytest.approx(
        WC.FLOOR_FACTOR * floor + WC.LAYER_OVERHEAD_MS * model.config.num_hidden_layers, rel=0.05)


def test_real_interleaved_steps_run_on_a_tiny_model(gguf_dir):
    model = W.load_causal_lm(gguf_dir, "q4")
    t = WC.measure_interleaved({"q4": WC.step_callables(model, context=8, rows=(1, 3))}, max_rounds=2, min_rounds=2)
    assert set(t.times) == {("q4", 1), ("q4", 3)} and all(len(v) == 2 and min(v) > 0 for v in t.times.values())
    assert 0 < t.cpu_share and t.threads == timing.usable_threads(torch.get_num_threads())


def test_cli_q4_without_gguf_is_one_line(tmp_path):
    from services.testing import tiny_causal_lm

    plain = tmp_path / "plain"
    tiny_causal_lm("llama", hidden_size=64, intermediate_size=128).save_pretrained(plain)
    r = subprocess.run([sys.executable, "-m", "services.cli", "generate", "hi", "--target", str(plain),
                        "--weights", "q4", "--max-tokens", "2", "--method", "ar"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("dartree: error: weights 'q4' need")
