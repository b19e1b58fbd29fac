"""``make gpu-check``: on a CUDA machine, the gpu-marked tests and a round-time breakdown, in one go.

Question answered: on this GPU, where does a speculative round's time go (draft / tree build /
verify / commit) per method and tree budget B = 16 / 32 / 64, for a SmolLM2-135M-shaped and a
Qwen3-4B-shaped target; and how much would CUDA graphs save on a verify-sized forward? Needs
nothing beyond torch, transformers and this repository: both targets and their DFlash + Domino
drafters are **random weights** built from configs in code (no downloads), so acceptance is ~0 and
only the timings mean anything. Rounds run through the engine itself
(:class:`services.verifier.engine.SpecEngine`, one request, T = 0, ``ignore_eos``); the phase
times are its :class:`~services.verifier.engine.RoundOutput` ``timings``, with a device
synchronisation added around the target forward and the drafter block (instrumentation only) so
GPU time lands in the phase that queued it. The graph probe times one no-KV forward of B + 1 rows
eagerly and replayed from a :class:`services.cuda_graphs.GraphedStep`. With ``--graphs`` (the
default) ``ar`` and ``dartree-pruned`` also run on an engine whose runner captures its padded steps
in CUDA graphs (``EngineConfig(cuda_graphs=True)``; cells marked ``"graphs": true``, bars "+graphs";
on the CPU smoke run the same padded steps run eagerly).

The verify curve (:mod:`benchmarks.gpu_verify_curve`) times one verify step of 1 ... 129 rows per
attention path (tree attention, dense, CUDA graphs) at ``--context`` positions.

Writes ``<out>/gpu_check.json`` and ``<out>/gpu_check.png``; prints a table and, last, one JSON
line. Stays under ``--time-limit`` seconds (default 420: < 8 min with start-up); cells past it are
reported as skipped. ``--smoke`` runs tiny configs on the CPU in seconds (what CI checks).

On a bare machine without network (an image with torch and transformers but not the serving
stack), ``--bundle DIR`` first unpacks the wheels ``make gpu-bundle`` wrote into a scratch target
directory, puts it first on ``sys.path`` (and on the tests' ``PYTHONPATH``) and imports every module
the check needs; the JSON's ``bundle`` section lists each module's version and whether it came from
the bundle or the image (:mod:`benchmarks.gpu_bundle`). Needs torch >= 2.11 and transformers >=
5.17 (refused below, one line); what could not run is listed under ``skipped`` with its reason.

Usage: ``make gpu-check [OUT=dir]`` or ``python -m benchmarks.gpu_check --out DIR [--smoke] [--bundle DIR]``.
Exit code 0 when the tests passed (under --smoke: skipped, no GPU) and every cell ran, 1 otherwise, 2 on
bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from benchmarks.gpu_bundle import activate

PHASES = ("draft", "tree_build", "verify", "commit", "round")
METHODS = ("ar", "dflash", "domino", "ddtree", "dartree-pruned")
GRAPH_METHODS = ("ar", "dartree-pruned")  # also measured on the CUDA-graph runner (--graphs)
BUDGET_METHODS = ("ddtree", "dartree-pruned", "domino-ddtree", "seqheap", "dartree-fixed")
REPO = Path(__file__).resolve().parents[1]
MIN_VERSIONS = {"torch": "2.11", "transformers": "5.17"}  # what the lent GPU images bring


def shapes(smoke: bool) -> dict[str, dict]:
    """Target configs (HF kwargs + arch) and drafter overrides: real shapes, or tiny ones for ``--smoke``."""
    if smoke:
        tiny = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512)
        return {"tiny-llama": {"arch": "llama", "target": tiny, "drafter": dict(num_hidden_layers=1, block_size=8)},
                "tiny-qwen3": {"arch": "qwen3", "target": {**tiny, "head_dim": 8},
                               "drafter": dict(num_hidden_layers=1, block_size=8)}}
    smollm2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0,
                   rms_norm_eps=1e-5, tie_word_embeddings=True)
    qwen3_4b = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048,
                    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    return {"smollm2-135m": {"arch": "llama", "target": smollm2, "drafter": dict(num_hidden_layers=2, block_size=16)},
            "qwen3-4b": {"arch": "qwen3", "target": qwen3_4b, "drafter": dict(num_hidden_layers=5, block_size=16)}}


def build_target(spec: dict, device: str, dtype: torch.dtype):
    """A :class:`~services.verifier.target.TargetModel` of ``spec``'s shape with random weights, and
    its tapped layers."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from services.models.layers import default_target_layer_ids
    from services.verifier.target import TargetModel

    t = spec["target"]
    cfg_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if spec["arch"] == "llama" else (Qwen3Config,
                                                                                           Qwen3ForCausalLM)
    cfg = cfg_cls(**t, bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(cfg).to(dtype).eval()
    n = t["num_hidden_layers"]
    layers = default_target_layer_ids(n) if n >= 6 else sorted({0, n - 1})  # tiny smoke targets: first + last
    return TargetModel(model, layers), layers


def build_engine(spec: dict, device: str, dtype: torch.dtype, max_context: int, graphs: bool = False):
    """A :class:`SpecEngine` over a random target and a random DFlash + Domino drafter of ``spec``'s
    shape; ``graphs``: its runner pads every step to a bucket and replays CUDA graphs."""
    from services.drafter.model import DFlashDrafter, DrafterConfig
    from services.drafter.build import build_drafter
    from services.spec import default_tree_knobs
    from services.verifier.drafter_client import InprocDrafterClient
    from services.verifier.build import build_engine
    from services.verifier.engine import EngineConfig

    t = spec["target"]
    target, layers = build_target(spec, device, dtype)
    heads, kv = t["num_attention_heads"], t["num_key_value_heads"]
    head_dim = t.get("head_dim", t["hidden_size"] // heads)
    dcfg = DrafterConfig(hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                         vocab_size=t["vocab_size"], rms_norm_eps=t.get("rms_norm_eps", 1e-6),
                         max_position_embeddings=t["max_position_embeddings"],
                         num_target_layers=t["num_hidden_layers"], target_hidden_size=t["hidden_size"],
                         mask_token_id=t["vocab_size"] - 1, target_layer_ids=layers, projector_type="domino",
                         **spec["drafter"])
    with torch.device(device):
        drafter = DFlashDrafter(dcfg).to(dtype).eval()
    service = build_drafter(drafter, target.embed_tokens(), target.lm_head(),
                            description="random weights (gpu_check)", packed_gemm=False)
    engine = build_engine(target, InprocDrafterClient(service), EngineConfig(max_running=1, max_context=max_context,
                                                                         cuda_graphs=graphs),
                          max_draft_depth=dcfg.num_draft_slots, defaults=default_tree_knobs(device), packed_gemm=False)
    if device.startswith("cuda"):
        synchronize_phases(engine, service)
    return engine


def synchronize_phases(engine, service) -> None:
    """Instrument (instance attributes only) the target forward and the drafter block so each ends
    with a device synchronisation: the GPU time of a phase is then counted in that phase."""
    execute = engine.runner.execute

    def synced_execute(*args, **kwargs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = execute(*args, **kwargs)
        torch.cuda.synchronize()
        return dataclasses.replace(out, seconds=time.perf_counter() - t0)

    def synced(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            return out
        return wrapped

    engine.runner.execute = synced_execute
    service.block_logits_batch = synced(service.block_logits_batch)


def measure(engine, method: str, budget: int | None, prompt: list[int], rounds: int, rid: str) -> dict:
    """Mean ms per phase over ``rounds`` rounds of one request: the engine's ``timings`` (draft,
    tree_build, verify, commit) and ``round``, the wall time of the whole engine step that ran the
    round (what a user waits; "other" = round - the four phases: bookkeeping, tree derive, policy)."""
    from services.params import SamplingParams, SpecParams

    sampling = SamplingParams(max_tokens=rounds + 1, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    nodes = []
    gen = engine.generate(rid, prompt, sampling, SpecParams(method, budget=budget))
    while True:
        t0 = time.perf_counter()
        out = next(gen, None)
        wall = time.perf_counter() - t0
        if out is None:
            break
        if out.is_prefill:
            continue
        for p in PHASES[:4]:
            times[p].append(out.timings.get(p, 0.0))
        times["round"].append(wall)
        nodes.append(out.num_draft_tokens)
    n = len(nodes)
    return {"rounds": n, "mean_nodes": sum(nodes) / n if n else None,
            "phase_ms": {p: 1000 * sum(v) / n for p, v in times.items()} if n else {},
            "round_median_ms": 1000 * statistics.median(times["round"]) if n else None}


def graph_probe(model, rows: int, device: str, reps: int) -> dict:
    """Median ms of a no-KV forward of ``rows`` rows: eager, and replayed from a CUDA graph (None off CUDA)."""
    from services.cuda_graphs import GraphedStep

    def fwd(ids, pos):
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits

    ids = torch.randint(100, 400, (1, rows), device=device)
    pos = torch.arange(rows, device=device)[None]

    def timed(fn) -> float:
        fn(ids, pos)
        xs = []
        for _ in range(reps):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(ids, pos)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            xs.append(time.perf_counter() - t0)
        return 1000 * statistics.median(xs)

    with torch.inference_mode():
        eager = timed(fwd)
        step = GraphedStep(fwd, [ids, pos])
        graphed = timed(step) if step.captured else None
        # nothing to compare when nothing was captured (off CUDA the "graph" is the eager call itself)
        equal = (bool(torch.allclose(step(ids, pos).float(), fwd(ids, pos).float(), rtol=1e-2, atol=1e-2))
                 if step.captured else None)
    return {"rows": rows, "eager_ms": eager, "graph_ms": graphed, "captured": step.captured,
            "graph_equals_eager": equal}


def gpu_test_files() -> list[str]:
    """Test files that use the ``gpu`` marker (collecting only these keeps the run short)."""
    return sorted(str(f.relative_to(REPO)) for f in (REPO / "tests").rglob("test_*.py")
                  if "pytest.mark.gpu" in f.read_text(encoding="utf-8", errors="replace"))


def run_tests(files: list[str], timeout: float) -> dict:
    """``pytest -m gpu`` over ``files`` in a subprocess: counts parsed from its summary line."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(10.0, timeout))
    except subprocess.TimeoutExpired:
        return {"command": " ".join(cmd[2:]), "status": "timeout", "elapsed_s": time.perf_counter() - t0}
    tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail[0])}
    ok = r.returncode in (0, 5) and not counts.get("failed") and not counts.get("error") and not counts.get("errors")
    status = ("ok" if counts.get("passed") else "skipped") if ok else "failed"  # skipped: no test ran (no GPU)
    return {"command": "python " + " ".join(cmd[1:]), "files": files, "status": status,
            "returncode": r.returncode, "counts": counts, "summary": tail[0], "elapsed_s": time.perf_counter() - t0,
            "output_tail": (r.stdout + r.stderr)[-3000:] if not ok else ""}


def breakdown(a, device: str, dtype: torch.dtype, deadline: float) -> tuple[list[dict], list[dict], list[dict]]:
    """Every (shape, method, B) cell, the graph probe and the verify curve
    (:func:`benchmarks.gpu_verify_curve.verify_curve`); cells past ``deadline`` are skipped."""
    from benchmarks.gpu_verify_curve import ROWS, SMOKE_ROWS, verify_curve

    cells, probes, curves = [], [], []
    gen = torch.Generator().manual_seed(0)
    runs = [(name, spec, graphs) for name, spec in shapes(a.smoke).items()
            for graphs in ((False, True) if a.graphs else (False,))]
    for name, spec, graphs in runs:
        if time.perf_counter() > deadline:
            cells.append({"shape": name, "graphs": graphs, "status": "skipped", "error": "time limit"})
            continue
        t0 = time.perf_counter()
        try:
            engine = build_engine(spec, device, dtype, a.context + a.rounds + 64, graphs=graphs)
        except Exception as e:  # noqa: BLE001 (reported per shape; the check goes on)
            cells.append({"shape": name, "graphs": graphs, "status": "error",
                          "error": f"build: {type(e).__name__}: {e}"[:500]})
            continue
        build_s = time.perf_counter() - t0
        vocab = spec["target"]["vocab_size"]
        prompt = torch.randint(100, vocab - 100, (a.context,), generator=gen).tolist()
        for m in (a.methods if not graphs else [m for m in a.methods if m in GRAPH_METHODS]):
            for b in (a.budgets if m in BUDGET_METHODS else [None]):
                cell = {"shape": name, "method": m, "budget": b, "build_s": build_s, "graphs": graphs}
                if time.perf_counter() > deadline:
                    cells.append({**cell, "status": "skipped", "error": "time limit"})
                    continue
                try:
                    measure(engine, m, b, prompt, 2, f"warm-{name}-{m}-{b}")  # untimed warm-up
                    cell.update(measure(engine, m, b, prompt, a.rounds, f"{name}-{m}-{b}"), status="ok")
                    if graphs:
                        cell["graphs_captured"] = engine.runner.graphs.num_captured()
                except Exception as e:  # noqa: BLE001
                    cell.update(status="error", error=f"{type(e).__name__}: {e}"[:500])
                cells.append(cell)
        if not graphs:
            probes += _graph_probes(engine, name, a, device, deadline)
            curves += verify_curve(engine.target, name, a.context, SMOKE_ROWS if a.smoke else ROWS, a.probe_reps,
                                   deadline)
        del engine
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return cells, probes, curves


def _graph_probes(engine, name: str, a, device: str, deadline: float) -> list[dict]:
    """:func:`graph_probe` of ``B + 1`` rows for every budget ``B`` until ``deadline``."""
    probes = []
    for b in a.budgets:
        if time.perf_counter() > deadline:
            break
        try:
            probes.append({"shape": name, **graph_probe(engine.target.model, b + 1, device, a.probe_reps)})
        except Exception as e:  # noqa: BLE001 (reported per probe; the check goes on)
            probes.append({"shape": name, "rows": b + 1, "error": f"{type(e).__name__}: {e}"[:500]})
    return probes


def plot(cells: list[dict], path: Path, title: str) -> str | None:
    """Stacked bars of the phases per (method, B), one panel per shape; returns why no PNG was
    written (matplotlib missing), else None."""
    try:
        import matplotlib
    except ImportError as e:
        return f"png: matplotlib cannot be imported ({e})"

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(c["shape"] for c in cells))
    fig, axes = plt.subplots(1, max(1, len(names)), figsize=(6 * max(1, len(names)), 4.5), squeeze=False)
    colors = {"draft": "tab:blue", "tree_build": "tab:orange", "verify": "tab:green", "commit": "tab:red",
              "other": "tab:gray"}
    for ax, name in zip(axes[0], names):
        ok = [c for c in cells if c["shape"] == name and c.get("status") == "ok"]
        labels = [_label(c) + (f"\nB={c['budget']}" if c["budget"] else "") for c in ok]
        bottom = [0.0] * len(ok)
        for p in ("draft", "tree_build", "verify", "commit", "other"):
            vals = [c["phase_ms"]["round"] - sum(c["phase_ms"][q] for q in PHASES[:4]) if p == "other"
                    else c["phase_ms"][p] for c in ok]
            vals = [max(0.0, v) for v in vals]
            ax.bar(range(len(ok)), vals, bottom=bottom, color=colors[p], label=p)
            bottom = [x + v for x, v in zip(bottom, vals)]
        ax.set_xticks(range(len(ok)), labels, fontsize=7, rotation=45, ha="right")
        ax.set_ylabel("ms per round")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _label(cell: dict) -> str:
    return cell.get("method", "-") + ("+graphs" if cell.get("graphs") else "")


def env_info(device: str) -> dict:
    from importlib import metadata

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": metadata.version("transformers"), "cuda": torch.version.cuda, "device": device,
            "torch_threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                     text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["git"] = None
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.png")
    p.add_argument("--smoke", action="store_true", help="tiny configs on the CPU (seconds; what CI runs)")
    p.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--budgets", nargs="+", type=int, default=None, help="default 16 32 64 (smoke: 4 8)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per cell (default 16; smoke 3)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens (default 256; smoke 24)")
    p.add_argument("--probe-reps", type=int, default=None, help="graph-probe repetitions (default 20; smoke 2)")
    p.add_argument("--time-limit", type=float, default=420.0, help="seconds for the whole check")
    p.add_argument("--bundle", default=None,
                   help="folder of wheels (make gpu-bundle) to unpack into a scratch target and import first")
    p.add_argument("--no-tests", dest="tests", action="store_false", help="skip the gpu-marked tests")
    p.add_argument("--no-graphs", dest="graphs", action="store_false",
                   help="skip the CUDA-graph runner cells (ar and dartree-pruned on padded, captured steps)")
    a = p.parse_args(argv)
    a.budgets = a.budgets or ([4, 8] if a.smoke else [16, 32, 64])
    a.rounds = a.rounds or (3 if a.smoke else 16)
    a.context = a.context or (24 if a.smoke else 256)
    a.probe_reps = a.probe_reps or (2 if a.smoke else 20)
    a.device = a.device or ("cpu" if a.smoke else "cuda")
    return a


def check_args(a) -> None:
    """Raises ValueError (one line) for a device that is not there or out-of-range numbers."""
    from services.drafter.service import METHODS as KNOWN

    from importlib import metadata

    from packaging.version import Version

    for name, least in MIN_VERSIONS.items():
        have = metadata.version(name)
        if Version(have).release < Version(least).release:
            raise ValueError(f"{name} {have} is older than the {least} this check supports")
    if a.bundle and not Path(a.bundle).is_dir():
        raise ValueError(f"--bundle {a.bundle}: no such folder (make gpu-bundle writes it)")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("no CUDA device here (torch.cuda.is_available() is False): run with --smoke for the CPU check")
    bad = [m for m in a.methods if m not in KNOWN]
    if bad:
        raise ValueError(f"unknown method(s) {', '.join(bad)} (choose from {', '.join(KNOWN)})")
    if min(a.budgets) < 1 or a.rounds < 1 or a.context < 2 or a.time_limit <= 0:
        raise ValueError("--budgets, --rounds, --time-limit must be positive and --context >= 2")


def print_table(cells: list[dict], probes: list[dict], curves: list[dict], tests: dict) -> None:
    """The human table: one line per cell, per graph probe, per verify-curve point, and the tests' summary."""
    print(f"{'shape':<14}{'method':<23}{'B':>4}{'draft':>8}{'build':>8}{'verify':>8}{'commit':>8}{'round':>8}")
    for c in cells:
        if c.get("status") != "ok":
            print(f"{c['shape']:<14}{_label(c):<23}{c.get('budget') or '-':>4}  {c['status']}: "
                  f"{c.get('error', '')}")
            continue
        ph = c["phase_ms"]
        print(f"{c['shape']:<14}{_label(c):<23}{c['budget'] or '-':>4}"
              + "".join(f"{ph[p]:8.2f}" for p in PHASES))
    for p in probes:
        print(f"graph probe {p['shape']} rows={p['rows']}: eager {p.get('eager_ms', float('nan')):.2f} ms, "
              f"graph {p.get('graph_ms') if p.get('graph_ms') is None else round(p['graph_ms'], 2)} ms "
              f"{p.get('error', '')}")
    for c in curves:
        print(f"verify {c['shape']} {c['mode']:<15} rows={c.get('rows', '-')}: " + (
            f"{c['ms']:.2f} ms ({c['ratio_to_one_row']:.2f}x one row), vs dense {c['max_abs_diff_vs_dense']}"
            if c.get("status") == "ok" else f"{c.get('status', 'error')}: {c.get('error', '')}"))
    print(f"tests: {tests.get('summary', tests['status'])}")


def skipped_parts(tests: dict, cells: list[dict], curves: list[dict], png_skip: str | None) -> list[str]:
    """What did not run, one line each with its reason (the JSON's ``skipped``)."""
    out = [] if tests["status"] != "not run" else ["tests: --no-tests"]
    if tests["status"] == "skipped":
        out.append(f"tests: {tests.get('summary', 'no test ran')} (no CUDA device)")
    out += [f"cell {c['shape']} {_label(c)} B={c.get('budget')}: {c.get('error')}" for c in cells
            if c.get("status") == "skipped"]
    out += [f"verify curve {c['shape']} {c['mode']} rows={c.get('rows')}: {c.get('error')}" for c in curves
            if c.get("status") == "skipped"]
    return out + ([png_skip] if png_skip else [])


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
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    tests = run_tests(gpu_test_files(), min(240.0, a.time_limit / 2)) if a.tests else {"status": "not run"}
    cells, probes, curves = breakdown(a, a.device, dtype, deadline - 5)
    res = {"schema": 1, "mode": "smoke" if a.smoke else "full",
           "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "env": env_info(a.device),
           "config": {"methods": a.methods, "budgets": a.budgets, "rounds": a.rounds, "context": a.context,
                      "graphs": a.graphs,
                      "dtype": str(dtype).removeprefix("torch."), "time_limit_s": a.time_limit,
                      "weights": "random (configs in code, no downloads)"},
           "bundle": bundle, "tests": tests, "breakdown": cells, "graph_probe": probes,
           "verify_curve": curves, "json": "gpu_check.json",
           "png": "gpu_check.png"}
    png_skip = plot(cells, out / "gpu_check.png", f"round time per phase, {res['env'].get('gpu', a.device)}, "
                                                  f"{res['config']['dtype']}, random weights, context {a.context}")
    res["png"] = None if png_skip else "gpu_check.png"
    res["skipped"] = skipped_parts(tests, cells, curves, png_skip)
    res["elapsed_s"] = time.perf_counter() - t_start
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1))
    print_table(cells, probes, curves, tests)
    errors = [c for c in cells if c.get("status") != "ok"] + [c for c in curves if c.get("status") != "ok"]
    print(json.dumps({"out": str(out), "elapsed_s": round(res["elapsed_s"], 1), "tests": tests["status"],
                      "bundle": bundle["status"] if bundle else None,
                      "cells_ok": len(cells) + len(curves) - len(errors), "cells_not_ok": len(errors)}))
    # smoke (CPU): the gpu tests skip by design; a full run on a GPU must have run them
    ok = not errors and tests["status"] in ("ok", "not run", *(("skipped",) if a.smoke else ()))
    return 0 if ok and (bundle is None or bundle["status"] == "ok") else 1


if __name__ == "__main__":
    sys.exit(main())
