"""datagen refuses to resume a shard directory with flags that change which prompts a shard holds."""

import argparse

import pytest

from services.training.datagen import check_layout


def _a(**kw):
    base = dict(num_prompts=100, batch_size=24, max_prompt_tokens=384, max_new_tokens=256, sampled_every=5)
    base.update(kw)
    return argparse.Namespace(**base)


def test_layout_recorded_then_enforced(tmp_path):
    check_layout(tmp_path, _a())
    check_layout(tmp_path, _a())  # same flags: fine
    with pytest.raises(ValueError, match="num_prompts"):
        check_layout(tmp_path, _a(num_prompts=200))
    with pytest.raises(ValueError, match="batch_size"):
        check_layout(tmp_path, _a(batch_size=16))


@pytest.mark.parametrize("flags, msg", [(["--weights", "nosuch"], "weights 'nosuch' is not supported"),
                                        (["--num-prompts", "-1"], "--num-prompts must be >= 0"),
                                        (["--backend", "hf", "--dtype", "nosuch"], "not a torch dtype")])
def test_bad_flags_are_one_line_errors_before_anything_is_written(tmp_path, capsys, flags, msg):
    from services.training.datagen import main

    with pytest.raises(SystemExit) as exc:
        main(flags + ["--out-dir", str(tmp_path / "gen")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "gen").exists()
