"""The verify step's cost against its row count, per attention path (a section of ``gpu_check``).

Question answered: on this device, what does one verify step of ``R`` rows (a random tree of
``R - 1`` draft nodes below its root, at ``context`` committed positions) cost on each path of
:class:`~services.verifier.runner.ModelRunner`, and how far is it from a one-row step? Paths:
``tree-attention`` (eager; the prefix call merged with the device-built tree block, the CUDA
default), ``dense`` (eager; per-request SDPA over a host-built mask) and ``graphs`` (padded to a
bucket, replayed from a CUDA graph on a GPU, eager padded steps elsewhere). Each path's logits are
compared with the dense path's (max absolute difference; bfloat16 on a GPU, so not zero).
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from services.testing import random_tree
from services.tree import derive_buffers
from services.tree.batch import Segment, causal_segment
from services.verifier.runner import ModelRunner

ROWS = (1, 9, 17, 33, 65, 129)
SMOKE_ROWS = (1, 5, 9)
MODES = {"tree-attention": dict(tree_attention=True), "dense": dict(tree_attention=False),
         "graphs": dict(cuda_graphs=True)}


def tree_segment(rows: int, start: int, vocab: int, seed: int = 0) -> Segment:
    """A verify segment of ``rows`` rows (a random tree of ``rows - 1`` nodes, depth <= 8) at ``start``."""
    b = derive_buffers(random_tree(random.Random(seed), vocab, rows - 1, 8), 1)
    return Segment(b.input_ids, b.position_offsets, b.tree_mask, start, 0, b.parent_rows)


def _prefilled(target, mode: dict, context: int, capacity: int) -> ModelRunner:
    """A one-slot runner whose slot 0 holds ``context`` committed positions."""
    runner = ModelRunner(target, num_slots=1, capacity=capacity, kv_bucket=64, **mode)
    slot = runner.cache.alloc()
    ids = torch.randint(100, int(target.config.vocab_size) - 100, (context,), generator=torch.Generator()
                        .manual_seed(0)).tolist()
    runner.execute([causal_segment(ids, 0, slot)], torch.tensor([context - 1]))
    runner.cache.extend(slot, context)
    return runner


def _median_ms(runner: ModelRunner, seg: Segment, reps: int, cuda: bool) -> float:
    """Median wall ms of ``runner.execute([seg])`` (rewrites the same columns; nothing committed)."""
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.execute([seg])
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def verify_curve(target, shape: str, context: int, rows: tuple[int, ...], reps: int, deadline: float,
                 modes=tuple(MODES)) -> list[dict]:
    """One entry per (path of ``modes``, rows): ``ms``, ``ratio_to_one_row`` and
    ``max_abs_diff_vs_dense``; a path that cannot be built or run is one entry with its ``error``;
    past ``deadline`` (``time.perf_counter()``) the rest is ``skipped``."""
    cuda = torch.device(target.device).type == "cuda"
    capacity = context + max(rows) + 64
    out, dense_logits = [], {}
    chosen = {m: MODES[m] for m in modes}
    for mode, kwargs in sorted(chosen.items(), key=lambda kv: kv[0] != "dense"):  # dense first: the reference
        try:
            runner = _prefilled(target, kwargs, context, capacity)
        except Exception as e:  # noqa: BLE001 (reported per path; the check goes on)
            out.append({"shape": shape, "mode": mode, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        one = None
        for r in rows:
            cell = {"shape": shape, "mode": mode, "rows": r, "context": context}
            if time.perf_counter() > deadline:
                out.append({**cell, "status": "skipped", "error": "time limit"})
                continue
            seg = tree_segment(r, context, int(target.config.vocab_size), seed=r)
            logits = runner.execute([seg]).logits  # warm-up (a graph's capture) and the comparison
            if mode == "dense":
                dense_logits[r] = logits
            ms = _median_ms(runner, seg, reps, cuda)
            one = ms if r == 1 else one
            diff = float((logits - dense_logits[r]).abs().max()) if r in dense_logits else None
            out.append({**cell, "status": "ok", "ms": ms, "ratio_to_one_row": ms / one if one else None,
                        "max_abs_diff_vs_dense": diff})
        del runner
    return out
