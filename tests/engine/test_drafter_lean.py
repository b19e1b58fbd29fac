"""The drafter's lean forward equals the textbook one bit for bit (R8 fast == reference).

:meth:`DFlashDrafter.block_forward` computes the rotary tables once per forward, norms and rotates
queries and keys together and, with int4 linears, runs q/k/v (and gate/up, and every layer's
context k/v) as one kernel call each; :meth:`DFlashDrafter.context_kv` does the same for the
context rows of all layers. The references below are the plain per-layer sequences (separate
projections, one norm and one rope per tensor, the rotary tables recomputed per call).
"""

from __future__ import annotations

import pytest
import torch

from services import int_dot
import torch.nn.functional as F

from services.drafter.layers import FusedInt4, RMSNorm, apply_rope, rms_norm, rope_cos_sin
from services.drafter.model import DFlashDrafter, DrafterConfig
from services.weights import Int4Linear, int4_kernel_available, quantize_linears_q4, quantize_q4_1


def _ref_rope(x, pos, theta):
    """Rotary embedding as HF Llama writes it: tables per call, ``x * cos + rotate_half(x) * sin``."""
    dh = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
    ang = pos.float()[..., None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    if pos.ndim == 2:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


def _ref_norm(norm, x):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype) * norm.weight.to(x.dtype)


def _ref_kv(attn, x, pos):
    c = attn.c
    k = _ref_norm(attn.k_norm, attn.k_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim))).transpose(-2, -3)
    v = attn.v_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim)).transpose(-2, -3)
    return _ref_rope(k, pos, c.rope_theta), v


def _ref_attn(attn, x, pos, ctx_k, ctx_v, ctx_mask):
    c = attn.c
    q = _ref_norm(attn.q_norm, attn.q_proj(x).unflatten(-1, (c.num_attention_heads, c.head_dim))).transpose(1, 2)
    q = _ref_rope(q, pos, c.rope_theta)
    bk, bv = _ref_kv(attn, x, pos)
    k, v = torch.cat([ctx_k, bk], dim=2), torch.cat([ctx_v, bv], dim=2)
    mask = None
    if ctx_mask is not None:
        blk = torch.ones(*ctx_mask.shape[:2], x.shape[1], dtype=torch.bool)
        mask = torch.cat([ctx_mask, blk], dim=-1)[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return attn.o_proj(o.transpose(1, 2).flatten(-2))


def _ref_block_forward(m, emb, pos, ctx_kv, ctx_mask=None):
    h = emb
    for layer, (k, v) in zip(m.layers, ctx_kv):
        h = h + _ref_attn(layer.self_attn, _ref_norm(layer.input_layernorm, h), pos, k, v, ctx_mask)
        x = _ref_norm(layer.post_attention_layernorm, h)
        h = h + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x))
    return _ref_norm(m.norm, h)


def _ref_context_kv(m, feats, pos):
    ctx = _ref_norm(m.hidden_norm, m.fc(feats))
    return [_ref_kv(layer.self_attn, ctx, pos) for layer in m.layers]


def _drafter(seed: int = 0) -> DFlashDrafter:
    """Shapes whose int4 packs concatenate (outputs % 64, inputs % 32); norms away from 1."""
    c = DrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=96, rope_theta=10000.0, block_size=8,
                      num_target_layers=4, target_hidden_size=32, target_layer_ids=[0, 1, 3], mask_token_id=95,
                      gru_hidden_dim=16, emb_dim=8)
    torch.manual_seed(seed)
    m = DFlashDrafter(c)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(1.0 + 0.3 * torch.randn_like(p) if p.ndim == 1 else 0.2 * torch.randn_like(p))
    return m.eval()


def _inputs(m, batch: int, ctx_len: int, q: int, per_row: bool, dtype):
    c = m.config
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(batch, ctx_len, c.feature_dim, generator=g).to(dtype)
    emb = torch.randn(batch, q, c.hidden_size, generator=g).to(dtype)
    if per_row:  # training layout: positions per row, some context rows hidden
        pos_blk = torch.stack([torch.arange(5 + 3 * i, 5 + 3 * i + q) for i in range(batch)])
        mask = torch.rand(batch, q, ctx_len, generator=g) < 0.7
        mask[..., 0] = True
    else:
        pos_blk, mask = torch.arange(ctx_len, ctx_len + q), None
    return feats, torch.arange(ctx_len), emb, pos_blk, mask


def _assert_equal_kv(got, want):
    assert len(got) == len(want)
    for (gk, gv), (wk, wv) in zip(got, want):
        assert gk.shape == wk.shape and gv.shape == wv.shape
        assert torch.equal(gk, wk) and torch.equal(gv, wv)


@pytest.mark.parametrize("batch,q,per_row", [(1, 4, False), (1, 2, False), (2, 9, False), (3, 4, True)])
def test_float32_block_and_context_equal_reference(batch: int, q: int, per_row: bool) -> None:
    m = _drafter()
    feats, pos_ctx, emb, pos_blk, mask = _inputs(m, batch, 11, q, per_row, torch.float32)
    with torch.no_grad():
        kv = m.context_kv(feats, pos_ctx)
        _assert_equal_kv(kv, _ref_context_kv(m, feats, pos_ctx))
        got = m.block_forward(emb, pos_blk, kv, mask)
        assert torch.equal(got, _ref_block_forward(m, emb, pos_blk, kv, mask))


def test_context_kv_per_row_positions_and_packed_layout() -> None:
    m = _drafter(3)
    feats = torch.randn(2, 7, m.config.feature_dim)
    pos = torch.stack([torch.arange(7), torch.arange(10, 17)])  # [B, C]
    with torch.no_grad():
        packed = m.context_kv_packed(feats, pos)
        assert packed.shape == (2, 7, 2, 2, 2, 32)  # [B, C, L, 2, Hkv, Dh]
        want = _ref_context_kv(m, feats, pos)
        for li, (k, v) in enumerate(want):
            assert torch.equal(packed[:, :, li, 0].transpose(1, 2), k)
            assert torch.equal(packed[:, :, li, 1].transpose(1, 2), v)


def test_rope_tables_equal_textbook_rope() -> None:
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        for shape, pos in (((2, 3, 5, 16), torch.arange(40, 45)), ((2, 3, 5, 8), torch.randint(0, 900, (2, 5)))):
            x = torch.randn(*shape, generator=g).to(dtype)
            cos, sin = rope_cos_sin(pos, shape[-1], 1e4)
            assert torch.equal(apply_rope(x, cos, sin), _ref_rope(x, pos, 1e4))


def test_rms_norm_equals_float32_sequence() -> None:
    """The fused normalisation gives the bits of ``x * rsqrt(mean(x²) + eps)`` in float32."""
    g = torch.Generator().manual_seed(8)
    for dtype in (torch.float32, torch.bfloat16):
        for shape, wshape in (((1, 4, 576), (576,)), ((2, 5, 12, 64), (12, 64)), ((1, 9, 3, 3, 64), (3, 1, 64)),
                              ((3, 7, 2880), (2880,)), ((4, 33), (33,))):
            norm = RMSNorm(shape[-1], 1e-5)
            x = (3 * torch.randn(*shape, generator=g)).to(dtype)
            w = (1 + 0.3 * torch.randn(*wshape, generator=g)).to(dtype)
            norm.weight.data = w.reshape(-1)[: shape[-1]].clone()
            assert torch.equal(rms_norm(x, w, 1e-5), _ref_norm(norm, x) if wshape == (shape[-1],) else
                               _ref_norm(RMSNorm(shape[-1], 1e-5), x) * w)
            assert torch.equal(norm(x), _ref_norm(norm, x))


def test_training_gradients_flow() -> None:
    """The shared tables and joint q/k norm keep the float32 training path differentiable."""
    m = _drafter(4).train()
    feats, pos_ctx, emb, pos_blk, mask = _inputs(m, 2, 6, 4, True, torch.float32)
    m.block_forward(emb, pos_blk, m.context_kv(feats, pos_ctx), mask).square().mean().backward()
    for name in ("layers.0.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight", "fc.weight",
                 "layers.1.mlp.up_proj.weight"):
        grad = m.get_parameter(name).grad
        assert grad is not None and bool(grad.abs().sum() > 0), name


needs_int4 = pytest.mark.skipif(not int4_kernel_available(), reason="torch has no int4 CPU kernel")


@needs_int4
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch,q,per_row", [(1, 2, False), (1, 4, False), (2, 9, False), (2, 4, True)])
def test_int4_fused_projections_equal_separate_calls(batch: int, q: int, per_row: bool, threads: int) -> None:
    """bfloat16 drafter on the int4 kernel: the fused q/k/v, gate/up and context k/v calls give what
    the separate Int4Linear calls give, bit for bit (per-column independence of the kernel)."""
    m = _drafter(1).to(torch.bfloat16)
    quantize_linears_q4(m, torch.bfloat16, names=("layers", "fc"))
    feats, pos_ctx, emb, pos_blk, mask = _inputs(m, batch, 13, q, per_row, torch.bfloat16)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            kv = m.context_kv(feats, pos_ctx)
            _assert_equal_kv(kv, _ref_context_kv(m, feats, pos_ctx))
            got = m.block_forward(emb, pos_blk, kv, mask)
            assert torch.equal(got, _ref_block_forward(m, emb, pos_blk, kv, mask))
    finally:
        torch.set_num_threads(old)
    # the fused modules were built and used
    assert m._ctx_kv._mod is not None
    assert all(layer.self_attn._qkv._mod is not None and layer.mlp._gate_up._mod is not None for layer in m.layers)


@needs_int4
def test_fused_int4_follows_the_linears() -> None:
    """None for dense linears; rebuilt when a linear is replaced (re-quantized)."""
    m = _drafter(2).to(torch.bfloat16)
    attn = m.layers[0].self_attn
    fused = FusedInt4()
    assert fused.get(attn.q_proj, attn.k_proj) is None
    quantize_linears_q4(m.layers, torch.bfloat16)
    first = fused.get(attn.q_proj, attn.k_proj)
    assert first is not None and first.out_features == attn.q_proj.out_features + attn.k_proj.out_features
    assert fused.get(attn.q_proj, attn.k_proj) is first
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(first(x), torch.cat([attn.q_proj(x), attn.k_proj(x)], -1))
    quantize_linears_q4(m.layers, torch.bfloat16)  # no nn.Linear left: nothing replaced
    v = attn.v_proj
    attn.k_proj = type(v).from_int_dot(v.qw, v.dm) if v.kernel == "int_dot" else type(v).from_packed(v.packed,
                                                                                                  v.scale_zeros)
    second = fused.get(attn.q_proj, attn.k_proj)
    assert second is not first and torch.equal(second(x), torch.cat([attn.q_proj(x), attn.v_proj(x)], -1))


@needs_int4
def test_fused_int4_built_eagerly_is_what_a_compiled_graph_calls() -> None:
    """Inside ``torch.compile`` a FusedInt4 is never built (that would trace its probe): before an
    eager call the graph runs the linears one by one, after it the graph calls the one fused kernel
    (a compiled drafter block: 4 int4 calls a layer instead of 7), with the same values."""
    import torch._dynamo

    g = torch.Generator().manual_seed(7)
    a, b = (Int4Linear(quantize_q4_1(0.1 * torch.randn(64, 64, generator=g))) for _ in range(2))
    x = torch.randn(3, 64, generator=g).bfloat16()
    want = torch.cat([a(x), b(x)], -1)

    def calls(fused: FusedInt4) -> tuple[torch.Tensor, int]:
        graphs = []

        def backend(gm, inputs):
            graphs.append(gm)
            return gm.forward

        def f(x):
            m = fused.get(a, b)
            return m(x) if m is not None else torch.cat([a(x), b(x)], -1)

        torch._dynamo.reset()
        with torch.inference_mode():
            out = torch.compile(f, backend=backend, fullgraph=True)(x)
        return out, sum(1 for gm in graphs for n in gm.graph.nodes
                        if n.op == "call_function" and ("int4" in str(n.target) or "q4_mm" in str(n.target)))

    out, n = calls(FusedInt4())
    assert n == 2 and torch.equal(out, want)
    built = FusedInt4()
    assert built.build(a, b) is not None
    out, n = calls(built)
    assert n == 1 and torch.equal(out, want)


@needs_int4
def test_fused_int4_only_at_whole_pack_blocks() -> None:
    """torch's int4 pack interleaves rows in blocks of 64: a part of 32 rows fuses only as the last
    one. The integer-dot pack's tiles are 16 rows: any order fuses; two kernels never fuse."""
    g = torch.Generator().manual_seed(6)
    a, b = (Int4Linear(quantize_q4_1(0.1 * torch.randn(n, 64, generator=g)), kernel="torch") for n in (32, 64))
    assert FusedInt4().get(a, b) is None
    fused = FusedInt4().get(b, a)
    x = torch.randn(5, 64, generator=g).bfloat16()
    assert fused is not None and torch.equal(fused(x), torch.cat([b(x), a(x)], -1))
    if int_dot.isa() is None:
        return
    c, d = (Int4Linear(quantize_q4_1(0.1 * torch.randn(n, 64, generator=g)), kernel="int_dot") for n in (32, 64))
    fused = FusedInt4().get(c, d)
    assert fused is not None and torch.equal(fused(x), torch.cat([c(x), d(x)], -1))
    assert FusedInt4().get(a, d) is None


def test_gru_cell_zero_state_equals_zeros() -> None:
    """``gru_cell(x, None)`` (no ``h @ W_hh`` product) is bit for bit ``gru_cell(x, zeros)``."""
    m = _drafter(9)
    g = torch.Generator().manual_seed(9)
    for dtype in (torch.float32, torch.bfloat16):
        d = m.to(dtype)
        for rows in (1, 3):
            x = torch.randn(rows, d.config.target_hidden_size, generator=g).to(dtype)
            zeros = torch.zeros(rows, d.config.gru_hidden_dim, dtype=dtype)
            with torch.no_grad():
                assert torch.equal(d.gru_cell(x, None), d.gru_cell(x, zeros))


@needs_int4
def test_quantize_names_reach_the_feature_projection() -> None:
    """``names=("layers", "fc")`` puts ``fc`` itself on the int4 kernel (a linear named directly is
    replaced in its parent) and leaves every other linear dense; a bare linear or a missing name is
    refused instead of being skipped silently."""
    m = _drafter(3).to(torch.bfloat16)
    n_layers = sum(type(x) is torch.nn.Linear for x in m.layers.modules())
    assert quantize_linears_q4(m, torch.bfloat16, names=("layers", "fc")) == n_layers + 1
    assert type(m.fc) is Int4Linear
    assert not any(type(x) is torch.nn.Linear for x in m.layers.modules())
    assert all(type(x) is torch.nn.Linear for x in m.embed_proj if isinstance(x, torch.nn.Linear))
    with pytest.raises(ValueError, match="parent"):
        quantize_linears_q4(torch.nn.Linear(64, 64), torch.bfloat16)
    with pytest.raises(ValueError, match="nope"):
        quantize_linears_q4(m, torch.bfloat16, names=("nope",))


@needs_int4
def test_dense_catch_up_projects_many_rows_with_the_dequantized_weights() -> None:
    """With dense copies of an int4 drafter's context projections (``set_dense_context``, as
    ``DrafterService`` sets them up), a context call of at least ``min_rows`` rows goes through them:
    keys / values within bfloat16 rounding of the int4 path's; a shorter call, or the copies
    removed, is the int4 path bit for bit."""
    from services.drafter.service import DrafterService

    m = _drafter(4).to(torch.bfloat16)
    quantize_linears_q4(m, torch.bfloat16, names=("layers", "fc"))
    feats, pos, *_ = _inputs(m, 1, 13, 2, False, torch.bfloat16)
    with torch.inference_mode():
        ref, ref_short = m.context_kv_packed(feats, pos), m.context_kv_packed(feats[:, :5], pos[:5])
    DrafterService._dense_catch_up(m, min_rows=8)
    with torch.inference_mode():
        fc, kv, rows = m._ctx_dense
        assert rows == 8 and not any(p is fc.weight or p is kv.weight for p in m.parameters())
        assert torch.equal(fc.weight.float(), m.fc.dequantized().to(torch.bfloat16).float())
        seen = []
        fc.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[:-1].numel()))
        got = m.context_kv_packed(feats, pos)  # 13 rows >= 8: the dense copies
        assert seen == [13]
        torch.testing.assert_close(got.float(), ref.float(), atol=0.05, rtol=0.05)
        assert torch.equal(m.context_kv_packed(feats[:, :5], pos[:5]), ref_short) and seen == [13]
        m.set_dense_context(None)
        assert torch.equal(m.context_kv_packed(feats, pos), ref)
