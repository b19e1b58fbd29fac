"""Smoke test of ``dartree bench`` on a tiny random target (SmolLM2 tokenizer, hidden 32, 2 layers).

One GSM8K prompt and one MT-Bench prompt (two turns), 8 new tokens, T = 0, three engine methods and
the HF greedy peer, plus a two-point budget sweep: checks results.json fields, the lossless check
(no mismatch against ``ar``), the figures, and that a second run is served from the cell cache.
The serving stage is tested against a mock OpenAI completions endpoint (no server).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> tuple[Path, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.drafter.model import DFlashDrafter, DrafterConfig, save_drafter
    from services.models.registry import ModelNotFoundError, resolve_target

    try:
        src = resolve_target(None)
    except ModelNotFoundError as e:  # the SmolLM2 package is not installed
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("bench_models")
    tdir, ddir = root / "target", root / "drafter"
    tdir.mkdir()
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, tdir / name)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2, tie_word_embeddings=True, initializer_range=0.1)
    LlamaForCausalLM(cfg).save_pretrained(tdir)
    dcfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=49152, max_position_embeddings=1024,
                         block_size=4, num_target_layers=2, target_hidden_size=32, mask_token_id=16,
                         target_layer_ids=[0, 1], projector_type="domino", gru_hidden_dim=16, emb_dim=8)
    save_drafter(DFlashDrafter(dcfg), ddir)
    return tdir, ddir


def _args(argv: list[str]) -> argparse.Namespace:
    from benchmarks.bench import add_bench_args

    p = argparse.ArgumentParser()
    add_bench_args(p)
    return p.parse_args(argv)


def test_bench_smoke(tiny_models, tmp_path, capsys):
    from benchmarks.bench import bench_main

    tdir, ddir = tiny_models
    out = tmp_path / "results"
    argv = ["--target", str(tdir), "--drafter", str(ddir), "--datasets", "gsm8k", "mt-bench", "mbpp",
            "--methods", "ar", "ddtree", "dartree-pruned", "hf-generate", "--temperatures", "0",
            "--prompts-per-dataset", "1", "--max-new-tokens", "8", "--sweep-budget", "4", "8",
            "--sweep-datasets", "gsm8k", "--sweep-prompts", "1", "--warmup-tokens", "2", "--out", str(out),
            "--no-progress"]
    assert bench_main(_args(argv)) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary["mismatches"] == {"ddtree": 0, "dartree-pruned": 0, "hf-generate": 0}
    res = json.loads((out / "results.json").read_text())
    for key in ("versions", "machine", "config", "table1", "table2", "lossless", "latency", "acceptance",
                "depth_fraction", "example_trees", "sweeps", "cells", "unavailable"):
        assert key in res, key
    assert "mbpp" in res["unavailable"] and "alpaca" in res["unavailable"]
    t1 = res["table1"]["0"]
    assert t1["ar"]["gsm8k"]["speedup"] == pytest.approx(1.0)
    for m in ("ddtree", "dartree-pruned", "hf-generate"):
        for ds in ("gsm8k", "mt-bench"):
            assert t1[m][ds]["tau"] is not None and t1[m][ds]["speedup"] > 0
    mt = [r for r in res["cells"] if r["stage"] == "main" and r["dataset"] == "mt-bench"]
    assert all(r["summary"]["num_samples"] == 2 for r in mt)  # two turns
    assert res["lossless"]["dartree-pruned"]["checked"] == 3
    assert {p["knobs"]["budget"] for p in res["sweeps"]["budget"]} == {4, 8}
    assert res["lossless_sweeps"] and all(v["mismatches"] == 0 and v["checked"] == 1
                                          for v in res["lossless_sweeps"].values())
    for fig in ("fig1a_round_breakdown.png", "fig2_speedup.png", "fig4_sweep_width_budget.png",
                "fig5_acceptance.png", "fig7_depth_distribution.png", "fig8_tree_ddtree.png",
                "fig9_tree_dartree-pruned.png"):
        assert (out / fig).stat().st_size > 1000, fig
    md = (out / "results.md").read_text()
    assert "Table 1" in md and "Table 2" in md and "MBPP" in md
    # Resume: a second run measures nothing new.
    cells = sorted((out / "cells").glob("*.json"))
    mtimes = [c.stat().st_mtime_ns for c in cells]
    assert bench_main(_args(argv + ["--no-figures"])) == 0
    assert [c.stat().st_mtime_ns for c in sorted((out / "cells").glob("*.json"))] == mtimes


def test_serving_table_mock():
    import httpx

    from benchmarks.bench_serving import check_loopback, run_serving

    seen = []
    info = 'dartree_info{role="verifier",model="m",tree_schedule="1:16x12,4:8x6"} 1.0\n'

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":  # the verifier's metrics: where the bench reads the schedule
            return httpx.Response(200, text=info)
        body = json.loads(request.content)
        seen.append(body["speculative"])
        n = 4 if body["speculative"]["method"] == "ar" else 8
        return httpx.Response(200, json={"choices": [{"text": "x"}], "usage": {"completion_tokens": n}})

    res = run_serving("http://127.0.0.1:9", ["hi"], 16, 4, max_tokens=8, deadline_s=10, requests_factor=1,
                      transport=httpx.MockTransport(handler))
    assert set(res["table"]) >= {"ar", "domino", "ddtree"}
    assert res["table"]["ar"]["8"]["completed"] == 8
    assert res["table"]["ddtree"]["1"]["speedup"] > 0
    assert {"method": "dartree-pruned", "budget": 16, "width": 4} in seen
    assert {"method": "dartree-pruned"} in seen  # the server-B/W row sends neither knob
    assert res["server_tree_schedule"] == "1:16x12,4:8x6"
    assert "dartree-pruned (server B/W schedule 1:16x12,4:8x6)" in res["table"]
    assert "--tree-schedule 1:16x12,4:8x6 picks B/W per round" in res["note"]
    with pytest.raises(ValueError):
        check_loopback("http://example.com:8000")


def test_serving_schedule_row_is_labelled_by_what_the_verifier_reports():
    import httpx

    from benchmarks.bench_serving import read_server_schedule, serving_methods

    def metrics(text: str | None):
        return httpx.MockTransport(lambda r: httpx.Response(200, text=text) if text is not None
                                   else httpx.Response(404))

    url = "http://127.0.0.1:8001/metrics"
    assert read_server_schedule(url, metrics('dartree_info{role="verifier",tree_schedule=""} 1.0\n')) == ""
    assert read_server_schedule(url, metrics('dartree_info{role="gateway"} 1.0\n')) is None
    assert read_server_schedule(url, metrics(None)) is None
    assert read_server_schedule("http://127.0.0.1:9/metrics") is None  # nothing listens on port 9
    assert read_server_schedule("http://example.com/metrics", metrics("")) is None  # not loopback: not read
    assert serving_methods(16, 4, "")[-1][0] == "dartree-pruned (server default B/W, no schedule)"
    assert serving_methods(16, 4, None)[-1][0] == "dartree-pruned (server B/W, schedule unknown)"


def test_cell_resume_skips_finished_prompts():
    from benchmarks.bench_run import CellStats, run_cell
    from services.datasets import Prompt

    class Tok:
        def encode(self, text):
            return [ord(c) % 50 for c in text]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(65 + i % 26) for i in ids)

    calls = []

    def runner(ids, max_tokens, seed, stats, keep):
        calls.append(seed)
        stats.add_round(1, {"total": 0.01, "verify": 0.005})
        return {"tokens": [1, 2, 3], "finish": "length", "ttft_s": 0.1, "decode_s": 0.02, "rounds": 1, "tau": 2.0,
                "taus_sum": 2}

    prompts = [Prompt(f"x/{i}", ["abc", "de"] if i == 1 else ["abc"], chat=False) for i in range(3)]
    saved = []
    run_cell(runner, Tok(), prompts[:2], 8, 100, 0, checkpoint=lambda st: saved.append(st.to_json()))
    assert len(calls) == 3 and len(saved) == 2  # prompt 1 has two turns
    resumed = CellStats.from_json(json.loads(json.dumps(saved[-1])))
    full = run_cell(runner, Tok(), prompts, 8, 100, 0, stats=resumed)
    assert len(calls) == 4  # only x/2 ran
    assert [s["uid"] for s in full.samples] == ["x/0", "x/1", "x/1", "x/2"]
    assert full.phase["total"][0] == 4 and full.accept_hist[1] == 4


def test_lossless_check_reports_first_difference():
    from benchmarks.bench_stats import lossless_check, slim_cell

    def cell(tokens):
        return {"samples": [{"uid": "a/0", "turn": 0, "num_tokens": len(tokens), "token_ids": tokens}]}

    full = {("ar", "d"): cell([1, 2, 3, 4]), ("m", "d"): cell([1, 2, 9, 4]), ("ok", "d"): cell([1, 2, 3, 4])}
    slim = {k: slim_cell(v) for k, v in full.items()}
    back = {id(slim[k]): full[k] for k in full}
    res = lossless_check(slim, ["ar", "m", "ok"], lambda c, uid, turn: back[id(c)]["samples"][0]["token_ids"])
    assert res["ok"] == {"checked": 1, "mismatches": 0, "examples": []}
    assert res["m"]["mismatches"] == 1 and res["m"]["examples"][0]["first_diff"] == 2


def test_bench_tau_replay_and_max_turns(tiny_models, tmp_path, capsys):
    """--tau-replay: T=0 drafting cells are replayed (tau only, no speedup, not in the lossless check);
    --max-turns 1 keeps MT-Bench first turns only."""
    from benchmarks.bench import bench_main

    tdir, ddir = tiny_models
    out = tmp_path / "results"
    argv = ["--target", str(tdir), "--drafter", str(ddir), "--datasets", "gsm8k", "mt-bench",
            "--methods", "ar", "ddtree", "dartree-pruned", "--temperatures", "0", "--prompts-per-dataset", "1",
            "--max-new-tokens", "8", "--warmup-tokens", "0", "--tau-replay", "--max-turns", "1", "--out", str(out),
            "--no-progress"]
    assert bench_main(_args(argv)) == 0
    res = json.loads((out / "results.json").read_text())
    main = {(r["method"], r["dataset"]): r for r in res["cells"] if r["stage"] == "main"}
    assert main[("ar", "mt-bench")]["summary"]["num_samples"] == 1
    for m in ("ddtree", "dartree-pruned"):
        for ds in ("gsm8k", "mt-bench"):
            r = main[(m, ds)]
            assert r["replay"] and r["summary"]["tau"] >= 1.0 and r["summary"]["speedup"] is None
            assert r["summary"]["num_samples"] == 1
    assert not main[("ar", "gsm8k")]["replay"]
    assert res["replayed"] == ["dartree-pruned@gsm8k", "dartree-pruned@mt-bench", "ddtree@gsm8k",
                               "ddtree@mt-bench"]
    assert all(v["checked"] == 0 for v in res["lossless"].values())  # nothing verified, nothing claimed
    assert (out / "fig5_acceptance.png").stat().st_size > 1000  # figures cope with cells without timings
    assert "**τ replay**" in (out / "results.md").read_text()


def test_bench_compile_flag_reaches_the_engine_and_the_cell_key(tiny_models, tmp_path, monkeypatch):
    """``--compile`` builds the engine with compiled steps (checked at the call; the compile itself is
    covered by tests/engine/test_compile.py) and keys its cells apart from eager ones."""
    import services.generate as gen
    from benchmarks.bench import bench_main

    seen = []
    real = gen.build_inprocess

    def spy(*args, **kw):
        seen.append(kw.get("compile"))
        return real(*args, **{**kw, "compile": False})  # the tiny target need not compile here

    monkeypatch.setattr(gen, "build_inprocess", spy)
    tdir, ddir = tiny_models
    base = ["--target", str(tdir), "--drafter", str(ddir), "--datasets", "gsm8k", "--methods", "ar",
            "--temperatures", "0", "--prompts-per-dataset", "1", "--max-new-tokens", "2", "--warmup-tokens", "0",
            "--no-progress", "--no-figures", "--out"]
    assert bench_main(_args(base + [str(tmp_path / "c"), "--compile"])) == 0
    assert bench_main(_args(base + [str(tmp_path / "e")])) == 0
    assert seen == [True, False]
    res = {k: json.loads((tmp_path / k / "results.json").read_text()) for k in ("c", "e")}
    assert res["c"]["config"]["compile"] is True and res["e"]["config"]["compile"] is False
    keys = {k: {p.name for p in (tmp_path / k / "cells").glob("*.json")} for k in ("c", "e")}
    assert keys["c"] and keys["e"] and not keys["c"] & keys["e"]


def test_ar_cells_are_shared_across_drafters_and_drafting_cells_are_not(tiny_models, tmp_path):
    """Two drafters benchmarked into one --out: the second run reuses ``ar``'s cell (its greedy
    references never touch the drafter) and measures its own ``ddtree`` cell."""
    import os

    from benchmarks.bench import bench_main

    tdir, ddir = tiny_models
    other = tmp_path / "drafter2"
    shutil.copytree(ddir, other)
    for f in other.iterdir():  # another drafter to the cache: other mtimes
        os.utime(f, (1_000_000_000, 1_000_000_000))
    out = tmp_path / "results"
    base = ["--target", str(tdir), "--datasets", "gsm8k", "--methods", "ar", "ddtree", "--temperatures", "0",
            "--prompts-per-dataset", "1", "--max-new-tokens", "4", "--warmup-tokens", "0", "--tau-replay",
            "--no-progress", "--no-figures", "--out", str(out)]
    assert bench_main(_args(base + ["--drafter", str(ddir)])) == 0
    first = {p.name: p.stat().st_mtime_ns for p in (out / "cells").glob("*.json")}
    assert bench_main(_args(base + ["--drafter", str(other)])) == 0
    second = {p.name: p.stat().st_mtime_ns for p in (out / "cells").glob("*.json")}
    ar = [n for n in first if n.startswith("ar__")]
    assert len(ar) == 1 and second[ar[0]] == first[ar[0]]  # reused, not re-measured
    assert [n for n in second if n.startswith("ar__")] == ar  # and no second ar cell
    dd = sorted(n for n in second if n.startswith("ddtree"))
    assert len(dd) == 2  # one per drafter
