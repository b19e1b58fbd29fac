"""The goodput policy's forecast ageing and its prices at the batch's size, on injected cost curves and
replayed acceptance traces (benchmarks/policy_replay.py: modelled tokens/s, no timing)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from benchmarks.policy_replay import (Q4_CURVE, Q4_ONE_ROW_S, CostCurve, load_trace, replay, seeded_policy,
                                      synthetic_trace, table_forward)
from services.tree import DraftTree
from services.verifier.calibration import AcceptanceCalibrator
from services.verifier.cost_model import StepCostModel
from services.verifier.forecast import FORECAST_RELAX, Forecaster, mean_curve
from services.verifier.pricing import saving_per_token

GSM_LIKE = [0.95, 0.9, 0.8, 0.6, 0.3]
WEAK = [0.5, 0.3, 0.1, 0.05]
RECORDED = Path(__file__).resolve().parents[1] / "benchmarks/results/2026-12-07-policy-replay/trace-gsm8k.json"


def _q4(draft_steps: float = 0.35) -> CostCurve:
    return CostCurve(table_forward(Q4_CURVE, Q4_ONE_ROW_S), draft_steps * Q4_ONE_ROW_S)


def _flat(rows: int) -> float:
    """A step whose extra rows are nearly free (a memory-bound GPU step)."""
    return Q4_ONE_ROW_S * (1.0 + 0.02 * (rows - 1))


def _filled(c: int):
    """Up to ``c`` rows cost about one row; every row beyond costs half a step (batching fills the step)."""
    def forward(rows: int) -> float:
        return Q4_ONE_ROW_S * (1.0 + 0.02 * min(rows - 1, c - 1) + 0.5 * max(rows - c, 0))
    return forward


@pytest.mark.parametrize("c", [4, 8])
def test_at_c4_trees_are_verified_where_rows_are_cheap_and_not_where_they_are_expensive(c):
    """The same traces and drafter at c >= 4: on a curve where extra rows cost half a step, no drafter
    call and no verified node (exactly ``ar``'s tokens/s); on a flat curve the policy verifies trees
    and beats ``ar`` (at c = 8 the replay charges eight drafter calls a step, so only at c = 4)."""
    traces = [synthetic_trace(300, GSM_LIKE, k) for k in range(c)]
    expensive = CostCurve(_filled(c), 0.35 * Q4_ONE_ROW_S)
    got = replay(traces, seeded_policy(expensive, max_budget=8), expensive)
    assert got["verified"] == 0 and got["drafts"] == 0, got
    assert got["tokens_per_s"] == pytest.approx(replay(traces, "ar", expensive)["tokens_per_s"])
    cheap = CostCurve(_flat, 0.35 * Q4_ONE_ROW_S)
    got = replay(traces, seeded_policy(cheap, max_budget=8), cheap)
    ar = replay(traces, "ar", cheap)["tokens_per_s"]
    assert got["verified"] > got["steps"], got           # more than a node a step on average
    assert got["tokens_per_s"] >= (1.1 if c == 4 else 0.95) * ar, (got, ar)


def _model(forward) -> StepCostModel:
    model = StepCostModel()
    model.seed([(r, forward(r)) for r in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16)])
    for _ in range(10):
        model.observe_draft(0.35 * Q4_ONE_ROW_S, 1, 1)
    model.observe_overhead(0.0015, 1, 0)
    return model


def test_a_trees_saving_is_priced_at_the_batchs_size():
    """Alone, the saving per token is the plain step minus the drafted step per expected token; at c = 4
    on a curve where batching fills the step the same forecast saves nothing (its rows cost half a step
    each), and on a flat curve it still saves."""
    curve = [0.9, 0.8, 0.6]
    filled = _model(_filled(4))
    o = filled.overhead_seconds
    t0 = filled.forward_seconds(1) + o
    steps = {k: (1 + sum(curve[:k]), filled.forward_seconds(1 + k) + filled.draft_cost(1) + o) for k in (1, 2, 3)}
    g, t1 = max(steps.values(), key=lambda x: x[0] / x[1])   # the best number of nodes alone
    assert saving_per_token(filled, curve, 1) == pytest.approx(t0 - t1 / g)
    assert saving_per_token(filled, curve, 1) > 0
    assert saving_per_token(filled, curve, 4) == 0.0
    assert saving_per_token(_model(_flat), curve, 4) > 0


def _chain(p: float, n: int = 3) -> DraftTree:
    return DraftTree(torch.arange(1, n + 1), torch.arange(-1, n - 1), torch.arange(1, n + 1),
                     torch.tensor([math.log(p) * (d + 1) for d in range(n)], dtype=torch.float32))


@dataclass
class _Req:
    trees: deque = field(default_factory=lambda: deque(maxlen=8))
    stamps: deque = field(default_factory=lambda: deque(maxlen=8))
    plain: int = 0
    since_draft: int = 0
    curve: tuple | None = None


def test_one_draft_after_a_plain_stretch_does_not_restore_the_stale_windows_weight():
    """Eight low-confidence trees, 20 plain rounds, then one confident tree: the own trees weigh
    ``1 + 7 * RELAX**20`` (not 8, as when the weight was aged per request), and the own curve weighs
    each tree by its age, so the new tree counts more than the seven stale ones together."""
    cal = AcceptanceCalibrator()
    fc = Forecaster(cal, lambda window, regime, weights=None: mean_curve(cal, window, regime, 0.0, 8, weights),
                    lambda: 1)
    st = _Req()
    low, high = _chain(0.2), _chain(0.95)
    for _ in range(7):
        st.trees.append((low, 3))
        st.stamps.append(st.plain)
    st.plain += 20
    st.trees.append((high, 3))
    st.stamps.append(st.plain)
    assert fc.own_weight(st) == pytest.approx(1 + 7 * FORECAST_RELAX ** 20)
    own = fc._own_curve(st, "m:greedy")
    p_high = mean_curve(cal, [(high, 3)], "m:greedy", 0.0, 8)[0]
    p_low = mean_curve(cal, [(low, 3)], "m:greedy", 0.0, 8)[0]
    w = 7 * FORECAST_RELAX ** 20
    assert own[0] == pytest.approx((p_high + w * p_low) / (1 + w))   # each tree by its own age
    assert own[0] > (p_high + 7 * p_low) / 8 + 0.25                  # not the stale window's plain mean
    st.plain += 5  # five more plain rounds: every tree ages
    assert fc.own_weight(st) == pytest.approx(FORECAST_RELAX ** 5 * (1 + 7 * FORECAST_RELAX ** 20))


def test_on_the_recorded_gsm8k_trace_b1_is_reached_within_2_percent():
    """The shipped drafter's GSM8K trace, one request at a time: capped at one node, the policy reaches
    fixed B = 1 within 2 % (0.978 when one draft restored a stale window's weight) and the default
    budget the best fixed small tree within 1.5 % (0.981 then)."""
    cost = _q4()
    traces = [load_trace(RECORDED)]
    fixed = {b: replay(traces, b, cost)["tokens_per_s"] for b in (1, 2, 3)}
    assert replay(traces, seeded_policy(cost, max_budget=1), cost)["tokens_per_s"] >= 0.98 * fixed[1]
    assert replay(traces, seeded_policy(cost, max_budget=8), cost)["tokens_per_s"] >= 0.985 * max(fixed.values())


def test_where_no_tree_pays_the_policy_decodes_plainly():
    """Weak drafts and a drafter call costing a whole step: fixed B = 1 loses to ``ar`` by ~30 %; the
    policy drafts in at most 5 % of its steps (probes and explorations, time-capped) and keeps 98 % of
    ``ar``."""
    cost = _q4(draft_steps=1.0)
    traces = [synthetic_trace(1500, WEAK, 0)]
    ar = replay(traces, "ar", cost)["tokens_per_s"]
    assert replay(traces, 1, cost)["tokens_per_s"] < 0.8 * ar          # the premise: nothing pays
    for cap in (1, 8):
        got = replay(traces, seeded_policy(cost, max_budget=cap), cost)
        assert got["drafts"] <= 0.05 * got["steps"], got
        assert got["tokens_per_s"] >= 0.98 * ar, (got, ar)
