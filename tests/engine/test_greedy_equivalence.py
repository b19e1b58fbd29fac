"""Speculative == plain greedy, token for token, for every method (style.md R8.2).

Three drafters: (a) an oracle that proposes the true continuation plus wrong siblings (everything
accepted, non-trivial KV compaction), (b) random trees (almost nothing accepted), (c) a
real-architecture random DFlash(+Domino) drafter through :class:`DrafterService`. Commit semantics:
an EOS / stop id at every depth of an accepted path, and ``max_tokens`` ending mid-path.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.drafter.service import DFLASH_METHODS, HEAD_METHODS, METHODS
from services.testing import greedy_reference, tiny_drafter, tiny_service, tiny_target
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import SpecEngine

from tests.doubles import OracleDrafter, RandomDrafter, next_output
from tests.engine.conftest import TARGET_KW, V  # noqa: F401  (fixtures: target, llama)
D = 4  # oracle draft depth: a full-accept round emits D + 1 tokens
N = 40  # generated tokens


def _run(engine, rid, prompt, sampling, method="dartree-pruned", **spec):
    outs = list(engine.generate(rid, prompt, sampling, SpecParams(method, **spec)))
    tokens = [t for o in outs for t in o.token_ids]
    return tokens, outs


def _prompt(seed, n=7):
    rng = random.Random(seed)
    return [rng.randrange(3, V - 1) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# (a) oracle drafter
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_oracle_drafter_equals_greedy_and_accepts_full_depth(target, method):
    prompt = _prompt(1)
    ref = greedy_reference(target.model, prompt, N)
    oracle = OracleDrafter({"r": prompt + ref}, depth=D, distractors=2, vocab_size=V, seed=3)
    engine = SpecEngine(target, oracle, max_draft_depth=D)
    tokens, outs = _run(engine, "r", prompt, SamplingParams(max_tokens=N, ignore_eos=True), method)
    assert tokens == ref
    assert outs[0].is_prefill and len(outs[0].token_ids) == 1
    assert outs[-1].finish_reason == "length" and all(o.finish_reason is None for o in outs[:-1])
    rounds = outs[1:]
    if method == "ar":
        assert not oracle.calls and len(rounds) == N - 1
        assert all(o.accept_length == 0 and o.num_draft_tokens == 0 for o in rounds)
    else:
        # tau is maximal: every round but the last (cut by max_tokens) accepts the whole depth.
        assert len(rounds) == -(-(N - 1) // (D + 1))
        assert all(o.accept_length == D and len(o.token_ids) == D + 1 for o in rounds[:-1])
        assert all(o.accepted_per_depth == [1] * o.accept_length for o in rounds)
        assert all(o.num_draft_tokens == c.tree.num_nodes > D for o, c in zip(rounds, oracle.calls))
    assert engine.num_active() == 0
    assert oracle.released == (["r"] if method != "ar" else []) and oracle.num_contexts() == 0


def test_features_handed_to_the_drafter_equal_teacher_forced_features(target):
    """Each round's features (the accepted rows of the verify forward, after compaction) equal a
    fresh causal forward over the committed tokens at those positions."""
    prompt = _prompt(2)
    ref = greedy_reference(target.model, prompt, N)
    oracle = OracleDrafter({"r": prompt + ref}, depth=D, distractors=3, vocab_size=V, seed=4, truth_prob=0.6)
    engine = SpecEngine(target, oracle, max_draft_depth=D)
    tokens, _ = _run(engine, "r", prompt, SamplingParams(max_tokens=N, ignore_eos=True))
    assert tokens == ref
    seq = prompt + ref
    _, fresh = target.teacher_forced(seq)
    assert oracle.calls[0].committed_ids == prompt and oracle.calls[0].start == len(prompt)
    for c in oracle.calls:
        lo = c.start - len(c.committed_ids)
        assert c.committed_ids == seq[lo:c.start]
        assert c.root_token == seq[c.start]
        torch.testing.assert_close(c.features.float(), fresh[lo:c.start].float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_with_mid_path_rejections_equals_greedy(llama, seed):
    prompt = _prompt(10 + seed)
    ref = greedy_reference(llama.model, prompt, N)
    oracle = OracleDrafter({"r": prompt + ref}, depth=6, distractors=2, vocab_size=V, seed=seed, truth_prob=0.5)
    engine = SpecEngine(llama, oracle, max_draft_depth=6)
    tokens, outs = _run(engine, "r", prompt, SamplingParams(max_tokens=N, ignore_eos=True))
    assert tokens == ref
    lengths = {o.accept_length for o in outs[1:-1]}
    assert len(lengths) > 2  # a mix of full and partial acceptance really happened


# ---------------------------------------------------------------------------------------------
# (b) random drafter
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_random_drafter_equals_greedy(target, method):
    prompt = _prompt(3)
    ref = greedy_reference(target.model, prompt, N)
    drafter = RandomDrafter(V, budget=16, depth=5, seed=7)
    engine = SpecEngine(target, drafter, max_draft_depth=5)
    tokens, outs = _run(engine, "r", prompt, SamplingParams(max_tokens=N, ignore_eos=True), method)
    assert tokens == ref
    assert outs[-1].finish_reason == "length"
    if method != "ar":
        assert sum(o.num_draft_tokens for o in outs) > 5 * len(outs)  # real trees were verified
    assert engine.num_active() == 0 and drafter.num_contexts() == 0


# ---------------------------------------------------------------------------------------------
# (c) real-architecture random DFlash (+ Domino) drafter through DrafterService
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def domino_service(target):
    return tiny_service(target, tiny_drafter(target, block_size=8))


@pytest.mark.parametrize("method", DFLASH_METHODS)
def test_dflash_domino_drafter_equals_greedy(target, domino_service, method):
    prompt = _prompt(4)
    ref = greedy_reference(target.model, prompt, N)
    engine = SpecEngine(target, InprocDrafterClient(domino_service), max_draft_depth=8)
    tokens, outs = _run(engine, "r", prompt, SamplingParams(max_tokens=N, ignore_eos=True), method,
                        budget=12, width=3, candidates=8)
    assert tokens == ref
    if method != "ar":
        assert all(o.num_draft_tokens > 0 for o in outs[1:])
        assert all(o.accept_length <= o.num_draft_tokens for o in outs)
    assert engine.num_active() == 0 and domino_service.num_contexts() == 0


@pytest.mark.parametrize("method", [m for m in DFLASH_METHODS if m not in HEAD_METHODS])
def test_plain_dflash_drafter_equals_greedy(llama, method):
    """A DFlash drafter without the head (shift_label False: block_size - 1 draft slots)."""
    svc = tiny_service(llama, tiny_drafter(llama, projector_type=None, block_size=6))
    prompt = _prompt(5)
    ref = greedy_reference(llama.model, prompt, N)
    engine = SpecEngine(llama, InprocDrafterClient(svc), max_draft_depth=16)
    tokens, outs = _run(engine, "r", prompt, SamplingParams(max_tokens=N, ignore_eos=True), method, budget=10)
    assert tokens == ref
    assert max(o.num_draft_tokens for o in outs) <= (5 if method == "dflash" else 10)
    assert svc.num_contexts() == 0


def test_interleaved_requests_keep_separate_state(llama):
    """Two requests stepped alternately through one engine and one drafter service."""
    svc = tiny_service(llama, tiny_drafter(llama))
    engine = SpecEngine(llama, InprocDrafterClient(svc), max_draft_depth=8)
    prompts = {"a": _prompt(6), "b": _prompt(7, n=12)}
    methods = {"a": "dartree-pruned", "b": "ddtree"}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(max_tokens=25, ignore_eos=True), SpecParams(methods[rid], budget=8))
    got = {rid: [] for rid in prompts}
    live = set(prompts)
    while live:
        for rid in sorted(live):
            out = next_output(engine, rid)
            got[rid] += out.token_ids
            if out.finish_reason:
                live.discard(rid)
    for rid, p in prompts.items():
        assert got[rid] == greedy_reference(llama.model, p, 25)
    assert engine.num_active() == 0 and svc.num_contexts() == 0


# ---------------------------------------------------------------------------------------------
# Commit semantics: EOS / stop ids at every depth of an accepted path, max_tokens mid-path
# ---------------------------------------------------------------------------------------------
ROUNDS_CHECKED = 2
SPAN = 1 + ROUNDS_CHECKED * (D + 1)  # prefill token + two full rounds


@pytest.fixture(scope="module")
def distinct_case(llama):
    """A prompt whose first SPAN greedy tokens are pairwise distinct, so a stop id placed at
    position p first occurs at p (p = 1 + (D + 1) * r + (k - 1) is depth k of round r + 1)."""
    for seed in range(100):
        prompt = _prompt(100 + seed)
        ref = greedy_reference(llama.model, prompt, SPAN + 8)
        if len(set(ref[:SPAN])) == SPAN:
            return prompt, ref
    pytest.fail("no prompt with distinct greedy tokens found")


def _oracle_engine(target, prompt, ref, bait=None):
    oracle = OracleDrafter({"r": prompt + ref}, depth=D, distractors=2, vocab_size=V, seed=9, bait=bait)
    return SpecEngine(target, oracle, max_draft_depth=D), oracle


def _check_usage(outs, n_tokens):
    emitted = [t for o in outs for t in o.token_ids]
    assert len(emitted) == n_tokens
    # every emitted token is either the prefill token, an accepted draft, or a round's bonus;
    # nothing cut off after a terminator is counted as accepted
    for o in outs[1:]:
        assert o.accept_length <= len(o.token_ids) <= o.accept_length + 1
        assert o.accepted_per_depth == [1] * o.accept_length


@pytest.mark.parametrize("pos", range(SPAN))
@pytest.mark.parametrize("how", ["stop_id", "eos"])
def test_terminator_at_every_depth_of_an_accepted_path(llama, distinct_case, pos, how):
    prompt, ref = distinct_case
    stop = ref[pos]
    if how == "eos":
        target = tiny_target("llama", eos_token_id=stop, **TARGET_KW)
        sampling = SamplingParams(max_tokens=SPAN + 8)
    else:
        target = llama
        sampling = SamplingParams(max_tokens=SPAN + 8, stop_token_ids=(stop,), ignore_eos=True)
    engine, oracle = _oracle_engine(target, prompt, ref)
    tokens, outs = _run(engine, "r", prompt, sampling)
    assert tokens == ref[:pos]  # stops exactly before the terminator, which is not emitted
    assert outs[-1].finish_reason == "stop" and all(o.finish_reason is None for o in outs[:-1])
    assert outs[-1].stop_token_id == (stop if how == "stop_id" else None)  # the stop_reason the API reports
    assert all(o.stop_token_id is None for o in outs[:-1])
    _check_usage(outs, pos)
    if pos > 0:
        depth = (pos - 1) % (D + 1) + 1  # depth of the terminator inside its round (D + 1 = bonus)
        assert len(outs) == 1 + (pos - 1) // (D + 1) + 1
        assert outs[-1].accept_length == depth - 1 == len(outs[-1].token_ids)
        assert all(o.accept_length == D for o in outs[1:-1])
    else:
        assert len(outs) == 1 and outs[0].is_prefill
    assert engine.num_active() == 0 and oracle.num_contexts() == 0


def test_eos_is_ignored_with_ignore_eos(distinct_case):
    prompt, ref = distinct_case
    target = tiny_target("llama", eos_token_id=ref[3], **TARGET_KW)
    engine, _ = _oracle_engine(target, prompt, ref)
    tokens, outs = _run(engine, "r", prompt, SamplingParams(max_tokens=SPAN, ignore_eos=True))
    assert tokens == ref[:SPAN] and outs[-1].finish_reason == "length"


def test_stop_id_in_a_rejected_branch_has_no_effect(llama, distinct_case):
    prompt, ref = distinct_case
    bait = next(t for t in range(3, V) if t not in ref)
    engine, oracle = _oracle_engine(llama, prompt, ref, bait=bait)
    tokens, outs = _run(engine, "r", prompt, SamplingParams(max_tokens=SPAN, stop_token_ids=(bait,), ignore_eos=True))
    assert any(bait in c.tree.draft_tokens.tolist() for c in oracle.calls)
    assert tokens == ref[:SPAN] and outs[-1].finish_reason == "length"


@pytest.mark.parametrize("max_tokens", range(1, SPAN + 1))
def test_max_tokens_ends_mid_path(llama, distinct_case, max_tokens):
    prompt, ref = distinct_case
    engine, oracle = _oracle_engine(llama, prompt, ref)
    tokens, outs = _run(engine, "r", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert tokens == ref[:max_tokens]
    assert outs[-1].finish_reason == "length"
    _check_usage(outs, max_tokens)
    if max_tokens > 1:
        j = (max_tokens - 2) % (D + 1) + 1  # tokens the last round contributes (1..D+1)
        assert len(outs[-1].token_ids) == j and outs[-1].accept_length == min(j, D)
    assert engine.num_active() == 0 and oracle.num_contexts() == 0
