"""Pre-packed float32 GEMMs (services/cpu_gemm.py): same results as ``F.linear``, used exactly for the
row counts they were packed for (padded from above half of it), never under autograd, dropped when the
weight changes, transparent to state dicts and tied weights; and the engine stays lossless with them."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services import cpu_gemm
from services.cpu_gemm import PackedLinear, pack_linears, packed_bytes, packing_available
from services.drafter.service import DFLASH_METHODS as METHODS
from services.spec import TreeKnobs
from services.testing import greedy_reference, tiny_service, tiny_target
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import SpecEngine
from services.verifier.policy import FixedPolicy

needs_mkl = pytest.mark.skipif(not packing_available(), reason="this torch build has no MKL packed sgemm")


def _linear(k=24, n=40, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    return lin


def _poison(lin: PackedLinear, r: int) -> None:
    """Replace the pack for ``r`` rows by a pack of a zero weight: calls that use it return the bias."""
    lin._packs[r] = torch.ops.mkl._mkl_reorder_linear_weight(torch.zeros_like(lin.weight.detach()), r)


@needs_mkl
@pytest.mark.parametrize("m", [2, 9, 12, 17])
def test_packed_equals_f_linear(m):
    lin = _linear()
    ref = _linear()
    assert pack_linears(lin, [17]) > 0 and isinstance(lin, PackedLinear)
    x = torch.randn(1, m, 24)
    with torch.inference_mode():
        y = lin(x)
    assert y.shape == (1, m, 40)
    torch.testing.assert_close(y, F.linear(x, ref.weight, ref.bias), rtol=1e-6, atol=1e-6)


@needs_mkl
def test_pack_is_used_only_for_rows_it_fits():
    lin = _linear()
    pack_linears(lin, [17])
    _poison(lin, 17)
    bias_only = lin.bias.detach().expand(1, 40)
    with torch.inference_mode():
        for m in (9, 10, 16, 17):  # R/2 < m <= R: padded to R rows, the (poisoned) pack is used
            y = lin(torch.randn(m, 24))
            torch.testing.assert_close(y, bias_only.expand(m, 40))
        for m in (1, 2, 8, 18, 40):  # outside: plain F.linear with the real weight
            x = torch.randn(m, 24)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


@needs_mkl
def test_autograd_calls_use_the_plain_weight():
    lin = _linear()
    pack_linears(lin, [8])
    _poison(lin, 8)
    x = torch.randn(8, 24, requires_grad=True)
    y = lin(x)  # grad enabled and x needs grad: never the pack
    torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias))
    y.sum().backward()
    assert lin.weight.grad is not None and x.grad is not None


@needs_mkl
def test_in_place_weight_change_drops_stale_packs():
    lin = _linear()
    pack_linears(lin, [8])
    with torch.no_grad():
        lin.weight.mul_(2.0)
    x = torch.randn(8, 24)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
    assert not lin._packs
    lin.load_state_dict(_linear(seed=5).state_dict())  # copy_ into the parameter: also in place
    lin.add_rows([8])
    with torch.no_grad():
        lin.weight.add_(1.0)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


@needs_mkl
def test_state_dict_tied_weights_and_other_dtypes_untouched():
    emb = nn.Embedding(40, 24)
    model = nn.ModuleDict({"emb": emb, "head": nn.Linear(24, 40, bias=False), "lowp": nn.Linear(24, 8).bfloat16()})
    model["head"].weight = emb.weight  # tied, like SmolLM2's lm_head
    keys = list(model.state_dict())
    added = pack_linears(model, [4, 16])
    assert added == packed_bytes(model) > 0
    assert model["head"].weight is emb.weight and list(model.state_dict()) == keys
    assert type(model["lowp"]) is nn.Linear  # bf16: not packed
    assert sorted(model["head"]._packs) == [4, 16]
    assert pack_linears(model, [16]) == 0  # already packed: nothing added


def test_row_counts_below_two_are_rejected():
    with pytest.raises(ValueError, match=">= 2"):
        pack_linears(_linear(), [1])


def test_no_mkl_means_no_change(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "packing_available", lambda: False)
    lin = _linear()
    assert pack_linears(lin, [17]) == 0 and type(lin) is nn.Linear


@needs_mkl
@pytest.mark.parametrize("method", METHODS)
def test_engine_with_packed_target_and_drafter_equals_greedy(method):
    """Every method stays lossless with the target packed for a B + 1 = 9 row verify and the drafter
    service packed for its block (trees of 5..9 rows use the pack, larger ones the plain path)."""
    target = tiny_target("llama")
    assert target.pack_gemm([9]) > 0
    service = tiny_service(target)
    assert any(isinstance(m, PackedLinear) and m._packs for m in service.drafter.modules())
    engine = SpecEngine(target, InprocDrafterClient(service), max_draft_depth=service.cfg.num_draft_slots,
                        policy=FixedPolicy(defaults=TreeKnobs(budget=8, width=4, depth_bonus=-0.2, candidates=8)))
    rng = random.Random(7)
    V = target.vocab_size
    for k in range(2):
        prompt = [rng.randrange(3, V - 1) for _ in range(6 + 3 * k)]
        ref = greedy_reference(target.model, prompt, 24)
        outs = list(engine.generate(f"r{k}", prompt, SamplingParams(max_tokens=24, ignore_eos=True),
                                    SpecParams(method)))
        assert [t for o in outs for t in o.token_ids] == ref


@needs_mkl
def test_pack_for_rounds_covers_the_default_tree_and_a_chain():
    target = tiny_target("llama")
    assert target.pack_for_rounds(8, 16) > 0
    assert sorted(target.lm_head()._packs) == [9, 17]
    assert target.pack_for_rounds(8, 16) == 0  # nothing new


@needs_mkl
def test_pack_for_steps_ladder_covers_every_batched_step_size():
    """Every step of 3 .. max_running * (B + 1) rows finds a pack within 2x its rows (2 rows run the
    plain kernel, faster there), and the ladder stops there (no pack for far larger steps)."""
    target = tiny_target("llama")
    assert target.pack_for_steps(8, 16, max_running=8) > 0
    lin = next(m for m in target.model.modules() if isinstance(m, PackedLinear))
    assert sorted(lin._packs) == [4, 9, 17, 33, 65, 129]
    assert lin._rows_for(2) is None
    for m in range(3, 8 * 9 + 1):
        r = lin._rows_for(m)
        assert r is not None and m <= r < 2 * m, m


@needs_mkl
def test_lazy_packs_follow_the_row_counts_that_run():
    """The served layout: ``pack_for_steps(lazy=True)`` packs nothing at start; each linear packs a
    row count of its ladder on the first call that needs it, so packed bytes = (linears' weight
    bytes) x (distinct packs used); 2-row calls and calls past the ladder never pack; results equal
    the plain ``F.linear`` model."""
    target = tiny_target("llama")
    ref = tiny_target("llama")
    assert target.pack_for_steps(8, 16, max_running=8, lazy=True) == 0 and packed_bytes(target.model) == 0
    lins = {id(m): m for m in target.model.modules() if isinstance(m, PackedLinear)}
    assert lins and all(m._lazy == (4, 9, 17, 33, 65, 129) for m in lins.values())
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in lins.values())
    seen = set()
    for rows, bucket in ((9, 9), (7, 9), (2, None), (3, 4), (9, 9), (200, None), (40, 65)):
        ids = torch.randint(0, target.vocab_size, (1, rows))
        with torch.inference_mode():
            got = target.model(input_ids=ids).logits
            want = ref.model(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        seen |= {bucket} - {None}
        assert packed_bytes(target.model) == len(seen) * weight_bytes, rows
    assert all(sorted(m._packs) == [4, 9, 65] for m in lins.values())
    with cpu_gemm.lazy_packing_paused():  # a start-up sweep: packs nothing new, uses what is packed
        for rows in (17, 33, 9):
            ids = torch.randint(0, target.vocab_size, (1, rows))
            with torch.inference_mode():
                torch.testing.assert_close(target.model(input_ids=ids).logits, ref.model(input_ids=ids).logits,
                                           rtol=1e-4, atol=1e-4)
    assert packed_bytes(target.model) == 3 * weight_bytes


@needs_mkl
def test_lazy_pack_is_used_and_rebuilt_after_an_in_place_change():
    lin = _linear()
    assert pack_linears(lin, [8], lazy=True) == 0 and not lin._packs
    x = torch.randn(8, 24)
    with torch.inference_mode():
        lin(x)
    assert sorted(lin._packs) == [8]
    _poison(lin, 8)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), lin.bias.expand(8, -1))  # the (poisoned) pack served the call
    with torch.no_grad():
        lin.weight.mul_(2.0)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))  # packed again, fresh
    assert sorted(lin._packs) == [8]


# ------------------------------------------------------------------- bfloat16, oneDNN pre-packed

needs_onednn = pytest.mark.skipif(not cpu_gemm.onednn_bf16_available(), reason="no oneDNN bf16 on this CPU/build")


def _bf16_linear(k=64, n=96, bias=True, seed=0):
    return _linear(k, n, bias, seed).to(torch.bfloat16)


@needs_onednn
@pytest.mark.parametrize("m", [1, 9, 17, 40])
def test_onednn_packed_equals_f_linear(m):
    lin, ref = _bf16_linear(), _bf16_linear()
    assert cpu_gemm.pack_linears_bf16(lin) > 0 and isinstance(lin, cpu_gemm.OneDNNLinear)
    x = torch.randn(2, m, 64).to(torch.bfloat16)
    with torch.inference_mode():
        y = lin(x)
    assert y.shape == (2, m, 96) and y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x, ref.weight, ref.bias))


@needs_onednn
@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (1536, 576), (576, 1536)])
def test_onednn_rows_equal_the_row_alone_for_every_row_count(n, k):
    """Batched == solo at the kernel: on SmolLM2's linear shapes every row of a call of 1..130 rows
    (and of 300) is bitwise the result of that row alone, once the load-time check has cut the
    shape's calls into pieces of the row count where this CPU's kernel is row-invariant."""
    lin = _bf16_linear(k, n, bias=False, seed=1)
    cpu_gemm.pack_linears_bf16(lin)
    assert 1 <= lin.max_rows <= cpu_gemm.ONEDNN_MAX_ROWS
    x = torch.randn(300, k).to(torch.bfloat16)
    with torch.inference_mode():
        solo = torch.cat([lin(x[i:i + 1]) for i in range(300)])
        for m in list(range(2, 131)) + [300]:
            assert torch.equal(lin(x[:m]), solo[:m]), m


@contextlib.contextmanager
def _onednn_call_rows():
    """Collects the row count of every oneDNN packed-linear call made inside the block."""
    calls, orig = [], cpu_gemm.torch.ops.mkldnn
    real = orig._linear_pointwise

    class Spy:
        def __getattr__(self, name):
            return getattr(orig, name)

        def _linear_pointwise(self, a, *rest):
            calls.append(a.shape[0])
            return real(a, *rest)

    cpu_gemm.torch.ops.mkldnn = Spy()
    try:
        yield calls
    finally:
        cpu_gemm.torch.ops.mkldnn = orig


@needs_onednn
def test_onednn_calls_past_max_rows_are_cut_into_pieces():
    lin = _bf16_linear()
    cpu_gemm.pack_linears_bf16(lin, max_rows=8)
    x = torch.randn(20, 64).to(torch.bfloat16)
    with torch.inference_mode():
        want = torch.cat([lin(x[i:i + 8]) for i in range(0, 20, 8)])
        with _onednn_call_rows() as calls:
            y = lin(x)
    assert calls == [8, 8, 4] and torch.equal(y, want)


@needs_onednn
def test_onednn_autograd_stale_weight_and_fallbacks_use_f_linear():
    lin = _bf16_linear()
    cpu_gemm.pack_linears_bf16(lin)
    lin._onednn_pack = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(lin.weight.detach()), 1)  # poison
    x = torch.randn(4, 64).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(lin(x), lin.bias.detach().expand(4, 96))  # the (poisoned) pack is what runs
    xg = x.clone().requires_grad_(True)
    y = lin(xg)  # autograd: the real weight
    assert torch.equal(y.detach(), F.linear(x, lin.weight, lin.bias).detach())
    y.float().sum().backward()
    assert xg.grad is not None
    with torch.no_grad():
        lin.weight.mul_(2.0)  # in place: the pack is stale and dropped
    with torch.inference_mode():
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    assert lin._onednn_pack is None


@needs_onednn
def test_onednn_state_dict_tied_weights_and_float32_untouched():
    emb = nn.Embedding(40, 64).to(torch.bfloat16)
    model = nn.ModuleDict({"emb": emb, "head": nn.Linear(64, 40, bias=False).to(torch.bfloat16),
                           "fp32": nn.Linear(64, 8)})
    model["head"].weight = emb.weight  # tied, like SmolLM2's lm_head
    keys = list(model.state_dict())
    assert cpu_gemm.pack_linears_bf16(model) == 40 * 64 * 2
    assert model["head"].weight is emb.weight and list(model.state_dict()) == keys
    assert type(model["fp32"]) is nn.Linear
    assert cpu_gemm.pack_linears_bf16(model) == 0  # already packed: nothing added
    with pytest.raises(ValueError, match="max_rows"):
        cpu_gemm.pack_linears_bf16(model, max_rows=0)


@needs_onednn
def test_a_shape_whose_rows_depend_on_the_row_count_is_cut_into_invariant_pieces(monkeypatch):
    """A shape whose kernel changes rows from 3-row calls on (as the 576 x 1536 down projection does
    on some CPUs) is packed with 2-row pieces: every call is made of 2-row calls."""
    monkeypatch.setattr(cpu_gemm, "rows_are_independent", lambda lin, rows: max(rows) < 3)
    lin = _bf16_linear()
    assert cpu_gemm.pack_linears_bf16(lin) > 0 and lin.max_rows == 2
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.inference_mode(), _onednn_call_rows() as calls:
        y = lin(x)
    assert calls == [2, 2, 1]
    with torch.inference_mode():
        assert torch.equal(y, torch.cat([lin(x[i:i + 1]) for i in range(5)]))


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch, tmp_path):
    """Each test probes its shapes' row invariance itself (no verdict kept by an earlier test)."""
    monkeypatch.setenv("DARTREE_CACHE_DIR", str(tmp_path / "state"))


@needs_onednn
def test_a_row_invariance_verdict_is_found_once_per_machine_threads_and_shape(monkeypatch, tmp_path):
    """The first pack of a shape probes it and keeps the verdict on disk; a later pack (a restart) of
    the same shape reuses it without probing; another thread count or shape is probed again."""
    probed = []
    real = cpu_gemm.invariant_rows
    monkeypatch.setattr(cpu_gemm, "invariant_rows", lambda lin, limit: probed.append(tuple(lin.weight.shape)) or
                        (2 if lin.weight.shape[1] == 64 else real(lin, limit)))
    cpu_gemm.pack_linears_bf16(_bf16_linear())
    assert probed == [(96, 64)] and cpu_gemm.cached_verdicts() == {"96 x 64": 2}
    lin = _bf16_linear(seed=3)
    cpu_gemm.pack_linears_bf16(lin)
    assert probed == [(96, 64)] and lin.max_rows == 2        # reused: not probed again
    cpu_gemm.pack_linears_bf16(_bf16_linear(32, 16))
    assert probed == [(96, 64), (16, 32)] and set(cpu_gemm.cached_verdicts()) == {"96 x 64", "16 x 32"}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert cpu_gemm.cached_verdicts() == {}
        cpu_gemm.pack_linears_bf16(_bf16_linear())
        assert probed[-1] == (96, 64) and len(probed) == 3
    finally:
        torch.set_num_threads(threads)
    (tmp_path / "state" / "onednn_rows.json").write_text("not json")  # unreadable: probed again, rewritten
    cpu_gemm.pack_linears_bf16(_bf16_linear())
    assert len(probed) == 4 and cpu_gemm.cached_verdicts() == {"96 x 64": 2}


def test_no_onednn_means_no_change(monkeypatch):
    monkeypatch.setattr(cpu_gemm, "onednn_bf16_available", lambda: False)
    lin = _bf16_linear()
    assert cpu_gemm.pack_linears_bf16(lin) == 0 and type(lin) is nn.Linear
