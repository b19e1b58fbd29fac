"""The goodput policy against fixed trees and plain decoding on replayed acceptance traces, in the model
(benchmarks/policy_replay.py: modelled tokens/s on an injected cost curve, no timing).

Measured before this model existed, through HTTP on the 2-core CPU: goodput with ``B_max`` = 1 ran at
0.954x of ``ar`` on GSM8K-style prompts where fixed B = 1 gave 1.149x; a request that stopped drafting
kept the forecast of the dip that stopped it (1,131 of 3,295 rounds plain)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.policy_replay import (Q4_CURVE, Q4_ONE_ROW_S, CostCurve, load_trace, main, position_of, replay,
                                      save_trace, seeded_policy, synthetic_trace, table_forward)
from services.tree import DraftTree

GSM_LIKE = [0.95, 0.9, 0.8, 0.6, 0.3]     # a chain node's acceptance (given its parent) is drawn from these
MIXED = [0.9, 0.7, 0.5, 0.3, 0.1]
NEAR_BREAK_EVEN = [0.8, 0.5, 0.3, 0.1]   # fixed B = 1 within a few % of ar
WEAK = [0.5, 0.3, 0.1, 0.05]


def _q4(draft_steps: float = 0.35) -> CostCurve:
    """The q4 CPU curve; a drafter call costs ``draft_steps`` one-row forwards (0.3-0.46 measured)."""
    return CostCurve(table_forward(Q4_CURVE, Q4_ONE_ROW_S), draft_steps * Q4_ONE_ROW_S)


def _tps(traces, arm, cost) -> float:
    return replay(traces, arm, cost)["tokens_per_s"]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mix", [GSM_LIKE, MIXED], ids=["gsm-like", "mixed"])
def test_where_b1_pays_the_policy_is_within_3_percent_of_fixed_b1(mix, seed):
    """One request at a time, on text where fixed B = 1 beats ``ar`` (by ~25 % GSM8K-like, ~9 % mixed):
    goodput capped at one node gets within 3 % of it, and the default budget within 3 % of the best
    fixed small tree (before: down to 0.946 and 0.943)."""
    cost = _q4()
    traces = [synthetic_trace(1500, mix, seed)]
    ar, fixed = _tps(traces, "ar", cost), {b: _tps(traces, b, cost) for b in (1, 2, 3)}
    assert fixed[1] > 1.05 * ar                                   # the premise: B = 1 pays
    capped = _tps(traces, seeded_policy(cost, max_budget=1), cost)
    assert capped >= 0.97 * fixed[1], (capped, fixed[1])
    default = _tps(traces, seeded_policy(cost, max_budget=8), cost)
    assert default >= 0.97 * max(fixed.values()), (default, fixed)


RECORDED = Path(__file__).resolve().parents[1] / "benchmarks/results/2026-12-07-policy-replay/trace-gsm8k.json"


def test_on_the_shipped_drafters_recorded_gsm8k_trace_the_policy_is_within_3_percent():
    """The shipped drafter's trees at every position of 4 GSM8K answers (``--record``): B = 1 pays
    there; capped at one node the policy gets within 3 % of fixed B = 1, the default within 3 % of
    the best fixed small tree (before: 0.969 of B = 3)."""
    cost = _q4()
    traces = [load_trace(RECORDED)]
    ar, fixed = _tps(traces, "ar", cost), {b: _tps(traces, b, cost) for b in (1, 2, 3)}
    assert fixed[1] > 1.05 * ar
    assert _tps(traces, seeded_policy(cost, max_budget=1), cost) >= 0.97 * fixed[1]
    assert _tps(traces, seeded_policy(cost, max_budget=8), cost) >= 0.97 * max(fixed.values())


@pytest.mark.parametrize("mix", [GSM_LIKE, MIXED, NEAR_BREAK_EVEN, WEAK],
                         ids=["gsm-like", "mixed", "near-break-even", "weak"])
def test_a_budget_cap_of_one_never_does_worse_than_both_fixed_b1_and_ar(mix):
    """With one node to choose, the policy ends at or above the worse of its two options (the issue's
    run: below both), and within 4 % of the better, whichever it is: B = 1 (GSM8K-like, mixed, near
    break-even) or plain decoding (weak drafts)."""
    cost = _q4()
    traces = [synthetic_trace(1500, mix, 0)]
    ar, b1 = _tps(traces, "ar", cost), _tps(traces, 1, cost)
    capped = _tps(traces, seeded_policy(cost, max_budget=1), cost)
    assert capped >= min(ar, b1), (capped, ar, b1)
    assert capped >= 0.96 * max(ar, b1), (capped, ar, b1)


def _batch_fills_the_step(c: int) -> CostCurve:
    """Up to ``c`` rows cost about one row (batching fills the step); every row beyond costs half a step."""
    def forward(rows: int) -> float:
        return Q4_ONE_ROW_S * (1.0 + 0.02 * min(rows - 1, c - 1) + 0.5 * max(rows - c, 0))
    return CostCurve(forward, 0.35 * Q4_ONE_ROW_S)


@pytest.mark.parametrize("c", [4, 8])
def test_where_extra_rows_are_expensive_at_c4_no_tree_is_verified(c):
    """c >= 4 on a curve where the batch already fills the step: a tree's rows cost more than its
    tokens bring, even with a drafter this good, so no drafter call is made (no probe, no exploration)
    and no node is verified: the policy decodes as ``ar`` does. The same drafter at c = 1 on the q4
    curve drafts and verifies (the check is not vacuous)."""
    cost = _batch_fills_the_step(c)
    traces = [synthetic_trace(300, GSM_LIKE, k) for k in range(c)]
    got = replay(traces, seeded_policy(cost, max_budget=8), cost)
    assert got["verified"] == 0 and got["drafts"] == 0, got
    assert got["tokens_per_s"] == pytest.approx(_tps(traces, "ar", cost))
    assert _tps(traces, 1, cost) < _tps(traces, "ar", cost)        # the premise: trees lose here
    alone = replay(traces[:1], seeded_policy(_q4(), max_budget=8), _q4())
    assert alone["verified"] > 0 and alone["drafts"] > 0, alone


def test_the_replay_command_reports_every_arm(capsys):
    out = main(["--positions", "200", "--node-p", "0.9", "0.5"])
    arms = out["modelled_tokens_per_s"]
    assert set(arms) == {"ar", "fixed B=1", "fixed B=2", "fixed B=3", "fixed B=8", "goodput B_max=1",
                         "goodput B_max=8"}
    assert all(v > 0 for v in arms.values())
    assert '"modelled_tokens_per_s"' in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--node-p", "1.5"])


def test_a_drafted_tree_becomes_a_position_in_the_builders_order(tmp_path):
    """Nodes by path score + beta x depth (so each prefix is the B-budget tree), hits where the node's
    path is the text; a B-budget tree cut from it accepts what the text says; traces round-trip."""
    # root -> a(5) -> b(7); root -> c(6); a -> d(8). Text after the root: 5 7 9.
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 0]), torch.tensor([1, 1, 2, 2]),
                     torch.tensor([-0.1, -1.0, -0.3, -2.0]))
    pos = position_of(tree, [4, 5, 7, 9], 0, depth_bonus=-0.2)
    assert pos.parents == (-1, 0, -1, 0)           # a (-0.3), b (-0.7), c (-1.2), d (-2.4)
    assert pos.hits == (True, True, False, False)
    assert pos.accepted(pos.tree(1)) == 1 and pos.accepted(pos.tree(2)) == 2 and pos.accepted(pos.tree(4)) == 2
    assert pos.continuation()[:3] == [1, 2, 0]     # a hit node's token is its depth
    save_trace(tmp_path / "t.json", {"q/0": [pos], "q/1": [pos, pos]}, {"budget": 4})
    loaded = load_trace(tmp_path / "t.json")
    assert [(x.parents, x.hits) for x in loaded] == [(pos.parents, pos.hits)] * 3
    assert all(x.scores == pytest.approx(pos.scores, abs=1e-5) for x in loaded)
    out = main(["--trace", str(tmp_path / "t.json")])
    assert out["positions"] == 3 and out["modelled_tokens_per_s"]["fixed B=2"] > out["modelled_tokens_per_s"]["ar"]
