"""Turn (prompt, response) token rows into training shards: target features + target argmax labels.

Two sources: the target's own generations (``datagen`` shards) and reference responses of train
sets, teacher-forced through the target (``load_train_pairs``). For every position ``t`` a shard
stores the target's tapped features and ``labels[t]`` = the target's argmax next token given
``ids[: t + 1]`` -- the token greedy decoding would emit there. Shards are resumable.
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="featurize drafter training data (resumable)")
    ap.add_argument("--target", default=None)
    ap.add_argument("--gen-dir", default="data/gen")
    ap.add_argument("--out-dir", default="data/feats")
    ap.add_argument("--num-pairs", type=int, default=6000)
    ap.add_argument("--shard-size", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from services.models.registry import resolve_target
    from services.verifier.target import TargetModel

    path = resolve_target(a.target)
    tok = AutoTokenizer.from_pretrained(path)
    target = TargetModel.from_pretrained(path, dtype=getattr(torch, a.dtype))
    gen = [r for p in sorted(Path(a.gen_dir).glob("shard_*.pt")) for r in torch.load(p)]
    write_shards(target, gen, Path(a.out_dir), "gen", a.shard_size)
    write_shards(target, pair_rows(tok, a.num_pairs), Path(a.out_dir), "pair", a.shard_size)


if __name__ == "__main__":
    main()
