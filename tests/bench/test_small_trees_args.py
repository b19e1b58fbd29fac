"""``bench_small_trees`` rejects bad arguments with a one-line usage error, before loading anything."""

from __future__ import annotations

import pytest

from benchmarks import bench_small_trees


def test_negative_verify_context_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench_small_trees.main(["cost", "--verify-context", "-1"])
    assert e.value.code == 2
    assert "--verify-context must be >= 0, got -1" in capsys.readouterr().err
