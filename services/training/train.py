"""``dartree train-drafter``: train a DFlash backbone + Domino head on self-distilled target data.

Training semantics (algorithms.md §1.3, §2.1): random anchors a in the response of each sequence;
block = [token at a, MASK x (block_size - 1)] at positions a .. a + block_size - 1; context =
target features of positions < a only; shift-label targets tokens a + 1 .. a + block_size. Loss =
(1 - lambda) * CE(corrected) + lambda * CE(base), lambda decayed linearly; the target stays frozen
and its embedding / lm_head are used in place (never copied into the drafter's weights).
Resumable: ``--resume`` continues from ``<work-dir>/ckpt.pt`` (model, optimiser, step, RNG).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from services.drafter.model import DFlashDrafter, DrafterConfig, save_drafter


HELDOUT_SHARD = "gen_00000"


def shard_paths(feat_dir: Path) -> list[Path]:
    """Finished featurized shards (``featurize`` output), held-out shard excluded."""
    return [p for p in sorted(feat_dir.glob("*.pt")) if p.stem != HELDOUT_SHARD]


class Trainer:
    """One drafter, the frozen target pieces it borrows, and the loss of one sequence's anchors."""

    def __init__(self, drafter: DFlashDrafter, embed_w: torch.Tensor, head_w: torch.Tensor, args):
        self.m, self.embed_w, self.head_w, self.a = drafter, embed_w, head_w, args
        c = drafter.config
        self.bs = c.block_size
        self.row_w = torch.exp(-torch.arange(self.bs).float() / args.row_decay)

    def batch(self, row: dict, n_anchor: int, rng: random.Random):
        """Sample anchors of one sequence.

        Returns ``(anchors [A], block ids [A, Q], labels [A, Q] (-100 = none), realised [A, Q])``:
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
            if m.has_head:
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


def build_args(ap: argparse.ArgumentParser) -> None:
    """Flags of ``dartree train-drafter``."""
    ap.add_argument("--target", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--feat-dir", default="data/feats", help="featurized training shards (featurize output)")
    ap.add_argument("--work-dir", default="data/train", help="checkpoints, feature cache, logs")
    ap.add_argument("--out", default="models/smollm2-135m-dartree-drafter", help="exported drafter directory")
    ap.add_argument("--layers", type=int, default=3, help="drafter transformer layers (default: 3)")
    ap.add_argument("--gru-hidden-dim", type=int, default=256, help="hidden size of the Domino head's GRU (default: 256)")
    ap.add_argument("--emb-dim", type=int, default=128, help="token embedding size of the Domino head (default: 128)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate, AdamW (default: 1e-3)")
    ap.add_argument("--warmup", type=int, default=100, help="linear learning-rate warm-up steps (default: 100)")
    ap.add_argument("--max-steps", type=int, default=20000,
                    help="training steps: the length of the cosine and lambda schedules (default: 20000)")
    ap.add_argument("--max-minutes", type=float, default=0, help="stop (and export) after this wall time; 0 = off")
    ap.add_argument("--anchors", type=int, default=32, help="anchors per sequence per step")
    ap.add_argument("--row-decay", type=float, default=8.0, help="loss weight of block row j = exp(-j / decay)")
    ap.add_argument("--lambda-start", type=float, default=0.8,
                    help="weight of the base (pre-correction) loss at step 0, decayed linearly (default: 0.8)")
    ap.add_argument("--lambda-end", type=float, default=0.2, help="weight of the base loss at --max-steps (default: 0.2)")
    ap.add_argument("--save-every-min", type=float, default=5.0, help="checkpoint period, minutes (default: 5)")
    ap.add_argument("--eval-every", type=int, default=500, help="held-out acceptance estimate every N steps (default: 500)")
    ap.add_argument("--heldout", type=int, default=48, help="held-out sequences for the acceptance estimate")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False,
                    help="bf16 autocast (slower than fp32 on the 2-core CPU measured 2026-11-30)")
    ap.add_argument("--resume", action="store_true", help="continue from <work-dir>/ckpt.pt (model, optimiser, step, RNG)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: 0 = torch's)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="dartree train-drafter", description=__doc__.splitlines()[0])
    build_args(ap)
    run(ap.parse_args(argv))


def run(a) -> None:
    """Train (resumably) and export the drafter."""
    from services.models.registry import resolve_target
    from services.verifier.target import TargetModel

    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    work = Path(a.work_dir)
    (work / "feats").mkdir(parents=True, exist_ok=True)
    tpath = resolve_target(a.target)
    target = TargetModel.from_pretrained(tpath, dtype=torch.float32)
    tcfg = target.config
    cfg = DrafterConfig(hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size,
                        num_hidden_layers=a.layers, num_attention_heads=tcfg.num_attention_heads,
                        num_key_value_heads=tcfg.num_key_value_heads,
                        head_dim=getattr(tcfg, "head_dim", tcfg.hidden_size // tcfg.num_attention_heads),
                        vocab_size=tcfg.vocab_size, rms_norm_eps=tcfg.rms_norm_eps,
                        rope_theta=float((getattr(tcfg, "rope_parameters", None) or {}).get("rope_theta", 1e4)),
                        max_position_embeddings=tcfg.max_position_embeddings,
                        num_target_layers=tcfg.num_hidden_layers, target_hidden_size=tcfg.hidden_size,
                        mask_token_id=16 if tcfg.vocab_size == 49152 else tcfg.vocab_size - 1,
                        target_layer_ids=target.target_layer_ids, gru_hidden_dim=a.gru_hidden_dim, emb_dim=a.emb_dim)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():  # start the output scale where the target's own final norm has it
        drafter.norm.weight.copy_(target.model.model.norm.weight.float())
    embed_w = target.embed_tokens().weight.detach().float()
    head_w = target.lm_head().weight.detach().float()
    opt = torch.optim.AdamW(drafter.parameters(), lr=a.lr, weight_decay=0.01, betas=(0.9, 0.95))
    step, elapsed_prev = 0, 0.0
    ckpt = work / "ckpt.pt"
    if a.resume and ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        drafter.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed_prev = st["step"], st.get("elapsed", 0.0)
        rng.setstate(st["rng"])
        print(f"[train] resumed at step {step} ({elapsed_prev / 60:.1f} min trained)", flush=True)
    args_log = {k: v for k, v in vars(a).items() if not callable(v)}  # the CLI adds its handler function
    (work / "config.json").write_text(json.dumps({"args": args_log, "drafter": cfg.to_hf()}, indent=2))
    trainer = Trainer(drafter, embed_w, head_w, a)
    heldout = torch.load(Path(a.feat_dir) / f"{HELDOUT_SHARD}.pt")[: a.heldout]
    paths = shard_paths(Path(a.feat_dir))
    print(f"[train] {len(paths)} training shards; held-out {len(heldout)} sequences", flush=True)
    t0, last_save = time.time(), time.time()
    bar = tqdm(total=a.max_steps, initial=step, desc="train", mininterval=10)
    ema: dict[str, float] = {}

    def lr_at(s: int) -> float:
        if s < a.warmup:
            return a.lr * (s + 1) / a.warmup
        frac = min(1.0, (s - a.warmup) / max(1, a.max_steps - a.warmup))
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    def save(final: bool = False) -> None:
        elapsed = elapsed_prev + time.time() - t0
        torch.save({"model": drafter.state_dict(), "opt": opt.state_dict(), "step": step, "rng": rng.getstate(),
                    "elapsed": elapsed}, work / "ckpt.tmp")
        (work / "ckpt.tmp").rename(ckpt)
        save_drafter(drafter, a.out, extra={"training": {"steps": step, "minutes": round(elapsed / 60, 1),
                                                          "final": final}})

    done = False
    while not done:
        for path in rng.sample(paths, len(paths)):
            rows = torch.load(path)
            for row in rng.sample(rows, len(rows)):
                lam = a.lambda_start + (a.lambda_end - a.lambda_start) * min(1.0, step / a.max_steps)
                out = trainer.loss(row, lam, rng)
                if out is None:
                    continue
                loss, stats = out
                for g in opt.param_groups:
                    g["lr"] = lr_at(step)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
                opt.step()
                step += 1
                for k, v in stats.items():
                    ema[k] = v if k not in ema else 0.98 * ema[k] + 0.02 * v
                bar.update(1)
                bar.set_postfix({k: f"{v:.3f}" for k, v in ema.items()}, refresh=False)
                if step % a.eval_every == 0:
                    evaluate(trainer, heldout, work, step)
                if time.time() - last_save > a.save_every_min * 60:
                    save()
                    last_save = time.time()
                minutes = (elapsed_prev + time.time() - t0) / 60
                if step >= a.max_steps or (a.max_minutes and minutes >= a.max_minutes):
                    done = True
                    break
            if done:
                break
        paths = shard_paths(Path(a.feat_dir))  # pick up shards featurized since (resumable pipeline)
    save(final=True)
    evaluate(trainer, heldout, work, step)
    print(f"[train] done at step {step}; drafter exported to {a.out}", flush=True)


@torch.no_grad()
def evaluate(trainer: Trainer, heldout: list[dict], work: Path, step: int) -> dict:
    """Teacher-forced chain acceptance on held-out on-policy sequences (base and Domino-corrected)."""
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
    line = json.dumps({"step": step, **{k: round(v, 4) for k, v in res.items()}})
    print(f"[eval] {line}", flush=True)
    with open(work / "eval.jsonl", "a") as f:
        f.write(line + "\n")
    return res


if __name__ == "__main__":
    main()
