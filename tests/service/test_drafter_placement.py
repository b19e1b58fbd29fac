"""``--drafter-placement``: the drafter in its own process or inside the verifier process.

The rule of ``auto`` (:func:`services.serve_plan.resolve_drafter_placement`), the processes the supervisor
starts for each placement, and a tiny server with the drafter inside the verifier: greedy answers
equal plain decoding for every drafting method, rounds draft, no drafter process runs, and the
drafter's metrics are still served on the drafter's port.
"""

from __future__ import annotations

import argparse
import shutil

import httpx
import pytest

from benchmarks.bench_served import metric_sum as _metric
from services.serve import Supervisor, add_serve_args
from services.serve_plan import plan, resolve_drafter_placement
from services.testing import served_ar_reference, start_server

from .tiny import TINY_FLAGS, make_tiny_models


@pytest.mark.parametrize("setting, device, overlap, endpoint, want", [
    ("auto", "cpu", False, "", "verifier"),
    ("auto", "cuda", False, "", "process"),
    ("auto", "cuda:1", False, "", "process"),
    ("auto", "cpu", True, "", "process"),
    ("auto", "cpu", False, "tcp://127.0.0.1:5555", "process"),
    ("process", "cpu", False, "", "process"),
    ("process", "cpu", True, "", "process"),
    ("verifier", "cpu", False, "", "verifier"),
    ("verifier", "cuda", False, "", "verifier"),
])
def test_the_placement_rule(setting, device, overlap, endpoint, want):
    assert resolve_drafter_placement(setting, device, overlap, endpoint) == want


@pytest.mark.parametrize("overlap, endpoint, fragment", [(True, "", "--overlap"), (False, "ipc:///x", "--drafter-endpoint")])
def test_a_drafter_in_the_verifier_refuses_what_needs_a_drafter_process(overlap, endpoint, fragment):
    with pytest.raises(ValueError, match=fragment):
        resolve_drafter_placement("verifier", "cpu", overlap, endpoint)
    with pytest.raises(ValueError, match="DARTREE_DRAFTER_PLACEMENT is 'verifier'"):  # names where it came from
        resolve_drafter_placement("verifier", "cpu", overlap, endpoint, "DARTREE_DRAFTER_PLACEMENT")


@pytest.mark.parametrize("setting", ["bogus", "VERIFIER", ""])
def test_an_unknown_placement_is_refused(setting):
    with pytest.raises(ValueError, match=r"DARTREE_DRAFTER_PLACEMENT must be one of auto, process, verifier"):
        resolve_drafter_placement(setting, "cpu", False, "", "DARTREE_DRAFTER_PLACEMENT")


def _plan(tmp_path, monkeypatch, *flags: str, drafter_flag: bool = True):
    target, drafter = make_tiny_models(tmp_path)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    for name in ("DARTREE_DRAFTER_PLACEMENT", "DARTREE_OVERLAP", "DARTREE_DRAFTER_ENDPOINT", "DARTREE_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--target", str(target), *(("--drafter", str(drafter)) if drafter_flag else ()),
                              "--weights", "float32",
                              "--port", "18441", "--verifier-metrics-port", "18442", "--drafter-metrics-port",
                              "18443", *flags])
    sup, gateway, verifier, drafter_cfg, rt = plan(args)
    if rt is not None:
        shutil.rmtree(rt, ignore_errors=True)
    return sup, Supervisor(sup, gateway, verifier, drafter_cfg), verifier, drafter_cfg


def test_on_cpu_the_default_runs_the_drafter_inside_the_verifier(tmp_path, monkeypatch):
    sup, supervisor, verifier, drafter_cfg = _plan(tmp_path, monkeypatch)
    assert sup.drafter_placement == "verifier"
    assert set(supervisor.children) == {"verifier", "gateway"}
    assert supervisor.children["verifier"].config == (verifier, drafter_cfg)
    assert verifier.drafter_endpoint == drafter_cfg.drafter_endpoint == ""  # nothing binds or connects


def test_a_drafter_process_gets_an_ipc_endpoint(tmp_path, monkeypatch):
    _, _, verifier, drafter_cfg = _plan(tmp_path, monkeypatch, "--drafter-placement", "process")
    assert verifier.drafter_endpoint == drafter_cfg.drafter_endpoint
    assert verifier.drafter_endpoint.startswith("ipc://")


def test_drafter_endpoint_none_serves_without_a_drafter(tmp_path, monkeypatch):
    sup, supervisor, verifier, drafter_cfg = _plan(tmp_path, monkeypatch, "--drafter-endpoint", "none",
                                                   drafter_flag=False)
    assert (sup.drafter, drafter_cfg, verifier.drafter_endpoint, verifier.default_method) == ("none", None, "none", "ar")
    assert set(supervisor.children) == {"verifier", "gateway"}
    assert supervisor.children["verifier"].config == verifier


def test_drafter_endpoint_none_with_a_drafter_directory_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--drafter-endpoint none runs no drafter, but --drafter names one"):
        _plan(tmp_path, monkeypatch, "--drafter-endpoint", "none")


def test_without_a_drafter_the_placement_is_not_checked(tmp_path, monkeypatch):
    sup, supervisor, verifier, drafter_cfg = _plan(tmp_path, monkeypatch, "--drafter", "none",
                                                   "--drafter-placement", "verifier", "--overlap", drafter_flag=False)
    assert drafter_cfg is None and set(supervisor.children) == {"verifier", "gateway"}


@pytest.mark.parametrize("flags", [("--drafter-placement", "process"), ("--overlap",)])
def test_a_drafter_process_when_asked_for_or_needed(tmp_path, monkeypatch, flags):
    sup, supervisor, verifier, drafter_cfg = _plan(tmp_path, monkeypatch, *flags)
    assert sup.drafter_placement == "process"
    assert set(supervisor.children) == {"drafter", "verifier", "gateway"}
    assert supervisor.children["verifier"].config == verifier
    assert supervisor.children["drafter"].config == drafter_cfg


@pytest.mark.e2e
def test_a_server_with_the_drafter_inside_the_verifier_drafts_losslessly(tmp_path):
    from gateway.text import TextModel

    target_dir, drafter_dir = make_tiny_models(tmp_path)
    with start_server(*TINY_FLAGS, "--drafter-placement", "verifier", "--budget", "8", "--candidates", "8",
                      "--width", "4", log=tmp_path / "serve.log", target=target_dir, drafter=drafter_dir,
                      env={"OMP_NUM_THREADS": "1"}) as srv:
        with pytest.raises(LookupError):
            srv.child("dartree-drafter")  # one process drafts and verifies
        srv.child("dartree-verifie")  # the process title, cut to 15 characters
        vport, dport = srv.metrics_ports
        ready = httpx.get(srv.base + "/health/ready", timeout=10)
        assert ready.status_code == 200 and ready.json()["detail"] == "ready", ready.text
        reference = served_ar_reference(target_dir, TextModel(target_dir).encode("Hello world"), 24)
        for method in ("dartree-pruned", "ddtree", "dflash", "ar"):
            r = httpx.post(srv.base + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "Hello world", "max_tokens": 24, "return_token_ids": True,
                "speculative": {"method": method, "budget": 8}})
            assert r.status_code == 200, r.text
            ids = r.json()["choices"][0]["token_ids"]
            assert ids and ids == reference[:len(ids)], method
        verifier = httpx.get(f"http://127.0.0.1:{vport}/metrics", timeout=10).text
        assert _metric(verifier, "dartree_spec_draft_tokens_total") > 0
        assert _metric(verifier, "dartree_verifier_drafter_up") == 1
        drafter = httpx.get(f"http://127.0.0.1:{dport}/metrics", timeout=10).text
        assert _metric(drafter, "dartree_drafter_calls_total", type="draft_batch") >= 3
        assert _metric(drafter, "dartree_drafter_seconds_count") > 0
        assert _metric(drafter, "dartree_drafter_contexts") == 0  # every finished request released its context
        assert "drafter runs in the verifier process" in srv.log_tail(200_000)


@pytest.mark.parametrize("flags,env,want", [((), None, None), ((), "auto", None), (("--compile",), None, True),
                                            (("--no-compile",), None, False), ((), "1", True), ((), "0", False),
                                            (("--no-compile",), "1", False)])
def test_compile_is_auto_unless_set(tmp_path, monkeypatch, flags, env, want):
    """``--compile`` unset (or ``DARTREE_COMPILE=auto``): the verifier decides (compiled steps for a
    q4 llama target on CPU), the drafter stays eager; a flag or a boolean variable sets both."""
    if env is None:
        monkeypatch.delenv("DARTREE_COMPILE", raising=False)
    else:
        monkeypatch.setenv("DARTREE_COMPILE", env)
    _, _, verifier, drafter_cfg = _plan(tmp_path, monkeypatch, *flags)
    assert verifier.engine.compile is want and drafter_cfg.compile is bool(want)


def test_a_bad_compile_variable_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DARTREE_COMPILE", "sometimes")
    with pytest.raises(SystemExit) as e:
        _plan(tmp_path, monkeypatch)
    assert e.value.code == 2 and "DARTREE_COMPILE='sometimes' is not" in capsys.readouterr().err


class _Exited:
    """A finished child process as ``Supervisor._reap`` sees it."""

    def __init__(self, exitcode: int):
        self.exitcode, self.pid = exitcode, 1

    def is_alive(self) -> bool:
        return False


class _NoErrors:
    def poll(self) -> bool:
        return False


def _exit_verifier(supervisor, code: int) -> list:
    """Make the verifier child look exited with ``code``; return the list ``_spawn`` appends to."""
    spawned = []
    for child in supervisor.children.values():
        child.proc, child.errors = (_Exited(code) if child.name == "verifier" else None), _NoErrors()
    supervisor._spawn = lambda child: (spawned.append(child.config), setattr(child, "proc", None))
    return spawned


def test_a_verifier_that_compiled_cold_is_started_again_once(tmp_path, monkeypatch):
    from services.serve import StartupError
    from services.verifier.process import RESTART_AFTER_COMPILE_EXIT

    _, supervisor, verifier, drafter_cfg = _plan(tmp_path, monkeypatch)
    assert verifier.restart_after_compile is None  # auto: the worker restarts when a supervisor runs it
    spawned = _exit_verifier(supervisor, RESTART_AFTER_COMPILE_EXIT)
    assert supervisor._reap() and supervisor.failure is None
    (config,) = spawned  # started again at once, not counted as a restart, with the restart turned off
    assert config[0].restart_after_compile is False and config[1] == drafter_cfg
    assert not supervisor.children["verifier"].restarts
    # the second process asking again means its cache did not keep the compiled steps: a start-up failure
    supervisor.children["verifier"].proc = _Exited(RESTART_AFTER_COMPILE_EXIT)
    with pytest.raises(StartupError, match="the verifier failed to start"):
        supervisor._reap()


def test_another_exit_code_before_readiness_is_still_a_start_up_failure(tmp_path, monkeypatch):
    from services.serve import StartupError

    _, supervisor, _, _ = _plan(tmp_path, monkeypatch)
    spawned = _exit_verifier(supervisor, 2)
    with pytest.raises(StartupError):
        supervisor._reap()
    assert not spawned


def test_compiled_cold_reads_the_inductor_cache_misses(monkeypatch):
    from collections import Counter
    from types import SimpleNamespace

    from torch._dynamo.utils import counters

    from services.verifier.process import compiled_cold

    monkeypatch.setitem(counters, "inductor", Counter({"fxgraph_cache_hit": 4}))
    compiled, eager = (SimpleNamespace(runner=SimpleNamespace(compiled=c)) for c in (True, False))
    assert compiled_cold(compiled) == 0  # every graph loaded from disk: nothing to restart for
    monkeypatch.setitem(counters, "inductor", Counter({"fxgraph_cache_miss": 3, "fxgraph_cache_hit": 1}))
    assert compiled_cold(compiled) == 3 and compiled_cold(eager) == 0
