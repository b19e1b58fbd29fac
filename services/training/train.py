"""``dartree train-drafter``: train a DFlash backbone + Domino head on self-distilled target data.

Training semantics (docs/algorithms.md §1.3, §2.1): random anchors a in the response of each sequence;
block = [token at a, MASK x (block_size - 1)] at positions a .. a + block_size - 1; context =
target features of positions < a only; shift-label targets tokens a + 1 .. a + block_size. Loss =
(1 - lambda) * CE(corrected) + lambda * CE(base), lambda decayed linearly; the target stays frozen
and its embedding / lm_head are used in place (never copied into the drafter's weights).
Resumable: ``--resume`` continues from ``<work-dir>/ckpt.pt`` (model, optimiser, step, the lr and
lambda schedules of ``--schedule-steps``, the data position, RNG) exactly as if never stopped; when
``ckpt.pt`` is gone (a new machine), ``--init-from <exported drafter dir>`` warm-starts the weights.

The pieces: the rows (:mod:`services.training.train_data`), the loss (:mod:`services.training.train_loss`),
the checks before anything is loaded (:mod:`services.training.train_checks`), the starting drafter
(:mod:`services.training.train_init`) and the loop with its checkpoints (:mod:`services.training.train_loop`);
their public names are importable from here too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from services.runtime import error_line
from services.training.train_checks import load_counts, preflight, read_ckpt, read_init_config
from services.training.train_data import HELDOUT_SHARD, DataStream, shard_paths
from services.training.train_init import (dspark_from, make_optimiser, new_drafter_config, start_drafter,
                                          with_draft_vocab)
from services.training.train_loop import Schedule, TrainLoop, evaluate, heldout_turns, load_heldout
from services.training.train_loss import Trainer

__all__ = ["HELDOUT_SHARD", "DataStream", "Schedule", "TrainLoop", "Trainer", "build_args", "dspark_from",
           "evaluate", "heldout_turns", "load_counts", "load_heldout", "main", "make_optimiser",
           "new_drafter_config", "preflight", "read_ckpt", "read_init_config", "run", "shard_paths",
           "start_drafter", "with_draft_vocab"]


def build_args(ap: argparse.ArgumentParser) -> None:
    """Flags of ``dartree train-drafter``."""
    _data_flags(ap)
    _model_flags(ap)
    _schedule_flags(ap)
    _eval_flags(ap)


def _data_flags(ap: argparse.ArgumentParser) -> None:
    """Target, data, work directory, export, starting weights and draft vocabulary."""
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


def _model_flags(ap: argparse.ArgumentParser) -> None:
    """The drafter's architecture (DFlash + Domino, or DSpark) and its loss weights."""
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


def _schedule_flags(ap: argparse.ArgumentParser) -> None:
    """Optimiser, schedules, run length, anchors and checkpoint period."""
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


def _eval_flags(ap: argparse.ArgumentParser) -> None:
    """Held-out estimates, logging, seed, precision, resume and threads."""
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
    """``dartree train-drafter`` ARGV: train and export; bad input exits 2 with one error line."""
    ap = argparse.ArgumentParser(prog="dartree train-drafter", description=__doc__.splitlines()[0])
    build_args(ap)
    a = ap.parse_args(argv)
    try:
        run(a)
    except (ValueError, RuntimeError, OSError) as exc:  # bad input: one line, not a traceback
        ap.exit(2, f"train-drafter: error: {error_line(exc)}\n")


def run(a) -> None:
    """Train (resumably) and export the drafter.

    Start: ``--resume`` with ``<work-dir>/ckpt.pt`` continues it exactly (weights, optimiser, step,
    schedule, data position, RNG); otherwise ``--init-from DIR`` loads an exported drafter's
    weights; otherwise a fresh drafter. Raises ``ValueError`` when ``--schedule-steps`` contradicts
    the checkpoint's schedule or any flag, path or file is bad (:func:`preflight`: checked before
    anything is loaded or written), ``FileNotFoundError`` when there is no training shard.
    """
    from services.models.registry import resolve_target
    from services.verifier.target import TargetModel

    st = preflight(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    tpath = resolve_target(a.target)
    target = TargetModel.from_pretrained(tpath, dtype=torch.float32)
    drafter, origin = start_drafter(a, st, target)
    embed_w = target.embed_tokens().weight.detach().float()
    head_w = target.lm_head().weight.detach().float()
    if drafter.has_markov and st is None:  # DSpark's own frozen copies of the target's embedding and lm_head
        drafter.copy_target_io(embed_w, head_w)
    sched = Schedule(a.lr, a.warmup, a.schedule_steps or a.max_steps, a.lambda_start, a.lambda_end)
    loop = TrainLoop(a, drafter, make_optimiser(drafter, a), sched, origin)
    if st is not None:
        loop.resume(st, embed_w, head_w)
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)  # the first write: every check has passed
    args_log = {k: v for k, v in vars(a).items() if not callable(v)}  # the CLI adds its handler function
    (work / "config.json").write_text(json.dumps({"args": args_log, "schedule": dataclasses.asdict(loop.sched),
                                                  "origin": origin, "drafter": drafter.config.to_hf()}, indent=2))
    trainer = Trainer(drafter, embed_w, head_w, a)
    heldout, turns = load_heldout(a, target, tpath, work)
    stream = DataStream(Path(a.feat_dir), a.seed, loop.data_state)
    print(f"[train] {len(stream.names)} training shards in epoch {stream.epoch}; held-out {len(heldout)} sequences",
          flush=True)
    loop.run(trainer, stream, heldout, target, turns)


if __name__ == "__main__":
    main()
