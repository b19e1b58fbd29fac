"""Batch invariance: a request's logits and tokens do not depend on who shares its step.

Oracle: the same request run alone (one segment per step, the runner's solo call). A greedy ``ar``
row and two tree verifies of different widths (9 and 17 rows) share steps, with contexts across
several KV buckets and mates whose contexts are longer than the request's, so that the step's widest
segment and longest KV length are the mates'. Formats: float32, bfloat16 and q4 (the decoder
linears' Q4_1 blocks served by torch's int4 kernel, as ``--weights q4`` loads a GGUF), on a tiny
random model with SmolLM2-135M's attention geometry.

In bfloat16 and q4 the logits are bitwise equal (their linears' row results do not depend on the
row count: :func:`test_linear_rows_per_format`). float32's linears run MKL's sgemm, whose rows change
in their last bits with the call's row count, so the float32 runner test swaps the target's linears
for a row-at-a-time ``F.linear``: everything else in the step (attention, norms, rotary, the
logit-row gather) is then checked bitwise too, and the served float32 linears are checked to float32
rounding with identical tokens.
"""

from __future__ import annotations

import random
import types

import pytest
import torch
import torch.nn.functional as F

from services import weights as W
from services.testing import random_tree, tiny_causal_lm, tiny_service
from services.tree import derive_buffers
from services.tree.batch import Segment, causal_segment, split_rows
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import EngineConfig, SpecEngine
from services.verifier.runner import ModelRunner
from services.verifier.target import TargetModel

V = 128
FORMATS = ["float32", "bfloat16", "q4"]


# SmolLM2-135M's attention geometry (9 query heads, 3 KV heads, head dim 64), two layers, small MLP
GEOMETRY = dict(vocab_size=V, hidden_size=576, intermediate_size=128, num_layers=2, num_heads=9, num_kv_heads=3,
                max_position_embeddings=512, init_std=0.05)


def _q4_linears(model) -> None:
    """Every decoder linear of a bfloat16 ``model`` replaced by its Q4_1 blocks served 4-bit, as
    ``--weights q4`` loads a GGUF (:func:`services.weights.apply_q4`), in place."""
    import gguf
    from gguf.quants import quantize

    for layer in model.model.layers:
        for name, lin in list(layer.named_modules()):
            if isinstance(lin, torch.nn.Linear):
                raw = quantize(lin.weight.detach().float().numpy(), gguf.GGMLQuantizationType.Q4_1)
                parent, attr = name.rsplit(".", 1)
                setattr(layer.get_submodule(parent), attr, W.Int4Linear(W.parse_q4_1(raw), None, torch.bfloat16))


def _target(fmt: str) -> TargetModel:
    """A tiny target in weight format ``fmt``, with the linears a server gives that format."""
    from services.cpu_gemm import pack_linears_bf16

    if fmt == "q4" and not W.int4_kernel_available():
        pytest.skip("torch without the int4 CPU kernel")
    model = tiny_causal_lm("llama", **GEOMETRY, dtype=W.compute_dtype(fmt))
    if fmt == "q4":
        _q4_linears(model)
    if fmt != "float32":
        pack_linears_bf16(model)
    target = TargetModel(model, [0, 1])
    target.weights = fmt
    target.pack_for_steps(16, 8, 4)  # the float32 packs a server makes (no-op in the bf16 formats)
    return target


def _row_at_a_time(target: TargetModel) -> TargetModel:
    """``target`` with every linear computing each row alone (a row-invariant reference GEMM)."""
    def forward(self, x):
        rows = x.reshape(-1, x.shape[-1])
        y = torch.cat([F.linear(rows[i:i + 1], self.weight, self.bias) for i in range(rows.shape[0])])
        return y.reshape(*x.shape[:-1], self.out_features)

    for m in target.model.modules():
        if isinstance(m, torch.nn.Linear):
            m.forward = types.MethodType(forward, m)
    return target


def _tree_segment(rng, nodes: int, start: int, slot: int) -> Segment:
    b = derive_buffers(random_tree(rng, V, nodes, 4), rng.randrange(3, V))
    assert b.input_ids.numel() == nodes + 1
    return Segment(b.input_ids, b.position_offsets, b.tree_mask, start, slot)


def _solo_vs_mixed(runner: ModelRunner, steps: int = 10, contexts=(200, 260, 330), seed: int = 0):
    """Prefill three requests, then ``steps`` steps of [tree 9, ar, tree 17] run together and each
    alone. Yields ``(step, segment index, solo logits, mixed logits, solo features, mixed features)``."""
    rng = random.Random(seed)
    slots = [runner.cache.alloc() for _ in contexts]
    for n, s in zip(contexts, slots):
        runner.execute([causal_segment([rng.randrange(3, V) for _ in range(n)], 0, s)], torch.tensor([n - 1]))
        runner.cache.extend(s, n)
    token = rng.randrange(3, V)
    for step in range(steps):
        lengths = [runner.cache.length(s) for s in slots]
        segs = [_tree_segment(rng, 8, lengths[1], slots[1]), causal_segment([token], lengths[0], slots[0]),
                _tree_segment(rng, 16, lengths[2], slots[2])]
        mixed = runner.execute(segs)
        solos = [runner.execute([s]) for s in segs]  # rewrites the same KV rows
        for i, (solo, lg, ft) in enumerate(zip(solos, split_rows(mixed.logits, mixed.packed.cu_rows),
                                               split_rows(mixed.features, mixed.packed.cu_rows))):
            yield step, i, solo.logits, lg, solo.features, ft
        token = int(solos[1].logits[0].argmax())
        runner.cache.extend(slots[0], 1)
        for s, start in ((slots[1], lengths[1]), (slots[2], lengths[2])):
            runner.cache.commit(s, start, torch.tensor([0]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_runner_rows_equal_solo_bitwise(fmt):
    """Every row of every request (an ``ar`` row, trees of 9 and 17 rows) gives bitwise the logits
    and tapped features of its solo step, step after step (bf16 formats as served; float32 with
    row-at-a-time linears, see the module docstring)."""
    target = _target(fmt)
    if fmt == "float32":
        target = _row_at_a_time(target)
    runner = ModelRunner(target, num_slots=3, capacity=400, kv_bucket=16)
    for step, i, solo, mixed, solo_f, mixed_f in _solo_vs_mixed(runner):
        assert torch.equal(solo, mixed), (fmt, step, i, (solo - mixed).abs().max().item())
        assert torch.equal(solo_f, mixed_f), (fmt, step, i)


def test_runner_float32_served_linears_within_rounding():
    """float32 as served (MKL sgemm, packed for the server's row counts): rows agree with the solo
    step to float32 rounding and pick the same greedy token."""
    runner = ModelRunner(_target("float32"), num_slots=3, capacity=400, kv_bucket=16)
    for step, i, solo, mixed, _, _ in _solo_vs_mixed(runner, steps=6):
        torch.testing.assert_close(mixed, solo, atol=1e-4, rtol=0)
        assert torch.equal(mixed.argmax(-1), solo.argmax(-1)), (step, i)


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_ar_request_equals_solo_beside_speculating_mates(fmt):
    """The reported case: a greedy ``ar`` request alone, and the same request while two requests
    speculate in the same steps (``dartree-pruned`` budget 16, ``ddtree`` budget 8: trees of
    different widths; prompts longer than its own). Tokens identical; logprobs (top 5) bitwise
    identical in the bf16 formats, to float32 rounding in float32."""
    target = _target(fmt)
    service = tiny_service(target, seed=5)
    rng = random.Random(3)
    ar = ("a", [rng.randrange(3, V - 1) for _ in range(150)],
          SamplingParams(max_tokens=40, ignore_eos=True, logprobs=5), SpecParams("ar"))
    mates = [(f"m{i}", [rng.randrange(3, V - 1) for _ in range(n)], SamplingParams(max_tokens=60, ignore_eos=True),
              SpecParams(m, budget=b)) for i, (n, m, b) in enumerate([(190, "dartree-pruned", 16), (230, "ddtree", 8)])]

    def run(reqs):
        engine = SpecEngine(target, InprocDrafterClient(service), EngineConfig(max_running=3, kv_bucket=16),
                            max_draft_depth=8)
        outs: dict[str, list] = {r[0]: [] for r in reqs}
        active = [r[0] for r in reqs]
        for r in reqs:
            engine.add_request(*r)
        sizes = []
        while active:
            res = engine.step_batch(list(active))
            sizes.append(len(res))
            for rid, out in res.items():
                assert not isinstance(out, BaseException), out
                if out is not None:
                    outs[rid].append(out)
                    if out.finish_reason is not None:
                        active.remove(rid)
        return outs["a"], sizes

    solo, _ = run([ar])
    mixed, sizes = run([ar] + mates)
    assert max(sizes) == 3
    tokens = [[t for o in outs for t in o.token_ids] for outs in (solo, mixed)]
    assert tokens[0] == tokens[1]
    lps = [[x for o in outs for x in o.logprobs.logprobs] for outs in (solo, mixed)]
    tops = [[x for o in outs for x in o.logprobs.top_logprobs] for outs in (solo, mixed)]
    if fmt == "float32":
        torch.testing.assert_close(torch.tensor(lps[1]), torch.tensor(lps[0]), atol=1e-4, rtol=0)
    else:
        assert lps[0] == lps[1] and tops[0] == tops[1]


@pytest.mark.parametrize("fmt", ["bfloat16", "q4"])
def test_linear_rows_per_format(fmt):
    """Each linear of the served bf16 formats (oneDNN-packed bf16, torch's int4 kernel, the q4
    lm_head) gives every row of an ``M``-row call bitwise its 1-row result, ``M`` = 1..17: the
    property the bitwise tests above rest on."""
    target = _target(fmt)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, lin in target.model.named_modules():
            if not hasattr(lin, "in_features"):
                continue
            x = torch.randn(17, lin.in_features, generator=g).to(target.dtype)
            solo = torch.cat([lin(x[i:i + 1]) for i in range(17)])
            for m in range(1, 18):
                assert torch.equal(lin(x[:m]), solo[:m]), (fmt, name, m)


@pytest.mark.slow
def test_compiled_runner_rows_equal_solo_bitwise():
    """Compiled steps (``torch.compile``, one graph for one-row steps, one for the others) keep the
    invariance in bfloat16: the per-request attention is the same opaque op body."""
    runner = ModelRunner(_target("bfloat16"), num_slots=3, capacity=400, kv_bucket=16, compile=True)
    for step, i, solo, mixed, solo_f, mixed_f in _solo_vs_mixed(runner, steps=3):
        assert torch.equal(solo, mixed) and torch.equal(solo_f, mixed_f), (step, i)
