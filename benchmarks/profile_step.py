"""Where a plain decoding (``ar``) step goes: the target's kernels by kind, and the time outside them.

Decodes one chat prompt with ``ar`` through the in-process engine (the verifier's own step code),
measures the median step without a profiler, then runs the same number of steps under
``torch.profiler`` and splits the ops' self CPU time per step into:

- ``int4_linears``: ``aten::_weight_int4pack_mm_for_cpu`` (the q4 decoder linears);
- ``dense_linears``: oneDNN / MKL / ``aten::addmm`` / ``aten::mm`` / ``aten::linear`` (the bf16
  lm_head under q4; every linear under float32 / bfloat16);
- ``attention``: ``aten::_scaled_dot_product*`` / ``aten::bmm`` / ``aten::_softmax`` (the slot
  attention of every layer), and the Python of the opaque ``dartree::slot_attention`` op that
  compiled steps call;
- ``other_ops``: every other ATen op (norms, rotary, residual adds, KV writes, sampling; with
  ``--compile`` inductor's fused kernels, ``CompiledFxGraph``);
- ``outside_ops``: the profiled step's wall time minus all op self time: Python, transformers'
  module code, dispatcher overhead.

With a ``--context`` the prompt is padded to about that many tokens (a repeated paragraph) so the
attention over a long slot shows. Threads: ``--threads``. Run on an idle machine (a busy one
inflates every kind; the JSON records the load average).

    python -m benchmarks.profile_step --weights q4 --threads 2 --tokens 32 [--context 2000] [--compile]

Prints a table and, as its last line, one JSON object (also written to ``--out`` when given).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

PROMPT = "Explain, step by step, how a hash table handles collisions."
FILLER = ("A hash table stores keys in buckets chosen by a hash function; two keys may land in the "
          "same bucket, and the table must then keep both and find each again. ")

KINDS = ("int4_linears", "dense_linears", "attention", "other_ops", "outside_ops")


def op_kind(name: str) -> str:
    """The kind of a profiled op name (see the module docstring); ``other_ops`` when none matches."""
    if "int4pack" in name:
        return "int4_linears"
    if name.startswith("mkldnn::") or name in ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul") \
            or "mkl_linear" in name or "linear_pointwise" in name:
        return "dense_linears"
    if "scaled_dot_product" in name or "slot_attention" in name or name in ("aten::bmm", "aten::_softmax",
                                                                           "aten::softmax"):
        return "attention"
    return "other_ops"


def split_profile(events, steps: int, wall_s: float) -> dict[str, float]:
    """Per-step milliseconds of each kind from ``torch.profiler``'s ``key_averages()`` rows
    (``key``, ``self_cpu_time_total`` in microseconds) over ``steps`` steps that took ``wall_s``.

    Raises:
        ValueError: ``steps < 1``."""
    if steps < 1:
        raise ValueError("need at least one profiled step")
    ms = dict.fromkeys(KINDS, 0.0)
    for e in events:
        ms[op_kind(e.key)] += e.self_cpu_time_total / 1000.0 / steps
    ops = sum(ms[k] for k in KINDS[:-1])
    ms["outside_ops"] = max(1000.0 * wall_s / steps - ops, 0.0)
    return ms


def build_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_step", description=__doc__.split("\n")[0])
    p.add_argument("--weights", default="q4", help="target weight format (float32, bfloat16, q4)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--tokens", type=int, default=32, help="ar steps measured (and profiled)")
    p.add_argument("--context", type=int, default=0, help="pad the prompt to about this many tokens (0 = the bare prompt)")
    p.add_argument("--compile", action="store_true", help="the target's steps through torch.compile (the "
                   "server's default for q4 on CPU; warmed up before anything is timed)")
    p.add_argument("--top", type=int, default=0, help="also list this many ops by self time a step")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    if a.threads < 1 or a.tokens < 2 or a.context < 0:
        p.error("--threads >= 1, --tokens >= 2, --context >= 0")
    return a


def main(argv: list[str] | None = None) -> None:
    a = build_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from services.generate import build_inprocess, encode
    from services.params import SamplingParams, SpecParams
    from services.weights import compute_dtype

    torch.set_num_threads(a.threads)
    engine, tok, _ = build_inprocess(None, None, compute_dtype(a.weights), weights=a.weights, compile=a.compile)
    text = PROMPT
    while a.context and len(tok(text)["input_ids"]) < a.context:
        text = FILLER + text
    ids = encode(tok, text, chat=True)

    def run(n: int, rid: str) -> list[float]:
        engine.add_request(rid, ids, SamplingParams(max_tokens=n, ignore_eos=True), SpecParams("ar"))
        walls = []
        while True:
            out = engine.step_batch([rid])[rid]
            if isinstance(out, BaseException):
                raise out
            if out is None:
                continue
            if not out.is_prefill:
                walls.append(engine.last_step.wall_seconds)
            if out.finish_reason is not None:
                return walls

    run(4, "warm")
    load_before = os.getloadavg()[0]
    step_ms = 1000 * statistics.median(run(a.tokens, "plain"))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        walls = run(a.tokens, "profiled")
    split = split_profile(prof.key_averages(), len(walls), sum(walls))
    rec = {"weights": a.weights, "compiled": engine.runner.compiled, "threads": a.threads, "prompt_tokens": len(ids),
           "steps": len(walls),
           "step_ms": round(step_ms, 2), "profiled_step_ms": round(1000 * sum(walls) / len(walls), 2),
           **{k + "_ms": round(v, 2) for k, v in split.items()},
           "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    print(f"{a.weights}, {a.threads} thread(s), {len(ids)} prompt tokens: step {rec['step_ms']} ms "
          f"(profiled {rec['profiled_step_ms']} ms)")
    for k in KINDS:
        print(f"  {k:<14} {split[k]:7.2f} ms")
    if a.top:
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:a.top]
        rec["top_ops"] = [{"op": e.key, "kind": op_kind(e.key), "calls_per_step": round(e.count / len(walls), 1),
                           "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / len(walls), 3)} for e in rows]
        for r in rec["top_ops"]:
            print(f"    {r['self_ms_per_step']:7.3f} ms {r['calls_per_step']:6.1f} calls  {r['op']} ({r['kind']})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rec, f, indent=1)
    print(json.dumps(rec))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
