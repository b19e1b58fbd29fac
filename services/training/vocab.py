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

from services.runtime import error_line


def count_tokens(gen_dir: Path, vocab_size: int) -> tuple[torch.Tensor, int]:
    """``(counts [vocab_size] int64, shards read)``: occurrences of each id in the response tokens.

    Raises:
        FileNotFoundError: no ``shard_*.pt`` in ``gen_dir``.
        ValueError: a token id outside ``[0, vocab_size)``, or a shard that is not a readable list of
            datagen rows (one line naming it).
    """
    paths = sorted(Path(gen_dir).glob("shard_*.pt"))
    if not paths:
        raise FileNotFoundError(f"no datagen shards (shard_*.pt) in {gen_dir}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for p in paths:
        try:
            rows = torch.load(p)
        except Exception as exc:  # noqa: BLE001 - any unreadable shard is one error line
            why = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            raise ValueError(f"{p} is not a readable datagen shard ({why})") from None
        if not (isinstance(rows, list) and all(isinstance(r, dict) and "response_ids" in r for r in rows)):
            raise ValueError(f"{p} is not a datagen shard (no list of rows with 'response_ids')")
        for r in rows:
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
    try:
        _run(a)
    except (ValueError, RuntimeError, OSError) as exc:  # bad input: one line, not a traceback
        ap.exit(2, f"vocab: error: {error_line(exc)}\n")


def _run(a) -> None:
    """Check the flags and paths (before counting anything), count, save, print the coverage."""
    for flag, value, least in (("--vocab-size", a.vocab_size, 1), ("--ref-pairs", a.ref_pairs, 0)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least} (got {value})")
    gen, out_path = Path(a.gen_dir), Path(a.out)
    if not gen.is_dir():
        raise ValueError(f"--gen-dir {gen} is not a directory (datagen's --out-dir)")
    if out_path.is_dir():
        raise ValueError(f"--out {out_path} is a directory (give a file name, e.g. data/vocab_counts.pt)")
    if not out_path.parent.is_dir():
        raise ValueError(f"--out {out_path}: directory {out_path.parent} does not exist")
    tok = None
    if a.ref_pairs:
        from transformers import AutoTokenizer

        from services.models.registry import resolve_target

        tok = AutoTokenizer.from_pretrained(str(resolve_target(a.target)))
    counts, n = count_tokens(gen, a.vocab_size)
    out = {"counts": counts, "shards": n, "gen_dir": str(a.gen_dir)}
    if tok is not None:
        out["secondary"] = reference_counts(tok, a.ref_pairs, a.vocab_size)
        print(f"[vocab] secondary ranking: {int(out['secondary'].sum())} reference-response tokens of "
              f"{a.ref_pairs} train pairs", flush=True)
    torch.save(out, a.out)
    cov = coverage(counts, [1024, 4096, 8192, 16384, 32768])
    print(f"[vocab] {int(counts.sum())} response tokens from {n} shards, {int((counts > 0).sum())} distinct ids; "
          + ", ".join(f"top-{k}: {v:.4f}" for k, v in cov.items()), flush=True)


if __name__ == "__main__":
    main()
