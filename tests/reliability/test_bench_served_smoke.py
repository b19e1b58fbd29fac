"""``benchmarks/bench_served.py`` runs end to end on the tiny models (slow: starts a server; not in CI)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_served

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_bench_served_tiny_smoke(capsys):
    assert bench_served.main(["--tiny", "--repeats", "1", "--prompts", "1", "--max-tokens", "24"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["same_tokens"] and result["round_ms"]["served"] > 0 and "ttft_added_ms" in result
