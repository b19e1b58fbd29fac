"""``bench_small_trees`` rejects bad arguments with a one-line usage error, before loading anything."""

from __future__ import annotations

import pytest

from benchmarks import bench_small_trees


def test_negative_verify_context_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench_small_trees.main(["cost", "--verify-context", "-1"])
    assert e.value.code == 2
    assert "--verify-context must be >= 0, got -1" in capsys.readouterr().err


def test_e2e_mismatch_records_name_the_prompt_and_the_first_differing_token():
    from benchmarks.bench_small_trees import _mismatches

    ref = {0: [1, 2, 3], 1: [4, 5, 6], 2: [7, 8]}
    assert _mismatches(ref, dict(ref)) == []
    got = _mismatches(ref, {0: [1, 2, 3], 1: [4, 9, 6], 2: [7, 8, 1]})
    assert got == [{"prompt": 1, "position": 1, "ar": 5, "got": 9},
                   {"prompt": 2, "position": 2, "ar": None, "got": 1}]
