"""The decode rounds of a step committed on the device, with ONE device-to-host copy for the step.

After the step's forward every decode round samples its verify rows where the logits are
(:meth:`~services.verifier.sampling.Sampler.sample`: argmax at T = 0, the inverse-CDF draw with the
position's uniform at T > 0, logit processors and grammar masks as on the host path), then
:func:`~services.tree.device_walk.walk_segments` walks every round's tree at once with static
shapes, and its packed ``[n, Rm + 2]`` outcome (accept length, bonus token, accepted rows) is read
once: the only device-to-host copy between the forward and the next step (a request that asks for
logprobs reads them after it). :meth:`~services.verifier.kv_cache.SlotKVCache.commit_paths` then
compacts every accepted path's KV in one gather and one write per layer, and
:func:`~services.verifier.requests.commit_path` commits each request's tokens on the host from the
lists it already holds. The tokens, KV and histories are those of the host path
(:func:`~services.verifier.requests.commit_round`: a per-request host walk and per-slot commit).

Which rounds read what: every decode round takes this path when the engine's ``device_walk`` is on
(the default off the CPU: :attr:`~services.verifier.engine.SpecEngine.device_walk`; ``StepStats.device_rounds`` and the ``dartree_verifier_rounds_total{walk=...}`` metric
count them), greedy and T > 0 alike (the uniforms of T > 0 rows are made from host lists). Rounds
with a grammar build their masks from host-side tree lists (no device read). Rounds with
``repetition_penalty`` / ``frequency_penalty`` / ``presence_penalty`` read once more: the penalties
pick the columns they change with a ``nonzero`` (:func:`~services.tree.logit_processors.process_logits`).
Logprobs, when asked, are read after the copy. Prompt chunks are not rounds: the last one samples
its first token on its own read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from services.tree.device_walk import walk_segments
from services.verifier.requests import Committed, RequestState, commit_path


@dataclass
class DeviceRound:
    """One decode round handed to :func:`commit_rounds`.

    Attributes:
        req: the request; buffers: its round's verify buffers; row_ids, row_offsets: the buffers'
        ``input_ids`` and ``position_offsets`` as host lists (read when the round was laid out, before
        the forward); logits: ``[R, V]`` its rows' logits; feats: ``[R, F]`` its rows' features;
        flags: ``(skipped, drafted, with_drafter)`` (:func:`~services.verifier.requests.commit_path`).
    """

    req: RequestState
    buffers: object
    row_ids: list[int]
    row_offsets: list[int]
    logits: Tensor
    feats: Tensor
    flags: tuple[bool, bool, bool]


class HostReads:
    """Counts the engine's device-to-host copies of committed rounds (one per step on the device
    path; the ``dartree_verifier_round_reads_total`` metric)."""

    def __init__(self) -> None:
        self.count = 0

    def read(self, packed: Tensor) -> list[list[int]]:
        """``packed`` as nested lists: one device-to-host copy."""
        self.count += 1
        return packed.tolist()


def _sample(r: DeviceRound) -> Tensor:
    """``[R]`` long target tokens of one round's rows, on the logits' device (no tensor read)."""
    req = r.req
    positions = [req.start + 1 + d for d in r.row_offsets]
    return req.sampler.sample(r.logits, torch.tensor(positions, dtype=torch.long), r.buffers,
                              host_positions=positions).long()


def commit_rounds(rounds: list[DeviceRound], cache, eos_token_ids, reads: HostReads) -> list[Committed | BaseException]:
    """Sample, walk, compact and commit every round of a step (see the module docstring).

    Args:
        rounds: the step's decode rounds (distinct slots); cache: the step's
            :class:`~services.verifier.kv_cache.SlotKVCache`; reads: where the one copy is counted.
    Returns:
        Per round, its :class:`~services.verifier.requests.Committed`, or the exception its sampling
        raised (that round commits nothing; the others are unaffected). An error of the shared walk
        or compaction is returned for every round that reached it.
    """
    out: list[Committed | BaseException | None] = [None] * len(rounds)
    live, targets, sampled = [], [], []
    for i, r in enumerate(rounds):
        t0 = time.perf_counter()
        try:
            targets.append(_sample(r))
        except Exception as exc:
            out[i] = exc
            continue
        live.append(i)
        sampled.append(time.perf_counter() - t0)
    if live:
        try:
            paths = _walk_and_compact([rounds[i] for i in live], targets, cache, reads)
        except Exception as exc:
            for i in live:
                out[i] = exc
            return out
        for i, (rows, bonus), secs in zip(live, paths, sampled):
            r = rounds[i]
            try:
                out[i] = commit_path(r.req, rows, bonus, r.row_ids, r.feats, eos_token_ids, r.flags, secs)
            except Exception as exc:
                out[i] = exc
    return out


def _walk_and_compact(rounds: list[DeviceRound], targets: list[Tensor], cache,
                      reads: HostReads) -> list[tuple[list[int], int]]:
    """The device walk of ``rounds`` (target tokens ``targets[i] [R_i]``), its one read, and the KV
    compaction of the accepted paths. Returns per round ``(accepted rows, bonus token)``."""
    dev = targets[0].device
    bounds = [0]
    for r in rounds:
        bounds.append(bounds[-1] + len(r.row_ids))
    ids = torch.tensor([t for r in rounds for t in r.row_ids], dtype=torch.long).to(dev)
    parents = torch.cat([r.buffers.parent_rows for r in rounds]).long().to(dev)
    cu = torch.tensor(bounds, dtype=torch.long).to(dev)
    width = max(len(r.row_ids) for r in rounds)
    walked = walk_segments(ids, parents, cu, torch.cat(targets), width)
    host = reads.read(walked.packed())  # the step's one device-to-host copy
    paths = [(row[2:3 + row[0]], row[1]) for row in host]
    lengths = [len(rows) for rows, _ in paths]
    cache.commit_paths([r.req.slot for r in rounds], [r.req.start for r in rounds],
                       walked.accepted_rows[:, :max(lengths)], lengths)  # only the columns a path reaches
    return paths
