"""Small trees on a CPU: replayed τ(B), the verify cost curve c(M) and the draft cost d(B).

Two measurements, each printing one JSON object (last stdout line, also ``--out``):

``tau``: replayed τ (T = 0, :mod:`services.replay`: no timing, load does not enter) of
``dartree-pruned`` at budgets B (the builder's top-B by ``path + beta * depth``, Lemma 1: a valid
prefix-closed tree for every B) and inference block lengths L (``DrafterService(block_rows=L)``; 16
= the trained block), on ``load_eval`` prompts (first turns, chat template) against the target's
greedy output. Per dataset: τ as the τ protocol reports it (mean over samples of emitted / rounds)
and pooled (all emitted / all rounds).

    python -m benchmarks.bench_small_trees tau --datasets gsm8k mt-bench sharegpt --prompts 10 \\
        --max-tokens 96 --budgets 1 2 3 4 8 --blocks 16 8 4 --threads 1 --out tau.json

``cost``: per weight format, the target forward of M rows (``services.verifier.build.time_forward``,
the goodput policy's start-up sweep: an empty KV slot; float32 pre-packed for every M as a server
packs its verify rows) and the drafter's wall time per round (context append + block forward +
output projection + tree build, through the in-process client) for each (B, L), replayed on a few
prompts, each draft timed after a (B + 1)-row target forward as the engine runs it (``--warm-drafts``:
back to back, the drafter's weights left in the caches); formats, row counts and configurations
interleaved, medians. With ``--verify-context N``
each M-row forward is timed as a verify is run: after N committed positions, with logits for every
row (the sweep's forward computes the last row's only). ``c(M)`` and ``d(B)`` are
also given in units of the q4 one-row forward (``--unit q4``, the default format's plain step) and
of each format's own one-row forward.

    python -m benchmarks.bench_small_trees cost --weights q4 bfloat16 float32 --rows 1 2 3 4 5 6 7 8 9 \\
        --budgets 1 2 3 4 8 --blocks 16 4 --prompts 3 --repeats 7 --threads 1 --out cost.json

``e2e``: tokens/s at c = 1 through the in-process engine (``ar``, the default goodput policy, fixed
``B/L`` settings), interleaved repeats, T = 0 output checked against ``ar``:

    python -m benchmarks.bench_small_trees e2e --weights q4 --datasets gsm8k --prompts 6 --max-tokens 64 \\
        --settings 3/16 3/4 2/4 --repeats 3 --threads 1 --out e2e.json

``http``: the same question through HTTP: one default ``dartree serve`` (goodput policy; ``--weights``
q4 by default), each prompt sent twice at c = 1 as a streaming ``/v1/completions`` request, once
with the server's default method and once with ``"speculative": {"method": "ar"}`` (plain decoding,
same server), in alternating order, T = 0, ``ignore_eos``; ``--passes`` times over the prompt set
(the first pass shows what a cold calibration costs). Per dataset and pass: tokens/s (completion
tokens / request wall time at the client, TTFT included) of both, their ratio, τ and the histogram of
the policy's verified budgets per round from the verifier's /metrics.

    python -m benchmarks.bench_small_trees http --datasets gsm8k mt-bench sharegpt --prompts 4 \
        --max-tokens 96 --passes 2 --out http.json

Run ``cost``, ``e2e`` and ``http`` on an idle machine. :mod:`benchmarks.roofline` turns the two files into the
predicted speedup table of docs/roofline.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_served import metric_sum
from benchmarks.bench_stats import write_result


def _prompts(target_dir, datasets: list[str], n: int, max_prompt_tokens: int = 384) -> list[tuple[str, list[int]]]:
    """``(uid, chat-templated prompt ids)`` of the first ``n`` prompts of each dataset (first turns)."""
    from transformers import AutoTokenizer

    from services.datasets import load_eval
    from services.training.datagen import encode_prompt

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    return [(p.uid, encode_prompt(tok, p, max_prompt_tokens)) for ds in datasets for p in load_eval(ds, n)]


def _configs(budgets: list[int], blocks: list[int]) -> list[tuple[int, int]]:
    """``(B, L)`` pairs with ``L >= B``, ``L`` the full block (a B-node tree can be B deep) or ``L = 0``
    (rows follow the budget)."""
    full = max(blocks)
    return [(b, block) for block in blocks for b in budgets if block in (0, full) or block >= b]


def _engine(target, drafter, dtype, block: int, packed: bool, q4_linears: bool | None = None,
            compile: bool = False):
    """An engine whose drafter runs ``block`` rows per call (0 = the trained block's rows cut to the
    call's budget plus one, ``DrafterService(spare_rows=1)``, the default); ``q4_linears`` and
    ``compile`` (its block forward through ``torch.compile``, warmed up here) as
    :class:`DrafterService` (None = its default)."""
    from services.drafter.build import build_drafter
    from services.verifier.build import build_engine
    from services.verifier.drafter_client import InprocDrafterClient

    svc = build_drafter(drafter, target.embed_tokens(), target.lm_head(), dtype, packed_gemm=packed,
                        block_rows=block or None, spare_rows=1 if block == 0 else None, q4_linears=q4_linears,
                        compile=compile)
    return build_engine(target, InprocDrafterClient(svc), max_draft_depth=svc.block_rows, packed_gemm=False)


class _TimedClient:
    """A drafter client that records the wall seconds of each ``submit`` + ``collect``; ``before``
    (untimed, None = nothing) runs before each submit: a target forward, as the engine runs one
    between two drafts (the drafter then finds its weights out of the caches)."""

    def __init__(self, inner, before=None):
        self.inner, self.seconds, self._t0, self.before = inner, [], 0.0, before

    def submit(self, jobs):
        if self.before is not None:
            self.before()
        self._t0 = time.perf_counter()
        return self.inner.submit(jobs)

    def collect(self, handle):
        out = self.inner.collect(handle)
        self.seconds.append(time.perf_counter() - self._t0)
        return out

    def release(self, rid):
        self.inner.release(rid)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def run_tau(a) -> dict:
    from services.drafter.model import load_drafter
    from services.models.registry import DEFAULT_DRAFTER_DIR, resolve_target
    from services.replay import replay_rounds
    from services.training.heldout import greedy_turns
    from services.params import SpecParams
    from services.verifier.target import TargetModel

    tdir = resolve_target(a.target)
    ddir = Path(a.drafter) if a.drafter else DEFAULT_DRAFTER_DIR
    ddt = getattr(torch, a.drafter_dtype)
    drafter = load_drafter(ddir, dtype=ddt)
    target = TargetModel.from_pretrained(tdir, drafter.config.target_layer_ids, weights="float32")
    turns = greedy_turns(target, _prompts(tdir, a.datasets, a.prompts), a.max_tokens,
                         Path(a.refs_cache) if a.refs_cache else None)
    res = {"bench": "small-trees-tau", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "drafter": str(ddir), "datasets": a.datasets, "prompts_per_dataset": a.prompts, "max_tokens": a.max_tokens,
           "width": a.width, "depth_bonus": a.depth_bonus, "candidates": 64, "weights": "float32",
           "drafter_dtype": a.drafter_dtype, "drafter_linears": a.drafter_linears, "machine": _machine(),
           "cells": []}
    q4 = a.drafter_linears == "q4"
    for (b, block), beta in itertools.product(_configs(a.budgets, a.blocks), a.depth_bonus):
        engine = _engine(target, drafter, ddt, block, packed=q4, q4_linears=q4)
        spec = SpecParams("dartree-pruned", budget=b, width=a.width, depth_bonus=beta)
        per: dict[str, list[tuple[int, int]]] = {}
        t0 = time.perf_counter()
        for k, t in enumerate(turns):
            rounds = emitted = 0
            for r in replay_rounds(engine, t.prompt_ids, t.ref, t.finish, spec, f"tau-{b}-{block}-{k}"):
                rounds, emitted = rounds + 1, emitted + r.emitted
            per.setdefault(t.uid.split("/")[0], []).append((rounds, emitted))
        cell = {"budget": b, "block": block, "depth_bonus": beta, "seconds": round(time.perf_counter() - t0, 1), "datasets": {}}
        for ds, rs in per.items():
            cell["datasets"][ds] = {"tau": round(statistics.mean(e / r for r, e in rs if r), 3),
                                    "tau_pooled": round(sum(e for _, e in rs) / sum(r for r, _ in rs), 3),
                                    "samples": len(rs), "rounds": sum(r for r, _ in rs)}
        cell["tau_mean"] = round(statistics.mean(d["tau"] for d in cell["datasets"].values()), 3)
        res["cells"].append(cell)
        print(f"B={b} L={block} beta={beta}: " + " ".join(f"{ds} {d['tau']:.3f}" for ds, d in cell["datasets"].items())
              + f" mean {cell['tau_mean']:.3f} ({cell['seconds']} s)", flush=True)
    return res


def run_cost(a) -> dict:
    from services.cpu_gemm import lazy_packing_paused  # noqa: F401 (the sweep's packs are explicit here)
    from services.drafter.model import load_drafter
    from services.models.registry import DEFAULT_DRAFTER_DIR, resolve_target
    from services.replay import replay_rounds
    from services.training.heldout import greedy_turns
    from services.tree.batch import causal_segment
    from services.verifier.build import make_runner, time_forward
    from services.params import SpecParams
    from services.verifier.engine import EngineConfig
    from services.verifier.target import TargetModel
    from services.weights import compute_dtype, drafter_dtype

    tdir = resolve_target(a.target)
    ddir = Path(a.drafter) if a.drafter else DEFAULT_DRAFTER_DIR
    prompts = _prompts(tdir, a.datasets, a.prompts)
    fmts: dict[str, dict] = {}
    for w in a.weights:
        ddt = drafter_dtype(compute_dtype(w))
        drafter = load_drafter(ddir, dtype=ddt)
        target = TargetModel.from_pretrained(tdir, drafter.config.target_layer_ids, weights=w)
        target.pack_gemm([r for r in a.rows if r >= 2])  # float32: every verify row count packed, as served
        runner = make_runner(target, EngineConfig(compile=a.compile))
        if a.compile:
            runner.warm_up(tuple(a.rows))
        turns = greedy_turns(target, prompts, a.max_tokens)
        engines = {}
        for b, block in _configs(a.budgets, a.blocks):
            if block not in engines:
                engines[block] = _engine(target, drafter, ddt, block, packed=True,
                                         q4_linears={"auto": None, "dense": False, "q4": True}[a.drafter_linears],
                                         compile=a.drafter_compile)
                engines[block].drafter = _TimedClient(engines[block].drafter)
        fmts[w] = {"drafter_dtype": str(ddt).removeprefix("torch."), "runner": runner, "turns": turns,
                   "engines": engines, "fwd": {r: [] for r in a.rows}, "draft": {}, "nodes": {}}
    for f in fmts.values():  # --verify-context: one slot holding that many committed positions
        f["slot"] = None
        if a.verify_context:
            f["slot"] = f["runner"].cache.alloc()
            for c in range(0, a.verify_context, 256):
                n = min(256, a.verify_context - c)
                f["runner"].execute([causal_segment([3] * n, c, f["slot"])], torch.tensor([n - 1]))
                f["runner"].cache.extend(f["slot"], n)
    for i in range(a.repeats + 1):  # round 0 warms up (first calls, lazy packs); formats / rows interleaved
        for w, f in fmts.items():
            for r in a.rows:
                if f["slot"] is None:
                    s = time_forward(f["runner"], r)
                else:  # a verify's forward: M rows after the context, logits for every row (slot unchanged)
                    s = f["runner"].execute([causal_segment([3] * r, a.verify_context, f["slot"])]).seconds
                if i:
                    f["fwd"][r].append(s)
        if i >= a.draft_repeats:
            continue
        for w, f in fmts.items():
            for b, block in _configs(a.budgets, a.blocks):
                eng = f["engines"][block]
                spec = SpecParams("dartree-pruned", budget=b, width=a.width)
                eng.drafter.seconds = []
                # each draft after a (B + 1)-row target forward, as in the engine (--warm-drafts: back to back)
                eng.drafter.before = None if a.warm_drafts else \
                    (lambda runner=f["runner"], rows=b + 1: time_forward(runner, rows))
                nodes = []
                for k, t in enumerate(f["turns"]):
                    for rr in replay_rounds(eng, t.prompt_ids, t.ref, t.finish, spec, f"cost-{b}-{block}-{k}"):
                        nodes.append(rr.tree.num_nodes)
                if i:
                    f["draft"].setdefault(f"{b}/{block}", []).extend(eng.drafter.seconds)
                    f["nodes"][f"{b}/{block}"] = statistics.mean(nodes) if nodes else 0.0
    unit = statistics.median(fmts[a.unit]["fwd"][1]) if a.unit in fmts else None
    res = {"bench": "small-trees-cost", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "drafter": str(ddir), "rows": a.rows, "warm_drafts": a.warm_drafts, "repeats": a.repeats, "draft_repeats": a.draft_repeats,
           "prompts": len(prompts), "max_tokens": a.max_tokens, "width": a.width, "unit": a.unit,
           "drafter_linears": a.drafter_linears, "verify_context": a.verify_context,
           "compile": a.compile, "drafter_compile": a.drafter_compile,
           "unit_ms": round(1e3 * unit, 3) if unit else None, "machine": _machine(), "formats": {}}
    for w, f in fmts.items():
        one = statistics.median(f["fwd"][1])
        out = {"drafter_dtype": f["drafter_dtype"], "forward_ms": {}, "c": {}, "c_unit": {}, "draft": {}}
        for r in a.rows:
            m = statistics.median(f["fwd"][r])
            out["forward_ms"][str(r)] = round(1e3 * m, 3)
            out["c"][str(r)] = round(m / one, 3)
            if unit:
                out["c_unit"][str(r)] = round(m / unit, 3)
        for key, secs in f["draft"].items():
            m = statistics.median(secs)
            out["draft"][key] = {"ms": round(1e3 * m, 3), "d": round(m / one, 3),
                                 "d_unit": round(m / unit, 3) if unit else None, "rounds": len(secs),
                                 "mean_nodes": round(f["nodes"][key], 2)}
        res["formats"][w] = out
        print(f"{w}: c(M) " + " ".join(f"{r}:{out['c'][str(r)]:.2f}" for r in a.rows)
              + f" (1 row {out['forward_ms']['1']:.1f} ms); d(B/L) "
              + " ".join(f"{k}:{v['d']:.2f}" for k, v in out["draft"].items()), flush=True)
    return res


def run_e2e(a) -> dict:
    """Served-path check at c = 1 through the in-process engine (``bench_goodput.run_level``): ``ar``,
    the default goodput policy (its drafter call at the default budget, full block), and fixed
    ``(B, L)`` settings, interleaved ``--repeats`` times; tokens/s per run, medians, T = 0 output
    checked against ``ar``."""
    from transformers import AutoTokenizer  # noqa: F401 (the tokenizer comes with the engine)

    from benchmarks.bench_goodput import _prompts as goodput_prompts
    from benchmarks.bench_goodput import run_level
    from services.generate import build_inprocess
    from services.verifier.build import build_engine
    from services.verifier.engine import EngineConfig
    from services.verifier.policy import FixedPolicy
    from services.weights import compute_dtype

    engine0, tok, note = build_inprocess(None, None, compute_dtype(a.weights), weights=a.weights)
    svc = engine0.drafter.service
    defaults = engine0.policy.defaults
    engine = build_engine(engine0.target, engine0.drafter, EngineConfig(max_running=1, compile=a.compile),
                          max_draft_depth=engine0.max_draft_depth, policy="goodput", defaults=defaults,
                          cost_key=("smollm2-135m-instruct", a.weights, "cpu"))
    goodput, fixed = engine.policy, FixedPolicy(defaults=defaults)
    full = svc.block_rows
    settings = [("ar", "ar", None, fixed, full), ("goodput", "dartree-pruned", None, goodput, full)]
    settings += [(f"fixed B={b} L={block}", "dartree-pruned", b, fixed, block) for b, block in a.settings_parsed]
    for m in a.goodput_max_budgets:  # the goodput policy with a smaller B_max (the drafter called at B_max)
        import copy

        from services.verifier.policy import GoodputPolicy
        settings.append((f"goodput Bmax={m}", "dartree-pruned",
                         None, GoodputPolicy(cost=copy.deepcopy(goodput.cost), max_budget=m, defaults=defaults), full))
    prompts = [ids for ds in a.datasets for ids in goodput_prompts(tok, ds, a.prompts)]
    run_level(engine, prompts[:1], 1, "ar", None, 8)  # warm-up
    runs: dict[str, list[dict]] = {}
    ref = None
    for rep in range(a.repeats):
        for label, method, budget, pol, block in settings:
            engine.policy, svc.block_rows = pol, block
            r = run_level(engine, prompts, 1, method, budget, a.max_tokens)
            outs = r.pop("outputs")
            ref = outs if ref is None else ref
            r["equals_ar"] = outs == ref
            r["mismatches"] = _mismatches(ref, outs)  # per prompt: where the output left ar's
            runs.setdefault(label, []).append(r)
            print(f"rep {rep} {label:18s} {r['tokens_per_s']:6.2f} tok/s tau {r['tau']:.2f} "
                  f"plain {r['plain_round_fraction']:.2f} equals_ar {r['equals_ar']}", flush=True)
    svc.block_rows = full
    ar_med = statistics.median(x["tokens_per_s"] for x in runs["ar"])
    res = {"bench": "small-trees-e2e", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "note": note,
           "weights": a.weights, "datasets": a.datasets, "prompts_per_dataset": a.prompts, "max_tokens": a.max_tokens,
           "repeats": a.repeats, "compile": a.compile, "machine": _machine(), "settings": {}}
    for label, rs in runs.items():
        tps = [x["tokens_per_s"] for x in rs]
        res["settings"][label] = {"tokens_per_s_runs": [round(x, 3) for x in tps],
                                  "tokens_per_s": round(statistics.median(tps), 3),
                                  "vs_ar": round(statistics.median(tps) / ar_med, 3),
                                  "vs_ar_paired": round(statistics.median(
                                      x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(rs, runs["ar"])), 3),
                                  "tau": round(statistics.median(x["tau"] for x in rs), 3),
                                  "plain_round_fraction": round(statistics.median(x["plain_round_fraction"] for x in rs), 3),
                                  "equals_ar": all(x["equals_ar"] for x in rs),
                                  # ms per decode step (median over repeats): forward, draft wait, the rest
                                  "step_ms": {k: round(statistics.median(x["step_ms"][k] for x in rs), 3)
                                              for k in ("wall", "forward", "draft_wait", "other")}
                                  if all(x.get("step_ms") for x in rs) else {},
                                  "mismatches": [m | {"repeat": i} for i, x in enumerate(rs) for m in x["mismatches"]]}
        print(f"{label:18s} median {res['settings'][label]['tokens_per_s']:.2f} tok/s = "
              f"{res['settings'][label]['vs_ar']:.3f}x ar (paired {res['settings'][label]['vs_ar_paired']:.3f})", flush=True)
    return res


def _mismatches(ref: dict[int, list[int]], outs: dict[int, list[int]]) -> list[dict]:
    """Each prompt whose tokens differ from the reference's (``{prompt index: tokens}`` both): its
    index, the first differing position and the two tokens there (None past an output's end)."""
    out = []
    for i in sorted(ref):
        a, b = ref[i], outs.get(i, [])
        if a != b:
            pos = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append({"prompt": i, "position": pos, "ar": a[pos] if pos < len(a) else None,
                        "got": b[pos] if pos < len(b) else None})
    return out


def _budget_hist(before: str, after: str, method: str) -> dict[str, int]:
    """Rounds per verified budget bucket (``dartree_spec_policy_budget``) between two scrapes."""
    from services.metrics import BUDGET_BUCKETS, POLICY_BUDGET

    cum = [metric_sum(after, POLICY_BUDGET + "_bucket", le=str(b), method=method)
           - metric_sum(before, POLICY_BUDGET + "_bucket", le=str(b), method=method) for b in BUDGET_BUCKETS]
    out, prev = {}, 0.0
    for b, c in zip(BUDGET_BUCKETS, cum):
        if c - prev > 0:
            out[f"<={b:g}"] = int(round(c - prev))
        prev = c
    return out


def _http_request(client, base: str, vmetrics: str, ids: list[int], method: str | None, max_tokens: int) -> dict:
    """One streaming completion; tokens/s at the client and the verifier's counters around it."""
    import httpx

    from services.metrics import ROUND_SECONDS, SPEC_ACCEPTED_TOKENS, SPEC_ROUNDS

    before = httpx.get(vmetrics, timeout=10).text
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    if method:
        body["speculative"] = {"method": method}
    out: list[int] = []
    t0 = time.perf_counter()
    with client.stream("POST", base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                if "error" in ev:
                    raise RuntimeError(ev["error"])
                out += ev["choices"][0].get("token_ids") or []
    wall = time.perf_counter() - t0
    after = httpx.get(vmetrics, timeout=10).text
    used = method or "dartree-pruned"
    rounds = metric_sum(after, SPEC_ROUNDS, method=used) - metric_sum(before, SPEC_ROUNDS, method=used)
    acc = metric_sum(after, SPEC_ACCEPTED_TOKENS, method=used) - metric_sum(before, SPEC_ACCEPTED_TOKENS, method=used)
    phases = {ph: round(metric_sum(after, ROUND_SECONDS + "_sum", phase=ph)
                        - metric_sum(before, ROUND_SECONDS + "_sum", phase=ph), 6) for ph in HTTP_PHASES}
    return {"tokens": len(out), "seconds": wall, "tokens_per_s": len(out) / wall, "rounds": int(rounds),
            "accepted": int(acc), "budgets": _budget_hist(before, after, used), "phase_seconds": phases, "ids": out}


# the verifier's round phases (``dartree_round_seconds{phase}``, summed over a request's rounds):
# the drafter's own compute (draft, tree_build), the transport (ipc), how long the round waited for
# its draft (draft_wait), its share of the step's target forward (verify), walk + commit (commit),
# the whole round from its draft wait to its commit (total), and the first token's prefill step (prefill)
HTTP_PHASES = ("draft", "tree_build", "ipc", "draft_wait", "verify", "commit", "total", "prefill")


def _start_server(a, log_path: str):
    """``python -m services.serve`` with the defaults (plus ``--weights``); ``(proc, base, metrics url)``."""
    import subprocess
    import sys

    import httpx

    from services.runtime import free_loopback_ports

    port, vport, dport = free_loopback_ports(3)
    cmd = [sys.executable, "-m", "services.serve", "--port", str(port), "--verifier-metrics-port", str(vport),
           "--drafter-metrics-port", str(dport), "--weights", a.weights, "--log-level", "INFO"] + a.serve_args
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            cwd=a.server_root or Path(__file__).resolve().parents[1])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(base + "/health/ready", timeout=2).status_code == 200:
                return proc, base, f"http://127.0.0.1:{vport}/metrics", " ".join(cmd[1:])
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit(f"server not ready in 900 s; see {log_path}")
        time.sleep(0.5)


def _summary(rows: list[dict]) -> dict:
    """Medians and pooled figures of the A/B rows of one group (dataset, pass)."""
    spec, ar = [r["spec"] for r in rows], [r["ar"] for r in rows]
    tps_s = sum(x["tokens"] for x in spec) / sum(x["seconds"] for x in spec)
    tps_a = sum(x["tokens"] for x in ar) / sum(x["seconds"] for x in ar)
    rounds = sum(x["rounds"] for x in spec)
    hist: dict[str, int] = {}
    for x in spec:
        for k, v in x["budgets"].items():
            hist[k] = hist.get(k, 0) + v
    per_round = {}
    for arm, xs in (("spec", spec), ("ar", ar)):
        n = sum(x["rounds"] for x in xs)
        if n and all("phase_seconds" in x for x in xs):  # ms per round; "outside": client wall time not in a round
            per_round[arm] = {ph: round(1e3 * sum(x["phase_seconds"][ph] for x in xs) / n, 3) for ph in HTTP_PHASES}
            per_round[arm]["outside"] = round(1e3 * (sum(x["seconds"] for x in xs)
                                                     - sum(x["phase_seconds"]["total"] for x in xs)) / n, 3)
    return {"requests": len(rows), "tokens_per_s_spec": round(tps_s, 2), "tokens_per_s_ar": round(tps_a, 2),
            "ms_per_round": per_round,
            "ratio": round(tps_s / tps_a, 3),
            "ratio_median_paired": round(statistics.median(x["tokens_per_s"] / y["tokens_per_s"]
                                                           for x, y in zip(spec, ar)), 3),
            "tau": round(sum(x["tokens"] for x in spec) / max(rounds, 1), 3) if rounds else None,
            "rounds": rounds, "budget_hist": hist}


def run_http(a) -> dict:
    """Default server vs plain decoding on the same server, through HTTP (module docstring)."""
    import os

    import httpx

    from services.models.registry import resolve_target

    cache = Path(os.environ.get("DARTREE_CACHE_DIR", Path.home() / ".cache" / "dartree"))
    if a.cold_calibration:
        (cache / "calibration.json").unlink(missing_ok=True)
    prompts = [(ds, uid, ids) for ds in a.datasets
               for uid, ids in _prompts(resolve_target(a.target or "smollm2-135m-instruct"), [ds], a.prompts)]
    t_start = time.monotonic()
    proc, base, vmetrics, cmd = _start_server(a, a.serve_log)
    print(f"server ready in {time.monotonic() - t_start:.0f} s: {cmd}", flush=True)
    rows: list[dict] = []
    try:
        with httpx.Client(timeout=600) as client:
            for method in ("ar", None):  # warm-up of both arms (first-use packing, the drafter's first call)
                _http_request(client, base, vmetrics, prompts[-1][2][:48], method, 16)
            for p in range(a.passes):
                for i, (ds, uid, ids) in enumerate(prompts):
                    order = ("spec", "ar") if (i + p) % 2 == 0 else ("ar", "spec")
                    # prime the prefix cache with the prompt so neither arm pays its prefill and the
                    # second arm does not reuse the first arm's (the pair then compares decoding only)
                    _http_request(client, base, vmetrics, ids, "ar", 1)
                    r = {arm: _http_request(client, base, vmetrics, ids, None if arm == "spec" else "ar",
                                            a.max_tokens) for arm in order}
                    same = r["spec"].pop("ids") == r["ar"].pop("ids")
                    rows.append({"dataset": ds, "uid": uid, "pass": p, "first": order[0], "same_tokens": same, **r})
                    print(f"pass {p} {ds:9s} {uid[:14]:14s} spec {r['spec']['tokens_per_s']:6.2f} ar "
                          f"{r['ar']['tokens_per_s']:6.2f} tok/s ({r['spec']['tokens_per_s'] / r['ar']['tokens_per_s']:.2f}x)"
                          f" rounds {r['spec']['rounds']} budgets {r['spec']['budgets']}", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except Exception:  # noqa: BLE001 (a stuck server is killed, the results are still written)
            proc.kill()
    res = {"bench": "small-trees-http", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "server": cmd, "weights": a.weights, "datasets": a.datasets, "prompts_per_dataset": a.prompts,
           "max_tokens": a.max_tokens, "passes": a.passes, "cold_calibration": a.cold_calibration,
           "server_root": a.server_root,
           "machine": _machine(), "groups": {}, "rows": rows}
    for ds in a.datasets:
        for p in list(range(a.passes)) + ["all"]:
            sel = [r for r in rows if r["dataset"] == ds and (p == "all" or r["pass"] == p)]
            res["groups"][f"{ds} pass {p}"] = g = _summary(sel)
            print(f"{ds:9s} pass {p!s:3s} spec {g['tokens_per_s_spec']:6.2f} ar {g['tokens_per_s_ar']:6.2f} tok/s "
                  f"= {g['ratio']:.3f}x (paired median {g['ratio_median_paired']:.3f}) tau {g['tau']} "
                  f"budgets {g['budget_hist']}", flush=True)
            for arm, ms in g["ms_per_round"].items():
                print(f"    {arm:4s} ms/round " + " ".join(f"{k} {v:.2f}" for k, v in ms.items()), flush=True)
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("tau", "cost", "e2e", "http"):
        p = sub.add_parser(name)
        p.add_argument("--target", default=None)
        p.add_argument("--drafter", default=None, help="drafter dir (default: the shipped drafter)")
        p.add_argument("--datasets", nargs="+", default=["gsm8k", "mt-bench", "sharegpt"])
        p.add_argument("--prompts", type=int, default=10 if name == "tau" else 3, help="prompts per dataset")
        p.add_argument("--max-tokens", type=int, default=96 if name == "tau" else 48)
        p.add_argument("--budgets", type=int, nargs="+", default=[1, 2, 3, 4, 8])
        p.add_argument("--blocks", type=int, nargs="+", default=[16, 8, 4] if name == "tau" else [16, 4],
                       help="inference block lengths L (the largest is the full block; 0 = rows follow "
                            "each call's budget, B + 1)")
        p.add_argument("--width", type=int, default=12)
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--out", default=None)
    sub.choices["tau"].add_argument("--refs-cache", default=None, help=".pt cache of the greedy references")
    c = sub.choices["cost"]
    c.add_argument("--weights", nargs="+", default=["q4", "bfloat16", "float32"])
    c.add_argument("--rows", type=int, nargs="+", default=list(range(1, 10)))
    c.add_argument("--repeats", type=int, default=7, help="timed rounds of the forward sweep")
    c.add_argument("--draft-repeats", type=int, default=2, help="rounds (incl. one warm-up) of the draft replay")
    c.add_argument("--unit", default="q4", help="format whose one-row forward is the unit step")
    c.add_argument("--warm-drafts", action="store_true",
                   help="time the drafts back to back (before: each after a (B + 1)-row target forward, as the "
                        "engine runs them; back to back the drafter's weights stay in the caches: ~1 ms faster "
                        "at B = 3 on the 2-core VM)")
    c.add_argument("--verify-context", type=int, default=0,
                   help="time each M-row forward as a verify: after this many committed positions, logits for "
                        "every row (0: the goodput policy's start-up sweep, an empty slot, the last row's logits)")
    c.add_argument("--drafter-linears", choices=["auto", "dense", "q4"], default="auto",
                   help="the drafter's linears: DrafterService's default, dense, or Q4_1 (int4 kernel)")
    c.add_argument("--compile", action="store_true",
                   help="the target's steps compiled and warmed up, as `dartree serve` runs a q4 Llama target on CPU")
    c.add_argument("--drafter-compile", action="store_true",
                   help="the drafter's block forward through torch.compile (DrafterService(compile=True))")
    t = sub.choices["tau"]
    t.add_argument("--depth-bonus", type=float, nargs="+", default=[-0.2],
                   help="the pruned tree's depth bonus beta (each value replayed; <= 0)")
    t.add_argument("--drafter-dtype", choices=["float32", "bfloat16"], default="float32")
    t.add_argument("--drafter-linears", choices=["dense", "q4"], default="dense",
                   help="q4: the drafter's linears rounded to Q4_1 blocks (needs --drafter-dtype bfloat16)")
    e = sub.choices["e2e"]
    e.add_argument("--weights", default="q4")
    e.add_argument("--settings", nargs="*", default=["3/16", "3/4"], help="fixed B/L settings beside ar and goodput")
    e.add_argument("--repeats", type=int, default=3)
    e.add_argument("--compile", action="store_true",
                   help="the target's steps compiled, as `dartree serve` runs a q4 Llama target on CPU")
    e.add_argument("--goodput-max-budgets", type=int, nargs="*", default=[],
                   help="also run the goodput policy with these B_max (its own policy object each)")
    h = sub.choices["http"]
    h.add_argument("--weights", default="q4", help="the server's --weights")
    h.add_argument("--passes", type=int, default=2, help="passes over the prompt set (one server)")
    h.add_argument("--cold-calibration", action="store_true",
                   help="delete the saved acceptance calibration ($DARTREE_CACHE_DIR/calibration.json) first")
    h.add_argument("--serve-log", default="/tmp/dartree-bench-http.log")
    h.add_argument("--server-root", default=None,
                   help="run the server from this checkout (default: this one), e.g. to compare a commit")
    h.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                   help="more `dartree serve` flags (last on the command line)")
    a = ap.parse_args(argv)
    if a.cmd == "cost" and a.verify_context < 0:
        ap.error(f"--verify-context must be >= 0, got {a.verify_context}")
    if a.cmd == "e2e":
        a.settings_parsed = [tuple(int(x) for x in v.split("/")) for v in a.settings]
    torch.set_num_threads(a.threads)
    res = {"tau": run_tau, "cost": run_cost, "e2e": run_e2e, "http": run_http}[a.cmd](a)
    res["command"] = "python -m benchmarks.bench_small_trees " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    return write_result(res, a.out)


if __name__ == "__main__":
    main()
