"""A drafter that goes away never fails a request: its rounds decode plainly (the same tokens) and,
once the drafter is back, each request's next draft carries its whole committed history.

Oracles: greedy decoding of the target alone (``greedy_reference``) and the scripted drafter's
context contract (``ScriptedDrafterClient.check``: a job's committed ids must start where the
drafter's context for that request ends, so a resync that left positions out fails it).
"""

from __future__ import annotations

import pytest

from services.testing import greedy_reference
from services.params import SamplingParams, SpecParams
from services.verifier.engine import EngineConfig, SpecEngine
from services.verifier.remote_drafter import DrafterUnavailable
from tests.doubles import OracleDrafter, next_output
from tests.engine.conftest import V  # noqa: F401  (fixture: llama)

D, N = 4, 40
PROMPTS = {"a": [5, 17, 33, 9, 60, 2 + 40], "b": [7, 7, 91, 12]}


class RestartingOracle(OracleDrafter):
    """An oracle drafter whose process can die: while ``down`` every submitted draft fails with
    ``DrafterUnavailable`` at collect (``at="collect"``, a death after submission) or at submit
    (``at="submit"``); ``restart()`` loses every context, as a new drafter process has none."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.down, self.at, self.failed = False, "collect", 0

    def submit(self, jobs):
        if self.down and self.at == "submit":
            self.failed += 1
            raise DrafterUnavailable("lost the connection to the drafter (submit)")
        return super().submit(jobs)

    def collect(self, handle):
        if self.down:
            self.failed += 1
            raise DrafterUnavailable("lost the connection to the drafter (draft)")
        return super().collect(handle)

    def restart(self) -> None:
        self.ctx_len.clear()
        self.down = False


def _run(engine, oracle, plan):
    """Step both requests together; ``plan[k]`` is called before step ``k``. Returns tokens per request."""
    sampling = SamplingParams(max_tokens=N, ignore_eos=True)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, sampling, SpecParams("dartree-pruned", budget=8))
    tokens = {rid: [] for rid in PROMPTS}
    active = list(PROMPTS)
    for k in range(400):
        if k in plan:
            plan[k]()
        res = engine.step_batch(list(active))
        for rid, out in res.items():
            assert not isinstance(out, BaseException), out
            if out is not None:
                tokens[rid] += out.token_ids
                if out.finish_reason is not None:
                    active.remove(rid)
        if not active:
            return tokens
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("at", ["collect", "submit"])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_drafter_death_decodes_plainly_then_resyncs(llama, at, overlap):
    refs = {rid: greedy_reference(llama.model, p, N) for rid, p in PROMPTS.items()}
    oracle = RestartingOracle({rid: PROMPTS[rid] + refs[rid] for rid in PROMPTS}, depth=D, distractors=1,
                              vocab_size=V, seed=1)
    oracle.at = at
    engine = SpecEngine(llama, oracle, EngineConfig(overlap=overlap), max_draft_depth=D)
    seen = {}

    def kill():
        oracle.down = True

    def while_down():
        seen["calls_while_down"] = len(oracle.calls)
        seen["up_while_down"] = engine.drafter_up

    def back():
        seen["calls_before_back"] = len(oracle.calls)
        oracle.restart()
        engine.set_drafter_up(True)

    tokens = _run(engine, oracle, {3: kill, 6: while_down, 8: back})
    assert tokens == refs  # every request finished with exactly the plain-decoding tokens
    assert oracle.failed >= 1 and seen["up_while_down"] is False
    assert seen["calls_before_back"] == seen["calls_while_down"]  # no draft was asked for while down
    resyncs = [c for c in oracle.calls[seen["calls_before_back"]:] if len(c.committed_ids) == c.start]
    assert {c.request_id for c in resyncs} == set(PROMPTS)  # each sent its whole history once back
    for c in resyncs:
        assert c.committed_ids == (PROMPTS[c.request_id] + refs[c.request_id])[:c.start]
    accepted_after = sum(1 for c in oracle.calls[seen["calls_before_back"]:] if c.tree.num_nodes)
    assert accepted_after >= 2  # and drafting resumed


def test_plain_rounds_while_down_are_resent_even_without_a_failed_draft(llama):
    """Rounds the engine ran plainly because it was told the drafter is down (no draft failed) are
    part of the history the next draft carries; going down releases the request's drafter context."""
    prompt = PROMPTS["a"]
    ref = greedy_reference(llama.model, prompt, N)
    oracle = OracleDrafter({"r": prompt + ref}, depth=D, distractors=1, vocab_size=V, seed=2)
    engine = SpecEngine(llama, oracle, max_draft_depth=D)
    engine.add_request("r", prompt, SamplingParams(max_tokens=N, ignore_eos=True), SpecParams("dartree-pruned"))
    out = [t for _ in range(3) for t in next_output(engine, "r").token_ids]
    engine.set_drafter_up(False)
    n_calls = len(oracle.calls)
    out += [t for _ in range(3) for t in next_output(engine, "r").token_ids]
    assert len(oracle.calls) == n_calls
    assert oracle.released == ["r"]  # its context was released at once (a draining drafter need not wait)
    engine.set_drafter_up(True)
    while len(out) < N:
        out += next_output(engine, "r").token_ids
    assert out == ref
    assert len(oracle.calls) > n_calls and oracle.calls[n_calls].committed_ids == (prompt + ref)[:oracle.calls[n_calls].start]
