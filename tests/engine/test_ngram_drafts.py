"""n-gram chains in drafted trees through the engine: the output never changes, acceptance rises.

spec == ar token for token at T = 0 (style.md R8.2) and, seeded, at T > 0 (the tree walk accepts a
node only when it equals the target's own sample at its parent, so an n-gram node needs no draft
distribution); batched == solo; on a request whose text repeats, the chains are accepted.
"""

from __future__ import annotations

import random

import pytest

from services.drafter.service import DFLASH_METHODS
from services.params import SamplingParams, SpecParams
from services.testing import greedy_reference, tiny_drafter, tiny_service
from services.verifier.drafter_client import InprocDrafterClient
from services.verifier.engine import SpecEngine
from tests.engine.conftest import V  # fixtures: target, llama
from tests.engine.test_seeded_sampling import _run as run_batched

N = 48
TREE = dict(budget=4, width=3, candidates=8)


def _prompt(seed, n=7):
    rng = random.Random(seed)
    return [rng.randrange(3, V - 1) for _ in range(n)]


def _service(tgt, ngram_nodes=4, **kw):
    return tiny_service(tgt, tiny_drafter(tgt, block_size=8, **kw),
                        {"ngram_nodes": ngram_nodes} if ngram_nodes else None)


def _run(engine, prompt, sampling, method="dartree-pruned", rid="r", **spec):
    outs = list(engine.generate(rid, prompt, sampling, SpecParams(method, **{**TREE, **spec})))
    return [t for o in outs for t in o.token_ids], outs[1:]


@pytest.mark.parametrize("method", ["dflash", "ddtree", "domino", "dartree-pruned"])
def test_spec_with_ngram_chains_equals_greedy(target, method):
    """One method of each tree shape: chain, heap, rolled-out chain, pruned supertree."""
    assert method in DFLASH_METHODS
    svc = _service(target)
    for seed in (4, 9):
        prompt = _prompt(seed)
        ref = greedy_reference(target.model, prompt, N)
        engine = SpecEngine(target, InprocDrafterClient(svc), max_draft_depth=8)
        tokens, rounds = _run(engine, prompt, SamplingParams(max_tokens=N, ignore_eos=True), method, rid=f"r{seed}")
        assert tokens == ref, (method, seed)
        assert all(o.accept_length <= o.num_draft_tokens for o in rounds)
    assert svc.ngram.proposed > 0 and svc.num_contexts() == 0 and not svc.ngram._index


def test_ngram_chains_are_accepted_where_the_output_repeats(llama):
    """The tiny target's greedy output falls into repeated runs; the chains copy them (the random
    drafter alone accepts almost nothing)."""
    prompt = _prompt(4)
    ref = greedy_reference(llama.model, prompt, 60)
    accepted = {}
    for nodes in (0, 4):
        svc = _service(llama, nodes)
        engine = SpecEngine(llama, InprocDrafterClient(svc), max_draft_depth=8)
        tokens, rounds = _run(engine, prompt, SamplingParams(max_tokens=60, ignore_eos=True))
        assert tokens == ref
        accepted[nodes] = (sum(o.accept_length for o in rounds), len(rounds))
    assert accepted[4][0] >= accepted[0][0] + 10 and accepted[4][1] < accepted[0][1]  # tau up, fewer rounds
    assert svc.ngram.accepted >= 10 and svc.ngram.accepted <= svc.ngram.proposed


def test_seeded_sampling_with_ngram_chains_equals_plain_sampling(llama):
    """T > 0: the tokens are the plain seeded samples whatever the tree holds."""
    svc = _service(llama)
    for temperature, seed in ((0.7, 3), (1.0, 5), (0.3, 8)):
        sp = SamplingParams(max_tokens=N, temperature=temperature, seed=seed, ignore_eos=True)
        ar, _ = _run(SpecEngine(llama, None), _prompt(6), sp, "ar")
        spec, _ = _run(SpecEngine(llama, InprocDrafterClient(svc), max_draft_depth=8), _prompt(6), sp)
        assert spec == ar, (temperature, seed)
    assert svc.ngram.proposed > 0


def test_batched_requests_keep_separate_histories(llama):
    """Two requests stepped together through one drafter: each equals its solo greedy run."""
    svc = _service(llama)
    engine = SpecEngine(llama, InprocDrafterClient(svc), max_draft_depth=8)
    prompts = {"a": _prompt(4), "b": _prompt(11)}
    sp = SamplingParams(max_tokens=N, ignore_eos=True)
    out = run_batched(engine, {rid: (p, sp, SpecParams("dartree-pruned", **TREE)) for rid, p in prompts.items()})
    for rid, p in prompts.items():
        assert out[rid] == greedy_reference(llama.model, p, N), rid
    assert svc.ngram.proposed > 0 and svc.num_contexts() == 0


@pytest.mark.slow
def test_smollm2_repeating_a_sentence_accepts_the_chain():
    """SmolLM2-135M-Instruct with the shipped drafter, asked to repeat a sentence: the chains raise
    tau (benchmarks/bench_ngram.py measured 1.33 -> 3.33) and the tokens do not change."""
    import torch

    from benchmarks.bench_ngram import SUMMARY, run
    from services.drafter.ngram_drafts import NgramDrafts
    from services.generate import build_inprocess, encode

    engine, tok, _ = build_inprocess(None, None, torch.float32)
    svc = engine.drafter.service
    ids = encode(tok, SUMMARY, chat=True)
    svc.ngram = None
    off = run(engine, ids, 48, "off")
    svc.ngram = NgramDrafts()
    on = run(engine, ids, 48, "on")
    assert on["tokens"] == off["tokens"]
    assert on["tau"] >= off["tau"] + 0.5 and svc.ngram.accepted > 0
