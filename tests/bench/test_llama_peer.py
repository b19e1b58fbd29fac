"""The ``llama-cpp`` peer of ``dartree bench``: counting and timing like the HF peers, our prompt ids
fed as is, a one-line "unavailable" when llama-cpp-python is missing (never a crash), and (only
where llama-cpp-python is installed) a real greedy turn on the default target's GGUF.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks.bench_llama import (INSTALL_HINT, PeerUnavailableError, check_installed, llama_runner, llama_turn,
                                    resolve_gguf)
from benchmarks.bench_run import CellStats
from tests.bench.test_bench_smoke import _args, tiny_models  # noqa: F401  (module fixture)

EOS = 2


class FakeLlama:
    """``reset`` / ``generate`` of ``llama_cpp.Llama``, yielding a scripted continuation."""

    def __init__(self, script: list[int]):
        self.script = script
        self.resets = 0
        self.prompts: list[list[int]] = []
        self.kwargs: dict = {}
        self.pulled = 0

    def reset(self) -> None:
        self.resets += 1

    def generate(self, tokens, **kwargs):
        self.prompts.append(list(tokens))
        self.kwargs = kwargs
        for t in self.script:
            self.pulled += 1
            yield t


def test_turn_feeds_our_ids_greedy_and_cuts_at_the_terminator():
    llm = FakeLlama([5, 6, 7, EOS, 9])
    rec = llama_turn(llm, [1, 2, 3], max_tokens=10, eos_ids=(EOS,))
    assert llm.prompts == [[1, 2, 3]] and llm.resets == 1  # our ids, a fresh KV cache
    assert llm.kwargs["temp"] == 0.0 and llm.kwargs["repeat_penalty"] == 1.0
    assert rec["tokens"] == [5, 6, 7] and rec["finish"] == "stop"
    assert llm.pulled == 4  # nothing decoded past the terminator
    # 4 tokens produced (EOS included, as the engine's round that produces it is timed): 1 prefill + 3 rounds
    assert rec["rounds"] == 3 and rec["taus_sum"] == 3 and rec["tau"] == 1.0 and rec["first_chunk"] == 1
    assert rec["ttft_s"] > 0 and rec["decode_s"] >= 0 and len(rec["_chunks"]) == 3


def test_turn_stops_at_max_tokens_and_runner_records_rounds():
    llm = FakeLlama([5, 6, 7, 8, 9])
    stats = CellStats()
    rec = llama_runner(llm, (EOS,))([4, 4], 3, 0, stats, 0)
    assert rec["tokens"] == [5, 6, 7] and rec["finish"] == "length" and llm.pulled == 3
    assert "_chunks" not in rec
    assert stats.accept_hist == {0: 2} and stats.phase["total"][0] == 2  # two decode rounds, nothing accepted


def test_turn_with_an_immediate_terminator():
    rec = llama_turn(FakeLlama([EOS]), [1], 5, (EOS,))
    assert rec["tokens"] == [] and rec["finish"] == "stop" and rec["rounds"] == 0 and rec["tau"] is None


def test_missing_package_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(PeerUnavailableError) as e:
        check_installed()
    assert "not installed" in str(e.value) and INSTALL_HINT in str(e.value) and "\n" not in str(e.value)


def test_non_default_target_needs_its_own_gguf(tmp_path):
    with pytest.raises(PeerUnavailableError, match="--llama-gguf"):
        resolve_gguf(str(tmp_path), None)
    with pytest.raises(PeerUnavailableError, match="is not a file"):
        resolve_gguf(None, str(tmp_path / "nope.gguf"))


@pytest.mark.parametrize("installed", [False, True])
def test_bench_reports_the_peer_unavailable_and_finishes(tiny_models, tmp_path, capsys, monkeypatch,  # noqa: F811
                                                         installed):
    """Not installed (faked) or installed but with a tiny non-default target: an n/a cell with the
    reason, one stderr line, exit code 0, and the other methods measured as usual."""
    import benchmarks.bench_llama as bl
    from benchmarks.bench import bench_main

    if installed:
        monkeypatch.setattr(bl, "check_installed", lambda: None)
    else:
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    tdir, ddir = tiny_models
    out = tmp_path / "r"
    argv = ["--target", str(tdir), "--drafter", str(ddir), "--datasets", "gsm8k", "--methods", "ar", "llama-cpp",
            "--temperatures", "0", "--prompts-per-dataset", "1", "--max-new-tokens", "4", "--warmup-tokens", "0",
            "--out", str(out), "--no-progress", "--no-figures"]
    assert bench_main(_args(argv)) == 0
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if "llama-cpp unavailable" in ln]
    assert len(lines) == 1
    assert ("not installed" in lines[0]) != installed and ("--llama-gguf" in lines[0]) == installed
    res = json.loads((out / "results.json").read_text())
    cell = next(r for r in res["cells"] if r["method"] == "llama-cpp")
    assert cell["status"] == "n/a" and cell["reason"] in lines[0]
    assert "llama-cpp" in res["unavailable"]
    assert next(r for r in res["cells"] if r["method"] == "ar")["status"] == "ok"
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["ar_vs_llama_cpp"] == res["unavailable"]["llama-cpp"] and summary["errors"] == []
    assert "llama-cpp not run" in (out / "results.md").read_text()


needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="llama-cpp-python is not installed (make bench-deps)")


@needs_llama
def test_real_gguf_greedy_turn_from_our_ids():
    """llama.cpp on SmolLM2's Q4_1 GGUF, fed our chat-template ids: it evaluates exactly those ids,
    and its first greedy token is a top choice of our float32 (dequantized) target at that position.
    Not necessarily our argmax: llama.cpp multiplies against 8-bit-quantized activations, and here
    our top two ("The" 25.33, "L" 25.24) are 0.09 apart while the two engines' logits differ by up
    to ~1.8 (correlation 0.9985, measured 2026-11-30), so llama.cpp answers "L'Étoile, ..."."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.bench_llama import default_gguf, load_llama
    from services.models.registry import ModelNotFoundError, resolve_target

    try:
        tdir, gguf = resolve_target(None), default_gguf()
    except (ModelNotFoundError, PeerUnavailableError) as e:
        pytest.skip(str(e))
    tok = AutoTokenizer.from_pretrained(tdir)
    ids = list(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                       tokenize=True, add_generation_prompt=True, return_dict=False))
    llm = load_llama(gguf, 512, 1)
    rec = llama_turn(llm, ids, 8, (tok.eos_token_id,))
    assert list(llm.input_ids[:len(ids)]) == ids  # the prompt it ran is ours, token for token
    assert 1 <= len(rec["tokens"]) <= 8 and rec["ttft_s"] > 0
    assert rec["finish"] == "length" or len(rec["tokens"]) < 8
    model = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    assert rec["tokens"][0] in logits.topk(3).indices.tolist()
    assert float(logits[rec["tokens"][0]]) >= float(logits.max()) - 1.0
    again = llama_turn(llm, ids, 8, (tok.eos_token_id,))  # a fresh cache each turn: same greedy output
    assert again["tokens"] == rec["tokens"]


def test_serving_row_runs_requests_one_at_a_time_and_compares_with_ar():
    """The serving table's llama-cpp row: requests per level as the HTTP rows, tokens counted
    without the terminator, speedup over the ar row at the same concurrency."""
    from types import SimpleNamespace

    from benchmarks.bench import add_llama_serving

    llm = FakeLlama([7, 8, EOS])
    tok = SimpleNamespace(apply_chat_template=lambda msgs, **kw: "<chat>" + msgs[0]["content"],
                          encode=lambda text: [ord(c) % 50 for c in text])
    bench = SimpleNamespace(llama=lambda: llm, tok=tok, engine=SimpleNamespace(eos_token_ids=(EOS,)),
                            prompts=lambda ds, n: [SimpleNamespace(turns=[f"q{i}"]) for i in range(n)])
    serving = {"concurrency": [1, 2], "max_tokens": 16, "note": "n",
               "table": {"ar": {"1": {"tokens_per_s": 10.0}, "2": {"tokens_per_s": 15.0}}}}
    add_llama_serving(serving, bench, SimpleNamespace(serving_prompts=3, serving_requests_factor=2))
    (label, rows), = [(k, v) for k, v in serving["table"].items() if k.startswith("llama-cpp")]
    assert "batch 1" in label and "llama-cpp row" in serving["note"]
    assert [rows[c]["requests"] for c in ("1", "2")] == [2, 4]
    assert [rows[c]["completion_tokens"] for c in ("1", "2")] == [4, 8]  # 2 tokens per request, EOS not counted
    assert llm.prompts == [tok.encode(f"<chat>q{i}") for i in (0, 1, 0, 1, 2, 0)]  # each level from prompt 0, cycled
    for c, base in (("1", 10.0), ("2", 15.0)):
        assert rows[c]["speedup"] == pytest.approx(rows[c]["tokens_per_s"] / base)


def test_serving_row_when_unavailable_says_why():
    from types import SimpleNamespace

    from benchmarks.bench import add_llama_serving

    def missing():
        raise PeerUnavailableError("llama-cpp-python is not installed: x")

    serving = {"concurrency": [1], "max_tokens": 4, "table": {"ar": {}}}
    add_llama_serving(serving, SimpleNamespace(llama=missing), SimpleNamespace())
    (row,) = [v for k, v in serving["table"].items() if k.startswith("llama-cpp")]
    assert row == {"error": "unavailable: llama-cpp-python is not installed: x"}


def test_a_peer_that_crashes_is_unavailable_not_fatal(monkeypatch):
    """A llama.cpp build that dies on this CPU (SIGILL from AMX kernels on our VMs) is found by the probe
    child process and reported as one line; the benchmark process survives."""
    import sys as _sys

    from benchmarks import bench_llama as bl

    bl.probe_decode.cache_clear()
    monkeypatch.setattr(bl, "_probe_argv", lambda path, threads: [
        _sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"])
    with pytest.raises(PeerUnavailableError, match="crashed \\(SIGILL\\).*make bench-deps"):
        bl.probe_decode("/nowhere.gguf", 1)
    monkeypatch.setattr(bl, "_probe_argv", lambda path, threads: [_sys.executable, "-c", "raise SystemExit(3)"])
    bl.probe_decode("/other.gguf", 1)  # an ordinary failure is left to the in-process load
    bl.probe_decode.cache_clear()
