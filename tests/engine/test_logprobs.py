"""Logprobs of emitted tokens are the target's raw ones, for every method (bug-classes B19, B03/B04).

Reference: ``log_softmax`` of one plain causal forward of the target over prompt + output, read at
the position before each output token. At T = 0 every speculative method must give the same
per-token logprobs and top-k alternatives as plain ``ar`` decoding and as that reference (fp32,
atol 1e-4), across round boundaries and under mid-path rejections; the rows are cut at the same
token as the output (EOS / stop id excluded, ``max_tokens``); at T > 0 they are still the raw
(temperature-free) logprobs; nothing is computed when the request does not ask.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.drafter.service import DFLASH_METHODS as METHODS  # the Domino drafter's methods
from services.protocol import LOGPROB_FLOOR
from services.testing import greedy_reference, tiny_drafter, tiny_service
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import SpecEngine, token_logprobs

from tests.doubles import OracleDrafter
from tests.engine.conftest import TARGET_KW, V  # noqa: F401  (fixtures: target, llama)
N = 24
K = 5
ATOL = 1e-4


def _prompt(seed: int, n: int = 7) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, V - 1) for _ in range(n)]


def _run(engine: SpecEngine, prompt: list[int], sampling: SamplingParams, method: str, **spec):
    outs = list(engine.generate("r", prompt, sampling, SpecParams(method, **spec)))
    ids = [t for o in outs for t in o.token_ids]
    for o in outs:  # one row per emitted token, every round (prefill included)
        assert o.logprobs is not None and len(o.logprobs.logprobs) == len(o.token_ids)
        assert len(o.logprobs.top_ids) == len(o.logprobs.top_logprobs) == len(o.token_ids)
    lps = [x for o in outs for x in o.logprobs.logprobs]
    tops = [(i, v) for o in outs for i, v in zip(o.logprobs.top_ids, o.logprobs.top_logprobs)]
    return ids, lps, tops, outs


def _reference(target, prompt: list[int], ids: list[int], k: int):
    """``(logprobs [n], top values [n, k], top ids [n, k])`` from one causal forward over prompt + ids."""
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([prompt + ids]), use_cache=False).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(ids)], dim=-1)
    chosen = lp.gather(1, torch.tensor(ids)[:, None])[:, 0]
    top_v, top_i = lp.topk(k, dim=-1)
    return chosen, top_v, top_i


def _assert_matches(target, prompt, ids, lps, tops, k=K):
    chosen, top_v, top_i = _reference(target, prompt, ids, k)
    torch.testing.assert_close(torch.tensor(lps), chosen, atol=ATOL, rtol=0)
    assert [i for i, _ in tops] == top_i.tolist()
    torch.testing.assert_close(torch.tensor([v for _, v in tops]), top_v, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def ar_case(target):
    """Plain ``ar`` decoding with logprobs: the baseline every method must reproduce."""
    prompt = _prompt(1)
    engine = SpecEngine(target, None)
    ids, lps, tops, _ = _run(engine, prompt, SamplingParams(max_tokens=N, ignore_eos=True, logprobs=K), "ar")
    assert ids == greedy_reference(target.model, prompt, N)
    _assert_matches(target, prompt, ids, lps, tops)
    return prompt, ids, lps, tops


@pytest.fixture(scope="module")
def service(target):
    return tiny_service(target, tiny_drafter(target, block_size=8))


@pytest.mark.parametrize("method", METHODS)
def test_every_method_gives_the_logprobs_of_plain_decoding(target, service, ar_case, method):
    """The real DFlash+Domino drafter (random weights: short, varied acceptance) for every method."""
    prompt, ar_ids, ar_lps, ar_tops = ar_case
    engine = SpecEngine(target, InprocDrafterClient(service), max_draft_depth=8)
    ids, lps, tops, _ = _run(engine, prompt, SamplingParams(max_tokens=N, ignore_eos=True, logprobs=K), method,
                             budget=12, width=3, candidates=8)
    assert ids == ar_ids
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(ar_lps), atol=ATOL, rtol=0)
    assert [i for i, _ in tops] == [i for i, _ in ar_tops]
    torch.testing.assert_close(torch.tensor([v for _, v in tops]), torch.tensor([v for _, v in ar_tops]),
                               atol=ATOL, rtol=0)
    _assert_matches(target, prompt, ids, lps, tops)


@pytest.mark.parametrize("seed", [0, 1])
def test_deep_acceptance_with_rejections_reads_the_parent_rows(target, seed):
    """An oracle drafter: several accepted drafts per round, a shuffled tree (the accepted path is not
    rows 0..L-1), rejections mid-path; each draft's logprob must come from its parent's row."""
    prompt = _prompt(10 + seed)
    ref = greedy_reference(target.model, prompt, N)
    oracle = OracleDrafter({"r": prompt + ref}, depth=5, distractors=2, vocab_size=V, seed=seed, truth_prob=0.6)
    engine = SpecEngine(target, oracle, max_draft_depth=5)
    ids, lps, tops, outs = _run(engine, prompt, SamplingParams(max_tokens=N, ignore_eos=True, logprobs=3),
                                "dartree-pruned")
    assert ids == ref
    assert max(o.accept_length for o in outs) >= 3  # multi-token rounds really happened
    _assert_matches(target, prompt, ids, lps, tops, k=3)


@pytest.mark.parametrize("how", ["stop_id", "max_tokens"])
@pytest.mark.parametrize("cut", [1, 4, 7, 11])
def test_rows_are_cut_at_the_same_token_as_the_output(llama, how, cut):
    prompt, ref = next((p, r) for p in map(_prompt, range(100, 200))
                       if (r := greedy_reference(llama.model, p, N))[cut] not in r[:cut])  # stop id first at cut
    oracle = OracleDrafter({"r": prompt + ref}, depth=4, distractors=1, vocab_size=V, seed=2)
    engine = SpecEngine(llama, oracle, max_draft_depth=4)
    sampling = (SamplingParams(max_tokens=N, stop_token_ids=(ref[cut],), ignore_eos=True, logprobs=0)
                if how == "stop_id" else SamplingParams(max_tokens=cut, ignore_eos=True, logprobs=0))
    ids, lps, tops, outs = _run(engine, prompt, sampling, "dflash")
    assert ids == ref[:cut] and outs[-1].finish_reason == ("stop" if how == "stop_id" else "length")
    assert all(t == ([], []) for t in tops)  # logprobs=0: the token's own logprob only
    _assert_matches(llama, prompt, ids, lps, tops, k=0)


def test_temperature_does_not_change_the_reported_logprobs(llama):
    """At T > 0 the tokens are sampled from the tempered distribution; the logprobs stay the raw ones."""
    prompt = _prompt(4)
    engine = SpecEngine(llama, None)
    ids, lps, tops, _ = _run(engine, prompt, SamplingParams(max_tokens=12, temperature=1.7, seed=5, top_k=20,
                                                            ignore_eos=True, logprobs=2), "ar")
    _assert_matches(llama, prompt, ids, lps, tops, k=2)


def test_nothing_is_computed_unless_asked(llama):
    engine = SpecEngine(llama, None)
    outs = list(engine.generate("r", _prompt(5), SamplingParams(max_tokens=5), SpecParams("ar")))
    assert all(o.logprobs is None for o in outs)


def test_token_logprobs_is_finite_and_clamped():
    logits = torch.tensor([[0.0, -float("inf"), 3.0], [float("nan"), 1.0, 1.0]])
    lp = token_logprobs(logits, [1, 2], 2)
    assert lp.logprobs[0] == LOGPROB_FLOOR and all(LOGPROB_FLOOR <= x <= 0 for r in lp.top_logprobs for x in r)
    assert token_logprobs(logits[:0], [], 3).logprobs == []


def test_top_logprobs_list_ties_in_greedy_order():
    """Ties are broken by ascending id, as ``torch.argmax`` (greedy decoding) breaks them: the first
    entry is the greedy token even when more than k tokens tie for the maximum, equal values are
    listed lowest id first, and the kept set is the k best with the lowest ids among ties."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randint(-3, 3, (4, 40), generator=gen).float()  # many exact ties
        lp = token_logprobs(logits, logits.argmax(-1).tolist(), 6)
        for row, ids, vals in zip(logits, lp.top_ids, lp.top_logprobs):
            assert ids[0] == int(row.argmax())
            assert vals == sorted(vals, reverse=True)
            assert all(a < b for a, b, x, y in zip(ids, ids[1:], vals, vals[1:]) if x == y)
            ref = sorted(range(row.numel()), key=lambda i: (-float(row[i]), i))[:6]
            assert ids == ref
    assert token_logprobs(torch.zeros(2, 5), [0, 0], 0).top_ids == [[], []]


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0])
def test_sampling_params_refuse_bad_logprobs(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad).check()
