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


def test_the_timed_drafter_client_runs_its_forward_before_each_draft_outside_the_timing():
    """``cost`` times each draft after a target forward, as the engine runs it; that forward is not
    part of the draft's time."""
    import time

    from benchmarks.bench_small_trees import _TimedClient

    log = []

    class Inner:
        def submit(self, jobs):
            log.append(("submit", jobs))
            return jobs

        def collect(self, handle):
            log.append(("collect", handle))
            return handle

    client = _TimedClient(Inner(), before=lambda: (log.append(("forward", None)), time.sleep(0.05)))
    for k in range(2):
        client.collect(client.submit(k))
    assert [e[0] for e in log] == ["forward", "submit", "collect"] * 2
    assert len(client.seconds) == 2 and max(client.seconds) < 0.04  # the 50 ms forward is left out
    warm = _TimedClient(Inner())
    warm.collect(warm.submit(0))
    assert log[-2:] == [("submit", 0), ("collect", 0)]
