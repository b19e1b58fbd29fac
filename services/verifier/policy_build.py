"""Building a speculation policy by name (``--spec-policy``), and the goodput policy with its cost sweep.

Kept apart from the policies themselves (:mod:`services.verifier.policy_base`,
:mod:`services.verifier.policy`) because building one may time the target's forward
(:func:`goodput_with_sweep`), which the policies' step logic never does.
"""

from __future__ import annotations

import logging

from services.spec import POLICIES
from services.verifier.policy import GoodputPolicy
from services.verifier.policy_base import FixedPolicy

log = logging.getLogger("verifier.policy")


def goodput_with_sweep(time_forward, key: str, max_budget: int | None = None, sweep: bool = True,
                       dtype: str = "default", threads: int = 1, rows: tuple[int, ...] | None = None,
                       device: str = "cpu", **kw) -> GoodputPolicy:
    """A :class:`GoodputPolicy` whose cost model starts from a timed sweep (``time_forward(rows)`` ->
    seconds, at ``threads`` intra-op threads, on ``device``), taken from the per-machine cache under
    ``key`` when one is there. ``rows``: the row counts swept (None:
    :func:`~services.verifier.cost_model.sweep_rows` of ``max_budget``, else
    :data:`~services.verifier.cost_model.SWEEP_ROWS`).

    :func:`~services.verifier.cost_model.startup_sweep`: a cached sweep is used while plausible and
    still valid (two row counts re-timed); a fresh one is cached only when no other process had the
    cores, every row count's fastest time was reproduced and its curve is plausible, else retaken
    once and then replaced by the rule-based curve of ``dtype`` (not cached). One log line says which.
    """
    from services.verifier.cost_model import SWEEP_ROWS, sweep_rows

    policy = GoodputPolicy(max_budget=max_budget, **kw)
    if not sweep:
        return policy
    rows = rows or (sweep_rows(max_budget) if max_budget else SWEEP_ROWS)
    sweep_into(policy.cost, time_forward, key, dtype, rows, threads, device)
    return policy


def sweep_into(cost, time_forward, key: str, dtype: str, rows: tuple[int, ...], threads: int, device: str,
               step: str = "", replace: bool = False) -> str:
    """Take :func:`~services.verifier.cost_model.startup_sweep` (``time_forward(rows)`` -> seconds,
    cached under ``key``) and seed ``cost`` (a :class:`~services.verifier.cost_model.StepCostModel`)
    with it, or with ``replace`` :meth:`~services.verifier.cost_model.StepCostModel.reseed` it (its
    earlier forward samples forgotten). One log line (a warning for the rule-based curve) names the
    source, ``step`` (e.g. ``"compiled"``) when given, the fitted line and the samples. Returns the source."""
    from services.verifier.cost_model import startup_sweep

    samples, source = startup_sweep(time_forward, key, dtype, rows=rows, threads=threads, device=device)
    (cost.reseed if replace else cost.seed)(samples)
    a, b = cost.coefficients()
    (log.warning if "rule" in source else log.info)(
        "step cost model%s (%s): forward = %.2f ms + %.3f ms/row (%s)", f" of the {step} step" if step else "",
        source, a * 1e3, b * 1e3, ", ".join(f"{r} rows {s * 1e3:.1f} ms" for r, s in samples))
    return source


def make_policy(name: str, **kw):
    """``"fixed"`` -> :class:`FixedPolicy` (``schedule`` and ``defaults`` passed on);
    ``"goodput"`` -> :class:`GoodputPolicy` (every kwarg passed on).

    Raises:
        ValueError: unknown policy name.
    """
    if name == "fixed":
        return FixedPolicy(**{k: v for k, v in kw.items() if k in ("schedule", "defaults")})
    if name == "goodput":
        return GoodputPolicy(**kw)
    raise ValueError(f"unknown spec policy {name!r} (choose from {', '.join(POLICIES)})")
