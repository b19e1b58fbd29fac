"""CPU microbenchmark: build time of every tree builder, buffer derivation and the walk.

Question answered: how many milliseconds does each tree algorithm in ``services.tree`` cost per
round at the paper's defaults (K=64, W=12, B=64, D=16), for the Qwen3 (V=151,936) and SmolLM2
(V=49,152) vocabularies? No model code: the correction head is a
:class:`services.tree.MarkovScorer` with random rank-256 ``w1``/``w2`` (a DSpark-style bigram
head, the same tensor shapes as Domino's ``[V, 256]`` output projection).

What each row times (inputs pre-built, outputs discarded):

- ``chain``: argmax of the ``[D, V]`` base logits + :func:`chain` (DFlash chain baseline).
- ``ddtree``: full-vocab log-softmax + :func:`ddtree` (CPU heap, as in DDT).
- ``dartree_pruned`` / ``dartree_fixed``: :func:`dartree` incl. the per-depth top-K candidates.
- ``seqheap``: :func:`seqheap` (exact best-first search, one scorer call per pop); fewer runs.
- ``chain_rollout``: the sequential Domino chain (full-vocab correction per slot).
- ``domino_ddtree``: :func:`domino_ddtree` over the rollout's logits (rollout excluded).
- ``derive_buffers``: mask / positions / paths of the pruned DARTree; ``walk``: greedy walk on it.

Usage: ``python -m benchmarks.bench_tree [--runs 200] [--seqheap-runs 50] [--vocab 49152 151936]
[--threads 1]``. One torch thread by default: on a 2-core machine with other load, intra-op
parallelism turns millisecond ops into scheduler-quantum stalls (8, 16, 500 ms medians).
Prints a table, then (last stdout line) one JSON object with every number and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from services.tree import (
    MarkovScorer,
    chain,
    chain_rollout,
    dartree,
    ddtree,
    derive_buffers,
    domino_ddtree,
    seqheap,
    walk,
)

K, W, B, D, RANK = 64, 12, 64, 16, 256
ROOT_TOKEN = 1


def time_ms(fn: Callable[[], object], runs: int, warmup: int = 3) -> dict[str, float]:
    """Median / p10 / p90 wall time of ``fn()`` in milliseconds over ``runs`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1e6)
    samples.sort()
    return {"median_ms": statistics.median(samples), "p10_ms": samples[len(samples) // 10],
            "p90_ms": samples[(9 * len(samples)) // 10], "runs": runs}


def make_inputs(vocab: int, seed: int) -> tuple[torch.Tensor, MarkovScorer]:
    """Random base logits ``[D, V]`` and a rank-256 Markov scorer over ``V``."""
    gen = torch.Generator().manual_seed(seed)
    base = 4.0 * torch.randn(D, vocab, generator=gen)  # [D, V]
    w1 = torch.randn(vocab, RANK, generator=gen) / RANK**0.5  # [V, r]
    w2 = torch.randn(vocab, RANK, generator=gen) / RANK**0.5  # [V, r]
    return base, MarkovScorer(w1, w2)


def bench_vocab(vocab: int, runs: int, seqheap_runs: int, seed: int) -> dict[str, dict[str, float]]:
    """Time every builder at one vocabulary size."""
    base, scorer = make_inputs(vocab, seed)
    _, chain_logits = chain_rollout(base, scorer, ROOT_TOKEN)
    tree = dartree(base, scorer, ROOT_TOKEN, K=K, W=W, B=B)
    buffers = derive_buffers(tree, ROOT_TOKEN)
    target = torch.randint(0, vocab, (tree.num_nodes + 1,), generator=torch.Generator().manual_seed(seed))
    cases: dict[str, tuple[Callable[[], object], int]] = {
        "chain": (lambda: chain(torch.argmax(base, dim=-1)), runs),
        "ddtree": (lambda: ddtree(torch.log_softmax(base, dim=-1), B), runs),
        "dartree_pruned": (lambda: dartree(base, scorer, ROOT_TOKEN, K=K, W=W, B=B, beta=-0.2), runs),
        "dartree_fixed": (lambda: dartree(base, scorer, ROOT_TOKEN, K=K, B=B, beta=0.0, variant="fixed"), runs),
        "seqheap": (lambda: seqheap(base, scorer, ROOT_TOKEN, K=K, B=B, beta=-0.2), seqheap_runs),
        "chain_rollout": (lambda: chain_rollout(base, scorer, ROOT_TOKEN), runs),
        "domino_ddtree": (lambda: domino_ddtree(chain_logits, B), runs),
        "derive_buffers": (lambda: derive_buffers(tree, ROOT_TOKEN), runs),
        "walk": (lambda: walk(buffers, target), runs),
    }
    return {name: time_ms(fn, n) for name, (fn, n) in cases.items()}


def machine_info() -> dict[str, object]:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version()}


def print_table(results: dict[int, dict[str, dict[str, float]]]) -> None:
    vocabs = list(results)
    names = list(next(iter(results.values())))
    header = f"{'builder':<16}" + "".join(f"{'V=' + str(v) + ' median ms (p10-p90)':>36}" for v in vocabs) + f"{'runs':>6}"
    print(header)
    print("-" * len(header))
    for name in names:
        cells = "".join(
            f"{r['median_ms']:>16.3f} ({r['p10_ms']:.3f}-{r['p90_ms']:.3f})".rjust(36)
            for r in (results[v][name] for v in vocabs))
        print(f"{name:<16}{cells}{results[vocabs[0]][name]['runs']:>6}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="timed runs per builder (median reported)")
    parser.add_argument("--seqheap-runs", type=int, default=50, help="timed runs for the slow seqheap ablation")
    parser.add_argument("--vocab", type=int, nargs="+", default=[49_152, 151_936])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: stable latencies; >1 stalls badly on a busy machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    results = {v: bench_vocab(v, args.runs, min(args.seqheap_runs, args.runs), args.seed) for v in args.vocab}
    print(f"tree build times, K={K} W={W} B={B} D={D}, MarkovScorer rank {RANK}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads")
    print_table(results)
    print(json.dumps({
        "bench": "tree", "config": {"K": K, "W": W, "B": B, "D": D, "rank": RANK, "beta": -0.2,
                                    "runs": args.runs, "seqheap_runs": min(args.seqheap_runs, args.runs),
                                    "seed": args.seed},
        "results": {str(v): r for v, r in results.items()},
        "torch": torch.__version__, "machine": machine_info(),
    }))


if __name__ == "__main__":
    main()
