"""Tiny models on disk for smoke runs and tests: byte-level tokenizer directories and a random-weight
target (llama) with a DARTree drafter that load in seconds on a CPU.

The target uses the byte-level tokenizer, so a gateway, verifier and drafter started on these
directories all read the same ``tokenizer.json`` (the handshake compares its hash). Nothing here is
a real model: the tokens they produce are meaningless, only their plumbing is real.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

CONTEXT = 256  # context window of the tiny target
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
CORPUS = ["Hello world, this is a test.", "你好，世界！这是一个测试。", "Emoji 😀🎉 party time",
          "The quick brown fox jumps over the lazy dog", "STOP here. END of text"] * 4


def _write_dir(path: Path, tok: Tokenizer, eos: str, eos_id: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "bos_token": "<|im_start|>"}))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (path / "config.json").write_text(json.dumps({"eos_token_id": eos_id, "vocab_size": tok.get_vocab_size(),
                                                  "max_position_embeddings": CONTEXT}))
    return path


def bytelevel_model_dir(path: Path) -> Path:
    """A GPT-2/SmolLM2-style byte-level BPE (CJK and emoji split across tokens)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return _write_dir(path, tok, "<|im_end|>", 2)


def bytefallback_model_dir(path: Path) -> Path:
    """A SentencePiece/Llama-style tokenizer: Metaspace + byte-fallback tokens ``<0xE4>``."""
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'", "你", "好", "世", "界"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<|endoftext|>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    return _write_dir(path, tok, "<|im_end|>", 2)


def make_tiny_models(root: Path, seed: int = 0, context: int | None = None) -> tuple[Path, Path]:
    """``(target_dir, drafter_dir)`` under ``root`` (created once; reused if present); ``context``: both
    models' position limit (None = :data:`CONTEXT`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.drafter.model import DFlashDrafter, DrafterConfig, save_drafter

    target_dir, drafter_dir = root / "target", root / "drafter"
    if (target_dir / "model.safetensors").is_file() and (drafter_dir / "model.safetensors").is_file():
        return target_dir, drafter_dir
    bytelevel_model_dir(target_dir)
    vocab = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    ctx = CONTEXT if context is None else context
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ctx,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(target_dir)
    dcfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=vocab, max_position_embeddings=ctx,
                         block_size=4, num_target_layers=4, target_hidden_size=64, mask_token_id=3,
                         target_layer_ids=[1, 2], projector_type="domino", gru_hidden_dim=32, emb_dim=32)
    save_drafter(DFlashDrafter(dcfg), drafter_dir)
    return target_dir, drafter_dir
