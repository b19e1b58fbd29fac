"""Which target architectures are served exactly, and why every other one is refused at start.

The verifier runs a target through transformers' own decoder modules with one piece replaced: the
attention call (:func:`services.verifier.slot_attention.slot_attention`), which attends over the slot KV
cache with a causal or tree mask over **every** earlier position, and keeps one key/value row per
layer, KV head and position. A target is served exactly when that is the attention its own
modules compute. That holds for the families in :data:`SERVED`, and fails for:

- sliding-window attention actually in use (Mistral's ``sliding_window``; Qwen2/Qwen3 only with
  ``use_sliding_window: true`` — their configs carry a ``sliding_window`` value that is unused
  otherwise). Exact while every position is inside the window, so it is served when the context is
  capped at the window (``--max-context``), refused otherwise;
- attention sinks (gpt-oss's per-head ``s_aux`` logits in the softmax);
- hybrid / linear-attention layers (``layer_types`` with linear attention or Mamba layers, Qwen3-Next
  and Qwen3.5): their recurrent state is not a key/value row per position;
- multi-head latent attention (``kv_lora_rank``, DeepSeek-V2/V3): the cached latent is not the
  ``[heads, head_dim]`` rows the slot cache holds;
- any ``model_type`` not listed here.

Torch- and transformers-free: the supervisor checks a ``config.json`` before anything loads.
``docs/models.md`` has the table for users.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

# model_type -> the transformers class that runs it (served exactly, equivalence-tested on CPU)
SERVED = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM (full attention)",
          "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

_SINKS = "attention sinks (per-head s_aux logits in the softmax) are not implemented"
_HYBRID = "hybrid linear-attention / state-space layers are not implemented (their state is not per-position KV)"
_MLA = "multi-head latent attention (kv_lora_rank) does not fit the per-head KV slot cache"
_SWA = "sliding-window attention on some layers (with other per-layer features) is not implemented"
# model_type -> why it is refused (known families; anything else is refused as unknown)
REFUSED = {"gpt_oss": _SINKS,
           "qwen3_next": _HYBRID, "qwen3_5": _HYBRID, "qwen3_5_text": _HYBRID, "qwen3_5_moe": _HYBRID,
           "qwen3_5_moe_text": _HYBRID, "jamba": _HYBRID,
           "mamba": _HYBRID, "mamba2": _HYBRID, "falcon_h1": _HYBRID, "bamba": _HYBRID, "zamba2": _HYBRID,
           "lfm2": _HYBRID, "granitemoehybrid": _HYBRID, "nemotron_h": _HYBRID, "minimax": _HYBRID,
           "deepseek_v2": _MLA, "deepseek_v3": _MLA, "kimi_k2": _MLA, "minicpm3": _MLA,
           "gemma2": _SWA, "gemma3": _SWA, "gemma3_text": _SWA, "cohere2": _SWA, "ministral": _SWA}
_LINEAR_LAYER_WORDS = ("linear", "mamba", "conv", "recurrent", "ssm")
_QWEN = ("qwen2", "qwen3", "qwen3_moe")


class UnsupportedArchitecture(ValueError):
    """A target that cannot be served exactly (the message is one line with the reason and, where
    one exists, the flag that makes it servable)."""


def _refuse(name: str, reason: str) -> UnsupportedArchitecture:
    return UnsupportedArchitecture(f"target {name} cannot be served exactly: {reason}")


def _window_layers(cfg: Mapping) -> int | None:
    """The sliding window (tokens) when some layer of a served family uses one, else None."""
    kind = cfg.get("model_type")
    window = cfg.get("sliding_window")
    if kind == "mistral":  # MistralModel masks every layer by sliding_window when it is set
        return int(window) if window else None
    if kind in _QWEN:  # the window is used only with use_sliding_window, from layer max_window_layers on
        if not (cfg.get("use_sliding_window") and window):
            return None
        types = cfg.get("layer_types")
        if types is not None:
            return int(window) if "sliding_attention" in types else None
        first = int(cfg.get("max_window_layers") or 0)
        return int(window) if first < int(cfg.get("num_hidden_layers") or 0) else None
    return None


def served_context(cfg: Mapping, name: str = "") -> int:
    """The longest context (tokens) in which the target ``cfg`` (a ``config.json`` as a mapping) is
    served exactly: ``max_position_embeddings``, or the sliding window when one is in use and shorter.

    Raises:
        UnsupportedArchitecture: an architecture not served at any context (module docstring), one line.
    """
    name = name or repr(cfg.get("_name_or_path") or "")
    kind = cfg.get("model_type")
    if kind in REFUSED:
        raise _refuse(name, f"model_type {kind!r}: {REFUSED[kind]}")
    if cfg.get("kv_lora_rank"):
        raise _refuse(name, _MLA)
    types = [str(t).lower() for t in cfg.get("layer_types") or []]
    if any(w in t for t in types for w in _LINEAR_LAYER_WORDS):
        odd = sorted({t for t in types if any(w in t for w in _LINEAR_LAYER_WORDS)})
        raise _refuse(name, f"layer_types has {', '.join(odd)} layers: {_HYBRID}")
    if kind not in SERVED:
        raise _refuse(name, f"model_type {kind!r} is not one of the served architectures "
                            f"({', '.join(SERVED)}; docs/models.md)")
    if any(cfg.get(k) for k in ("attention_sinks", "use_sinks")):
        raise _refuse(name, _SINKS)
    context = int(cfg.get("max_position_embeddings") or 2048)
    window = _window_layers(cfg)
    return min(context, window) if window else context


def check_architecture(cfg: Mapping, max_context: int = 0, name: str = "",
                       fix: str = "pass --max-context {limit} or less") -> int:
    """The context served for ``cfg`` when ``max_context`` tokens (0 = the target's own limit) are
    asked for: :func:`served_context` plus the sliding-window rule (exact only while every position
    is inside the window, so a longer context is refused, ending with ``fix`` formatted with the
    window as ``limit``).

    Raises:
        UnsupportedArchitecture: refused (one line: the reason, and the flag when a cap serves it).
    """
    limit = served_context(cfg, name)
    own = int(cfg.get("max_position_embeddings") or 2048)
    wanted = min(max_context or own, own)
    if wanted > limit:
        name = name or repr(cfg.get("_name_or_path") or "")
        raise _refuse(name, f"sliding-window attention with a {limit}-token window is in use and only full "
                            f"attention is implemented (exact up to {limit} tokens; the context asked for is "
                            f"{wanted}): " + fix.format(limit=limit))
    return wanted


def read_config(model_dir: str | Path) -> dict:
    """``model_dir/config.json`` as a dict.

    Raises:
        ValueError: a config.json that is not a JSON object (one line). FileNotFoundError: none there.
    """
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a model config (not a JSON object)")
    return cfg


def check_target_dir(model_dir: str | Path, max_context: int = 0, name: str = "",
                     fix: str = "pass --max-context {limit} or less") -> int:
    """:func:`check_architecture` of the ``config.json`` in ``model_dir``; ``name`` (default: the
    directory) is what the refusal calls the target."""
    return check_architecture(read_config(model_dir), max_context, name or repr(str(model_dir)), fix)
