"""Penalties, logit bias, min_tokens and min_p under tree speculation == plain decoding.

(a) the per-row processed logits of a tree equal a token-by-token reference along each
root-to-node path; (b) for every method and drafter, speculative output equals plain (``ar``)
decoding with the same options, token for token, solo and in a mixed batch.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.testing import tiny_drafter, tiny_service
from services.tree import derive_buffers
from services.tree.draft_tree import tree_from_parents
from services.tree.logit_processors import (LogitOptions, path_counts, process_logits, sample_probs,
                                            token_counts)
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import EngineConfig, SpecEngine

from tests.doubles import FullTreeDrafter, OracleDrafter, ScriptedDrafterClient
from tests.engine.conftest import TARGET_KW, V  # noqa: F401  (fixtures: target, llama)
from tests.engine.test_batched import _run_batched

N = 24
EOS = 2


def _ref_row(logits: list[float], opts: LogitOptions, prompt: list[int], output: list[int]) -> list[float]:
    """One row, one token at a time in plain Python: min_tokens, bias, penalties (vLLM's order)."""
    out = list(logits)
    if len(output) < opts.min_tokens:
        for t in opts.terminator_ids:
            out[t] = float("-inf")
    for t, b in opts.logit_bias:
        out[t] += b
    for t in range(len(out)):
        c = output.count(t)
        if t in prompt or c:
            out[t] = out[t] / opts.repetition_penalty if out[t] > 0 else out[t] * opts.repetition_penalty
        out[t] -= opts.frequency_penalty * c + opts.presence_penalty * (c > 0)
    return out


def test_tree_rows_equal_token_by_token_reference():
    torch.manual_seed(0)
    vocab = 12
    prompt, emitted = [3, 4, 3], [5, 1, 5]  # emitted includes the root token (1 ... then root 5)
    #          rows: 1  2  3  4  5  6  7   (row 0 = root 5)
    tokens = [5, 6, 5, 5, 7, 6, 2]
    parents = [-1, -1, 0, 0, 2, 4, 5]
    buffers = derive_buffers(tree_from_parents(tokens, parents), emitted[-1])
    r = buffers.input_ids.numel()
    logits = torch.randn(r, vocab) * 3
    opts = LogitOptions(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.6,
                        logit_bias=((6, -3.0), (9, 2.5)), min_tokens=6, terminator_ids=(2, 7), min_p=0.1)
    counts = path_counts(token_counts(emitted, vocab), buffers.input_ids, buffers.tree_mask)
    out_index = len(emitted) + buffers.position_offsets  # the output position each row predicts
    got = process_logits(logits, opts, counts, token_counts(prompt, vocab) > 0, out_index)
    for i in range(r):
        path = buffers.input_ids[buffers.tree_mask[i]].tolist()[1:]  # draft tokens root -> i
        want = _ref_row(logits[i].tolist(), opts, prompt, emitted + path)
        assert torch.allclose(got[i], torch.tensor(want), atol=1e-5), i
    assert counts[6].sum() == len(emitted) + 4  # root, then 5, 5, 7, 6 on row 6's path
    probs = sample_probs(got, 0.7, min_p=0.5)
    top = probs.max(dim=-1, keepdim=True).values
    assert torch.all((probs == 0) | (probs >= 0.5 * top - 1e-6))


def test_min_tokens_yields_where_only_a_terminator_is_allowed():
    """A row whose every other token is already at -inf (a complete grammar) keeps its terminators:
    completion wins over ``min_tokens``; the other early rows lose them, later rows keep them."""
    torch.manual_seed(1)
    logits = torch.randn(3, 6)
    logits[1, [0, 1, 3, 5]] = float("-inf")  # row 1 allows only the terminators 2 and 4
    opts = LogitOptions(min_tokens=5, terminator_ids=(2, 4))
    got = process_logits(logits, opts, output_index=torch.tensor([0, 1, 5]))
    assert torch.isinf(got[0, [2, 4]]).all() and torch.equal(got[0, [0, 1, 3, 5]], logits[0, [0, 1, 3, 5]])
    assert torch.equal(got[1], logits[1]) and torch.equal(got[2], logits[2])


# ---------------------------------------------------------------------------------------------
# speculative == plain with the same options
# ---------------------------------------------------------------------------------------------
def _prompt(seed, n=7):
    rng = random.Random(seed)
    return [rng.randrange(3, V - 1) for _ in range(n)]


OPTIONS = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=1.0),
    "repetition": dict(repetition_penalty=1.8),
    "repetition<1": dict(repetition_penalty=0.6),
    "all penalties": dict(presence_penalty=0.8, frequency_penalty=-0.5, repetition_penalty=1.3),
    "bias forces": dict(logit_bias={11: 100.0}, frequency_penalty=0.2),
    "min_p seeded": dict(temperature=0.9, seed=7, min_p=0.3, presence_penalty=0.5),
}


def _ar(target, prompt, sampling):
    engine = SpecEngine(target, None)
    return [t for o in engine.generate("r", prompt, sampling, SpecParams("ar")) for t in o.token_ids]


def _spec(engine, prompt, sampling, method):
    outs = list(engine.generate("r", prompt, sampling, SpecParams(method)))
    return [t for o in outs for t in o.token_ids], outs


class BaitDrafter(ScriptedDrafterClient):
    """A full tree over ``tokens`` up to ``depth`` (the tokens a request's logit_bias forbids)."""

    def __init__(self, tokens: list[int], depth: int):
        super().__init__()
        self.tokens, self.depth = tokens, depth

    def draft_job(self, job):
        self.check(job)
        tokens, parents, frontier = [], [], [-1]
        for _ in range(self.depth_cap(job, self.depth)):
            nxt = []
            for p in frontier:
                for t in self.tokens:
                    tokens.append(t)
                    parents.append(p)
                    nxt.append(len(tokens) - 1)
            frontier = nxt
        return self.record(job, tree_from_parents(tokens, parents))


@pytest.fixture(scope="module")
def service(llama):
    return tiny_service(llama, tiny_drafter(llama, seed=3, block_size=6))


def _engines(llama, service, prompt, ref):
    """(name, engine, method) for every drafter under test."""
    yield "oracle", SpecEngine(llama, OracleDrafter({"r": prompt + ref}, depth=4, distractors=2, vocab_size=V,
                                                    seed=3, truth_prob=0.8), max_draft_depth=4), "dartree-pruned"
    for method in ("dartree-pruned", "ddtree", "domino"):
        yield method, SpecEngine(llama, InprocDrafterClient(service), max_draft_depth=6), method
    yield "full tree", SpecEngine(llama, FullTreeDrafter(V, depth=1), max_draft_depth=1), "dartree-pruned"


@pytest.mark.parametrize("name", list(OPTIONS))
def test_speculative_equals_plain_with_options(llama, service, name):
    prompt = _prompt(5)
    sampling = SamplingParams(max_tokens=N, ignore_eos=True, **OPTIONS[name])
    ref = _ar(llama, prompt, sampling)
    plain = _ar(llama, prompt, SamplingParams(max_tokens=N, ignore_eos=True,
                                              **{k: v for k, v in OPTIONS[name].items() if k in ("temperature", "seed")}))
    assert ref != plain  # the option changes the output
    if name == "bias forces":
        assert ref.count(11) >= N // 2
    for label, engine, method in _engines(llama, service, prompt, ref):
        tokens, outs = _spec(engine, prompt, sampling, method)
        assert tokens == ref, label
        if label in ("oracle", "full tree"):
            assert sum(o.accept_length for o in outs) > 0, label


def test_logit_bias_forbids_the_tokens_the_drafter_proposes(llama, service):
    prompt = _prompt(6)
    base = _ar(llama, prompt, SamplingParams(max_tokens=N, ignore_eos=True))
    banned = sorted(set(base[:6]))
    sampling = SamplingParams(max_tokens=N, ignore_eos=True, logit_bias={t: -100.0 for t in banned})
    ref = _ar(llama, prompt, sampling)
    assert not set(ref) & set(banned)
    bait = BaitDrafter(banned, depth=3)  # drafts only banned tokens: every row verifies, none is accepted
    engine = SpecEngine(llama, bait, max_draft_depth=3)
    tokens, outs = _spec(engine, prompt, sampling, "dartree-pruned")
    assert tokens == ref and bait.calls and all(o.accept_length == 0 for o in outs)
    for label, engine, method in _engines(llama, service, prompt, ref):
        assert _spec(engine, prompt, sampling, method)[0] == ref, label


def test_min_tokens_holds_back_a_stop_token_across_tree_rows(llama, service):
    prompt = _prompt(7)
    base = _ar(llama, prompt, SamplingParams(max_tokens=N, ignore_eos=True))
    stop = base[2]
    early = _ar(llama, prompt, SamplingParams(max_tokens=N, stop_token_ids=(stop,)))
    assert len(early) <= 2
    sampling = SamplingParams(max_tokens=N, stop_token_ids=(stop,), min_tokens=9)
    ref = _ar(llama, prompt, sampling)
    assert len(ref) >= 9 and stop not in ref[:9]
    for label, engine, method in _engines(llama, service, prompt, ref):
        assert _spec(engine, prompt, sampling, method)[0] == ref, label
    masked_eos = SamplingParams(max_tokens=N, logit_bias={EOS: 100.0}, min_tokens=5)
    ref = _ar(llama, prompt, masked_eos)
    assert len(ref) == 5  # EOS forced by the bias, held back for 5 tokens, then it ends the request
    for label, engine, method in _engines(llama, service, prompt, ref):
        assert _spec(engine, prompt, masked_eos, method)[0] == ref, label


def test_mixed_batch_with_options_equals_solo_plain(llama, service):
    cases = [(f"q{i}", _prompt(20 + i), SamplingParams(max_tokens=N, ignore_eos=True, **OPTIONS[name]), method)
             for i, (name, method) in enumerate([("presence", "dartree-pruned"), ("all penalties", "ddtree"),
                                                  ("min_p seeded", "domino"), ("repetition", "ar"),
                                                  ("bias forces", "dartree-pruned")])]
    cases.append(("plain", _prompt(30), SamplingParams(max_tokens=N, ignore_eos=True), "domino"))
    refs = {rid: _ar(llama, prompt, s) for rid, prompt, s, _ in cases}
    engine = SpecEngine(llama, InprocDrafterClient(service), EngineConfig(max_running=8), max_draft_depth=6)
    tokens, _ = _run_batched(engine, {0: [(rid, prompt, s, SpecParams(method)) for rid, prompt, s, method in cases]})
    assert tokens == refs


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                dict(min_p=1.5), dict(min_tokens=-1), dict(max_tokens=3, min_tokens=4),
                                dict(logit_bias={3: 101.0}), dict(logit_bias={-1: 1.0}),
                                dict(presence_penalty=float("nan"))])
def test_out_of_range_options_are_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw).check()


def test_logit_bias_outside_the_vocabulary_is_refused(llama):
    engine = SpecEngine(llama, None)
    with pytest.raises(ValueError, match="logit_bias token id 128"):
        engine.add_request("r", [3, 4], SamplingParams(logit_bias={128: 1.0}), SpecParams("ar"))
