"""Pack many requests' rows into one batched step, and split the results back (pure, torch only).

A *step* is one target forward for every running request; each request contributes a *segment* of
rows: its verify rows (root + N draft nodes of a tree, :class:`VerifyBuffers`), a single row (a plain
``ar`` round) or a chunk of its prompt (chunked prefill). Linears run on the flattened rows
(``R = sum R_i``, no padding); attention runs on a padded ``[n, R_max]`` view of the same rows
against each request's slot of the KV cache (vLLM's ``cu_*`` offsets, SGLang's per-request tree
masks).

Worked example: request 0 verifies a two-node tree ``[r, a, b]`` (both children of the root) at
``start = 3``; request 1 prefills a 2-token chunk ``[p, q]`` at ``start = 0``. Then::

    input_ids   = [r, a, b, p, q]          cu_rows = [0, 3, 5]
    positions   = [3, 4, 4, 0, 1]          row_index = [[0, 1, 2],
    kv_length   = 6 (max start + R_max)                 [3, 4, -1]]

and with slot columns ``0..5`` (request 0's new rows are written at columns 3, 4, 5, request 1's at
0, 1)::

    request 0: r 1 1 1 1 0 0     request 1: p 1 0 0 0 0 0
               a 1 1 1 1 1 0                q 1 1 0 0 0 0
               b 1 1 1 1 0 1                - 1 0 0 0 0 0   (padding row: sees column ``start``)

Padding rows see exactly one written column, so no softmax row is empty (no NaN); their outputs
are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Segment:
    """One request's rows in a step.

    Attributes:
        input_ids: ``[R_i]`` long token ids.
        position_offsets: ``[R_i]`` long, position of each row relative to ``start``.
        local_mask: ``[R_i, R_i]`` bool, ``local_mask[i, j]`` = row ``i`` attends to row ``j`` of
            this segment (a tree mask, or lower-triangular for a prompt chunk). Every row attends to
            the ``start`` committed positions of its slot as well.
        start: committed KV length of the request's slot (its rows are written from there on).
        slot: the request's KV-cache slot.
    """

    input_ids: Tensor
    position_offsets: Tensor
    local_mask: Tensor
    start: int
    slot: int

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.numel())


def causal_segment(ids: list[int], start: int, slot: int) -> Segment:
    """A prompt chunk (or a lone ``ar`` row): rows at ``start, start+1, ...``, causal among themselves."""
    n = len(ids)
    return Segment(torch.tensor(ids, dtype=torch.long), torch.arange(n),
                   torch.ones(n, n, dtype=torch.bool).tril_(), start, slot)


@dataclass(frozen=True)
class PackedRows:
    """The flattened rows of a step and the padded attention layout.

    Attributes (``n`` segments, ``R`` rows in all, ``Rm`` = the longest segment, ``L`` = KV length):
        input_ids: ``[R]`` long.
        positions: ``[R]`` long absolute position ids (``start + position_offsets``).
        cu_rows: ``[n + 1]`` long, segment ``i`` owns flattened rows ``cu_rows[i]:cu_rows[i+1]``.
        slots: ``[n]`` long slot of each segment; starts: ``[n]`` long committed lengths.
        row_index: ``[n, Rm]`` long flattened row of each padded row, ``-1`` for padding.
        padded_pos: ``[R]`` long, where each flattened row sits in the ``[n * Rm]`` padded layout
            (the inverse of ``row_index``: an index gather back to flattened rows needs no
            data-dependent shape, hence no host sync on CUDA and nothing a CUDA graph cannot capture).
        write_slot, write_pos: ``[R]`` long, where each row's K/V is written (slot, column).
        attn_mask: ``[n, 1, Rm, L]`` bool, True = attend (see the module docstring).
        kv_length: ``L``, the columns attention reads (a multiple of ``kv_bucket``).
    """

    input_ids: Tensor
    positions: Tensor
    cu_rows: Tensor
    slots: Tensor
    starts: Tensor
    row_index: Tensor
    padded_pos: Tensor
    write_slot: Tensor
    write_pos: Tensor
    attn_mask: Tensor
    kv_length: int


def pack_segments(segments: list[Segment], kv_bucket: int = 1, kv_capacity: int | None = None) -> PackedRows:
    """Flatten ``segments`` into one step (see the module docstring's worked example).

    Args:
        kv_bucket: round the KV length up to a multiple of this (fewer distinct shapes), capped
            at ``kv_capacity``.
    Raises:
        ValueError: no segments, an empty segment, a mask of the wrong shape, a duplicate slot, or
            rows that would not fit in ``kv_capacity`` columns.
    """
    if not segments:
        raise ValueError("a step needs at least one segment")
    slots = [s.slot for s in segments]
    if len(set(slots)) != len(slots):
        raise ValueError(f"duplicate slot in one step: {slots}")
    sizes = [s.num_rows for s in segments]
    for s, r in zip(segments, sizes):
        if r == 0:
            raise ValueError("a segment has no rows")
        if tuple(s.local_mask.shape) != (r, r) or s.position_offsets.numel() != r:
            raise ValueError("segment mask / positions do not match its rows")
    n, rm = len(segments), max(sizes)
    need = max(s.start + r for s, r in zip(segments, sizes))
    if kv_capacity is not None and need > kv_capacity:
        raise ValueError(f"a segment needs {need} KV columns, the cache holds {kv_capacity}")
    length = -(-need // kv_bucket) * kv_bucket
    if kv_capacity is not None:
        length = min(length, kv_capacity)
    cu = torch.zeros(n + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(torch.tensor(sizes), 0)
    starts = torch.tensor([s.start for s in segments], dtype=torch.long)
    row_index = torch.full((n, rm), -1, dtype=torch.long)
    mask = torch.zeros(n, 1, rm, length, dtype=torch.bool)
    cols = torch.arange(length)
    for i, (s, r) in enumerate(zip(segments, sizes)):
        row_index[i, :r] = torch.arange(int(cu[i]), int(cu[i + 1]))
        mask[i, 0, :r] = cols[None, :] < s.start
        mask[i, 0, :r, s.start:s.start + r] = s.local_mask
        mask[i, 0, r:, s.start] = True  # padding rows: one written column
    seg_of_row = torch.repeat_interleave(torch.arange(n), torch.tensor(sizes))
    offsets = torch.arange(int(cu[-1])) - cu[seg_of_row]
    return PackedRows(
        input_ids=torch.cat([s.input_ids for s in segments]).long(),
        positions=torch.cat([s.start + s.position_offsets for s in segments]).long(),
        cu_rows=cu, slots=torch.tensor(slots, dtype=torch.long), starts=starts, row_index=row_index,
        padded_pos=seg_of_row * rm + offsets,
        write_slot=torch.tensor(slots, dtype=torch.long)[seg_of_row], write_pos=starts[seg_of_row] + offsets,
        attn_mask=mask, kv_length=length)


def split_rows(x: Tensor, cu_rows: Tensor) -> list[Tensor]:
    """Split a ``[R, ...]`` per-row tensor into one ``[R_i, ...]`` view per segment."""
    bounds = cu_rows.tolist()
    return [x[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
