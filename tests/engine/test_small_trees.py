"""Small trees (B = 1, 2, 3) through the real drafter service: lossless, batched == solo, and the
budget's reach (output projection over B slots only, a short inference block) at T = 0 in float32."""

from __future__ import annotations

import random

import pytest
import torch

from services.drafter.service import DrafterService
from services.testing import greedy_reference, tiny_drafter
from services.verifier.drafter_client import DraftJob, InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import EngineConfig, SpecEngine
from services.spec import TreeKnobs
from tests.engine.conftest import TARGET_KW, V  # noqa: F401  (fixture: target)
from tests.engine.test_batched import _run_batched

N = 30
SMALL = [1, 2, 3]
REACH_METHODS = ["dartree-pruned", "seqheap", "ddtree"]


def _service(target, block_rows=None, **kw):
    d = tiny_drafter(target, seed=5, block_size=8)
    return DrafterService(d, target.embed_tokens(), target.lm_head(), block_rows=block_rows, **kw)


def _engine(target, service, **cfg):
    return SpecEngine(target, InprocDrafterClient(service), EngineConfig(**cfg), max_draft_depth=service.block_rows)


def _prompt(seed, n=9):
    rng = random.Random(seed)
    return [rng.randrange(3, V - 1) for _ in range(n)]


@pytest.mark.parametrize("block_rows", [None, 3])
@pytest.mark.parametrize("budget", SMALL)
@pytest.mark.parametrize("method", REACH_METHODS + ["dartree-fixed"])
def test_small_budget_equals_greedy(target, method, budget, block_rows):
    service = _service(target, block_rows)
    prompt = _prompt(budget)
    ref = greedy_reference(target.model, prompt, N)
    engine = _engine(target, service)
    outs = list(engine.generate("r", prompt, SamplingParams(max_tokens=N, ignore_eos=True),
                                SpecParams(method, budget=budget, width=3, candidates=8)))
    assert [t for o in outs for t in o.token_ids] == ref
    assert all(0 < o.num_draft_tokens <= budget for o in outs[1:])
    assert engine.num_active() == 0 and service.num_contexts() == 0


@pytest.mark.parametrize("budget", [1, 2, 3, 4, 20])
@pytest.mark.parametrize("method", REACH_METHODS)
def test_reach_cut_builds_the_tree_of_every_slot(target, method, budget):
    """``draft_batch`` projects only the ``B`` slots a B-node tree can reach; its tree equals the
    one built over every slot's logits (a fixed block: rows that follow the budget change the
    drafts, tests/engine/test_draft_cost_paths.py)."""
    service = _service(target, spare_rows=None)
    prompt = _prompt(7, 12)
    _, feats = target.teacher_forced(prompt)
    knobs = TreeKnobs(budget, 3, -0.2, 8)
    job = DraftJob("a", prompt[:-1], feats[:-1], prompt[-1], len(prompt) - 1, method, knobs, None)
    tree, _ = service.draft_batch([job])[0]
    hd, base = service.block_logits_batch([("a", prompt[-1], len(prompt) - 1)])[0]
    assert base.shape[0] == 8
    with torch.inference_mode():
        want = service._build(method, knobs, hd, base, prompt[-1])
    assert torch.equal(tree.draft_tokens, want.draft_tokens) and torch.equal(tree.parents, want.parents)
    assert tree.num_nodes == min(budget, want.num_nodes) and int(tree.depths.max()) <= budget
    service.release("a")


def test_block_rows_is_checked(target):
    with pytest.raises(ValueError, match="block_rows"):
        _service(target, block_rows=1)
    with pytest.raises(ValueError, match="block_rows"):
        _service(target, block_rows=9)


@pytest.mark.parametrize("block_rows", [None, 4])
def test_small_trees_batched_equal_solo(target, block_rows):
    """Budgets 1, 2, 3, a default-budget tree and ``ar`` share steps: each request's tokens equal
    its solo run."""
    service = _service(target, block_rows)
    specs = [SpecParams("dartree-pruned", budget=1), SpecParams("dartree-pruned", budget=2, width=2),
             SpecParams("ddtree", budget=3), SpecParams("dartree-pruned"), SpecParams("ar"),
             SpecParams("seqheap", budget=2)]
    reqs = [(f"r{i}", _prompt(20 + i, 3 + 4 * i), SamplingParams(max_tokens=12 + i, ignore_eos=True), s)
            for i, s in enumerate(specs)]
    arrivals = {0: reqs[:3], 2: reqs[3:]}
    engine = _engine(target, service, max_running=8, prefill_chunk=4, max_step_tokens=64)
    got, sizes = _run_batched(engine, arrivals)
    assert max(sizes) >= 4
    for rid, prompt, sampling, spec in reqs:
        solo = _engine(target, service, max_running=1)
        want = [t for o in solo.generate("solo", prompt, sampling, spec) for t in o.token_ids]
        assert got[rid] == want, (rid, spec)
        assert got[rid] == greedy_reference(target.model, prompt, sampling.max_tokens)
    assert service.num_contexts() == 0


def test_round_info_carries_the_tokens_left(target):
    """The goodput policy's probe gate weighs a first draft's prompt catch-up against the tokens a
    request may still emit: every decode round's :class:`RoundInfo` carries ``max_tokens`` minus
    what the request generated so far (the policy's fallback without it is a learnt mean length)."""
    engine = _engine(target, _service(target), max_running=2)
    seen: dict[str, list[int | None]] = {}
    begin = engine.policy.begin_step

    def record(infos, **kw):
        for info in infos:
            seen.setdefault(info.rid, []).append(info.remaining)
        return begin(infos, **kw)

    engine.policy.begin_step = record
    lengths = {"a": 12, "b": 7}
    arrivals = {0: [(rid, _prompt(n), SamplingParams(max_tokens=n, ignore_eos=True), SpecParams("dartree-pruned"))
                    for rid, n in lengths.items()]}
    tokens, _ = _run_batched(engine, arrivals)
    for rid, n in lengths.items():
        assert len(tokens[rid]) == n
        left = seen[rid]
        assert left[0] == n - 1  # the prefill step emitted the first token
        assert all(x > y for x, y in zip(left, left[1:])) and min(left) >= 1, left
