"""Engine input validation, state release on finish / abort / error, and the end of the context window."""

from __future__ import annotations

import math

import pytest

from services.drafter.service import DFLASH_METHODS, HEAD_METHODS, METHODS
from services.testing import greedy_reference, tiny_drafter, tiny_service, tiny_target
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import EngineConfig, SpecEngine
from tests.doubles import OracleDrafter, next_output

V = 96
CTX = 48


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2, max_position_embeddings=CTX)


@pytest.fixture()
def service(target):
    return tiny_service(target, tiny_drafter(target, block_size=6))


@pytest.fixture()
def engine(target, service):
    return SpecEngine(target, InprocDrafterClient(service), max_draft_depth=6)


@pytest.mark.parametrize("kw,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_p=math.nan), "top_p"), (dict(top_k=-1), "top_k"),
])
def test_bad_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw).check()


@pytest.mark.parametrize("kw,match", [
    (dict(method="eagle"), "unknown speculative method 'eagle'"), (dict(method=""), "unknown speculative method"),
    (dict(budget=0), "budget"), (dict(budget=5000), "budget"), (dict(width=0), "width"),
    (dict(candidates=0), "candidates"), (dict(depth_bonus=0.5), "depth_bonus"),
    (dict(depth_bonus=math.nan), "depth_bonus"),
])
def test_bad_spec_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SpecParams(**kw).check()


def test_unknown_method_message_lists_the_choices():
    with pytest.raises(ValueError) as e:
        SpecParams("eagle").check()
    assert all(m in str(e.value) for m in METHODS)


@pytest.mark.parametrize("prompt,max_tokens,match", [
    ([], 4, "empty"),
    ([5, -1, 6], 4, r"\[0, 96\)"),
    ([5, V, 6], 4, r"\[0, 96\)"),
    ([5, 6.0, 7], 4, r"\[0, 96\)"),
    ([5] * (CTX - 3), 4, "exceeds the context window of 48"),
    ([5] * CTX, 1, "exceeds the context window"),
])
def test_bad_requests_are_rejected_without_state(engine, service, prompt, max_tokens, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens), SpecParams("dartree-pruned"))
    assert engine.num_active() == 0 and service.num_contexts() == 0


def test_context_limit_from_the_engine_config(target):
    engine = SpecEngine(target, None, EngineConfig(max_context=20))
    with pytest.raises(ValueError, match="context window of 20"):
        engine.add_request("r", [5] * 15, SamplingParams(max_tokens=6), SpecParams("ar"))
    engine.add_request("r", [5] * 15, SamplingParams(max_tokens=5), SpecParams("ar"))  # exactly fits


def test_duplicate_request_id(engine):
    engine.add_request("r", [5, 6], SamplingParams(max_tokens=4), SpecParams("ddtree"))
    with pytest.raises(ValueError, match="already active"):
        engine.add_request("r", [5, 6], SamplingParams(max_tokens=4), SpecParams("ddtree"))
    engine.abort("r")
    assert engine.num_active() == 0


def test_drafting_method_without_a_drafter(target):
    engine = SpecEngine(target, None)
    with pytest.raises(ValueError, match="needs a drafter"):
        engine.add_request("r", [5, 6], SamplingParams(max_tokens=4), SpecParams("dflash"))
    assert engine.num_active() == 0
    out = list(engine.generate("r", [5, 6], SamplingParams(max_tokens=4, ignore_eos=True), SpecParams("ar")))
    assert [t for o in out for t in o.token_ids] == greedy_reference(target.model, [5, 6], 4)


@pytest.mark.parametrize("method", sorted(HEAD_METHODS))
def test_head_method_on_a_drafter_without_head_fails_cleanly(target, method):
    svc = tiny_service(target, tiny_drafter(target, projector_type=None, block_size=6))
    engine = SpecEngine(target, InprocDrafterClient(svc))
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=8), SpecParams(method))
    next_output(engine, "r")  # prefill
    with pytest.raises(ValueError, match="correction head"):
        next_output(engine, "r")
    assert engine.num_active() == 0 and svc.num_contexts() == 0


def test_unknown_request_step_raises_key_error(engine):
    with pytest.raises(KeyError):
        next_output(engine, "nope")


@pytest.mark.parametrize("method", DFLASH_METHODS)  # the Domino drafter's methods
def test_finish_and_abort_free_all_state(engine, service, method):
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    list(engine.generate("done", [5, 6, 7], sp, SpecParams(method)))  # finishes by length
    assert engine.num_active() == 0 and service.num_contexts() == 0
    engine.add_request("a", [5, 6, 7], sp, SpecParams(method))
    engine.add_request("b", [8, 9], sp, SpecParams(method))
    for _ in range(2):
        next_output(engine, "a")
        next_output(engine, "b")
    assert engine.num_active() == 2
    if method != "ar":
        assert service.num_contexts() == 2
    engine.abort("a")
    assert engine.num_active() == 1 and service.num_contexts() == (0 if method == "ar" else 1)
    engine.abort("a")  # idempotent
    engine.abort("never-added")
    engine.abort("b")
    assert engine.num_active() == 0 and service.num_contexts() == 0
    with pytest.raises(KeyError):
        next_output(engine, "a")
    # the id can be reused after an abort, and the new request starts from scratch
    out = [t for o in engine.generate("a", [5, 6, 7], sp, SpecParams(method)) for t in o.token_ids]
    assert out == greedy_reference(engine.target.model, [5, 6, 7], 12)
    assert engine.num_active() == 0 and service.num_contexts() == 0


def test_abort_before_prefill(engine, service):
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5), SpecParams("dartree-pruned"))
    engine.abort("a")
    assert engine.num_active() == 0 and service.num_contexts() == 0


class _CheckedRunner:
    """Wraps an engine's model runner and asserts every row of every step stays inside the context
    window (``max_pos``: the highest position seen; ``max_rows``: rows of each step)."""

    def __init__(self, engine, limit):
        self.limit, self.max_pos, self.max_rows = limit, -1, []
        self._execute = engine.runner.execute
        engine.runner.execute = self.execute

    def execute(self, segments, logit_rows=None):
        for seg in segments:
            top = seg.start + int(seg.position_offsets.max())
            assert top < self.limit, f"a step reaches position {top} >= context {self.limit}"
            self.max_pos = max(self.max_pos, top)
        self.max_rows.append(sum(seg.num_rows for seg in segments))
        return self._execute(segments, logit_rows)


@pytest.mark.parametrize("method", DFLASH_METHODS)  # the Domino drafter's methods
@pytest.mark.parametrize("remaining", [0, 1, 2, 3])
def test_near_the_context_end_the_tree_shrinks(target, service, method, remaining):
    """The prompt leaves ``remaining`` free positions after ``max_tokens`` = all of them: the engine
    must cap the tree depth at the positions left, never go past the window, and still equal greedy."""
    prompt = [(7 * i + 3) % (V - 1) for i in range(CTX - 1 - remaining)]
    max_tokens = CTX - len(prompt)
    engine = SpecEngine(target, InprocDrafterClient(service), max_draft_depth=6)
    checked = _CheckedRunner(engine, CTX)
    outs = list(engine.generate("r", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                SpecParams(method, budget=10)))
    tokens = [t for o in outs for t in o.token_ids]
    assert tokens == greedy_reference(target.model, prompt, max_tokens)
    assert outs[-1].finish_reason == "length"
    assert engine.num_active() == 0 and service.num_contexts() == 0
    assert checked.max_rows and checked.max_pos < CTX  # every step went through the window check


@pytest.mark.parametrize("remaining", [1, 2, 3])
def test_near_the_context_end_with_an_oracle(target, remaining):
    """With an oracle the depth cap is what limits the tree: the last rounds must shrink to the room left."""
    prompt = [(5 * i + 1) % (V - 1) for i in range(CTX - 1 - remaining - 7)]  # one full round, then capped
    max_tokens = CTX - len(prompt)
    ref = greedy_reference(target.model, prompt, max_tokens)
    oracle = OracleDrafter({"r": prompt + ref + [0] * 20}, depth=6, distractors=1, vocab_size=V)
    engine = SpecEngine(target, oracle, max_draft_depth=6)
    checked = _CheckedRunner(engine, CTX)
    outs = list(engine.generate("r", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                SpecParams("dartree-pruned")))
    assert [t for o in outs for t in o.token_ids] == ref
    for c in oracle.calls:
        assert c.max_depth == min(6, CTX - c.start - 1)
    assert [c.max_depth for c in oracle.calls] == [6, remaining]
    assert [o.accept_length for o in outs[1:]] == [6, remaining]
    assert checked.max_pos == CTX - 1


# ---------------------------------------------------------------------------------------------
# Reported library gaps (these fail until fixed; see the docstrings)
# ---------------------------------------------------------------------------------------------
def test_top_k_must_be_an_integer():
    """``SamplingParams`` range-checks ``top_k`` but not its type: 2.5 is accepted and only fails
    later inside ``torch.topk`` (a TypeError from ``step``, not a ValueError at admission)."""
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2.5, temperature=1.0).check()


def test_tiny_positive_temperature_behaves_like_greedy(target):
    """A finite temperature > 0 passes validation, but ``target_probs`` divides the logits by it
    first (services/tree/accept.py ``x = logits.float() / temperature``): at T = 1e-40 that
    overflows to inf, softmax gives NaN, and ``sample_rows`` then returns the last vocabulary id
    for every row. Either reject such temperatures or make the softmax robust (subtract the row
    max before dividing, so the limit is the argmax)."""
    prompt = [5, 6, 7]
    ref = greedy_reference(target.model, prompt, 8)
    # below ~1.4e-45 the temperature (and a top_p) rounds to 0 in float32: 0 / 0 made NaN rows there
    cases = [dict(temperature=t) for t in (1e-6, 1e-20, 1e-40, 1e-46, 5e-324)]
    cases += [dict(temperature=1.0, top_p=p) for p in (1e-46, 5e-324)]
    cases += [dict(temperature=1e-46, min_p=0.1)]
    for case in cases:
        try:
            sp = SamplingParams(max_tokens=8, seed=0, ignore_eos=True, **case)
        except ValueError:
            continue  # rejecting a degenerate temperature is fine too
        engine = SpecEngine(target, None)
        got = [t for o in engine.generate("r", prompt, sp, SpecParams("ar")) for t in o.token_ids]
        assert got == ref, f"{case}: {got} (greedy {ref})"


class _SpyClient(InprocDrafterClient):
    def __init__(self, service):
        super().__init__(service)
        self.calls = []

    def submit(self, jobs):
        handles = super().submit(jobs)
        for job, handle in zip(jobs, handles):
            handle.job = job
        return handles

    def collect(self, handle):
        tree, dt = super().collect(handle)
        self.calls.append((handle.job.start, handle.job.max_depth, tree.max_depth))
        return tree, dt


def test_engine_respects_the_drafter_position_limit():
    """Issue 3 §3: "near the end of the context window **or the drafter's position limit**, shrink
    the tree or fall back to plain decoding". The engine caps the depth by its own context window
    only (services/verifier/engine.py ``_round``: ``room = self.max_context - req.start - 1``); the
    drafter's limit (``DrafterService.info()["max_position"]``, ``PeerInfo.max_position`` over ZMQ) is
    never consulted, so a drafter trained for 24 positions is asked to place draft tokens far
    beyond them. Expected: no drafted token at a position >= the drafter's limit, output still greedy."""
    target = tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2, max_position_embeddings=256)
    drafter = tiny_drafter(target, block_size=6)
    drafter.config.max_position_embeddings = 24
    svc = tiny_service(target, drafter)
    assert svc.info()["max_position"] == 24
    client = _SpyClient(svc)
    engine = SpecEngine(target, client, max_draft_depth=6)
    prompt = [5, 6, 7, 8, 9]
    tokens = [t for o in engine.generate("r", prompt, SamplingParams(max_tokens=40, ignore_eos=True),
                                         SpecParams("dartree-pruned", budget=8)) for t in o.token_ids]
    assert tokens == greedy_reference(target.model, prompt, 40)
    assert client.calls
    beyond = [(s, d) for s, _, d in client.calls if s + d >= 24]
    assert not beyond, f"draft tokens placed at positions >= the drafter's limit 24: (start, depth) {beyond[:5]}"
