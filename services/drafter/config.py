"""The drafter's configuration (:class:`DrafterConfig`, its ``config.json`` layouts) and the kind of
drafter a checkpoint directory holds: torch-free.

The supervisor (``dartree serve``) checks the default method against the drafter's kind before it
spawns anything, and must not import torch to do so (``services/serve.py``); the modules that build
the drafter (``services/drafter/model.py``) use the same class.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from services.drafter.layouts import (BACKBONE_FIELDS, CHECKED_FIELDS, LayoutError, check_backbone,
                                      check_dflash_config, check_fields, layout_of, speculators_fields)
from services.drafter.layouts import rope_theta as config_rope_theta
from services.models.layers import default_target_layer_ids


def drafter_kind(path: str | Path) -> str:
    """The kind of drafter a directory holds, from its ``config.json`` alone (no weights loaded, no
    torch): ``"eagle3"``, ``"dspark"``, ``"domino"`` or ``"dflash"``
    (:func:`services.protocol.served_methods`).

    Raises:
        FileNotFoundError: no config.json. ValueError: a config.json that is not valid JSON or not a
            drafter's (a target model's ``*ForCausalLM`` included), in one line;
            :class:`~services.drafter.layouts.LayoutError` (a ValueError) for a layout or field we
            cannot serve exactly, naming it.
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
        return DrafterConfig.from_hf(raw).kind
    except LayoutError as exc:
        raise LayoutError(f"{p / 'config.json'} is not a drafter config this server runs exactly: {exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as exc:
        raise ValueError(f"{p / 'config.json'} is not a drafter config ({type(exc).__name__}: {exc})") from None


@dataclass
class DrafterConfig:
    """Drafter hyper-parameters, serialised as a HF ``config.json`` with a ``dflash_config`` block."""

    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 2
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    vocab_size: int = 49152
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    block_size: int = 16
    num_target_layers: int = 30
    target_hidden_size: int = 576
    mask_token_id: int = 16
    target_layer_ids: list[int] = field(default_factory=lambda: default_target_layer_ids(30))
    projector_type: str | None = "domino"  # None = plain DFlash (no correction head)
    shift_label: bool = True
    pure_draft_prefix_len: int = 1
    gru_hidden_dim: int = 256
    emb_dim: int = 128
    draft_vocab_size: int | None = None  # None = draft over the full target vocabulary (released layout)
    # DSpark (projector_type "markov", docs/algorithms.md §3): low-rank bigram head and optional confidence head
    markov_rank: int = 0
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    num_anchors: int = 512
    attention_bias: bool = False  # biases on q/k/v/o_proj (``attention_bias: true``)
    rope_scaling: dict | None = None  # a scaled RoPE (rope_type linear / llama3 / yarn and its keys); None: plain
    own_io: bool = False  # own embed_tokens [V, H] / lm_head [out_vocab, H] (speculators exports), not the target's

    def __post_init__(self) -> None:
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}] (got {self.draft_vocab_size})")
        if self.projector_type not in (None, "domino", "markov"):
            raise ValueError(f"unsupported projector_type {self.projector_type!r} (choose from None, 'domino', 'markov')")
        if self.projector_type == "markov":
            if self.markov_rank < 1:
                raise ValueError(f"a DSpark (markov) drafter needs markov_rank >= 1 (got {self.markov_rank})")
            if not self.shift_label:
                raise ValueError("a DSpark (markov) drafter uses the shift-label layout (shift_label must be true)")
            if self.draft_vocab_size is not None:
                raise ValueError("a DSpark (markov) drafter drafts over the full vocabulary (no draft_vocab_size)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def feature_dim(self) -> int:
        """Width of the concatenated target features: ``len(target_layer_ids) * target_hidden_size``."""
        return len(self.target_layer_ids) * self.target_hidden_size

    @property
    def out_vocab_size(self) -> int:
        """Rows of the drafter's output projections: ``draft_vocab_size`` when reduced, else ``vocab_size``."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def num_draft_slots(self) -> int:
        """Draft depth D: 16 rows under shift-label, ``block_size - 1`` otherwise."""
        return self.block_size if self.shift_label else self.block_size - 1

    @property
    def is_dspark(self) -> bool:
        """A DSpark drafter: own embedding / lm_head copies and a vanilla Markov head (docs/algorithms.md §3)."""
        return self.projector_type == "markov"

    @property
    def kind(self) -> str:
        """``"dspark"``, ``"domino"`` or ``"dflash"``: which methods it serves
        (:func:`services.protocol.served_methods`)."""
        return "dspark" if self.is_dspark else "domino" if self.projector_type == "domino" else "dflash"

    def to_hf(self) -> dict:
        """The released config.json layout (docs/algorithms.md §1.1; DSpark's ``Qwen3DSparkModel`` layout, §3)."""
        if self.is_dspark:
            return self._to_hf_dspark()
        dc = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.projector_type:
            dc.update(projector_type=self.projector_type, shift_label=self.shift_label,
                      pure_draft_prefix_len=self.pure_draft_prefix_len, gru_hidden_dim=self.gru_hidden_dim,
                      emb_dim=self.emb_dim)
        out = {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings, "attention_bias": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers, "tie_word_embeddings": False,
            "dtype": "bfloat16", "block_size": self.block_size, "num_target_layers": self.num_target_layers,
            "target_hidden_size": self.target_hidden_size, "dflash_config": dc,
        }
        if self.draft_vocab_size is not None:  # EAGLE-3's field; absent in the full-vocabulary layout
            out["draft_vocab_size"] = self.draft_vocab_size
        return out | self._to_hf_extras()

    def _to_hf_extras(self) -> dict:
        """The fields away from the released defaults: attention bias, a scaled RoPE, own embedding / head."""
        out: dict = {"attention_bias": self.attention_bias}
        if self.rope_scaling:
            out["rope_scaling"] = dict(self.rope_scaling)
        if self.own_io:
            out["dartree_own_io"] = True
        return out

    def _to_hf_dspark(self) -> dict:
        """DSpark's released config layout: top-level ``block_size``, ``mask_token_id``, ``target_layer_ids``,
        Markov / confidence head fields, ``rope_parameters`` (DSPK ``config/dspark``; docs/algorithms.md §3)."""
        return {
            "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings, "attention_bias": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers, "tie_word_embeddings": False,
            "dtype": "bfloat16", "block_size": self.block_size, "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids), "num_target_layers": self.num_target_layers,
            "target_hidden_size": self.target_hidden_size, "num_anchors": self.num_anchors,
            "markov_rank": self.markov_rank, "markov_head_type": "vanilla",
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
        } | self._to_hf_extras()

    @classmethod
    def _from_hf_dspark(cls, cfg: dict, extras: dict) -> "DrafterConfig":
        """Parse DSpark's config layout (``Qwen3DSparkModel``).

        Raises:
            ValueError: a Markov head type other than ``vanilla`` (the only released one), or no Markov head.
        """
        kind = cfg.get("markov_head_type", "vanilla")
        if kind != "vanilla":
            raise LayoutError(f"markov_head_type {kind!r} is not served (only the released 'vanilla' head)")
        n_layers = cfg.get("num_target_layers", 36)
        return cls(
            **_backbone_fields(cfg), **extras, block_size=cfg.get("block_size", 7),
            num_target_layers=n_layers, target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
            mask_token_id=cfg["mask_token_id"],
            target_layer_ids=list(cfg.get("target_layer_ids") or default_target_layer_ids(n_layers)),
            projector_type="markov", shift_label=True, pure_draft_prefix_len=0,
            markov_rank=int(cfg.get("markov_rank", 0)), enable_confidence_head=bool(cfg.get("enable_confidence_head")),
            confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", True)),
            num_anchors=int(cfg.get("num_anchors", 512)))

    @classmethod
    def from_hf(cls, cfg: dict) -> "DrafterConfig":
        """Parse a drafter config.json in any served layout (:mod:`services.drafter.layouts`: z-lab
        DFlash, Domino, DSpark's two schemas, speculators exports; DART's older field spellings too).

        Raises:
            LayoutError: a layout or field that cannot be served exactly, one line naming it.
            KeyError: a missing backbone field.
        """
        layout = layout_of(cfg)
        if layout == "speculators":
            cfg = speculators_fields(cfg)
            layout = layout_of(cfg)
        if layout == "dflash2":
            check_dflash_config(cfg.get("dflash_config") or {})
        check_fields(cfg, BACKBONE_FIELDS | CHECKED_FIELDS)
        extras = dict(rope_scaling=check_backbone(cfg), attention_bias=bool(cfg.get("attention_bias", False)),
                      own_io=bool(cfg.get("dartree_own_io", False)))
        if layout == "dspark":
            return cls._from_hf_dspark(cfg, extras)
        dc = dict(cfg.get("dflash_config") or {})
        check_dflash_config(dc)
        proj = dc.get("projector_type")
        proj = "domino" if proj == "causal_v5" else None if proj == "dflash" else proj
        emb_dim = dc.get("emb_dim", cfg.get("emb_dim", 256))
        n_layers = cfg.get("num_target_layers", 36)
        layer_ids = dc.get("target_layer_ids") or cfg.get("target_layer_ids") or default_target_layer_ids(n_layers)
        return cls(
            **_backbone_fields(cfg), **extras, num_target_layers=n_layers,
            block_size=int(dc.get("block_size", cfg.get("block_size", 16))),  # DFlash 2 nests it in dflash_config
            target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
            mask_token_id=dc.get("mask_token_id", cfg.get("mask_token_id", 0)), target_layer_ids=list(layer_ids),
            projector_type=proj, shift_label=bool(dc.get("shift_label", False)),
            pure_draft_prefix_len=int(dc.get("pure_draft_prefix_len", 1 if proj else 0)),
            gru_hidden_dim=int(dc.get("gru_hidden_dim", cfg.get("gru_hidden_dim", emb_dim))), emb_dim=int(emb_dim),
            draft_vocab_size=cfg.get("draft_vocab_size"),
        )


def _backbone_fields(cfg: dict) -> dict:
    """The Qwen3-style backbone fields every released drafter config.json spells the same way."""
    return dict(
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
        vocab_size=cfg["vocab_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=config_rope_theta(cfg, 1e6),
        max_position_embeddings=cfg.get("max_position_embeddings", 40960))
