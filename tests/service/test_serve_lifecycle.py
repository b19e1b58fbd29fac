"""``dartree serve`` start-up validation and the end of the drain.

Start-up: every bad setting is one ``error:`` line with exit status 2, found before anything is
spawned (no traceback, no "serving on", no restarts, no runtime dir left behind); a worker that
fails while starting stops the server with that worker's error line instead of being restarted.
Drain: when ``--drain-timeout-s`` expires, streams still open end with a ``server_shutdown`` error
event and ``[DONE]``, waiting non-streaming requests get a 503, and the log has no traceback.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from services.runtime import free_loopback_ports
from services.testing import REPO, start_server

from .tiny import TINY_FLAGS, make_tiny_models

ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def _serve(*flags: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m services.serve`` on free ports (unless the flags name them); no XDG runtime dir.
    Checks that the run left no runtime dir behind."""
    port, vport, dport = free_loopback_ports(3)
    base = ["--port", str(port), "--verifier-metrics-port", str(vport), "--drafter-metrics-port", str(dport)]
    environ = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR" and not k.startswith("DARTREE_")}
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "services.serve", *base, *flags], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**environ, **ENV, **(env or {})})
    out, err = proc.communicate(timeout=timeout)
    rt = Path(f"/tmp/dartree-{os.getuid()}-{proc.pid}")  # one of an earlier process with this pid is not ours
    assert not (rt.exists() and rt.stat().st_mtime >= t0 - 1), "the runtime dir was left behind"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _assert_one_line_error(r: subprocess.CompletedProcess, fragment: str) -> None:
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "serving on" not in out and "restarting" not in out, out[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "error:" in last and fragment in last, out[-3000:]


@pytest.fixture
def listener():
    """A TCP socket listening on a free loopback port (another server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


@pytest.mark.parametrize("flags, env, fragment", [
    (("--host", "999.1.1.1"), None, "999.1.1.1"),
    (("--budget", "-3"), None, "budget must be in [1, 1024]"),
    (("--width", "0"), None, "width must be in [1, 256]"),
    (("--candidates", "0"), None, "candidates must be in [1, 1024]"),
    (("--depth-bonus", "0.5"), None, "--depth-bonus must be a finite number <= 0"),
    (("--drafter-threads", "-1"), None, "--drafter-threads must be in [0, 1024] (0 = auto; got -1)"),
    (("--drafter-threads", "99999999999999999999"), None, "--drafter-threads must be in [0, 1024]"),
    (("--default-method", "medusa"), None, "invalid choice: 'medusa'"),
    (("--drafter-placement", "gpu"), None, "invalid choice: 'gpu'"),
    (("--drafter-placement", "verifier", "--overlap"), None, "--overlap needs a drafter process"),
    (("--overlap",), {"DARTREE_DRAFTER_PLACEMENT": "verifier"},
     "--overlap needs a drafter process, but DARTREE_DRAFTER_PLACEMENT is 'verifier'"),
    (("--drafter-placement", "verifier"), {"DARTREE_OVERLAP": "1"},
     "DARTREE_OVERLAP needs a drafter process, but --drafter-placement is 'verifier'"),
    ((), {"DARTREE_DRAFTER_PLACEMENT": "bogus"},
     "DARTREE_DRAFTER_PLACEMENT='bogus' is not one of: auto, process, verifier"),
    ((), {"DARTREE_START_METHOD": "bogus"}, "DARTREE_START_METHOD='bogus' is not one of:"),
    ((), {"DARTREE_WEIGHTS": "int3"}, "DARTREE_WEIGHTS='int3' is not one of:"),
    ((), {"DARTREE_DTYPE": "float64"}, "DARTREE_DTYPE='float64' is not one of:"),
    (("--drafter-endpoint", "tcp://127.0.0.1:1", "--drafter-placement", "verifier"), None,
     "--drafter-endpoint names a drafter process's address"),
    (("--dtype", "float64"), None, "invalid choice: 'float64'"),
    ((), {"DARTREE_MAX_RUNNING": "abc"}, "DARTREE_MAX_RUNNING='abc' is not a valid int"),
    ((), {"DARTREE_METRICS_AUTH": "maybe"}, "DARTREE_METRICS_AUTH='maybe' is not a valid boolean"),
    (("--drafter", "{tmp}"), None, "has no config.json"),
    (("--default-method", "eagle3"), None,
     "the default method 'eagle3' (--default-method) is not served by the domino"),
    (("--drafter", "{tmp}/notjson"), None, "config.json is not valid JSON"),
    (("--drafter", "{tmp}/emptyobj"), None, "config.json is not a drafter config (KeyError"),
    (("--drafter", "{tmp}/list"), None, "config.json is not a drafter config (not a JSON object)"),
    (("--drafter", "{tmp}/target"), None, "holds a LlamaForCausalLM model, not a drafter"),
    (("--drafter", "models/smollm2-135m-eagle3-drafter"), None,
     "the default method 'dartree-pruned' (the default; change it with --default-method) is not served by the eagle3"),
    (("--drafter", "none", "--default-method", "ddtree"), None,
     "the default method 'ddtree' (--default-method) needs a drafter, but none runs"),
    ((), {"DARTREE_DRAFTER": "none", "DARTREE_DEFAULT_METHOD": "eagle3"},
     "the default method 'eagle3' (DARTREE_DEFAULT_METHOD) needs a drafter, but none runs"),
    (("--drafter", "NONE", "--default-method", "dartree-pruned"), None,  # the default value, given explicitly
     "the default method 'dartree-pruned' (--default-method) needs a drafter, but none runs"),
    (("--default-method", "eagle3"), {"DARTREE_DEFAULT_METHOD": "ddtree"},  # the flag wins over the env var
     "the default method 'eagle3' (--default-method) is not served by the domino"),
    ((), {"DARTREE_DEFAULT_METHOD": "eagle3"},
     "the default method 'eagle3' (DARTREE_DEFAULT_METHOD) is not served by the domino"),
])
def test_bad_settings_are_one_line_errors_before_anything_starts(tmp_path, flags, env, fragment):
    flags = tuple(f.replace("{tmp}", str(tmp_path)) for f in flags)
    for name, text in (("notjson", "not json"), ("emptyobj", "{}"), ("list", "[]"),
                       ("target", '{"architectures": ["LlamaForCausalLM"], "hidden_size": 8}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
    t0 = time.monotonic()
    r = _serve(*flags, env=env)
    _assert_one_line_error(r, fragment)
    assert time.monotonic() - t0 < 60
    assert "started " not in r.stderr  # no worker was spawned


def test_cuda_without_a_cuda_device_is_one_line_before_anything_starts():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    r = _serve("--device", "cuda")
    _assert_one_line_error(r, "--device cuda: this torch")
    assert "started " not in r.stderr


@pytest.mark.parametrize("which", ["--port", "--verifier-metrics-port", "--drafter-metrics-port"])
def test_a_busy_port_is_refused_before_anything_starts(tmp_path, listener, which):
    _, drafter_dir = make_tiny_models(tmp_path)  # the drafter's port is only checked when a drafter runs
    r = _serve(which, str(listener), "--drafter", str(drafter_dir))
    _assert_one_line_error(r, f"{which}: cannot listen on 127.0.0.1:{listener}")
    assert "already in use" in r.stderr.strip().splitlines()[-1]


def test_a_flag_overrides_a_bad_env_var():
    r = _serve("--max-running", "2", "--dtype", "float64", env={"DARTREE_MAX_RUNNING": "abc"})
    _assert_one_line_error(r, "float64")  # the env var was not the error: the flag replaced it


def test_a_worker_that_fails_at_start_stops_the_server_with_its_error_line(tmp_path):
    target_dir, drafter_dir = make_tiny_models(tmp_path)
    bad = tmp_path / "bad-drafter"  # a valid config (it passes the start-up checks) without its weights
    bad.mkdir()
    (bad / "config.json").write_text((drafter_dir / "config.json").read_text())
    r = _serve(*TINY_FLAGS, "--target", str(target_dir), "--drafter", str(bad), "--drafter-wait-s", "60")
    out = r.stdout + r.stderr
    _assert_one_line_error(r, "the drafter failed to start:")
    assert "model.safetensors" in r.stderr.strip().splitlines()[-1], out[-3000:]
    assert out.count("started drafter") == 1, out[-3000:]  # not restarted


def test_a_drafter_inside_the_verifier_that_fails_to_load_stops_the_server_with_its_error_line(tmp_path):
    target_dir, drafter_dir = make_tiny_models(tmp_path)
    bad = tmp_path / "bad-drafter"
    bad.mkdir()
    (bad / "config.json").write_text((drafter_dir / "config.json").read_text())
    r = _serve(*TINY_FLAGS, "--drafter-placement", "verifier", "--target", str(target_dir), "--drafter", str(bad))
    out = r.stdout + r.stderr
    _assert_one_line_error(r, "the verifier failed to start:")
    assert "model.safetensors" in r.stderr.strip().splitlines()[-1], out[-3000:]
    assert "started drafter" not in out and out.count("started verifier") == 1, out[-3000:]


@pytest.mark.parametrize("drain_s, signals", [("1", 1), ("60", 2)])
def test_drain_timeout_ends_open_requests_cleanly_and_promptly(tmp_path, drain_s, signals):
    """Requests still running when the drain timeout expires (or at a second signal): the stream ends
    with an OpenAI-shaped server_shutdown error event then [DONE], the non-streaming request gets a
    503, nothing is cut mid-chunk, no traceback is logged, and the server exits soon after."""
    target_dir, drafter_dir = make_tiny_models(tmp_path)
    log = tmp_path / "serve.log"
    with start_server(*TINY_FLAGS, "--drain-timeout-s", drain_s, "--draft-timeout-s", "60", log=log, target=target_dir,
                      drafter=drafter_dir, env=ENV, stop_timeout=60) as srv:
        drafter = srv.child("dartree-drafter")
        results: dict = {}

        def plain() -> None:
            results["plain"] = httpx.post(srv.base + "/v1/completions", timeout=60, json={
                "prompt": "x", "max_tokens": 200, "speculative": {"budget": 8}})  # explicit budget: drafts every round

        with httpx.Client(base_url=srv.base, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "x"}], "max_tokens": 200, "stream": True,
                    "speculative": {"budget": 8}}) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: {"):
                        break
                drafter.suspend()  # every request now waits for a draft: "a slow long generation"
                t = threading.Thread(target=plain)
                t.start()
                time.sleep(0.5)
                t0 = time.monotonic()
                for _ in range(signals):
                    srv.proc.send_signal(signal.SIGTERM)
                    time.sleep(0.3)
                rest = [line for line in lines if line.startswith("data: ")]  # must end cleanly, not raise
                cut_after = time.monotonic() - t0
                drafter.resume()
                t.join(30)
        code = srv.proc.wait(30)
        stopped_after = time.monotonic() - t0
    assert rest[-1] == "data: [DONE]", rest[-3:]
    err = json.loads(rest[-2][6:])["error"]
    assert err["code"] == "server_shutdown" and set(err) == {"message", "type", "param", "code"}
    assert results["plain"].status_code == 503 and results["plain"].json()["error"]["code"] == "server_shutdown"
    says = "at the end of the drain timeout" if signals == 1 else "told to stop now"  # which of the two cut it
    assert says in err["message"] and says in results["plain"].json()["error"]["message"], err
    assert (0.8 if signals == 1 else 0.0) < cut_after < 6, cut_after
    assert code == 0 and stopped_after < 20, (code, stopped_after)
    text = log.read_text()
    assert "Traceback" not in text and "CancelledError" not in text and "leaked semaphore" not in text, text[-3000:]
