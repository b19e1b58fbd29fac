"""``dartree train-drafter``: bad input is one line before anything is loaded or written; the default
``--out`` is ``<work-dir>/export`` (never a shipped model); a rerun without ``--resume`` keeps ``ckpt.pt``."""

from __future__ import annotations

import json

import pytest

from services.cli import main as cli_main


def _flags(tdir, feats, work, *extra):
    return ["train-drafter", "--target", str(tdir), "--feat-dir", str(feats), "--work-dir", str(work),
            "--layers", "1", "--gru-hidden-dim", "8", "--emb-dim", "8", "--anchors", "4", "--warmup", "2",
            "--eval-every", "0", "--log-every", "1", "--threads", "1", "--heldout", "2", "--replay-prompts", "0",
            *map(str, extra)]


def _one_line_error(capsys, rc, *needles):
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


def _snapshot(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()} if d.exists() else None


@pytest.mark.parametrize("flags, msg", [(["--max-steps", "-5"], "--max-steps must be >= 0 (got -5)"),
                                        (["--schedule-steps", "0"], "--schedule-steps must be >= 1"),
                                        (["--max-minutes", "-1"], "--max-minutes must be >= 0"),
                                        (["--eval-every", "-1"], "--eval-every must be >= 0"),
                                        (["--lr", "0"], "--lr must be > 0"), (["--lr=-0.001"], "--lr must be > 0"),
                                        (["--threads", "-1"], "--threads must be >= 0"),
                                        (["--anchors", "0"], "--anchors must be >= 1 (got 0)"),
                                        (["--block-size", "0"], "--block-size must be >= 2"),
                                        (["--block-size", "1"], "--block-size must be >= 2")])
def test_bad_numbers_are_one_line_before_anything_is_written(tmp_path, capsys, flags, msg):
    work = tmp_path / "w"
    rc = cli_main(_flags(tmp_path / "no-target", tmp_path / "no-feats", work, *flags))
    _one_line_error(capsys, rc, msg)
    assert not work.exists()


def test_default_out_is_the_work_dirs_export_not_a_shipped_model(tiny_training, tmp_path, capsys):
    from services.cli import build_parser, command_parser

    sub = command_parser(build_parser(), "train-drafter")
    out = next(a for a in sub._actions if a.dest == "out")
    assert out.default is None and "<work-dir>/export" in out.help
    tdir, feats = tiny_training
    work = tmp_path / "w"
    assert cli_main(_flags(tdir, feats, work, "--max-steps", 0)) == 0
    assert (work / "export" / "model.safetensors").is_file()
    assert json.loads((work / "config.json").read_text())["args"]["out"] == str(work / "export")


def test_rerun_without_resume_is_refused_and_keeps_every_file(tiny_training, tmp_path, capsys):
    tdir, feats = tiny_training
    work = tmp_path / "w"
    assert cli_main(_flags(tdir, feats, work, "--max-steps", 1)) == 0
    before = _snapshot(work)
    assert "ckpt.pt" in before and "config.json" in before
    capsys.readouterr()
    rc = cli_main(_flags(tdir, feats, work, "--max-steps", 2))
    _one_line_error(capsys, rc, f"{work / 'ckpt.pt'} exists (step 1): pass --resume to continue it")
    assert _snapshot(work) == before


def test_config_json_is_not_written_before_the_feature_dir_check(tiny_training, tmp_path, capsys):
    tdir, _ = tiny_training
    work = tmp_path / "w"
    rc = cli_main(_flags(tdir, tmp_path / "nofeats", work, "--max-steps", 1))
    _one_line_error(capsys, rc, "no training shards in")
    assert not work.exists()


def test_block_size_is_honoured_fresh_and_refused_when_the_checkpoint_or_export_has_another(
        tiny_training, tmp_path, capsys):
    tdir, feats = tiny_training
    work = tmp_path / "w"
    assert cli_main(_flags(tdir, feats, work, "--max-steps", 1, "--block-size", 6)) == 0
    assert json.loads((work / "export" / "config.json").read_text())["block_size"] == 6
    before = _snapshot(work)
    capsys.readouterr()
    rc = cli_main(_flags(tdir, feats, work, "--max-steps", 2, "--resume", "--block-size", 8))
    _one_line_error(capsys, rc, "--block-size 8 but", "block 6")
    assert _snapshot(work) == before
    rc = cli_main(_flags(tdir, feats, tmp_path / "w2", "--max-steps", 1, "--block-size", 8,
                         "--init-from", work / "export"))
    _one_line_error(capsys, rc, "--block-size 8 but --init-from", "has block 6")
    assert not (tmp_path / "w2").exists()


@pytest.mark.parametrize("case", ["work-dir-file", "out-file", "init-from-file", "init-from-empty-dir",
                                  "empty-ckpt", "garbage-ckpt", "vocab-counts-garbage", "vocab-counts-json",
                                  "replay-file-bad-json"])
def test_bad_paths_and_files_are_one_line_naming_the_file(tiny_training, tmp_path, capsys, case):
    tdir, feats = tiny_training
    work = tmp_path / "w"
    extra: list = ["--max-steps", 1]
    if case == "work-dir-file":
        work.write_text("x")
        named = str(work)
    elif case == "out-file":
        named = tmp_path / "out"
        named.write_text("x")
        extra += ["--out", named]
    elif case.startswith("init-from"):
        named = tmp_path / "init"
        named.mkdir() if case == "init-from-empty-dir" else named.write_text("x")
        extra += ["--init-from", named]
    elif case.endswith("ckpt"):
        work.mkdir()
        named = work / "ckpt.pt"
        named.write_bytes(b"" if case == "empty-ckpt" else b"1234 not a checkpoint\n")
        extra += ["--resume"]
    elif case.startswith("vocab-counts"):
        named = tmp_path / "counts.pt"
        named.write_bytes(b"garbage\x00\x01" if case == "vocab-counts-garbage" else b'{"counts": [1, 2]}')
        extra += ["--draft-vocab", 8, "--vocab-counts", named]
    else:
        named = tmp_path / "prompts.json"
        named.write_text("[[1, 2, 3], oops")
        extra += ["--replay-prompt-file", named]
    before = _snapshot(work) if work.is_dir() else None
    rc = cli_main(_flags(tdir, feats, work, *extra))
    _one_line_error(capsys, rc, str(named))
    if case != "work-dir-file":
        assert (_snapshot(work) if work.is_dir() else None) == before


def test_python_m_entry_point_is_one_line_too(tmp_path, capsys):
    from services.training.train import main

    with pytest.raises(SystemExit) as exc:
        main(["--anchors", "0", "--work-dir", str(tmp_path / "w")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == "train-drafter: error: --anchors must be >= 1 (got 0)"
    assert not (tmp_path / "w").exists()

