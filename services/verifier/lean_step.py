"""The runner's eager step for Llama-architecture targets without transformers' module dispatch.

A batched step of the :class:`~services.verifier.runner.ModelRunner` used to run through the HF
model's own modules: some 40 ATen calls and a dozen ``nn.Module`` calls per decoder layer, each
with the module, keyword-argument and dispatcher cost of eager PyTorch. On a 2-core CPU that cost
exceeds the arithmetic of the weights (SmolLM2-135M in ``q4``: ~10 ms of a ~22 ms step outside
any op; ``benchmarks/profile_step.py``). :class:`LeanLlamaStep` computes the same decoder pass from
the same parameters with fewer calls, and gives **the same bits** as the modules:

- the ops the modules run, in their order and dtypes (residual adds, rotary in the activation
  dtype with HF's ``rotate_half``, SiLU-gated MLP, the model's own rotary module for ``cos``/``sin``
  and its own final norm / lm_head modules);
- queries and keys rotated in one elementwise pass over both (elementwise ops give each element
  the bits it gets alone);
- q/k/v and gate/up each as one int4 kernel call where the linears are 4-bit
  (:class:`services.int4_fused.FusedInt4`: the kernel computes each output column on its own;
  a probe call checks it when built, which is when the step is built);
- RMSNorm as torch's fused CPU op (``aten._fused_rms_norm``) where a probe at build gives the bits
  of the model's own norm module for this dtype and width, else the module itself.

It applies to a model whose ``config.model_type`` is ``llama`` on CPU (CUDA-graph steps keep the
modules), and is switched off with ``DARTREE_LEAN_STEP=0``. The attention call is the runner's slot
attention, unchanged. Tapped layer outputs go to the target's tap table
(:class:`services.verifier.target.TargetModel`), as its forward hooks would put them.

**Compiled** (``compiled=True``, the runner's ``compile`` on CPU): the same pass is what
``torch.compile`` traces, the fused int4 modules resolved when the step is built and the attention
the opaque op ``dartree::slot_attention``. Inductor then fuses the norms, rotary, residual adds and
the SiLU gate into a few kernels per layer (the eager step's ~200 ATen calls a layer were most of
its time outside the weights' arithmetic). Its bits are not the eager step's (inductor reduces the
norms in its own order), so every step of a compiled runner goes through the compiled pass, and
what speculation needs holds there as it does eagerly: a row's values do not depend on the other
rows of its step (the fused kernels work row by row; inductor's ``emulate_precision_casts`` rounds
every intermediate to the activation dtype as the eager ops do). ``docs/weights.md``, "Compiled
steps", has the measurements.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from services.int4_fused import FusedInt4

_FUSED_RMS = getattr(torch.ops.aten, "_fused_rms_norm", None)


def lean_step_enabled() -> bool:
    """False when ``DARTREE_LEAN_STEP=0`` (run steps through the HF modules)."""
    return os.environ.get("DARTREE_LEAN_STEP", "1") != "0"


def _rotate_half(x: Tensor) -> Tensor:
    """HF Llama's ``rotate_half``: ``cat(-x2, x1)`` of ``x [..., Dh]``'s halves."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class _Norm:
    """One RMSNorm module as a callable: the fused CPU op when it gives the module's bits, else the module."""

    def __init__(self, module, fused_ok: bool):
        self.module = module
        self.eps = float(module.variance_epsilon)
        self.fused = fused_ok

    def __call__(self, x: Tensor) -> Tensor:
        return _rms_norm(self.module, x, self.fused, self.eps)


def _rms_norm(module, x: Tensor, fused: bool, eps: float) -> Tensor:
    """RMSNorm ``module`` of ``x [..., D]``: ``aten._fused_rms_norm`` times its weight when ``fused``
    (where it gives the module's bits, :func:`_fused_norm_matches`), else the module itself."""
    if fused:
        return module.weight * _FUSED_RMS(x, [x.shape[-1]], None, eps)[0]
    return module(x)


def _fused_norm_matches(module, dtype: torch.dtype) -> bool:
    """Whether ``aten._fused_rms_norm`` gives ``module``'s bits on this CPU for its width in ``dtype``
    (random rows of a few counts, values of a residual stream's range)."""
    if _FUSED_RMS is None:
        return False
    g = torch.Generator().manual_seed(0)
    width = module.weight.shape[-1]
    with torch.inference_mode():
        for rows in (1, 3, 9):
            x = (torch.randn(1, rows, width, generator=g) * 4).to(dtype)
            if not torch.equal(_Norm(module, True)(x), module(x)):
                return False
    return True


class LeanLlamaStep:
    """The decoder pass of a HF ``LlamaForCausalLM`` over one step's flattened rows (module docstring).

    Args:
        model: the loaded HF model (eval; its attention switched to the runner's slot attention).
        attention: ``attention(layer, query [1, Hq, R, Dh], key [1, Hkv, R, Dh], value [1, Hkv, R, Dh],
            scaling) -> [1, R, Hq, Dh]``: the runner's slot attention of the active step.
        taps: the target's tap table; layer ``i``'s output ``[1, R, D]`` is stored under ``i`` for
            every ``i`` in ``tap_layers``.
        compiled: the pass ``torch.compile`` traces (module docstring): each decoder layer a
            :class:`_CompiledLayer` (one nested compile region: traced once, reused for every layer),
            ``attention`` called with each attention module's 0-d ``dartree_layer`` buffer
            (registered here) instead of the layer's int index.
        share: a step over the same ``model`` whose layer table (its fused int4 packs, its norms)
            this one uses instead of building its own: the compiled step that replaces an eager
            one holds no second copy of the fused weights.
    Raises:
        ValueError: a model this class does not cover (:meth:`supports` is False).
    """

    def __init__(self, model, attention, taps: dict, tap_layers, compiled: bool = False,
                 share: "LeanLlamaStep | None" = None):
        if not self.supports(model):
            raise ValueError(f"the lean step covers llama models on CPU, not {model.config.model_type!r} "
                             f"on {next(model.parameters()).device}")
        self.model = model
        self.attention = attention
        self.taps = taps
        self.tap_layers = frozenset(int(i) for i in tap_layers)
        inner = model.model
        cfg = model.config
        dtype = next(model.parameters()).dtype
        first = inner.layers[0]
        self.head_dim = int(first.self_attn.head_dim)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        fused = share.fused_norms if share is not None else _fused_norm_matches(first.input_layernorm, dtype)
        self.layers = list(share.layers) if share is not None else []
        for layer in inner.layers[: cfg.num_hidden_layers] if share is None else ():
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append((int(attn.layer_idx), float(attn.scaling), _Norm(layer.input_layernorm, fused),
                                attn.q_proj, attn.k_proj, attn.v_proj, FusedInt4(), attn.o_proj,
                                _Norm(layer.post_attention_layernorm, fused), mlp.gate_proj, mlp.up_proj,
                                FusedInt4(), mlp.down_proj, mlp.act_fn))
        self.norm = share.norm if share is not None else _Norm(inner.norm, _fused_norm_matches(inner.norm, dtype))
        for (_, _, _, q_proj, k_proj, v_proj, qkv_fused, _, _, gate_proj, up_proj, gate_up_fused, _, _) in self.layers:
            # the fused packs now, not at the first step: a server that drops the weight-file pages
            # they supersede after start-up (services.runtime.drop_file_pages) finds them read already
            qkv_fused.get(q_proj, k_proj, v_proj)
            gate_up_fused.get(gate_proj, up_proj)
        self.fused_norms = fused
        self.compiled = bool(compiled)
        self.blocks: list[_CompiledLayer] = []  # compiled: one module per decoder layer (one traced region)
        if self.compiled:
            for layer, entry in zip(inner.layers, self.layers):
                attn = layer.self_attn
                if "dartree_layer" not in attn._buffers:
                    attn.register_buffer("dartree_layer", torch.tensor(int(attn.layer_idx)), persistent=False)
                self.blocks.append(_CompiledLayer(entry, attn.dartree_layer, attention, self.heads, self.kv_heads,
                                                  self.head_dim))

    @staticmethod
    def supports(model) -> bool:
        """True for a ``llama`` model on CPU whose layers have the modules this class reads."""
        if getattr(model.config, "model_type", None) != "llama" or next(model.parameters()).device.type != "cpu":
            return False
        layer = model.model.layers[0]
        attn = layer.self_attn
        return all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim")) and \
            not hasattr(attn, "q_norm") and all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))

    def __call__(self, input_ids: Tensor, position_ids: Tensor, keep: Tensor) -> Tensor:
        """One step: ``input_ids [1, R]`` at ``position_ids [1, R]``; returns the logits ``[1, K, V]``
        (the model's dtype) of the rows ``keep [K]``."""
        inner = self.model.model
        h = inner.embed_tokens(input_ids)  # [1, R, D]
        cos, sin = inner.rotary_emb(h, position_ids)  # [1, R, Dh] each, the activation dtype
        cos, sin = cos[:, None], sin[:, None]
        r = h.shape[1]
        dh, hq, hkv = self.head_dim, self.heads, self.kv_heads
        if self.compiled:
            for block in self.blocks:
                h = block(h, cos, sin)
                if block.index in self.tap_layers:
                    self.taps[block.index] = h
            return self.model.lm_head(self.norm(h[:, keep]))
        for (idx, scaling, norm1, q_proj, k_proj, v_proj, qkv_fused, o_proj, norm2, gate_proj, up_proj,
             gate_up_fused, down_proj, act) in self.layers:
            x = norm1(h)
            fused = qkv_fused.get(q_proj, k_proj, v_proj)
            if fused is not None:
                qkv = fused(x).view(1, r, hq + 2 * hkv, dh)
                qk = qkv[:, :, :hq + hkv].transpose(1, 2)  # [1, Hq + Hkv, R, Dh]
                v = qkv[:, :, hq + hkv:].transpose(1, 2)
            else:
                qk = torch.cat((q_proj(x).view(1, r, hq, dh), k_proj(x).view(1, r, hkv, dh)), 2).transpose(1, 2)
                v = v_proj(x).view(1, r, hkv, dh).transpose(1, 2)
            qk = qk * cos + _rotate_half(qk) * sin
            out = self.attention(idx, qk[:, :hq], qk[:, hq:], v, scaling)  # [1, R, Hq, Dh]
            h = h + o_proj(out.reshape(1, r, hq * dh))
            x = norm2(h)
            fused = gate_up_fused.get(gate_proj, up_proj)
            if fused is not None:
                gate, up = fused(x).chunk(2, -1)
            else:
                gate, up = gate_proj(x), up_proj(x)
            h = h + down_proj(act(gate) * up)
            if idx in self.tap_layers:
                self.taps[idx] = h
        return self.model.lm_head(self.norm(h[:, keep]))  # the norm is per row: only the kept rows


class _CompiledLayer(nn.Module):
    """One decoder layer of the compiled lean step, as a ``torch.compiler.nested_compile_region``:
    ``torch.compile`` traces the first layer and reuses the graph for the others (a 30-layer target
    traced layer by layer took ~10 s of every start). Per-layer values reach the region as tensors
    (the weights, the layer index buffer); what is a constant (heads, eps, scaling, which linears
    are fused) is the same for every layer of a model.

    Args:
        entry: the layer's tuple in :attr:`LeanLlamaStep.layers`; layer: its 0-d int64 index tensor;
        attention: ``attention(layer, q, k, v, scaling) -> [1, R, Hq, Dh]`` (the opaque slot op).
    ``forward(h [1, R, D], cos [1, 1, R, Dh], sin) -> h [1, R, D]``.
    """

    def __init__(self, entry: tuple, layer: Tensor, attention, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        (idx, scaling, norm1, q_proj, k_proj, v_proj, qkv_fused, o_proj, norm2, gate_proj, up_proj, gate_up_fused,
         down_proj, act) = entry
        self.index, self.scaling, self.attention = idx, scaling, attention
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm1, self.norm2, self.fused_norms, self.eps = norm1.module, norm2.module, norm1.fused, norm1.eps
        self.qkv = qkv_fused.get(q_proj, k_proj, v_proj)  # None: q / k / v one by one
        self.q_proj, self.k_proj, self.v_proj = (None, None, None) if self.qkv is not None else (q_proj, k_proj, v_proj)
        self.gate_up = gate_up_fused.get(gate_proj, up_proj)
        self.gate_proj, self.up_proj = (None, None) if self.gate_up is not None else (gate_proj, up_proj)
        self.o_proj, self.down_proj, self.act = o_proj, down_proj, act
        self.register_buffer("layer", layer, persistent=False)

    @torch.compiler.nested_compile_region
    def forward(self, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        r = h.shape[1]
        dh, hq, hkv = self.head_dim, self.heads, self.kv_heads
        x = _rms_norm(self.norm1, h, self.fused_norms, self.eps)
        if self.qkv is not None:
            qkv = self.qkv(x).view(1, r, hq + 2 * hkv, dh)
            qk = qkv[:, :, :hq + hkv].transpose(1, 2)  # [1, Hq + Hkv, R, Dh]
            v = qkv[:, :, hq + hkv:].transpose(1, 2)
        else:
            qk = torch.cat((self.q_proj(x).view(1, r, hq, dh), self.k_proj(x).view(1, r, hkv, dh)), 2).transpose(1, 2)
            v = self.v_proj(x).view(1, r, hkv, dh).transpose(1, 2)
        qk = qk * cos + _rotate_half(qk) * sin
        out = self.attention(self.layer, qk[:, :hq], qk[:, hq:], v, self.scaling)  # [1, R, Hq, Dh]
        h = h + self.o_proj(out.reshape(1, r, hq * dh))
        x = _rms_norm(self.norm2, h, self.fused_norms, self.eps)
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, -1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return h + self.down_proj(self.act(gate) * up)
