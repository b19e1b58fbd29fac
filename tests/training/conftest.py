"""A tiny target on disk and featurized on-policy-like shards, for training tests (CPU, seconds)."""

from __future__ import annotations

import random

import pytest
import torch

V = 64


def make_tiny_training_dir(root):
    """``(target_dir, feat_dir)``: a 6-layer tiny llama and shards gen_00000 (held out) .. gen_00003."""
    from services.testing import tiny_causal_lm
    from services.training.featurize import featurize_gen_dir
    from services.verifier.target import TargetModel

    tdir, gen, feats = root / "target", root / "gen", root / "feats"
    tiny_causal_lm("llama", vocab_size=V, hidden_size=32, num_layers=6, max_position_embeddings=256).save_pretrained(tdir)
    gen.mkdir()
    rng = random.Random(0)
    for s in range(4):
        rows = [{"uid": f"s{s}/{j}", "prompt_ids": [rng.randrange(3, V) for _ in range(rng.randrange(4, 9))],
                 "response_ids": [rng.randrange(3, V) for _ in range(rng.randrange(20, 40))], "sampled": False}
                for j in range(3)]
        torch.save(rows, gen / f"shard_{s:05d}.pt")
    featurize_gen_dir(TargetModel.from_pretrained(tdir), gen, feats)
    return tdir, feats


@pytest.fixture(scope="module")
def tiny_training(tmp_path_factory):
    """``(target_dir, feat_dir)`` shared by a test module."""
    return make_tiny_training_dir(tmp_path_factory.mktemp("tinytrain"))
