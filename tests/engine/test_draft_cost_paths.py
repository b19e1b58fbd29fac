"""The draft phase's cost paths at T = 0 in float32: block rows that follow each call's budget
(``DrafterService(spare_rows=...)``) and the drafter's linears on the int4 kernel
(``q4_linears``, :func:`services.weights.quantize_linears_q4`). Drafts may change, output may not."""

from __future__ import annotations

import random

import pytest
import torch

from services.drafter.service import DrafterService, _want_q4
from services.spec import TreeKnobs
from services.testing import greedy_reference, tiny_drafter
from services.verifier.drafter_client import DraftJob, InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import EngineConfig, SpecEngine
from services.weights import Int4Linear, int4_kernel_available, quantize_linears_q4, quantize_q4_1
from tests.engine.conftest import TARGET_KW, V  # noqa: F401  (fixture: target)

needs_int4 = pytest.mark.skipif(not int4_kernel_available(), reason="torch has no int4 CPU kernel")


def _service(target, seed=5, **kw):
    d = tiny_drafter(target, seed=seed, block_size=8)
    return DrafterService(d, target.embed_tokens(), target.lm_head(), packed_gemm=False, **kw)


def _prompt(seed, n=12):
    rng = random.Random(seed)
    return [rng.randrange(3, V - 1) for _ in range(n)]


def _draft(service, prompt, feats, budget, rid="a"):
    knobs = TreeKnobs(budget, 3, -0.2, 8)
    job = DraftJob(rid, prompt[:-1], feats[:-1], prompt[-1], len(prompt) - 1, "dartree-pruned", knobs, None)
    tree, _ = service.draft_batch([job])[0]
    service.release(rid)
    return tree


@pytest.mark.parametrize("budget", [1, 2, 3, 5])
def test_budget_rows_equal_a_fixed_block_of_as_many_rows(target, budget):
    """A call at budget B runs B + 1 block rows (shift-label drafter, one spare row) and drafts the
    tree a fixed block of B + 1 rows drafts."""
    follow, fixed = _service(target, spare_rows=1), _service(target, block_rows=budget + 1, spare_rows=None)
    assert follow.rows_for(budget) == budget + 1 and follow.rows_for(None) == 8
    prompt = _prompt(budget)
    _, feats = target.teacher_forced(prompt)
    follow.append_context("r", feats[:-1], len(prompt) - 1)
    hd, base = follow.block_logits_batch([("r", prompt[-1], len(prompt) - 1)], budget)[0]
    assert hd.shape[0] == budget + 1 and base.shape[0] == budget  # the rows ran, the reach projected
    follow.release("r")
    a, b = _draft(follow, prompt, feats, budget), _draft(fixed, prompt, feats, budget)
    assert a.num_nodes == budget
    assert torch.equal(a.draft_tokens, b.draft_tokens) and torch.equal(a.parents, b.parents)


def test_batched_budget_rows_follow_the_largest_reach(target):
    """Jobs of budgets 1 and 3 share one forward of 3 + 1 rows; each tree equals its own draft in a
    fixed 4-row block."""
    follow, fixed = _service(target, spare_rows=1), _service(target, block_rows=4, spare_rows=None)
    p1, p2 = _prompt(11, 9), _prompt(12, 14)
    (_, f1), (_, f2) = target.teacher_forced(p1), target.teacher_forced(p2)
    jobs = [DraftJob(rid, p[:-1], f[:-1], p[-1], len(p) - 1, "dartree-pruned", TreeKnobs(b, 3, -0.2, 8), None)
            for rid, p, f, b in (("x", p1, f1, 1), ("y", p2, f2, 3))]
    got = [t for t, _ in follow.draft_batch(jobs)]
    for tree, (p, f, b) in zip(got, ((p1, f1, 1), (p2, f2, 3))):
        want = _draft(fixed, p, f, b, rid="solo")
        assert torch.equal(tree.draft_tokens, want.draft_tokens) and torch.equal(tree.parents, want.parents)


def test_spare_rows_is_checked(target):
    with pytest.raises(ValueError, match="spare_rows"):
        _service(target, spare_rows=-1)


@needs_int4
def test_q4_1_rounding_and_kernel_agree():
    """Q4_1 blocks within half a step of the weight; the int4 kernel multiplies by their dequantization."""
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0))
    blocks = quantize_q4_1(w)
    deq = blocks.dequantize()
    step = blocks.d.repeat_interleave(32, 1)
    assert bool(((deq - w).abs() <= step / 2 + 1e-3 * step + 1e-6).all())
    lin = torch.nn.Linear(96, 48, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    mod = torch.nn.Sequential(lin)
    assert quantize_linears_q4(mod, torch.float32) == 1 and isinstance(mod[0], Int4Linear)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(mod(x), x @ deq.T, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="K % 32"):
        quantize_q4_1(torch.zeros(16, 40))


@needs_int4
@pytest.mark.parametrize("budget", [1, 2, 3])
def test_q4_drafter_with_budget_rows_equals_greedy(target, budget):
    """Speculative == greedy at T = 0 with the drafter's linears on the int4 kernel and its rows
    following the budget (float32 target; the drafter's activations float32 on the kernel's
    reference path)."""
    service = _service(target, spare_rows=1, q4_linears=True)
    assert sum(isinstance(m, Int4Linear) for m in service.drafter.modules()) > 0
    assert not any(type(m) is torch.nn.Linear for m in service.drafter.layers.modules())
    prompt = _prompt(30 + budget, 9)
    ref = greedy_reference(target.model, prompt, 24)
    engine = SpecEngine(target, InprocDrafterClient(service), EngineConfig(), max_draft_depth=service.block_rows)
    outs = list(engine.generate("r", prompt, SamplingParams(max_tokens=24, ignore_eos=True),
                                SpecParams("dartree-pruned", budget=budget, width=3, candidates=8)))
    assert [t for o in outs for t in o.token_ids] == ref
    assert sum(o.num_draft_tokens for o in outs) > 0 and service.num_contexts() == 0


def test_q4_default_follows_the_drafter_dtype(target):
    d32 = tiny_drafter(target)
    assert not _want_q4(d32, packed_gemm=True)
    d16 = tiny_drafter(target).to(torch.bfloat16)
    assert _want_q4(d16, packed_gemm=True) == int4_kernel_available()
    assert not _want_q4(d16, packed_gemm=False)




@needs_int4
def test_q4_linears_cover_fc(target):
    """``q4_linears``: the feature projection ``fc`` itself (it is the linear, replaced in the
    drafter) multiplies by the Q4_1 rounding of its weight; the output projection stays the
    borrowed lm_head; without ``q4_linears`` ``fc`` stays dense."""
    dense = _service(target, q4_linears=False)
    w = dense.drafter.fc.weight.detach().clone()
    service = _service(target, q4_linears=True)  # same seed: the same weights before rounding
    assert type(service.drafter.fc) is Int4Linear and type(dense.drafter.fc) is torch.nn.Linear
    assert service.lm_head is target.lm_head()
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(service.drafter.fc(x), x @ quantize_q4_1(w).dequantize().T, atol=1e-4, rtol=1e-4)


@needs_int4
def test_q4_drafter_dense_catch_up_keeps_greedy(target):
    """Speculative == greedy at T = 0 when the drafter's catch-up appends (the prompt, the tokens of
    plain rounds) go through the dense copies of its int4 context projections; they were used."""
    service = _service(target, spare_rows=1, q4_linears=True, catch_up_rows=4)
    fc, _, rows = service.drafter._ctx_dense
    calls = []
    fc.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[:-1].numel()))
    prompt = _prompt(41, 9)
    ref = greedy_reference(target.model, prompt, 24)
    engine = SpecEngine(target, InprocDrafterClient(service), EngineConfig(), max_draft_depth=service.block_rows)
    outs = list(engine.generate("r", prompt, SamplingParams(max_tokens=24, ignore_eos=True),
                                SpecParams("dartree-pruned", budget=3, width=3, candidates=8)))
    assert [t for o in outs for t in o.token_ids] == ref
    assert rows == 4 and calls and min(calls) >= 4  # the prompt's catch-up went dense, short appends did not
    assert _service(target, q4_linears=True, catch_up_rows=None).drafter._ctx_dense is None
