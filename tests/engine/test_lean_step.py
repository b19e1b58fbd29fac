"""The runner's lean Llama step (:mod:`services.verifier.lean_step`) against the HF modules' step.

Oracle: the same runner steps through transformers' Llama modules (``runner.lean = None``), on a
second runner over the same target. Checked bitwise, in every weight format, on SmolLM2-135M's
attention geometry: logits and tapped features of prompt chunks, ``ar`` rows, tree verifies and
steps that mix them (q4 also runs the fused q/k/v and gate/up int4 calls). Plus when the lean step
is (not) used.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.testing import tiny_causal_lm
from services.tree.batch import causal_segment
from services.verifier.lean_step import LeanLlamaStep
from services.verifier.runner import ModelRunner
from services.verifier.target import TargetModel
from tests.engine.test_batch_invariance import FORMATS, V, _solo_vs_mixed, _target, _tree_segment


def _steps(runner: ModelRunner, seed: int = 0):
    """Yield the ``StepOutput`` of a fixed sequence of steps on two slots: prompt chunks, then rounds
    mixing an ``ar`` row of one request with a tree verify of the other (or each alone)."""
    rng = random.Random(seed)
    slots = [runner.cache.alloc() for _ in range(2)]
    for s, n in zip(slots, (37, 90)):
        yield runner.execute([causal_segment([rng.randrange(3, V) for _ in range(n)], 0, s)], torch.tensor([n - 1]))
        runner.cache.extend(s, n)
    for step in range(6):
        lengths = [runner.cache.length(s) for s in slots]
        ar = causal_segment([rng.randrange(3, V)], lengths[0], slots[0])
        tree = _tree_segment(rng, 1 + step, lengths[1], slots[1])
        segs = [ar, tree] if step % 3 == 0 else [ar] if step % 3 == 1 else [tree]
        yield runner.execute(segs)
        runner.cache.extend(slots[0], 1)
        runner.cache.commit(slots[1], lengths[1], torch.tensor([0]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_lean_step_equals_the_modules_bitwise(fmt):
    """Every step's logits and features are the HF modules' bits (float32, bfloat16, q4)."""
    target = _target(fmt)
    lean = ModelRunner(target, num_slots=2, capacity=400, kv_bucket=16)
    modules = ModelRunner(target, num_slots=2, capacity=400, kv_bucket=16)
    modules.lean = None
    assert lean.lean is not None
    if fmt == "q4":  # the fused int4 calls run (SmolLM2's q/k/v and gate/up widths fuse)
        (_, _, _, q, k, v, qkv, _, _, gate, up, gate_up, _, _) = lean.lean.layers[0]
        assert qkv._mod is not None and gate_up._mod is not None  # built with the step, before any step ran
        assert qkv.get(q, k, v) is not None and gate_up.get(gate, up) is not None
    n = 0
    for a, b in zip(_steps(lean), _steps(modules)):
        assert torch.equal(a.logits, b.logits), (fmt, n)
        assert torch.equal(a.features, b.features), (fmt, n)
        n += 1
    assert n == 8


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("DARTREE_LEAN_STEP", "0")
    assert ModelRunner(_target("float32"), num_slots=1, capacity=64).lean is None


def test_other_architectures_keep_the_modules():
    """A model that is not ``llama`` (here qwen3, with q/k norms) runs through its modules."""
    model = tiny_causal_lm("qwen3", vocab_size=V, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, max_position_embeddings=256)
    assert not LeanLlamaStep.supports(model)
    assert ModelRunner(TargetModel(model, [0, 1]), num_slots=1, capacity=64).lean is None
    with pytest.raises(ValueError, match="llama"):
        LeanLlamaStep(model, None, {}, [0])


def test_compiled_lean_step_rows_equal_solo_bitwise():
    """The compiled pass (``compile=True`` on CPU: the serving default for q4): every row of a step
    mixing an ``ar`` row with trees of 9 and 17 rows gives bitwise the logits and features of its
    solo step (the one-row graph for the ``ar`` row, the many-row graph for the rest), so plain
    decoding and speculation stay token-identical through it; and its values are the eager step's
    to bfloat16 rounding (inductor reduces the norms in its own order)."""
    from torch._dynamo.utils import counters

    target = _target("q4")
    torch._dynamo.reset()
    counters.clear()
    runner = ModelRunner(target, num_slots=3, capacity=400, kv_bucket=16, compile=True)
    assert runner.compiled and runner.lean is not None and runner.lean.compiled
    runner.warm_up((1, 9))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 3 and not counters["graph_break"]  # one row; many rows; many rows, one logit row
    n = 0
    for step, i, solo, mixed, solo_f, mixed_f in _solo_vs_mixed(runner, steps=4):
        assert torch.equal(solo, mixed), (step, i, (solo - mixed).abs().max().item())
        assert torch.equal(solo_f, mixed_f), (step, i)
        n += 1
    assert n == 12
    for slot in range(3):
        runner.cache.free(slot)
    slot = runner.cache.alloc()  # logits for some rows of a step (a prompt chunk beside decode rows)
    runner.execute([causal_segment(list(range(3, 40)), 0, slot)], torch.tensor([4, 20, 36]))
    out = runner.execute([causal_segment(list(range(3, 40)), 0, slot)], torch.tensor([], dtype=torch.long))
    assert out.logits.shape == (0, V) and out.features.shape[0] == 37  # a chunk before a prompt's last
    runner.cache.free(slot)
    assert counters["stats"]["unique_graphs"] == graphs  # serving's steps compile nothing after the warm-up
    eager = ModelRunner(target, num_slots=3, capacity=400, kv_bucket=16)
    assert not eager.compiled and not eager.lean.compiled
    for (_, _, c, _, cf, _), (_, _, e, _, ef, _) in zip(_solo_vs_mixed(runner, steps=2), _solo_vs_mixed(eager, steps=2)):
        torch.testing.assert_close(c, e, atol=0.1, rtol=0.02)
        torch.testing.assert_close(cf.float(), ef.float(), atol=0.1, rtol=0.02)


def test_auto_compile_rule(monkeypatch):
    """``--compile`` unset: compiled steps for a q4 llama target on CPU only."""
    from services.verifier.runner import auto_compile

    assert auto_compile(_target("q4"))
    assert not auto_compile(_target("float32")) and not auto_compile(_target("bfloat16"))
    monkeypatch.setenv("DARTREE_LEAN_STEP", "0")
    assert not auto_compile(_target("q4"))


def test_compiled_runners_of_different_models_in_one_process():
    """Two compiled runners in one process keep their own graphs: a q4 and a bfloat16 target (other
    modules: fused int4 calls or dense linears) and a second q4 target with other weights, used in
    turn, each give its own eager runner's logits (before each runner had a private frame, the
    second runner ran the first one's graph: ``KeyError: 'qkv'``)."""
    import services.weights as W
    from tests.engine.test_batch_invariance import GEOMETRY, _q4_linears

    other = tiny_causal_lm("llama", **{**GEOMETRY, "seed": 7}, dtype=W.compute_dtype("q4"))
    _q4_linears(other)
    from services.cpu_gemm import pack_linears_bf16

    pack_linears_bf16(other)
    second_q4 = TargetModel(other, [0, 1])
    second_q4.weights = "q4"
    targets = [_target("q4"), _target("bfloat16"), second_q4]
    compiled = [ModelRunner(t, num_slots=1, capacity=128, kv_bucket=16, compile=True) for t in targets]
    eager = [ModelRunner(t, num_slots=1, capacity=128, kv_bucket=16) for t in targets]
    ids = list(range(3, 20))

    def logits(runner):
        slot = runner.cache.alloc()
        try:
            return runner.execute([causal_segment(ids, 0, slot)]).logits
        finally:
            runner.cache.free(slot)

    want = [logits(r) for r in eager]
    assert (want[0] - want[2]).abs().max() > 1.0  # the two q4 targets' logits differ: the check can tell them apart
    for _ in range(2):  # in turn, twice: each call finds its runner's own graph
        for runner, ref in zip(compiled, want):
            torch.testing.assert_close(logits(runner), ref, atol=0.1, rtol=0.02)
