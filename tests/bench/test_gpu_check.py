"""``make gpu-check`` end to end in its CPU ``--smoke`` mode: one JSON with every section filled and
one PNG; bad arguments are one line and exit code 2 (the full mode needs a GPU: see the script).
The served part alone: tests/bench/test_gpu_check_serve.py; the whole check with it (slow):
tests/bench/test_gpu_bundle.py."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu_check import PHASES, main
from benchmarks.gpu_verify_curve import MODES, SMOKE_ROWS


def test_smoke_writes_one_json_and_one_png(tmp_path, capsys):
    out = tmp_path / "gc"
    assert main(["--smoke", "--out", str(out), "--methods", "ar", "dflash", "ddtree", "dartree-pruned", "--no-serve",
                 "--paper-tau", "8=3.5"]) == 0
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
    _check_cells(res)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cells_not_ok"] == 0
    _check_predicted(res)
    assert res["served"] == {"status": "not run", "reason": "--no-serve"} and "served: --no-serve" in res["skipped"]
    assert all(f["available"] for f in res["compat"])  # the pinned torch / transformers have every API


def _check_cells(res: dict) -> None:
    """The breakdown cells, the graph probes and the verify curve of the smoke run."""
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


def _check_predicted(res: dict) -> None:
    """Every predicted speedup recomputed from the JSON's own cells and verify curve (eager tree attention
    on the CPU), for every tau source at every measured budget it has a tau for."""
    pred = res["predicted"]
    assert pred["verify_mode"] == "tree-attention"
    sources = pred["tau_sources"]
    assert sources["paper"] == {"status": "ok", "taus": {"given": {"8": 3.5}}, "source": "--paper-tau"}
    assert sources["replay-protocol"]["status"] == sources["replay-trace"]["status"] == "ok"
    rows = pred["speedup"]
    want = {(s, "paper", "given", 8) for s in ("tiny-llama", "tiny-qwen3")}
    want |= {(s, "replay-trace", "gsm8k", b) for s in ("tiny-llama", "tiny-qwen3") for b in (4, 8)}
    want |= {(s, "replay-protocol", d, 8) for s in ("tiny-llama", "tiny-qwen3")
             for d in ("gsm8k", "humaneval", "mt-bench", "mean")}
    assert {(r["shape"], r["source"], r["dataset"], r["budget"]) for r in rows} == want
    for r in rows:
        verify = {c["rows"]: c["ms"] for c in res["verify_curve"] if c["shape"] == r["shape"]
                  and c["mode"] == "tree-attention"}
        (cell,) = [c for c in res["breakdown"] if c["shape"] == r["shape"] and c["method"] == "dartree-pruned"
                   and c["budget"] == r["budget"] and not c["graphs"]]
        ph = cell["phase_ms"]
        t_round = ph["draft"] + ph["tree_build"] + verify[r["budget"] + 1] + ph["commit"]
        assert r["t_step1_ms"] == verify[1] and r["t_round_ms"] == pytest.approx(t_round)
        assert r["speedup"] == pytest.approx(r["tau"] * verify[1] / t_round)
    assert {r["tau"] for r in rows if r["source"] == "paper"} == {3.5}
    assert pred["budgets_without_tau"] == []


@pytest.mark.parametrize("argv, msg", [(["--device", "cuda"], "no CUDA device"),
                                       (["--smoke", "--methods", "nope"], "unknown method"),
                                       (["--smoke", "--rounds", "-1"], "must be positive"),
                                       (["--smoke", "--shapes", "qwen3-4b"], "unknown shape"),
                                       (["--smoke", "--paper-tau", "64"], "expected B=tau"),
                                       (["--smoke", "--paper-tau", "64=0.5"], "expected B=tau")])
def test_bad_arguments_are_one_line(tmp_path, capsys, argv, msg):
    import torch

    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(["--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1
