"""Process plumbing shared by the worker entries: logging with request ids, process title,
parent-death guard, metrics HTTP server, stop/drain signals. Torch-free.
"""

from __future__ import annotations

import contextvars
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from services import weight_formats

log = logging.getLogger(__name__)
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("dartree_request_id", default="-")
LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s [%(request_id)s] %(message)s"
_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (set by the worker around each request's work; "-" otherwise)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


DTYPES = ("float32", "bfloat16")  # model precisions the workers run (and the tests cover)


WEIGHT_FORMATS = weight_formats.names()  # target weight formats (services/weight_formats.py)
WEIGHT_CHOICES = ("auto", *WEIGHT_FORMATS)


def default_weights() -> str:
    """The command lines' default ``--weights``: ``$DARTREE_WEIGHTS`` or ``auto`` (the tests pin float32)."""
    return os.environ.get("DARTREE_WEIGHTS", "auto")


def error_line(err: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none): what the CLIs and
    the workers print for bad input instead of a traceback."""
    text = str(err.code if isinstance(err, SystemExit) else err).strip()
    return text.splitlines()[0] if text and text != "None" else type(err).__name__


def check_device(device: str) -> None:
    """ValueError (one line) unless ``device`` is ``cpu``, ``cuda`` or ``cuda:N`` (what the workers run on)."""
    import re

    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"device {device!r} is not supported (choose cpu, cuda or cuda:N)")


def check_dtype(dtype: str) -> None:
    """ValueError (one line) unless ``dtype`` is one of :data:`DTYPES`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (choose from {', '.join(DTYPES)})")


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def set_process_title(name: str) -> None:
    """Linux ``comm`` name (shown by ps/top), best effort."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def exit_with_parent(parent_pid: int | None) -> None:
    """SIGTERM this process when its supervisor dies (Linux), plus a polling fallback.

    A worker forked from the supervisor's forkserver (:func:`worker_context`) has the forkserver as
    its parent: the death signal follows the forkserver (which exits with the supervisor), and the
    poll checks both that its parent is unchanged and that ``parent_pid`` is alive."""
    if parent_pid is None:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    first_parent = os.getppid()

    def gone() -> bool:
        if os.getppid() != first_parent:
            return True
        if first_parent == parent_pid:
            return False
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False

    def watch() -> None:
        while True:
            if gone():
                log.error("supervisor %d is gone; stopping", parent_pid)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            threading.Event().wait(1.0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


START_METHODS = ("auto", "forkserver", "spawn")  # how the supervisor starts its workers (--start-method)
DRAFTER_PLACEMENTS = ("auto", "process", "verifier")  # where the drafter runs (--drafter-placement)
FORKSERVER_PRELOAD = "services.forkserver_preload"


def worker_context(start_method: str = "auto", device: str = "cpu"):
    """The :mod:`multiprocessing` context the supervisor starts its workers (and the weight-choice
    child) with.

    ``auto``: a forkserver on CPU, ``spawn`` on any other device. The forkserver imports
    :mod:`services.forkserver_preload` (torch, transformers' Llama, the worker modules) once, before
    it forks anything, so the workers share those pages (~250 MB of PSS per worker otherwise) and
    skip their imports; ``spawn`` starts each worker in a fresh interpreter (always safe with CUDA,
    whose state must not cross a ``fork``). Children of either start with the default SIGTERM
    action (:func:`restore_stop_signals`).

    Raises:
        ValueError: ``start_method`` not in :data:`START_METHODS`.
    """
    import multiprocessing as mp

    if start_method not in START_METHODS:
        raise ValueError(f"start method {start_method!r} is not one of {', '.join(START_METHODS)}")
    if start_method == "spawn" or (start_method == "auto" and not device.startswith("cpu")):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([FORKSERVER_PRELOAD])
    return ctx


def trim_heap() -> None:
    """Return the C heap's freed pages to the operating system (glibc ``malloc_trim``; a no-op
    elsewhere). glibc keeps freed heap pages resident otherwise."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_MADV_DONTNEED = 4


def _file_mappings(suffix: str) -> list[tuple[int, int, int]]:
    """``(start, end, rss_bytes)`` of this process's private mappings of ``*suffix`` files holding
    no private (copy-on-write) page: ``/proc/self/smaps`` ``Anonymous: 0 kB``."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":") and len(head) >= 5:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                path = head[5] if len(head) > 5 else ""
                cur = [lo, hi, 0, 0] if path.endswith(suffix) and head[1].endswith("p") else None
                if cur is not None:
                    out.append(cur)
            elif cur is not None and head[0] in ("Rss:", "Anonymous:"):
                cur[2 if head[0] == "Rss:" else 3] = int(head[1]) * 1024
    return [(lo, hi, rss) for lo, hi, rss, anon in out if rss and not anon]


def drop_file_pages(suffix: str = ".safetensors") -> int:
    """Unmap the resident pages of this process's private mappings of ``*suffix`` files (weights
    that tensors view, as safetensors gives them) where no page was ever written, and return the
    bytes that were resident there (0 off Linux).

    The pages stay in the page cache: a tensor that still reads them faults them back in (minor
    faults); pages nothing reads again stop counting in the process's RSS and PSS. For weights
    read once at start and superseded by a copy (the verifier's q4 linears that its lean step
    fused into one kernel call: ~45 MB of SmolLM2's q4 packs). ``madvise(MADV_DONTNEED)`` on a
    private file mapping drops written (copy-on-write) pages too, hence only mappings without any;
    weights must not be written in place afterwards (nothing here writes them).
    """
    try:
        maps = _file_mappings(suffix)
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for lo, hi, rss in maps:
        if libc.madvise(lo, hi - lo, _MADV_DONTNEED) == 0:
            dropped += rss
    return dropped


def restore_stop_signals() -> None:
    """SIGTERM back to its default action: the first thing a process started from the forkserver
    does (the forkserver ignores SIGTERM, :mod:`services.forkserver_preload`, and ``fork`` keeps an
    ignored signal ignored)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def start_metrics_server(port: int, host: str, registry) -> None:
    """Serve ``registry`` on ``http://host:port/metrics`` (``port == 0``: disabled)."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host, registry=registry)
        log.info("metrics on http://%s:%d/metrics", host, port)


# What the supervisor sends its workers (never SIGTERM, so that a SIGTERM the whole process group
# got as well is not counted twice): "drain" (idempotent) and "stop now" (the supervisor got a second signal).
DRAIN_SIGNAL = signal.SIGUSR1
STOP_NOW_SIGNAL = signal.SIGUSR2


def on_stop_signals(drain: Callable[[], None], stop_now: Callable[[], None], supervised: bool) -> None:
    """Install a worker's stop signals: ``drain()`` on the first SIGTERM (and SIGINT when run alone;
    a supervisor owns Ctrl-C) and on the supervisor's :data:`DRAIN_SIGNAL` (idempotent: it never
    counts as a second signal); ``stop_now()`` on a second SIGTERM/SIGINT and on :data:`STOP_NOW_SIGNAL`.
    """
    count = [0]

    def on_term(signum, frame) -> None:
        count[0] += 1
        (drain if count[0] == 1 else stop_now)()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN if supervised else on_term)
    signal.signal(DRAIN_SIGNAL, lambda s, f: drain())
    signal.signal(STOP_NOW_SIGNAL, lambda s, f: stop_now())


def prepare_process(name: str, log_level: str, parent_pid: int | None) -> None:
    """Everything a model worker's entry does first (docs/design.md "Worker processes"): title, logging
    (without transformers' "Loading weights" progress bars), parent-death guard."""
    from services.hf_compat import quiet_progress_bars

    set_process_title(name)
    setup_logging(log_level)
    quiet_progress_bars()
    exit_with_parent(parent_pid)


def free_loopback_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now (for tests and benchmarks that start servers).

    Taken below the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``, 32768 by
    default on Linux) where that leaves room, so no outgoing connection made meanwhile (a Ray
    cluster's workers open dozens) can be handed the same port before the server binds it; else
    ports the kernel picks.
    """
    import random
    import socket

    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    ports: list[int] = []
    if low > 10000 + 4 * n:
        rng = random.Random()
        for _ in range(64 * n):
            if len(ports) == n:
                break
            port = rng.randrange(10000, low)
            if port in ports:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            ports.append(port)
    if len(ports) < n:
        socks = [socket.socket() for _ in range(n - len(ports))]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        ports += [s.getsockname()[1] for s in socks]
        for s in socks:
            s.close()
    return ports
