"""``dartree train-drafter``: --schedule-steps with exact resume, and --init-from an exported drafter."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file

from services.training.train import Schedule, build_args, run


def _args(tdir, feats, work, out, *extra):
    ap = argparse.ArgumentParser()
    build_args(ap)
    return ap.parse_args(["--target", str(tdir), "--feat-dir", str(feats), "--work-dir", str(work), "--out", str(out),
                          "--layers", "1", "--gru-hidden-dim", "8", "--emb-dim", "8", "--anchors", "4",
                          "--warmup", "2", "--eval-every", "0", "--log-every", "1", "--threads", "1",
                          "--heldout", "2", "--replay-prompts", "0", *map(str, extra)])


def _log(work):
    return [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]


def test_schedule_is_a_function_of_step_only():
    s = Schedule(lr=1e-3, warmup=10, steps=100, lambda_start=0.8, lambda_end=0.2)
    assert s.lr_at(0) == pytest.approx(1e-4) and s.lr_at(9) == pytest.approx(1e-3)
    assert s.lr_at(100) == pytest.approx(1e-4) and s.lr_at(500) == pytest.approx(1e-4)
    assert s.lambda_at(0) == 0.8 and s.lambda_at(50) == pytest.approx(0.5) and s.lambda_at(1000) == pytest.approx(0.2)


def test_interrupted_and_resumed_run_equals_uninterrupted(tiny_training, tmp_path):
    tdir, feats = tiny_training
    a_work, b_work = tmp_path / "a", tmp_path / "b"
    run(_args(tdir, feats, a_work, tmp_path / "a_out", "--max-steps", 8, "--schedule-steps", 20))
    run(_args(tdir, feats, b_work, tmp_path / "b_out", "--max-steps", 3, "--schedule-steps", 20))
    run(_args(tdir, feats, b_work, tmp_path / "b_out", "--max-steps", 8, "--resume"))  # schedule from ckpt.pt
    la, lb = _log(a_work), _log(b_work)
    assert [r["step"] for r in la] == [r["step"] for r in lb] == list(range(1, 9))
    assert [(r["lr"], r["lambda"]) for r in la] == [(r["lr"], r["lambda"]) for r in lb]
    s = Schedule(1e-3, 2, 20, 0.8, 0.2)
    assert [r["lr"] for r in la] == [s.lr_at(i) for i in range(8)]
    # same data order and anchors too: the losses and final weights agree
    assert [r["loss"] for r in la] == pytest.approx([r["loss"] for r in lb], rel=1e-4)
    wa, wb = torch.load(a_work / "ckpt.pt", weights_only=False), torch.load(b_work / "ckpt.pt", weights_only=False)
    assert wa["step"] == wb["step"] == 8 and wa["data"] == wb["data"]
    for k in wa["model"]:
        torch.testing.assert_close(wa["model"][k], wb["model"][k], rtol=1e-4, atol=1e-6)
    cfg = json.loads((tmp_path / "b_out" / "config.json").read_text())["training"]
    assert cfg["steps"] == 8 and cfg["schedule_steps"] == 20 and cfg["cpu_minutes"] >= 0


def test_resume_refuses_a_different_schedule(tiny_training, tmp_path):
    tdir, feats = tiny_training
    run(_args(tdir, feats, tmp_path / "w", tmp_path / "o", "--max-steps", 2, "--schedule-steps", 10))
    with pytest.raises(ValueError, match="schedule-steps"):
        run(_args(tdir, feats, tmp_path / "w", tmp_path / "o", "--max-steps", 4, "--schedule-steps", 12, "--resume"))


def test_init_from_export_warm_starts_weights(tiny_training, tmp_path):
    tdir, feats = tiny_training
    run(_args(tdir, feats, tmp_path / "a", tmp_path / "a_out", "--max-steps", 3, "--layers", 2))
    # a new machine: no ckpt.pt in the new work dir; --layers is taken from the export, not the flag
    run(_args(tdir, feats, tmp_path / "b", tmp_path / "b_out", "--max-steps", 0, "--resume",
              "--init-from", tmp_path / "a_out"))
    sa, sb = load_file(str(tmp_path / "a_out" / "model.safetensors")), load_file(str(tmp_path / "b_out" / "model.safetensors"))
    assert sa.keys() == sb.keys() and any(k.startswith("layers.1.") for k in sa)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    cfg = json.loads((tmp_path / "b_out" / "config.json").read_text())["training"]
    assert cfg["init_from"] == str(tmp_path / "a_out") and cfg["init_training"]["steps"] == 3
