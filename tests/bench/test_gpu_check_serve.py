"""The served part of ``gpu_check`` in pieces (fast): the command it starts, the spec == ar comparison,
MPS detection, and the stop that leaves no process behind. The whole served part runs in the slow
``--smoke`` test of tests/bench/test_gpu_bundle.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu_check import serve


def test_command_is_dartree_serve_with_a_drafter_process():
    cmd = serve.serve_command("cpu", Path("/t"), Path("/d"), (1, 2, 3))
    assert cmd[:3] == [sys.executable, "-m", "services.serve"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--drafter-placement"] == "process" and flags["--device"] == "cpu"
    assert flags["--port"] == "1" and flags["--target"] == "/t" and flags["--drafter"] == "/d"
    assert flags["--max-running"] == str(len(serve.PROMPTS)) == "8" and "--cuda-ipc" not in cmd
    assert serve.serve_command("cuda:0", Path("/t"), Path("/d"), (1, 2, 3))[-1] == "--cuda-ipc"


def test_compare_names_each_stream_that_differs():
    ar = {"ids": [[1, 2, 3]] * 8}
    spec = {"ids": [[1, 2, 3]] * 6 + [[1, 9, 3], [1, 2]]}
    res = serve.compare(ar, spec)
    assert res["requests"] == 8 and res["equal"] == 6
    assert res["mismatches"] == [
        {"prompt": serve.PROMPTS[6], "ar_tokens": 3, "spec_tokens": 3, "first_difference": 1},
        {"prompt": serve.PROMPTS[7], "ar_tokens": 3, "spec_tokens": 2, "first_difference": 2}]
    assert serve.compare(ar, ar)["mismatches"] == []


def test_mps_status(monkeypatch):
    assert serve.mps_status("cpu") == {"status": "not available", "reason": "not a CUDA device (cpu)"}
    monkeypatch.setattr(serve.shutil, "which", lambda name: None)
    assert serve.mps_status("cuda")["reason"] == "nvidia-cuda-mps-control is not on the PATH"
    monkeypatch.setattr(serve.shutil, "which", lambda name: "/usr/bin/" + name)
    assert serve.mps_status("cuda") == {"status": "available"}


CHILD = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a worker that ignores the drain
kid = subprocess.Popen([sys.executable, "-c", "import os, signal, time; os.setpgrp(); "
                        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(kid.pid, flush=True)
time.sleep(600)
"""


def test_stop_all_kills_what_the_drain_leaves():
    """A supervisor that ignores SIGTERM and a worker in its own process group (as ``dartree serve``'s
    workers are) that ignores it too: both are gone after :func:`serve.stop_all`."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    worker = int(proc.stdout.readline())
    found = {}
    for _ in range(50):  # the worker's own exec may lag behind its pid
        found = serve.descendants(proc.pid)
        if found.get(worker, "").startswith("python"):
            break
        time.sleep(0.1)
    assert worker in found
    killed = serve.stop_all(proc, found, drain_s=0.5)
    assert killed[0] == "supervisor" and len(killed) == 2
    assert proc.returncode is not None
    for _ in range(50):
        if not Path(f"/proc/{worker}").exists() or _zombie(worker):
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{worker}").exists() or _zombie(worker)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True

