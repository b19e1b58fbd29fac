"""``python -m services.training.vocab`` and ``... featurize``: bad input is one line (naming the file),
checked before anything is counted, loaded or created."""

from __future__ import annotations

import pytest
import torch


def _one_line_exit(capsys, fn, argv, *needles):
    with pytest.raises(SystemExit) as exc:
        fn(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


def _gen(tmp_path):
    gen = tmp_path / "gen"
    gen.mkdir()
    torch.save([{"uid": "a", "prompt_ids": [7], "response_ids": [1, 2, 2], "sampled": False}], gen / "shard_00000.pt")
    return gen


@pytest.mark.parametrize("case", ["gen-dir-missing", "vocab-size-neg", "vocab-size-zero", "out-dir-missing",
                                  "out-is-dir", "corrupt-shard", "not-rows-shard"])
def test_vocab_bad_input_is_one_line_and_counts_nothing(tmp_path, capsys, monkeypatch, case):
    from services.training import vocab

    gen, out = _gen(tmp_path), tmp_path / "counts.pt"
    argv = ["--gen-dir", str(gen), "--out", str(out), "--vocab-size", "8"]
    needle = None
    if case == "gen-dir-missing":
        argv[1] = needle = str(tmp_path / "nonexistent")
    elif case.startswith("vocab-size"):
        argv[-1] = "-1" if case == "vocab-size-neg" else "0"
        needle = f"--vocab-size must be >= 1 (got {argv[-1]})"
    elif case == "out-dir-missing":
        argv[3] = needle = str(tmp_path / "missing" / "counts.pt")
    elif case == "out-is-dir":
        argv[3] = needle = str(tmp_path)
    elif case == "corrupt-shard":
        (gen / "shard_00001.pt").write_bytes(b"not a torch file")
        needle = str(gen / "shard_00001.pt")
    else:
        torch.save(torch.zeros(3), gen / "shard_00001.pt")
        needle = str(gen / "shard_00001.pt")
    if case in ("out-dir-missing", "out-is-dir"):  # checked up front: nothing is counted first
        monkeypatch.setattr(vocab, "count_tokens", lambda *a: pytest.fail("counted before checking --out"))
    _one_line_exit(capsys, vocab.main, argv, needle)
    assert not out.exists()


@pytest.mark.parametrize("flags, msg", [(["--watch-pid", "0"], "--watch-pid must be >= 1 (got 0)"),
                                        (["--watch-pid", "123", "-4"], "--watch-pid must be >= 1 (got -4)"),
                                        (["--threads", "-1"], "--threads must be >= 0"),
                                        (["--dtype", "foo"], "--dtype must be one of float32, bfloat16, float16"),
                                        (["--poll-s", "-1"], "--poll-s must be > 0"),
                                        (["--shard-size", "0"], "--shard-size must be >= 1"),
                                        (["--num-pairs", "-1"], "--num-pairs must be >= 0")])
def test_featurize_bad_flags_are_one_line_before_loading(tmp_path, capsys, flags, msg):
    from services.training.featurize import main

    gen, out = _gen(tmp_path), tmp_path / "feats"
    _one_line_exit(capsys, main, ["--target", str(tmp_path / "no-target"), "--gen-dir", str(gen), "--out-dir",
                                  str(out), "--num-pairs", "0", *flags], msg)
    assert not out.exists()


def test_featurize_missing_gen_dir_is_one_line_and_creates_nothing(tmp_path, capsys):
    from services.training.featurize import main

    out = tmp_path / "feats"
    _one_line_exit(capsys, main, ["--target", str(tmp_path / "no-target"), "--gen-dir", str(tmp_path / "nonexistent"),
                                  "--out-dir", str(out), "--num-pairs", "0"], f"--gen-dir {tmp_path / 'nonexistent'}")
    assert not out.exists()


def test_featurize_out_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    from services.training.featurize import main

    gen, out = _gen(tmp_path), tmp_path / "feats"
    out.write_text("x")
    _one_line_exit(capsys, main, ["--target", str(tmp_path / "no-target"), "--gen-dir", str(gen),
                                  "--out-dir", str(out), "--num-pairs", "0"], f"--out-dir {out}")
