"""benchmarks.roofline: the speedup model and the report from small synthetic inputs."""

from __future__ import annotations

import pytest

from benchmarks.roofline import check_e2e, overhead_of, predict, report, speedups

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
