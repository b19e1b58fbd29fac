"""The goodput policy's pure parts on synthetic streams (issue 13): the step cost model converges to
the true line, the calibrator converges to the true acceptance rates, a sudden acceptance drop moves
the budget down within a few steps, and truncation keeps valid prefix-closed trees."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from services import timing
from services.testing import random_tree
from services.timing import Timings
from services.tree import DraftTree
from services.tree.draft_tree import tree_from_parents
from services.verifier.calibration import AcceptanceCalibrator, accepted_labels, prefix_gains
from services.verifier.cost_model import (SWEEP_ROWS, StepCostModel, cache_key, calibration_sweep, load_cached,
                                           plausible, rule_curve, save_cached, startup_sweep,
                                           sweep_rejection)
from services.verifier.engine import StepStats
from services.verifier.policy import Drafted, FixedPolicy, GoodputPolicy, RoundInfo, truncate_tree
from services.verifier.policy_build import goodput_with_sweep, make_policy


# --------------------------------------------------------------------------------------- cost model
@pytest.fixture(autouse=True)
def idle_machine(monkeypatch):
    """The sweeps here time scripted functions: the timing process counts as having every thread's CPU
    time (the tests that play a competing process say so), whatever else runs on the test machine."""
    monkeypatch.setattr(timing, "cpu_seconds", lambda: timing.wall_seconds() * 1024)


def test_cost_model_fits_the_line_and_follows_a_change():
    rng = random.Random(0)
    m = StepCostModel(forget=0.95)
    assert m.coefficients() == (m.prior_a, m.prior_b)
    for _ in range(200):
        r = rng.choice([1, 4, 9, 17, 33])
        m.observe_forward(r, 0.01 + 0.002 * r + rng.gauss(0, 1e-4))
    a, b = m.coefficients()
    assert abs(a - 0.01) < 5e-4 and abs(b - 0.002) < 5e-5
    for _ in range(100):  # the machine gets twice as slow: forgetting follows it
        r = rng.choice([1, 4, 9, 17, 33])
        m.observe_forward(r, 2 * (0.01 + 0.002 * r))
    a, b = m.coefficients()
    assert abs(a - 0.02) < 1e-3 and abs(b - 0.004) < 1e-4
    assert m.forward_seconds(10) == pytest.approx(0.06, rel=0.02)
    assert m.forward_seconds(40) == pytest.approx(m.forward_seconds(33) + 7 * b)  # the line beyond the table


def test_cost_model_table_keeps_the_cpu_step_shape():
    """One row is a GEMV, more rows a (packed) GEMM: the first extra row is expensive, the next ones
    nearly free (SmolLM2 on this CPU: 1 row 40 ms, 9 rows 74 ms, 17 rows 77 ms, 33 rows 105 ms)."""
    m = StepCostModel()
    m.seed([(1, 0.040), (4, 0.0686), (9, 0.0744), (17, 0.0773), (33, 0.1054)])
    assert m.forward_seconds(1) == pytest.approx(0.040)
    assert m.forward_seconds(13) == pytest.approx((0.0744 + 0.0773) / 2)
    assert m.forward_seconds(2) - m.forward_seconds(1) > 5 * (m.forward_seconds(10) - m.forward_seconds(9))
    m.observe_forward(20, 0.070)  # a noisy fast sample: the curve stays non-decreasing
    assert m.forward_seconds(20) >= m.forward_seconds(17)


def test_cost_model_single_row_count_keeps_the_prior_slope_and_ignores_junk():
    m = StepCostModel(prior_b=0.001)
    for _ in range(5):
        m.observe_forward(1, 0.02)
    m.observe_forward(0, 1.0)
    m.observe_forward(3, float("nan"))
    a, b = m.coefficients()
    assert b == 0.001 and a == pytest.approx(0.019)
    m.observe_draft(0.01)
    m.observe_draft(0.02)
    assert 0.01 < m.draft_cost() < 0.02
    assert m.step_seconds(9, 2, 3) == pytest.approx(m.forward_seconds(9) + 2 * m.draft_cost() + 3 * m.overhead_seconds)
    with pytest.raises(ValueError):
        StepCostModel(forget=0)


def test_draft_cost_learns_the_catch_up_of_owed_context():
    m = StepCostModel()
    rng = random.Random(0)
    for _ in range(60):  # steps of 1-3 drafting requests owing 1-200 context tokens: 4 ms + 0.5 ms/token
        n = rng.randint(1, 3)
        owed = [rng.choice([1, 2, 8, rng.randint(20, 200)]) for _ in range(n)]
        total = sum(0.004 + 0.0005 * k for k in owed)
        m.observe_draft(total / n, n, sum(owed))
    d, e = m.draft_coefficients()
    assert d == pytest.approx(0.004, rel=1e-6) and e == pytest.approx(0.0005, rel=1e-6)
    assert m.draft_cost(150) == pytest.approx(0.079) and m.draft_cost(1) == pytest.approx(0.0045)
    assert 0.0045 < m.draft_cost() < 0.079        # no owed count: the moving average
    one = StepCostModel()
    one.observe_draft(0.01, 1, 5)                 # one owed count seen: cannot separate d and e yet
    assert one.draft_coefficients() is None and one.draft_cost(500) == pytest.approx(0.01)


def test_overhead_fit_separates_a_drafted_rounds_own_work():
    """A step's time outside its forward and drafter wait is o per request plus t per drafting
    request (tree buffers, the policy's cut, the walk and commit of several tokens): the fit recovers
    both from steps with varying drafting counts, and a model that has never seen a drafted round
    keeps t = 0 and o = the moving average."""
    m = StepCostModel()
    rng = random.Random(0)
    for _ in range(80):
        n = rng.choice([1, 4, 8])
        k = rng.randint(0, n)
        m.observe_overhead((0.0003 * n + 0.0015 * k) / n, n, k)
    o, t = m.overhead_coefficients()
    assert o == pytest.approx(0.0003, rel=1e-6) and t == pytest.approx(0.0015, rel=1e-6)
    assert (m.request_overhead(), m.round_overhead()) == (pytest.approx(0.0003), pytest.approx(0.0015))
    assert m.step_seconds(12, 2, 8) == pytest.approx(m.forward_seconds(12) + 2 * (m.draft_cost() + 0.0015)
                                                     + 8 * 0.0003)
    plain = StepCostModel()
    for n in (1, 4, 8):
        plain.observe_overhead(0.0004, n, 0)
    assert plain.overhead_coefficients() is None and plain.round_overhead() == 0.0
    assert plain.request_overhead() == plain.overhead_seconds > 0


def test_a_drafted_rounds_own_work_is_priced_before_drafting():
    """Eight requests decoding together; one has a forecast that pays for its drafter call and rows
    alone (0.9 + 0.3 tokens for 1 ms of drafting and 2 ms of rows on a 38 ms step), but not once each
    drafted round's own 2 ms in the step is counted (measured on the 2-core CPU at c = 8: a step with
    one drafting request ran 5.2 ms outside forward and draft against 3.2 ms for a plain one, and the
    default ran at 0.94x of plain decoding)."""
    decisions = []
    for t in (0.0, 0.002):
        pol = _policy(draft_s=0.001)
        for k in (0, 1, 2) * 10:
            pol.cost.observe_overhead((0.0003 * 8 + t * k) / 8, 8, k if t else 0)
        rids = [f"r{i}" for i in range(8)]
        for rid in rids:
            st = pol._state(rid)
            st.fresh, st.interval, st.probed = False, 10 ** 6, True
        pol.forecast = lambda regime, rid=None: [0.9, 0.3, 0.1, 0.05] if rid == "r0" else [0.01] * 4
        pol.begin_step([RoundInfo(rid, "dartree-pruned", 0.0, True, owed=1) for rid in rids])
        decisions.append(pol.draft_knobs("r0", _Spec()) is not None)
        assert all(pol.draft_knobs(rid, _Spec()) is None for rid in rids[1:])
    assert decisions == [True, False], decisions


def test_a_forecast_curve_is_refreshed_after_as_many_labels_as_running_requests(monkeypatch):
    """Recomputing each request's forecast curve after every calibration label cost ~0.15 ms a request
    a step at c = 8: a cached curve is now refreshed when its trees change or after as many new labels
    as there are running requests (at c = 1: after every label, as before)."""
    pol = _policy()
    calls = []
    real = pol._mean_curve
    monkeypatch.setattr(pol, "_mean_curve", lambda window, regime: calls.append(regime) or real(window, regime))
    tree = _chain_tree([math.log(0.8) * (d + 1) for d in range(4)])
    st = pol._state("r")
    st.regime = "dartree-pruned:greedy"
    st.trees.append((tree, 4))
    for running, expect in ((1, [1, 2, 3, 4]), (4, [0, 0, 0, 1, 1, 1, 1, 2])):
        calls.clear()
        pol._running = running
        seen = []
        for _ in expect:
            pol.forecast(st.regime, "r")
            seen.append(len(calls))
            pol._version += 1  # one new calibration label
        assert seen == expect, (running, seen)
    st.trees.append((_chain_tree([math.log(0.5) * (d + 1) for d in range(4)]), 4))  # a new tree: at once
    n = len(calls)
    pol.forecast(st.regime, "r")
    assert len(calls) == n + 1


def test_a_long_catch_up_does_not_keep_a_request_plain():
    """The catch-up of an owed context (a new request's prompt, the tokens of plain rounds) is paid by
    whichever draft comes next and only grows while the request waits: a forecast that pays at the
    steady drafter cost drafts now, whether the request owes 2 tokens or 400 (charging the catch-up
    to one round kept every new request plain on q4: 0.98-1.01x of ``ar`` where fixed B = 3 gave
    1.3x). A forecast that does not pay stays plain either way."""
    pol = _policy(draft_s=0.0)
    for _ in range(20):
        pol.cost.observe_draft(0.002 + 0.0002 * 2, 1, 2)
        pol.cost.observe_draft(0.002 + 0.0002 * 300, 1, 300)
    for p, drafts in ((0.9, True), (0.01, False)):
        pol.forecast = lambda *a, p=p, **k: [p] * 8
        for rid in ("near", "far"):
            st = pol._state(rid)
            st.fresh, st.interval = False, 10 ** 6
        pol.begin_step([RoundInfo("near", "dartree-pruned", 0.0, True, owed=2),
                        RoundInfo("far", "dartree-pruned", 0.0, True, owed=400)])
        assert (pol.draft_knobs("near", _Spec()) is not None) == drafts
        assert (pol.draft_knobs("far", _Spec()) is not None) == drafts


def test_calibration_sweep_and_cache(tmp_path):
    calls = []

    def run(rows):
        calls.append(rows)
        return 0.005 + 0.001 * rows

    samples = calibration_sweep(run, rows=(1, 9))
    assert samples == [(1, pytest.approx(0.006)), (9, pytest.approx(0.014))]
    assert calls == [1, 9, 1, 9, 9, 1, 1, 9]  # a warm-up round, then 3 rounds (all reproduced), each starting one later
    path = tmp_path / "c.json"
    assert load_cached("k", path) is None
    save_cached("k", samples, path)
    assert load_cached("k", path) == samples and load_cached("other", path) is None
    m = StepCostModel()
    m.seed(samples)
    assert m.coefficients() == (pytest.approx(0.005), pytest.approx(0.001))


def test_sweep_resolves_every_row_count_up_to_8():
    """The int4 kernel works in 4-row tiles: 5 rows cost a step more than 4. The sweep times 1 .. 8
    one by one, so the cost model sees the edge instead of interpolating across it."""
    assert set(range(1, 9)) <= set(SWEEP_ROWS)

    def run(rows):
        return 0.020 + 0.006 * ((rows + 3) // 4) + 0.0005 * rows

    m = StepCostModel()
    m.seed(calibration_sweep(run))
    assert m.forward_seconds(5) - m.forward_seconds(4) == pytest.approx(0.0065)
    assert m.forward_seconds(4) - m.forward_seconds(3) == pytest.approx(0.0005)


def test_a_sweep_next_to_a_competing_process_gets_the_rule_curve_and_is_not_cached(tmp_path, monkeypatch):
    """Another process on the cores: every row count reproduces its (slower) times, but the timing
    process got half its CPU time. Both sweeps are rejected, the rule curve is used, nothing is cached;
    on a quiet machine the same sweep is accepted and cached."""
    path = tmp_path / "c.json"
    monkeypatch.setattr(timing, "cpu_seconds", lambda: timing.wall_seconds() * 0.5)
    samples, source = startup_sweep(lambda r: 0.040 + 0.002 * r, "k", "float32", path=path)
    assert "rule-based curve" in source and "another process on the cores" in source and "not cached" in source
    assert samples == [(r, pytest.approx(t)) for r, t in rule_curve(0.042, "float32")]
    assert load_cached("k", path) is None
    monkeypatch.setattr(timing, "cpu_seconds", lambda: timing.wall_seconds() * 1024)  # a quiet machine
    samples, source = startup_sweep(lambda r: 0.020 + 0.001 * r, "k", "float32", path=path)
    assert source == "sweep" and load_cached("k", path) == [(r, pytest.approx(0.020 + 0.001 * r)) for r in SWEEP_ROWS]


def test_a_sweep_whose_repeats_never_agree_gets_the_rule_curve(tmp_path):
    """The 4-row forward never repeats a time within 15 % (each call 1.3x the one before): each sweep
    runs its 8 rounds, both are rejected, nothing is cached."""
    path, calls = tmp_path / "c.json", []

    def run(rows):
        calls.append(rows)
        return (0.020 + 0.001 * rows) * (1.3 ** calls.count(4) if rows == 4 else 1)

    samples, source = startup_sweep(run, "k", "float32", path=path)
    assert "4-row repeats never within 15%" in source and "not cached" in source and load_cached("k", path) is None
    assert calls.count(4) == 2 * (1 + 8)
    assert sweep_rejection(Timings({1: [0.02, 0.021, 0.02]}, 1.0, 1)) is None


def test_one_slow_call_in_a_sweep_is_a_transient(tmp_path):
    """One 20x call among four timed repeats is dropped: the sweep is accepted and cached."""
    path, calls = tmp_path / "c.json", []

    def run(rows):
        calls.append(rows)
        return (0.020 + 0.001 * rows) * (20 if rows == 4 and calls.count(4) == 3 else 1)

    samples, source = startup_sweep(run, "k", "float32", path=path)
    assert source == "sweep" and load_cached("k", path) == [(r, pytest.approx(0.020 + 0.001 * r)) for r in SWEEP_ROWS]


def test_plausible_rejects_a_sweep_taken_under_load():
    good = [(1, 0.028), (4, 0.035), (9, 0.05), (17, 0.08), (33, 0.15)]
    assert plausible(good)
    # the cache this repo once wrote for q4: 9 and 17 rows 3 s (another process had the core)
    assert not plausible([(1, 0.213), (4, 0.227), (9, 3.008), (17, 3.289), (33, 0.711)])
    assert not plausible([(1, 0.05), (9, 0.01)])          # more rows far cheaper than fewer
    assert not plausible([(1, 0.0), (9, 0.01)])


def test_isotonic_table_is_not_lifted_by_one_slow_row_count():
    m = StepCostModel()
    m.seed([(1, 0.03), (9, 0.30), (17, 0.08), (33, 0.40)])  # one slow sample at 9 rows
    ys = [m.forward_seconds(r) for r in (1, 9, 17, 33, 40)]
    assert ys == sorted(ys)                                # non-decreasing
    assert m.forward_seconds(9) == pytest.approx(0.19)     # pooled with 17 (a running max: 0.30)
    assert m.forward_seconds(17) == pytest.approx(0.19) and m.forward_seconds(33) == pytest.approx(0.40)
    m.observe_forward(9, 0.05)                             # the table is refitted after a sample
    assert m.forward_seconds(9) < 0.19


def test_sweep_gives_marginal_rows_real_steps_give_the_level():
    """The sweep runs in an empty slot; real steps of 4 requests with long contexts cost 25 ms more.
    More rows must still cost the sweep's marginal seconds on top (pooling a sweep entry with the
    slower real one would make extra verify rows look free)."""
    m = StepCostModel()
    m.seed([(1, 0.028), (4, 0.035), (9, 0.050), (17, 0.080), (33, 0.150)])
    for _ in range(20):
        m.observe_forward(4, 0.060)
    assert m.forward_seconds(4) == pytest.approx(0.060)
    assert m.forward_seconds(9) == pytest.approx(0.075)     # 0.050 + the 25 ms the contexts add
    assert m.forward_seconds(12) - m.forward_seconds(4) == pytest.approx((0.050 - 0.035) + 3 / 8 * 0.030)
    assert m.forward_seconds(33) == pytest.approx(0.175)


def test_sweep_row_counts_take_the_shift_of_their_nearest_real_row_counts():
    """Plain steps sit 1 ms above the sweep, 4-row verifies 3.7 ms, a few 9-row probes 12.6 ms
    (the 2-core VM, 2026-12-05): the 2- and 3-row entries must stay between the real 1- and 4-row
    costs (a mean shift of 5.8 ms lifted them above the 4-row cost and the isotonic fit pooled
    2, 3 and 4: a B = 1 or 2 tree looked as dear as B = 3)."""
    m = StepCostModel()
    sweep = {1: 9.95, 2: 11.08, 3: 12.04, 4: 12.55, 5: 17.94, 6: 18.14, 7: 18.19, 8: 18.29, 9: 23.8, 17: 34.64}
    m.seed([(r, ms / 1e3) for r, ms in sweep.items()])
    for _ in range(30):
        m.observe_forward(1, 0.01099)
        m.observe_forward(4, 0.01621)
    m.observe_forward(9, 0.0364)
    f = {r: m.forward_seconds(r) * 1e3 for r in range(1, 18)}
    assert f[1] == pytest.approx(10.99, abs=0.01) and f[4] == pytest.approx(16.21, abs=0.01)
    assert f[1] < f[2] < f[3] < f[4]                               # not pooled with the 4-row cost
    assert f[2] == pytest.approx(11.08 + 1.04 + (3.66 - 1.04) / 3, abs=0.02)
    assert f[5] == pytest.approx(17.94 + 3.66 + (12.6 - 3.66) / 5, abs=0.02)
    assert f[9] == pytest.approx(36.4, abs=0.01) and f[17] == pytest.approx(34.64 + 12.6, abs=0.02)


def test_poisoned_or_stale_cache_is_swept_again(tmp_path, monkeypatch):
    monkeypatch.setenv("DARTREE_CACHE_DIR", str(tmp_path))
    true = {r: 0.02 + 0.004 * r for r in SWEEP_ROWS}
    calls = []

    def run(rows):
        calls.append(rows)
        return true[rows]

    save_cached("k", [(1, 0.213), (4, 0.227), (9, 3.0), (17, 3.3), (33, 0.71)])  # implausible
    pol = goodput_with_sweep(run, "k")
    assert pol.cost.forward_seconds(9) == pytest.approx(true[9])
    assert load_cached("k") == [(r, pytest.approx(t)) for r, t in sorted(true.items())]
    save_cached("k", [(r, 2 * t) for r, t in true.items()])  # plausible but 2x slower than now
    calls.clear()
    pol = goodput_with_sweep(run, "k")
    assert set(calls) == set(true)                         # re-timed, then swept again
    assert pol.cost.forward_seconds(17) == pytest.approx(true[17])
    calls.clear()
    goodput_with_sweep(run, "k")                           # a valid cache: only the two checks
    assert set(calls) == {1, 33}


def test_implausible_sweep_is_retaken_and_never_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("DARTREE_CACHE_DIR", str(tmp_path))
    calls = []

    def run(rows):
        calls.append(rows)
        return 0.5 if rows == 9 else 0.01

    pol = goodput_with_sweep(run, "busy", dtype="q4")
    assert load_cached("busy") is None and len(calls) == 2 * 4 * len(SWEEP_ROWS)  # two sweeps (warm-up + 3), then the rule
    for r, t in rule_curve(0.01, "q4"):                                           # from the one-row time
        assert pol.cost.forward_seconds(r) == pytest.approx(t)
    assert "threads 2" in cache_key("m", "q4", "cpu", 2) and cache_key("m", "q4", "cpu", 1) != cache_key("m", "q4", "cpu", 2)


# --------------------------------------------------------------------------------------- calibration
def test_labels_follow_the_continuation():
    # root -> a(0) -> c(2); root -> b(1) -> d(3)
    tree = tree_from_parents([5, 6, 7, 8], [-1, -1, 0, 1])
    labels, known = accepted_labels(tree, [5, 7])
    assert labels.tolist() == [True, False, True, False] and known.all()
    labels, known = accepted_labels(tree, [6])
    assert labels.tolist() == [False, True, False, False] and known.tolist() == [True, True, False, False]
    assert prefix_gains([0.5, 0.25]) == [0.0, 0.5, 0.75]


def _chain_tree(scores):
    n = len(scores)
    return DraftTree(torch.arange(1, n + 1), torch.arange(n) - 1, torch.arange(1, n + 1),
                     torch.tensor(scores, dtype=torch.float32))


def _stream(cal, rng, true_p, scores, rounds, regime="greedy", rid=None):
    """Chains whose node i is accepted (given its parent) with probability true_p[i]."""
    tree = _chain_tree(scores)
    for _ in range(rounds):
        cont = []
        for i, p in enumerate(true_p):
            if rng.random() < p:
                cont.append(i + 1)
            else:
                cont.append(0)  # a token no node carries
                break
        cont += [0] * (len(true_p) - len(cont))
        cal.observe(tree, cont, regime, rid)
    return tree


def test_calibrator_converges_to_the_true_rates_per_regime():
    rng = random.Random(1)
    cal = AcceptanceCalibrator(forget=1.0)
    cond = [0.8, 0.6, 0.5, 0.3]  # conditional acceptance per depth
    scores = [math.log(0.5), math.log(0.3), math.log(0.1), math.log(0.02)]  # the drafter is miscalibrated
    tree = _stream(cal, rng, cond, scores, 3000)
    truth = [math.prod(cond[:i + 1]) for i in range(len(cond))]
    p = cal.p_accept(tree, "greedy")
    assert max(abs(a - b) for a, b in zip(p.tolist(), truth)) < 0.03
    assert cal.expected_emitted(tree, 2) == pytest.approx(1 + truth[0] + truth[1], abs=0.05)
    # the other regime is untouched (still the prior: the drafter's own q, made monotone)
    q = cal.p_accept(tree, "sampled").tolist()
    assert q == sorted(q, reverse=True) and abs(q[0] - 0.5) < 0.06


def test_probabilities_are_monotone_and_the_top_b_is_prefix_closed():
    rng = random.Random(2)
    cal = AcceptanceCalibrator()
    for k in range(30):
        tree = random_tree(rng, 50, 20, 5)
        tree = DraftTree(tree.draft_tokens, tree.parents, tree.depths, -torch.rand(tree.num_nodes) * 6)
        p = cal.p_accept(tree)
        par = tree.parents
        assert bool((p[par >= 0] <= p[par[par >= 0]] + 1e-12).all())
        order = cal.order(p)
        for b in range(tree.num_nodes + 1):
            cut = truncate_tree(tree, order, b)
            cut.validate()
            assert cut.num_nodes == b
        cal.observe(tree, [rng.randrange(50) for _ in range(5)], "greedy", "r")


def test_request_factor_adapts_to_a_request():
    rng = random.Random(3)
    cal = AcceptanceCalibrator(forget=1.0)
    scores = [math.log(0.9)] * 4
    _stream(cal, rng, [0.9] * 4, scores, 500)               # the global map: high acceptance
    tree = _stream(cal, random.Random(4), [0.2] * 4, scores, 12, rid="hard")  # one hard request
    assert cal.request_factor("hard") < 0.5
    assert cal.expected_emitted(tree, 4, request_id="hard") < 0.6 * cal.expected_emitted(tree, 4)
    cal.release("hard")
    assert cal.request_factor("hard") == 1.0


# --------------------------------------------------------------------------------------- policy
def test_sorted_lists_match_p_accept_tree_by_tree():
    """The forecast's curves equal each tree's own sorted ``p_accept`` (with optimism), bitwise."""
    rng = random.Random(3)
    cal = AcceptanceCalibrator()
    trees = [_tree(n=rng.randint(1, 12), depth=rng.randint(1, 6), seed=k) for k in range(7)]
    for t in trees[:4]:
        cal.observe(t, [int(t.draft_tokens[0])] + [0] * 6)
    curves = torch.tensor(cal.sorted_lists(trees + [DraftTree.empty()], "greedy", 0.5, length=8), dtype=torch.float64)
    assert curves.shape == (7, 8)
    for t, row in zip(trees, curves):
        ref = torch.sort(cal.p_accept(t, "greedy", optimism=0.5), descending=True).values[:8]
        assert torch.equal(row[:ref.numel()], ref) and (row[ref.numel():] == 0).all()


def _tree(n=8, depth=4, seed=0):
    rng = random.Random(seed)
    t = random_tree(rng, 100, n, depth)
    return DraftTree(t.draft_tokens, t.parents, t.depths, -0.3 * t.depths.float())


def _policy(draft_s=0.004, a=0.02, b=0.002):
    cost = StepCostModel()
    cost.seed([(1, a + b), (33, a + 33 * b)])
    cost.observe_draft(draft_s)
    return GoodputPolicy(cost, AcceptanceCalibrator(forget=0.98), explore_every=8)


def _drive(pol, trees_by_round, accept, rid="r"):
    """Run rounds of one request through the policy hooks; ``accept(round)`` = does the truth follow
    the drafted path? Returns the budgets verified per round (-1 = no drafter call)."""
    budgets = []
    for k, tree in enumerate(trees_by_round):
        info = RoundInfo(rid, "dartree-pruned", 0.0, can_draft=True)
        pol.begin_step([info])
        spec = pol.draft_knobs(rid, _Spec())
        drafted = spec is not None
        sel = pol.select([Drafted(info, tree if drafted else DraftTree.empty(), drafted)])[rid]
        budgets.append(sel.budget if drafted else -1)
        path = _deepest_path(tree) if accept(k) else []
        pol.observe_round(rid, path + [99] * (tree.max_depth + 1 - len(path)))
        pol.observe_step(StepStats(1, 1 + sel.budget, 0, pol.cost.forward_seconds(1 + sel.budget)))
    return budgets


class _Spec:
    method, budget, width, depth_bonus, candidates = "dartree-pruned", None, None, None, None


def _deepest_path(tree):
    i = int(torch.argmax(tree.depths))
    path = []
    while i >= 0:
        path.append(int(tree.draft_tokens[i]))
        i = int(tree.parents[i])
    return path[::-1]


def test_good_drafter_speculates_and_a_sudden_drop_moves_the_budget_down():
    pol = _policy()
    tree = _tree()
    budgets = _drive(pol, [tree] * 40, accept=lambda k: True)
    assert all(b > 0 for b in budgets[-10:]), budgets
    budgets = _drive(pol, [tree] * 30, accept=lambda k: False)  # the drafter stops being right
    # measured: [8 x 6, 4 x 4, then plain with a 1-node retry every ~4 rounds]; the per-request
    # factor needs a few rounds of evidence before it overrides a map that has seen only successes
    assert next(i for i, b in enumerate(budgets) if b < budgets[0]) <= 6, budgets   # B moves down ...
    assert next(i for i, b in enumerate(budgets) if b < 1) <= 10, budgets            # ... to plain decoding
    assert budgets[-12:].count(-1) >= 8, budgets  # mostly plain rounds (no drafter call), retrying now and then
    assert any(b >= 0 for b in budgets[-12:]), budgets
    budgets = _drive(pol, [tree] * 80, accept=lambda k: True)  # the drafter recovers: exploration notices
    assert all(b > 0 for b in budgets[-10:]), budgets
    assert budgets.index(8) <= 40, budgets  # within the backed-off exploration interval (<= 32 here)


def test_expensive_drafter_is_never_called_after_exploring():
    pol = _policy(draft_s=1.0)  # a drafter call costs 50 forwards
    budgets = _drive(pol, [_tree()] * 200, accept=lambda k: True)
    assert budgets[0] >= 0  # the first round has no forecast: it drafts
    explored = [i for i, b in enumerate(budgets) if b >= 0]
    assert explored == [0, 16, 48, 112], explored  # back-off: each useless draft doubles the interval (8 -> 16, 32, 64)
    budgets = _drive(pol, [_tree()] * 40, accept=lambda k: True, rid="new")
    # a new request inherits the forecast and the regime's backed-off interval (64 here, not the
    # initial 16): it does not re-explore the useless drafter on its own
    assert budgets.count(-1) == 40, budgets


def test_one_low_confidence_draft_does_not_stop_a_good_drafter():
    """The forecast before drafting is the regime's recent trees, not the request's last tree. With
    the last tree as the forecast, one low-confidence (and rejected) draft after many accepted ones
    made the next forecast that tree's, the policy stopped drafting, and nothing refreshed the
    forecast until an exploration (measured on q4 GSM8K: plain in 95-100 % of rounds where fixed
    B = 3 gave 1.3x of ``ar``)."""
    pol = _policy()
    good = _chain_tree([math.log(0.9) * (d + 1) for d in range(4)])
    hard = _chain_tree([math.log(0.05) * (d + 1) for d in range(4)])
    budgets = _drive(pol, [good] * 11, accept=lambda k: True)
    assert all(b > 0 for b in budgets[1:]), budgets
    budgets = _drive(pol, [hard], accept=lambda k: False)
    assert budgets[0] >= 0                         # drafted (the good forecast), verified, rejected
    pol.begin_step([RoundInfo("r", "dartree-pruned", 0.0, can_draft=True, owed=1)])
    assert pol.draft_knobs("r", _Spec()) is not None
    assert pol.forecast("dartree-pruned:greedy", "r")[0] > 0.5


def test_short_requests_still_explore():
    """Rounds since the regime last drafted carry over to a new request: with requests shorter than
    the backed-off exploration interval, a per-request count never reached it and a drafter that
    had stopped paying was never tried again."""
    pol = _policy(draft_s=1.0)  # useless: a drafter call costs 50 forwards
    calls = []
    for i in range(12):
        budgets = _drive(pol, [_tree()] * 30, accept=lambda k: True, rid=f"q{i}")
        calls += [30 * i + k for k, b in enumerate(budgets) if b >= 0]
        pol.release(f"q{i}")
    assert any(k >= 150 for k in calls), calls    # still exploring after the interval outgrew a request
    assert len(calls) <= 8, calls                  # ... at the backed-off rate (intervals up to 128)


# q4 SmolLM2-135M on the 2-core CPU (benchmarks/results/2026-12-03-cpu-small-trees, cost.json): one-row
# forward 23.3 ms, c(M) by rows; the 5th row crosses the int4 kernel's 4-row tile
Q4_C = {1: 1.0, 2: 1.03, 3: 1.11, 4: 1.22, 5: 1.63, 6: 1.63, 7: 1.69, 8: 1.69, 9: 1.95}


def _tile_policy(curve, draft_s=0.0126, **kw):
    cost = StepCostModel()
    cost.seed([(m, 0.0233 * c) for m, c in curve.items()])
    cost.observe_draft(draft_s)
    return GoodputPolicy(cost, AcceptanceCalibrator(), max_budget=8, **kw)


def _drive_budgets(pol, tree, rounds, accepted, rid="r"):
    """Rounds of one request whose truth follows the tree's first ``accepted`` chain nodes; returns
    ``(drafted budgets, verified budgets)`` of the rounds that called the drafter."""
    drafted, verified = [], []
    for _ in range(rounds):
        info = RoundInfo(rid, "dartree-pruned", 0.0, can_draft=True, owed=1)
        pol.begin_step([info])
        knobs = pol.draft_knobs(rid, _Spec())
        sel = pol.select([Drafted(info, tree if knobs else DraftTree.empty(), knobs is not None)])[rid]
        if knobs is not None:
            drafted.append(knobs.budget)
            verified.append(sel.budget)
        path = [int(t) for t in tree.draft_tokens[:accepted]]
        pol.observe_round(rid, path + [99] * (tree.max_depth + 1 - len(path)))
        rows = 1 + sel.budget
        fwd, wait = pol.cost.forward_seconds(rows), pol.cost.draft_cost(1) if knobs else 0.0
        pol.observe_step(StepStats(1, rows, 0, fwd, wait, wait, 1, int(knobs is not None), int(sel.budget > 0),
                                   fwd + wait))
    return drafted, verified


def test_drafting_budget_follows_the_tile_edge_of_the_cost_curve():
    """On the q4 curve a 5th verify row costs c(5) - c(4) = 0.41 of a step, more than a chain node
    with P ~ 0.5 brings: the policy drafts (not only verifies) B = 3 there, where it used to call the
    drafter at B_max = 8 every round and cut afterwards; on a flat (memory-bound) curve, B = 8."""
    tree = _chain_tree([math.log(0.97) * (d + 1) for d in range(8)])
    drafted, verified = _drive_budgets(_tile_policy(Q4_C), tree, 60, accepted=3)
    assert len(drafted) == 60, drafted                          # it pays: every round drafts
    tail = drafted[20:]
    assert max(tail) <= 4 and tail.count(3) >= 0.7 * len(tail), drafted
    assert all(v <= d for v, d in zip(verified, drafted)), (verified, drafted)
    assert max(verified[20:]) <= 4, verified
    flat = {m: 1.0 for m in Q4_C}
    drafted, _ = _drive_budgets(_tile_policy(flat, draft_s=0.002), tree, 40, accepted=8)
    assert drafted[-10:] == [8] * 10, drafted


def test_drafting_budget_grows_back_when_the_drafter_improves():
    """Small trees say nothing about a 5th node: the forecast reads position k over the trees drafted
    that deep (the widening calls), so the budget climbs again once deeper nodes are accepted."""
    tree = _chain_tree([math.log(0.97) * (d + 1) for d in range(8)])
    cheap = {1: 1.0, 2: 1.02, 3: 1.04, 4: 1.06, 5: 1.08, 6: 1.10, 7: 1.12, 8: 1.14, 9: 1.16}
    pol = _tile_policy(cheap, draft_s=0.002)
    drafted, _ = _drive_budgets(pol, tree, 60, accepted=1)     # only the first node is ever right
    assert max(drafted[-8:]) <= 3, drafted
    drafted, _ = _drive_budgets(pol, tree, 120, accepted=8)    # now the whole chain is
    assert drafted[-5:] == [8] * 5, drafted
    # without widening, and with a regime window short enough to have forgotten the first B = 8 tree
    never = _tile_policy(cheap, draft_s=0.002, widen_every=0, forecast_trees=8)
    _drive_budgets(never, tree, 60, accepted=1)
    drafted, _ = _drive_budgets(never, tree, 120, accepted=8)
    assert max(drafted[-5:]) < 8, drafted                      # without widening it could not see it


def test_forecast_position_averages_only_trees_drafted_that_deep():
    pol = _tile_policy(Q4_C)
    deep = _chain_tree([math.log(0.9) * (d + 1) for d in range(8)])
    small = truncate_tree(deep, torch.arange(8), 3)
    for _ in range(3):
        pol.remember("m:greedy", small, 3)
    pol.remember("m:greedy", deep, 8)
    ref = torch.sort(pol.cal.p_accept(deep, "m:greedy", optimism=pol.optimism), descending=True).values
    curve = pol.forecast("m:greedy")
    assert len(curve) == 8
    assert curve[5] == pytest.approx(float(ref[5]))             # only the B = 8 tree has a 6th node
    assert curve[1] == pytest.approx(float(ref[1]))             # every tree shares the first three


def _drive_timed(pol, rounds, draft_s, step_s=0.02, rid="t"):
    """Like :func:`_drive` with a useless drafter, reporting measured times: a drafting step waits
    ``draft_s`` for the drafter. Returns (rounds that called the drafter, total wall seconds)."""
    called, wall = [], 0.0
    tree = _tree()
    for k in range(rounds):
        info = RoundInfo(rid, "dartree-pruned", 0.0, can_draft=True)
        pol.begin_step([info])
        drafted = pol.draft_knobs(rid, _Spec()) is not None
        sel = pol.select([Drafted(info, tree if drafted else DraftTree.empty(), drafted)])[rid]
        pol.observe_round(rid, [99] * (tree.max_depth + 1))
        w = step_s + (draft_s if drafted else 0.0)
        wall += w
        pol.observe_step(StepStats(1, 1 + sel.budget, 0, step_s, draft_s if drafted else 0.0,
                                   draft_s if drafted else 0.0, decoding=1, drafting=int(drafted), wall_seconds=w))
        if drafted:
            called.append(k)
    return called, wall


def test_exploration_time_is_capped_at_a_fraction_of_the_wall_time():
    # a drafter whose calls (context catch-up included) cost 5 steps and never pay
    pol = _policy(draft_s=0.1)
    pol.explore_fraction = 0.01
    called, wall = _drive_timed(pol, 3000, draft_s=0.1)
    assert called[0] == 0 and len(called) >= 2                 # the first draft, then explorations go on ...
    assert len(called) * 0.1 <= 0.01 * wall + 0.1 + 1e-9, (called, wall)  # ... within 1 % of the time (+ one call)
    # without the cap, the doubling interval alone explores every 64 rounds: 5 steps' time each
    free = _policy(draft_s=0.1)
    free.explore_fraction = 1.0
    called_free, wall_free = _drive_timed(free, 3000, draft_s=0.1)
    assert len(called_free) * 0.1 > 0.02 * wall_free, (called_free, wall_free)
    with pytest.raises(ValueError):
        GoodputPolicy(explore_fraction=1.5)


def test_a_prompt_chunk_in_the_step_does_not_make_a_draft_look_cheap():
    """A step that also carries a 500-row prompt chunk takes ~1 s whatever is drafted; counting that
    second in the tokens / second ratio made a 30 ms drafter call for 0.3 expected tokens look like a
    30 % gain (measured: new requests' prefill steps drafted on HumanEval at c = 4). The decision
    must be the same with and without the chunk."""
    pol = _policy(draft_s=0.03)                # a drafter call costs 1.4 one-row forwards
    st = pol._state("r")
    st.fresh, st.interval, st.probed = False, 10 ** 6, True  # mid-request (its first round probes)
    pol.forecast = lambda *a, **k: [0.04] * 8
    decisions = []
    for extra in (0, 500):
        pol.begin_step([RoundInfo("r", "dartree-pruned", 0.0, True, owed=1)], extra_rows=extra)
        decisions.append(pol.draft_knobs("r", _Spec()) is not None)
    assert decisions == [False, False], decisions
    # and a forecast that pays without the chunk still pays with it
    pol.forecast = lambda *a, **k: [0.95] * 8
    for extra in (0, 500):
        pol.begin_step([RoundInfo("r", "dartree-pruned", 0.0, True, owed=1)], extra_rows=extra)
        assert pol.draft_knobs("r", _Spec()) is not None


def test_explorations_due_in_one_step_share_the_time_budget():
    """Four requests due to explore in the same step: the budget left (one call) admits one call,
    not all four (the budget was checked per request against the time spent before the step)."""
    pol = _policy(draft_s=0.05)
    pol.explore_fraction = 0.01
    pol._wall, pol._explore_s = 10.0, 0.06     # 100 ms budget, 60 ms spent: a call starts while some is left
    rids = [f"r{i}" for i in range(4)]
    for rid in rids:
        st = pol._state(rid)
        st.fresh, st.interval, st.since_draft, st.probed = False, 4, 10, True  # mid-request
    pol.forecast = lambda *a, **k: []  # forecasts never pay
    pol.begin_step([RoundInfo(r, "dartree-pruned", 0.0, True, owed=1) for r in rids])
    drafting = [r for r in rids if pol.draft_knobs(r, _Spec()) is not None]
    assert len(drafting) == 1, drafting


def test_batch_selection_prefers_likely_nodes_and_respects_explicit_budgets():
    pol = _policy(draft_s=0.0)
    good, bad = _tree(seed=1), _tree(seed=2)
    bad = DraftTree(bad.draft_tokens, bad.parents, bad.depths, torch.full((bad.num_nodes,), -8.0))
    infos = [RoundInfo("g", "ddtree", 0.0, True), RoundInfo("b", "ddtree", 0.0, True),
             RoundInfo("x", "ddtree", 0.0, True, explicit_budget=True)]
    out = pol.select([Drafted(infos[0], good, True), Drafted(infos[1], bad, True), Drafted(infos[2], bad, True)])
    assert out["g"].budget > 0 and out["b"].budget == 0 and out["x"].tree is bad
    assert out["g"].predicted_tau > 1 and out["b"].tree.num_nodes == 0
    for sel in out.values():
        sel.tree.validate()


def test_fixed_policy_is_a_pass_through():
    pol = make_policy("fixed")
    assert isinstance(pol, FixedPolicy)
    t = _tree()
    info = RoundInfo("r", "ddtree", 0.0, True)
    assert pol.select([Drafted(info, t, True)])["r"].tree is t
    with pytest.raises(ValueError):
        make_policy("fastest")
    with pytest.raises(ValueError):
        GoodputPolicy(max_budget=0)


def test_worker_config_and_metrics_of_the_policy():
    from prometheus_client import generate_latest

    from services.metrics import VerifierMetrics
    from services.verifier.worker import VerifierWorkerConfig

    assert VerifierWorkerConfig().spec_policy == "goodput"
    with pytest.raises(ValueError, match="spec_policy"):
        VerifierWorkerConfig(spec_policy="fastest")
    with pytest.raises(ValueError, match="spec_max_budget"):
        VerifierWorkerConfig(spec_max_budget=-1)
    m = VerifierMetrics()
    m.observe_policy_round("dartree-pruned", 0, None, 1)
    m.observe_policy_round("dartree-pruned", 8, 2.5, 2)
    m.observe_policy_step(0, 0.05, 0.06)
    m.observe_policy_step(2, None, 0.07)
    text = generate_latest(m.registry).decode()
    assert 'dartree_spec_policy_budget_bucket{le="0.0",method="dartree-pruned"} 1.0' in text
    assert "dartree_spec_policy_tau_abs_error_sum 0.5" in text
    assert "dartree_spec_policy_predicted_tau_total 2.5" in text
    assert "dartree_spec_policy_realised_tau_total 2.0" in text
    assert 'dartree_spec_policy_step_seconds_total{kind="measured"} 0.06' in text
    assert 'dartree_spec_policy_steps_total{speculation="none"} 1.0' in text
    assert 'dartree_spec_policy_steps_total{speculation="some"} 1.0' in text


# ------------------------------------------------------------------ simulated serving (issue 13 goals)
CPU_FORWARD = {1: 0.040, 2: 0.060, 4: 0.0686, 9: 0.0744, 17: 0.0773, 33: 0.1054, 65: 0.16}  # SmolLM2, this CPU
DRAFT_S = 0.022


def _true_forward(rows):
    xs = sorted(CPU_FORWARD)
    if rows >= xs[-1]:
        return CPU_FORWARD[xs[-1]] + 0.0017 * (rows - xs[-1])
    i = next(k for k, x in enumerate(xs) if x >= rows)
    if xs[i] == rows or i == 0:
        return CPU_FORWARD[xs[i]]
    x0, x1 = xs[i - 1], xs[i]
    return CPU_FORWARD[x0] + (CPU_FORWARD[x1] - CPU_FORWARD[x0]) * (rows - x0) / (x1 - x0)


def _simulate(policy, c, cond, steps=400, budget=8, seed=0):
    """c requests decoding together; a chain of ``budget`` nodes whose node d is right (given its
    parent) with probability cond; the step takes the true CPU time. ``policy`` None = ``ar``,
    an int = fixed B. Returns tokens per simulated second."""
    rng = random.Random(seed)
    scores = [math.log(0.8) * (d + 1) for d in range(budget)]
    tree = _chain_tree(scores)
    tokens = seconds = 0.0
    rids = [f"q{i}" for i in range(c)]
    for _ in range(steps):
        infos = [RoundInfo(r, "dartree-pruned", 0.0, can_draft=policy is not None) for r in rids]
        if isinstance(policy, GoodputPolicy):
            policy.begin_step(infos)
            drafted = {r: policy.draft_knobs(r, _Spec()) is not None for r in rids}
            sel = policy.select([Drafted(i, tree if drafted[i.rid] else DraftTree.empty(), drafted[i.rid])
                                 for i in infos])
            verified = {r: sel[r].tree for r in rids}
        else:
            drafted = {r: isinstance(policy, int) for r in rids}
            verified = {r: (truncate_tree(tree, torch.arange(tree.num_nodes), policy) if drafted[r]
                            else DraftTree.empty()) for r in rids}
        rows = sum(1 + verified[r].num_nodes for r in rids)
        fwd = _true_forward(rows)
        wall = fwd + DRAFT_S * sum(drafted.values()) + 0.001 * c
        seconds += wall
        for r in rids:
            depth = 0
            while depth < budget and rng.random() < cond:
                depth += 1
            acc = min(depth, verified[r].num_nodes)  # a chain: the verified prefix
            tokens += acc + 1
            if isinstance(policy, GoodputPolicy):
                policy.observe_round(r, [int(t) for t in tree.draft_tokens[:depth]] + [0] * (budget + 1 - depth))
        if isinstance(policy, GoodputPolicy):
            policy.observe_step(StepStats(c, rows, 0, fwd, 0.0, DRAFT_S * sum(drafted.values()), c,
                                          sum(drafted.values()), sum(1 for r in rids if verified[r].num_nodes),
                                          wall))
    return tokens / seconds


@pytest.mark.parametrize("c", [1, 4])
@pytest.mark.parametrize("cond", [0.3, 0.6, 0.8, 0.95])
def test_simulated_goodput_tracks_the_best_of_ar_and_fixed(c, cond):
    """The issue's goal on a simulator with this CPU's measured step costs, from weak drafters (ar
    wins) to strong ones (B = 8 wins). Measured (400 steps, learning included): 0.95-1.06 of
    max(ar, best fixed B); the worst cases sit at break-even (cond ~0.6 at c = 1, ~0.8 at c = 4),
    where drafting and not drafting are within 4 % of each other and a round that drafts but then
    verifies few nodes pays the expensive first extra row. Asserted: >= 0.93 everywhere."""
    ar = _simulate(None, c, cond)
    fixed = max(_simulate(b, c, cond) for b in (1, 2, 4, 8))
    cost = StepCostModel()
    cost.seed(sorted(CPU_FORWARD.items()))
    cost.observe_draft(DRAFT_S)
    gp = _simulate(GoodputPolicy(cost, AcceptanceCalibrator()), c, cond)
    assert gp >= 0.93 * max(ar, fixed), (gp, ar, fixed)


# ------------------------------------------------------------------ calibration kept between starts
def test_calibration_state_round_trips_and_rejects_mismatches():
    cal = AcceptanceCalibrator()
    tree = _chain_tree([math.log(0.9) * (d + 1) for d in range(4)])
    for _ in range(20):
        cal.observe(tree, [1, 99, 0, 0, 0], "dartree-pruned:greedy")
    state = json.loads(json.dumps(cal.state()))
    fresh = AcceptanceCalibrator()
    assert fresh.load_state(state, max_weight=1e9)
    assert torch.allclose(fresh.p_accept(tree, "dartree-pruned:greedy"), cal.p_accept(tree, "dartree-pruned:greedy"))
    scaled = AcceptanceCalibrator()
    assert scaled.load_state(state, max_weight=2.0)                 # a loaded map is a prior: capped evidence
    assert float(scaled._tot["dartree-pruned:greedy"].max()) == pytest.approx(2.0)
    assert not AcceptanceCalibrator(max_depth_bucket=4).load_state(state)
    assert not AcceptanceCalibrator().load_state({"q_edges": [0.5], "depth_buckets": 8, "regimes": {}})
    assert not AcceptanceCalibrator().load_state({"junk": 1})


def test_a_second_start_does_not_pay_again_for_learning(tmp_path):
    """A drafter that is confident but wrong (MT-Bench-like, break-even or worse): a cold start drafts
    while its calibration learns; a start that loads the first one's calibration stays plain."""
    from services.verifier.calibration_store import CalibrationStore

    tree = _chain_tree([math.log(0.95) * (d + 1) for d in range(8)])
    path = tmp_path / "calibration.json"

    def serve(n_requests):
        pol = _tile_policy(Q4_C, store=CalibrationStore("k", path), save_every=16)
        calls = 0
        for i in range(n_requests):
            drafted, _ = _drive_budgets(pol, tree, 24, accepted=0, rid=f"q{i}")
            calls += len(drafted)
            pol.release(f"q{i}")
        pol.flush()
        return calls

    assert not path.exists()
    cold = serve(4)
    assert path.exists() and CalibrationStore("k", path).load() is not None
    assert CalibrationStore("other", path).load() is None
    warm = serve(4)
    assert warm <= cold / 2, (cold, warm)
    path.write_text("{not json")                                     # unreadable: a cold start, no error
    assert serve(1) >= 1


def test_a_request_that_drafts_well_after_ones_that_did_not_is_not_kept_plain():
    """Mixed traffic through one server: the regime's recent trees belong to requests whose drafts
    were rejected (MT-Bench-like); a new request whose text drafts well (GSM8K-like) probes its first
    round and then forecasts from its own trees. Measured through HTTP before: GSM8K after MT-Bench
    plain in 56 of 60 rounds. Without the probe (``probe=False``) it stays plain here too."""
    tree = _chain_tree([math.log(0.9) * (d + 1) for d in range(8)])

    def run(probe):
        pol = _tile_policy(Q4_C, probe=probe)
        for i in range(3):
            _drive_budgets(pol, tree, 40, accepted=0, rid=f"hard{i}")
            pol.release(f"hard{i}")
        drafted, _ = _drive_budgets(pol, tree, 30, accepted=8, rid="easy")
        return len(drafted)

    assert run(True) >= 25
    assert run(False) <= 10


def _round(pol, rid, tree, owed, remaining=None, accepted=0):
    """One decode round of ``rid`` (owing ``owed`` context tokens); returns whether it called the drafter."""
    info = RoundInfo(rid, "dartree-pruned", 0.0, can_draft=True, owed=owed, remaining=remaining)
    pol.begin_step([info])
    knobs = pol.draft_knobs(rid, _Spec())
    sel = pol.select([Drafted(info, tree if knobs else DraftTree.empty(), knobs is not None)])[rid]
    path = [int(t) for t in tree.draft_tokens[:accepted]]  # the text follows the tree, verified or not
    pol.observe_round(rid, path + [99])
    rows = 1 + sel.budget
    fwd, wait = pol.cost.forward_seconds(rows), pol.cost.draft_cost(owed) if knobs else 0.0
    pol.observe_step(StepStats(1, rows, 0, fwd, wait, wait, 1, int(knobs is not None), int(sel.budget > 0),
                               fwd + wait, draft_owed=owed if knobs else 0))
    return knobs is not None


def _catch_up_policy(**kw):
    """q4 curve; a drafter call costs 10 ms + 0.3 ms per owed context token (the CPU drafter's catch-up)."""
    pol = _tile_policy(Q4_C, **kw)
    for owed in (1, 300) * 20:
        pol.cost.observe_draft(0.010 + 0.0003 * owed, 1, owed)
    return pol


def test_a_probe_must_pay_for_its_catch_up():
    """A request's first draft catches the drafter up on its whole prompt (measured in process, q4,
    243-token MT-Bench prompt: probe round 85-98 ms vs 30-36 ms plain), a cost ``ar`` never pays.
    After requests whose drafts were all rejected, a request owing 400 prompt tokens with 16 tokens to
    go stays plain in every round (no drafter call, no catch-up: the same work as ``ar``); one owing 2
    tokens, or with a long way to go, still probes. Before, every request probed its first round."""
    tree = _chain_tree([math.log(0.9) * (d + 1) for d in range(8)])
    pol = _catch_up_policy(explore_fraction=0.0)  # no explorations: only the probe can draft
    for i in range(12):
        for k in range(6):
            _round(pol, f"hard{i}", tree, owed=300 if k == 0 else 1, remaining=64 - k, accepted=0)
        pol.release(f"hard{i}")
    calls = [_round(pol, "long-short", tree, owed=400 + k, remaining=16 - k) for k in range(16)]
    assert not any(calls), calls
    assert _round(pol, "short-prompt", tree, owed=2, remaining=64)
    assert _round(pol, "long-long", tree, owed=400, remaining=4096)


def test_probes_resume_when_the_traffic_has_text_that_drafts_well():
    """The probe's expected saving is the mean over the regime's recent requests: one request that
    drafted well among rejected ones makes a long-prompt request probe again (mixed traffic: GSM8K
    among MT-Bench / ShareGPT through one server); with rejected ones only it does not."""
    tree = _chain_tree([math.log(0.97) * (d + 1) for d in range(8)])

    def probes(with_easy):
        pol = _catch_up_policy(explore_fraction=0.0)
        names = [f"hard{i}" for i in range(16)]
        if with_easy:  # one among them (arriving while the evidence was thin)
            names.insert(8, "easy")
        for name in names:
            for k in range(12):
                _round(pol, name, tree, owed=300 if k == 0 else 1, remaining=64 - k,
                       accepted=8 if name == "easy" else 0)
            pol.release(name)
        return _round(pol, "new", tree, owed=300, remaining=64)

    assert probes(True)
    assert not probes(False)


def test_the_probe_gate_learns_request_length_when_max_tokens_is_unknown():
    """Without ``remaining`` the gate uses the regime's mean request length minus what the request
    emitted: near the end of a typical request a long catch-up is not worth starting."""
    tree = _chain_tree([math.log(0.9) * (d + 1) for d in range(8)])
    pol = _catch_up_policy(explore_fraction=0.0)
    for i in range(12):
        for k in range(20):
            _round(pol, f"hard{i}", tree, owed=300 if k == 0 else 1, accepted=0)
        pol.release(f"hard{i}")
    assert not _round(pol, "late", tree, owed=400)


def test_explorations_draft_small_trees_and_probes_whole_ones():
    """An exploration (a draft made regardless of the forecast by a request that has drafted) asks
    whether the drafter beats its forecast; its first nodes answer that. On the q4 curve it drafts at
    most the forecast's best budget + 1 and no more than the 4-row tile holds (3), not ``B_max`` = 8
    (a 9-row block and verify in a round the forecast expected to lose). A request's first draft (its
    probe) keeps the whole budget: its own forecast starts from that tree."""
    tree = _chain_tree([math.log(0.9) * (d + 1) for d in range(8)])
    pol = _tile_policy(Q4_C, explore_every=4, explore_fraction=1.0)
    drafted, _ = _drive_budgets(pol, tree, 80, accepted=0)       # nothing is ever accepted
    assert drafted[0] == 8, drafted                              # no forecast yet: the cap
    assert len(drafted) >= 5, drafted                            # explorations kept coming ...
    assert max(drafted[2:]) <= 3, drafted                        # ... as trees within the 4-row tile
    knobs = []
    for i in range(3):                                           # new requests: their probes
        info = RoundInfo(f"new{i}", "dartree-pruned", 0.0, can_draft=True, owed=1, remaining=4096)
        pol.begin_step([info])
        knobs.append(pol.draft_knobs(f"new{i}", _Spec()))
    assert all(k is not None and k.budget == 8 for k in knobs), knobs
    good = _tile_policy(Q4_C)
    _drive_budgets(good, tree, 30, accepted=8)                   # a drafter the forecast trusts
    best = good.explore_budget(good.forecast("dartree-pruned:greedy"))
    assert 2 <= best <= 3, best                                  # within the 4-row tile edge
