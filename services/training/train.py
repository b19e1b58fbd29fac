"""``dartree train-drafter``: train a DFlash backbone + Domino head on self-distilled target data.

Training semantics (docs/algorithms.md §1.3, §2.1): random anchors a in the response of each sequence;
block = [token at a, MASK x (block_size - 1)] at positions a .. a + block_size - 1; context =
target features of positions < a only; shift-label targets tokens a + 1 .. a + block_size. Loss =
(1 - lambda) * CE(corrected) + lambda * CE(base), lambda decayed linearly; the target stays frozen
and its embedding / lm_head are used in place (never copied into the drafter's weights).
Resumable: ``--resume`` continues from ``<work-dir>/ckpt.pt`` (model, optimiser, step, the lr and
lambda schedules of ``--schedule-steps``, the data position, RNG) exactly as if never stopped; when
``ckpt.pt`` is gone (a new machine), ``--init-from <exported drafter dir>`` warm-starts the weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from services.drafter.model import DFlashDrafter, DrafterConfig, save_drafter
from services.runtime import error_line


HELDOUT_SHARD = "gen_00000"


def shard_paths(feat_dir: Path) -> list[Path]:
    """Finished featurized shards (``featurize`` output), held-out shard excluded."""
    return [p for p in sorted(feat_dir.glob("*.pt")) if p.stem != HELDOUT_SHARD]


class Trainer:
    """One drafter, the frozen target pieces it borrows, and the loss of one sequence's anchors."""

    def __init__(self, drafter: DFlashDrafter, embed_w: torch.Tensor, head_w: torch.Tensor, args):
        """``embed_w [V, H]`` and ``head_w [V, H]`` are the target's (full vocabulary); a drafter with a
        reduced draft vocabulary trains on the ``head_w`` rows its ``d2t`` selects, and labels outside
        its vocabulary are ignored (it can never draft them)."""
        self.m, self.embed_w, self.a = drafter, embed_w, args
        c = drafter.config
        d2t = drafter.draft_to_target()
        self.label_map = None
        if d2t is not None:
            head_w = head_w[d2t]
            self.label_map = torch.full((c.vocab_size,), -100, dtype=torch.long)
            self.label_map[d2t] = torch.arange(d2t.numel())
        self.head_w = head_w
        self.bs = c.block_size
        decay = args.row_decay if not drafter.has_markov or args.dspark_gamma <= 0 else args.dspark_gamma
        self.row_w = torch.exp(-torch.arange(self.bs).float() / decay)

    def batch(self, row: dict, n_anchor: int, rng: random.Random):
        """Sample anchors of one sequence.

        Returns ``(anchors [A], block ids [A, Q], labels [A, Q] (-100 = none), realised [A, Q])``, or None
        when the sequence has no anchor or no anchor has a label (a loss of 0 / 0):
        row j of the block anchored at a is labelled with the target's greedy token after
        ``ids[: a + j + 1]`` (shift-label); ``realised`` are the tokens the GRU consumes.
        """
        ids, labels_all = row["ids"], row["labels"]
        n = ids.numel()
        lo, hi = max(row["prompt_len"] - 1, 1), n - 2
        if hi < lo:
            return None
        anchors = torch.tensor(sorted(rng.sample(range(lo, hi + 1), min(n_anchor, hi - lo + 1))))
        pad = torch.full((self.bs,), -100, dtype=torch.long)
        idx = anchors[:, None] + torch.arange(self.bs)[None, :]  # [A, Q]
        labels = torch.cat([labels_all.long(), pad])[idx]
        if self.label_map is not None:  # target ids -> draft ids (-100: not in the draft vocabulary)
            labels = torch.where(labels >= 0, self.label_map[labels.clamp(min=0)], labels)
        if not bool((labels >= 0).any()):  # nothing to learn (e.g. every label outside the draft vocabulary):
            return None                    # the loss would be 0 / 0 = NaN
        realised = torch.cat([ids.long(), pad])[idx]  # realised[:, 0] = anchor token
        block = torch.full_like(idx, self.m.config.mask_token_id)
        block[:, 0] = realised[:, 0]
        return anchors, block, labels, realised

    def loss(self, row: dict, lam: float, rng: random.Random):
        """Joint Domino loss of one sequence; returns ``(loss, stats)`` or None when it has no anchor."""
        b = self.batch(row, self.a.anchors, rng)
        if b is None:
            return None
        anchors, block, labels, realised = b
        feats = row["feats"]
        m, c = self.m, self.m.config
        t = int(anchors.max())  # context never needs positions >= the last anchor
        pos_ctx = torch.arange(t)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.a.bf16):
            ctx_kv = m.context_kv(feats[:t].float()[None], pos_ctx)
            A = anchors.numel()
            ctx_kv = [(k.expand(A, -1, -1, -1), v.expand(A, -1, -1, -1)) for k, v in ctx_kv]
            ctx_mask = (pos_ctx[None, None, :] < anchors[:, None, None]).expand(A, self.bs, t)
            pos_blk = anchors[:, None] + torch.arange(self.bs)[None, :]  # [A, Q]
            emb = F.embedding(block, self.embed_w)  # [A, Q, H]
            hd = m.block_forward(emb, pos_blk, ctx_kv, ctx_mask)  # [A, Q, H], positions per anchor
            base = hd @ self.head_w.T  # [A, Q, V]
            valid = labels >= 0
            tgt = labels.clamp(min=0)
            w = self.row_w[None, :].expand_as(labels) * valid
            ce_base = F.cross_entropy(base.float().flatten(0, 1), tgt.flatten(), reduction="none").view_as(labels)
            loss_base = (ce_base * w).sum() / w.sum()
            stats = {"acc_base": self._chain_tau(base, labels)}
            if m.has_markov:
                # DSpark (docs/algorithms.md §3): logits_k = base_k + W2 . W1[x_{a+k}] (teacher-forced prev tokens);
                # loss = ce * CE + l1 * L1, where L1 = |softmax - onehot(label)|_1 = 2 (1 - p_label) (the labels
                # are the target's greedy tokens, so its distribution is taken as one-hot), rows weighted
                # exp(-k / gamma) (the DSpark recipe: gamma 4, ce 0.1, l1 0.9).
                final = base + m.markov_head.bias(realised.clamp(min=0))
                logp = torch.log_softmax(final.float(), dim=-1)
                nll = -logp.gather(-1, tgt[..., None])[..., 0]
                l1 = 2.0 * (1.0 - nll.neg().exp())
                per = self.a.dspark_ce * nll + self.a.dspark_l1 * l1
                loss = (per * w).sum() / w.sum()
                stats["acc_dspark"] = self._chain_tau(final, labels)
            elif m.has_head:
                gru_in = F.embedding(realised.clamp(min=0), self.embed_w)  # [A, Q, H]
                states, _ = m.prefix_gru(gru_in)  # state i consumed [anchor, y_1 .. y_i]
                corr = m.correction(hd, states)
                corr[:, : c.pure_draft_prefix_len] = 0
                final = base + corr
                ce_fin = F.cross_entropy(final.float().flatten(0, 1), tgt.flatten(), reduction="none").view_as(labels)
                loss_fin = (ce_fin * w).sum() / w.sum()
                loss = (1 - lam) * loss_fin + lam * loss_base
                stats["acc_domino"] = self._chain_tau(final, labels)
            else:
                loss = loss_base
        stats["loss"] = float(loss.detach())
        return loss, stats

    @staticmethod
    @torch.no_grad()
    def _chain_tau(logits: torch.Tensor, labels: torch.Tensor) -> float:
        """Mean 1 + leading argmax matches per block (teacher-forced chain acceptance)."""
        ok = (logits.argmax(-1) == labels) & (labels >= 0)
        return float((ok.int().cumprod(1).sum(1) + 1).float().mean())


@dataclass(frozen=True)
class Schedule:
    """Learning-rate and lambda schedules as pure functions of the step (saved in ``ckpt.pt``).

    lr: linear warm-up over ``warmup`` steps to ``lr``, then cosine to 10 % of it at ``steps``
    (flat after). lambda (weight of the base loss): linear ``lambda_start`` -> ``lambda_end`` over
    ``steps`` (flat after). ``steps`` is ``--schedule-steps``, independent of where a run stops.
    """

    lr: float
    warmup: int
    steps: int
    lambda_start: float
    lambda_end: float

    def lr_at(self, s: int) -> float:
        """Learning rate of optimiser step ``s`` (0-based)."""
        if s < self.warmup:
            return self.lr * (s + 1) / self.warmup
        frac = min(1.0, (s - self.warmup) / max(1, self.steps - self.warmup))
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def lambda_at(self, s: int) -> float:
        """Base-loss weight lambda of step ``s``."""
        return self.lambda_start + (self.lambda_end - self.lambda_start) * min(1.0, s / max(1, self.steps))


class DataStream:
    """Deterministic, resumable order of training rows: epochs of shuffled shards, rows shuffled per shard.

    Epoch ``e`` fixes its shard list when it starts (shards featurized later join the next epoch);
    the shard order and each shard's row order are seeded by ``(seed, e, shard name)``, so the
    position ``state()`` = ``{epoch, shards, shard_index, row_index}`` is all a resume needs.
    """

    def __init__(self, feat_dir: Path, seed: int, state: dict | None = None):
        self.dir, self.seed = feat_dir, seed
        if state:
            self.epoch, self.names = state["epoch"], list(state["shards"])
            self.si, self.ri = state["shard_index"], state["row_index"]
        else:
            self.epoch, self.si, self.ri = 0, 0, 0
            self.names = self._order(0)
        self._rows: list[dict] | None = None
        self._row_order: list[int] = []
        if not self.names:
            raise FileNotFoundError(f"no training shards in {feat_dir} (run featurize first)")

    def _order(self, epoch: int) -> list[str]:
        names = [p.name for p in shard_paths(self.dir)]
        return random.Random(f"{self.seed}/{epoch}").sample(names, len(names))

    def state(self) -> dict:
        """Position of the next row (JSON-able)."""
        return {"epoch": self.epoch, "shards": list(self.names), "shard_index": self.si, "row_index": self.ri}

    def last(self) -> str:
        """Where the row ``next()`` returned last came from: ``"<shard> row <i> (epoch <e>)"``."""
        if self._rows is None or self.ri == 0:
            return f"epoch {self.epoch} position {self.si}/{self.ri}"
        return f"{self.names[self.si]} row {self._row_order[self.ri - 1]} (epoch {self.epoch})"

    def next(self) -> dict:
        """The next training row (a featurized sequence dict)."""
        while True:
            if self.si >= len(self.names):
                self.epoch, self.si, self.ri = self.epoch + 1, 0, 0
                self.names = self._order(self.epoch)
                self._rows = None
            if self._rows is None:
                name = self.names[self.si]
                self._rows = torch.load(self.dir / name)
                self._row_order = random.Random(f"{self.seed}/{self.epoch}/{name}").sample(
                    range(len(self._rows)), len(self._rows))
            if self.ri < len(self._rows):
                row = self._rows[self._row_order[self.ri]]
                self.ri += 1
                return row
            self.si, self.ri, self._rows = self.si + 1, 0, None


def build_args(ap: argparse.ArgumentParser) -> None:
    """Flags of ``dartree train-drafter``."""
    ap.add_argument("--target", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--feat-dir", default="data/feats", help="featurized training shards (featurize output)")
    ap.add_argument("--work-dir", default="data/train", help="checkpoints, feature cache, logs")
    ap.add_argument("--out", default=None,
                    help="exported drafter directory (default: <work-dir>/export; copy it into models/ by hand)")
    ap.add_argument("--init-from", default=None,
                    help="warm-start from an exported drafter directory unless resuming (no --resume, or no "
                         "<work-dir>/ckpt.pt): weights only, a fresh optimiser and schedule; its config replaces "
                         "--layers / --gru-hidden-dim / --emb-dim. '--resume --init-from DIR' works on a new machine "
                         "and on one with ckpt.pt alike. E.g. models/smollm2-135m-dartree-drafter")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="draft over the N most frequent target ids of --vocab-counts (EAGLE-3 style d2t map; "
                         "0 = the full vocabulary, the released layout); fixed once training has started")
    ap.add_argument("--vocab-counts", default="data/vocab_counts.pt",
                    help="token counts of the training data (python -m services.training.vocab)")
    ap.add_argument("--layers", type=int, default=3, help="drafter transformer layers (default: 3)")
    ap.add_argument("--dspark", action="store_true",
                    help="train a DSpark drafter (own frozen embedding / lm_head copies, vanilla Markov head, "
                         "docs/algorithms.md §3) instead of DFlash + Domino; with --init-from, the DFlash backbone is "
                         "warm-started and the Markov head starts at zero")
    ap.add_argument("--block-size", type=int, default=None,
                    help="block rows, >= 2 (default: 16; 7 with --dspark, the released DSpark block); a --resume "
                         "keeps the checkpoint's block and a DFlash --init-from the export's (another value is "
                         "refused)")
    ap.add_argument("--markov-rank", type=int, default=64, help="rank r of the DSpark Markov head (default: 64)")
    ap.add_argument("--markov-lr-mult", type=float, default=10.0,
                    help="learning-rate multiplier of the DSpark Markov head (it starts at zero; default: 10)")
    ap.add_argument("--dspark-gamma", type=float, default=4.0, help="DSpark row weight exp(-k / gamma) (default: 4)")
    ap.add_argument("--dspark-ce", type=float, default=0.1, help="DSpark weight of the CE loss (default: 0.1)")
    ap.add_argument("--dspark-l1", type=float, default=0.9, help="DSpark weight of the L1 loss (default: 0.9)")
    ap.add_argument("--gru-hidden-dim", type=int, default=256, help="hidden size of the Domino head's GRU (default: 256)")
    ap.add_argument("--emb-dim", type=int, default=128, help="token embedding size of the Domino head (default: 128)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate, AdamW (default: 1e-3)")
    ap.add_argument("--warmup", type=int, default=100, help="linear learning-rate warm-up steps (default: 100)")
    ap.add_argument("--max-steps", type=int, default=20000,
                    help="stop (and export) at this step; a later --resume may go further (default: 20000)")
    ap.add_argument("--schedule-steps", type=int, default=None,
                    help="length of the cosine lr and linear lambda schedules (default: --max-steps); saved in "
                         "ckpt.pt, so a --resume continues the same schedules exactly")
    ap.add_argument("--max-minutes", type=float, default=0, help="stop (and export) after this wall time; 0 = off")
    ap.add_argument("--anchors", type=int, default=32, help="anchors per sequence per step")
    ap.add_argument("--row-decay", type=float, default=8.0, help="loss weight of block row j = exp(-j / decay)")
    ap.add_argument("--lambda-start", type=float, default=0.8,
                    help="weight of the base (pre-correction) loss at step 0, decayed linearly (default: 0.8)")
    ap.add_argument("--lambda-end", type=float, default=0.2,
                    help="weight of the base loss at --schedule-steps (default: 0.2)")
    ap.add_argument("--save-every-min", type=float, default=5.0, help="checkpoint period, minutes (default: 5)")
    ap.add_argument("--eval-every", type=int, default=500, help="held-out acceptance estimate every N steps (default: 500)")
    ap.add_argument("--heldout", type=int, default=48,
                    help="held-out on-policy sequences (shard gen_00000) for the teacher-forced chain estimate")
    ap.add_argument("--replay-prompts", type=int, default=8,
                    help="held-out prompts (datasets.load_heldout) for the engine's replayed tau at each eval; 0 = off")
    ap.add_argument("--replay-prompt-file", default=None,
                    help="JSON list of prompt token-id lists to use instead of load_heldout (tests, other targets)")
    ap.add_argument("--replay-max-tokens", type=int, default=96, help="greedy tokens per held-out prompt (default: 96)")
    ap.add_argument("--replay-budgets", type=int, nargs="+", default=[8, 64],
                    help="tree budgets B of the replayed dartree-pruned tau (default: 8 64; W = 12)")
    ap.add_argument("--log-every", type=int, default=50, help="append step, lr, lambda, loss to train_log.jsonl every N steps")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False,
                    help="bf16 autocast (slower than fp32 on the 2-core CPU it was measured on)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from <work-dir>/ckpt.pt (model, optimiser, step, schedule, data position, RNG)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: 0 = torch's)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="dartree train-drafter", description=__doc__.splitlines()[0])
    build_args(ap)
    a = ap.parse_args(argv)
    try:
        run(a)
    except (ValueError, RuntimeError, OSError) as exc:  # bad input: one line, not a traceback
        ap.exit(2, f"train-drafter: error: {error_line(exc)}\n")


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


def _dspark_from(src: DFlashDrafter, a) -> DFlashDrafter:
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


def _with_draft_vocab(drafter: DFlashDrafter, a, always: tuple[int, ...]) -> DFlashDrafter:
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
    saved = _load_counts(a.vocab_counts)
    ids = top_ids(saved["counts"], a.draft_vocab, always=tuple(always), secondary=saved.get("secondary"))
    print(f"[train] draft vocabulary: the {a.draft_vocab} most frequent ids of {a.vocab_counts}", flush=True)
    return reduce_draft_vocab(drafter, ids)


def _load_counts(path) -> dict:
    """``--vocab-counts``: the ``{"counts": [V] tensor, ...}`` dict ``python -m services.training.vocab`` saves.

    Raises:
        ValueError: missing, unreadable or not such a dict (one line naming the file).
    """
    if not Path(path).is_file():
        raise ValueError(f"--vocab-counts {path} is not a file (python -m services.training.vocab writes it)")
    try:
        saved = torch.load(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one error line
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        raise ValueError(f"{path} is not a readable token counts file ({why})") from None
    if not (isinstance(saved, dict) and isinstance(saved.get("counts"), torch.Tensor) and saved["counts"].dim() == 1):
        raise ValueError(f"{path} is not a token counts file (no 'counts' vector; python -m services.training.vocab "
                         "writes one)")
    return saved


def _read_ckpt(path: Path) -> dict:
    """``<work-dir>/ckpt.pt`` as a dict. Raises ValueError (one line naming it) when it cannot be read."""
    try:
        st = torch.load(path, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - an empty or damaged file is one error line
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        raise ValueError(f"{path} is not a readable checkpoint ({why}): delete it to start over, or use another "
                         "--work-dir") from None
    if not (isinstance(st, dict) and {"model", "opt", "step"} <= st.keys()):
        raise ValueError(f"{path} is not a train-drafter checkpoint (no model / opt / step): delete it to start "
                         "over, or use another --work-dir")
    return st


def _read_init_config(path: Path) -> dict:
    """``--init-from``'s config.json (checked to be an exported DFlash / DSpark drafter directory).

    Raises:
        ValueError: not a directory, no readable config.json or model.safetensors, or an EAGLE-3 drafter.
    """
    if not path.is_dir():
        raise ValueError(f"--init-from {path} is not a directory (an exported drafter directory, e.g. "
                         "models/smollm2-135m-dartree-drafter)")
    for name in ("config.json", "model.safetensors"):
        if not (path / name).is_file():
            raise ValueError(f"--init-from {path} has no {name} (not an exported drafter directory)")
    try:
        raw = json.loads((path / "config.json").read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        DrafterConfig.from_hf(raw)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path / 'config.json'} is not a drafter config ({type(exc).__name__}: {exc})"
                         .splitlines()[0]) from None
    if "LlamaForCausalLMEagle3" in (raw.get("architectures") or []):
        raise ValueError(f"--init-from {path} is an EAGLE-3 drafter (python -m services.training.train_eagle3 "
                         "trains those)")
    return raw


def _preflight(a) -> dict | None:
    """Every check of the flags, paths and files that needs no model, before anything is loaded or
    written; fills in the default ``--out`` (``<work-dir>/export``).

    Returns the checkpoint to resume (``--resume`` with ``<work-dir>/ckpt.pt``), else None.

    Raises:
        ValueError: one line saying what is wrong (a ``ckpt.pt`` without ``--resume`` is refused:
            starting over would overwrite it).
    """
    for flag, value, least in (("--max-steps", a.max_steps, 0), ("--schedule-steps", a.schedule_steps, 1),
                               ("--max-minutes", a.max_minutes, 0), ("--eval-every", a.eval_every, 0),
                               ("--anchors", a.anchors, 1), ("--threads", a.threads, 0), ("--warmup", a.warmup, 0),
                               ("--block-size", a.block_size, 2), ("--layers", a.layers, 1),
                               ("--gru-hidden-dim", a.gru_hidden_dim, 1), ("--emb-dim", a.emb_dim, 1),
                               ("--markov-rank", a.markov_rank, 1), ("--draft-vocab", a.draft_vocab, 0),
                               ("--heldout", a.heldout, 0), ("--replay-prompts", a.replay_prompts, 0),
                               ("--replay-max-tokens", a.replay_max_tokens, 1), ("--log-every", a.log_every, 0),
                               ("--save-every-min", a.save_every_min, 0),
                               *(("--replay-budgets", b, 1) for b in a.replay_budgets)):
        if value is not None and not value >= least:  # (not >=: NaN too)
            raise ValueError(f"{flag} must be >= {least} (got {value})")
    for flag, value in (("--lr", a.lr), ("--row-decay", a.row_decay), ("--markov-lr-mult", a.markov_lr_mult)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0 (got {value})")
    work = Path(a.work_dir)
    if a.out is None:
        a.out = str(work / "export")
    for flag, path in (("--work-dir", work), ("--out", Path(a.out))):
        if path.exists() and not path.is_dir():
            raise ValueError(f"{flag} {path} is a file, not a directory")
    feat = Path(a.feat_dir)
    if not feat.is_dir() or not shard_paths(feat):
        raise FileNotFoundError(f"no training shards in {feat} (run featurize first)")
    if a.replay_prompt_file:
        from services.training.heldout import load_prompt_file

        try:
            prompts = load_prompt_file(Path(a.replay_prompt_file))
        except (OSError, UnicodeDecodeError, ValueError, TypeError) as exc:
            raise ValueError(f"--replay-prompt-file {a.replay_prompt_file} is not a JSON list of token-id lists "
                             f"({type(exc).__name__}: {exc})".splitlines()[0]) from None
        if not all(ids for _, ids in prompts):
            raise ValueError(f"--replay-prompt-file {a.replay_prompt_file} holds an empty prompt")
    ckpt = work / "ckpt.pt"
    st = _read_ckpt(ckpt) if ckpt.exists() else None
    if st is not None and not a.resume:
        raise ValueError(f"{ckpt} exists (step {st['step']}): pass --resume to continue it, or use another "
                         "--work-dir")
    if st is not None:
        saved = st.get("schedule")
        if saved and a.schedule_steps is not None and a.schedule_steps != saved["steps"]:
            raise ValueError(f"--schedule-steps {a.schedule_steps} differs from the checkpoint's {saved['steps']}: "
                             "a resume continues the saved schedule (omit the flag, or start a new --work-dir)")
        have = (st.get("drafter_config") or {}).get("block_size")
        if a.block_size and have is not None and have != a.block_size:
            raise ValueError(f"--block-size {a.block_size} but {ckpt} trains block {have}: a resume keeps it "
                             "(omit the flag, or start a new --work-dir)")
        return st
    init = _read_init_config(Path(a.init_from)) if a.init_from else None
    if init is not None and not a.dspark and a.block_size:
        have = DrafterConfig.from_hf(init).block_size
        if have != a.block_size:
            raise ValueError(f"--block-size {a.block_size} but --init-from {a.init_from} has block {have} (a "
                             "warm start keeps the export's architecture; omit the flag)")
    if a.draft_vocab and (init is None or DrafterConfig.from_hf(init).draft_vocab_size is None):
        _load_counts(a.vocab_counts)
    return None


def run(a) -> None:
    """Train (resumably) and export the drafter.

    Start: ``--resume`` with ``<work-dir>/ckpt.pt`` continues it exactly (weights, optimiser, step,
    schedule, data position, RNG); otherwise ``--init-from DIR`` loads an exported drafter's
    weights; otherwise a fresh drafter. Raises ``ValueError`` when ``--schedule-steps`` contradicts
    the checkpoint's schedule or any flag, path or file is bad (:func:`_preflight`: checked before
    anything is loaded or written), ``FileNotFoundError`` when there is no training shard.
    """
    from services.drafter.model import load_drafter
    from services.models.registry import resolve_target
    from services.verifier.target import TargetModel

    st = _preflight(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    work = Path(a.work_dir)
    tpath = resolve_target(a.target)
    target = TargetModel.from_pretrained(tpath, dtype=torch.float32)
    ckpt = work / "ckpt.pt"
    origin: dict = {}
    if st is not None:
        cfg = DrafterConfig.from_hf(st["drafter_config"]) if "drafter_config" in st else \
            new_drafter_config(target.config, target.target_layer_ids, a)
        drafter = DFlashDrafter(cfg)
        origin = st.get("origin", {})
    elif a.init_from and a.dspark:
        drafter = _dspark_from(load_drafter(a.init_from), a)
        cfg = drafter.config
        prev = json.loads((Path(a.init_from) / "config.json").read_text()).get("training", {})
        origin = {"init_from": str(a.init_from), "init_training": prev, "init": "DFlash backbone only"}
        print(f"[train] DSpark: backbone warm-started from {a.init_from} (its training: {prev})", flush=True)
    elif a.init_from:
        drafter = load_drafter(a.init_from).train()
        cfg = drafter.config
        prev = json.loads((Path(a.init_from) / "config.json").read_text()).get("training", {})
        origin = {"init_from": str(a.init_from), "init_training": prev}
        print(f"[train] warm start from {a.init_from} (its training: {prev})", flush=True)
    else:
        cfg = new_drafter_config(target.config, target.target_layer_ids, a)
        drafter = _dspark_from(DFlashDrafter(cfg), a) if a.dspark else DFlashDrafter(cfg)
        cfg = drafter.config
        with torch.no_grad():  # start the output scale where the target's own final norm has it
            drafter.norm.weight.copy_(target.model.model.norm.weight.float())
    if st is None and a.draft_vocab:
        drafter = _with_draft_vocab(drafter, a, target.eos_token_ids)
        cfg = drafter.config
    embed_w = target.embed_tokens().weight.detach().float()
    head_w = target.lm_head().weight.detach().float()
    if drafter.has_markov and st is None:  # DSpark's own frozen copies of the target's embedding and lm_head
        drafter.copy_target_io(embed_w, head_w)
    head = [p for n, p in drafter.named_parameters() if n.startswith("markov_head.")]
    rest = [p for n, p in drafter.named_parameters() if not n.startswith("markov_head.")]
    groups = [{"params": rest, "lr_mult": 1.0}] + ([{"params": head, "lr_mult": a.markov_lr_mult}] if head else [])
    opt = torch.optim.AdamW(groups, lr=a.lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = Schedule(a.lr, a.warmup, a.schedule_steps or a.max_steps, a.lambda_start, a.lambda_end)
    step, elapsed_prev, cpu_prev, data_state = 0, 0.0, 0.0, None
    if st is not None:
        drafter.load_state_dict(st["model"])
        if drafter.has_markov:
            drafter.copy_target_io(embed_w, head_w)  # frozen (requires_grad off) after the load
        opt.load_state_dict(st["opt"])
        step, elapsed_prev, cpu_prev = st["step"], st.get("elapsed", 0.0), st.get("cpu_elapsed", 0.0)
        rng.setstate(st["rng"])
        if "torch_rng" in st:
            torch.set_rng_state(st["torch_rng"])
        data_state = st.get("data")
        if "schedule" in st:  # (a different --schedule-steps was refused by _preflight)
            sched = Schedule(**st["schedule"])
        print(f"[train] resumed at step {step} ({elapsed_prev / 60:.1f} min trained); schedule {sched}", flush=True)
    work.mkdir(parents=True, exist_ok=True)  # the first write: every check has passed
    args_log = {k: v for k, v in vars(a).items() if not callable(v)}  # the CLI adds its handler function
    (work / "config.json").write_text(json.dumps({"args": args_log, "schedule": dataclasses.asdict(sched),
                                                  "origin": origin, "drafter": cfg.to_hf()}, indent=2))
    trainer = Trainer(drafter, embed_w, head_w, a)
    hpath = Path(a.feat_dir) / f"{HELDOUT_SHARD}.pt"
    heldout = torch.load(hpath)[: a.heldout] if hpath.exists() else []  # not generated yet: replayed tau only
    turns = _heldout_turns(a, target, tpath, work)
    stream = DataStream(Path(a.feat_dir), a.seed, data_state)
    print(f"[train] {len(stream.names)} training shards in epoch {stream.epoch}; held-out {len(heldout)} sequences",
          flush=True)
    t0, last_save, cpu0 = time.time(), time.time(), time.process_time()
    bar = tqdm(total=a.max_steps, initial=step, desc="train", mininterval=30)
    ema: dict[str, float] = {}

    def save(final: bool = False) -> None:
        bad = [n for n, w in drafter.named_parameters() if not bool(torch.isfinite(w).all())]
        if bad:  # never overwrite the last good checkpoint and export with a broken model
            raise RuntimeError(f"non-finite weights at step {step} ({', '.join(bad[:3])}): checkpoint and "
                               f"export not written (the last good ones are kept in {ckpt} and {a.out})")
        elapsed = elapsed_prev + time.time() - t0  # wall time, including any kill -STOP pause
        cpu = cpu_prev + time.process_time() - cpu0  # CPU time of this process (all threads)
        torch.save({"model": drafter.state_dict(), "opt": opt.state_dict(), "step": step, "rng": rng.getstate(),
                    "torch_rng": torch.get_rng_state(), "elapsed": elapsed, "cpu_elapsed": cpu, "schedule": dataclasses.asdict(sched),
                    "data": stream.state(), "drafter_config": cfg.to_hf(), "origin": origin}, work / "ckpt.tmp")
        (work / "ckpt.tmp").rename(ckpt)
        save_drafter(drafter, a.out, omit_target_copies=drafter.has_markov, extra={"training": {"steps": step, "schedule_steps": sched.steps,
                                                          "minutes": round(elapsed / 60, 1),
                                                          "cpu_minutes": round(cpu / 60, 1), "final": final,
                                                          **origin}})

    if step == 0 and a.eval_every:  # the starting point of the held-out curve (e.g. the --init-from export)
        evaluate(trainer, heldout, work, step, target, turns, a.replay_budgets)
    log = open(work / "train_log.jsonl", "a")
    skipped = 0
    while step < a.max_steps and not (a.max_minutes and (elapsed_prev + time.time() - t0) / 60 >= a.max_minutes):
        row = stream.next()
        lam, lr = sched.lambda_at(step), sched.lr_at(step)
        out = trainer.loss(row, lam, rng)
        if out is None:
            continue
        loss, stats = out
        for g in opt.param_groups:
            g["lr"] = lr * g.get("lr_mult", 1.0)
        opt.zero_grad(set_to_none=True)
        bad = "loss" if not torch.isfinite(loss) else None
        if bad is None:
            loss.backward()
            if not torch.isfinite(torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)):
                bad = "gradient norm"
        if bad:  # one bad row must not turn every weight into NaN (it once cost a whole run): skip it
            opt.zero_grad(set_to_none=True)
            skipped += 1
            print(f"[train] step {step}: non-finite {bad} on {stream.last()}: row skipped ({skipped} so far)",
                  flush=True)
            log.write(json.dumps({"step": step, "skipped": stream.last(), "why": f"non-finite {bad}"}) + "\n")
            if skipped > max(100, step // 100):
                raise RuntimeError(f"{skipped} rows gave a non-finite {bad} by step {step}: stopping (the last "
                                   f"checkpoint is the last good state)")
            continue
        opt.step()
        step += 1
        for k, v in stats.items():
            ema[k] = v if k not in ema else 0.98 * ema[k] + 0.02 * v
        if a.log_every and step % a.log_every == 0:
            log.write(json.dumps({"step": step, "lr": lr, "lambda": lam, **{k: round(v, 5) for k, v in stats.items()},
                                  **{f"ema_{k}": round(v, 4) for k, v in ema.items()}}) + "\n")
            log.flush()
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items()}, refresh=False)
        if a.eval_every and step % a.eval_every == 0:
            evaluate(trainer, heldout, work, step, target, turns, a.replay_budgets)
        if time.time() - last_save > a.save_every_min * 60:
            save()
            last_save = time.time()
    log.close()
    save(final=True)
    evaluate(trainer, heldout, work, step, target, turns, a.replay_budgets)
    print(f"[train] stopped at step {step} of {sched.steps} (schedule); drafter exported to {a.out}", flush=True)


def _heldout_turns(a, target, tpath: Path, work: Path) -> list:
    """Held-out prompts and the target's greedy outputs for the replayed tau (cached in the work dir)."""
    from services.training.heldout import greedy_turns, heldout_prompt_ids, load_prompt_file

    if not a.replay_prompts and not a.replay_prompt_file:
        return []
    prompts = (load_prompt_file(Path(a.replay_prompt_file)) if a.replay_prompt_file
               else heldout_prompt_ids(tpath, a.replay_prompts))
    t0 = time.time()
    turns = greedy_turns(target, prompts, a.replay_max_tokens, work / "heldout_turns.pt")
    print(f"[train] held-out replay: {len(turns)} prompts x <= {a.replay_max_tokens} greedy tokens "
          f"({time.time() - t0:.0f} s)", flush=True)
    return turns


@torch.no_grad()
def evaluate(trainer: Trainer, heldout: list[dict], work: Path, step: int, target=None, turns: list | None = None,
             budgets: tuple[int, ...] = (8, 64)) -> dict:
    """Held-out estimates, appended to ``<work>/eval.jsonl``: the engine's replayed dartree-pruned tau
    (ddtree without a Domino head) on held-out prompts at each budget B (W = 12; ``replay_tau_B<B>``;
    the figure to trust), and the
    teacher-forced chain acceptance on held-out on-policy sequences (base and Domino-corrected)."""
    rng = random.Random(1234)
    acc: dict[str, list[float]] = {}
    trainer.m.eval()
    for row in heldout:
        out = trainer.loss(row, 0.5, rng)
        if out is not None:
            for k, v in out[1].items():
                acc.setdefault(k, []).append(v)
    trainer.m.train()
    res = {k: sum(v) / len(v) for k, v in acc.items()}
    if turns:
        from services.training.heldout import replayed_tau

        t0 = time.time()
        method = "dspark-dartree" if trainer.m.has_markov else "dartree-pruned" if trainer.m.has_head else "ddtree"
        for b in budgets:
            res[f"replay_tau_B{b}"] = replayed_tau(trainer.m, target, turns, method, budget=b)
        res["replay_s"] = time.time() - t0
    line = json.dumps({"step": step, **{k: round(v, 4) for k, v in res.items()}})
    print(f"[eval] {line}", flush=True)
    with open(work / "eval.jsonl", "a") as f:
        f.write(line + "\n")
    return res


if __name__ == "__main__":
    main()
