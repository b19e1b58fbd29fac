"""DSpark (Markov head; ``dspark``, ``dspark-dartree``) and EAGLE-3 (``eagle3``), issue 18.

Strict loading of the released key layouts (written here key by key, not from our modules), the
Markov-head math of both DSpark methods, the EAGLE-3 dynamic tree against a slow reference, the
EAGLE-3 inference rows against the training-time-test rows, and the lossless contracts every
method has: T = 0 equals plain greedy exactly (float32), batched equals solo, and at T > 0 the first
three tokens are distributed as plain sampling (chi-square, as tests/engine/test_sampling.py).
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from safetensors.torch import save_file

from services.drafter.model import DFlashDrafter, load_drafter, save_drafter
from services.drafter.build import make_service
from services.protocol import served_methods
from services.testing import (block_logits_one, draft_job, draft_one, greedy_reference, tiny_drafter, tiny_dspark, tiny_eagle3,
                              tiny_service, tiny_target)
from services.tree import MarkovScorer, dartree
from services.tree.eagle import eagle_tree
from services.verifier.drafter_client import InprocDrafterClient
from services.spec import TreeKnobs
from services.params import SamplingParams, SpecParams
from services.verifier.engine import EngineConfig, SpecEngine
from services.verifier.policy import FixedPolicy
from tests.engine.conftest import TARGET_KW, V
from tests.engine.test_batched import _run_batched
from tests.engine.test_sampling import assert_target_distribution, sample_counts

H = TARGET_KW["hidden_size"]
N = 40


def _prompt(seed, n=7):
    rng = random.Random(seed)
    return [rng.randrange(3, V - 1) for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target3(request):
    """A tiny target tapping 3 layers (EAGLE-3's low / mid / high)."""
    return tiny_target(request.param, target_layer_ids=[0, 1, 2], **TARGET_KW)


@pytest.fixture(scope="module")
def dspark_service(target):
    return tiny_service(target, tiny_dspark(target, seed=4, std=0.3))


@pytest.fixture(scope="module")
def eagle3_service(target3):
    return tiny_service(target3, tiny_eagle3(target3, seed=4, std=0.3))


# ---------------------------------------------------------------------------------------------
# Released key layouts, strict loading
# ---------------------------------------------------------------------------------------------
def _dspark_released(tmp_path, drop=None, extra=None, head_type="vanilla"):
    """A tiny DSpark checkpoint in the released layout (DSPK qwen3/modeling.py key names)."""
    r, nh, nkv, dh, inter = 8, 4, 2, 8, 64
    cfg = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": H,
           "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": nh,
           "num_key_value_heads": nkv, "head_dim": dh, "vocab_size": V, "rms_norm_eps": 1e-6,
           "rope_parameters": {"rope_theta": 10000.0}, "max_position_embeddings": 256, "block_size": 7,
           "mask_token_id": V - 1, "target_layer_ids": [0, 2], "num_target_layers": 3, "num_anchors": 512,
           "markov_rank": r, "markov_head_type": head_type, "enable_confidence_head": True,
           "confidence_head_with_markov": True}
    g = torch.Generator().manual_seed(0)
    shapes = {"layers.0.self_attn.q_proj.weight": (nh * dh, H), "layers.0.self_attn.k_proj.weight": (nkv * dh, H),
              "layers.0.self_attn.v_proj.weight": (nkv * dh, H), "layers.0.self_attn.o_proj.weight": (H, nh * dh),
              "layers.0.self_attn.q_norm.weight": (dh,), "layers.0.self_attn.k_norm.weight": (dh,),
              "layers.0.mlp.gate_proj.weight": (inter, H), "layers.0.mlp.up_proj.weight": (inter, H),
              "layers.0.mlp.down_proj.weight": (H, inter), "layers.0.input_layernorm.weight": (H,),
              "layers.0.post_attention_layernorm.weight": (H,), "fc.weight": (H, 2 * H),
              "hidden_norm.weight": (H,), "norm.weight": (H,), "embed_tokens.weight": (V, H),
              "lm_head.weight": (V, H), "markov_head.markov_w1.weight": (V, r),
              "markov_head.markov_w2.weight": (V, r), "confidence_head.proj.weight": (1, H + r),
              "confidence_head.proj.bias": (1,)}
    sd = {k: torch.randn(*s, generator=g).to(torch.bfloat16) for k, s in shapes.items() if k != drop}
    sd.update(extra or {})
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(tmp_path / "model.safetensors"))
    return sd


def test_dspark_loads_the_released_layout_strictly(tmp_path):
    sd = _dspark_released(tmp_path / "ok")
    m = load_drafter(tmp_path / "ok")
    assert isinstance(m, DFlashDrafter) and m.has_markov and not m.has_head
    c = m.config
    assert (c.block_size, c.num_draft_slots, c.markov_rank, c.mask_token_id, c.target_layer_ids) == (7, 7, 8, V - 1, [0, 2])
    assert c.shift_label and c.pure_draft_prefix_len == 0 and c.enable_confidence_head
    got = m.state_dict()
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v.float()), k
    with pytest.raises(RuntimeError, match="markov_w2"):
        _dspark_released(tmp_path / "missing", drop="markov_head.markov_w2.weight")
        load_drafter(tmp_path / "missing")
    with pytest.raises(RuntimeError, match="Unexpected"):
        _dspark_released(tmp_path / "extra", extra={"prefix_gru.weight_ih_l0": torch.zeros(3, 3)})
        load_drafter(tmp_path / "extra")
    with pytest.raises(ValueError, match="markov_head_type"):
        _dspark_released(tmp_path / "gated", head_type="gated")
        load_drafter(tmp_path / "gated")


def test_dspark_saved_without_target_copies_refills_them_from_the_target(target, tmp_path):
    d = tiny_dspark(target, seed=2)
    save_drafter(d, tmp_path, omit_target_copies=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys == set(d.state_dict()) - {"embed_tokens.weight", "lm_head.weight"}
    loaded = load_drafter(tmp_path)
    assert loaded.needs_target_io
    a, b = make_service(d, target.embed_tokens(), target.lm_head()), make_service(loaded, target.embed_tokens(),
                                                                                   target.lm_head())
    assert not loaded.needs_target_io
    assert torch.equal(loaded.embed_tokens.weight, target.embed_tokens().weight.float())
    feats = torch.randn(9, target.feature_dim)
    for method in ("dspark", "dspark-dartree"):
        ta, _ = draft_one(a, method, list(range(9)), feats, 5, 9, SpecParams(method, budget=10, width=3))
        tb, _ = draft_one(b, method, list(range(9)), feats, 5, 9, SpecParams(method, budget=10, width=3))
        # bf16 save rounds the weights: the trees agree on the first (most confident) nodes
        assert ta.num_nodes == tb.num_nodes
    with pytest.raises(ValueError, match="only a DSpark"):
        save_drafter(tiny_drafter(target), tmp_path / "x", omit_target_copies=True)


def _eagle3_released(tmp_path, drop=None, arch="LlamaForCausalLMEagle3", n_draft=96):
    """A tiny EAGLE-3 checkpoint with the 15 keys of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B."""
    nh, nkv, dh, inter = 4, 2, 8, 64
    cfg = {"architectures": [arch], "model_type": "llama", "hidden_size": H, "intermediate_size": inter,
           "num_hidden_layers": 1, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": dh,
           "vocab_size": V, "draft_vocab_size": n_draft, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": 256, "target_hidden_size": H, "num_target_layers": 3,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}
    g = torch.Generator().manual_seed(0)
    shapes = {"midlayer.self_attn.q_proj.weight": (nh * dh, 2 * H), "midlayer.self_attn.k_proj.weight": (nkv * dh, 2 * H),
              "midlayer.self_attn.v_proj.weight": (nkv * dh, 2 * H), "midlayer.self_attn.o_proj.weight": (H, nh * dh),
              "midlayer.mlp.gate_proj.weight": (inter, H), "midlayer.mlp.up_proj.weight": (inter, H),
              "midlayer.mlp.down_proj.weight": (H, inter), "midlayer.hidden_norm.weight": (H,),
              "midlayer.input_layernorm.weight": (H,), "midlayer.post_attention_layernorm.weight": (H,),
              "norm.weight": (H,), "fc.weight": (H, 3 * H), "lm_head.weight": (n_draft, H)}
    sd = {k: torch.randn(*s, generator=g).to(torch.bfloat16) for k, s in shapes.items() if k != drop}
    ids = torch.randperm(V, generator=g)[:n_draft].sort().values
    sd["d2t"] = ids - torch.arange(n_draft)
    sd["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill(0, ids, True)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(tmp_path / "model.safetensors"))
    return sd, ids


def test_eagle3_loads_the_released_layout_strictly(tmp_path):
    from services.drafter.eagle3 import Eagle3Drafter

    sd, ids = _eagle3_released(tmp_path / "ok")
    m = load_drafter(tmp_path / "ok")
    assert isinstance(m, Eagle3Drafter) and len(sd) == 15
    assert m.config.target_layer_ids == [0, 1, 2] and m.config.draft_vocab_size == 96
    assert set(m.state_dict()) == set(sd)
    assert torch.equal(m.draft_to_target(), ids) and torch.equal(m.t2d, sd["t2d"])
    assert torch.equal(m.state_dict()["fc.weight"], sd["fc.weight"].float())
    with pytest.raises(RuntimeError, match="hidden_norm"):
        _eagle3_released(tmp_path / "missing", drop="midlayer.hidden_norm.weight")
        load_drafter(tmp_path / "missing")
    # our own export round-trips (and keeps the d2t map)
    save_drafter(m, tmp_path / "again")
    assert torch.equal(load_drafter(tmp_path / "again").draft_to_target(), ids)


def test_eagle3_config_errors():
    from services.drafter.eagle3 import Eagle3Config

    with pytest.raises(ValueError, match="exactly 3"):
        Eagle3Config(target_layer_ids=[1, 2])
    with pytest.raises(ValueError, match="not an EAGLE-3"):
        Eagle3Config.from_hf({"architectures": ["DFlashDraftModel"]})
    with pytest.raises(ValueError, match="one layer"):
        Eagle3Config.from_hf({"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 2})


# ---------------------------------------------------------------------------------------------
# DSpark methods: the Markov head's math
# ---------------------------------------------------------------------------------------------
def test_markov_scorer_is_the_heads_bias(target):
    d = tiny_dspark(target, seed=3)
    head = d.markov_head
    sc = MarkovScorer(head.markov_w1.weight, head.markov_w2.weight)
    prev = torch.tensor([3, 17, 17, 40])
    cand = torch.tensor([5, 9, 100, 2])
    vals = torch.randn(4)
    got = sc.score(2, sc.advance(sc.root_state(0).expand(4, -1), prev), cand, vals)
    want = vals[None, :] + head.bias(prev)[:, cand]
    torch.testing.assert_close(got, want)


def test_dspark_chain_is_the_sequential_markov_rollout(target):
    d = tiny_dspark(target, seed=5, std=0.4)
    svc = make_service(d, target.embed_tokens(), target.lm_head())
    feats = torch.randn(9, target.feature_dim)
    tree, _ = draft_one(svc, "r", list(range(9)), feats, 5, 9, SpecParams("dspark"))
    svc2 = make_service(d, target.embed_tokens(), target.lm_head())
    _, base = block_logits_one(svc2, "r", feats, 5, 9)
    toks, prev = [], 5
    with torch.no_grad():
        for k in range(7):  # all 7 rows draft (shift-label); slot 0's prev is the root
            prev = int((base[k] + d.markov_head.bias(torch.tensor(prev))).argmax())
            toks.append(prev)
    assert tree.draft_tokens.tolist() == toks
    assert tree.parents.tolist() == list(range(-1, 6))
    assert tree.draft_tokens.tolist() != base.argmax(-1).tolist()  # the head changes the chain here


def test_dspark_dartree_is_dartree_with_the_markov_scorer(target):
    d = tiny_dspark(target, seed=6, std=0.4)
    svc = make_service(d, target.embed_tokens(), target.lm_head())
    feats = torch.randn(9, target.feature_dim)
    spec = SpecParams("dspark-dartree", budget=12, width=4, candidates=16, depth_bonus=-0.1)
    tree, _ = draft_one(svc, "r", list(range(9)), feats, 5, 9, spec)
    _, base = block_logits_one(make_service(d, target.embed_tokens(), target.lm_head()), "r", feats, 5, 9)
    w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
    want = dartree(base, MarkovScorer(w1, w2), 5, K=16, W=4, B=12, beta=-0.1, pure_draft_prefix_len=0)
    assert torch.equal(tree.draft_tokens, want.draft_tokens) and torch.equal(tree.parents, want.parents)
    no_head = dartree(base, MarkovScorer(w1, torch.zeros_like(w2)), 5, K=16, W=4, B=12, beta=-0.1,
                      pure_draft_prefix_len=0)
    assert not torch.equal(tree.draft_tokens, no_head.draft_tokens)  # the Markov head re-ranks the tree
    tree.validate(budget=12, vocab_size=V)


def test_methods_follow_the_drafter_kind(target, target3):
    assert served_methods("dspark") == ("ar", "dflash", "ddtree", "dspark", "dspark-dartree")
    assert served_methods("eagle3") == ("ar", "eagle3")
    assert "dspark" not in served_methods("domino")
    with pytest.raises(ValueError, match="unknown drafter kind"):
        served_methods("medusa")
    dsp = tiny_service(target, tiny_dspark(target))
    dom = tiny_service(target)
    e3 = tiny_service(target3, tiny_eagle3(target3))
    assert dsp.info()["methods"] == list(served_methods("dspark"))
    assert e3.info()["methods"] == ["ar", "eagle3"] and e3.info()["feature_dim"] == 3 * H
    f = torch.randn(1, target.feature_dim)
    with pytest.raises(ValueError, match="DSpark"):
        draft_one(dom, "r", [1], f, 2, 1, SpecParams("dspark-dartree"))
    with pytest.raises(ValueError, match="correction head"):
        draft_one(dsp, "r", [1], f, 2, 1, SpecParams("dartree-pruned"))
    with pytest.raises(ValueError, match="EAGLE-3"):
        draft_one(dsp, "r", [1], f, 2, 1, SpecParams("eagle3"))
    with pytest.raises(ValueError, match="DSpark"):
        draft_one(e3, "r", [1], torch.randn(1, 3 * H), 2, 1, SpecParams("dspark"))
    with pytest.raises(ValueError, match="DFlash-family"):
        draft_one(e3, "r", [1], torch.randn(1, 3 * H), 2, 1, SpecParams("dartree-pruned"))
    with pytest.raises(ValueError, match="features must be"):
        draft_one(e3, "r", [1], torch.randn(1, 2 * H), 2, 1, SpecParams("eagle3"))


# ---------------------------------------------------------------------------------------------
# EAGLE-3 dynamic tree
# ---------------------------------------------------------------------------------------------
def _eagle_reference(root_logp, table, k, depth, budget):
    """Slow EAGLE-2/3 tree: node = (token, parent, depth, score); child log-probs = table[token]."""
    nodes = []
    order = sorted(range(root_logp.numel()), key=lambda t: (-float(root_logp[t]), t))[:k]
    for t in order:
        nodes.append((t, -1, 1, float(root_logp[t])))
    frontier = list(range(len(nodes)))
    for d in range(2, depth + 1):
        cands = []
        for f in frontier:
            tok, _, _, sc = nodes[f]
            lp = table[tok]
            kids = sorted(range(lp.numel()), key=lambda t: (-float(lp[t]), t))[:k]
            for t in kids:
                cands.append((t, f, d, sc + float(lp[t])))
        first = len(nodes)
        nodes += cands
        best = sorted(range(len(cands)), key=lambda i: (-cands[i][3], i))[:k]
        frontier = [first + i for i in best]
    keep = sorted(sorted(range(len(nodes)), key=lambda i: (-nodes[i][3], i))[:budget])
    remap = {o: n for n, o in enumerate(keep)}
    return [(nodes[i][0], remap.get(nodes[i][1], -1), nodes[i][2]) for i in keep]


@pytest.mark.parametrize("k,depth,budget", [(3, 4, 10), (2, 5, 64), (4, 3, 7), (1, 6, 6)])
def test_eagle_tree_matches_the_slow_reference(k, depth, budget):
    g = torch.Generator().manual_seed(k * 100 + depth)
    n = 12
    table = torch.log_softmax(torch.randn(n, n, generator=g) * 2, -1)  # child log-probs by parent token
    root = torch.log_softmax(torch.randn(n, generator=g) * 2, -1)
    calls = []

    def expand(nodes, tokens, parents):
        calls.append(nodes.numel())
        return table[tokens]

    tree = eagle_tree(root, expand, top_k=k, depth=depth, budget=budget)
    want = _eagle_reference(root, table, k, depth, budget)
    assert list(zip(tree.draft_tokens.tolist(), tree.parents.tolist(), tree.depths.tolist())) == want
    tree.validate(budget=budget, vocab_size=n)
    assert all(c <= k for c in calls) and len(calls) <= depth - 1


def test_eagle_tree_errors():
    with pytest.raises(ValueError, match="root_logp"):
        eagle_tree(torch.zeros(2, 3), lambda *a: None)
    with pytest.raises(ValueError, match="top_k"):
        eagle_tree(torch.zeros(3), lambda *a: None, top_k=0)
    assert eagle_tree(torch.zeros(3), lambda *a: None, budget=0).num_nodes == 0


def test_eagle3_inference_rows_equal_training_time_test_rows(target3, monkeypatch):
    """A chain of draft nodes expanded at inference (context cache, tree mask, positions, the parent's
    output as hidden) computes exactly the rows the training-time test trains."""
    import services.drafter.eagle3_service as es
    from services.training.train_eagle3 import Eagle3Trainer

    d = tiny_eagle3(target3, seed=9, std=0.3, draft_vocab_size=V, depth=3, top_k=1)
    svc = make_service(d, target3.embed_tokens(), target3.lm_head())
    prompt = _prompt(2, 9)
    s = len(prompt) - 1
    _, feats = target3.teacher_forced(prompt)
    seen = []
    real = es.eagle_tree

    def spy(root_logp, expand, **kw):
        def wrapped(nodes, tokens, parents):
            out = expand(nodes, tokens, parents)
            seen.append(out)
            return out
        seen.append(root_logp)
        return real(root_logp, wrapped, **kw)

    monkeypatch.setattr(es, "eagle_tree", spy)
    tree, _ = draft_one(svc, "r", prompt[:s], feats[:s], prompt[s], s, SpecParams("eagle3", budget=3))
    assert tree.num_nodes == 3 and tree.parents.tolist() == [-1, 0, 1]  # k = 1: a chain
    ids = torch.tensor(prompt + tree.draft_tokens.tolist()[:2])
    _, feats_full = target3.teacher_forced(ids.tolist())
    trainer = Eagle3Trainer(d, target3.embed_tokens().weight.detach().float(), torch.arange(3 * H), 3, 64)
    with torch.no_grad():
        rows = trainer.step_logits(ids, feats_full)
    for j in range(3):  # row s - 1 at step j drafts depth j + 1
        torch.testing.assert_close(seen[j].reshape(-1), torch.log_softmax(rows[j][s - 1].float(), -1), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Lossless contracts
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["dspark", "dspark-dartree", "dflash", "ddtree"])
@pytest.mark.parametrize("seed", [0, 1])
def test_dspark_greedy_equals_plain_greedy(target, dspark_service, method, seed):
    prompt = _prompt(seed)
    ref = greedy_reference(target.model, prompt, N)
    engine = SpecEngine(target, InprocDrafterClient(dspark_service), max_draft_depth=7)
    outs = list(engine.generate("r", prompt, SamplingParams(max_tokens=N, ignore_eos=True),
                                SpecParams(method, budget=[6, 16][seed], width=3)))
    assert [t for o in outs for t in o.token_ids] == ref
    assert engine.num_active() == 0 and dspark_service.num_contexts() == 0


@pytest.mark.parametrize("budget", [1, 5, 16, 64])
def test_eagle3_greedy_equals_plain_greedy(target3, eagle3_service, budget):
    prompt = _prompt(budget)
    ref = greedy_reference(target3.model, prompt, N)
    engine = SpecEngine(target3, InprocDrafterClient(eagle3_service), max_draft_depth=4)
    outs = list(engine.generate("r", prompt, SamplingParams(max_tokens=N, ignore_eos=True),
                                SpecParams("eagle3", budget=budget)))
    assert [t for o in outs for t in o.token_ids] == ref
    assert all(o.num_draft_tokens <= budget for o in outs)
    assert engine.num_active() == 0 and eagle3_service.num_contexts() == 0


def test_eagle3_near_the_context_end(target3):
    """Trees shrink to the positions left (max_depth) and the answer still equals greedy."""
    svc = tiny_service(target3, tiny_eagle3(target3, seed=1))
    prompt = _prompt(4, 250)
    ref = greedy_reference(target3.model, prompt, 6)
    engine = SpecEngine(target3, InprocDrafterClient(svc), max_draft_depth=4)
    outs = list(engine.generate("r", prompt, SamplingParams(max_tokens=6, ignore_eos=True), SpecParams("eagle3")))
    assert [t for o in outs for t in o.token_ids] == ref


def _mixed(seed, n, methods):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, V - 1) for _ in range(rng.randrange(2, 30))]
        spec = SpecParams(methods[i % len(methods)], budget=rng.choice([None, 3, 9]), width=rng.choice([None, 2, 4]))
        out.append((f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(4, 24), ignore_eos=bool(i % 2)), spec))
    return out


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_batched_equals_solo(target, target3, kind):
    tgt = target if kind == "dspark" else target3
    drafter = tiny_dspark(tgt, seed=3) if kind == "dspark" else tiny_eagle3(tgt, seed=3)
    svc = tiny_service(tgt, drafter)
    methods = [m for m in served_methods(kind)]
    reqs = _mixed(7, 6, methods)
    arrivals: dict[int, list] = {}
    for i, r in enumerate(reqs):
        arrivals.setdefault(2 * (i % 3), []).append(r)
    engine = SpecEngine(tgt, InprocDrafterClient(svc), EngineConfig(max_running=8, prefill_chunk=4,
                                                                    max_step_tokens=64), max_draft_depth=5)
    got, sizes = _run_batched(engine, arrivals)
    for rid, prompt, sampling, spec in reqs:
        solo = SpecEngine(tgt, InprocDrafterClient(svc), EngineConfig(max_running=1), max_draft_depth=5)
        want = [t for o in solo.generate("solo", prompt, sampling, spec) for t in o.token_ids]
        assert got[rid] == want, (rid, spec.method)
    assert max(sizes) >= 2 and svc.num_contexts() == 0


def test_draft_batch_equals_one_at_a_time(target, target3):
    for tgt, drafter, methods in ((target, tiny_dspark(target, seed=2), ["dspark", "dspark-dartree"]),
                                  (target3, tiny_eagle3(target3, seed=2), ["eagle3"])):
        a, b = tiny_service(tgt, drafter), tiny_service(tgt, drafter)
        rng = random.Random(3)
        jobs, start = [], {}
        for i, m in enumerate(methods * 2):
            rid = f"{m}-{i}"
            n = rng.randrange(2, 12)
            start[rid] = n
            jobs.append(draft_job(rid, [rng.randrange(3, V - 1) for _ in range(n)], torch.randn(n, tgt.feature_dim),
                                 rng.randrange(3, V - 1), n, SpecParams(m, budget=7, width=3), 5))
        for j, res in zip(jobs, a.draft_batch(jobs)):
            want, _ = b.draft_batch([j])[0]
            assert torch.equal(res[0].draft_tokens, want.draft_tokens) and torch.equal(res[0].parents, want.parents)


V8 = 8


@pytest.fixture(scope="module")
def target8():
    return tiny_target("llama", vocab_size=V8, hidden_size=32, num_layers=3, init_std=0.3, eos_token_id=None,
                       target_layer_ids=[0, 1, 2])


@pytest.mark.parametrize("method", ["dspark", "dspark-dartree", "eagle3"])
def test_first_three_tokens_match_plain_sampling(target8, method):
    """T = 1 with the real drafters (random weights, peaked so that trees are often right): the joint of
    the first three tokens is the target's (chi-square at p = 0.001), and the test rejects the usual
    wrong distributions."""
    drafter = tiny_eagle3(target8, seed=1, std=0.6, draft_vocab_size=6, depth=3, top_k=2) if method == "eagle3" \
        else tiny_dspark(target8, seed=1, std=0.6, block_size=3)
    svc = tiny_service(target8, drafter)
    engine = SpecEngine(target8, InprocDrafterClient(svc), max_draft_depth=3,
                        policy=FixedPolicy(defaults=TreeKnobs(budget=6, width=3, depth_bonus=-0.2, candidates=4)))
    import tests.engine.test_sampling as ts

    assert ts.V == V8
    counts = sample_counts(engine, 1500, 3, method=method, temperature=1.0)
    stat = assert_target_distribution(counts, target8.model)
    assert engine.num_active() == 0 and svc.num_contexts() == 0
    assert math.isfinite(stat)
