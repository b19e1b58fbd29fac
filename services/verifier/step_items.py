"""Each request's part of one engine step, and the step-wide bookkeeping over those parts.

:meth:`SpecEngine.step <services.verifier.engine.SpecEngine.step>` turns its plan into one
:class:`StepItem` per request (a decode round with its tree laid out as a verify segment, or a
prompt chunk as a causal segment); this module holds the item and the pure steps around the one
target forward: laying a round's tree out (:func:`lay_out_round`), the rows whose logits the
forward keeps (:func:`logit_rows`), committing the step's decode rounds on the device
(:func:`commit_on_device`) and the step's :class:`~services.verifier.requests.StepStats`
(:func:`step_stats`). The engine keeps the loop, its drafter calls and the per-request emits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from services.tree import DraftTree, derive_buffers
from services.tree.batch import Segment, causal_segment
from services.verifier.requests import RequestState, StepStats
from services.verifier.scheduler import RoundInfo, StepPlan
from services.verifier.step_commit import DeviceRound, HostReads, commit_rounds


@dataclass
class StepItem:
    """One request's part of a step (the engine's own record; never leaves the verifier)."""

    rid: str
    req: RequestState
    segment: Segment
    buffers: object = None             # VerifyBuffers of a decode round; None for a prompt chunk
    tree: DraftTree | None = None
    timings: dict = field(default_factory=dict)
    final_chunk: bool = False
    drafted: bool = False              # the drafter was called (or its overlapped draft collected)
    skipped: bool = False              # the plan gave a drafting method a plain round
    predicted_tau: float | None = None
    row_ids: list[int] = field(default_factory=list)      # buffers.input_ids, read before the forward
    row_offsets: list[int] = field(default_factory=list)  # buffers.position_offsets, likewise


def lay_out_round(p: StepItem, tree: DraftTree, predicted_tau: float | None) -> None:
    """Give the decode round ``p`` the policy's cut of its ``tree``: its verify buffers
    (:func:`~services.tree.derive_buffers` from the request's root), its verify segment and the
    host lists of its row ids / offsets (host tensors: no device read)."""
    p.tree, p.predicted_tau = tree, predicted_tau
    p.buffers = b = derive_buffers(p.tree, p.req.root)
    p.segment = Segment(b.input_ids, b.position_offsets, b.tree_mask, p.req.start, p.req.slot, b.parent_rows)
    p.row_ids, p.row_offsets = b.input_ids.tolist(), b.position_offsets.tolist()


def prompt_chunks(plan: StepPlan, reqs: dict[str, RequestState]) -> list[StepItem]:
    """The plan's prompt chunks as causal segments."""
    items = []
    for e in plan.chunks:
        req, (first, n) = reqs[e.rid], e.chunk
        items.append(StepItem(e.rid, req, causal_segment(req.prompt_ids[first:first + n], first, e.slot),
                              final_chunk=first + n == len(req.prompt_ids)))
    return items


def logit_rows(items: list[StepItem]) -> tuple[list[int], list[tuple[int, int]], list[int]]:
    """The step's row layout, items in order: ``(keep, spans, cu)`` with ``keep`` the flattened rows
    whose logits the forward computes (every row of a decode round, the last row of a final prompt
    chunk, none of another chunk), ``spans[i]`` item i's ``[s, e)`` in those logit rows and ``cu``
    the cumulative row counts (item i's rows are ``[cu[i], cu[i + 1])``).

    Example: a 3-row round, a 4-row non-final chunk, a 2-row final chunk -> ``keep = [0, 1, 2, 8]``,
    ``spans = [(0, 3), (3, 3), (3, 4)]``, ``cu = [0, 3, 7, 9]``."""
    cu = [0]
    for p in items:
        cu.append(cu[-1] + p.segment.num_rows)
    keep, spans = [], []
    for p, a, b in zip(items, cu[:-1], cu[1:]):
        rows = list(range(a, b)) if p.buffers is not None else ([b - 1] if p.final_chunk else [])
        spans.append((len(keep), len(keep) + len(rows)))
        keep.extend(rows)
    return keep, spans, cu


def commit_on_device(items: list[StepItem], out: list[tuple[torch.Tensor, torch.Tensor]], cache, eos_token_ids,
                     reads: HostReads, has_drafter: bool) -> dict:
    """Every decode round of the step sampled, walked and committed on the device with one
    device-to-host copy (:func:`services.verifier.step_commit.commit_rounds`; ``out``: each item's
    ``(logits, features)``): per request id, its :class:`~services.verifier.requests.Committed` or
    the exception its round raised. Each round's ``_commit`` timing gets an even share."""
    flags = lambda p: (p.skipped, p.drafted, has_drafter)  # noqa: E731
    rounds = [(p, DeviceRound(p.req, p.buffers, p.row_ids, p.row_offsets, logits, feats, flags(p)))
              for p, (logits, feats) in zip(items, out) if p.buffers is not None]
    if not rounds:
        return {}
    t0 = time.perf_counter()
    done = commit_rounds([r for _, r in rounds], cache, eos_token_ids, reads)
    secs = (time.perf_counter() - t0) / len(rounds)  # the step's walk and compaction, shared evenly
    for p, _ in rounds:
        p.timings["_commit"] = secs
    return {p.rid: c for (p, _), c in zip(rounds, done)}


def step_stats(items: list[StepItem], infos: dict[str, RoundInfo], submit_wait: float, wall: float, reads: int,
               device_walk: bool, predicted_seconds: float | None) -> StepStats:
    """The step's :class:`StepStats` (``submit_wait``: the drafter submission; ``wall``: the step;
    ``reads``: its device-to-host copies of committed rounds; ``device_walk``: decode rounds were
    committed on the device; ``predicted_seconds``: the policy's prediction of the step)."""
    decoding = sum(1 for p in items if p.buffers is not None)
    draft_s = sum(p.timings.get("draft", 0.0) + p.timings.get("tree_build", 0.0) for p in items)
    wait_s = submit_wait + sum(p.timings.get("draft_wait", 0.0) for p in items)
    return StepStats(len(items), sum(p.segment.num_rows for p in items),
                     sum(p.segment.num_rows for p in items if p.buffers is None),
                     items[0].timings["verify"], draft_s, wait_s,
                     decoding=decoding, device_rounds=decoding if device_walk else 0,
                     round_reads=reads,
                     drafting=sum(1 for p in items if p.drafted),
                     draft_owed=sum(infos[p.rid].owed for p in items if p.drafted),
                     speculating=sum(1 for p in items if p.tree is not None and p.tree.num_nodes),
                     wall_seconds=wall, predicted_seconds=predicted_seconds)
