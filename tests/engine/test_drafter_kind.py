"""The torch-free drafter-kind lookup (``services.drafter.config``, what the supervisor calls): the kind
of every shipped drafter and of valid variants, a one-line ValueError for every malformed config, and
no torch import."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from services.drafter.config import drafter_kind
from services.testing import REPO

SHIPPED = {"smollm2-135m-dartree-drafter": "domino", "smollm2-135m-dartree-drafter-v2": "domino",
           "smollm2-135m-dspark-drafter": "dspark", "smollm2-135m-eagle3-drafter": "eagle3"}


def _shipped(name: str) -> dict:
    return json.loads((REPO / "models" / name / "config.json").read_text())


def _edited(name: str, edit) -> dict:
    cfg = copy.deepcopy(_shipped(name))
    edit(cfg)
    return cfg


def _dc(**kv):
    return lambda c: c["dflash_config"].update(kv)


def _set(**kv):
    return lambda c: c.update(kv)


def _drop(key):
    return lambda c: c.pop(key)


DOMINO, DSPARK = "smollm2-135m-dartree-drafter-v2", "smollm2-135m-dspark-drafter"
CASES = {
    "domino": _shipped(DOMINO),
    "dspark": _shipped(DSPARK),
    "dflash (no projector)": _edited(DOMINO, lambda c: c["dflash_config"].pop("projector_type")),
    "causal_v5 is domino": _edited(DOMINO, _dc(projector_type="causal_v5")),
    "unknown projector": _edited(DOMINO, _dc(projector_type="bogus")),
    "markov projector without rank": _edited(DOMINO, _dc(projector_type="markov")),
    "empty": {},
    "no vocab_size": _edited(DOMINO, _drop("vocab_size")),
    "no hidden_size": _edited(DOMINO, _drop("hidden_size")),
    "heads do not divide": _edited(DOMINO, _set(num_key_value_heads=4)),
    "zero heads": _edited(DOMINO, _set(num_attention_heads=0)),
    "hidden_size a string": _edited(DOMINO, _set(hidden_size="576")),
    "draft_vocab_size 0": _edited(DOMINO, _set(draft_vocab_size=0)),
    "draft_vocab_size too big": _edited(DOMINO, _set(draft_vocab_size=10**9)),
    "draft_vocab_size reduced": _edited(DOMINO, _set(draft_vocab_size=8192)),
    "dflash_config a list": _edited(DOMINO, _set(dflash_config=[1])),
    "rope_parameters a list": _edited(DOMINO, lambda c: (c.pop("rope_theta", None), c.update(rope_parameters=[1]))),
    "emb_dim not a number": _edited(DOMINO, _dc(emb_dim="x")),
    "layer ids not a list": _edited(DOMINO, _dc(target_layer_ids=5)),
    "dspark head type": _edited(DSPARK, _set(markov_head_type="lowrank")),
    "dspark rank 0": _edited(DSPARK, _set(markov_rank=0)),
    "dspark without mask token": _edited(DSPARK, _drop("mask_token_id")),
    "dspark anchors not a number": _edited(DSPARK, _set(num_anchors="many")),
    "markov_rank makes dspark": _edited(DOMINO, _set(markov_rank=4, mask_token_id=2)),
}


VALID = {"domino": "domino", "dspark": "dspark", "dflash (no projector)": "dflash", "causal_v5 is domino": "domino",
         "draft_vocab_size reduced": "domino", "markov_rank makes dspark": "dspark"}


def _write(tmp_path, cfg: dict):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("case", sorted(VALID))
def test_a_valid_config_has_its_kind(case, tmp_path):
    assert drafter_kind(_write(tmp_path, CASES[case])) == VALID[case]


@pytest.mark.parametrize("case", sorted(set(CASES) - set(VALID)))
def test_a_malformed_config_is_one_line_value_error(case, tmp_path):
    with pytest.raises(ValueError, match="is not a drafter config") as err:
        drafter_kind(_write(tmp_path, CASES[case]))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_drafter_has_its_kind(name):
    assert drafter_kind(REPO / "models" / name) == SHIPPED[name]


def test_the_model_module_reexports_the_same_function():
    from services.drafter import model

    assert model.drafter_kind is drafter_kind


def test_the_kind_lookup_imports_no_torch():
    code = (f"import sys; from services.drafter.config import drafter_kind; "
            f"print(drafter_kind({str(REPO / 'models' / DOMINO)!r}), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         timeout=120)
    assert out.stdout.split() == ["domino", "False"]
