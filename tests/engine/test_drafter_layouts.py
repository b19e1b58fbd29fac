"""Every public drafter checkpoint layout loads strictly and drafts as the reference does, or is
refused in one line naming the field (``docs/drafter-layouts.md``).

Each checkpoint is written here from the public config field names and tensor keys (z-lab's
``DFlashDraftModel``, the Domino heads, DSpark's ``Qwen3DSparkModel``, vllm-project/speculators'
``DFlashSpeculatorConfig`` / ``DSparkSpeculatorConfig`` exports) with random weights, loaded by
:func:`load_drafter`, and run against :mod:`tests.doubles.dflash_reference` (z-lab's forward on
transformers' Qwen3 pieces) with the same tensors.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from services.drafter.config import DrafterConfig, drafter_kind
from services.drafter.layers import rope_cos_sin
from services.drafter.layouts import LayoutError
from services.drafter.model import load_drafter
from services.drafter.build import make_service
from services.testing import block_logits_one
from tests.doubles.dflash_reference import reference_for

V, H, IDS, MASK = 64, 32, [0, 2, 4], 63
BACKBONE = dict(hidden_size=H, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=V, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=512, hidden_act="silu", attention_bias=False,
                layer_types=["full_attention"] * 2, tie_word_embeddings=False, use_sliding_window=False,
                sliding_window=None, max_window_layers=2, model_type="qwen3", bos_token_id=1, eos_token_id=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def zlab(**over) -> dict:
    """z-lab's DFlash config.json (v1: ``block_size`` at the top level)."""
    return {**BACKBONE, "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "block_size": 8, "num_target_layers": 6, "target_hidden_size": H,
            "dflash_config": {"mask_token_id": MASK, "target_layer_ids": IDS}, **over}


def write(d, cfg: dict, sd: dict, shards: int = 1):
    """``config.json`` and the tensors, in one file or ``shards`` files with transformers' index."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    sd = {k: v.detach().contiguous() for k, v in sd.items()}
    if shards == 1:
        save_file(sd, str(d / "model.safetensors"))
        return d
    keys, weight_map = sorted(sd), {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in keys[i::shards]}
        save_file(part, str(d / name))
        weight_map.update(dict.fromkeys(part, name))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def ref_and_sd(backbone: dict, seed: int = 0):
    """A reference module of ``backbone`` and its state dict (the released key names)."""
    ref = reference_for(backbone, len(IDS), seed=seed)
    return ref, dict(ref.state_dict())


def hidden(drafter, ref, start: int = 100, c: int = 5, q: int = 8):
    """``(ours, reference)`` drafter states ``[1, q, H]`` of the same random context / block rows at
    positions ``[start, start + c + q)``."""
    g = torch.Generator().manual_seed(7)
    feats, noise = torch.randn(1, c, len(IDS) * H, generator=g), torch.randn(1, q, H, generator=g)
    pos = torch.arange(start, start + c + q)
    with torch.no_grad():
        ours = drafter.block_forward(noise, pos[c:], drafter.context_kv(feats, pos[:c]))
        return ours, ref(noise, feats, pos[None])


def assert_matches(drafter, ref, **kw):
    ours, theirs = hidden(drafter, ref, **kw)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)


def refused(d, *names: str) -> str:
    """The one-line refusal of a directory (drafter_kind and load_drafter agree); it names ``names``."""
    with pytest.raises(ValueError) as kind_err:
        drafter_kind(d)
    with pytest.raises(ValueError) as load_err:
        load_drafter(d)
    for msg in (str(kind_err.value), str(load_err.value)):
        assert "\n" not in msg and all(n in msg for n in names), msg
    return str(load_err.value)


# ----- z-lab DFlash (v1 and DFlash 2's nested block_size) -----

def test_zlab_dflash_v1_loads_strict_and_matches_the_reference(tmp_path):
    ref, sd = ref_and_sd(BACKBONE)
    d = load_drafter(write(tmp_path / "v1", zlab(), sd))
    c = d.config
    assert (c.block_size, c.num_draft_slots, c.mask_token_id, c.target_layer_ids) == (8, 7, MASK, IDS)
    assert c.kind == "dflash" and c.rope_scaling is None and not c.attention_bias
    assert set(d.state_dict()) == set(sd)
    assert_matches(d, ref)


@pytest.mark.parametrize("top", [None, 16])
def test_block_size_nested_in_dflash_config_is_read(tmp_path, top):
    """DFlash 2 era configs (Qwen3.5+ drafters) keep block_size in dflash_config; it wins over the top level."""
    cfg = zlab(dflash_config={"mask_token_id": MASK, "target_layer_ids": IDS, "block_size": 10})
    cfg.pop("block_size")
    if top is not None:
        cfg["block_size"] = top
    assert DrafterConfig.from_hf(cfg).block_size == 10
    ref, sd = ref_and_sd(BACKBONE)
    assert load_drafter(write(tmp_path / "d", cfg, sd)).config.num_draft_slots == 9


def test_dflash2_convolutions_and_selector_are_refused_naming_them(tmp_path):
    dc = {"block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2, "mask_token_id": MASK,
          "selector_rank": 8, "selector_top_k": 4, "target_layer_ids": IDS}
    ref, sd = ref_and_sd(BACKBONE)
    extra = {"layers.0.attention_conv.base_kernel": torch.zeros(2, 2, H),
             "layers.0.attention_conv.kernel_projection.weight": torch.zeros(8, H),
             "candidate_selector.predecessor_codebook": torch.zeros(V, 8)}
    d = write(tmp_path / "v2", zlab(architectures=["DFlash2DraftModel"], dflash_config=dc), {**sd, **extra})
    msg = refused(d, "dflash_config.conv_kernel_size")
    assert "attention_conv" in msg and "candidate_selector" in msg
    # the tensors alone (a config that does not declare them): refused naming the tensors
    d2 = write(tmp_path / "tensors", zlab(), {**sd, **extra})
    with pytest.raises(RuntimeError, match="Unexpected tensors.*attention_conv.base_kernel") as err:
        load_drafter(d2)
    assert "\n" not in str(err.value)


# ----- Domino heads -----

def _domino_tensors(g: int = 16, e: int = 8, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"prefix_gru.weight_ih_l0": torch.randn(3 * g, H, generator=gen),
            "prefix_gru.weight_hh_l0": torch.randn(3 * g, g, generator=gen),
            "embed_proj.0.weight": torch.randn(e, H + g, generator=gen),
            "embed_proj.2.weight": torch.randn(V, e, generator=gen)}


@pytest.mark.parametrize("projector", ["domino", "causal_v5"])
def test_domino_projector_variants_load_and_match(tmp_path, projector):
    ref, sd = ref_and_sd(BACKBONE)
    head = _domino_tensors()
    dc = {"mask_token_id": MASK, "target_layer_ids": IDS, "projector_type": projector, "shift_label": True,
          "pure_draft_prefix_len": 1, "gru_hidden_dim": 16, "emb_dim": 8}
    d = load_drafter(write(tmp_path / projector, zlab(block_size=16, dflash_config=dc), {**sd, **head}))
    assert d.config.kind == "domino" and d.config.num_draft_slots == 16 and d.has_head
    w_z, w_s, w_out = d.head_split()
    torch.testing.assert_close(torch.cat([w_z, w_s], 1), head["embed_proj.0.weight"])
    torch.testing.assert_close(w_out, head["embed_proj.2.weight"])
    x, s = torch.randn(3, H), torch.randn(3, 16)
    gru = torch.nn.GRUCell(H, 16, bias=False)
    gru.load_state_dict({"weight_ih": head["prefix_gru.weight_ih_l0"], "weight_hh": head["prefix_gru.weight_hh_l0"]})
    with torch.no_grad():
        torch.testing.assert_close(d.gru_cell(x, s), gru(x, s))
    assert_matches(d, ref)


def test_an_unknown_projector_type_is_refused(tmp_path):
    ref, sd = ref_and_sd(BACKBONE)
    dc = {"mask_token_id": MASK, "target_layer_ids": IDS, "projector_type": "mlp_v9"}
    refused(write(tmp_path / "p", zlab(dflash_config=dc), sd), "dflash_config.projector_type", "mlp_v9")


# ----- DSpark: Qwen3DSparkModel and the speculators DSparkSpeculator schema -----

def _dspark_tensors(rank: int = 4, seed: int = 2) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"embed_tokens.weight": torch.randn(V, H, generator=gen), "lm_head.weight": torch.randn(V, H, generator=gen),
            "markov_head.markov_w1.weight": torch.randn(V, rank, generator=gen),
            "markov_head.markov_w2.weight": torch.randn(V, rank, generator=gen),
            "confidence_head.proj.weight": torch.randn(1, H + rank, generator=gen),
            "confidence_head.proj.bias": torch.randn(1, generator=gen)}


def test_dspark_both_config_schemas_load_the_same_drafter(tmp_path):
    ref, sd = ref_and_sd(BACKBONE)
    sd = {**sd, **_dspark_tensors()}
    released = {**{k: v for k, v in BACKBONE.items() if k != "rope_theta"}, "architectures": ["Qwen3DSparkModel"],
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "block_size": 7,
                "mask_token_id": MASK, "target_layer_ids": IDS, "num_target_layers": 6, "target_hidden_size": H,
                "num_anchors": 512, "markov_rank": 4, "markov_head_type": "vanilla", "enable_confidence_head": True,
                "confidence_head_with_markov": True}
    spec = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"], "speculators_version": "0.3.0",
            "transformer_layer_config": BACKBONE, "draft_vocab_size": V, "block_size": 7, "target_hidden_size": None,
            "aux_hidden_state_layer_ids": [i + 1 for i in IDS], "mask_token_id": MASK,
            "sliding_window_non_causal": False, "sample_from_anchor": True, "markov_rank": 4,
            "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
            "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy"}}
    a = load_drafter(write(tmp_path / "released", released, sd))
    b = load_drafter(write(tmp_path / "speculators", spec, {**sd, "verifier_norm.weight": torch.ones(H)}))
    for d in (a, b):
        assert d.config.kind == "dspark" and d.config.target_layer_ids == IDS and d.config.num_draft_slots == 7
        assert_matches(d, ref)
    assert {k: v for k, v in a.state_dict().items()}.keys() == b.state_dict().keys()
    for k, v in a.state_dict().items():
        torch.testing.assert_close(b.state_dict()[k], v)


# ----- speculators DFlash exports: own embedding / lm_head, d2t / t2d -----

def _speculators_dflash(draft_vocab: int, **over) -> dict:
    return {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"], "speculators_version": "0.3.0",
            "transformer_layer_config": BACKBONE, "draft_vocab_size": draft_vocab, "block_size": 8,
            "target_hidden_size": None, "aux_hidden_state_layer_ids": [i + 1 for i in IDS], "mask_token_id": MASK,
            "sliding_window_non_causal": False, "sample_from_anchor": False,
            "speculators_config": {"algorithm": "dflash", "proposal_methods": [], "verifier": {"name_or_path": "x"}},
            **over}


def test_speculators_dflash_export_drafts_with_its_own_embedding_head_and_vocab_maps(tmp_path):
    ref, sd = ref_and_sd(BACKBONE)
    n, gen = 48, torch.Generator().manual_seed(5)
    draft_ids = torch.randperm(V, generator=gen)[:n].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    own = {"embed_tokens.weight": torch.randn(V, H, generator=gen), "lm_head.weight": torch.randn(n, H, generator=gen),
           "d2t": draft_ids - torch.arange(n), "t2d": t2d, "verifier_norm.weight": torch.ones(H)}
    d = load_drafter(write(tmp_path / "spec", _speculators_dflash(n), {**sd, **own}))
    c = d.config
    assert c.own_io and c.draft_vocab_size == n and c.target_layer_ids == IDS and not c.shift_label
    assert torch.equal(d.draft_to_target(), draft_ids)
    assert_matches(d, ref)
    # the served block: the drafter's own embedding and head, not the ones handed in
    other = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)
    svc = make_service(d, *other, packed_gemm=False)
    start, ctx = 5, torch.randn(5, len(IDS) * H, generator=gen)
    root = 11
    _, logits = block_logits_one(svc, "r", ctx, root, start)
    noise = own["embed_tokens.weight"][torch.tensor([root] + [MASK] * 7)][None]
    with torch.no_grad():
        want = ref(noise, ctx[None], torch.arange(start + 8)[None])[0, 1:] @ own["lm_head.weight"].T
    torch.testing.assert_close(logits, want[:logits.shape[0]], atol=2e-4, rtol=2e-4)


def test_speculators_domino_head_keys_map_to_the_domino_layout(tmp_path):
    ref, sd = ref_and_sd(BACKBONE)
    head = {f"domino_head.{k}": v for k, v in _domino_tensors().items()}
    own = {"embed_tokens.weight": torch.randn(V, H), "lm_head.weight": torch.randn(V, H)}
    cfg = _speculators_dflash(V, projector_type="domino", pure_draft_prefix_len=1, emb_dim=8, gru_hidden_dim=16,
                              shift_label=True, lambda_base_start=1.0, lambda_base_decay_ratio=1.0, auf=False)
    d = load_drafter(write(tmp_path / "dom", cfg, {**sd, **head, **own}))
    assert d.config.kind == "domino" and d.config.shift_label and d.config.draft_vocab_size is None
    torch.testing.assert_close(d.embed_proj[2].weight, head["domino_head.embed_proj.2.weight"])
    assert_matches(d, ref)


# ----- rope variants -----

@pytest.mark.parametrize("rope", [LLAMA3, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                                  {"rope_type": "linear", "factor": 2.0}], ids=["llama3", "yarn", "linear"])
def test_scaled_rope_matches_transformers_and_changes_the_drafter(tmp_path, rope):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    backbone = {**BACKBONE, "rope_scaling": dict(rope)}
    ref, sd = ref_and_sd(backbone)
    d = load_drafter(write(tmp_path / "scaled", zlab(rope_scaling=dict(rope)), sd))
    assert d.config.rope_scaling["rope_type"] == rope["rope_type"]
    pos = torch.arange(0, 400, 7)
    cos, sin = Qwen3RotaryEmbedding(Qwen3Config(**backbone))(torch.zeros(1, 1, 8), pos[None])
    ours_cos, ours_sin = rope_cos_sin(pos, 8, 10000.0, d.config.rope_scaling, 512)
    torch.testing.assert_close(ours_cos, cos[0])
    torch.testing.assert_close(ours_sin.abs(), sin[0].abs())  # ours carries rotate_half's sign in its first half
    assert_matches(d, ref)
    plain = load_drafter(write(tmp_path / "plain", zlab(), sd))
    ours, _ = hidden(d, ref)
    unscaled, _ = hidden(plain, ref)
    assert (ours - unscaled).abs().max() > 1e-3  # the scaling reaches the drafter's output


def test_rope_parameters_spelling_of_transformers_5_is_read():
    cfg = zlab(rope_parameters={"rope_theta": 5e5, **LLAMA3})
    cfg.pop("rope_theta")
    c = DrafterConfig.from_hf(cfg)
    assert c.rope_theta == 5e5 and c.rope_scaling == LLAMA3
    assert DrafterConfig.from_hf(c.to_hf()) == c


def test_eagle3_reads_llama3_rope_scaling():
    from services.drafter.eagle3 import Eagle3Config

    raw = {**Eagle3Config().to_hf(), "rope_scaling": dict(LLAMA3)}
    c = Eagle3Config.from_hf(raw)
    assert c.rope_scaling == LLAMA3 and Eagle3Config.from_hf(c.to_hf()) == c


# ----- sharded checkpoints, attention bias -----

def test_sharded_checkpoint_loads_the_same_as_one_file(tmp_path):
    ref, sd = ref_and_sd(BACKBONE)
    one = load_drafter(write(tmp_path / "one", zlab(), sd))
    three = load_drafter(write(tmp_path / "three", zlab(), sd, shards=3))
    assert one.state_dict().keys() == three.state_dict().keys()
    for k, v in one.state_dict().items():
        assert torch.equal(three.state_dict()[k], v), k
    assert_matches(three, ref)
    (tmp_path / "three" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors") as err:
        load_drafter(tmp_path / "three")
    assert "\n" not in str(err.value)


def test_attention_bias_is_served(tmp_path):
    backbone = {**BACKBONE, "attention_bias": True}
    ref, sd = ref_and_sd(backbone)
    assert "layers.0.self_attn.q_proj.bias" in sd
    d = load_drafter(write(tmp_path / "bias", zlab(attention_bias=True), sd))
    assert d.config.attention_bias and set(d.state_dict()) == set(sd)
    assert_matches(d, ref)
    no_bias = {k: v for k, v in sd.items() if not k.endswith("_proj.bias")}
    with pytest.raises(RuntimeError, match="Missing tensors.*q_proj.bias"):
        load_drafter(write(tmp_path / "nobias", zlab(attention_bias=True), no_bias))


# ----- refusals: every unserved field by name, in one line -----

REFUSED = [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"is_causal": True}, "is_causal"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "longrope"),
    ({"rope_scaling": {"rope_type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"},
                       "mrope_section": [2, 1, 1]}}, "mrope_section"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}}, "low_freq_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_is_neox_style": False}, "rope_is_neox_style"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": IDS, "output_multiplier": 0.2}},
     "dflash_config.output_multiplier"),
    ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": IDS, "final_logit_softcapping": 20.0}},
     "dflash_config.final_logit_softcapping"),
    ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": IDS, "input_embedding_scale": 2.0}},
     "dflash_config.input_embedding_scale"),
    ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": IDS, "use_swa": True}}, "dflash_config.use_swa"),
    ({"dflash_config": {"mask_token_id": MASK, "target_layer_ids": IDS, "gate_mode": "x"}}, "dflash_config.gate_mode"),
]


@pytest.mark.parametrize("change,name", REFUSED, ids=[n for _, n in REFUSED])
def test_an_unserved_field_is_refused_naming_it(tmp_path, change, name):
    ref, sd = ref_and_sd(BACKBONE)
    refused(write(tmp_path / "d", zlab(**change), sd), name)


@pytest.mark.parametrize("change,name", [({"speculators_model_type": "eagle3"}, "speculators_model_type"),
                                         ({"markov_head_type": "gated"}, "markov_head_type"),
                                         ({"markov_rank": 0}, "markov_rank"),
                                         ({"draft_vocab_size": 48}, "draft_vocab_size"),
                                         ({"aux_hidden_state_layer_ids": None}, "aux_hidden_state_layer_ids"),
                                         ({"new_head_knob": 3}, "new_head_knob")])
def test_speculators_dspark_fields_we_cannot_serve_are_refused(tmp_path, change, name):
    ref, sd = ref_and_sd(BACKBONE)
    cfg = {**_speculators_dflash(V), "speculators_model_type": "dspark", "sample_from_anchor": True,
           "markov_rank": 4, "markov_head_type": "vanilla", "enable_confidence_head": False, **change}
    refused(write(tmp_path / "d", cfg, {**sd, **_dspark_tensors()}), name)


def test_a_trained_mask_embedding_file_is_refused(tmp_path):
    ref, sd = ref_and_sd(BACKBONE)
    d = write(tmp_path / "mimo", zlab(), sd)
    torch.save({"mask_token_id": MASK, "embedding": torch.zeros(H)}, d / "mask_embedding.pt")
    with pytest.raises(LayoutError, match="mask_embedding.pt"):
        load_drafter(d)
