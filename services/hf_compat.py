"""Every transformers-version-specific call lives here (cache layout, GGUF loading, 4-D masks).

Tested with transformers 5.24 (CPU) ; the cache helpers also handle the 4.x ``key_cache`` layout.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor


def cache_layers(cache) -> list[tuple[Tensor, Tensor]]:
    """``[(keys, values)]`` per layer of a HF ``DynamicCache``; tensors are ``[1, H, T, Dh]``."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def set_cache_layer(cache, i: int, keys: Tensor, values: Tensor) -> None:
    """Replace layer ``i``'s keys and values of a ``DynamicCache`` in place."""
    if hasattr(cache, "layers"):
        cache.layers[i].keys, cache.layers[i].values = keys, values
    else:
        cache.key_cache[i], cache.value_cache[i] = keys, values


def cache_length(cache) -> int:
    """Number of cached positions."""
    return int(cache.get_seq_length())


def new_dynamic_cache(config=None):
    """An empty ``DynamicCache``."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=config)
    except TypeError:
        return DynamicCache()


def load_gguf_model(directory: str, filename: str):
    """Load a GGUF causal LM, dequantized to float32, and its tokenizer (never touches the hub)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    return model, tok


def cache_kwargs(model, cache) -> dict:
    """Keyword that passes a KV cache to ``model.forward`` (``cache`` in 5.x, ``past_key_values`` before)."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions (a negative ``crop`` argument works in 4.x and 5.x)."""
    remove = cache_length(cache) - length
    if remove > 0:
        cache.crop(-remove)


def quiet_progress_bars() -> None:
    """Silence transformers' per-load progress bars (``Loading weights``)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


SLOT_ATTENTION = "dartree_slots"
SLOT_ATTENTION_NO_MASK = "dartree_slots_no_mask"


def register_slot_attention(fn) -> str:
    """Register ``fn`` as a transformers attention implementation named :data:`SLOT_ATTENTION` (and
    give it the SDPA mask builder, so calls without a step use SDPA's masks). Returns the name.

    ``fn(module, query [1, Hq, R, Dh], key [1, Hkv, R, Dh], value, attention_mask, **kwargs)`` must
    return ``(out [1, R, Hq, Dh], None)``, as transformers' own ``sdpa_attention_forward`` does.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(SLOT_ATTENTION, fn)
    AttentionInterface.register(SLOT_ATTENTION_NO_MASK, fn)  # no mask builder: see attention_without_mask
    ALL_MASK_ATTENTION_FUNCTIONS.register(SLOT_ATTENTION, sdpa_mask)
    return SLOT_ATTENTION


@contextlib.contextmanager
def attention_without_mask(model):
    """Within the block, ``model`` (switched to :data:`SLOT_ATTENTION` first) runs the same attention
    function under a name with no mask builder, so transformers builds no causal mask for its
    forward: no ``[R, R]`` mask per step, and none of its host-synchronising checks of the position
    ids (``find_packed_sequence_indices``), which a CUDA graph cannot hold. For steps whose attention
    takes its masks from the step metadata (the runner's padded / CUDA-graph path)."""
    config = model.config
    old = config._attn_implementation
    config._attn_implementation = SLOT_ATTENTION_NO_MASK
    try:
        yield
    finally:
        config._attn_implementation = old


def sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' own SDPA attention (the fallback of the slot attention)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def set_attention_implementation(model, name: str) -> None:
    """Switch a loaded model's attention implementation (every layer reads ``config._attn_implementation``)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older 4.x
        model.config._attn_implementation = name


def decoder_layers(model) -> list:
    """The decoder layers of a loaded causal LM (``model.model.layers`` for llama / qwen2 / qwen3)."""
    return list(model.model.layers)


def mark_layers_as_compile_regions(model) -> int:
    """Make each decoder layer's ``forward`` a ``torch.compiler.nested_compile_region`` (per instance;
    the class is untouched), so a ``torch.compile`` of the whole model traces and compiles one layer
    and stamps it out for the others instead of tracing all of them (hierarchical compilation). In
    eager mode the region is a no-op. Layers of one class share one region. Returns the layer count.

    A region is reused only when its inputs match: per-layer Python constants read inside it
    (e.g. ``layer_idx``) must reach the compiled code as tensors (:mod:`services.verifier.runner`)."""
    import types

    regions: dict = {}
    layers = decoder_layers(model)
    for layer in layers:
        fn = type(layer).forward
        if fn not in regions:
            regions[fn] = torch.compiler.nested_compile_region(fn)
        layer.forward = types.MethodType(regions[fn], layer)
    return len(layers)


def rope_inv_freq(head_dim: int, rope_parameters: dict, max_position_embeddings: int) -> tuple[Tensor, float]:
    """The rotary inverse frequencies ``[head_dim // 2]`` (float32, CPU) and the attention factor (the
    scale transformers applies to ``cos`` / ``sin``; 1.0 except for ``yarn``) of a scaled RoPE, from
    transformers' own init functions (``ROPE_INIT_FUNCTIONS``), for ``rope_parameters`` as a config
    spells them (``rope_type`` and its keys, ``rope_theta`` included; the legacy ``type`` too).

    Raises:
        ValueError: a ``rope_type`` transformers does not know, or parameters it rejects (one line).
    """
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_parameters)
    kind = params.get("rope_type", params.get("type"))
    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {kind!r} is not one of transformers' ({', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
    try:
        cfg = Qwen3Config(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
                          max_position_embeddings=max_position_embeddings, rope_parameters=params)
        inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"rope parameters {params} are not valid for {kind!r} ({exc})") from None
    return inv_freq.float(), float(factor)
