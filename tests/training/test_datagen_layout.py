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
                                        (["--num-prompts", "0"], "--num-prompts must be >= 1 (got 0)"),
                                        (["--backend", "hf", "--dtype", "nosuch"], "not a torch dtype"),
                                        (["--backend", "hf", "--dtype", "bool"],
                                         "--dtype 'bool': the hf backend generates in float32, bfloat16 or float16"),
                                        (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be >= 1"),
                                        (["--sampled-every", "0"], "--sampled-every must be >= 1"),
                                        (["--sampled-every", "-1"], "--sampled-every must be >= 1 (got -1)"),
                                        (["--threads", "-2"], "--threads must be >= 0"),
                                        (["--batch-size", "0"], "--batch-size must be >= 1"),
                                        (["--in-flight", "-1"], "--in-flight must be >= 0"),
                                        (["--part", "2/2"], "--part K/N needs 0 <= K < N"),
                                        (["--part", "half"], "--part must be K/N"),
                                        (["--target", "/nonexistent/model"], "/nonexistent/model")])
def test_bad_flags_are_one_line_errors_before_anything_is_written(tmp_path, capsys, flags, msg):
    from services.training.datagen import main

    with pytest.raises(SystemExit) as exc:
        main(flags + ["--out-dir", str(tmp_path / "gen")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "gen").exists()


def test_an_out_dir_that_is_a_file_is_one_line_before_loading(tmp_path, capsys):
    from services.training.datagen import main

    out = tmp_path / "gen"
    out.write_text("x")
    with pytest.raises(SystemExit) as exc:  # (an unknown target: the check must come first)
        main(["--out-dir", str(out), "--target", str(tmp_path / "no-target")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--out-dir {out} is a file" in err and len(err.strip().splitlines()) == 1
    assert out.read_text() == "x"


def test_a_drafter_directory_as_target_is_one_line_before_loading(tmp_path, capsys):
    import json

    from services.training.datagen import main

    drafter = tmp_path / "drafter"
    drafter.mkdir()  # a DFlash drafter's config.json (no tokenizer, no causal LM)
    (drafter / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                                                     "block_size": 16, "dflash_config": {}}))
    with pytest.raises(SystemExit) as exc:
        main(["--out-dir", str(tmp_path / "gen"), "--target", str(drafter)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"target {drafter} is not a causal LM" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "gen").exists()


def test_backend_recorded_then_enforced(tmp_path):
    from services.training.datagen import check_backend

    check_backend(tmp_path, "engine:bfloat16")
    check_backend(tmp_path, "engine:bfloat16")  # same policy: fine
    with pytest.raises(ValueError, match="'engine:bfloat16', this run would add 'engine:float32'"):
        check_backend(tmp_path, "engine:float32")


def test_backend_of_an_older_directory_comes_from_its_shards(tmp_path):
    import json

    import torch

    from services.training.datagen import check_backend, check_layout

    check_layout(tmp_path, _a())  # a datagen.json without "backend", as written before it was recorded
    torch.save([{"uid": "x", "prompt_ids": [1], "response_ids": [2], "sampled": False, "backend": "hf:bfloat16"}],
               tmp_path / "shard_00003.pt")
    with pytest.raises(ValueError, match="hf:bfloat16"):
        check_backend(tmp_path, "engine:bfloat16")
    check_backend(tmp_path, "hf:bfloat16")
    assert json.loads((tmp_path / "datagen.json").read_text())["backend"] == "hf:bfloat16"
    check_layout(tmp_path, _a())  # the layout check ignores the extra key


def test_resume_with_another_weight_format_is_one_line_before_generating(tmp_path, capsys):
    import json

    from services.training.datagen import main

    out = tmp_path / "gen"
    out.mkdir()
    (out / "datagen.json").write_text(json.dumps(dict(num_prompts=4, batch_size=2, max_prompt_tokens=384,
                                                      max_new_tokens=8, sampled_every=5, backend="engine:q4")))
    with pytest.raises(SystemExit) as exc:
        main(["--out-dir", str(out), "--num-prompts", "4", "--batch-size", "2", "--max-new-tokens", "8",
              "--weights", "float32"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "'engine:q4'" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not list(out.glob("shard_*.pt"))


@pytest.mark.parametrize("content, msg", [(b"", "cannot be read"), (b"[]", "is not a JSON object"),
                                          (b"null", "is not a JSON object"), (b"{oops", "cannot be read")])
def test_a_damaged_datagen_json_is_one_error_naming_it(tmp_path, content, msg):
    from services.training.datagen import check_backend

    (tmp_path / "datagen.json").write_bytes(content)
    for check in (lambda: check_layout(tmp_path, _a()), lambda: check_backend(tmp_path, "engine:float32")):
        with pytest.raises(ValueError, match=msg) as exc:
            check()
        assert "datagen.json" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("content", [b"", b"not a torch file", "tensor"])
def test_a_damaged_first_shard_is_one_error_naming_it(tmp_path, content):
    import torch

    from services.training.datagen import check_backend

    shard = tmp_path / "shard_00000.pt"
    if content == "tensor":
        torch.save(torch.zeros(3, 3), shard)
    else:
        shard.write_bytes(content)
    with pytest.raises(ValueError, match="shard_00000.pt is not a readable datagen shard") as exc:
        check_backend(tmp_path, "engine:float32")
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "datagen.json").exists()


def test_a_refused_resume_writes_nothing(tmp_path, capsys):
    """A directory with shards but no datagen.json: the refusal must not create one with its own flags."""
    import torch

    from services.training.datagen import main

    out = tmp_path / "gen"
    out.mkdir()
    torch.save([{"uid": "x", "prompt_ids": [1], "response_ids": [2], "sampled": False, "backend": "engine:q4"}],
               out / "shard_00000.pt")
    with pytest.raises(SystemExit) as exc:
        main(["--out-dir", str(out), "--num-prompts", "4", "--batch-size", "2", "--weights", "float32"])
    assert exc.value.code == 2 and "'engine:q4'" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["shard_00000.pt"]


def test_fewer_usable_prompts_than_asked_are_reported(tmp_path, capsys, monkeypatch):
    """When the train sources yield fewer prompts than --num-prompts, datagen says so (it used to report
    the smaller count without comment)."""
    import torch

    from services.datasets import Prompt
    from services.training import datagen

    monkeypatch.setattr(datagen, "load_train", lambda n: [Prompt(f"train-x/{i}", ["hi"]) for i in range(n - 1)])
    out = tmp_path / "gen"
    out.mkdir()
    torch.save([{"uid": "x", "prompt_ids": [1], "response_ids": [2], "sampled": False, "backend": "engine:q4"}],
               out / "shard_00000.pt")  # a refused resume: the check runs, nothing is generated
    with pytest.raises(SystemExit):
        datagen.main(["--out-dir", str(out), "--num-prompts", "5", "--batch-size", "2", "--weights", "float32"])
    assert "4 of the 5 prompts asked for are usable" in capsys.readouterr().out


def test_a_whole_run_then_a_resume_on_a_tiny_target(tmp_path, capsys, monkeypatch):
    """main end to end on a tiny byte-level target: ``--part 1/2`` writes its share of the shards, a run
    of every part adds the rest and keeps that one; every prompt's response is there once; each run
    ends with a summary line (shards, new tokens); a run with nothing left to do says so."""
    import torch

    from services.datasets import Prompt
    from services.training import datagen
    from tests.service.tiny import make_tiny_models

    target_dir, _ = make_tiny_models(tmp_path / "models")
    monkeypatch.setattr(datagen, "load_train", lambda n: [Prompt(f"train-x/{i}", [f"prompt number {i}"], chat=False)
                                                          for i in range(n)])
    out = tmp_path / "gen"
    flags = ["--target", str(target_dir), "--out-dir", str(out), "--num-prompts", "5", "--batch-size", "2",
             "--max-new-tokens", "6", "--weights", "float32", "--threads", "1"]
    datagen.main(flags + ["--part", "1/2"])  # the odd positions of the shard order: one of the three
    [first] = [p.name for p in out.glob("shard_*.pt")]
    first_bytes = (out / first).read_bytes()
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(f"nothing left to generate in part 1/2: 1 shard in {out}")
    datagen.main(flags)  # the rest: 0/1 = every shard, the one already there is kept
    shards = sorted(p.name for p in out.glob("shard_*.pt"))
    assert shards == ["shard_00000.pt", "shard_00001.pt", "shard_00002.pt"]
    rows = [r for s in shards for r in torch.load(out / s)]
    assert sorted(r["uid"] for r in rows) == [f"train-x/{i}" for i in range(5)]
    assert all(1 <= len(r["response_ids"]) <= 6 for r in rows)
    assert (out / first).read_bytes() == first_bytes
    last = capsys.readouterr().out.strip().splitlines()[-1]
    n_rest = sum(len(r["response_ids"]) for s in shards if s != first for r in torch.load(out / s))
    assert last.startswith(f"[datagen] done: 2 shards, {n_rest} new tokens in ") and last.endswith(f"nothing left to generate: 3 shards in {out}")
    datagen.main(flags)
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"[datagen] done: nothing left to generate: 3 shards in {out}"


def test_the_start_line_counts_shards_in_words_and_never_more_prompts_per_shard_than_there_are(
        tmp_path, capsys, monkeypatch):
    """2 prompts with --batch-size 24: "1 shard of 2" (it said "1 shards of 24")."""
    from services.datasets import Prompt
    from services.training import datagen
    from tests.service.tiny import make_tiny_models

    target_dir, _ = make_tiny_models(tmp_path / "models")
    monkeypatch.setattr(datagen, "load_train", lambda n: [Prompt(f"train-x/{i}", [f"prompt {i}"], chat=False)
                                                          for i in range(n)])
    datagen.main(["--target", str(target_dir), "--out-dir", str(tmp_path / "gen"), "--num-prompts", "2",
                  "--max-new-tokens", "2", "--weights", "float32", "--threads", "1"])
    assert "[datagen] 2 prompts, 1 shard of 2, 1 to generate" in capsys.readouterr().out
