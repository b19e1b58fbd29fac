"""``benchmarks.bench_stats.write_result``: the JSON file and the last stdout line every benchmark ends with."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_stats import write_result


def test_write_result_writes_the_file_in_a_new_folder_and_prints_one_json_line(tmp_path, capsys):
    res = {"tau": 2.5, "rows": [1, 2], "command": "python -m benchmarks.x"}
    out = tmp_path / "new" / "deeper" / "res.json"
    assert write_result(res, out) is res
    assert json.loads(out.read_text()) == res and out.read_text().startswith("{\n  ")  # indented
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and json.loads(printed[-1]) == res


def test_write_result_without_out_only_prints(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_result({"a": 1}, None)
    write_result({"b": 2}, "")
    assert capsys.readouterr().out.splitlines() == ['{"a": 1}', '{"b": 2}'] and not list(tmp_path.iterdir())


def test_a_result_json_cannot_encode_leaves_no_file(tmp_path):
    out = tmp_path / "res.json"
    with pytest.raises(TypeError):
        write_result({"bad": object()}, out)
    assert not out.exists()
