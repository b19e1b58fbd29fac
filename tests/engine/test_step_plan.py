"""The step plan (``services.verifier.scheduler``): literal plans, the engine's plan of its requests,
and the overlap groups."""

from __future__ import annotations

import pytest

from services.verifier.scheduler import Candidate, OverlapGroups, PlanEntry, StepPlan, plan_step


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


def test_the_engine_plans_its_requests(llama):
    """``SpecEngine.plan_step``: slots, prompt progress, who may draft, the drafter's owed context."""
    from services.testing import tiny_drafter, tiny_service
    from services.verifier.drafter_client import InprocDrafterClient
    from services.verifier.engine import EngineConfig, SamplingParams, SpecEngine, SpecParams

    engine = SpecEngine(llama, InprocDrafterClient(tiny_service(llama, tiny_drafter(llama, block_size=6))),
                        EngineConfig(max_running=3, prefill_chunk=4, max_step_tokens=64), max_draft_depth=5)
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request("spec", [5, 6, 7], sampling, SpecParams("dartree-pruned"))
    engine.add_request("ar", [8, 9], sampling, SpecParams("ar"))
    engine.add_request("long", list(range(10, 20)), sampling, SpecParams("dartree-pruned"))
    engine.step_batch(["spec", "ar", "long"])  # the short prompts finish prefilling, "long" has 4 of 10
    plan = engine.plan_step(["long", "spec", "ar", "spec"])
    slots = {rid: engine._reqs[rid].slot for rid in ("spec", "ar", "long")}
    assert plan == StepPlan((PlanEntry("spec", slots["spec"], "decode", None, can_draft=True, owed=3),
                             PlanEntry("ar", slots["ar"], "decode", None, can_draft=False, owed=2),
                             PlanEntry("long", slots["long"], "chunk", (4, 4))), 64, 4)
    with pytest.raises(KeyError):
        engine.plan_step(["nobody"])


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
