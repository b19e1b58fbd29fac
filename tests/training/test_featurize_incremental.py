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


def test_watching_several_datagen_pids_featurizes_until_the_last_one_ends(tmp_path):
    """``--watch-pid A B``: featurize keeps scanning while any watched process lives (one datagen job
    per ``--part``), so a shard written while only the second job still runs is featurized too."""
    import subprocess
    import sys
    import threading
    import time

    from services.training.featurize import main
    from tests.service.tiny import make_tiny_models

    target_dir, _ = make_tiny_models(tmp_path / "models")
    gen, out = tmp_path / "gen", tmp_path / "feats"
    gen.mkdir()
    rows = [{"uid": "a/0", "prompt_ids": [1, 5, 7], "response_ids": [9, 10, 2], "sampled": False}]
    torch.save(rows, gen / "shard_00000.pt")
    short = subprocess.Popen([sys.executable, "-c", "pass"])
    short.wait()  # already ended: watching it alone would stop at once
    long = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(4)"])  # left unreaped until the end:
    # a zombie counts as ended

    def late_shard():
        time.sleep(1.5)
        torch.save([dict(rows[0], uid="b/0")], gen / "shard_00001.tmp")
        (gen / "shard_00001.tmp").rename(gen / "shard_00001.pt")

    writer = threading.Thread(target=late_shard)
    writer.start()
    try:
        main(["--target", str(target_dir), "--gen-dir", str(gen), "--out-dir", str(out), "--num-pairs", "0",
              "--dtype", "float32", "--threads", "1", "--watch-pid", str(short.pid), str(long.pid), "--poll-s", "0.3"])
    finally:
        writer.join()
        long.wait()
    assert sorted(p.name for p in out.glob("*.pt")) == ["gen_00000.pt", "gen_00001.pt"]
