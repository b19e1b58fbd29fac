"""``benchmarks/guidellm_peer.py`` and ``vs_llama_server --guidellm``: reading guidellm's JSON report
(a run recorded against ``dartree serve``, trimmed), its command line, a missing guidellm, and the
per-server section built from a stand-in executable that writes that report (guidellm not needed)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from benchmarks import guidellm_peer as gl
from benchmarks import vs_llama_server as vs
from benchmarks.bench_llama import PeerUnavailableError

FIXTURE = Path(__file__).parent / "fixtures" / "guidellm_report_c1.json"


@pytest.fixture
def recorded() -> dict:
    return json.loads(FIXTURE.read_text())


def test_the_recorded_report_gives_rate_and_medians(recorded):
    parsed = gl.parse_report(recorded)
    metrics = recorded["benchmarks"][0]["metrics"]
    assert parsed["guidellm_version"] == recorded["metadata"]["guidellm_version"]
    assert set(parsed["levels"]) == {"c1"}
    c1 = parsed["levels"]["c1"]
    assert c1["output_tps"] == pytest.approx(metrics["output_tokens_per_second"]["successful"]["mean"], abs=1e-3)
    assert c1["ttft_ms"] == pytest.approx(metrics["time_to_first_token_ms"]["successful"]["median"], abs=1e-3)
    assert c1["itl_ms"] == pytest.approx(metrics["inter_token_latency_ms"]["successful"]["median"], abs=1e-3)
    assert (c1["requests"], c1["errored"], c1["incomplete"]) == (1, 0, 1)
    # the rate is tokens of the successful requests over the benchmark, not a median of instants
    out_tokens = metrics["output_tokens_per_second"]["successful"]["count"]
    assert c1["output_tps"] == pytest.approx(out_tokens / recorded["benchmarks"][0]["duration"], rel=1e-3)


def test_parsing_takes_every_level_and_tolerates_missing_metrics(recorded):
    four = copy.deepcopy(recorded["benchmarks"][0])
    four["config"]["strategy"]["streams"] = [4]                          # a one-element list is read too
    del four["metrics"]["inter_token_latency_ms"]
    four["metrics"]["time_to_first_token_ms"]["successful"]["median"] = None
    parsed = gl.parse_report({"benchmarks": recorded["benchmarks"] + [four]})
    assert set(parsed["levels"]) == {"c1", "c4"} and parsed["guidellm_version"] is None
    assert parsed["levels"]["c4"]["itl_ms"] is None and parsed["levels"]["c4"]["ttft_ms"] is None
    assert parsed["levels"]["c4"]["output_tps"] == parsed["levels"]["c1"]["output_tps"]
    for bad, match in (({}, "no benchmarks"), ({"benchmarks": []}, "no benchmarks"),
                       ({"benchmarks": [{"config": {}, "metrics": {}}]}, "concurrency")):
        with pytest.raises(ValueError, match=match):
            gl.parse_report(bad)


def test_the_command_line_asks_for_the_workload(tmp_path):
    argv = gl.guidellm_argv(Path("/v/bin/guidellm"), "http://127.0.0.1:9000", Path("/m/tok"), [1, 4], 12.5,
                            256, 128, tmp_path / "r.json")
    assert argv[:2] == ["/v/bin/guidellm", "run"] and argv[-1] == "--disable-console-interactive"
    opts = {argv[i]: json.loads(argv[i + 1]) for i in range(2, len(argv) - 1, 2)}
    assert opts["--backend"]["target"] == "http://127.0.0.1:9000"
    assert opts["--backend"]["request_format"] == "/v1/chat/completions"
    assert opts["--backend"]["extras"] == {"body": {"temperature": 0}}           # T = 0 on both servers
    assert opts["--profile"] == {"kind": "concurrent", "streams": [1, 4]}
    assert opts["--constraint"] == {"kind": "max_duration", "seconds": 12.5}
    assert opts["--data"] == {"kind": "synthetic_text", "prompt_tokens": 256, "output_tokens": 128}
    assert opts["--tokenizer"] == {"kind": "huggingface_auto", "model": "/m/tok"}
    assert opts["--output"] == {"kind": "json", "path": str(tmp_path / "r.json")}
    env = gl.guidellm_env({"PYTHONPATH": "/repo", "HOME": "/h"})
    assert "PYTHONPATH" not in env and env["HOME"] == "/h" and env["HF_HUB_OFFLINE"] == "1"


def test_a_missing_guidellm_is_one_line_naming_the_make_target(tmp_path, monkeypatch, capsys):
    with pytest.raises(PeerUnavailableError, match="not an executable"):
        gl.find_guidellm(str(tmp_path / "nope"))
    monkeypatch.setattr(gl, "VENV", tmp_path / "venv")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PeerUnavailableError, match="make bench-guidellm"):
        gl.find_guidellm()
    with pytest.raises(SystemExit, match=r"^vs_llama_server: guidellm not found .*make bench-guidellm") as e:
        vs.main(["--guidellm"])
    assert "\n" not in str(e.value)
    exe = tmp_path / "venv" / "bin" / "guidellm"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert gl.find_guidellm() == exe
    assert vs.guidellm_binary(vs.parse_args([])) is None                         # off by default


def test_guidellm_arguments_default_and_refuse_bad_values(capsys):
    a = vs.parse_args([])
    assert (a.guidellm, a.guidellm_seconds, a.guidellm_concurrency, a.guidellm_prompt_tokens) == \
        (False, 30.0, [1, 4], 256)
    for bad in (["--guidellm-seconds", "0"], ["--guidellm-concurrency", "1", "0"],
                ["--guidellm-prompt-tokens", "0"],
                ["--guidellm", "--ctx-per-slot", "400", "--guidellm-prompt-tokens", "256"]):
        with pytest.raises(SystemExit):
            vs.parse_args(bad)
        assert "error: --" in capsys.readouterr().err.strip().splitlines()[-1]


STAND_IN = """#!{python}
import json, sys
argv = sys.argv[1:]
open({calls!r}, "a").write(json.dumps(argv) + "\\n")
opt = lambda name: json.loads(argv[argv.index(name) + 1])
if {fail!r} in opt("--backend")["target"]:
    print("boom", file=sys.stderr)
    sys.exit(3)
fast = {fast!r} in opt("--backend")["target"]
report = json.load(open({fixture!r}))
one = report["benchmarks"][0]
report["benchmarks"] = []
for streams in opt("--profile")["streams"]:
    bench = json.loads(json.dumps(one))
    bench["config"]["strategy"]["streams"] = streams
    tps = bench["metrics"]["output_tokens_per_second"]["successful"]
    tps["mean"] *= streams * (2 if fast else 1)
    report["benchmarks"].append(bench)
open(opt("--output")["path"], "w").write(json.dumps(report))
"""


def _stand_in(tmp_path: Path, fast: str, fail: str) -> Path:
    exe = tmp_path / "guidellm"
    exe.write_text(STAND_IN.format(python=sys.executable, calls=str(tmp_path / "calls"), fast=fast, fail=fail,
                                   fixture=str(FIXTURE)))
    exe.chmod(0o755)
    return exe


def test_each_server_in_turn_and_the_ratios(tmp_path, capsys):
    bases = {vs.OURS: "http://127.0.0.1:9001", vs.OURS_AR: "http://127.0.0.1:9001",
             vs.LLAMA: "http://127.0.0.1:9002"}
    exe = _stand_in(tmp_path, fast=":9001", fail="never")
    a = vs.parse_args(["--guidellm", "--guidellm-bin", str(exe), "--guidellm-seconds", "5", "--max-tokens", "64"])
    sec = vs.run_guidellm_arms(vs.guidellm_binary(a), bases, a, Path("/m/tok"), tmp_path / "out" / "vs")
    calls = [json.loads(line) for line in (tmp_path / "calls").read_text().splitlines()]
    targets = [json.loads(c[c.index("--backend") + 1])["target"] for c in calls]
    assert targets == [bases[vs.OURS], bases[vs.LLAMA]]                          # the two servers, in turn
    assert all(json.loads(c[c.index("--data") + 1])["output_tokens"] == 64 for c in calls)
    assert set(sec["levels"]) == {vs.OURS, vs.LLAMA} and set(sec["levels"][vs.LLAMA]) == {"c1", "c4"}
    assert sec["levels"][vs.LLAMA]["c4"]["output_tps"] == pytest.approx(4 * sec["levels"][vs.LLAMA]["c1"]["output_tps"])
    assert sec["ratio_ours_to_llama"]["c4"]["output_tps"] == pytest.approx(2.0)
    assert sec["ratio_ours_to_llama"]["c1"]["ttft_ms"] == pytest.approx(1.0)
    assert sec["settings"]["concurrency"] == [1, 4] and sec["guidellm_version"] == "0.8.1"
    assert (tmp_path / "out" / f"vs-guidellm-{vs.LLAMA}.json").is_file()
    assert sec["commands"][vs.OURS].startswith(str(exe) + " run ")
    table = capsys.readouterr().err
    assert sum(line.startswith((vs.OURS + " ", vs.LLAMA + " ")) for line in table.splitlines()) == 4
    res = vs.report(a, [], {}, Path("/m/a.gguf"), [], sec)
    assert res["guidellm"] == sec and json.loads(json.dumps(res)) == res
    assert "guidellm" not in vs.report(a, [], {}, Path("/m/a.gguf"), [])


def test_a_failing_guidellm_run_names_its_log(tmp_path):
    bases = {vs.OURS: "http://127.0.0.1:9001", vs.LLAMA: "http://127.0.0.1:9002"}
    a = vs.parse_args(["--guidellm", "--guidellm-concurrency", "1"])
    with pytest.raises(RuntimeError, match=r"guidellm exited \(3\); see .*vs-guidellm-llama-server.log"):
        vs.run_guidellm_arms(_stand_in(tmp_path, fast="x", fail=":9002"), bases, a, Path("/m"), tmp_path / "vs")
    assert "boom" in (tmp_path / "vs-guidellm-llama-server.log").read_text()
