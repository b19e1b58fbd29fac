"""Featurization follows datagen shard by shard: one feature shard per generated shard, never re-chunked."""

import torch

from services.testing import tiny_target
from services.training.featurize import featurize_gen_dir


def test_gen_shards_map_one_to_one_and_resume(tmp_path):
    target = tiny_target("llama", vocab_size=64, hidden_size=32, num_layers=3, max_position_embeddings=128)
    gen, out = tmp_path / "gen", tmp_path / "feats"
    gen.mkdir()

    def shard(i, n):
        rows = [{"uid": f"u{i}/{j}", "prompt_ids": [1, 5, 7], "response_ids": [9, 10 + j, 2], "sampled": False}
                for j in range(n)]
        torch.save(rows, gen / f"shard_{i:05d}.pt")

    shard(3, 2)
    assert featurize_gen_dir(target, gen, out) == 1
    shard(0, 1)  # a shard sorting before an existing one (datagen writes shards in shuffled order)
    assert featurize_gen_dir(target, gen, out) == 1
    assert featurize_gen_dir(target, gen, out) == 0  # resumable: nothing left
    assert sorted(p.name for p in out.glob("*.pt")) == ["gen_00000.pt", "gen_00003.pt"]
    rows = torch.load(out / "gen_00003.pt")
    assert [r["uid"] for r in rows] == ["u3/0", "u3/1"]
    r = rows[1]
    assert r["ids"].tolist() == [1, 5, 7, 9, 11, 2] and r["prompt_len"] == 3
    labels, feats = target.teacher_forced(r["ids"].tolist())
    assert torch.equal(r["labels"], labels) and r["feats"].shape == feats.shape and r["feats"].dtype == torch.bfloat16
