"""A reference DFlash drafter written after z-lab's ``DFlashDraftModel`` (``dflash/model.py``) on
transformers' own Qwen3 pieces: ``Qwen3Config`` reads the config (RoPE scaling, attention bias),
``Qwen3RotaryEmbedding`` builds the rotary tables, ``Qwen3MLP`` / ``Qwen3RMSNorm`` / ``rotate_half``
do the rest. Its state-dict keys are the released ones (``layers.N.*``, ``fc``, ``hidden_norm``,
``norm``), so the same tensors load into it and into the served drafter: the oracle of
``tests/engine/test_drafter_layouts.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half


class RefAttention(nn.Module):
    """z-lab's ``Qwen3DFlashAttention``: keys / values over [context rows; block rows], non-causal."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        h, nh, nkv, dh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.head_dim = dh
        self.q_proj = nn.Linear(h, nh * dh, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, nkv * dh, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, nkv * dh, bias=config.attention_bias)
        self.o_proj = nn.Linear(nh * dh, h, bias=config.attention_bias)
        self.q_norm = Qwen3RMSNorm(dh, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(dh, eps=config.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``x [B, Q, H]`` block rows, ``ctx [B, C, H]`` projected context; ``cos / sin [B, C + Q, Dh]``."""
        b, q_len, dh = x.shape[0], x.shape[1], self.head_dim
        q = self.q_norm(self.q_proj(x).view(b, q_len, -1, dh)).transpose(1, 2)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], 1).view(b, ctx.shape[1] + q_len, -1, dh)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], 1).view(b, ctx.shape[1] + q_len, -1, dh)
        k, v = self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, q_len, -1))


class RefLayer(nn.Module):
    """z-lab's ``Qwen3DFlashDecoderLayer`` (pre-norm residual attention + MLP)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = RefAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class RefDFlash(nn.Module):
    """z-lab's ``DFlashDraftModel.forward``: ``norm(layers(noise, hidden_norm(fc(target_hidden))))``."""

    def __init__(self, config: Qwen3Config, num_features: int):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(RefLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, noise: Tensor, target_hidden: Tensor, position_ids: Tensor) -> Tensor:
        """``noise [B, Q, H]`` block embeddings, ``target_hidden [B, C, F]``, ``position_ids [B, C + Q]``
        -> drafter states ``[B, Q, H]``."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise, position_ids)
        h = noise
        for layer in self.layers:
            h = layer(h, ctx, cos, sin)
        return self.norm(h)


def reference_for(backbone: dict, num_features: int, seed: int = 0, std: float = 0.2) -> RefDFlash:
    """A :class:`RefDFlash` of a config's backbone fields (any ``Qwen3Config`` keyword), float32,
    every weight ~ N(0, std) (norm scales around 1, biases too when ``attention_bias``)."""
    config = Qwen3Config(**{k: v for k, v in backbone.items() if k != "dflash_config"})
    torch.manual_seed(seed)
    ref = RefDFlash(config, num_features)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else std * torch.randn_like(p))
    return ref.eval()
