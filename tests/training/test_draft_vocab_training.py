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

    run(_vocab_args(tdir, feats, tmp_path, counts_path, "--max-steps", 2, "--schedule-steps", 4))
    run(_vocab_args(tdir, feats, tmp_path, counts_path, "--max-steps", 4, "--resume"))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 16 and cfg["training"]["steps"] == 4
    d = load_drafter(tmp_path / "out")
    ids = d.draft_to_target()
    assert ids.tolist() == top_ids(counts, 16, always=(2,)).tolist()  # eos id 2 of the tiny target kept
    assert d.embed_proj[2].weight.shape[0] == 16


def _vocab_args(tdir, feats, tmp_path, counts_path, *extra):
    ap = argparse.ArgumentParser()
    build_args(ap)
    return ap.parse_args(["--target", str(tdir), "--feat-dir", str(feats), "--work-dir", str(tmp_path / "w"),
                          "--out", str(tmp_path / "out"), "--layers", "1", "--gru-hidden-dim", "8",
                          "--emb-dim", "8", "--anchors", "4", "--warmup", "2", "--eval-every", "0",
                          "--threads", "1", "--heldout", "2", "--replay-prompts", "0", "--draft-vocab", "16",
                          "--vocab-counts", str(counts_path), *map(str, extra)])


def _finite_export(out) -> bool:
    from safetensors.torch import load_file

    return all(bool(torch.isfinite(v.float()).all()) for v in load_file(str(out / "model.safetensors")).values())


def test_rows_whose_labels_are_all_outside_the_draft_vocabulary_are_skipped_not_nan(tiny_training, tmp_path):
    """Session 12 lost a run to them: such a row's loss is 0 / 0 and one NaN step poisons every weight."""
    import shutil

    tdir, feats = tiny_training
    counts_path = tmp_path / "counts.pt"
    vocab_main(["--gen-dir", str(feats.parent / "gen"), "--out", str(counts_path), "--vocab-size", "64"])
    kept = set(top_ids(torch.load(counts_path)["counts"], 16, always=(2,)).tolist())
    outside = next(i for i in range(3, 64) if i not in kept)
    mine = tmp_path / "feats"
    shutil.copytree(feats, mine)
    for name in ("gen_00001.pt", "gen_00002.pt"):  # every row of two of the three training shards
        rows = torch.load(mine / name)
        for r in rows:
            r["labels"] = torch.full_like(r["labels"], outside)
        torch.save(rows, mine / name)
    run(_vocab_args(tdir, mine, tmp_path, counts_path, "--max-steps", 4, "--schedule-steps", 4))
    log = [json.loads(line) for line in (tmp_path / "w" / "train_log.jsonl").read_text().splitlines()]
    assert not [e for e in log if "skipped" in e]  # never reached the loss: no anchor has a label
    assert all(e["loss"] == e["loss"] for e in log if "loss" in e)  # no NaN logged
    assert _finite_export(tmp_path / "out")


def test_a_non_finite_loss_skips_the_row_and_keeps_the_weights_finite(tiny_training, tmp_path, monkeypatch):
    from services.training import train as tr

    tdir, feats = tiny_training
    counts_path = tmp_path / "counts.pt"
    vocab_main(["--gen-dir", str(feats.parent / "gen"), "--out", str(counts_path), "--vocab-size", "64"])
    real, calls = tr.Trainer.loss, []

    def poisoned(self, row, lam, rng):
        out = real(self, row, lam, rng)
        calls.append(1)
        if out is not None and len(calls) == 2:
            return out[0] * float("nan"), out[1]
        return out

    monkeypatch.setattr(tr.Trainer, "loss", poisoned)
    run(_vocab_args(tdir, feats, tmp_path, counts_path, "--max-steps", 4, "--schedule-steps", 4, "--log-every", 1))
    log = [json.loads(line) for line in (tmp_path / "w" / "train_log.jsonl").read_text().splitlines()]
    skipped = [e for e in log if "skipped" in e]
    assert len(skipped) == 1 and skipped[0]["why"] == "non-finite loss" and "gen_0000" in skipped[0]["skipped"]
    assert [e["step"] for e in log if "loss" in e] == [1, 2, 3, 4]  # four real steps still made
    assert _finite_export(tmp_path / "out")


def test_non_finite_weights_are_never_saved_over_the_last_checkpoint(tiny_training, tmp_path, monkeypatch):
    tdir, feats = tiny_training
    counts_path = tmp_path / "counts.pt"
    vocab_main(["--gen-dir", str(feats.parent / "gen"), "--out", str(counts_path), "--vocab-size", "64"])
    run(_vocab_args(tdir, feats, tmp_path, counts_path, "--max-steps", 2, "--schedule-steps", 4))
    good = (tmp_path / "w" / "ckpt.pt").read_bytes(), (tmp_path / "out" / "model.safetensors").read_bytes()
    real = torch.nn.utils.clip_grad_norm_

    def clip_then_break_a_weight(params, max_norm):  # a finite loss and norm; the model breaks behind them
        params = list(params)
        norm = real(params, max_norm)
        with torch.no_grad():
            params[0].fill_(float("nan"))
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_then_break_a_weight)
    with pytest.raises(RuntimeError, match="non-finite weights at step 3"):
        run(_vocab_args(tdir, feats, tmp_path, counts_path, "--max-steps", 3, "--resume"))
    assert (tmp_path / "w" / "ckpt.pt").read_bytes() == good[0]
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == good[1]
