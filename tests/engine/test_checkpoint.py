"""Drafter checkpoint format: the released Qwen3-4B DFlash / Domino layouts (algorithms.md §1.1, §1.2,
§2.1), strict save/load round trips, ``DrafterConfig.from_hf`` on released config.json blocks, and
``load_borrowed_weights``."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.drafter.model import DFlashDrafter, DrafterConfig, load_drafter, save_drafter
from services.drafter.build import load_borrowed_weights
from services.testing import tiny_causal_lm, tiny_drafter, tiny_target

# Released config.json layouts (values from algorithms.md §1.1: SF configs/qwen3-4b-dflash.json,
# SF-4B qwen3-4b-domino.json and the SPEC664 quote of the Huang2020 dflash_config block).
QWEN3_4B_BACKBONE = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "max_position_embeddings": 40960, "attention_bias": False, "layer_types": ["full_attention"] * 5,
    "tie_word_embeddings": False, "dtype": "bfloat16", "block_size": 16, "num_target_layers": 36,
}
DFLASH_4B = {**QWEN3_4B_BACKBONE, "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}}
DOMINO_4B = {**QWEN3_4B_BACKBONE, "dflash_config": {
    "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33], "projector_type": "domino", "shift_label": True,
    "pure_draft_prefix_len": 1, "gru_hidden_dim": 1024, "emb_dim": 256}}


def _expected_4b_keys(domino: bool) -> dict[str, tuple[int, ...]]:
    keys: dict[str, tuple[int, ...]] = {}
    for i in range(5):
        p = f"layers.{i}."
        keys |= {p + "self_attn.q_proj.weight": (4096, 2560), p + "self_attn.k_proj.weight": (1024, 2560),
                 p + "self_attn.v_proj.weight": (1024, 2560), p + "self_attn.o_proj.weight": (2560, 4096),
                 p + "self_attn.q_norm.weight": (128,), p + "self_attn.k_norm.weight": (128,),
                 p + "mlp.gate_proj.weight": (9728, 2560), p + "mlp.up_proj.weight": (9728, 2560),
                 p + "mlp.down_proj.weight": (2560, 9728),
                 p + "input_layernorm.weight": (2560,), p + "post_attention_layernorm.weight": (2560,)}
    keys |= {"fc.weight": (2560, 12800), "hidden_norm.weight": (2560,), "norm.weight": (2560,)}
    if domino:
        keys |= {"prefix_gru.weight_ih_l0": (3072, 2560), "prefix_gru.weight_hh_l0": (3072, 1024),
                 "embed_proj.0.weight": (256, 3584), "embed_proj.2.weight": (151936, 256)}
    return keys


@pytest.mark.parametrize("cfg,domino,count", [(DOMINO_4B, True, 62), (DFLASH_4B, False, 58)])
def test_qwen3_4b_state_dict_keys_and_shapes(cfg, domino, count):
    c = DrafterConfig.from_hf(cfg)
    with torch.device("meta"):
        model = DFlashDrafter(c)
    sd = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert len(sd) == count
    assert sd == _expected_4b_keys(domino)
    assert not any(k.startswith(("model.", "embed_tokens", "lm_head")) or k.endswith("inv_freq") for k in sd)


def test_from_hf_parses_the_released_domino_config():
    c = DrafterConfig.from_hf(json.loads(json.dumps(DOMINO_4B)))
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size) == (2560, 9728, 5, 32, 8, 128, 151936)
    assert (c.block_size, c.num_target_layers, c.target_hidden_size, c.mask_token_id) == (16, 36, 2560, 151669)
    assert c.target_layer_ids == [1, 9, 17, 25, 33] and c.feature_dim == 12800
    assert (c.projector_type, c.shift_label, c.pure_draft_prefix_len, c.gru_hidden_dim, c.emb_dim) == \
        ("domino", True, 1, 1024, 256)
    assert c.rope_theta == 1e6 and c.rms_norm_eps == 1e-6 and c.max_position_embeddings == 40960
    assert c.num_draft_slots == 16


def test_from_hf_parses_the_released_dflash_config():
    c = DrafterConfig.from_hf(DFLASH_4B)
    assert c.projector_type is None and c.shift_label is False and c.pure_draft_prefix_len == 0
    assert c.num_draft_slots == 15 and c.mask_token_id == 151669 and c.target_layer_ids == [1, 9, 17, 25, 33]


def test_from_hf_tolerates_older_domino_spellings():
    """DART ``normalize_draft_config``: "causal_v5" -> "domino", emb_dim from the top level,
    gru_hidden_dim falls back to emb_dim; a missing target_layer_ids list is derived from L = 36."""
    dc = {"mask_token_id": 151669, "projector_type": "causal_v5", "shift_label": True}
    c = DrafterConfig.from_hf({**QWEN3_4B_BACKBONE, "emb_dim": 256, "dflash_config": dc})
    assert c.projector_type == "domino" and c.emb_dim == 256 and c.gru_hidden_dim == 256
    assert c.target_layer_ids == [1, 9, 17, 25, 33] and c.pure_draft_prefix_len == 1
    c2 = DrafterConfig.from_hf({**QWEN3_4B_BACKBONE, "emb_dim": 256, "gru_hidden_dim": 1024, "dflash_config": dc})
    assert c2.gru_hidden_dim == 1024


def test_to_hf_round_trips_and_matches_the_released_layout():
    c = DrafterConfig.from_hf(DOMINO_4B)
    hf = c.to_hf()
    for k, v in DOMINO_4B.items():
        assert hf[k] == v, k
    assert DrafterConfig.from_hf(hf) == c
    tiny = tiny_drafter(tiny_target("llama", vocab_size=64, num_layers=2)).config
    assert DrafterConfig.from_hf(json.loads(json.dumps(tiny.to_hf()))) == tiny
    plain = DrafterConfig.from_hf(DFLASH_4B)
    assert "projector_type" not in plain.to_hf()["dflash_config"]
    assert DrafterConfig.from_hf(plain.to_hf()) == plain


def _outputs(drafter: DFlashDrafter, seed: int = 0):
    """Context K/V, block states and (if present) the head's correction and GRU, for fixed inputs."""
    c = drafter.config
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, 5, c.feature_dim, generator=g)
    block = torch.randn(1, c.block_size, c.hidden_size, generator=g)
    with torch.inference_mode():
        kv = drafter.context_kv(feats, torch.arange(5))
        h = drafter.block_forward(block, torch.arange(5, 5 + c.block_size), kv)
        out = [h] + [t for pair in kv for t in pair]
        if drafter.has_head:
            states = torch.randn(c.block_size, c.gru_hidden_dim, generator=g)
            out += [drafter.correction(h[0], states), drafter.gru_cell(block[0], states)]
    return out


@pytest.mark.parametrize("projector_type", ["domino", None])
def test_save_load_strict_round_trip_gives_identical_outputs(tmp_path, projector_type):
    target = tiny_target("llama", vocab_size=64, num_layers=2)
    d = tiny_drafter(target, projector_type=projector_type, block_size=4)
    with torch.no_grad():  # the format stores bf16: make the weights bf16-exact so outputs can match exactly
        for p in d.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    save_drafter(d, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and "dflash_config" in cfg
    sd = load_file(str(tmp_path / "model.safetensors"))
    assert set(sd) == set(d.state_dict()) and all(v.dtype == torch.bfloat16 for v in sd.values())
    loaded = load_drafter(tmp_path)
    assert loaded.config.to_hf() == d.config.to_hf()  # (head-only fields are not stored without a head)
    for a, b in zip(_outputs(d), _outputs(loaded)):
        assert torch.equal(a, b)


def test_load_is_strict(tmp_path):
    target = tiny_target("llama", vocab_size=64, num_layers=2)
    save_drafter(tiny_drafter(target), tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    extra = dict(sd, **{"lm_head.weight": torch.zeros(64, 32, dtype=torch.bfloat16)})
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(RuntimeError):
        load_drafter(tmp_path)
    missing = {k: v for k, v in sd.items() if k != "embed_proj.2.weight"}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(RuntimeError):
        load_drafter(tmp_path)
    wrong = dict(sd, **{"fc.weight": torch.zeros(32, 7, dtype=torch.bfloat16)})
    save_file(wrong, str(tmp_path / "model.safetensors"))
    with pytest.raises(RuntimeError):
        load_drafter(tmp_path)


def test_missing_files_raise(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_drafter(tmp_path)
    save_drafter(tiny_drafter(tiny_target("llama", vocab_size=64, num_layers=2)), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        load_drafter(tmp_path)


@pytest.mark.parametrize("junk", [b"", b"junk", b"\xff" * 64], ids=["empty", "text", "binary"])
def test_damaged_weights_file_is_one_line_naming_it(tmp_path, junk):
    """A truncated / foreign model.safetensors is a ValueError naming the file (the CLI prints it in
    one line), not safetensors' own SafetensorError traceback."""
    save_drafter(tiny_drafter(tiny_target("llama", vocab_size=64, num_layers=2)), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(junk)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file") as e:
        load_drafter(tmp_path)
    assert "\n" not in str(e.value)


def test_generate_with_a_damaged_drafter_is_one_line(tmp_path, capsys):
    from services import cli

    save_drafter(tiny_drafter(tiny_target("llama", vocab_size=64, num_layers=2)), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"junk")
    assert cli.main(["generate", "hi", "--drafter", str(tmp_path), "--weights", "float32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a readable safetensors file" in err[0], err


@pytest.mark.parametrize("tied", [True, False])
def test_load_borrowed_weights(tmp_path, tied):
    model = tiny_causal_lm("qwen3", vocab_size=64, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path)
    embed, head = load_borrowed_weights(tmp_path)
    assert torch.equal(embed.weight, model.get_input_embeddings().weight)
    assert torch.equal(head.weight, model.get_output_embeddings().weight)
    x = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(head(x), model.get_output_embeddings()(x))
    if not tied:
        assert not torch.equal(head.weight, embed.weight)
