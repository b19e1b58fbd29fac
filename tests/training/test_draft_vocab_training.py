"""Frequency-ranked draft vocabulary: token counts CLI, top-N map, training and export with it."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from services.drafter.model import load_drafter
from services.training.train import build_args, run
from services.training.vocab import count_tokens, coverage, main as vocab_main, top_ids


def test_top_ids_rank_by_frequency_and_keep_forced_ids():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 3])
    assert top_ids(counts, 3).tolist() == [2, 3, 0]  # ties: lower id first
    assert top_ids(counts, 3, always=(5,)).tolist() == [2, 3, 5]
    assert top_ids(counts, 7).tolist()[:5] == [2, 3, 0, 6, 4]
    with pytest.raises(ValueError):
        top_ids(counts, 8)
    # ids the generated data has not shown are ranked by the secondary (reference-text) counts
    sec = torch.tensor([0, 4, 0, 0, 0, 7, 0])
    assert top_ids(counts, 7, secondary=sec).tolist() == [2, 3, 0, 6, 4, 5, 1]
    cov = coverage(counts, [1, 2, 7])
    assert cov[1] == pytest.approx(9 / 27) and cov[2] == pytest.approx(18 / 27) and cov[7] == 1.0


def test_count_tokens_reads_responses_only(tmp_path):
    torch.save([{"uid": "a", "prompt_ids": [7, 7, 7], "response_ids": [1, 2, 2], "sampled": False}],
               tmp_path / "shard_00000.pt")
    torch.save([{"uid": "b", "prompt_ids": [7], "response_ids": [2, 3], "sampled": True}], tmp_path / "shard_00004.pt")
    counts, n = count_tokens(tmp_path, 8)
    assert n == 2 and counts.tolist() == [0, 1, 3, 1, 0, 0, 0, 0]
    with pytest.raises(ValueError):
        count_tokens(tmp_path, 3)
    with pytest.raises(FileNotFoundError):
        count_tokens(tmp_path / "none", 8)


def test_train_with_reduced_draft_vocab_resumes_and_exports(tiny_training, tmp_path):
    tdir, feats = tiny_training
    gen = feats.parent / "gen"
    counts_path = tmp_path / "counts.pt"
    vocab_main(["--gen-dir", str(gen), "--out", str(counts_path), "--vocab-size", "64"])
    counts = torch.load(counts_path)["counts"]

    def args(*extra):
        ap = argparse.ArgumentParser()
        build_args(ap)
        return ap.parse_args(["--target", str(tdir), "--feat-dir", str(feats), "--work-dir", str(tmp_path / "w"),
                              "--out", str(tmp_path / "out"), "--layers", "1", "--gru-hidden-dim", "8",
                              "--emb-dim", "8", "--anchors", "4", "--warmup", "2", "--eval-every", "0",
                              "--threads", "1", "--heldout", "2", "--replay-prompts", "0", "--draft-vocab", "16",
                              "--vocab-counts", str(counts_path), *map(str, extra)])

    run(args("--max-steps", 2, "--schedule-steps", 4))
    run(args("--max-steps", 4, "--resume"))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 16 and cfg["training"]["steps"] == 4
    d = load_drafter(tmp_path / "out")
    ids = d.draft_to_target()
    assert ids.tolist() == top_ids(counts, 16, always=(2,)).tolist()  # eos id 2 of the tiny target kept
    assert d.embed_proj[2].weight.shape[0] == 16
