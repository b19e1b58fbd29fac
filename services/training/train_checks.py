"""Checks of ``dartree train-drafter``'s flags, paths and files that need no model (run before anything
is loaded or written), and the readers of the files they check: the checkpoint to resume, the
``--init-from`` export's config and the ``--vocab-counts`` file."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.drafter.model import DrafterConfig
from services.training.train_data import shard_paths


def load_counts(path) -> dict:
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


def read_ckpt(path: Path) -> dict:
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


def read_init_config(path: Path) -> dict:
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


def preflight(a) -> dict | None:
    """Every check of the flags, paths and files that needs no model, before anything is loaded or
    written; fills in the default ``--out`` (``<work-dir>/export``).

    Returns the checkpoint to resume (``--resume`` with ``<work-dir>/ckpt.pt``), else None.

    Raises:
        ValueError: one line saying what is wrong (a ``ckpt.pt`` without ``--resume`` is refused:
            starting over would overwrite it).
        FileNotFoundError: no training shard in ``--feat-dir``.
    """
    _check_numbers(a)
    _check_paths(a)
    ckpt = Path(a.work_dir) / "ckpt.pt"
    st = read_ckpt(ckpt) if ckpt.exists() else None
    if st is not None and not a.resume:
        raise ValueError(f"{ckpt} exists (step {st['step']}): pass --resume to continue it, or use another "
                         "--work-dir")
    if st is not None:
        _check_resume(a, st, ckpt)
        return st
    _check_init(a)
    return None


def _check_numbers(a) -> None:
    """Numeric flags in range. Raises ValueError naming the flag."""
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


def _check_paths(a) -> None:
    """``--work-dir`` / ``--out`` (default filled in) not files, training shards present, a readable
    ``--replay-prompt-file``. Raises ValueError, or FileNotFoundError without a training shard."""
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


def _check_resume(a, st: dict, ckpt: Path) -> None:
    """A resume keeps the checkpoint's schedule length and block size. Raises ValueError on another."""
    saved = st.get("schedule")
    if saved and a.schedule_steps is not None and a.schedule_steps != saved["steps"]:
        raise ValueError(f"--schedule-steps {a.schedule_steps} differs from the checkpoint's {saved['steps']}: "
                         "a resume continues the saved schedule (omit the flag, or start a new --work-dir)")
    have = (st.get("drafter_config") or {}).get("block_size")
    if a.block_size and have is not None and have != a.block_size:
        raise ValueError(f"--block-size {a.block_size} but {ckpt} trains block {have}: a resume keeps it "
                         "(omit the flag, or start a new --work-dir)")


def _check_init(a) -> None:
    """A fresh start: a valid ``--init-from`` (a DFlash one keeps its block size) and, for a new
    ``--draft-vocab``, a readable ``--vocab-counts``. Raises ValueError."""
    init = read_init_config(Path(a.init_from)) if a.init_from else None
    if init is not None and not a.dspark and a.block_size:
        have = DrafterConfig.from_hf(init).block_size
        if have != a.block_size:
            raise ValueError(f"--block-size {a.block_size} but --init-from {a.init_from} has block {have} (a "
                             "warm start keeps the export's architecture; omit the flag)")
    if a.draft_vocab and (init is None or DrafterConfig.from_hf(init).draft_vocab_size is None):
        load_counts(a.vocab_counts)
