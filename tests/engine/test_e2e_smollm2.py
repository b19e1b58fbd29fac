"""On the real SmolLM2-135M-Instruct target (issue 3 §4, marked ``e2e``; CI converts the GGUF on
first use): greedy ``dartree-pruned`` == ``ar`` token for token in float32 on 8 chat prompts; in
bfloat16 any divergence is logged with the AR run's top-1/top-2 logit gap and must be a near-tie.

Length: the issue asks for 8 prompts x 128 tokens. That took 285 s for the fp32 test alone on 2
busy CPU cores (over the ~4 min budget of one test), so the default here is 8 prompts x 64 tokens;
``DARTREE_E2E_TOKENS=128`` runs the full length (``DARTREE_E2E_BF16_TOKENS`` sets the bf16 length).

Speed: without a trained drafter ``build_inprocess`` uses a random drafter (tau ~ 1), so every
``dartree-pruned`` round verifies a whole tree for ~1 token. The tree budget is 16 (width 4, 16
candidates) instead of the server default 64 for the same reason; the code path (draft -> DARTree
build -> tree verify -> walk -> commit) is the same. A third test drives the real target with an
oracle drafter, so that deep paths are accepted and the KV cache is compacted on the real model too.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from services.params import SamplingParams, SpecParams
from services.verifier.engine import SpecEngine
from tests.doubles import OracleDrafter

pytestmark = pytest.mark.e2e
log = logging.getLogger(__name__)

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about a cat sleeping in the sun.",
    "What is the capital of France, and what is it famous for?",
    "Give me three tips for learning a new programming language.",
    "Translate 'Good morning, how are you?' into Spanish and German.",
    "Summarize the plot of Romeo and Juliet.",
    "How do I make a cup of green tea?",
    "List the first ten prime numbers and explain what a prime number is.",
]
MAX_TOKENS = int(os.environ.get("DARTREE_E2E_TOKENS", "64"))
BF16_TOKENS = int(os.environ.get("DARTREE_E2E_BF16_TOKENS", "64"))
TREE = dict(budget=16, width=4, candidates=16)
# A bf16 divergence is a near-tie when, at that position, the AR run's logit of its own token exceeds
# that of the speculative run's token by at most 4 bf16 ulps (0.5 at |logit| in [16, 32)), and the
# fp32 model's logits of the two tokens differ by at most 0.25.
NEAR_TIE_FP32 = 0.25
NEAR_TIE_BF16_ULPS = 4


def _build(dtype, weights=None, compile=False):
    from services.generate import build_inprocess, encode

    engine, tok, note = build_inprocess(None, None, dtype, weights=weights, compile=compile)
    log.info("%s", note)
    return engine, [encode(tok, p, chat=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def fp32():
    return _build(torch.float32)


def _generate(engine, rid, ids, method, n, **spec):
    outs = list(engine.generate(rid, ids, SamplingParams(max_tokens=n, ignore_eos=True), SpecParams(method, **spec)))
    return [t for o in outs for t in o.token_ids], outs


@pytest.fixture(scope="module")
def ar32(fp32):
    engine, prompts = fp32
    return [_generate(engine, f"ar{i}", ids, "ar", MAX_TOKENS)[0] for i, ids in enumerate(prompts)]


def test_fp32_dartree_pruned_equals_ar(fp32, ar32):
    engine, prompts = fp32
    for i, (ids, ar) in enumerate(zip(prompts, ar32)):
        spec, outs = _generate(engine, f"dt{i}", ids, "dartree-pruned", MAX_TOKENS, **TREE)
        assert len(ar) == MAX_TOKENS
        first = next((j for j, (a, b) in enumerate(zip(ar, spec)) if a != b), None)
        assert spec == ar, f"prompt {i}: dartree-pruned diverges from ar at token {first}"
        assert all(o.num_draft_tokens == TREE["budget"] for o in outs[1:])
    assert engine.num_active() == 0 and engine.drafter.service.num_contexts() == 0


def test_fp32_oracle_drafter_on_the_real_target(fp32, ar32):
    """Deep accepted paths on the real model: every round accepts the full depth, output == ar."""
    engine, prompts = fp32
    for i, (ids, ar) in enumerate(zip(prompts[:4], ar32)):
        oracle = OracleDrafter({"o": ids + ar}, depth=8, distractors=2, vocab_size=engine.vocab_size, seed=i)
        spec_engine = SpecEngine(engine.target, oracle, max_draft_depth=8)
        got, outs = _generate(spec_engine, "o", ids, "dartree-pruned", MAX_TOKENS)
        assert got == ar, f"prompt {i}"
        assert all(o.accept_length == 8 for o in outs[1:-1])


def _ar_logits(engine, prompt, tokens):
    """The AR run's logits for the token after ``prompt + tokens``, computed exactly as the engine's
    AR steps do: its model runner (same KV bucketing), a prompt chunk, then one row per token."""
    from services.tree.batch import causal_segment
    from services.verifier.runner import ModelRunner

    assert len(prompt) <= engine.config.prefill_chunk  # one chunk, as in the engine
    runner = ModelRunner(engine.target, 1, engine.runner.cache.capacity, engine.config.kv_bucket,
                         compile=engine.runner.compiled)  # compiled: the engine's graphs (same model)
    slot = runner.cache.alloc()
    logits = runner.execute([causal_segment(prompt, 0, slot)], torch.tensor([len(prompt) - 1])).logits[0]
    runner.cache.extend(slot, len(prompt))
    for tok in tokens:
        logits = runner.execute([causal_segment([tok], runner.cache.length(slot), slot)]).logits[0]
        runner.cache.extend(slot, 1)
    return logits


def _top2(logits):
    top = logits.float().topk(2)
    return float(top.values[0] - top.values[1]), top.indices.tolist()


def _bf16_ulp(x: float) -> float:
    return 2.0 ** (torch.frexp(torch.tensor(abs(x))).exponent.item() - 1 - 7)


@pytest.mark.parametrize("weights,compile", [pytest.param("bfloat16", False, marks=pytest.mark.slow), ("q4", False),
                                             pytest.param("q4", True, marks=pytest.mark.slow)])
def test_bf16_divergences_are_near_ties(fp32, record_property, weights, compile):
    """Dense bfloat16 and the GGUF's 4-bit blocks (bf16 activations), eager and with compiled steps:
    every place where dartree-pruned and ar part is a near-tie of the AR run (and of the float32
    model). ``make test`` runs the eager 4-bit case (the format ``--weights auto`` picks on our CPU,
    bf16 arithmetic all the same); dense bfloat16 (~130 s on 2 cores) and compiled steps (a minute of
    warm-up) are ``slow`` (``pytest -m slow tests/engine/test_e2e_smollm2.py``)."""
    engine32, _ = fp32
    if compile:
        torch._dynamo.reset()
    engine, prompts = _build(torch.bfloat16, weights, compile)
    report = []
    for i, ids in enumerate(prompts):
        ar, _ = _generate(engine, f"ar{i}", ids, "ar", BF16_TOKENS)
        spec, _ = _generate(engine, f"dt{i}", ids, "dartree-pruned", BF16_TOKENS, **TREE)
        j = next((k for k, (a, b) in enumerate(zip(ar, spec)) if a != b), None)
        if j is None:
            continue
        logits = _ar_logits(engine, ids, ar[:j]).float()
        assert int(logits.argmax()) == ar[j], "replaying the AR run must reproduce its token"
        logits32 = _ar_logits(engine32, ids, ar[:j]).float()
        gap, top2 = _top2(logits)
        margin = float(logits[ar[j]] - logits[spec[j]])  # AR run: its token vs the speculative one
        margin32 = float(logits32[ar[j]] - logits32[spec[j]])
        ulps = margin / _bf16_ulp(float(logits[ar[j]]))
        line = (f"prompt {i}: bf16 dartree-pruned diverges from ar at token {j}: ar {ar[j]} vs {spec[j]}; AR run "
                f"top-2 {top2} gap {gap:.4f}; margin ar-vs-spec token: bf16 {margin:.4f} ({ulps:.0f} ulp), "
                f"fp32 {margin32:.4f}")
        log.warning("%s", line)
        report.append((line, ulps, abs(margin32)))
    record_property("bf16_divergences", [r[0] for r in report])
    for line, ulps, margin32 in report:
        assert ulps <= NEAR_TIE_BF16_ULPS and margin32 <= NEAR_TIE_FP32, f"not a near-tie: {line}"
