"""DFlash block-diffusion drafter and the Domino causal correction head (modules + checkpoint I/O).

Sources: ZDF ``dflash/model.py``, DART ``utils/draft_model.py``, DOM ``code/dflash.py``
(docs/algorithms.md §1–§2). State-dict keys are unprefixed and match the released
``z-lab/Qwen3-4B-DFlash-b16`` / ``Huang2020/Qwen3-4B-Domino-b16`` checkpoints (load with
``strict=True``). The drafter has no embedding and no lm_head: both are borrowed from the target.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.drafter.config import DrafterConfig as DrafterConfig  # re-export (torch-free module)
from services.drafter.config import drafter_kind as drafter_kind  # re-export
from services.drafter.layouts import LayoutError, layout_of, speculators_keys
from services.drafter.layers import MLP, FusedInt4, RMSNorm, apply_rope, read_model_safetensors, rms_norm, rope_cos_sin


class Attention(nn.Module):
    """Qwen3-style GQA attention whose keys/values are [context rows; block rows], non-causal.

    Lean path (one forward per draft round, 1-4 rows on a CPU, where every small op costs 5-10 µs):
    queries and keys are normed and rotated together, the rotary tables come from the caller (once
    per forward, :func:`services.drafter.layers.rope_cos_sin`), and with int4 linears q/k/v run as one
    kernel call (:class:`services.drafter.layers.FusedInt4`). Each op is elementwise the one of the
    textbook sequence (separate norms and ropes), so the output is bit for bit the same
    (``tests/engine/test_drafter_lean.py``).
    """

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        h, nh, nkv, dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        bias = c.attention_bias
        self.q_proj = nn.Linear(h, nh * dh, bias=bias)
        self.k_proj = nn.Linear(h, nkv * dh, bias=bias)
        self.v_proj = nn.Linear(h, nkv * dh, bias=bias)
        self.o_proj = nn.Linear(nh * dh, h, bias=bias)
        self.q_norm = RMSNorm(dh, c.rms_norm_eps)
        self.k_norm = RMSNorm(dh, c.rms_norm_eps)
        self._qkv = FusedInt4()

    def qk_norm_weight(self) -> Tensor:
        """``[Hq + Hkv, Dh]``: q_norm's weight on the query heads, k_norm's on the key heads."""
        c = self.c
        return torch.cat([self.q_norm.weight.expand(c.num_attention_heads, -1),
                          self.k_norm.weight.expand(c.num_key_value_heads, -1)])

    def forward(self, x: Tensor, rope_cs: tuple[Tensor, Tensor], ctx_k: Tensor, ctx_v: Tensor,
                ctx_mask: Tensor | None = None) -> Tensor:
        """Block queries ``x [B, Q, H]`` attend to cached context ``[B, Hkv, C, Dh]`` plus the block itself.

        ``rope_cs``: :func:`~services.drafter.layers.rope_cos_sin` of the block's positions (``[Q, Dh]``
        each, or ``[B, 1, Q, Dh]`` for per-row positions). ``ctx_mask`` (optional, ``[B, Q, C]`` bool,
        True = visible) restricts context rows (training).
        """
        c = self.c
        nh, nkv, dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        fused = self._qkv.get(self.q_proj, self.k_proj, self.v_proj)
        if fused is not None:
            qkv = fused(x).unflatten(-1, (nh + 2 * nkv, dh))  # [B, Q, Hq + 2 Hkv, Dh]
            qk, v = qkv[:, :, :nh + nkv], qkv[:, :, nh + nkv:]
        else:
            qk = torch.cat([self.q_proj(x), self.k_proj(x)], -1).unflatten(-1, (nh + nkv, dh))
            v = self.v_proj(x).unflatten(-1, (nkv, dh))
        qk = rms_norm(qk, self.qk_norm_weight(), c.rms_norm_eps).transpose(1, 2)  # [B, Hq + Hkv, Q, Dh]
        qk = apply_rope(qk, *rope_cs)
        q, bk = qk[:, :nh], qk[:, nh:]
        k, v = torch.cat([ctx_k, bk], dim=2), torch.cat([ctx_v, v.transpose(1, 2)], dim=2)
        mask = None
        if ctx_mask is not None:
            blk = torch.ones(*ctx_mask.shape[:2], x.shape[1], dtype=torch.bool, device=x.device)
            mask = torch.cat([ctx_mask, blk], dim=-1)[:, None]  # [B, 1, Q, C+Q]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).flatten(-2))


class DecoderLayer(nn.Module):
    """One drafter layer: context rows enter only as extra keys/values (no input_layernorm on them)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h: Tensor, rope_cs: tuple[Tensor, Tensor], ctx_k: Tensor, ctx_v: Tensor,
                ctx_mask: Tensor | None = None) -> Tensor:
        """``h [B, Q, H]`` -> ``[B, Q, H]``; arguments as :meth:`Attention.forward`."""
        h = h + self.self_attn(self.input_layernorm(h), rope_cs, ctx_k, ctx_v, ctx_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    """DSpark's vanilla Markov head: a rank-r bigram bias ``W2 . W1[prev]`` added to the base logits.

    Keys (DSPK ``markov_head.py``, docs/algorithms.md §3): ``markov_w1.weight [V, r]`` (an embedding of the
    previous token) and ``markov_w2.weight [V, r]`` (a bias-free Linear r -> V).
    """

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def bias(self, prev_tokens: Tensor) -> Tensor:
        """``prev_tokens [...]`` long -> additive logits bias ``[..., V]``."""
        return self.markov_w2(self.markov_w1(prev_tokens))


class ConfidenceHead(nn.Module):
    """DSpark's confidence head: ``proj`` = Linear(H [+ r] -> 1) with bias over ``[h_k; W1[x_{k-1}]]``
    (docs/algorithms.md §3). Its sigmoid predicts whether slot k's draft is accepted; a threshold > 0
    truncates the chain (not used by our methods: a longer tree costs little on the verify side)."""

    def __init__(self, in_dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, 1, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., in_dim]`` -> logit ``[...]``."""
        return self.proj(x)[..., 0]


class DFlashDrafter(nn.Module):
    """DFlash backbone (+ optional Domino head). Keys: ``layers.N.*``, ``fc``, ``hidden_norm``, ``norm``,
    and for Domino ``prefix_gru.weight_{ih,hh}_l0``, ``embed_proj.{0,2}.weight``.

    Reduced draft vocabulary (``config.draft_vocab_size = N``, EAGLE-3's layout): two more buffers,
    ``d2t [N]`` int64 offsets (draft id ``i`` is target id ``i + d2t[i]``) and ``t2d [V]`` bool (target
    id is in the draft vocabulary); ``embed_proj.2`` is ``[N, E]`` and the borrowed lm_head is cut to
    the N selected rows by the drafter service. Without it the state dict is the released one.

    DSpark (``config.projector_type == "markov"``, DSPK ``qwen3/modeling.py``, docs/algorithms.md §3): the
    same backbone keys plus its own frozen copies ``embed_tokens.weight [V, H]`` and ``lm_head.weight
    [V, H]`` of the target's, ``markov_head.markov_w{1,2}.weight [V, r]`` and, when
    ``enable_confidence_head``, ``confidence_head.proj.{weight [1, H + r], bias [1]}``.
    """

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.config = c
        self.needs_target_io = False  # DSpark loaded without its target copies (see load_drafter)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.fc = nn.Linear(c.feature_dim, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self._ctx_kv = FusedInt4()  # every layer's k/v projection of the context rows
        self._ctx_dense: tuple[nn.Module, nn.Module, int] | None = None  # set_dense_context
        if c.projector_type == "domino":
            self.prefix_gru = nn.GRU(c.target_hidden_size, c.gru_hidden_dim, num_layers=1, batch_first=True, bias=False)
            self.embed_proj = nn.Sequential(nn.Linear(c.hidden_size + c.gru_hidden_dim, c.emb_dim, bias=False),
                                            nn.SiLU(), nn.Linear(c.emb_dim, c.out_vocab_size, bias=False))
        if c.is_dspark or c.own_io:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
            self.lm_head = nn.Linear(c.hidden_size, c.out_vocab_size, bias=False)
        if c.is_dspark:
            self.markov_head = MarkovHead(c.vocab_size, c.markov_rank)
            if c.enable_confidence_head:
                self.confidence_head = ConfidenceHead(
                    c.hidden_size + (c.markov_rank if c.confidence_head_with_markov else 0))
        if c.draft_vocab_size is not None:
            # identity map (the first N target ids) until set_draft_vocab / a checkpoint sets it
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
            t2d = torch.zeros(c.vocab_size, dtype=torch.bool)  # no arange: on the meta device it imports sympy
            t2d[:c.draft_vocab_size] = True
            self.register_buffer("t2d", t2d)

    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """Set the draft -> target map from ``target_ids [N]`` (distinct target ids, draft id i -> target_ids[i]).

        Raises:
            ValueError: no reduced vocabulary configured, wrong length, repeated or out-of-range ids.
        """
        c = self.config
        ids = torch.as_tensor(target_ids, dtype=torch.long).flatten()
        if c.draft_vocab_size is None or ids.numel() != c.draft_vocab_size:
            raise ValueError(f"need exactly draft_vocab_size={c.draft_vocab_size} target ids (got {ids.numel()})")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size or ids.unique().numel() != ids.numel()):
            raise ValueError("draft vocabulary ids must be distinct target ids in [0, vocab_size)")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(ids.numel()))
            self.t2d.zero_()
            self.t2d[ids] = True

    def draft_to_target(self) -> Tensor | None:
        """Target id of every draft id ``[N]`` (int64), or None for a full-vocabulary drafter."""
        if self.config.draft_vocab_size is None:
            return None
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    @property
    def has_head(self) -> bool:
        """Whether a Domino correction head is present."""
        return self.config.projector_type == "domino"

    @property
    def has_own_io(self) -> bool:
        """Whether the drafter carries its own ``embed_tokens`` / ``lm_head`` (DSpark, speculators exports)."""
        return self.config.is_dspark or self.config.own_io

    @property
    def has_markov(self) -> bool:
        """Whether a DSpark Markov head (and own embedding / lm_head copies) is present."""
        return self.config.is_dspark

    def copy_target_io(self, embed_w: Tensor, head_w: Tensor) -> None:
        """Copy the target's ``embed_tokens [V, H]`` and ``lm_head [V, H]`` into a DSpark drafter and freeze them
        (DSPK ``initialize_embeddings_and_head``).

        Raises:
            ValueError: not a DSpark drafter, or shapes differ from ``[vocab_size, hidden_size]``.
        """
        if not self.has_markov:
            raise ValueError("only a DSpark drafter carries its own embedding / lm_head")
        want = (self.config.vocab_size, self.config.hidden_size)
        if tuple(embed_w.shape) != want or tuple(head_w.shape) != want:
            raise ValueError(f"embedding / lm_head must be {want}, got {tuple(embed_w.shape)} / {tuple(head_w.shape)}")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_w)
            self.lm_head.weight.copy_(head_w)
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)
        self.needs_target_io = False

    def context_kv(self, features: Tensor, pos: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per-layer context keys/values ``[B, Hkv, C, Dh]`` of target features ``[B, C, F]`` at
        positions ``pos [C]`` (or ``[B, C]``): views of :meth:`context_kv_packed`."""
        kv = self.context_kv_packed(features, pos)  # [B, C, L, 2, Hkv, Dh]
        return [(kv[:, :, li, 0].transpose(1, 2), kv[:, :, li, 1].transpose(1, 2)) for li in range(kv.shape[2])]

    def set_dense_context(self, fc: nn.Module | None, kv: nn.Module | None = None, min_rows: int = 16) -> None:
        """Project calls of at least ``min_rows`` context rows through dense modules (a catch-up:
        a new request's prompt, the tokens of plain rounds) instead of ``fc`` and the layers' k/v
        projections: ``fc [..., F] -> [..., H]`` and ``kv [..., H] -> [..., L * 2 * Hkv * Dh]`` (every
        layer's k then v, in layer order, as :meth:`context_kv_packed` unflattens them). Meant for
        int4 drafters, whose kernel costs ~one row's time per row beyond its 4-row tile while a
        dense bfloat16 GEMM is cheap per row at many rows; the dense weights are the int4 ones
        dequantized, so positions get the same keys / values up to rounding (drafts only: the
        target decides every token). Not registered as submodules (state dicts are unchanged).
        ``fc`` None: off."""
        self._ctx_dense = None if fc is None else (fc, kv, int(min_rows))

    def context_kv_packed(self, features: Tensor, pos: Tensor) -> Tensor:
        """Every layer's context keys (normed, rotated) and values of target features ``[B, C, F]`` at
        positions ``pos [C]`` (or ``[B, C]``), positions first: ``[B, C, L, 2, Hkv, Dh]`` (``[..., 0,
        :, :]`` keys, ``[..., 1, :, :]`` values).

        The context rows are shared by every layer, so all layers' k/v projections run as one int4
        kernel call (:class:`~services.drafter.layers.FusedInt4`; one call per projection otherwise)
        and their key norms and rotary embedding as one op each; bit for bit what each layer's own
        key / value sequence gives (``tests/engine/test_drafter_lean.py``).
        """
        c = self.config
        nkv, dh = c.num_key_value_heads, c.head_dim
        attns = [layer.self_attn for layer in self.layers]
        dense = self._ctx_dense
        if dense is not None and features.shape[:-1].numel() >= dense[2]:  # a catch-up (set_dense_context)
            ctx = self.hidden_norm(dense[0](features))
            fused = dense[1]
        else:
            ctx = self.hidden_norm(self.fc(features))  # [B, C, H], shared by every layer
            fused = self._ctx_kv.get(*(p for a in attns for p in (a.k_proj, a.v_proj)))
        if fused is not None:
            kv = fused(ctx).unflatten(-1, (len(attns), 2, nkv, dh))  # [B, C, L, 2, Hkv, Dh]
        else:
            kv = torch.stack([torch.stack([a.k_proj(ctx), a.v_proj(ctx)], -2) for a in attns], -3
                             ).unflatten(-1, (nkv, dh))
        cos, sin = self.rope_tables(pos)  # [C, Dh] or [B, 1, C, Dh]
        cos, sin = (cos[:, None, None], sin[:, None, None]) if pos.ndim == 1 else (
            cos[:, 0, :, None, None], sin[:, 0, :, None, None])  # [(B,) C, 1, 1, Dh]
        k_w = torch.stack([a.k_norm.weight for a in attns])[:, None]  # [L, 1, Dh]
        k = apply_rope(rms_norm(kv[:, :, :, 0], k_w, c.rms_norm_eps), cos, sin)  # [B, C, L, Hkv, Dh]
        return torch.stack([k, kv[:, :, :, 1]], 3)

    def block_forward(self, block_emb: Tensor, pos: Tensor, ctx_kv: list[tuple[Tensor, Tensor]],
                      ctx_mask: Tensor | None = None) -> Tensor:
        """Block rows ``[B, Q, H]`` (target embeddings of [root, MASK...]) at positions ``pos [Q]``
        (or ``[B, Q]``) against per-layer context ``(K, V)`` ``[B, Hkv, C, Dh]`` (any strides) ->
        drafter states ``[B, Q, H]``; ``ctx_mask [B, Q, C]`` bool (True = visible) or None.
        The rotary tables are computed once for every layer."""
        rope_cs = self.rope_tables(pos)
        h = block_emb
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, rope_cs, k, v, ctx_mask)
        return self.norm(h)

    def rope_tables(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`~services.drafter.layers.rope_cos_sin` of positions ``pos [T]`` (or ``[B, T]``) under
        this drafter's RoPE (plain, or the config's ``rope_scaling``)."""
        c = self.config
        return rope_cos_sin(pos, c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)

    # ----- Domino head pieces (docs/algorithms.md §2.1, §2.3) -----
    def head_split(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(W_z [E, H], W_s [E, G], W_out [V, E])``: embed_proj.0 split into drafter and GRU columns."""
        w0 = self.embed_proj[0].weight
        h = self.config.hidden_size
        return w0[:, :h], w0[:, h:], self.embed_proj[2].weight

    def gru_cell(self, x: Tensor, h: Tensor | None) -> Tensor:
        """Bias-free GRU cell (PyTorch gate order r, z, n): ``x [C, H_t]``, ``h [C, G]`` -> ``[C, G]``.

        ``h = None`` is the zero state (a root): its ``h @ W_hh`` product, exactly zero, is not computed.
        """
        w_ih, w_hh = self.prefix_gru.weight_ih_l0, self.prefix_gru.weight_hh_l0
        gi = x @ w_ih.T
        if h is None:
            h = x.new_zeros(x.shape[0], w_hh.shape[1])
            gh = x.new_zeros(x.shape[0], w_hh.shape[0])
        else:
            gh = h @ w_hh.T
        ir, iz, i_n = gi.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(i_n + r * hn)
        return (1 - z) * n + z * h

    def correction(self, hd: Tensor, states: Tensor) -> Tensor:
        """Additive bias ``embed_proj([hd; h])``: ``hd [.., H]``, ``states [.., G]`` -> ``[.., V]`` (``[.., N]``
        over the draft vocabulary when reduced)."""
        return self.embed_proj(torch.cat([hd, states], dim=-1))


def reduce_draft_vocab(model: DFlashDrafter, target_ids: Tensor) -> DFlashDrafter:
    """A copy of a full-vocabulary drafter that drafts over ``target_ids [N]`` only (draft id i -> target_ids[i]).

    Every weight is copied; the Domino head's output rows (``embed_proj.2``) are the selected rows,
    so the reduced drafter's logits over the draft vocabulary equal the full drafter's at those ids.

    Raises:
        ValueError: the drafter is already reduced, or ``target_ids`` is not a set of distinct target ids.
    """
    import dataclasses

    c = model.config
    if c.draft_vocab_size is not None:
        raise ValueError("the drafter already has a reduced draft vocabulary")
    ids = torch.as_tensor(target_ids, dtype=torch.long).flatten()
    out = DFlashDrafter(dataclasses.replace(c, draft_vocab_size=int(ids.numel())))
    out.set_draft_vocab(ids)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if model.has_head:
        sd["embed_proj.2.weight"] = sd["embed_proj.2.weight"][ids]
    if c.own_io:  # its own lm_head: the selected rows
        sd["lm_head.weight"] = sd["lm_head.weight"][ids]
    sd["d2t"], sd["t2d"] = out.d2t.clone(), out.t2d.clone()
    out.load_state_dict(sd, strict=True)
    return out.to(next(model.parameters()).dtype).train(model.training)


# DSpark keys that are frozen copies of the target's weights; ``save_drafter(..., omit_target_copies=True)``
# leaves them out (config flag below) and the drafter service refills them from the target it serves.
DSPARK_TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")
OMIT_FLAG = "target_copies_omitted"


def save_drafter(model, out_dir: str | Path, extra: dict | None = None, omit_target_copies: bool = False) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the released layout (bf16 weights).

    ``omit_target_copies`` (DSpark only): leave out ``embed_tokens`` / ``lm_head`` (frozen copies of the
    target's, 2 x V x H) and set ``target_copies_omitted: true`` in config.json; the file is then the
    released layout minus those two keys, and :class:`services.drafter.service.DrafterService` refills
    them from the target. Works for EAGLE-3 drafters too (their config has its own ``to_hf``).

    Raises:
        ValueError: ``omit_target_copies`` on a drafter that has no such copies.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_hf()
    if extra:
        cfg.update(extra)
    skip: tuple[str, ...] = ()
    if omit_target_copies:
        if not getattr(model, "has_markov", False):
            raise ValueError("only a DSpark drafter carries target copies to omit")
        skip, cfg[OMIT_FLAG] = DSPARK_TARGET_COPIES, True
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    sd = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous()
          for k, v in model.state_dict().items() if k not in skip}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load a drafter directory with ``strict=True``: DFlash / Domino / DSpark / speculators exports
    (:class:`DFlashDrafter`, :mod:`services.drafter.layouts`) or EAGLE-3 (``architectures``
    ``LlamaForCausalLMEagle3``: :class:`services.drafter.eagle3.Eagle3Drafter`); weights from
    ``model.safetensors`` or the shards of ``model.safetensors.index.json``.

    A DSpark directory saved with ``target_copies_omitted`` must hold every key but ``embed_tokens`` /
    ``lm_head``; those two are allocated empty and the model's ``needs_target_io`` is True until
    :meth:`DFlashDrafter.copy_target_io` fills them (the drafter service does).

    Raises:
        FileNotFoundError: missing config.json / weights (or a shard the index names).
        ValueError: a damaged weights file (one line naming it); a layout or config field that
            cannot be served (:class:`~services.drafter.layouts.LayoutError`, one line naming it).
        RuntimeError: missing / unexpected tensors or a shape mismatch (one line naming them).
    """
    p = Path(path)
    raw = json.loads((p / "config.json").read_text())
    if "LlamaForCausalLMEagle3" in (raw.get("architectures") or []):
        from services.drafter.eagle3 import load_eagle3

        return load_eagle3(p, dtype=dtype, device=device)
    try:
        cfg = DrafterConfig.from_hf(raw)
    except LayoutError as exc:
        raise LayoutError(f"{p}: {exc}") from None
    if (p / "mask_embedding.pt").is_file():
        raise LayoutError(f"{p}: mask_embedding.pt (a trained mask-token embedding) is not served")
    if cfg.rope_scaling:  # parameters transformers rejects: refused now, not at the first draft
        rope_cos_sin(torch.zeros(1), cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    sd = read_model_safetensors(p, device)
    if layout_of(raw) == "speculators":
        sd = speculators_keys(sd)
    sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    omitted = bool(raw.get(OMIT_FLAG)) and cfg.is_dspark
    if omitted:
        for k in DSPARK_TARGET_COPIES:
            if k in sd:
                raise RuntimeError(f"{p}: config says the target copies are omitted but {k} is present")
            sd[k] = torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
    strict_load(model, sd, p)
    model.needs_target_io = omitted
    return model.eval()


def strict_load(model: nn.Module, sd: dict[str, Tensor], where: Path) -> None:
    """``model.load_state_dict(sd, strict=True, assign=True)`` whose failure is one line naming the
    tensors: unexpected ones first (a layout piece we do not serve, e.g. DFlash 2's
    ``layers.0.attention_conv.base_kernel``), then missing ones, then shape mismatches.

    Raises:
        RuntimeError: as above.
    """
    want = model.state_dict()
    unexpected, missing = sorted(set(sd) - set(want)), sorted(set(want) - set(sd))
    for what, keys in (("Unexpected tensors (not served)", unexpected), ("Missing tensors", missing)):
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            raise RuntimeError(f"{where}: {what}: {', '.join(keys[:3])}{more}")
    for k, v in sd.items():
        if tuple(v.shape) != tuple(want[k].shape):
            raise RuntimeError(f"{where}: tensor {k} has shape {tuple(v.shape)}, the config gives {tuple(want[k].shape)}")
    model.load_state_dict(sd, strict=True, assign=True)


def config_summary(c: DrafterConfig) -> dict:
    """Plain dict of a config (for logs and model cards)."""
    return asdict(c)
