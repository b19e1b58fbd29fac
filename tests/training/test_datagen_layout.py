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
