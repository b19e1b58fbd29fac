"""The drafter ``dartree train-drafter`` starts from (a checkpoint's config, an exported drafter's
weights, or a fresh one sized to the target; DSpark and reduced-vocabulary variants) and its optimiser."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from services.drafter.model import DFlashDrafter, DrafterConfig
from services.training.train_checks import load_counts


def start_drafter(a, st: dict | None, target) -> tuple[DFlashDrafter, dict]:
    """The drafter to train and its ``origin`` (where its weights came from, saved with it).

    ``st`` (the checkpoint to resume, weights loaded later by the loop): a drafter of its config;
    else ``--init-from`` (an exported drafter's weights; with ``--dspark`` its DFlash backbone only);
    else a fresh drafter sized to ``target`` (a ``TargetModel``), its output norm copied from the
    target's. Without ``st``, ``--draft-vocab`` then cuts it to the most frequent ids.

    Raises:
        ValueError: a DSpark start from a reduced-vocabulary drafter, or a ``--draft-vocab`` the
            initial drafter contradicts.
    """
    origin: dict = {}
    if st is not None:
        cfg = DrafterConfig.from_hf(st["drafter_config"]) if "drafter_config" in st else \
            new_drafter_config(target.config, target.target_layer_ids, a)
        return DFlashDrafter(cfg), st.get("origin", {})
    if a.init_from:
        drafter, origin = _warm_start(a)
    else:
        cfg = new_drafter_config(target.config, target.target_layer_ids, a)
        drafter = dspark_from(DFlashDrafter(cfg), a) if a.dspark else DFlashDrafter(cfg)
        with torch.no_grad():  # start the output scale where the target's own final norm has it
            drafter.norm.weight.copy_(target.model.model.norm.weight.float())
    if a.draft_vocab:
        drafter = with_draft_vocab(drafter, a, target.eos_token_ids)
    return drafter, origin


def _warm_start(a) -> tuple[DFlashDrafter, dict]:
    """The ``--init-from`` export's drafter (with ``--dspark``: a DSpark drafter on its backbone) and origin."""
    from services.drafter.model import load_drafter

    if a.dspark:
        drafter = dspark_from(load_drafter(a.init_from), a)
        prev = _training_of(a.init_from)
        print(f"[train] DSpark: backbone warm-started from {a.init_from} (its training: {prev})", flush=True)
        return drafter, {"init_from": str(a.init_from), "init_training": prev, "init": "DFlash backbone only"}
    drafter = load_drafter(a.init_from).train()
    prev = _training_of(a.init_from)
    print(f"[train] warm start from {a.init_from} (its training: {prev})", flush=True)
    return drafter, {"init_from": str(a.init_from), "init_training": prev}


def _training_of(export_dir) -> dict:
    """The ``training`` record an exported drafter's config.json carries (empty without one)."""
    return json.loads((Path(export_dir) / "config.json").read_text()).get("training", {})


def make_optimiser(drafter: DFlashDrafter, a) -> torch.optim.AdamW:
    """AdamW over the drafter (weight decay 0.01, betas 0.9 / 0.95); a DSpark Markov head is its own
    parameter group at ``--markov-lr-mult`` times the learning rate (``lr_mult`` of each group)."""
    head = [p for n, p in drafter.named_parameters() if n.startswith("markov_head.")]
    rest = [p for n, p in drafter.named_parameters() if not n.startswith("markov_head.")]
    groups = [{"params": rest, "lr_mult": 1.0}] + ([{"params": head, "lr_mult": a.markov_lr_mult}] if head else [])
    return torch.optim.AdamW(groups, lr=a.lr, weight_decay=0.01, betas=(0.9, 0.95))


def new_drafter_config(tcfg, target_layer_ids: list[int], a) -> DrafterConfig:
    """A fresh drafter config matching the target's width and vocabulary (flags: layers, head sizes)."""
    return DrafterConfig(hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size,
                         num_hidden_layers=a.layers, num_attention_heads=tcfg.num_attention_heads,
                         num_key_value_heads=tcfg.num_key_value_heads,
                         head_dim=getattr(tcfg, "head_dim", tcfg.hidden_size // tcfg.num_attention_heads),
                         vocab_size=tcfg.vocab_size, rms_norm_eps=tcfg.rms_norm_eps,
                         rope_theta=float((getattr(tcfg, "rope_parameters", None) or {}).get("rope_theta", 1e4)),
                         max_position_embeddings=tcfg.max_position_embeddings,
                         num_target_layers=tcfg.num_hidden_layers, target_hidden_size=tcfg.hidden_size,
                         mask_token_id=16 if tcfg.vocab_size == 49152 else tcfg.vocab_size - 1,
                         target_layer_ids=list(target_layer_ids), gru_hidden_dim=a.gru_hidden_dim, emb_dim=a.emb_dim,
                         block_size=a.block_size or DrafterConfig.block_size)


def dspark_from(src: DFlashDrafter, a) -> DFlashDrafter:
    """A DSpark drafter (block ``--block-size`` or 7, Markov head of rank ``--markov-rank``) whose backbone
    (``layers.*``, ``fc``, ``hidden_norm``, ``norm``) is copied from ``src``. The Markov head starts as
    ``W1 ~ N(0, 1)``, ``W2 = 0`` (a zero bias that still gets gradients); embedding / lm_head are
    filled from the target by ``copy_target_io``.

    Raises:
        ValueError: ``src`` uses a reduced draft vocabulary (DSpark drafts over the full vocabulary).
    """
    if src.config.draft_vocab_size is not None:
        raise ValueError("DSpark drafts over the full vocabulary; the initial drafter has a reduced one")
    cfg = dataclasses.replace(src.config, projector_type="markov", shift_label=True, pure_draft_prefix_len=0,
                              block_size=a.block_size or 7, markov_rank=a.markov_rank,
                              enable_confidence_head=False)
    out = DFlashDrafter(cfg)
    keep = {k: v for k, v in src.state_dict().items()
            if k.startswith(("layers.", "fc.", "hidden_norm.", "norm."))}
    missing, _ = out.load_state_dict(keep, strict=False)
    assert all(k.startswith(("embed_tokens.", "lm_head.", "markov_head.")) for k in missing), missing
    with torch.no_grad():
        out.markov_head.markov_w1.weight.normal_(0.0, 1.0)  # nn.Embedding's default scale
        out.markov_head.markov_w2.weight.zero_()
    return out.train()


def with_draft_vocab(drafter: DFlashDrafter, a, always: tuple[int, ...]) -> DFlashDrafter:
    """``drafter`` cut to the ``--draft-vocab`` most frequent ids of ``--vocab-counts`` (EOS always kept).

    Raises:
        ValueError: the drafter already drafts over a different reduced vocabulary.
    """
    from services.drafter.model import reduce_draft_vocab
    from services.training.vocab import top_ids

    have = drafter.config.draft_vocab_size
    if have is not None:
        if have != a.draft_vocab:
            raise ValueError(f"--draft-vocab {a.draft_vocab} but the initial drafter drafts over {have} ids")
        return drafter
    saved = load_counts(a.vocab_counts)
    ids = top_ids(saved["counts"], a.draft_vocab, always=tuple(always), secondary=saved.get("secondary"))
    print(f"[train] draft vocabulary: the {a.draft_vocab} most frequent ids of {a.vocab_counts}", flush=True)
    return reduce_draft_vocab(drafter, ids)
