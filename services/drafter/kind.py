"""Which kind of drafter a checkpoint directory holds, from its ``config.json`` alone: torch-free.

The supervisor (``dartree serve``) checks the default method against the drafter's kind before it
spawns anything, and must not import torch to do so (``services/serve.py``). The decision mirrors
:meth:`services.drafter.model.DrafterConfig.from_hf` and its validation field for field, without
building the dataclass; ``tests/engine/test_drafter_kind.py`` pins the two to the same answer (kind or
error message) on every shipped drafter and on malformed configs.
"""

from __future__ import annotations

import json
from pathlib import Path

from services.models.layers import default_target_layer_ids


def drafter_kind(path: str | Path) -> str:
    """The kind of drafter a directory holds, from its ``config.json`` alone (no weights loaded, no
    torch): ``"eagle3"``, ``"dspark"``, ``"domino"`` or ``"dflash"``
    (:func:`services.protocol.served_methods`).

    Raises:
        FileNotFoundError: no config.json. ValueError: a config.json that is not valid JSON or not a
            drafter's (a target model's ``*ForCausalLM`` included), in one line.
    """
    p = Path(path)
    try:
        raw = json.loads((p / "config.json").read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p / 'config.json'} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{p / 'config.json'} is not a drafter config (not a JSON object)")
    archs = raw.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    if "LlamaForCausalLMEagle3" in archs:
        return "eagle3"
    plain = [a for a in archs if isinstance(a, str) and a.endswith("ForCausalLM")]
    if plain:  # e.g. a target model's directory passed as --drafter
        raise ValueError(f"{p} holds a {plain[0]} model, not a drafter (DFlash / Domino / DSpark / EAGLE-3)")
    try:
        return config_kind(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{p / 'config.json'} is not a drafter config ({type(exc).__name__}: {exc})") from None


def config_kind(cfg: dict) -> str:
    """``"dspark"``, ``"domino"`` or ``"dflash"`` of a DFlash-family config dict: the fields
    ``DrafterConfig.from_hf`` reads, read in its order, then ``DrafterConfig.__post_init__``'s checks,
    so a bad config fails with the same exception and message.

    Raises:
        KeyError: a required field missing. TypeError, AttributeError: a field of the wrong type.
            ValueError: an unsupported projector / Markov head, a bad ``draft_vocab_size``, heads
            that do not divide.
    """
    if "Qwen3DSparkModel" in (cfg.get("architectures") or []) or cfg.get("markov_rank"):
        head = cfg.get("markov_head_type", "vanilla")
        if head != "vanilla":
            raise ValueError(f"markov_head_type {head!r} is not supported (only the released 'vanilla' head)")
        n_layers = cfg.get("num_target_layers", 36)
        f = _backbone_fields(cfg)
        cfg.get("target_hidden_size", cfg["hidden_size"])
        cfg["mask_token_id"]
        list(cfg.get("target_layer_ids") or default_target_layer_ids(n_layers))
        f.update(projector_type="markov", shift_label=True, draft_vocab_size=None,
                 markov_rank=int(cfg.get("markov_rank", 0)))
        int(cfg.get("num_anchors", 512))
    else:
        dc = dict(cfg.get("dflash_config") or {})
        proj = dc.get("projector_type")
        proj = "domino" if proj == "causal_v5" else proj
        emb_dim = dc.get("emb_dim", cfg.get("emb_dim", 256))
        layer_ids = dc.get("target_layer_ids") or default_target_layer_ids(cfg.get("num_target_layers", 36))
        f = _backbone_fields(cfg)
        cfg.get("target_hidden_size", cfg["hidden_size"])
        list(layer_ids)
        int(dc.get("pure_draft_prefix_len", 1 if proj else 0))
        int(dc.get("gru_hidden_dim", cfg.get("gru_hidden_dim", emb_dim)))
        int(emb_dim)
        f.update(projector_type=proj, shift_label=bool(dc.get("shift_label", False)), markov_rank=0,
                 draft_vocab_size=cfg.get("draft_vocab_size"))
    _check(f)
    return "dspark" if f["projector_type"] == "markov" else "domino" if f["projector_type"] == "domino" else "dflash"


def _backbone_fields(cfg: dict) -> dict:
    """The backbone fields, read as ``services.drafter.model._backbone_fields`` reads them."""
    return dict(
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
        vocab_size=cfg["vocab_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 1e6)))


def _check(f: dict) -> None:
    """``DrafterConfig.__post_init__``'s checks on the fields read (ValueError, in its order)."""
    dv = f["draft_vocab_size"]
    if dv is not None and not 0 < dv <= f["vocab_size"]:
        raise ValueError(f"draft_vocab_size must be in [1, {f['vocab_size']}] (got {dv})")
    proj = f["projector_type"]
    if proj not in (None, "domino", "markov"):
        raise ValueError(f"unsupported projector_type {proj!r} (choose from None, 'domino', 'markov')")
    if proj == "markov":
        if f["markov_rank"] < 1:
            raise ValueError(f"a DSpark (markov) drafter needs markov_rank >= 1 (got {f['markov_rank']})")
        if not f["shift_label"]:
            raise ValueError("a DSpark (markov) drafter uses the shift-label layout (shift_label must be true)")
        if dv is not None:
            raise ValueError("a DSpark (markov) drafter drafts over the full vocabulary (no draft_vocab_size)")
    if f["num_attention_heads"] % f["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
