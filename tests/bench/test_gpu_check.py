"""``make gpu-check`` end to end in its CPU ``--smoke`` mode: one JSON with every section filled and
one PNG; bad arguments are one line and exit code 2 (the full mode needs a GPU: see the script)."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu_check import PHASES, main
from benchmarks.gpu_verify_curve import MODES, SMOKE_ROWS


def test_smoke_writes_one_json_and_one_png(tmp_path, capsys):
    out = tmp_path / "gc"
    assert main(["--smoke", "--out", str(out), "--methods", "ar", "dflash", "ddtree", "dartree-pruned"]) == 0
    res = json.loads((out / "gpu_check.json").read_text())
    assert res["mode"] == "smoke" and res["png"] == "gpu_check.png"
    assert (out / "gpu_check.png").stat().st_size > 5000
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.png"]
    for key in ("python", "torch", "transformers", "device"):
        assert key in res["env"]
    # no GPU: every gpu test skipped, and the status says so (not "ok")
    assert res["tests"]["status"] == "skipped" and res["tests"]["counts"].get("skipped", 0) >= 4
    assert not res["tests"]["counts"].get("passed")
    assert {"tests/engine/test_cuda_graphs.py", "tests/service/test_ipc_pool.py"} <= set(res["tests"]["files"])
    cells = res["breakdown"]
    assert {c["shape"] for c in cells} == {"tiny-llama", "tiny-qwen3"}
    assert all(c["status"] == "ok" and c["rounds"] >= 1 for c in cells)
    # one cell per (shape, method) and per B for tree methods; ar and dartree-pruned again on the
    # padded (CUDA-graph) runner, which on the CPU runs its padded steps eagerly, captures nothing
    nb = len(res["config"]["budgets"])
    assert len([c for c in cells if not c["graphs"]]) == 2 * (2 + 2 * nb)
    graphed = [c for c in cells if c["graphs"]]
    assert sorted((c["shape"], c["method"], c["budget"] or 0) for c in graphed) == sorted(
        (s, m, b) for s in ("tiny-llama", "tiny-qwen3") for m, bs in (("ar", [0]), ("dartree-pruned", res["config"]
                                                                                  ["budgets"])) for b in bs)
    assert all(c["graphs_captured"] == 0 for c in graphed)
    for c in cells:
        ph = c["phase_ms"]
        assert set(ph) == set(PHASES) and ph["verify"] > 0 and ph["round"] >= ph["verify"]
        assert (c["method"] == "ar") == (ph["draft"] == 0)
        if c["method"] in ("ddtree", "dartree-pruned"):
            assert 0 < c["mean_nodes"] <= c["budget"]
    assert {(p["shape"], p["rows"]) for p in res["graph_probe"]} == {
        (s, b + 1) for s in ("tiny-llama", "tiny-qwen3") for b in res["config"]["budgets"]}
    assert all(p["captured"] is False and p["graph_ms"] is None and p["graph_equals_eager"] is None
               for p in res["graph_probe"])  # CPU: the eager fallback, nothing compared
    # the verify curve: every path at every row count, equal to the dense path (float32 on CPU)
    curve = res["verify_curve"]
    assert {(c["shape"], c["mode"], c["rows"]) for c in curve} == {
        (s, m, r) for s in ("tiny-llama", "tiny-qwen3") for m in MODES for r in SMOKE_ROWS}
    assert all(c["status"] == "ok" and c["ms"] > 0 and c["max_abs_diff_vs_dense"] < 1e-4 for c in curve)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cells_not_ok"] == 0


@pytest.mark.parametrize("argv, msg", [(["--device", "cuda"], "no CUDA device"),
                                       (["--smoke", "--methods", "nope"], "unknown method"),
                                       (["--smoke", "--rounds", "-1"], "must be positive")])
def test_bad_arguments_are_one_line(tmp_path, capsys, argv, msg):
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(["--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1
