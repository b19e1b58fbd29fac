"""The goodput policy's prices: expected tokens per predicted second of a step, on the step cost model.

Pure functions of a :class:`~services.verifier.cost_model.StepCostModel` (forward ``seconds(rows)``, a
drafter call's seconds, per-request overheads) and acceptance curves (expected P of the k-th most
likely node, descending). Seconds are wall seconds of one step.
"""

from __future__ import annotations

from services.verifier.cost_model import StepCostModel

# an exploration drafts at most the nodes whose verify costs this many one-row steps
# (explore_budget): on the q4 CPU curve 1.22 at 4 rows, 1.63 at 5
EXPLORE_STEP_COST = 1.25


def overheads(cost: StepCostModel, requests: int) -> tuple[float, float]:
    """``(o, t)`` the step of ``requests`` decoding requests is priced with: ``o`` per request and ``t``
    per drafted round beyond its drafter call. The cost model's fit
    (:meth:`~services.verifier.cost_model.StepCostModel.overhead_coefficients`) when several requests
    share the step and the fit exists; alone (the c = 1 prices of :func:`could_pay`,
    :func:`saving_per_token`, :func:`explore_budget` too), the per-request moving average and no ``t``
    (pricing ``t`` there made a lone request draft less and run slower: 1.32x of ``ar`` against 1.37x,
    q4, 1 thread, GSM8K, in process; at 4 and 8 requests it is what keeps drafts from losing,
    benchmarks/results/2026-12-04-goodput-overhead)."""
    fit = cost.overhead_coefficients() if requests > 1 else None
    return fit if fit is not None else (cost.overhead_seconds, 0.0)


def best_prefix(cost: StepCostModel, gain0: float, rows0: int, probs: list[float], fixed_s: float,
                extra_rows: int = 0) -> tuple[int, float, float]:
    """Best ``k`` of ``(gain0 + sum probs[:k]) / seconds(k)`` (``probs`` descending):
    ``(k, gain, seconds)``, where ``seconds(k) = forward(rows0) + fixed_s`` plus the marginal cost of
    ``k`` more rows in a step that also carries ``extra_rows`` prompt-chunk rows. The prompt chunk's
    own time is left out: it emits no token this step, and counting it would make any draft look cheap
    next to it (a 2 s prefill step "hides" a 50 ms drafter call). Exact: every row costs the same
    whoever it belongs to, so the best set of k nodes is the k most likely."""
    base = cost.forward_seconds(rows0) + fixed_s
    full0 = cost.forward_seconds(rows0 + extra_rows)
    best = (0, gain0, base)
    g = gain0
    for k, p in enumerate(probs, start=1):
        g += p
        t = base + cost.forward_seconds(rows0 + extra_rows + k) - full0
        if t > 0 and g / t > best[1] / best[2] + 1e-12:
            best = (k, g, t)
    return best


def could_pay(cost: StepCostModel, requests: int, top: int, drafter: bool = True) -> bool:
    """Whether a steady drafter call could pay at all in a step of ``requests`` decoding requests (one
    row each): one request's chain of k <= ``top`` nodes, every one accepted, beats the plain step's
    tokens per second on the cost curve for some k, its k rows priced at the batch's size
    (``forward(n + k) - forward(n)``: where batching already fills the step, extra rows can cost a
    large part of a step). ``drafter=False``: the drafter call free (whether the rows alone could pay,
    whatever the drafter comes to cost)."""
    n = max(requests, 1)
    o, e = overheads(cost, n)
    plain = n / (cost.forward_seconds(n) + o * n)
    d = cost.draft_cost(1) + e if drafter else 0.0
    return any((n + k) / (d + cost.forward_seconds(n + k) + o * n) > plain for k in range(1, top + 1))


def saving_per_token(cost: StepCostModel, curve: list[float], requests: int = 1) -> float:
    """Seconds of the step's wall time saved per token a request emits when it drafts with the forecast
    ``curve`` (steady drafter call, best number of nodes) in a step of ``requests`` decoding requests
    (one row each), its rows priced at the batch's size: ``(G * T0 / n - T1) / g``, where ``T0`` is the
    plain step, ``T1`` the step with its tree, ``g`` its expected tokens a round and ``G = n - 1 + g``
    the step's. At c = 1: ``T0 - T1 / g``. 0 where drafting does not pay."""
    n = max(requests, 1)
    o, e = overheads(cost, n)
    k, big_g, t = best_prefix(cost, float(n), n, list(curve), cost.draft_cost(1) + e + o * n)
    g = big_g - (n - 1)
    if not k or g <= 0:
        return 0.0
    return max((big_g * (cost.forward_seconds(n) + o * n) / n - t) / g, 0.0)


def explore_budget(cost: StepCostModel, curve: list[float], cap: int) -> int:
    """Budget of an exploration (a draft made regardless of the forecast by a request that has drafted
    before) whose forecast is ``curve``: one node more than the forecast's best budget at c = 1 (steady
    drafter call; at least 2), and no more nodes than a verify costing at most
    :data:`EXPLORE_STEP_COST` one-row steps holds (on a q4 CPU the kernel's 4-row tile: 3; on a flat,
    memory-bound curve ``cap``). An exploration asks whether the drafter is better than its forecast,
    which its first nodes answer; drafting ``B_max`` there cost a full block and, on a q4 CPU, up to a
    9-row verify (~2.5 steps) in rounds the forecast expected not to pay. Deeper nodes are learnt by
    the policy's widening calls. A request's first draft (its probe) keeps the whole budget: its own
    forecast starts from that tree, and a small first tree left GSM8K requests plain through HTTP
    (0.98x of ``ar`` vs 1.07x with whole probes, benchmarks/results/2026-12-03-cpu-small-trees-http-lean).
    Always in ``[1, cap]``."""
    k = best_prefix(cost, 1.0, 1, list(curve), cost.draft_cost(1) + cost.overhead_seconds)[0]
    one = cost.forward_seconds(1)
    within = max((n for n in range(1, cap + 1) if cost.forward_seconds(1 + n) <= EXPLORE_STEP_COST * one),
                 default=1)
    return min(max(k + 1, 2), within)  # within is in [1, cap]
