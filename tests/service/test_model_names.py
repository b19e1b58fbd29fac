"""``--target`` / ``--drafter`` by name: local directories or hub ids resolved through
huggingface_hub's cache (here a fake one, offline), the one-line errors when a hub model is not
available, and the pairing of a target with a drafter at start (services/models/pairing.py).
"""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from services.models.pairing import resolve_pair
from services.models.registry import (DEFAULT_DRAFTER_DIR, ModelNotFoundError, cached_snapshot, is_hub_id,
                                      resolve_target)
from services.tiny_models import make_tiny_models

REV = "0123456789abcdef0123456789abcdef01234567"


def _publish(cache, repo_id: str, src) -> object:
    """Put directory ``src`` in the hub cache at ``cache`` as huggingface_hub lays a download out:
    ``models--org--name/snapshots/<commit>/`` and ``refs/main`` naming the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / REV
    shutil.copytree(src, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    return snap


@pytest.fixture
def hub(tmp_path_factory, monkeypatch):
    """``(cache, target snapshot, drafter snapshot, target dir, drafter dir)``: the tiny models in a
    fake hub cache as ``org/tiny-target`` and ``org/tiny-drafter``; offline mode on."""
    root = tmp_path_factory.mktemp("models")
    target, drafter = make_tiny_models(root)
    cache = root / "hub"
    tsnap, dsnap = _publish(cache, "org/tiny-target", target), _publish(cache, "org/tiny-drafter", drafter)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(root))
    return cache, tsnap, dsnap, target, drafter


@pytest.mark.parametrize("ref, want", [("Qwen/Qwen3-4B", True), ("org/tiny-target", True), ("./org/x", False),
                                       ("/abs/dir", False), ("~/models/x", False), ("a/b/c", False),
                                       ("name-only", False), ("org/../x", False)])
def test_what_counts_as_a_hub_id(ref, want):
    assert is_hub_id(ref) is want


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(hub):
    cache, tsnap, dsnap, *_ = hub
    assert resolve_target("org/tiny-target") == tsnap
    assert cached_snapshot("org/tiny-target") == tsnap  # the gateway's lookup (no huggingface_hub import)
    pair = resolve_pair("org/tiny-target", "org/tiny-drafter")
    assert (pair.target_dir, pair.drafter) == (tsnap, str(dsnap))


def test_a_hub_id_not_in_the_cache_offline_says_what_to_download_and_where(hub):
    cache = hub[0]
    with pytest.raises(ModelNotFoundError) as err:
        resolve_target("org/not-downloaded")
    msg = str(err.value)
    assert "\n" not in msg
    assert f"target 'org/not-downloaded' is not in the hub cache {cache} and HF_HUB_OFFLINE is set" in msg
    assert f"'hf download org/not-downloaded --cache-dir {cache}'" in msg
    with pytest.raises(ModelNotFoundError, match=r"drafter 'org/no-drafter' is not in the hub cache .*hf download"):
        resolve_pair(None, "org/no-drafter")


def test_an_unreachable_hub_says_so_and_what_to_download(hub, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(ModelNotFoundError) as err:
        resolve_target("org/not-downloaded")
    msg = str(err.value)
    assert "\n" not in msg and "the hub is unreachable (" in msg and "hf download org/not-downloaded" in msg


def test_a_local_path_that_is_not_a_model_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="target directory .* has no config.json"):
        resolve_target(str(tmp_path / "empty"))
    with pytest.raises(ModelNotFoundError, match="nor a hub id"):
        resolve_target(str(tmp_path / "a" / "b"))


def test_the_gateway_finds_the_tokenizer_of_a_hub_target(hub):
    from gateway.server import model_dir

    assert model_dir("org/tiny-target") == hub[1]


# ------------------------------------------------------------------------------------- pairing
@pytest.mark.skipif(not (DEFAULT_DRAFTER_DIR / "config.json").is_file(), reason="no shipped drafter")
def test_a_target_without_a_matching_shipped_drafter_is_refused_naming_the_flag(hub):
    target = hub[3]
    with pytest.raises(ValueError) as err:
        resolve_pair(str(target), None)
    msg = str(err.value)
    assert "\n" not in msg and "has no matching shipped drafter" in msg and "pass --drafter DIR or HUB_ID" in msg
    assert "--default-method ar" in msg and "hidden size 576" in msg
    pair = resolve_pair(str(target), None, ar_only=True)  # plain decoding needs no drafter
    assert (pair.target_dir, pair.drafter) == (target, "none") and "plain decoding" in pair.note
    with pytest.raises(ValueError, match=r"^--drafter .*: it was made for a target of hidden size 576"):
        resolve_pair(str(target), str(DEFAULT_DRAFTER_DIR))  # a given drafter must fit too
    assert resolve_pair(str(target), str(hub[4])).drafter == str(hub[4])


def _plan(*flags: str):
    from services.serve import add_serve_args
    from services.serve_plan import plan

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--weights", "float32", "--port", "18451", "--verifier-metrics-port", "18452",
                              "--drafter-metrics-port", "18453", *flags])
    sup, gateway, verifier, drafter, rt = plan(args)
    if rt is not None:
        shutil.rmtree(rt, ignore_errors=True)
    return gateway, verifier, drafter


def test_serve_plans_hub_models_and_names_them_by_id(hub, monkeypatch):
    for name in ("DARTREE_DRAFTER", "DARTREE_TARGET", "DARTREE_DEFAULT_METHOD", "DARTREE_SERVED_MODEL_NAME"):
        monkeypatch.delenv(name, raising=False)
    gateway, verifier, drafter = _plan("--target", "org/tiny-target", "--drafter", "org/tiny-drafter")
    assert gateway.served_model_name == "org/tiny-target"
    assert verifier.target == gateway.target == drafter.target == str(hub[1]) and drafter.drafter == str(hub[2])


@pytest.mark.skipif(not (DEFAULT_DRAFTER_DIR / "config.json").is_file(), reason="no shipped drafter")
def test_serve_without_a_fitting_drafter_refuses_or_serves_plain_decoding(hub, monkeypatch):
    for name in ("DARTREE_DRAFTER", "DARTREE_DEFAULT_METHOD"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="has no matching shipped drafter .*pass --drafter"):
        _plan("--target", "org/tiny-target")
    gateway, verifier, drafter = _plan("--target", "org/tiny-target", "--default-method", "ar")
    assert drafter is None and verifier.default_method == "ar" and verifier.drafter_endpoint == "none"


def test_serve_refuses_a_sliding_window_beyond_the_context_naming_the_flag(tmp_path, monkeypatch):
    from transformers import MistralConfig

    cfg = MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))  # refused before anything loads
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"sliding-window attention with a 16-token window .*pass --max-context 16"):
        _plan("--target", str(tmp_path), "--drafter", "none")


def test_generate_without_a_fitting_drafter(hub, capsys):
    """``dartree generate`` on a target the shipped drafter does not fit: a speculative method is
    refused in one line naming ``--drafter``; ``--method ar`` decodes without it."""
    from services.cli import main

    target = str(hub[3])
    if (DEFAULT_DRAFTER_DIR / "config.json").is_file():
        assert main(["generate", "hello", "--target", target, "--weights", "float32"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "pass --drafter DIR or HUB_ID" in err and "--method ar" in err
    code = main(["generate", "hello", "--target", target, "--method", "ar", "--weights", "float32",
                 "--max-tokens", "4", "--json", "--no-compile"])
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 0 and json.loads(out)["completion_tokens"] == 4


@pytest.mark.skipif(not (DEFAULT_DRAFTER_DIR / "config.json").is_file(), reason="no shipped drafter")
def test_a_drafter_worker_started_alone_refuses_a_drafter_that_does_not_fit(hub):
    """``dartree drafter`` (compose runs it without the supervisor) checks the pair itself."""
    from services.drafter.build import check_drafter_fits

    target, drafter = hub[3], hub[4]
    check_drafter_fits(drafter, target)
    with pytest.raises(ValueError, match=r"does not fit the target .*pass --drafter \(DARTREE_DRAFTER\)"):
        check_drafter_fits(DEFAULT_DRAFTER_DIR, target)
