"""Timing start-up measurements on a machine that may be busy: one interleaved loop and its guards.

Torch-free. Both start-up measurements use it: the weight-format choice
(:mod:`services.weight_choice`: formats x row counts) and the step cost sweep
(:mod:`services.verifier.cost_model`: row counts).

What the timings of an idle 2-core VM look like (``benchmarks/results/2026-12-03-first-start-cached``,
``scatter.py`` and ``share.py``): the same q4 one-row step, timed 30 times with nothing else running
(steal time 0-1 %, other processes 0.02 CPU seconds over the block), runs in phases of a few calls
to a few seconds at 1.0-1.6x its fastest time, at 2 threads *and* at 1 thread; a lone fastest call
is common, and half the repeats or more can sit at 1.5x. A rule on the spread of the repeats (max /
min, upper median / min) therefore rejects most idle measurements. Noise only makes a call slower,
so the statistic here is the **fastest time reproduced**: the smallest repeat that another repeat
confirms within :data:`REPRODUCE_TOL` (sorted times ``x0 <= x1 <= ...``: the first ``x[i+1]`` with
``x[i+1] <= (1 + tol) x[i]``), so a lone lucky call does not set the figure either. Rounds continue
(every step once per round, interleaved: A B A B ..., so a slow phase lands on every step alike)
until every step has one, at least ``min_rounds`` and at most ``max_rounds``. Each round starts one
step later than the one before, so a periodic disturbance whose period matches a round's length
does not slow the same step every time (in a server whose readiness is polled every 0.1 s, the
sweep's 3-, 6- and 9-row forwards were each reproduced at 1.5-2x their neighbours).

Another process on the cores also reproduces its (slower) times: at 2 threads next to one busy-loop
process the one-row step ran 46.1 / 46.3 ms instead of 23.6 ms. What gives it away is the timing
process's **CPU share**: its CPU seconds over the wall seconds times its threads. OpenMP's workers
spin between parallel regions, so an idle machine gives 0.99; next to one busy process 0.63, next
to a 2-thread torch process 0.57 (at 1 thread, where the competitor took the other core, 0.97-0.99
and the times barely moved). A measurement whose share is below :data:`MIN_CPU_SHARE` was taken on
a busy machine (:func:`busy_reason`); the limit sits between the competing runs (<= 0.63) and a
served first start whose readiness was polled 10 times a second (0.85).

The threads in that share are those the steps can really run on (:func:`usable_threads`): torch's
intra-op threads, capped at the CPUs this process may use (its affinity and its cgroup's CPU
quota: a container limited to 2 CPUs on a 16-core host, where torch starts 16 threads, gets at
most 2 CPU seconds a second). Steps timed on an accelerator (CUDA: the host thread launches
kernels and waits) have no CPU share to judge: :func:`time_interleaved` with ``threads=None``
records none, and :func:`busy_reason` never rejects such a measurement.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

REPRODUCE_TOL = 0.15   # a step's fastest time counts once another repeat lies within 15 % of it
MIN_CPU_SHARE = 0.75   # below: another process had the cores for part of the measurement

# the process's CPU seconds (every thread) and the wall clock; tests replace them to play a busy machine
cpu_seconds: Callable[[], float] = time.process_time
wall_seconds: Callable[[], float] = time.perf_counter
CGROUP_CPU_MAX = ("/sys/fs/cgroup/cpu.max",                                       # cgroup v2: "quota period"
                  ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"))  # v1


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_cpu_quota() -> float | None:
    """CPUs this process's cgroup may use per second of wall time (its CPU quota / period), or None
    when unlimited or unreadable (cgroup v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``)."""
    v2, (quota_path, period_path) = CGROUP_CPU_MAX
    text = _read(v2)
    fields = text.split() if text else [_read(quota_path) or "max", _read(period_path) or "0"]
    try:
        quota, period = float(fields[0]), float(fields[1])
    except (ValueError, IndexError):
        return None  # "max": no quota
    return quota / period if quota > 0 and period > 0 else None


# the CPUs the cgroup's quota allows (None: no quota); tests replace it to play a container
cpu_quota: Callable[[], float | None] = cgroup_cpu_quota


@dataclass
class Timings:
    """What :func:`time_interleaved` measured.

    Attributes:
        times: step -> its timed repeats (the unit its callable returns), in call order.
        cpu_share: CPU seconds of this process / (wall seconds x threads) over the timed rounds
            (1.0 when nothing was timed; None when the steps ran on an accelerator: not judged).
        threads: the threads the share was computed for (0 with no share).
    """

    times: dict
    cpu_share: float | None
    threads: int

    def estimates(self) -> dict:
        """Step -> its :func:`fastest_reproduced` time (the upper median of its repeats where it has
        none: such a measurement is rejected by :func:`unsteady_reason`)."""
        out = {}
        for k, ts in self.times.items():
            est = fastest_reproduced(ts)
            out[k] = est if est is not None else sorted(ts)[len(ts) // 2]
        return out


def fastest_reproduced(ts: list[float], tol: float = REPRODUCE_TOL) -> float | None:
    """The fastest time reproduced (module doc): the smallest of ``ts`` that confirms a faster-or-equal
    repeat within ``tol`` (relative); None when no two repeats are that close (or a time is <= 0)."""
    xs = sorted(ts)
    if not xs or xs[0] <= 0:
        return None
    for lo, hi in zip(xs, xs[1:]):
        if hi <= (1 + tol) * lo:
            return hi
    return None


def reproduced(ts: list[float], tol: float = REPRODUCE_TOL) -> bool:
    """Whether ``ts`` has a fastest time reproduced (:func:`fastest_reproduced`)."""
    return fastest_reproduced(ts, tol) is not None


def usable_threads(threads: int) -> int:
    """``threads`` capped at the CPUs this process may run on: its affinity (``sched_getaffinity``)
    and its cgroup's CPU quota (:data:`cpu_quota`, rounded up)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or threads
    quota = cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, min(int(threads), cpus))


def time_interleaved(steps: dict[Hashable, Callable[[], float]], max_rounds: int = 10, min_rounds: int = 3,
                     warmup: int = 1, threads: int | None = 1, tol: float = REPRODUCE_TOL) -> Timings:
    """Time every ``steps[k]()`` (each call returns its own duration) in rounds, steps interleaved.

    Args:
        steps: step -> a callable that runs the step once and returns how long it took.
        max_rounds, min_rounds: timed rounds at most / at least; between them the loop stops after
            the first round in which every step has a fastest time reproduced.
        warmup: untimed rounds first (first calls of a shape allocate and pick kernels).
        threads: the intra-op threads the steps run with (for the CPU share); None: the steps run
            on an accelerator, no CPU share is recorded.
        tol: the reproduction tolerance.
    Returns:
        :class:`Timings`.
    """
    keys = list(steps)
    out: dict = {k: [] for k in keys}
    for _ in range(max(warmup, 0)):
        for k in keys:
            steps[k]()
    w0, c0 = wall_seconds(), cpu_seconds()
    for i in range(max(max_rounds, 1)):
        j = i % len(keys) if keys else 0
        for k in keys[j:] + keys[:j]:  # each round starts one step later: a periodic disturbance (a
            out[k].append(steps[k]())  # health poll every 0.1 s) does not land on the same step every round
        if i + 1 >= min_rounds and all(reproduced(ts, tol) for ts in out.values()):
            break
    wall, cpu = wall_seconds() - w0, cpu_seconds() - c0
    if threads is None:
        return Timings(out, None, 0)
    n = usable_threads(threads)
    share = cpu / (wall * n) if wall > 0 else 1.0
    return Timings(out, share, n)


def busy_reason(t: Timings, min_share: float = MIN_CPU_SHARE) -> str | None:
    """Why ``t`` was taken on a busy machine (one line), or None: its CPU share below ``min_share``
    (never for a measurement without a share: steps on an accelerator)."""
    if t.cpu_share is not None and t.cpu_share < min_share:
        return (f"the timing process got {t.cpu_share:.0%} of {t.threads} thread(s)' CPU time "
                "(another process on the cores)")
    return None


def unsteady_reason(t: Timings, label: Callable[[Hashable], str] = str, unit: float = 1.0, tol: float = REPRODUCE_TOL
                    ) -> str | None:
    """Why ``t`` cannot be trusted because no two repeats of some step came within ``tol`` of each
    other (one line, times shown in ms: ``unit`` ms per unit of the times), or None."""
    for k, ts in t.times.items():
        if not reproduced(ts, tol):
            shown = ", ".join(f"{x * unit:.1f}" for x in sorted(ts)[:4])
            return f"{label(k)} repeats never within {tol:.0%} of each other in {len(ts)} rounds ({shown} ... ms)"
    return None
