"""benchmarks.roofline: the speedup model and the report from small synthetic inputs."""

from __future__ import annotations

import pytest

from benchmarks.roofline import check_e2e, overhead_of, predict, report, speedups, tree_overhead_of

TAU = {(1, 16): {"mean": 1.5, "gsm8k": 1.6}, (3, 16): {"mean": 1.9, "gsm8k": 2.1}, (3, 4): {"mean": 1.8, "gsm8k": 2.0}}
COST = {"unit": "q4", "unit_ms": 20.0, "rows": [1, 2, 3, 4], "machine": {"processor": "x", "torch": "t", "threads": 1},
        "formats": {
            "q4": {"drafter_dtype": "bfloat16", "forward_ms": {"1": 20.0}, "c": {"1": 1.0, "2": 1.0, "3": 1.1, "4": 1.2},
                   "draft": {"1/16": {"d": 0.5}, "3/16": {"d": 0.5}, "3/4": {"d": 0.4}}},
            "float32": {"drafter_dtype": "float32", "forward_ms": {"1": 40.0}, "c": {"1": 1.0, "2": 1.5, "3": 1.6, "4": 1.6},
                        "draft": {"3/16": {"d": 0.25}}}}}
E2E = {"weights": "q4", "datasets": ["gsm8k"], "settings": {"ar": {"tokens_per_s": 40.0},
                                                          "fixed B=3 L=4": {"vs_ar": 1.4, "vs_ar_paired": 1.38}}}


def test_predict_is_tau_over_round_cost() -> None:
    assert predict(2.0, 1.0, 0.0, 0.0) == 2.0
    assert predict(1.0, 1.0, 0.0, 0.5) == 1.0  # plain decoding as a "tree": exactly 1
    assert predict(2.0, 1.5, 0.5, 1.0) == pytest.approx(2.0 * 2.0 / 3.0)
    assert predict(2.0, 1.5, 0.5, 1.0, 0.5) == pytest.approx(2.0 * 2.0 / 3.5)  # a tree round's extra work


def test_speedups_per_format_and_against_the_unit_format() -> None:
    rows = {(r["B"], r["L"]): r for r in speedups(TAU, COST, "q4", overhead_ms=5.0)}
    assert rows[(3, 4)]["speedup"] == pytest.approx(1.8 * 1.25 / (1.2 + 0.4 + 0.25), abs=1e-3)
    assert rows[(3, 4)]["speedup_vs_unit"] == rows[(3, 4)]["speedup"]
    f32 = speedups(TAU, COST, "float32", overhead_ms=5.0)[0]
    assert f32["speedup_vs_unit"] == pytest.approx(f32["speedup"] * 25.0 / 45.0, abs=1e-3)


def test_e2e_overhead_and_check() -> None:
    assert overhead_of(E2E, COST) == pytest.approx(5.0)  # 25 ms ar step - 20 ms forward
    (row,) = check_e2e(TAU, COST, E2E, 5.0)
    assert row["setting"] == "fixed B=3 L=4" and row["measured"] == 1.4
    assert row["predicted"] == pytest.approx(2.0 * 1.25 / 1.85, abs=1e-3)
    text, out = report(TAU, COST, {64: {"mean": 2.6}}, 0.15, E2E)
    assert "predicted vs measured" in text and out["gpu"][-1]["B"] == 64


def test_step_timings_give_o_and_the_tree_rounds_extra_e() -> None:
    timed = {"weights": "q4", "datasets": ["gsm8k"], "settings": {
        "ar": {"tokens_per_s": 40.0, "step_ms": {"wall": 21.0, "forward": 20.0, "draft_wait": 0.0, "other": 1.0}},
        "goodput": {"vs_ar": 1.3, "vs_ar_paired": 1.3,
                    "step_ms": {"wall": 40.0, "forward": 24.0, "draft_wait": 8.0, "other": 8.0}},
        "fixed B=3 L=4": {"vs_ar": 1.4, "vs_ar_paired": 1.38,
                          "step_ms": {"wall": 35.0, "forward": 24.0, "draft_wait": 8.0, "other": 3.0}},
        "fixed B=3 L=16": {"vs_ar": 1.3, "vs_ar_paired": 1.3,
                           "step_ms": {"wall": 38.0, "forward": 24.0, "draft_wait": 10.0, "other": 4.0}}}}
    assert overhead_of(timed, COST) == pytest.approx(1.0)  # the ar steps' own time outside the forward
    assert tree_overhead_of(timed) == pytest.approx(2.5)  # fixed settings only: (2 + 3) / 2
    assert tree_overhead_of(E2E) == 0.0  # no step timings
    rows = {r["setting"]: r for r in check_e2e(TAU, COST, timed, 1.0, 2.5)}
    assert rows["fixed B=3 L=4"]["predicted"] == pytest.approx(2.0 * 1.05 / (1.2 + 0.4 + 0.05 + 0.125), abs=1e-3)
    text, out = report(TAU, COST, {}, 0.15, timed)
    assert out["tree_overhead_ms"] == 2.5 and "e = 2.5 ms" in text


def test_run_level_splits_each_decode_step_into_forward_draft_and_the_rest(tmp_path) -> None:
    import torch

    from benchmarks.bench_goodput import run_level
    from services.generate import build_inprocess
    from services.tiny_models import make_tiny_models

    target, drafter = make_tiny_models(tmp_path)
    engine, _tok, _note = build_inprocess(str(target), str(drafter), torch.float32)
    plain = run_level(engine, [[5, 6, 7, 8]], 1, "ar", None, 12)["step_ms"]
    tree = run_level(engine, [[5, 6, 7, 8]], 1, "dartree-pruned", 4, 12)["step_ms"]
    for split in (plain, tree):
        assert split["steps"] >= 1 and split["forward"] > 0 and split["wall"] >= split["forward"]
        assert split["other"] == pytest.approx(split["wall"] - split["forward"] - split["draft_wait"], abs=2e-3)
    assert plain["draft_wait"] < tree["draft_wait"]  # the tree steps drafted (in process: inside the wait)
