"""Frequency-ranked draft vocabulary (FR-Spec / EAGLE-3 style) from the token counts of the training data.

``python -m services.training.vocab --gen-dir data/gen --out data/vocab_counts.pt`` counts the
response tokens of the ``datagen`` shards (the target's own outputs: what the drafter must draft)
and prints the coverage of the top-N ids; ``dartree train-drafter --draft-vocab N --vocab-counts
data/vocab_counts.pt`` then drafts over the N most frequent ids (draft id 0 = the most frequent).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def count_tokens(gen_dir: Path, vocab_size: int) -> tuple[torch.Tensor, int]:
    """``(counts [vocab_size] int64, shards read)``: occurrences of each id in the response tokens.

    Raises:
        FileNotFoundError: no ``shard_*.pt`` in ``gen_dir``.
        ValueError: a token id outside ``[0, vocab_size)``.
    """
    paths = sorted(Path(gen_dir).glob("shard_*.pt"))
    if not paths:
        raise FileNotFoundError(f"no datagen shards (shard_*.pt) in {gen_dir}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for p in paths:
        for r in torch.load(p):
            ids = torch.as_tensor(r["response_ids"], dtype=torch.long)
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                raise ValueError(f"{p}: token id outside [0, {vocab_size})")
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts, len(paths)


def reference_counts(tok, n_pairs: int, vocab_size: int) -> torch.Tensor:
    """Token counts ``[vocab_size]`` of the reference responses of ``n_pairs`` train pairs
    (:func:`services.datasets.load_train_pairs`: ShareGPT answers, GSM8K / MATH solutions, stdlib code).

    A broad secondary ranking for the ids the target's own outputs (still few) have not shown yet.
    """
    from services.datasets import load_train_pairs

    counts = torch.zeros(vocab_size, dtype=torch.long)
    for _, resp in load_train_pairs(n_pairs):
        counts += torch.bincount(torch.tensor(tok.encode(resp, add_special_tokens=False), dtype=torch.long),
                                 minlength=vocab_size)[:vocab_size]
    return counts


def top_ids(counts: torch.Tensor, n: int, always: tuple[int, ...] = (), secondary: torch.Tensor | None = None
            ) -> torch.Tensor:
    """The ``n`` most frequent ids ``[n]`` int64, most frequent first (ties: higher ``secondary`` count
    first, then lower id).

    ``always`` ids (e.g. the EOS token) are included even when rare; they take the last slots.

    Raises:
        ValueError: ``n`` out of ``[len(always), vocab_size]``.
    """
    v = counts.numel()
    if not len(set(always)) <= n <= v:
        raise ValueError(f"draft vocabulary size must be in [{len(set(always))}, {v}] (got {n})")
    sec = secondary if secondary is not None else torch.zeros_like(counts)
    c, s2 = counts.tolist(), sec.tolist()
    order = sorted(range(v), key=lambda i: (-c[i], -s2[i], i))
    forced = [i for i in dict.fromkeys(always)]
    keep = [i for i in order if i not in set(forced)][: n - len(forced)]
    return torch.tensor(keep + forced, dtype=torch.long)


def coverage(counts: torch.Tensor, sizes: list[int]) -> dict[int, float]:
    """Fraction of all counted tokens covered by the top-N ids, per N."""
    s = counts.sort(descending=True).values.cumsum(0).double()
    total = float(s[-1]) or 1.0
    return {n: float(s[min(n, s.numel()) - 1]) / total for n in sizes}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="count response tokens of datagen shards for a draft vocabulary")
    ap.add_argument("--gen-dir", default="data/gen")
    ap.add_argument("--out", default="data/vocab_counts.pt")
    ap.add_argument("--vocab-size", type=int, default=49152, help="target vocabulary size (default: SmolLM2's)")
    ap.add_argument("--ref-pairs", type=int, default=0,
                    help="also count the reference responses of N train pairs (needs --target's tokenizer) as the "
                         "tie-break ranking of ids the generated data has not shown (default: 0 = off)")
    ap.add_argument("--target", default=None, help="target whose tokenizer encodes the reference responses")
    a = ap.parse_args(argv)
    counts, n = count_tokens(Path(a.gen_dir), a.vocab_size)
    out = {"counts": counts, "shards": n, "gen_dir": str(a.gen_dir)}
    if a.ref_pairs:
        from transformers import AutoTokenizer

        from services.models.registry import resolve_target

        out["secondary"] = reference_counts(AutoTokenizer.from_pretrained(str(resolve_target(a.target))),
                                            a.ref_pairs, a.vocab_size)
        print(f"[vocab] secondary ranking: {int(out['secondary'].sum())} reference-response tokens of "
              f"{a.ref_pairs} train pairs", flush=True)
    torch.save(out, a.out)
    cov = coverage(counts, [1024, 4096, 8192, 16384, 32768])
    print(f"[vocab] {int(counts.sum())} response tokens from {n} shards, {int((counts > 0).sum())} distinct ids; "
          + ", ".join(f"top-{k}: {v:.4f}" for k, v in cov.items()), flush=True)


if __name__ == "__main__":
    main()
