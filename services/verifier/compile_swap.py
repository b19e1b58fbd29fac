"""Compiled CPU steps built off the critical path, then swapped in between requests.

A q4 llama target on CPU serves faster on its compiled lean step (:mod:`services.verifier.lean_step`),
but compiling it on a cold inductor cache takes tens of seconds on a 2-core CPU. So ``dartree serve``
does not wait for it:

1. **Warm cache** (a previous build of the same steps loaded in a server: :func:`~services.verifier.warm_steps.cache_is_warm`,
   keyed by :func:`~services.verifier.warm_steps.steps_key`): the verifier loads the compiled step at start
   (:meth:`~services.verifier.swap_in.CompiledSwapIn.use_compiled`: dynamo traces the step,
   inductor reads its kernels from disk; no code generation) and serves on it from the first request.
2. **Cold cache**: the verifier is ready on the eager step. A child process
   (:class:`BackgroundCompile`, at the lowest CPU priority, ``os.nice(19)``) loads the same target
   and compiles the same steps, which writes inductor's disk cache. A process rather than a thread:
   on 2 cores a thread would take the GIL and the cores from the serving steps at normal priority,
   and the compiler's ~100 MB of in-memory state dies with the process instead of staying resident.
3. When the child is done, :class:`StepSwap` loads the compiled step in the verifier (from the
   disk cache) at a moment no request is in flight: at once when the engine is idle; else new
   requests wait for the running ones to finish for at most ``hold_s`` seconds, after which they
   are admitted again and the swap waits for the next idle moment. A request therefore runs on one
   step kind from its first row to its last. The compiled step's bits are not the eager step's, so
   the cached prefixes the eager step wrote are dropped at the swap.
4. A failure (in the child, or loading in the verifier) leaves the eager step serving, logged in one
   line (the child's own output goes to ``compile.log`` beside inductor's cache). Nothing about the
   failure is remembered: the next start tries again.

A successful swap records the steps as warm (:func:`~services.verifier.warm_steps.remember_warm`), so a restart takes path 1.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.verifier.warm_steps import forget_warm, one_line, remember_warm, steps_key

log = logging.getLogger("verifier")

CHILD_LOG = "compile.log"


# ------------------------------------------------------------------------------ the child process

@dataclass(frozen=True)
class CompileJob:
    """What the child needs to build the verifier's compiled steps exactly as it would.

    Attributes:
        config: the verifier's config, its ``engine`` as built (resolved limits).
        drafter: the drafter's handshake info (its tapped layers shape the step), or None.
        rows: the warm-up's row counts; pack: :func:`services.verifier.build.pack_rule`'s arguments
            (None: no GEMM packs); threads: torch's intra-op threads (the verifier's).
    """

    config: object
    drafter: object
    rows: tuple[int, ...]
    pack: tuple[int, int, int] | None
    threads: int


def compile_steps(job: CompileJob) -> tuple[float, int]:
    """Load the target of ``job`` and compile its steps (writes inductor's disk cache); returns
    ``(seconds of the warm-up, graphs compiled)``. Runs in the child process."""
    from dataclasses import replace

    import torch
    from torch._dynamo.utils import counters

    from services.verifier.build import load_target, make_runner

    torch.set_num_threads(job.threads)
    target, _ = load_target(job.config, job.drafter)
    runner = make_runner(target, replace(job.config.engine, compile=True, cuda_graphs=None))
    if job.pack is not None:
        target.pack_for_steps(*job.pack, lazy=True)
    seconds = runner.warm_up(job.rows)
    return seconds, int(counters["inductor"]["fxgraph_cache_miss"])


def _child_main() -> None:
    """The child's body (``python -m services.verifier.compile_swap``): the pickled ``(entry, job,
    parent pid)`` on stdin; lowest priority; its output to :data:`CHILD_LOG`; ``entry(job)``'s result
    or its error (one line) as one JSON line on its original stdout."""
    import json
    import pickle
    import sys

    from services.machine_cache import inductor_cache_dir
    from services.runtime import prepare_process

    entry, job, parent_pid = pickle.load(sys.stdin.buffer)
    os.nice(19)
    result = os.fdopen(os.dup(1), "w")
    path = inductor_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / CHILD_LOG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    prepare_process("dartree-compile", "WARNING", parent_pid)
    try:
        msg = ["ok", *entry(job)]
    except BaseException as exc:  # noqa: BLE001 - every failure is reported as one line
        import traceback

        traceback.print_exc()  # to compile.log, not to the server's log
        msg = ["error", one_line(exc)]
    result.write(json.dumps(msg) + "\n")
    result.close()


class BackgroundCompile:
    """A child process (``python -m services.verifier.compile_swap``, at ``nice`` 19) running
    ``entry(job)`` (default :func:`compile_steps`; ``entry`` must be importable by name).

    :meth:`poll` returns None while it runs, then once ``("ok", seconds, graphs)`` or
    ``("error", one line)``; :meth:`close` ends it (SIGTERM by its pid) if it still runs.
    """

    def __init__(self, job: CompileJob, entry: Callable = compile_steps):
        import pickle
        import subprocess
        import sys

        from services.machine_cache import use_inductor_cache

        use_inductor_cache()  # the child writes where this process will read
        self.proc = subprocess.Popen([sys.executable, "-m", "services.verifier.compile_swap"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.proc.stdin.write(pickle.dumps((entry, job, os.getpid())))
        self.proc.stdin.close()
        self.started = time.monotonic()
        self._result: tuple | None = None

    def poll(self) -> tuple | None:
        """The child's result once it has exited, else None."""
        import json

        if self._result is None and self.proc.poll() is not None:
            try:
                self._result = tuple(json.loads(self.proc.stdout.read().decode() or "null") or ())
            except ValueError:
                self._result = ()
            self.proc.stdout.close()
            if not self._result:
                self._result = ("error", f"the compile process exited with code {self.proc.returncode}")
        return self._result

    def close(self) -> None:
        """End the child if it still runs (SIGTERM by its pid) and reap it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        if not self.proc.stdout.closed:
            self.proc.stdout.close()


# ------------------------------------------------------------------------------ the swap

def start_background_compile(config, engine, drafter) -> "StepSwap | None":
    """The :class:`StepSwap` of a verifier whose engine started eager with its compiled steps
    deferred (``engine.runner.deferred_rows``; ``config``: its :class:`VerifierWorkerConfig`,
    ``drafter``: the drafter's handshake info or None), their compile started in a child process;
    None when nothing is deferred."""
    import torch

    from services.verifier.build import pack_rule
    from services.verifier.config import default_knobs

    rows = engine.runner.deferred_rows
    if rows is None:
        return None
    pack = pack_rule(default_knobs(config).budget, engine.max_draft_depth, config.engine.max_running,
                     drafter is not None) if config.packed_gemm else None
    job = CompileJob(config, drafter, rows, pack, torch.get_num_threads())
    return StepSwap(engine.runner, BackgroundCompile(job), steps_key(engine.runner.target, rows))


def _resweep_costs(engine) -> None:
    """The goodput policy's forward costs timed again on the compiled step just swapped in (its
    start-up sweep timed the eager one: ~1.3x slower a row on the 2-core CPU, and growing otherwise
    with the row count); a failure keeps the eager sweep, which real steps then correct, with one line."""
    cost = getattr(getattr(engine, "policy", None), "cost", None)
    if getattr(cost, "resweep", None) is None:
        return
    try:
        cost.resweep()
    except Exception as exc:  # noqa: BLE001 - serving goes on; the steps' own timings refine the model
        log.warning("step cost model: no sweep of the compiled step (%s); real steps correct the eager one's",
                    one_line(exc))


class StepSwap:
    """The verifier's side of a background compile: poll the child, then swap at a safe point.

    Args:
        runner: the engine's eager :class:`~services.verifier.runner.ModelRunner` (``deferred_rows`` set).
        build: the started :class:`BackgroundCompile`; key: :func:`~services.verifier.warm_steps.steps_key` of the steps.
        hold_s: once the compiled step is ready and requests run, new ones wait at most this long
            for the running ones to finish (then the swap waits for the next idle moment).

    ``state``: ``"compiling"`` -> ``"ready"`` (the child is done) -> ``"compiled"`` (swapped in), or
    ``"eager"`` after a failure (one log line; the eager step serves on).
    """

    def __init__(self, runner, build: BackgroundCompile, key: str, hold_s: float = 10.0):
        self.runner, self.build, self.key, self.hold_s = runner, build, key, hold_s
        self.state = "compiling"
        self.reason = ""
        self._hold_since: float | None = None

    @property
    def detail(self) -> str:
        """The readiness notice while the eager step serves (empty once the compiled step does)."""
        if self.state in ("compiling", "ready"):
            return "serving on the eager step while the compiled step is built in the background"
        if self.state == "eager":
            return f"serving on the eager step: the compiled step could not be built ({self.reason})"
        return ""

    def holds_admissions(self, running: int) -> bool:
        """Whether new requests wait now: the compiled step is ready, ``running`` requests run, and
        they have not yet been waited for ``hold_s`` seconds."""
        if self.state != "ready" or running == 0:
            self._hold_since = None
            return False
        now = time.monotonic()
        if self._hold_since is None:
            self._hold_since = now
        return now - self._hold_since < self.hold_s

    def tick(self, engine, running: int) -> bool:
        """Poll the child; swap the compiled step in when it is ready and ``running`` == 0 (then the
        engine's cached prefixes are dropped). Returns True when this call swapped."""
        if self.state == "compiling":
            self._poll()
        if self.state != "ready" or running or engine.num_active():
            return False
        return self._swap(engine)

    def _poll(self) -> None:
        msg = self.build.poll()
        if msg is None:
            return
        if msg[0] == "ok":
            self.state = "ready"
            log.info("compiled steps built in the background in %.0f s (%d graphs); swapping them in at the "
                     "next moment no request runs", time.monotonic() - self.build.started, msg[2])
        else:
            self._fail(msg[1], "in the background")

    def _swap(self, engine) -> bool:
        from torch._dynamo.utils import counters

        before = int(counters["inductor"]["fxgraph_cache_miss"])
        try:
            seconds = self.runner.use_compiled(self.runner.deferred_rows)
        except Exception as exc:  # noqa: BLE001 - the eager step serves on; one line says why
            forget_warm(self.key)
            self._fail(one_line(exc), "loading it")
            return False
        engine.runner.cache.prefix.clear()  # written by the eager step: other bits than the compiled one's
        missed = int(counters["inductor"]["fxgraph_cache_miss"]) - before
        self.state = "compiled"
        remember_warm(self.key, seconds)
        log.info("compiled step swapped in (loaded in %.1f s%s); new requests run on it",
                 seconds, f", {missed} graphs compiled here: the disk cache missed" if missed else "")
        _resweep_costs(engine)
        return True

    def _fail(self, reason: str, where: str) -> None:
        from services.machine_cache import inductor_cache_dir

        self.state, self.reason = "eager", reason
        more = f"; its output: {inductor_cache_dir() / CHILD_LOG}" if where == "in the background" else ""
        log.warning("the compiled step could not be built (%s: %s%s); serving on the eager step, the next start "
                    "tries again", where, reason, more)

    def close(self) -> None:
        """End the child if it still runs."""
        self.build.close()


if __name__ == "__main__":
    _child_main()
