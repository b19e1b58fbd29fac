"""Step cost model of the goodput policy: predicted seconds of a batched step.

Pure (no torch, no models). A step costs

    forward(R) = table(R)            seconds, R = rows of the step's one target forward
    + draft    = sum over drafting requests of (d + e * owed_r)   (the drafter's draft + tree build;
                 owed_r = context tokens the drafter has not seen yet: a request that decoded plainly
                 for a while pays its catch-up in its next draft)
    + overhead = o * (requests)      (walk, commit, emit per request)
               + t * (drafting)      (a drafted round's own work: its tree's buffers and mask, the
                                     policy's forecast and cut, the calibration labels, the walk and
                                     commit of several tokens)

``table`` holds a moving average of the measured seconds per row count and interpolates
piecewise-linearly between the row counts it has seen (made non-decreasing in R by isotonic
regression, so one slow sample lifts its neighbours' average instead of every larger row count): on a CPU the
first extra row is expensive (one row runs a GEMV, more rows a GEMM; pre-packed GEMM weights for
some row counts) and the next dozens nearly free, which no straight line captures. Beyond the
largest row count seen, and while fewer than two row counts are known, the line ``a + b * R``
applies, fitted by least squares with exponential forgetting (each new sample multiplies the
weight of the old ones by ``forget``), so the model follows a machine whose speed changes.
``o`` and ``t`` are a two-coefficient least-squares fit (with forgetting) of each step's time outside
the forward and the drafter wait on its requests and its drafting requests (``o`` alone, an
exponential moving average, and ``t = 0`` until the drafting count varies enough to separate the two:
a server that never drafted has no evidence of ``t``). On the 2-core CPU, ``t`` is ~0.5-2 ms a
drafted round at 8 running requests against a ~35 ms step: left out, it made one request's draft
look like a gain in steps where it was a loss (docs/roofline.md, "Tree round overhead").
``d`` and ``e`` a two-coefficient least-squares fit
(with forgetting) of each step's drafter wait on its drafting requests and their owed tokens (``d`` alone,
the moving average, until the owed tokens vary enough to separate the two). A start-up sweep (:func:`startup_sweep`) times a few forwards at every row count
1 .. 8, at 9, 17 and 33, and on up to B + 1 rows of the configured tree budget (:func:`sweep_rows`:
65 for the CUDA default B = 64) (row counts interleaved, a warm-up round excluded; each row count's
fastest time reproduced, :mod:`services.timing`) so the first steps already have a model; on CUDA
the forwards are timed with CUDA events. A CPU sweep taken while another process had the cores
(the timing process's CPU share; never judged on CUDA, where the host thread only launches and
waits), one whose fastest times were never reproduced, or one whose curve is implausible is taken
again once and then replaced by a rule-based curve that is never cached;
:func:`load_cached` / :func:`save_cached` keep an accepted sweep per machine / model / dtype.

Source: SmartSpec / TurboSpec use the same "goodput = expected tokens / predicted
step time" with a linear batch-time model.
"""

from __future__ import annotations

import bisect
import logging
import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from services.machine_cache import drop_entry, read_entries, state_dir, write_entry
from services.timing import Timings, busy_reason, time_interleaved, unsteady_reason

log = logging.getLogger("verifier.cost")

# every row count of a small step (1 .. 8: the int4 kernel's 4-row tile edge shows), the CPU default
# tree's verify (9) and two larger steps
SWEEP_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 33)
# extra seconds per extra row, as a fraction of a one-row forward, of the rule-based curve. On CUDA a
# verify of a few dozen rows reads the same weights as one row (decoding is bound by reading them):
# 65 rows at ~1.1 one-row steps (an estimate: no GPU has timed this code yet)
RULE_SLOPE = {"float32": 0.1, "default": 0.03}
RULE_SLOPE_CUDA = 0.0015


def sweep_rows(budget: int) -> tuple[int, ...]:
    """Row counts of the start-up sweep for a tree budget ``budget`` (B): :data:`SWEEP_ROWS`, then
    ``2^k + 1`` up to B + 1 and B + 1 itself, so the model has measured every row count a verify of
    the configured budget reaches (B = 64: ... 33, 65; B <= 32: :data:`SWEEP_ROWS`).

    Raises:
        ValueError: ``budget < 1``.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1 (got {budget})")
    rows, k = set(SWEEP_ROWS), 64
    while k + 1 < budget + 1:
        rows.add(k + 1)
        k *= 2
    rows.add(budget + 1)
    return tuple(sorted(rows))


def _add_pair(sums: list, forget: float, x1: float, x2: float, y: float) -> None:
    """Add a sample ``y = c1 * x1 + c2 * x2`` to the forgetful sums ``[x1 x1, x1 x2, x2 x2, x1 y, x2 y]``
    of a two-coefficient least-squares fit without intercept (old samples weigh ``forget`` each)."""
    for i in range(5):
        sums[i] *= forget
    sums[0] += x1 * x1
    sums[1] += x1 * x2
    sums[2] += x2 * x2
    sums[3] += x1 * y
    sums[4] += x2 * y


def _solve_pair(sums: list) -> tuple[float, float] | None:
    """``(c1, c2)`` of :func:`_add_pair`'s sums; None while ``x1`` and ``x2`` have not varied enough
    apart to separate them, or when a coefficient would be negative."""
    aa, ab, bb, ay, by = sums
    det = aa * bb - ab * ab
    if aa <= 0 or det <= 1e-9 * max(aa * bb, 1e-30):
        return None
    c1, c2 = (bb * ay - ab * by) / det, (aa * by - ab * ay) / det
    if c1 < 0 or c2 < 0:
        return None
    return c1, c2


@dataclass
class StepCostModel:
    """Online linear model of step time.

    Args:
        forget: weight kept by old forward samples per new sample (0 < forget <= 1).
        ema: weight of a new draft / overhead sample in its moving average.
        prior_a, prior_b: the model before any sample (seconds, seconds per row).
    Raises:
        ValueError: ``forget`` or ``ema`` outside ``(0, 1]``.
    """

    forget: float = 0.98
    ema: float = 0.1
    prior_a: float = 0.02
    prior_b: float = 0.002
    table_ema: float = 0.2
    draft_seconds: float | None = None     # per drafting request (moving average)
    _d: list = field(default_factory=lambda: [0.0] * 5)  # sum n^2, n k, k^2, n y, k y (n drafts, k owed, y s)
    overhead_seconds: float = 0.0          # per request in the step (moving average over all steps)
    _o: list = field(default_factory=lambda: [0.0] * 5)  # sum n^2, n m, m^2, n y, m y (n requests, m drafting, y s)
    samples: int = 0
    _s: list[float] = field(default_factory=lambda: [0.0] * 5)  # sum w, w x, w y, w x^2, w x y
    _table: dict = field(default_factory=dict)                   # rows -> moving average of seconds
    _hull: tuple | None = field(default=None, repr=False)        # (xs, ys, a, b) until the next sample
    _seed: dict = field(default_factory=dict)                    # rows -> seconds of the start-up sweep
    # re-takes the start-up sweep on the runner's current step and :meth:`reseed`\ s this model with
    # it (set where the sweep was taken; the verifier calls it when a compiled step replaces the
    # eager one it started on); None: no sweep to retake
    resweep: Callable[[], object] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.forget <= 1 or not 0 < self.ema <= 1:
            raise ValueError(f"forget and ema must be in (0, 1] (got {self.forget}, {self.ema})")

    # ---------------------------------------------------------------- fitting
    def observe_forward(self, rows: int, seconds: float) -> None:
        """Add one measured forward of ``rows`` rows that took ``seconds``."""
        if rows < 1 or not seconds > 0:
            return
        s = self._s
        for i in range(5):
            s[i] *= self.forget
        x, y = float(rows), float(seconds)
        s[0] += 1.0
        s[1] += x
        s[2] += y
        s[3] += x * x
        s[4] += x * y
        self.samples += 1
        old = self._table.get(rows)
        self._table[rows] = y if old is None else (1 - self.table_ema) * old + self.table_ema * y
        self._hull = None

    def observe_draft(self, seconds_per_request: float, drafting: int = 1, owed_tokens: int | None = None) -> None:
        """Add one step's measured drafter time: ``seconds_per_request`` per drafting request, for
        ``drafting`` requests that owed ``owed_tokens`` context tokens in all (None: unknown)."""
        if seconds_per_request < 0:
            return
        d = self.draft_seconds
        self.draft_seconds = seconds_per_request if d is None else (1 - self.ema) * d + self.ema * seconds_per_request
        if owed_tokens is None or drafting < 1:
            return
        _add_pair(self._d, self.forget, float(drafting), float(owed_tokens), seconds_per_request * drafting)

    def draft_coefficients(self) -> tuple[float, float] | None:
        """``(d, e)``: a draft costs ``d + e * owed`` seconds; None while the owed tokens have not varied
        enough to separate the two (or a fit would be negative)."""
        return _solve_pair(self._d)

    def observe_overhead(self, seconds_per_request: float, requests: int = 0, drafting: int = 0) -> None:
        """Add one measured per-request overhead (step wall time - forward - draft, per request) of a
        step of ``requests`` decoding requests of which ``drafting`` called the drafter (0 requests:
        unknown, the moving average only)."""
        if seconds_per_request < 0:
            return
        self.overhead_seconds = (1 - self.ema) * self.overhead_seconds + self.ema * seconds_per_request
        if requests < 1:
            return
        _add_pair(self._o, self.forget, float(requests), float(min(max(drafting, 0), requests)),
                  seconds_per_request * requests)

    def overhead_coefficients(self) -> tuple[float, float] | None:
        """``(o, t)``: a step's time outside its forward and drafter wait is ``o * requests + t *
        drafting``; None while the drafting count has not varied enough against the request count to
        separate the two (or a fit would be negative)."""
        return _solve_pair(self._o)

    def request_overhead(self) -> float:
        """Seconds a step spends per request outside its forward and drafter wait (``o``)."""
        fit = self.overhead_coefficients()
        return fit[0] if fit is not None else self.overhead_seconds

    def round_overhead(self) -> float:
        """Extra seconds per drafting request of a step (``t``; 0 before the fit can see it)."""
        fit = self.overhead_coefficients()
        return fit[1] if fit is not None else 0.0

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)``: forward seconds = a + b * rows. Falls back to the prior (or a proportional
        fit through one row count) while the samples cannot separate the two; b is kept >= 0."""
        w, sx, sy, sxx, sxy = self._s
        if w <= 0:
            return self.prior_a, self.prior_b
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx):  # one row count so far: keep the prior's slope
            b = self.prior_b
            return max(my - b * mx, 0.0), b
        b = max((sxy / w - mx * my) / var, 0.0)
        return max(my - b * mx, 0.0), b

    # ------------------------------------------------------------ prediction
    def _seed_at(self, rows: int) -> float:
        """The start-up sweep interpolated at ``rows`` (its end values outside its range)."""
        xs = sorted(self._seed)
        return _interpolate(xs, [self._seed[x] for x in xs], rows)

    def _points(self) -> dict:
        """Row count -> seconds: every row count measured in real steps, plus the sweep's other row
        counts shifted by how far real steps sit from the sweep. The sweep runs in an empty KV slot;
        real steps read contexts, which adds seconds to every row count of a step, so the sweep
        still gives the *marginal* cost of more rows, and the real steps give the level.

        The shift at a sweep row count is interpolated between the shifts of the nearest real row
        counts below and above it (the nearest one's beyond them), not their mean: real steps of
        different row counts sit at different distances from the sweep (R rows read the context R
        times; a rare 9-row probe right after a prompt ran 12.6 ms above the sweep where plain
        steps ran 1.0 ms above it, 2-core VM, 2026-12-05), and a mean lifted the 2- and 3-row
        entries above the measured 4-row one, which the isotonic fit then pooled: small trees
        looked as dear as a 4-row verify."""
        pts = dict(self._table)
        if self._seed:
            lo, hi = min(self._seed), max(self._seed)
            real = sorted(r for r in self._table if lo <= r <= hi)
            offs = [self._table[r] - self._seed_at(r) for r in real]
            for x, y in self._seed.items():
                if x not in pts:
                    pts[x] = max(y + (_interpolate(real, offs, x) if real else 0.0), 1e-9)
        return pts

    def _fit(self) -> tuple[list[int], list[float], float, float]:
        """``(xs, ys, a, b)``: the table's row counts with their isotonic (non-decreasing, pool
        adjacent violators) seconds, and the line; cached until the next sample."""
        if self._hull is None:
            pts = self._points()
            xs = sorted(pts)
            blocks: list[list[float]] = []  # [sum, count]
            for x in xs:
                blocks.append([pts[x], 1.0])
                while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                    s, n = blocks.pop()
                    blocks[-1][0] += s
                    blocks[-1][1] += n
            ys = [s / n for s, n in blocks for _ in range(int(n))]
            self._hull = (xs, ys, *self.coefficients())
        return self._hull

    def forward_seconds(self, rows: int) -> float:
        """Predicted forward seconds for ``rows`` rows (table interpolation, else the line)."""
        xs, ys, a, b = self._fit()
        if len(xs) < 2:
            return a + b * max(rows, 0)
        if rows <= xs[0]:
            return ys[0]
        if rows >= xs[-1]:
            return ys[-1] + b * (rows - xs[-1])
        return _interpolate(xs, ys, rows)

    def per_row_seconds(self) -> float:
        """Marginal seconds of one more row of the line (``b``)."""
        return self.coefficients()[1]

    def draft_cost(self, owed: int | None = None) -> float:
        """Predicted drafter seconds of one drafting request that owes ``owed`` context tokens (None:
        an average request); 0 before any measurement."""
        fit = self.draft_coefficients() if owed is not None else None
        if fit is not None:
            return fit[0] + fit[1] * owed
        return self.draft_seconds or 0.0

    def step_seconds(self, rows: int, drafting: int, requests: int) -> float:
        """Predicted wall seconds of a step: forward + drafter calls + per-request and per-drafted-round
        overhead."""
        return self.forward_seconds(rows) + (self.draft_cost() + self.round_overhead()) * drafting + \
            self.request_overhead() * requests

    def state(self) -> dict:
        """JSON-able fitted state (for the cache)."""
        a, b = self.coefficients()
        return {"a": a, "b": b, "table": {str(k): v for k, v in sorted(self._points().items())},
                "draft_seconds": self.draft_seconds, "overhead_seconds": self.request_overhead(),
                "round_overhead_seconds": self.round_overhead()}

    def reseed(self, samples: Iterable[tuple[int, float]]) -> None:
        """Forget every forward sample (line, table, sweep), then :meth:`seed` with ``samples``: the
        step being timed changed (a compiled step swapped in for the eager one). The draft and
        overhead fits are kept."""
        self._s, self.samples, self._table, self._seed, self._hull = [0.0] * 5, 0, {}, {}, None
        self.seed(samples)

    def seed(self, samples: Iterable[tuple[int, float]]) -> None:
        """Add start-up samples ``(rows, seconds)``: they seed the line like real samples, and the
        table as the sweep (shifted to the level of real steps once there are some, :meth:`_points`)."""
        table = dict(self._table)
        for rows, seconds in samples:
            self.observe_forward(rows, seconds)
            if rows >= 1 and seconds > 0:
                self._seed[rows] = float(seconds)
        self._table = table
        self._hull = None


def sweep_times(run_rows: Callable[[int], float], rows: Iterable[int] = SWEEP_ROWS, max_rounds: int = 8,
                min_rounds: int = 3, threads: int | None = 1) -> Timings:
    """Row count -> timed seconds of ``run_rows(R)`` (one forward of R rows, returning its seconds),
    row counts interleaved (1 2 ... 33, 1 2 ... 33, ...) after one untimed warm-up round, until every
    row count's fastest time is reproduced (:func:`services.timing.time_interleaved`; ``threads``
    None: forwards on an accelerator, no CPU share)."""
    calls = {int(r): (lambda r=int(r): run_rows(r)) for r in rows}
    return time_interleaved(calls, max_rounds, min_rounds, threads=threads)


def calibration_sweep(run_rows: Callable[[int], float], rows: Iterable[int] = SWEEP_ROWS, max_rounds: int = 8,
                      threads: int | None = 1) -> list[tuple[int, float]]:
    """``[(rows, seconds)]``: each row count's fastest time reproduced (:func:`sweep_times`), so a slow
    call (another process on the core, a slow phase of a VM) does not skew the fit."""
    return sorted(sweep_times(run_rows, rows, max_rounds, threads=threads).estimates().items())


def sweep_rejection(t: Timings) -> str | None:
    """Why a sweep cannot be trusted (one line), or None: another process had the cores (a sweep
    with a CPU share only: never on CUDA), or a row count's fastest time was never reproduced
    (:mod:`services.timing`), or its curve is not :func:`plausible`."""
    why = busy_reason(t) or unsteady_reason(t, lambda r: f"{r}-row", unit=1e3)
    if why:
        return why
    samples = sorted(t.estimates().items())
    if not plausible(samples):
        return "the curve is not plausible: " + ", ".join(f"{r}:{s * 1e3:.1f}" for r, s in samples) + " ms"
    return None


def rule_curve(one_row_seconds: float, dtype: str, rows: Iterable[int] = SWEEP_ROWS, device: str = "cpu"
               ) -> list[tuple[int, float]]:
    """A sweep by rule, for when the measured one cannot be trusted: ``t(R) = t1 * (1 + s * (R - 1))``
    with ``s = RULE_SLOPE[dtype]`` on a CPU (float32 GEMMs cost more per extra row than the 4-bit /
    bf16 kernels, which are bound by reading the weights), :data:`RULE_SLOPE_CUDA` on CUDA."""
    s = RULE_SLOPE_CUDA if str(device).startswith("cuda") else RULE_SLOPE.get(dtype, RULE_SLOPE["default"])
    return [(int(r), one_row_seconds * (1 + s * (int(r) - 1))) for r in rows]


def startup_sweep(run_rows: Callable[[int], float], key: str, dtype: str, path: Path | None = None,
                  rows: Iterable[int] = SWEEP_ROWS, max_rounds: int = 8, tries: int = 2, threads: int = 1,
                  device: str = "cpu") -> tuple[list[tuple[int, float]], str]:
    """The start-up samples of the cost model and where they come from (one line).

    A cached sweep is used while it covers ``rows``, is :func:`plausible` and :func:`still_valid`. Else a sweep is taken
    (:func:`sweep_times`, at ``threads`` intra-op threads; on a CUDA ``device`` with no CPU share:
    the host's threads do not run the forward) and accepted unless :func:`sweep_rejection` finds a
    reason; it is then cached. After ``tries`` rejected sweeps the rule's curve (:func:`rule_curve`
    of ``device``, from the fastest one-row time seen) is used and nothing is cached.
    """
    rows = tuple(rows)
    share_threads = None if str(device).startswith("cuda") else threads
    cached = load_cached(key, path)
    covers = cached is not None and set(rows) <= {r for r, _ in cached}  # a larger budget sweeps again
    if covers and plausible(cached) and still_valid(cached, run_rows):
        return cached, "cache"
    note = "" if cached is None else "cached sweep no longer matches this machine's speed; " if covers else \
        f"cached sweep stops at {max(r for r, _ in cached)} rows, short of {max(rows)}; "
    one_row, why = [], ""
    for _ in range(max(tries, 1)):
        t = sweep_times(run_rows, rows, max_rounds, threads=share_threads)
        one_row += t.times.get(min(t.times), [])
        why = sweep_rejection(t) or ""
        if not why:
            samples = sorted(t.estimates().items())
            save_cached(key, samples, path)
            return samples, note + "sweep"
    return rule_curve(min(one_row), dtype, rows, device), (f"{note}rule-based curve ({why}), not cached; "
                                                  "real steps will correct it")


def _interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` through ascending ``xs``; the end values outside their range."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_left(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def plausible(samples: list[tuple[int, float]], slack: float = 1.5) -> bool:
    """Whether a sweep looks like one machine's steady speed: more rows never take less than 2/3 of
    fewer rows' time, nor more than ``slack`` x (the fewer rows' time scaled by the row ratio): R rows
    in one forward cost at most R separate forwards. A sweep taken while another process stole the
    core, or a first-call compile, breaks one of the two."""
    pts = sorted(samples)
    for (r0, t0), (r1, t1) in zip(pts, pts[1:]):
        if t0 <= 0 or t1 < t0 / slack or t1 > slack * t0 * r1 / r0:
            return False
    return all(t > 0 for _, t in pts)


def still_valid(samples: list[tuple[int, float]], run_rows: Callable[[int], float], faster: float = 0.45,
                slower: float = 1.75, repeats: int = 3) -> bool:
    """Re-time the smallest and the largest row count of a cached sweep (a warm-up and ``repeats``
    calls each): False when either's fastest call is more than ``faster`` (relative) below its cached
    figure (the cache was taken under load: 2x too slow) or above ``slower`` times it (the machine is
    slower now). Lenient because noise only makes calls slower and a sweep taken next to a competing
    process is not cached (:mod:`services.timing`): on an idle 2-core VM the same step runs 1.0-1.6x
    its fastest time in phases of seconds, and a sweep's fastest time reproduced can come from a slow
    phase (a cached one-row 42.7 ms was re-timed at > 35 % less and re-swept at a restart). Real steps
    correct the level of the curve anyway (:meth:`StepCostModel._points`)."""
    pts = sorted(samples)
    for r, t in (pts[0], pts[-1]):
        run_rows(r)
        fastest = min(run_rows(r) for _ in range(max(repeats, 1)))
        if fastest < (1 - faster) * t or fastest > slower * t:
            return False
    return True


def cache_key(model: str, dtype: str, device: str, threads: int | None = None) -> str:
    """Key of a cached sweep: machine (host, CPU count, processor) / model / dtype / device / intra-op
    threads (a sweep at 2 threads says nothing about 1)."""
    key = f"{platform.node()}|{os.cpu_count()}|{platform.processor() or platform.machine()}|{model}|{dtype}|{device}"
    return key if threads is None else f"{key}|threads {threads}"


def default_cache_path() -> Path:
    """``<state dir>/cost_model.json`` (:func:`services.machine_cache.state_dir`)."""
    return state_dir() / "cost_model.json"


def load_cached(key: str, path: Path | None = None, max_age_s: float = 7 * 86400) -> list[tuple[int, float]] | None:
    """A cached sweep for ``key`` younger than ``max_age_s`` (None when absent, stale or unreadable)."""
    entry = read_entries(path or default_cache_path()).get(key)
    if not isinstance(entry, dict) or time.time() - entry.get("time", 0) > max_age_s:
        return None
    try:
        return [(int(r), float(s)) for r, s in entry["samples"]]
    except (KeyError, TypeError, ValueError):
        return None


def forget_cached(key: str, path: Path | None = None) -> None:
    """Drop the cached sweep of ``key`` (best effort)."""
    drop_entry(path or default_cache_path(), key)


def save_cached(key: str, samples: list[tuple[int, float]], path: Path | None = None) -> None:
    """Store a sweep under ``key`` (best effort: an unwritable cache only logs)."""
    write_entry(path or default_cache_path(), key, {"samples": [[int(r), float(t)] for r, t in samples]})
