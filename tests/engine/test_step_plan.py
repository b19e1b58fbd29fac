"""The step plan (``services.verifier.scheduler``): literal plans with their knobs and row budget,
the engine's candidates, the engine running exactly a plan, and the overlap groups."""

from __future__ import annotations

import pytest

from services.params import SpecParams
from services.spec import TreeKnobs
from services.verifier.policy import FixedPolicy
from services.verifier.scheduler import (Candidate, OverlapGroups, PlanEntry, RoundInfo, StepPlan, make_plan,
                                         plan_step)


def test_plan_of_three_requests_one_mid_prefill():
    """Decode rounds first (priority order kept), then the prompt chunk, bounded by prefill_chunk;
    the policy is told the chunk's rows."""
    cands = [Candidate("a", slot=0, prompt_len=5, prefilled=5, can_draft=True, owed=3),
             Candidate("b", slot=1, prompt_len=20, prefilled=8),  # mid-prefill: 12 prompt tokens left
             Candidate("c", slot=2, prompt_len=4, prefilled=4, can_draft=False, owed=1)]
    plan = plan_step(cands, max_step_tokens=12, prefill_chunk=8)
    assert plan == StepPlan(entries=(PlanEntry("a", 0, "decode", None, can_draft=True, owed=3),
                                     PlanEntry("c", 2, "decode", None, can_draft=False, owed=1),
                                     PlanEntry("b", 1, "chunk", (8, 8))),
                            max_step_tokens=12, chunk_rows=8)
    assert [e.rid for e in plan.decodes] == ["a", "c"] and [e.rid for e in plan.chunks] == ["b"]


def test_chunks_are_bounded_by_the_prompt_and_their_rows_by_the_step():
    cands = [Candidate("p", 0, prompt_len=30, prefilled=0), Candidate("q", 1, prompt_len=7, prefilled=4)]
    plan = plan_step(cands, max_step_tokens=12, prefill_chunk=16)
    assert [e.chunk for e in plan.entries] == [(0, 16), (4, 3)]
    assert plan.chunk_rows == 12  # 19 asked, capped at the step's rows
    assert plan_step([], 12, 16) == StepPlan((), 12, 0)


@pytest.mark.parametrize("cands, limits, why", [
    ([Candidate("a", 0, 3, 3), Candidate("a", 1, 3, 0)], (12, 8), "twice"),
    ([Candidate("a", 0, 3, 3)], (0, 8), ">= 1"),
    ([Candidate("a", 0, 3, 3)], (12, 0), ">= 1"),
])
def test_bad_plans_are_refused(cands, limits, why):
    with pytest.raises(ValueError, match=why):
        plan_step(cands, *limits)


def _decoding(rid, slot, spec, depth=5, tree=True, can_draft=True, owed=1, in_flight=None):
    info = RoundInfo(rid, spec.method or "dartree-pruned", 0.0, can_draft, spec.budget is not None, owed)
    return Candidate(rid, slot, 4, 4, can_draft, owed, info=info, spec=spec, depth=depth, tree=tree,
                     in_flight=in_flight)


KNOBS = TreeKnobs(8, 4, -0.2, 16)


def test_the_plan_carries_each_rounds_knobs_and_sizes_the_chunks_to_the_rows_left():
    """Knobs resolved per round (explicit budget 6, the default 8, none for a round that cannot
    draft, the in-flight draft's own); rows = 1 + the draft's most nodes (a chain: its depth)."""
    cands = [_decoding("a", 0, SpecParams(budget=6)),
             _decoding("b", 1, SpecParams("dflash"), depth=3, tree=False),
             _decoding("c", 2, SpecParams("ar"), can_draft=False, owed=0),
             _decoding("d", 3, SpecParams(), in_flight=TreeKnobs(2, 4, -0.2, 16)),
             Candidate("p", 4, prompt_len=30, prefilled=0)]
    plan = make_plan(cands, FixedPolicy(defaults=KNOBS), max_step_tokens=20, prefill_chunk=16, num_running=5)
    assert plan == StepPlan((PlanEntry("a", 0, "decode", None, True, 1, TreeKnobs(6, 4, -0.2, 16), rows=7),
                             PlanEntry("b", 1, "decode", None, True, 1, KNOBS, rows=4),
                             PlanEntry("c", 2, "decode", None, False, 0, None, rows=1),
                             PlanEntry("d", 3, "decode", None, True, 1, TreeKnobs(2, 4, -0.2, 16), rows=3),
                             PlanEntry("p", 4, "chunk", (0, 5), rows=5)), 20, 16)


def test_rounds_run_while_rows_are_left_and_the_first_entry_always_runs():
    cands = [_decoding("a", 0, SpecParams(budget=6)), _decoding("b", 1, SpecParams()),
             _decoding("c", 2, SpecParams()), Candidate("p", 3, prompt_len=30, prefilled=0)]
    plan = make_plan(cands, FixedPolicy(defaults=KNOBS), max_step_tokens=8, prefill_chunk=16, num_running=4)
    assert [(e.rid, e.rows) for e in plan.entries] == [("a", 7), ("b", 9)]  # c and the chunk wait
    alone = make_plan([Candidate("p", 3, prompt_len=30, prefilled=0)], FixedPolicy(), 8, 16, 1)
    assert alone.entries == (PlanEntry("p", 3, "chunk", (0, 8), rows=8),)
    big = make_plan([_decoding("a", 0, SpecParams(budget=6))], FixedPolicy(defaults=KNOBS), 2, 16, 1)
    assert [(e.rid, e.rows) for e in big.entries] == [("a", 7)]  # over the budget, but the first runs


class _PlainFor(FixedPolicy):
    """The fixed policy, except a plain round (no drafter call) for the requests in ``plain``."""

    def __init__(self, plain, **kw):
        super().__init__(**kw)
        self.plain = set(plain)

    def draft_knobs(self, rid, spec):
        return None if rid in self.plain else super().draft_knobs(rid, spec)


def test_the_engine_plans_its_requests_and_runs_exactly_the_plan(llama):
    """``SpecEngine.candidates``: slots, prompt progress, who may draft, the drafter's owed context;
    ``step(plan)``: the chunk of the plan's size, a decode round without knobs is plain, one with
    knobs drafts at most its budget."""
    from services.params import SamplingParams
    from services.testing import tiny_drafter, tiny_service
    from services.verifier.drafter_client import InprocDrafterClient
    from services.verifier.engine import EngineConfig, SpecEngine

    engine = SpecEngine(llama, InprocDrafterClient(tiny_service(llama, tiny_drafter(llama, block_size=6))),
                        EngineConfig(max_running=4, prefill_chunk=4, max_step_tokens=64), max_draft_depth=5,
                        policy=_PlainFor({"plain"}, defaults=TreeKnobs(3, 2, -0.2, 8)))
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request("spec", [5, 6, 7], sampling, SpecParams("dartree-pruned"))
    engine.add_request("ar", [8, 9], sampling, SpecParams("ar"))
    engine.add_request("long", list(range(10, 20)), sampling, SpecParams("dartree-pruned"))
    engine.add_request("plain", [21, 22], sampling, SpecParams("dartree-pruned"))
    engine.step_batch(["spec", "ar", "long", "plain"])  # the short prompts finish prefilling, "long" has 4 of 10
    plan = plan_step(engine.candidates(["long", "spec", "ar", "spec", "plain"]), 64, 4)
    slots = {rid: engine._reqs[rid].slot for rid in ("spec", "ar", "long", "plain")}
    assert plan == StepPlan((PlanEntry("spec", slots["spec"], "decode", None, can_draft=True, owed=3),
                             PlanEntry("ar", slots["ar"], "decode", None, can_draft=False, owed=2),
                             PlanEntry("plain", slots["plain"], "decode", None, can_draft=True, owed=2),
                             PlanEntry("long", slots["long"], "chunk", (4, 4))), 64, 4)
    with pytest.raises(KeyError):
        engine.candidates(["nobody"])
    plan = make_plan(engine.candidates(["long", "spec", "ar", "plain"]), engine.policy, 7, 4, 4)
    assert [(e.rid, e.knobs.budget if e.knobs else None, e.rows) for e in plan.entries] == \
        [("spec", 3, 4), ("ar", None, 1), ("plain", None, 1), ("long", None, 1)]
    out = engine.step(plan)
    assert list(out) == ["spec", "ar", "plain", "long"] and out["long"] is None
    assert engine._reqs["long"].prefilled == 5  # the plan's one-row chunk, not the 4 prefill_chunk allows
    assert out["spec"].drafted and 0 < out["spec"].num_draft_tokens <= 3
    assert not out["plain"].drafted and out["plain"].num_draft_tokens == 0
    assert engine.last_step.rows == 4 + 1 + 1 + 1 and engine.last_step.prefill_tokens == 1


def test_overlap_groups_take_turns_and_rebalance():
    g = OverlapGroups()
    drafting = {"a", "b", "c"}  # "x" drafts nothing: it runs every step
    assert g.pick(["a", "b", "c", "x"], drafting) == ["a", "c", "x"]  # a -> 0, b -> 1, c -> 0
    assert g.pick(["b", "c", "x", "a"], drafting) == ["b", "x"]
    g.forget("a")
    g.forget("c")
    assert g.pick(["b", "d", "e"], {"b", "d", "e"}) == ["d", "e"]  # newcomers join the smaller group
    assert g.group == {"b": 1, "d": 0, "e": 0} and g.turn == 1
    assert g.pick(["b", "x"], {"b"}) == ["b", "x"] and g.turn == 1  # one drafter: no turns
