"""Predicted speedup per tree budget from the measured round cost and a mean acceptance length τ.

For budget ``B`` (draft nodes; the verify has ``B + 1`` rows)::

    t_round(B) = draft + tree_build(B) + verify(B + 1 rows) + commit(B)      (ms, measured here)
    speedup(B) = τ(B) × t_step(1 row) / t_round(B)                            (c = 1: one request)

``verify`` and ``t_step(1 row)`` come from one attention path of the verify curve
(:mod:`benchmarks.gpu_verify_curve`); ``draft``, ``tree_build`` and ``commit`` from the engine's
``dartree-pruned`` cell at ``B`` (:mod:`benchmarks.gpu_check.engines`). τ includes the bonus token
(docs/algorithms.md §6). The τ sources:

- ``paper``: the DARTree paper's Table 1 τ per budget. The repository holds no such per-budget
  figures, so the source is reported as unavailable unless given with ``--paper-tau B=τ``.
- ``replay-protocol``: our drafter's replayed τ on the τ protocol (32 prompts × 3 sets, T = 0,
  W = 12, β = −0.2), at B = 8 and B = 64 (:data:`PROTOCOL_RESULTS`).
- ``replay-trace``: the recorded ``dartree-pruned`` trace of the shipped drafter on 4 GSM8K prompts
  (:data:`TRACE`), walked round by round at every B ≤ 8 (a prefix of the builder's order is the
  B-budget tree).

Every τ is the SmolLM2-135M drafter's: the targets timed here are random weights, so the product
is a prediction for a drafter as good as ours, not a measurement.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
PROTOCOL_RESULTS = {8: RESULTS / "2026-12-02-tau-drafter-v2-b8" / "results-B8.json",
                    64: RESULTS / "2026-12-02-tau-drafter-v2-b8" / "results-B64.json"}
TRACE = RESULTS / "2026-12-07-policy-replay" / "trace-gsm8k.json"
PAPER_UNAVAILABLE = ("the repository holds no per-budget tau from the DARTree paper's Table 1; "
                     "pass --paper-tau B=tau to add them")


def round_ms(phases: dict[str, float], verify_ms: float) -> float:
    """``draft + tree_build + verify + commit`` in ms (``phases``: the engine's phase means, ms)."""
    return phases["draft"] + phases["tree_build"] + verify_ms + phases["commit"]


def predict(step1_ms: float, verify_ms: dict[int, float], phases: dict[int, dict[str, float]],
            taus: dict[int, float]) -> list[dict]:
    """One row per budget ``B`` in ``taus`` that has a verify time of ``B + 1`` rows and a phase cell.

    Args:
        step1_ms: one verify step of one row (ms): the plain decoding step.
        verify_ms: ``{rows: ms}`` of one verify step.
        phases: ``{B: {"draft", "tree_build", "commit": ms}}``.
        taus: ``{B: τ}`` (tokens per round, bonus included).
    Returns:
        ``[{"budget", "tau", "t_step1_ms", "t_round_ms", "speedup"}]`` sorted by budget; a budget
        missing a measurement has ``speedup`` None and ``missing`` naming what is missing.
    Raises:
        ValueError: ``step1_ms`` is not positive.
    """
    if step1_ms <= 0:
        raise ValueError(f"the one-row step must take a positive time (got {step1_ms} ms)")
    rows = []
    for b in sorted(taus):
        row = {"budget": b, "tau": taus[b], "t_step1_ms": step1_ms, "t_round_ms": None, "speedup": None}
        missing = ([f"verify of {b + 1} rows"] if b + 1 not in verify_ms else []) + (
            [f"dartree-pruned cell at B={b}"] if b not in phases else [])
        if missing:
            row["missing"] = ", ".join(missing)
        else:
            row["t_round_ms"] = round_ms(phases[b], verify_ms[b + 1])
            row["speedup"] = taus[b] * step1_ms / row["t_round_ms"]
        rows.append(row)
    return rows


def protocol_taus(files: dict[int, Path] = PROTOCOL_RESULTS) -> dict[str, dict[int, float]]:
    """``{dataset: {B: τ}}`` of ``dartree-pruned`` at T = 0 from ``dartree bench`` results files
    (their ``table1``), ``mean`` included."""
    out: dict[str, dict[int, float]] = {}
    for b, path in files.items():
        cells = json.loads(Path(path).read_text())["table1"]["0"]["dartree-pruned"]
        for dataset, cell in cells.items():
            if cell.get("tau") is not None:
                out.setdefault(dataset, {})[b] = float(cell["tau"])
    return out


def trace_taus(path: Path = TRACE, budgets=range(1, 9)) -> dict[int, float]:
    """``{B: τ}`` of a recorded trace: per turn, rounds from its first position, each emitting the
    accepted draft tokens of the B-node tree + 1 and moving on by as many positions; τ is the mean
    over turns of emitted / rounds (the macro mean of ``dartree bench``)."""
    from benchmarks.policy_replay import Position

    turns = json.loads(Path(path).read_text())["turns"]
    positions = [[Position(tuple(a), tuple(s), tuple(bool(h) for h in hits)) for a, s, hits in t]
                 for t in turns.values()]
    out = {}
    for b in budgets:
        per_turn = []
        for turn in positions:
            i = rounds = emitted = 0
            while i < len(turn):
                step = turn[i].accepted(turn[i].tree(b)) + 1
                rounds, emitted, i = rounds + 1, emitted + step, i + step
            per_turn.append(emitted / rounds)
        out[b] = sum(per_turn) / len(per_turn)
    return out


def parse_paper_tau(items: list[str]) -> dict[int, float]:
    """``["64=5.1", ...]`` -> ``{64: 5.1}``.

    Raises:
        ValueError: an item is not ``B=τ`` with an integer B >= 1 and τ >= 1 (one line).
    """
    out = {}
    for item in items:
        b, sep, tau = item.partition("=")
        try:
            b_i, tau_f = int(b), float(tau)
        except ValueError:
            b_i, tau_f = 0, 0.0
        if not sep or b_i < 1 or tau_f < 1:
            raise ValueError(f"--paper-tau {item!r}: expected B=tau with an integer B >= 1 and tau >= 1")
        out[b_i] = tau_f
    return out


def tau_sources(paper: dict[int, float]) -> dict[str, dict]:
    """Every τ source (module docstring): ``{name: {"status", "taus": {dataset: {B: τ}}, ...}}``."""
    out = {"paper": ({"status": "ok", "taus": {"given": paper}, "source": "--paper-tau"} if paper
                     else {"status": "unavailable", "reason": PAPER_UNAVAILABLE, "taus": {}})}
    for name, load, src in (("replay-protocol", protocol_taus, [str(p.relative_to(REPO)) for p in
                                                                 PROTOCOL_RESULTS.values()]),
                            ("replay-trace", lambda: {"gsm8k": trace_taus()}, [str(TRACE.relative_to(REPO))])):
        try:
            out[name] = {"status": "ok", "taus": load(), "source": src}
        except (OSError, KeyError, ValueError) as e:
            out[name] = {"status": "unavailable", "reason": f"{type(e).__name__}: {e}"[:300], "taus": {},
                         "source": src}
    return out


def predictions(cells: list[dict], curves: list[dict], sources: dict[str, dict], mode: str) -> list[dict]:
    """:func:`predict` per shape, τ source and data set, from the breakdown ``cells`` (non-graph
    ``dartree-pruned``) and the verify-curve entries of attention path ``mode``."""
    out = []
    for shape in dict.fromkeys(c["shape"] for c in curves):
        verify = {c["rows"]: c["ms"] for c in curves if c["shape"] == shape and c.get("mode") == mode
                  and c.get("status") == "ok"}
        phases = {c["budget"]: c["phase_ms"] for c in cells if c["shape"] == shape and c.get("status") == "ok"
                  and c.get("method") == "dartree-pruned" and not c.get("graphs")}
        if 1 not in verify:
            continue
        for name, src in sources.items():
            for dataset, taus in src["taus"].items():
                measured = {b: t for b, t in taus.items() if b in phases}  # the budgets timed here
                out += [{"shape": shape, "mode": mode, "source": name, "dataset": dataset, **row}
                        for row in predict(verify[1], verify, phases, measured)]
    return out
