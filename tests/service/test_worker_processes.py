"""How ``dartree serve`` starts its workers (``--start-method``, :func:`services.runtime.worker_context`).

On CPU the workers are forked from one forkserver that imported torch and the worker modules once
(they share those pages); the forkserver ignores a SIGTERM sent to every process (its workers
drain; ``test_group_shutdown``) and exits with the supervisor, and so does every worker when the
supervisor is killed outright. ``--start-method spawn`` gives each worker a fresh interpreter, the
supervisor as its parent.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from services.runtime import worker_context
from services.testing import start_server

from .tiny import TINY_FLAGS, make_tiny_models

pytestmark = pytest.mark.e2e
ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
WORKERS = ("dartree-gateway", "dartree-verifie", "dartree-drafter")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_models(tmp_path_factory.mktemp("tiny-procs"))


def test_the_context_follows_the_device_and_the_flag():
    assert worker_context("auto", "cpu").get_start_method() == "forkserver"
    assert worker_context("auto", "cuda:0").get_start_method() == "spawn"
    assert worker_context("spawn", "cpu").get_start_method() == "spawn"
    assert worker_context("forkserver", "cpu").get_start_method() == "forkserver"
    with pytest.raises(ValueError, match="start method 'fork'"):
        worker_context("fork", "cpu")


def _workers(srv) -> dict[str, psutil.Process]:
    return {name: srv.child(name) for name in WORKERS}


def _gone(procs, timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    alive = list(procs)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    return alive


def test_cpu_workers_are_forked_from_one_preloaded_forkserver_that_dies_with_the_supervisor(tiny, tmp_path):
    target_dir, drafter_dir = tiny
    with start_server(*TINY_FLAGS, log=tmp_path / "serve.log", target=target_dir, drafter=drafter_dir,
                      env=ENV) as srv:
        workers = _workers(srv)
        parents = {p.ppid() for p in workers.values()}
        assert len(parents) == 1 and srv.proc.pid not in parents, parents
        forkserver = psutil.Process(parents.pop())
        assert forkserver.ppid() == srv.proc.pid
        assert "multiprocessing.forkserver" in " ".join(forkserver.cmdline())
        assert "services.forkserver_preload" in " ".join(forkserver.cmdline())
        forkserver.send_signal(signal.SIGTERM)  # ignored: it reports the workers' exit codes
        time.sleep(0.5)
        assert forkserver.is_running() and forkserver.status() != psutil.STATUS_ZOMBIE
        # the supervisor killed outright: the forkserver and every worker exit on their own
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(10)
        left = _gone([forkserver, *workers.values()], 30)
        for p in left:
            p.kill()
        assert not left, [p.name() for p in left]


def test_spawn_start_method_gives_each_worker_the_supervisor_as_parent(tiny, tmp_path):
    target_dir, drafter_dir = tiny
    with start_server(*TINY_FLAGS, "--start-method", "spawn", log=tmp_path / "serve.log", target=target_dir,
                      drafter=drafter_dir, env=ENV) as srv:
        assert {p.ppid() for p in _workers(srv).values()} == {srv.proc.pid}


def test_free_loopback_ports_are_distinct_bindable_and_below_the_ephemeral_range(monkeypatch):
    """Test servers get ports no outgoing connection can be handed meanwhile (below the kernel's
    ephemeral range where it leaves room), distinct and free; without room, the kernel's picks."""
    import socket
    from pathlib import Path

    from services import runtime

    ports = runtime.free_loopback_ports(8)
    assert len(set(ports)) == 8
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if low > 10032:
        assert all(10000 <= p < low for p in ports)
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "1024 65535" if "ip_local_port_range" in str(self)
                        else real_read(self, *a, **k))
    kernel = runtime.free_loopback_ports(3)  # no room below 1024: the kernel's picks
    assert len(set(kernel)) == 3 and all(p >= 1024 for p in kernel)
