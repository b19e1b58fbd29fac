"""A tiny random-weight target (llama) and DARTree drafter on disk, for process-level tests (CPU, seconds).

The target uses the byte-level test tokenizer, so the gateway, verifier and drafter all read the
same ``tokenizer.json`` (the handshake compares its hash).
"""

from __future__ import annotations

import json
from pathlib import Path

from .fakes import bytelevel_model_dir

CONTEXT = 256
# ``dartree serve`` flags every tiny-model server uses (see services.testing.start_server)
TINY_FLAGS = ("--served-model-name", "tiny", "--default-temperature", "0", "--ping-interval-s", "0.2")


def make_tiny_models(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """``(target_dir, drafter_dir)`` under ``root`` (created once; reused if present)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.drafter.model import DFlashDrafter, DrafterConfig, save_drafter

    target_dir, drafter_dir = root / "target", root / "drafter"
    if (target_dir / "model.safetensors").is_file() and (drafter_dir / "model.safetensors").is_file():
        return target_dir, drafter_dir
    bytelevel_model_dir(target_dir)
    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(target_dir)
    dcfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=vocab, max_position_embeddings=CONTEXT,
                         block_size=4, num_target_layers=4, target_hidden_size=64, mask_token_id=3,
                         target_layer_ids=[1, 2], projector_type="domino", gru_hidden_dim=32, emb_dim=32)
    save_drafter(DFlashDrafter(dcfg), drafter_dir)
    return target_dir, drafter_dir
