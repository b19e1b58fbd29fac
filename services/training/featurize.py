"""Turn (prompt, response) token rows into training shards: target features + target argmax labels.

Two sources: the target's own generations (``datagen`` shards) and reference responses of train
sets, teacher-forced through the target (``load_train_pairs``). For every position ``t`` a shard
stores the target's tapped features and ``labels[t]`` = the target's argmax next token given
``ids[: t + 1]`` -- the token greedy decoding would emit there. Shards are resumable.

Generated data is featurized one ``datagen`` shard at a time (``shard_NNNNN.pt`` ->
``gen_NNNNN.pt``), so featurization can follow a running generation (``--watch-pid``) and a
later run never re-chunks rows that an earlier run already wrote.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from services.datasets import load_train_pairs
from services.training.datagen import encode_prompt


def featurize_rows(target, rows: list[dict]) -> list[dict]:
    """Rows ``{uid, prompt_ids, response_ids}`` -> ``{uid, ids, prompt_len, labels [T], feats [T, F] bf16}``."""
    out = []
    for r in rows:
        ids = list(r["prompt_ids"]) + list(r["response_ids"])
        labels, feats = target.teacher_forced(ids)
        out.append({"uid": r["uid"], "ids": torch.tensor(ids), "prompt_len": len(r["prompt_ids"]),
                    "labels": labels.cpu(), "feats": feats.to(torch.bfloat16).cpu()})
    return out


def pair_rows(tok, n: int, max_prompt: int = 256, max_response: int = 256) -> list[dict]:
    """Tokenised reference pairs (response truncated; EOS appended when it ended inside the limit)."""
    rows = []
    for prompt, resp in load_train_pairs(n):
        p = encode_prompt(tok, prompt, max_prompt)
        r = tok.encode(resp, add_special_tokens=False)
        r = r[:max_response] if len(r) >= max_response else r + [tok.eos_token_id]
        rows.append({"uid": prompt.uid, "prompt_ids": p, "response_ids": r})
    return rows


def write_shards(target, rows: list[dict], out_dir: Path, prefix: str, shard_size: int) -> None:
    """Featurize ``rows`` into ``<prefix>_NNNNN.pt`` shards, skipping shards that exist."""
    out_dir.mkdir(parents=True, exist_ok=True)
    chunks = [rows[i:i + shard_size] for i in range(0, len(rows), shard_size)]
    t0, done = time.time(), 0
    bar = tqdm(range(len(chunks)), desc=f"featurize {prefix}")
    for i in bar:
        path = out_dir / f"{prefix}_{i:05d}.pt"
        if path.exists():
            continue
        data = featurize_rows(target, chunks[i])
        torch.save(data, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
        done += sum(int(d["ids"].numel()) for d in data)
        bar.set_postfix(tok_s=f"{done / (time.time() - t0):.0f}")


def featurize_gen_dir(target, gen_dir: Path, out_dir: Path) -> int:
    """Featurize every finished ``datagen`` shard that has no ``gen_NNNNN.pt`` yet; returns shards written.

    ``gen_dir/shard_NNNNN.pt`` maps to ``out_dir/gen_NNNNN.pt`` (one to one, written atomically).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = 0
    for src in sorted(gen_dir.glob("shard_*.pt")):
        dst = out_dir / f"gen_{src.stem.split('_')[1]}.pt"
        if dst.exists():
            continue
        t0 = time.time()
        data = featurize_rows(target, torch.load(src))
        torch.save(data, dst.with_suffix(".tmp"))
        dst.with_suffix(".tmp").rename(dst)
        n = sum(int(d["ids"].numel()) for d in data)
        print(f"[featurize] {time.strftime('%H:%M:%S')} {dst.name}: {len(data)} sequences, {n} tokens, "
              f"{n / (time.time() - t0):.0f} tok/s", flush=True)
        written += 1
    return written


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, ended but not yet reaped by its parent, has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # Linux: the state is the field after the parenthesized command name
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


DTYPES = ("float32", "bfloat16", "float16")


def _check(a) -> None:
    """The flags and paths of ``main``, checked before the target is loaded or a directory created.

    Raises:
        ValueError: one line saying what is wrong.
    """
    for flag, value, least in (("--threads", a.threads, 0), ("--shard-size", a.shard_size, 1),
                               ("--num-pairs", a.num_pairs, 0), *(("--watch-pid", pid, 1) for pid in a.watch_pid)):
        if value < least:  # (pid 0 / -N would signal a process group: the watch would never end)
            raise ValueError(f"{flag} must be >= {least} (got {value})")
    if a.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)} (got {a.dtype!r})")
    if not a.poll_s > 0:
        raise ValueError(f"--poll-s must be > 0 (got {a.poll_s})")
    gen, out = Path(a.gen_dir), Path(a.out_dir)
    if gen.exists() and not gen.is_dir():
        raise ValueError(f"--gen-dir {gen} is a file, not a directory")
    if not gen.exists() and not a.watch_pid:  # with --watch-pid the running datagen job may not have made it yet
        raise ValueError(f"--gen-dir {gen} does not exist (datagen's --out-dir; with --watch-pid PID, featurize "
                         "waits for a running datagen job to make it)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out-dir {out} is a file, not a directory")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="featurize drafter training data (resumable)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--gen-dir", default="data/gen")
    ap.add_argument("--out-dir", default="data/feats")
    ap.add_argument("--num-pairs", type=int, default=6000)
    ap.add_argument("--shard-size", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16",
                    help="target precision: float32, bfloat16 or float16; float32 gives the labels the fp32 "
                         "engine's greedy decoding emits")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: 0 = torch's)")
    ap.add_argument("--watch-pid", type=int, nargs="+", default=[], metavar="PID",
                    help="keep featurizing new datagen shards while any of these processes (the datagen jobs, "
                         "e.g. one per --part) lives")
    ap.add_argument("--poll-s", type=float, default=60.0, help="seconds between scans with --watch-pid")
    a = ap.parse_args(argv)
    try:  # bad flags: one line, before anything is loaded or written
        _check(a)
    except ValueError as exc:
        ap.exit(2, f"featurize: error: {exc}\n")
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    from services.models.registry import ModelNotFoundError, resolve_target
    from services.verifier.target import TargetModel

    try:
        path = resolve_target(a.target)
    except ModelNotFoundError as exc:  # an unknown target: one line
        ap.exit(2, f"featurize: error: {exc}\n")
    tok = AutoTokenizer.from_pretrained(path)
    target = TargetModel.from_pretrained(path, dtype=getattr(torch, a.dtype))
    gen_dir, out_dir = Path(a.gen_dir), Path(a.out_dir)
    featurize_gen_dir(target, gen_dir, out_dir)
    while any(_alive(pid) for pid in a.watch_pid):
        time.sleep(a.poll_s)
        featurize_gen_dir(target, gen_dir, out_dir)
    featurize_gen_dir(target, gen_dir, out_dir)  # whatever the generator finished last
    if a.num_pairs:
        write_shards(target, pair_rows(tok, a.num_pairs), out_dir, "pair", a.shard_size)


if __name__ == "__main__":
    main()
