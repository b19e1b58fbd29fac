"""``benchmarks.bench_draft_vocab`` refuses bad input in one line before loading the target (issue 14)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_draft_vocab
from services.drafter.model import reduce_draft_vocab, save_drafter
from services.testing import tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """``(reduced drafter dir, counts file)``: a tiny drafter cut to 16 ids, and a counts file."""
    root = tmp_path_factory.mktemp("bdv")
    target = tiny_target("llama", vocab_size=64, hidden_size=32, num_layers=3, max_position_embeddings=128)
    save_drafter(reduce_draft_vocab(tiny_drafter(target), torch.arange(16)), root / "reduced")
    torch.save({"counts": torch.ones(64)}, root / "counts.pt")
    return root / "reduced", root / "counts.pt"


def test_reduced_drafter_cannot_be_cut_to_other_sizes(dirs):
    ddir, counts = dirs
    with pytest.raises(SystemExit, match="already drafts over 16 ids"):
        bench_draft_vocab.main(["--drafter", str(ddir), "--counts", str(counts), "--sizes", "8", "0"])


def test_missing_drafter_and_counts_are_one_line_errors(dirs, tmp_path):
    ddir, counts = dirs
    with pytest.raises(SystemExit, match="not a drafter directory"):
        bench_draft_vocab.main(["--drafter", str(tmp_path / "none"), "--counts", str(counts)])
    with pytest.raises(SystemExit, match="no token counts"):
        bench_draft_vocab.main(["--drafter", str(ddir), "--counts", str(tmp_path / "none.pt")])


def test_q4_on_a_target_without_gguf_is_one_line(dirs, tmp_path):
    """``--weights q4`` needs the target's GGUF: a tiny HF target without one exits in one line."""
    from services.testing import tiny_causal_lm

    ddir, counts = dirs
    tdir = tmp_path / "target"
    tiny_causal_lm("llama", vocab_size=64, hidden_size=32, num_layers=3, max_position_embeddings=128).save_pretrained(tdir)
    with pytest.raises(SystemExit, match="^bench_draft_vocab: weights 'q4' need the target's GGUF"):
        bench_draft_vocab.main(["--drafter", str(ddir), "--counts", str(counts), "--target", str(tdir),
                                "--weights", "q4"])
