"""The public drafter checkpoint layouts, read into :class:`~services.drafter.config.DrafterConfig`
fields, and the fields we refuse: torch-free (the supervisor reads configs before it spawns anything).

Layouts (``docs/drafter-layouts.md``):

- **DFlash** (z-lab ``DFlashDraftModel``): Qwen3 backbone fields at the top level, the drafter's own
  in ``dflash_config`` (``block_size`` there or, in the first releases, at the top level).
- **Domino** heads: the DFlash layout with ``dflash_config.projector_type`` ``"domino"`` (older
  exports: ``"causal_v5"``), ``prefix_gru.*`` and ``embed_proj.*`` tensors.
- **DFlash 2** (``DFlash2DraftModel``: dynamic convolutions and a candidate selector): refused.
- **DSpark**: ``Qwen3DSparkModel`` (top-level ``target_layer_ids`` / ``mask_token_id`` / Markov fields)
  or the speculators ``DSparkSpeculator`` export.
- **speculators** exports (vllm-project/speculators ``speculators_model_type`` ``"dflash"`` /
  ``"dspark"``): the backbone nested in ``transformer_layer_config``, feature taps as
  ``aux_hidden_state_layer_ids`` (layer *input* ids = our output ids + 1), the drafter's own
  ``embed_tokens`` and ``lm_head`` (``[draft_vocab_size, H]``), ``d2t`` / ``t2d`` when reduced.

Every field that changes what the drafter computes is either served exactly or refused with a
:class:`LayoutError` naming it; fields that do not (token ids, training settings, bookkeeping) are
listed in :data:`INERT_FIELDS`, and any other field is refused too, so a checkpoint is never run
with a setting we silently ignore.
"""

from __future__ import annotations

from typing import Any


class LayoutError(ValueError):
    """A drafter config field (or tensor) that cannot be served exactly; the message is one line
    naming it."""


# Qwen3 backbone fields read as they are (services.drafter.config._backbone_fields)
BACKBONE_FIELDS = frozenset({
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings"})
# fields read and served (checked below): rotary, bias, activation, attention pattern
CHECKED_FIELDS = frozenset({
    "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias", "hidden_act", "layer_types",
    "use_sliding_window", "is_causal", "dflash_config", "draft_vocab_size", "block_size", "mask_token_id",
    "target_layer_ids", "num_target_layers", "target_hidden_size", "emb_dim", "gru_hidden_dim",
    "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "num_anchors",
    "target_copies_omitted", "dartree_own_io"})
# fields that do not change the drafter's math: HF bookkeeping, token ids, training-only settings
INERT_FIELDS = frozenset({
    "_name_or_path", "name_or_path", "architectures", "auto_map", "model_type", "transformers_version", "dtype",
    "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "tie_word_embeddings", "use_cache", "initializer_range", "attention_dropout", "max_window_layers",
    "sliding_window", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "pruned_heads", "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "task_specific_params",
    "finetuning_task", "num_labels", "use_bfloat16", "tf_legacy_loss", "cross_attention_hidden_size",
    "training"})  # our trainer's record of how the checkpoint was made
# rope types whose tables transformers' init functions give exactly for any position (services.hf_compat)
SERVED_ROPE = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}
_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                        "mscale", "mscale_all_dim", "truncate", "partial_rotary_factor"})
# dflash_config: served fields, and math-changing ones served only at their neutral value
DFLASH_SERVED = frozenset({"mask_token_id", "target_layer_ids", "block_size", "projector_type", "shift_label",
                           "pure_draft_prefix_len", "gru_hidden_dim", "emb_dim"})
DFLASH_NEUTRAL = {"output_multiplier": 1.0, "final_logit_softcapping": 0.0, "input_embedding_scale": 1.0,
                  "attention_value_scale": 1.0, "use_swa": False, "causal": False}
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# speculators exports: their own top-level fields (DFlashSpeculatorConfig / DSparkSpeculatorConfig)
SPECULATORS_FIELDS = frozenset({
    "speculators_model_type", "speculators_version", "speculators_config", "architectures", "auto_map",
    "transformer_layer_config", "draft_vocab_size", "block_size", "target_hidden_size",
    "aux_hidden_state_layer_ids", "mask_token_id", "sliding_window_non_causal", "sample_from_anchor",
    "projector_type", "pure_draft_prefix_len", "emb_dim", "gru_hidden_dim", "lambda_base_start",
    "lambda_base_decay_ratio", "auf", "shift_label", "markov_rank", "markov_head_type", "enable_confidence_head",
    "confidence_head_with_markov", "dtype", "torch_dtype", "transformers_version", "model_type",
    "has_no_defaults_at_init"})
# speculators tensors that only feed its training loss (the verifier's head / norm): not loaded
SPECULATORS_TRAINING_KEYS = ("verifier_lm_head.weight", "verifier_norm.weight")
SPECULATORS_DOMINO_PREFIX = "domino_head."


def layout_of(raw: dict) -> str:
    """The layout a drafter ``config.json`` dict is written in: ``"speculators"``, ``"dspark"``,
    ``"dflash2"`` or ``"dflash"`` (z-lab DFlash, Domino, our own)."""
    archs = raw.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    if "speculators_model_type" in raw or "transformer_layer_config" in raw:
        return "speculators"
    if "Qwen3DSparkModel" in archs or raw.get("markov_rank"):
        return "dspark"
    dc = raw.get("dflash_config") or {}
    if "DFlash2DraftModel" in archs or any(k in dc for k in DFLASH2_FIELDS):
        return "dflash2"
    return "dflash"


def check_backbone(cfg: dict, where: str = "") -> dict | None:
    """Refuse what the drafter's Qwen3 backbone cannot compute exactly; return the RoPE scaling to
    serve (``rope_type`` and its keys, without ``rope_theta``) or None for the plain RoPE.

    ``where``: the prefix of the field names in messages (``"transformer_layer_config."``).

    Raises:
        LayoutError: a sliding-window or causal layer, an activation other than SiLU, an MLP bias,
            a RoPE we cannot reproduce (dynamic / longrope / partial / interleaved), a quantization
            config (each names its field).
    """
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise LayoutError(f"{where}hidden_act {act!r} is not served (the drafter MLP is SiLU-gated)")
    if cfg.get("mlp_bias"):
        raise LayoutError(f"{where}mlp_bias: true is not served (the drafter MLP has no biases)")
    if not isinstance(cfg.get("attention_bias", False), bool):
        raise LayoutError(f"{where}attention_bias must be true or false (got {cfg['attention_bias']!r})")
    types = set(cfg.get("layer_types") or ["full_attention"])
    if types != {"full_attention"}:
        raise LayoutError(f"{where}layer_types {sorted(types)} is not served (only full_attention drafter layers)")
    if cfg.get("use_sliding_window"):
        raise LayoutError(f"{where}use_sliding_window: true is not served (drafter layers attend to every context row)")
    if cfg.get("is_causal"):
        raise LayoutError(f"{where}is_causal: true is not served (the draft block attends bidirectionally)")
    for key in ("quantization_config", "rope_is_neox_style"):
        if key in cfg and not (key == "rope_is_neox_style" and cfg[key] is True):
            raise LayoutError(f"{where}{key} is not served (dense half-split rotary weights only)")
    return rope_scaling_of(cfg, where)


def rope_scaling_of(cfg: dict, where: str = "") -> dict | None:
    """The served RoPE scaling of a config (``rope_scaling``, or ``rope_parameters`` as transformers 5
    writes it): ``rope_type`` and its keys without ``rope_theta``, or None for the plain RoPE.

    Raises:
        LayoutError: a RoPE type or key we cannot reproduce, or a served type missing a key (named).
    """
    name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rp = cfg.get(name) or {}
    if not isinstance(rp, dict):
        raise LayoutError(f"{where}{name} must be an object (got {rp!r})")
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind != "default" and kind not in SERVED_ROPE:
        raise LayoutError(f"{where}{name}.rope_type {kind!r} is not served (served: default, {', '.join(SERVED_ROPE)})")
    unknown = sorted(set(rp) - _ROPE_KEYS)
    if unknown:
        raise LayoutError(f"{where}{name}.{unknown[0]} is not served (a RoPE we cannot reproduce exactly)")
    if float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise LayoutError(f"{where}partial_rotary_factor is not served (the drafter rotates every head dimension)")
    if kind == "default":
        return None
    missing = [k for k in SERVED_ROPE[kind] if k not in rp]
    if missing:
        raise LayoutError(f"{where}{name}.{missing[0]} is missing ({kind!r} RoPE needs {', '.join(SERVED_ROPE[kind])})")
    return {k: v for k, v in rp.items() if k not in ("rope_theta", "type", "partial_rotary_factor")} | {"rope_type": kind}


def rope_theta(cfg: dict, default: float) -> float:
    """``rope_theta`` at the top level, or inside ``rope_parameters`` / ``rope_scaling``."""
    for block in (cfg, cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}):
        if isinstance(block, dict) and "rope_theta" in block:
            return float(block["rope_theta"])
    return default


def check_fields(raw: dict, known: frozenset, where: str = "") -> None:
    """Refuse a field of ``raw`` that is neither served (``known``) nor inert (:data:`INERT_FIELDS`).

    Raises:
        LayoutError: naming the first such field.
    """
    unknown = sorted(set(raw) - known - INERT_FIELDS)
    if unknown:
        raise LayoutError(f"config field {where}{unknown[0]} is not known to this server; "
                          "refused rather than ignored (it may change the drafter's output)")


def check_dflash_config(dc: dict) -> None:
    """Refuse a ``dflash_config`` field that is not served, or a math-changing one away from its neutral
    value (``output_multiplier``, ``final_logit_softcapping``, ...), and DFlash 2's convolutions.

    Raises:
        LayoutError: naming ``dflash_config.<field>``.
    """
    for key in DFLASH2_FIELDS:
        if key in dc:
            raise LayoutError(f"dflash_config.{key}: a DFlash 2 drafter (dynamic convolutions layers.N.attention_conv / "
                              "mlp_conv and candidate_selector.* tensors) is not served")
    for key, neutral in DFLASH_NEUTRAL.items():
        value = dc.get(key)
        if value is not None and value != neutral:
            raise LayoutError(f"dflash_config.{key} = {value!r} is not served (only {neutral!r})")
    unknown = sorted(set(dc) - DFLASH_SERVED - set(DFLASH_NEUTRAL) - {"swa_window_size"})
    if unknown:
        raise LayoutError(f"config field dflash_config.{unknown[0]} is not known to this server; "
                          "refused rather than ignored (it may change the drafter's output)")
    proj = dc.get("projector_type")
    if proj not in (None, "dflash", "domino", "causal_v5"):
        raise LayoutError(f"dflash_config.projector_type {proj!r} is not served (served: domino, causal_v5, none)")


def speculators_fields(raw: dict) -> dict[str, Any]:
    """A speculators export's config (``speculators_model_type`` ``dflash`` / ``dspark``) as the
    flat field set :meth:`DrafterConfig.from_hf` reads.

    Raises:
        LayoutError: another speculators model type, a missing ``transformer_layer_config`` /
            ``aux_hidden_state_layer_ids`` / ``mask_token_id``, a DSpark without a Markov head or with a
            reduced vocabulary, a Domino head over a reduced vocabulary, an unknown field.
    """
    kind = raw.get("speculators_model_type")
    if kind not in ("dflash", "dspark"):
        raise LayoutError(f"speculators_model_type {kind!r} is not served here (dflash, dspark)")
    check_fields(raw, SPECULATORS_FIELDS)
    tl = raw.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise LayoutError("transformer_layer_config is missing (a speculators export nests its backbone there)")
    check_fields(tl, BACKBONE_FIELDS | CHECKED_FIELDS, "transformer_layer_config.")
    aux = raw.get("aux_hidden_state_layer_ids")
    if not aux:
        raise LayoutError("aux_hidden_state_layer_ids is missing (which target layers the drafter reads)")
    if raw.get("mask_token_id") is None:
        raise LayoutError("mask_token_id is missing (the token of the draft block's masked rows)")
    vocab = tl["vocab_size"]
    draft = raw.get("draft_vocab_size") or vocab
    proj = raw.get("projector_type", "dflash")
    if proj not in ("dflash", "domino"):
        raise LayoutError(f"projector_type {proj!r} is not served (served: dflash, domino)")
    if (kind == "dspark" or proj == "domino") and draft != vocab:
        raise LayoutError(f"draft_vocab_size {draft} != vocab_size {vocab}: a reduced vocabulary is not served "
                          f"for a {'DSpark' if kind == 'dspark' else 'Domino'} head")
    anchor = raw.get("sample_from_anchor", kind == "dspark")
    shift = bool(anchor or raw.get("shift_label") or (proj == "domino" and raw.get("shift_label") is None))
    flat = {**tl, "num_target_layers": max(aux), "dartree_own_io": True,
            "target_hidden_size": raw.get("target_hidden_size") or tl["hidden_size"]}
    drafter = {"block_size": raw.get("block_size", 8), "mask_token_id": raw["mask_token_id"],
               "target_layer_ids": [int(i) - 1 for i in aux]}
    if kind == "dspark":
        return _speculators_dspark(raw, flat | drafter, shift)
    dc = drafter | {"shift_label": shift}
    if proj == "domino":
        dc.update(projector_type="domino", pure_draft_prefix_len=raw.get("pure_draft_prefix_len", 1),
                  emb_dim=raw.get("emb_dim", 256), gru_hidden_dim=raw.get("gru_hidden_dim", 1024))
    return flat | {"dflash_config": dc} | ({"draft_vocab_size": draft} if draft != vocab else {})


def _speculators_dspark(raw: dict, flat: dict, shift: bool) -> dict:
    """A speculators DSpark export as the ``Qwen3DSparkModel`` field set.

    Raises:
        LayoutError: no Markov head (``markov_rank`` 0) or ``sample_from_anchor: false``.
    """
    if not raw.get("markov_rank"):
        raise LayoutError("markov_rank 0: a DSpark export without its Markov head is not served")
    if not shift:
        raise LayoutError("sample_from_anchor: false is not served for a DSpark drafter")
    return flat | {"architectures": ["Qwen3DSparkModel"], "markov_rank": raw["markov_rank"],
                   "markov_head_type": raw.get("markov_head_type", "vanilla"),
                   "enable_confidence_head": raw.get("enable_confidence_head", True),
                   "confidence_head_with_markov": raw.get("confidence_head_with_markov", True)}


def speculators_keys(sd: dict) -> dict:
    """A speculators export's state dict in our key names: the Domino head's ``domino_head.`` prefix
    dropped, the verifier's head / norm (training targets only) left out."""
    out = {}
    for k, v in sd.items():
        if k in SPECULATORS_TRAINING_KEYS:
            continue
        out[k[len(SPECULATORS_DOMINO_PREFIX):] if k.startswith(SPECULATORS_DOMINO_PREFIX) else k] = v
    return out

