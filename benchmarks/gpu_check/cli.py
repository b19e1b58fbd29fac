"""``python -m benchmarks.gpu_check``: arguments, their checks and the run of every section (see the package)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.gpu_bundle import activate
import benchmarks.gpu_check.compat as compat
import benchmarks.gpu_check.predict as predict
from benchmarks.gpu_check.breakdown import METHODS, breakdown, gpu_test_files, run_tests
from benchmarks.gpu_check.engines import shapes
from benchmarks.gpu_check.report import env_info, plot, print_table, skipped_parts
from benchmarks.gpu_check.serve import served_check


DESCRIPTION = "make gpu-check: on a CUDA machine, the gpu-marked tests, the served stack and the round cost, in one go."


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=DESCRIPTION)
    p.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.png")
    p.add_argument("--smoke", action="store_true", help="tiny configs on the CPU (minutes; what CI runs)")
    p.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    p.add_argument("--shapes", nargs="+", default=None,
                   help="target shapes (default qwen3-4b qwen3-8b; smollm2-135m too; smoke: tiny-llama tiny-qwen3)")
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--budgets", nargs="+", type=int, default=None, help="default 8 16 32 64 (smoke: 4 8)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per cell (default 16; smoke 3)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens (default 256; smoke 24)")
    p.add_argument("--probe-reps", type=int, default=None, help="graph-probe repetitions (default 20; smoke 2)")
    p.add_argument("--time-limit", type=float, default=420.0, help="seconds for the whole check")
    p.add_argument("--bundle", default=None,
                   help="folder of wheels (make gpu-bundle) to unpack into a scratch target and import first")
    p.add_argument("--no-tests", dest="tests", action="store_false", help="skip the gpu-marked tests")
    p.add_argument("--no-graphs", dest="graphs", action="store_false",
                   help="skip the CUDA-graph runner cells (ar and dartree-pruned on padded, captured steps)")
    p.add_argument("--no-serve", dest="serve", action="store_false",
                   help="skip the served part (dartree serve on a tiny model, 8 concurrent streams)")
    p.add_argument("--serve-timeout", type=float, default=None,
                   help="seconds for one served run, start to stop (default 150; smoke 300)")
    p.add_argument("--serve-tokens", type=int, default=None, help="tokens per served stream (default 64; smoke 16)")
    p.add_argument("--paper-tau", nargs="+", default=[], metavar="B=TAU",
                   help="the DARTree paper's tau per budget, for the predicted speedup (none in the repository)")
    a = p.parse_args(argv)
    a.budgets = a.budgets or ([4, 8] if a.smoke else [8, 16, 32, 64])
    a.rounds = a.rounds or (3 if a.smoke else 16)
    a.context = a.context or (24 if a.smoke else 256)
    a.probe_reps = a.probe_reps or (2 if a.smoke else 20)
    a.device = a.device or ("cpu" if a.smoke else "cuda")
    a.shapes = a.shapes or (list(shapes(True)) if a.smoke else ["qwen3-4b", "qwen3-8b"])
    a.serve_timeout = a.serve_timeout or (300.0 if a.smoke else 150.0)
    a.serve_tokens = a.serve_tokens or (16 if a.smoke else 64)
    return a


def check_args(a) -> None:
    """Raises ValueError (one line) for old torch / transformers, a device or bundle that is not
    there, unknown methods or shapes, out-of-range numbers, a malformed ``--paper-tau``."""
    from services.drafter.service import METHODS as KNOWN

    old = compat.version_too_old()
    if old:
        raise ValueError(old)
    if a.bundle and not Path(a.bundle).is_dir():
        raise ValueError(f"--bundle {a.bundle}: no such folder (make gpu-bundle writes it)")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("no CUDA device here (torch.cuda.is_available() is False): run with --smoke for the CPU check")
    bad = [m for m in a.methods if m not in KNOWN]
    if bad:
        raise ValueError(f"unknown method(s) {', '.join(bad)} (choose from {', '.join(KNOWN)})")
    unknown = [s for s in a.shapes if s not in shapes(a.smoke)]
    if unknown:
        raise ValueError(f"unknown shape(s) {', '.join(unknown)} (choose from {', '.join(shapes(a.smoke))})")
    if min(a.budgets) < 1 or a.rounds < 1 or a.context < 2 or a.time_limit <= 0 or a.serve_timeout <= 0 \
            or a.serve_tokens < 1:
        raise ValueError("--budgets, --rounds, --time-limit, --serve-timeout, --serve-tokens must be positive "
                         "and --context >= 2")
    a.paper_taus = predict.parse_paper_tau(a.paper_tau)


def apply_compat(a, features: list[dict]) -> None:
    """Leave out what the probed APIs cannot run: the CUDA-graph cells, the Qwen3 shapes."""
    missing = compat.missing_skips(features)
    if "graphs" in missing:
        a.graphs = False
    if "qwen3" in missing:
        a.shapes = [s for s in a.shapes if shapes(a.smoke)[s]["arch"] != "qwen3"]


def run_served(a, deadline: float) -> dict:
    """The served part within what is left of the time limit (half of it at most, for each run)."""
    if not a.serve:
        return {"status": "not run", "reason": "--no-serve"}
    left = deadline - time.perf_counter()
    return served_check(a.device, a.serve_tokens, max(30.0, min(a.serve_timeout, left / 2)))


def predicted(a, cells: list[dict], curves: list[dict]) -> dict:
    """The JSON's ``predicted`` section (:mod:`benchmarks.gpu_check.predict`) on the preferred verify
    path: CUDA graphs where they ran, else the eager tree attention."""
    sources = predict.tau_sources(a.paper_taus)
    graphs_ok = any(c.get("mode") == "graphs" and c.get("status") == "ok" for c in curves)
    mode = "graphs" if a.device.startswith("cuda") and graphs_ok else "tree-attention"
    measured = sorted({c["budget"] for c in cells if c.get("method") == "dartree-pruned" and c.get("status") == "ok"})
    with_tau = {b for s in sources.values() for t in s["taus"].values() for b in t}
    return {"formula": "speedup = tau(B) * t_step(1 row) / t_round(B); t_round = draft + tree_build + "
                       "verify(B + 1 rows) + commit; c = 1", "verify_mode": mode, "tau_sources": sources,
            "note": "the replayed tau are the SmolLM2-135M drafter's; the timed targets have random weights",
            "budgets_without_tau": [b for b in measured if b not in with_tau],
            "speedup": predict.predictions(cells, curves, sources, mode)}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        check_args(a)
        bundle = activate(a.bundle) if a.bundle else None
    except ValueError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    deadline = t_start + a.time_limit
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from services.hf_compat import quiet_progress_bars

    quiet_progress_bars()
    features = compat.probe()
    apply_compat(a, features)
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    tests = run_tests(gpu_test_files(), min(240.0, a.time_limit / 2)) if a.tests else {"status": "not run"}
    served = run_served(a, deadline)
    cells, probes, curves = breakdown(a, a.device, dtype, deadline - 5)
    res = {"schema": 2, "mode": "smoke" if a.smoke else "full",
           "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "env": env_info(a.device),
           "config": {"shapes": a.shapes, "methods": a.methods, "budgets": a.budgets, "rounds": a.rounds,
                      "context": a.context, "graphs": a.graphs, "dtype": str(dtype).removeprefix("torch."),
                      "time_limit_s": a.time_limit, "weights": "random (configs in code, no downloads)"},
           "bundle": bundle, "compat": features, "tests": tests, "served": served, "breakdown": cells,
           "graph_probe": probes, "verify_curve": curves, "predicted": predicted(a, cells, curves),
           "json": "gpu_check.json"}
    png_skip = plot(cells, res["predicted"]["speedup"], out / "gpu_check.png",
                    f"round time per phase and predicted speedup, {res['env'].get('gpu', a.device)}, "
                    f"{res['config']['dtype']}, random weights, context {a.context}")
    res["png"] = None if png_skip else "gpu_check.png"
    res["skipped"] = skipped_parts(res, png_skip)
    res["elapsed_s"] = time.perf_counter() - t_start
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1))
    print_table(res)
    return summary(res, a, out, bundle)


def summary(res: dict, a, out: Path, bundle: dict | None) -> int:
    """Print the last line (one JSON object); the exit code: 0 when every section ran as it should."""
    errors = [c for c in res["breakdown"] + res["verify_curve"] if c.get("status") != "ok"]
    served = res["served"]["status"]
    print(json.dumps({"out": str(out), "elapsed_s": round(res["elapsed_s"], 1), "tests": res["tests"]["status"],
                      "served": served, "bundle": bundle["status"] if bundle else None,
                      "cells_ok": len(res["breakdown"]) + len(res["verify_curve"]) - len(errors),
                      "cells_not_ok": len(errors)}))
    # smoke (CPU): the gpu tests skip by design; a full run on a GPU must have run them
    ok = not errors and res["tests"]["status"] in ("ok", "not run", *(("skipped",) if a.smoke else ()))
    ok = ok and served in ("ok", "not run")
    return 0 if ok and (bundle is None or bundle["status"] == "ok") else 1
