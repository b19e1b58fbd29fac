"""EAGLE-3 drafter: one decoder layer over fused low/mid/high target features, reduced draft vocabulary.

Sources: EAGLE-3 (Li et al., arXiv 2503.01840) §3; the released checkpoint layout of
``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`` (15 unprefixed tensors: ``fc.weight [H, 3H]``,
``midlayer.{self_attn.{q,k,v}_proj [*, 2H], self_attn.o_proj, mlp.{gate,up,down}_proj, hidden_norm,
input_layernorm, post_attention_layernorm}.weight``, ``norm.weight``, ``lm_head.weight [N, H]``,
``d2t [N]`` int64, ``t2d [V]`` bool; no ``embed_tokens``: the target's embedding is borrowed).

Step semantics (one ``midlayer`` call, EAGLE-3 ``cnets.py``): the row at position ``i`` takes the pair
``(hidden_i, token_{i+1})``: ``x = [input_layernorm(embed(token_{i+1})); hidden_norm(hidden_i)]``
(``2H`` wide) feeds a Llama attention (no q/k norms, causal over the drafter's cache), residual =
``hidden_i``, then the SiLU MLP; the output ``h_i`` gives ``lm_head(norm(h_i))`` = logits of the token
at ``i + 2`` over the draft vocabulary. ``hidden_i`` is ``fc([f_low; f_mid; f_high])`` for a committed
position (target features) and the drafter's own ``h`` of the parent for a draft node.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.drafter.layers import MLP, RMSNorm, apply_rope, read_model_safetensors, rope_cos_sin
from services.drafter.layouts import rope_scaling_of
from services.drafter.layouts import rope_theta as config_rope_theta

ARCHITECTURE = "LlamaForCausalLMEagle3"


def eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's low / mid / high taps as 0-based layer *output* ids: ``[1, L // 2 - 1, L - 4]``.

    EAGLE-3 captures the inputs of layers ``(2, L // 2, L - 3)`` (vLLM ``aux_hidden_state_layers``),
    i.e. the outputs of the layers one below.
    """
    L = num_target_layers
    return [1, L // 2 - 1, L - 4]


@dataclass
class Eagle3Config:
    """EAGLE-3 hyper-parameters (serialised as the released HF ``config.json`` plus a ``dartree`` block)."""

    hidden_size: int = 576
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    vocab_size: int = 49152
    draft_vocab_size: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    target_hidden_size: int = 576
    num_target_layers: int = 30
    target_layer_ids: list[int] = field(default_factory=lambda: eagle3_layer_ids(30))
    depth: int = 6   # draft steps per round = deepest tree node (EAGLE-3 default 6-8)
    top_k: int = 8   # children kept per expanded node and nodes expanded per step (EAGLE-2/3 top-k)
    rope_scaling: dict | None = None  # a scaled RoPE (e.g. Llama 3.1's llama3), as DrafterConfig.rope_scaling

    def __post_init__(self) -> None:
        if len(self.target_layer_ids) != 3:
            raise ValueError(f"EAGLE-3 fuses exactly 3 target layers (got {self.target_layer_ids})")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}] (got {self.draft_vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.depth < 1 or self.top_k < 1:
            raise ValueError(f"need depth >= 1 and top_k >= 1 (got {self.depth}, {self.top_k})")

    @property
    def feature_dim(self) -> int:
        """Width of the concatenated target features: ``3 * target_hidden_size``."""
        return 3 * self.target_hidden_size

    @property
    def num_draft_slots(self) -> int:
        """Deepest draft node (the engine's ``max_draft_depth``)."""
        return self.depth

    @property
    def out_vocab_size(self) -> int:
        """Rows of ``lm_head``: the draft vocabulary N."""
        return self.draft_vocab_size

    def to_hf(self) -> dict:
        """The released config layout (``LlamaForCausalLMEagle3``). ``eagle_config.eagle_aux_hidden_state_layer_ids``
        are layer *input* ids (vLLM's convention) = our output ids + 1."""
        return {
            "architectures": [ARCHITECTURE], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "attention_bias": False, "tie_word_embeddings": False, "dtype": "bfloat16",
            "target_hidden_size": self.target_hidden_size, "num_target_layers": self.num_target_layers,
            "eagle_config": {"use_aux_hidden_state": True,
                             "eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.target_layer_ids]},
            "dartree": {"depth": self.depth, "top_k": self.top_k},
        } | ({"rope_scaling": dict(self.rope_scaling)} if self.rope_scaling else {})

    @classmethod
    def from_hf(cls, cfg: dict) -> "Eagle3Config":
        """Parse a released or our own EAGLE-3 config.json.

        Raises:
            ValueError: not an EAGLE-3 config, more than one layer, or no ``draft_vocab_size``; a RoPE
                that cannot be served (:class:`~services.drafter.layouts.LayoutError`, naming the field).
        """
        if ARCHITECTURE not in (cfg.get("architectures") or []):
            raise ValueError(f"not an EAGLE-3 config (architectures {cfg.get('architectures')})")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"EAGLE-3 drafters have one layer (config says {cfg.get('num_hidden_layers')})")
        if "draft_vocab_size" not in cfg:
            raise ValueError("EAGLE-3 config has no draft_vocab_size")
        n_t = cfg.get("num_target_layers", 32)
        aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        ours = cfg.get("dartree") or {}
        h = cfg["hidden_size"]
        return cls(
            hidden_size=h, intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim", h // cfg["num_attention_heads"]), vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg["draft_vocab_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=config_rope_theta(cfg, 1e4), rope_scaling=rope_scaling_of(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            target_hidden_size=cfg.get("target_hidden_size", h), num_target_layers=n_t,
            target_layer_ids=[i - 1 for i in aux] if aux else eagle3_layer_ids(n_t),
            depth=int(ours.get("depth", 6)), top_k=int(ours.get("top_k", 8)))


class Eagle3Attention(nn.Module):
    """Llama GQA attention whose q/k/v read the ``2H``-wide ``[embedding; hidden]`` row (no q/k norms)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.c = c
        h, nh, nkv, dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * h, nh * dh, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * dh, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * dh, bias=False)
        self.o_proj = nn.Linear(nh * dh, h, bias=False)

    def forward(self, x: Tensor, pos: Tensor, past_k: Tensor | None, past_v: Tensor | None,
                mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """``x [B, T, 2H]`` at positions ``pos [T]`` or ``[B, T]``; ``past_k/v [B, Hkv, L, Dh]`` (or None);
        ``mask [B, T, L + T]`` bool (True = visible; None = causal over the new rows, all past visible).
        Returns ``(out [B, T, H], k_new [B, Hkv, T, Dh], v_new)`` (rotated keys, to append to a cache)."""
        c = self.c
        cos, sin = rope_cos_sin(pos, c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        q = apply_rope(self.q_proj(x).unflatten(-1, (c.num_attention_heads, c.head_dim)).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim)).transpose(1, 2), cos, sin)
        v = self.v_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim)).transpose(1, 2)
        kk = k if past_k is None else torch.cat([past_k, k], dim=2)
        vv = v if past_v is None else torch.cat([past_v, v], dim=2)
        if mask is None:
            t, total = x.shape[1], kk.shape[2]
            mask = torch.ones(t, total, dtype=torch.bool, device=x.device).tril(total - t)[None].expand(x.shape[0], -1, -1)
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask[:, None], enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).flatten(-2)), k, v


class Eagle3Layer(nn.Module):
    """EAGLE-3's ``midlayer`` (``LlamaDecoderLayeremb``): keys ``self_attn.*``, ``mlp.*``, ``hidden_norm``,
    ``input_layernorm``, ``post_attention_layernorm``."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.self_attn = Eagle3Attention(c)
        self.mlp = MLP(c)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, emb: Tensor, hidden: Tensor, pos: Tensor, past_k: Tensor | None = None,
                past_v: Tensor | None = None, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``emb, hidden [B, T, H]`` -> ``(h [B, T, H], k_new, v_new)`` (see :meth:`Eagle3Attention.forward`)."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        a, k, v = self.self_attn(x, pos, past_k, past_v, mask)
        h = hidden + a
        return h + self.mlp(self.post_attention_layernorm(h)), k, v


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter (released key layout, loads with ``strict=True``); the embedding is the target's.

    Buffers ``d2t [N]`` int64 (draft id ``i`` is target id ``i + d2t[i]``) and ``t2d [V]`` bool.
    """

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(c.feature_dim, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(c.vocab_size) < c.draft_vocab_size)

    has_head = False
    has_markov = False

    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """Set ``d2t`` / ``t2d`` from ``target_ids [N]`` (distinct target ids; draft id i -> target_ids[i]).

        Raises:
            ValueError: wrong length, repeated or out-of-range ids.
        """
        c = self.config
        ids = torch.as_tensor(target_ids, dtype=torch.long).flatten()
        if ids.numel() != c.draft_vocab_size:
            raise ValueError(f"need exactly draft_vocab_size={c.draft_vocab_size} target ids (got {ids.numel()})")
        if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError("draft vocabulary ids must be distinct target ids in [0, vocab_size)")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel()))
            self.t2d.zero_()
            self.t2d[ids] = True

    def draft_to_target(self) -> Tensor:
        """Target id of every draft id ``[N]`` int64."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def fuse(self, features: Tensor) -> Tensor:
        """Target features ``[..., 3 * Ht]`` (low; mid; high) -> drafter hidden ``[..., H]``."""
        return self.fc(features)

    def logits(self, h: Tensor) -> Tensor:
        """Drafter outputs ``[..., H]`` -> logits over the draft vocabulary ``[..., N]``."""
        return self.lm_head(self.norm(h))


def load_eagle3(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Eagle3Drafter:
    """Load an EAGLE-3 directory (``config.json`` + ``model.safetensors``) with ``strict=True``.

    Raises:
        FileNotFoundError: missing files. ValueError: not an EAGLE-3 config, or a damaged
            model.safetensors. RuntimeError: key/shape mismatch.
    """
    p = Path(path)
    cfg = Eagle3Config.from_hf(json.loads((p / "config.json").read_text()))
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    sd = read_model_safetensors(p, device)
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()},
                          strict=True, assign=True)
    return model.eval()
