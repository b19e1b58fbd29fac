"""``gpu_check``'s predicted speedup (the arithmetic on a given curve, the tau sources) and its API
probes (missing APIs listed and their part left out; version-gated calls only where allowed)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from benchmarks.gpu_check import compat, predict
from benchmarks.gpu_check.cli import apply_compat, parse_args

REPO = Path(__file__).resolve().parents[2]


def test_predict_on_a_given_curve():
    verify = {1: 10.0, 9: 12.0, 65: 15.0}
    phases = {8: {"draft": 2.0, "tree_build": 1.0, "commit": 1.0, "verify": 99.0, "round": 99.0},
              64: {"draft": 2.0, "tree_build": 3.0, "commit": 2.0}}
    rows = predict.predict(10.0, verify, phases, {64: 4.0, 8: 2.5, 16: 3.0})
    assert [r["budget"] for r in rows] == [8, 16, 64]
    b8, b16, b64 = rows
    assert b8["t_round_ms"] == 16.0 and b8["speedup"] == pytest.approx(2.5 * 10 / 16)  # 2 + 1 + 12 + 1
    assert b64["t_round_ms"] == 22.0 and b64["speedup"] == pytest.approx(4.0 * 10 / 22)  # 2 + 3 + 15 + 2
    assert b16["speedup"] is None and b16["missing"] == "verify of 17 rows, dartree-pruned cell at B=16"
    assert "missing" not in b8 and b8["tau"] == 2.5 and b8["t_step1_ms"] == 10.0
    with pytest.raises(ValueError, match="positive"):
        predict.predict(0.0, verify, phases, {8: 2.0})


def test_trace_tau_walks_rounds(tmp_path):
    """One turn of 5 positions, chains of two nodes: at B = 1 the rounds emit 2, 1, 2 tokens (tau 5/3);
    at B = 2 they emit 3, 2 (tau 5/2): each round jumps by what it emitted."""
    chain, hit2, hit1, miss = [-1, 0], [1, 1], [1, 0], [0, 0]
    turn = [[chain, [-0.1, -0.2], h] for h in (hit2, miss, miss, hit1, miss)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"meta": {}, "turns": {"t0": turn}}))
    taus = predict.trace_taus(path, budgets=(1, 2))
    assert taus[1] == pytest.approx(5 / 3) and taus[2] == pytest.approx(5 / 2)


def test_replayed_tau_sources_read_the_recorded_results():
    """The tau-protocol replays at B = 8 and 64 (their README's GSM8K figures, 2.69 and 3.54) and the
    recorded GSM8K trace at B = 1 ... 8 (more nodes never lower tau on one text)."""
    proto = predict.protocol_taus()
    assert round(proto["gsm8k"][8], 2) == 2.69 and round(proto["gsm8k"][64], 2) == 3.54
    assert set(proto) == {"gsm8k", "humaneval", "mt-bench", "mean"}
    trace = predict.trace_taus()
    assert sorted(trace) == list(range(1, 9)) and 1.0 < trace[1]
    assert all(trace[b] <= trace[b + 1] for b in range(1, 8))
    sources = predict.tau_sources({})
    assert sources["paper"]["status"] == "unavailable" and "Table 1" in sources["paper"]["reason"]
    assert sources["replay-trace"]["taus"] == {"gsm8k": trace}


def test_parse_paper_tau():
    assert predict.parse_paper_tau(["64=5.25", "16=3"]) == {64: 5.25, 16: 3.0}
    for bad in ("64", "x=2", "0=2", "8=0.9"):
        with pytest.raises(ValueError, match="expected B=tau"):
            predict.parse_paper_tau([bad])


def test_a_missing_api_is_listed_and_its_part_left_out():
    features = compat.probe((*compat.FEATURES, compat.Feature("torch.cuda.no_such_graph_api", "a test", "graphs"),
                             compat.Feature("transformers.NoSuchQwen3", "a test", "qwen3")))
    missing = [f for f in features if not f["available"]]
    assert [f["api"] for f in missing] == ["torch.cuda.no_such_graph_api", "transformers.NoSuchQwen3"]
    assert missing[0]["reason"].startswith("not in torch ") and "AttributeError" in missing[0]["reason"]
    assert compat.missing_skips(features) == {"graphs", "qwen3"}
    lines = compat.skipped_lines(features)
    assert len(lines) == 2 and lines[0].startswith("torch.cuda.no_such_graph_api: not in torch")
    assert lines[0].endswith("needed by a test (graphs left out)")
    a = parse_args(["--smoke", "--out", "x"])
    apply_compat(a, features)
    assert a.graphs is False and a.shapes == ["tiny-llama"]
    with pytest.raises(ImportError):
        compat.resolve("no_such_package.thing")


def test_every_probed_api_exists_at_the_pinned_versions():
    assert all(f["available"] for f in compat.probe()), compat.skipped_lines(compat.probe())


def _names(source: str) -> set[str]:
    """Every identifier a module uses as a name, an attribute, a keyword argument or an import."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            out.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {part for a in node.names for part in a.name.split(".")}
            out |= set((getattr(node, "module", None) or "").split("."))
    return out


def test_version_gated_calls_stay_in_their_modules():
    """The check's code (services/ and benchmarks/gpu_check*) names a version-gated API only in the
    modules allowed to (transformers' through services/hf_compat.py); the scan sees imports,
    attributes and keyword arguments, not text in docstrings."""
    assert {"DynamicCache", "flex_attention", "past_key_values"} <= _names(
        "from transformers import DynamicCache\nimport torch.nn.attention.flex_attention\nf(past_key_values=1)")
    files = [*REPO.glob("services/**/*.py"), *REPO.glob("benchmarks/gpu_check/*.py"),
             REPO / "benchmarks/gpu_verify_curve.py", REPO / "benchmarks/gpu_bundle.py"]
    offenders = []
    for f in files:
        rel = str(f.relative_to(REPO))
        for name in _names(f.read_text()) & set(compat.VERSION_GATED):
            if rel not in compat.VERSION_GATED[name]:
                offenders.append(f"{rel}: {name}")
    assert not offenders
    for allowed in {p for paths in compat.VERSION_GATED.values() for p in paths}:
        assert (REPO / allowed).is_file(), allowed
