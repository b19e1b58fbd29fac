"""Pack many requests' rows into one batched step, and split the results back (pure, torch only).

A *step* is one target forward for every running request; each request contributes a *segment* of
rows: its verify rows (root + N draft nodes of a tree, :class:`VerifyBuffers`), a single row (a plain
``ar`` round) or a chunk of its prompt (chunked prefill). Linears run on the flattened rows
(``R = sum R_i``, no padding); attention runs per request on its own rows against its slot of the
KV cache, each request's mask being its row block of a padded ``[n, R_max]`` layout (vLLM's ``cu_*``
offsets, SGLang's per-request tree masks); a padded step (CUDA graphs) runs the whole layout at once.

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

from services.tree.tree_mask import tree_mask_from_parents


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
        parent_rows: ``[R_i]`` long or None, the parent row of each row (``-1`` for a root),
            ``local_mask`` as a parent array (``VerifyBuffers.parent_rows``; a chunk's
            ``[-1, 0, 1, ...]``): what the device-built tree mask is made from
            (:func:`services.tree.tree_mask.tree_mask_from_parents`). None: derived from
            ``local_mask`` when needed (:meth:`parents`).
    """

    input_ids: Tensor
    position_offsets: Tensor
    local_mask: Tensor
    start: int
    slot: int
    parent_rows: Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.numel())

    def parents(self) -> Tensor:
        """``[R_i]`` long parent row of every row: :attr:`parent_rows`, else the nearest earlier row
        ``local_mask`` lets each row see (its parent, for an ancestor-or-self mask in topological
        order; ``-1`` when it sees no earlier row)."""
        if self.parent_rows is not None:
            return self.parent_rows.long()
        r = self.num_rows
        rows = torch.arange(r)
        earlier = self.local_mask.bool() & (rows[None, :] < rows[:, None])  # [R_i, R_i]
        return torch.where(earlier, rows[None, :], -1).amax(dim=1) if r else rows


def causal_segment(ids: list[int], start: int, slot: int) -> Segment:
    """A prompt chunk (or a lone ``ar`` row): rows at ``start, start+1, ...``, causal among themselves."""
    n = len(ids)
    rows = torch.arange(n)
    # rows[:, None] >= rows, not ones(n, n).tril_(): tril_ costs 4-16 ms per call on 2 CPU threads
    # (its parallel path), as much as a tenth of a short warm prefill step; the comparison ~20 us
    return Segment(torch.tensor(ids, dtype=torch.long), rows, rows[:, None] >= rows, start, slot, rows - 1)


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
        segment_kv_lengths: per segment, the KV length it reads when it is the step's only segment
            (its own ``start + R_i`` rounded up like ``L``): the runner's per-request attention
            reads exactly these columns, so a request's attention never depends on its batch mates.
            Empty for padded steps (:func:`pad_packed`), which read ``L`` columns for every segment.
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
    segment_kv_lengths: tuple[int, ...] = ()


def _kv_length(need: int, kv_bucket: int, kv_capacity: int | None) -> int:
    """``need`` columns rounded up to a multiple of ``kv_bucket``, capped at ``kv_capacity``."""
    length = -(-need // kv_bucket) * kv_bucket
    return length if kv_capacity is None else min(length, kv_capacity)


def pack_segments(segments: list[Segment], kv_bucket: int = 1, kv_capacity: int | None = None,
                  with_mask: bool = True) -> PackedRows:
    """Flatten ``segments`` into one step (see the module docstring's worked example).

    Args:
        kv_bucket: round the KV length up to a multiple of this (fewer distinct shapes), capped
            at ``kv_capacity``.
        with_mask: build ``attn_mask``; False leaves it ``[n, 1, Rm, 0]`` (empty), for steps whose
            attention builds its masks on the device (:mod:`services.verifier.tree_attention`).
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
    length = _kv_length(need, kv_bucket, kv_capacity)
    # index arithmetic on Python lists, one tensor each at the end: a decode step's pack is on the
    # critical path of every step (~50 us of small tensor ops before, ~20 us now on a 2-core CPU)
    cu = [0]
    for r in sizes:
        cu.append(cu[-1] + r)
    start_list = [s.start for s in segments]
    row_index = torch.full((n, rm), -1, dtype=torch.long)
    mask = torch.zeros(n, 1, rm, length if with_mask else 0, dtype=torch.bool)
    seg_of_row, offsets = [], []
    for i, (s, r) in enumerate(zip(segments, sizes)):
        row_index[i, :r] = torch.arange(cu[i], cu[i + 1])
        seg_of_row += [i] * r
        offsets += range(r)
        if not with_mask:
            continue
        mask[i, 0, :r, :s.start] = True
        mask[i, 0, :r, s.start:s.start + r] = s.local_mask
        if r < rm:
            mask[i, 0, r:, s.start] = True  # padding rows: one written column
    slot_t = torch.tensor(slots, dtype=torch.long)
    return PackedRows(
        input_ids=torch.cat([s.input_ids for s in segments]).long(),
        positions=torch.tensor([st + int(o) for s, st in zip(segments, start_list) for o in s.position_offsets.tolist()],
                               dtype=torch.long),
        cu_rows=torch.tensor(cu, dtype=torch.long), slots=slot_t, starts=torch.tensor(start_list, dtype=torch.long),
        row_index=row_index, padded_pos=torch.tensor([g * rm + o for g, o in zip(seg_of_row, offsets)], dtype=torch.long),
        write_slot=torch.tensor([slots[g] for g in seg_of_row], dtype=torch.long),
        write_pos=torch.tensor([start_list[g] + o for g, o in zip(seg_of_row, offsets)], dtype=torch.long),
        attn_mask=mask, kv_length=length,
        segment_kv_lengths=tuple(_kv_length(s.start + r, kv_bucket, kv_capacity) for s, r in zip(segments, sizes)))


def split_rows(x: Tensor, cu_rows: Tensor) -> list[Tensor]:
    """Split a ``[R, ...]`` per-row tensor into one ``[R_i, ...]`` view per segment."""
    bounds = cu_rows.tolist()
    return [x[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


@dataclass(frozen=True)
class StepBucket:
    """The fixed shape a padded step runs at (the key of a captured CUDA graph).

    Attributes:
        segments: ``n'`` segments (real ones, then padding segments on the scratch slot).
        rows_per_segment: ``Rm'``, the padded attention layout's row count per segment.
        rows: ``R'`` flattened rows (``<= n' * Rm'``); kv_length: ``L'`` columns read.
        logit_rows: ``K'`` rows whose logits are computed.
    """

    segments: int
    rows_per_segment: int
    rows: int
    kv_length: int
    logit_rows: int


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


ROW_STEP = 16  # row counts past one are bucketed to its multiples


def row_bucket(n: int) -> int:
    """The row count a step's ``n`` rows are padded to: 1 for one row (a plain decoding step), else
    the next multiple of :data:`ROW_STEP` (1, 16, 32, 48, 64, 80, ...): a 65-row verify (a B = 64
    tree and its root) runs 80 rows, not 128; a GPU's cost per row count is flat over such a step
    (memory bound), and a few dozen buckets cover every tree budget."""
    n = max(1, int(n))
    return 1 if n == 1 else -(-n // ROW_STEP) * ROW_STEP


def step_bucket(p: PackedRows, logit_rows: int, max_segments: int, kv_bucket: int, kv_capacity: int,
                segment_rows: int | None = None) -> StepBucket:
    """The bucket a step is padded to: the segment count rounded up to a power of two, rows per
    segment, flattened rows and logit rows to :func:`row_bucket`, the KV length to ``kv_bucket``
    times a power of two (all capped: segments at ``max_segments``, flattened rows at ``n' * Rm'``,
    logit rows at ``R'``, KV length at ``kv_capacity``). This keeps the graphs a server captures to
    a few dozen (vLLM / SGLang pad their decode batches the same way).

    ``segment_rows`` (the CUDA-graph grid's shapes, :mod:`services.verifier.graph_grid`): the rows
    per segment and the logit rows follow from the flattened rows instead, so that a bucket is fixed
    by its segments, rows and KV length: ``Rm' = R'`` for one segment, else ``min(R', segment_rows)``
    (or the widest segment's bucket when wider), and ``K' = R'``.

    Raises:
        ValueError: ``p`` has more segments than ``max_segments`` or a KV length past ``kv_capacity``.
    """
    n, rm = p.row_index.shape
    if n > max_segments:
        raise ValueError(f"a step of {n} segments exceeds the {max_segments} a bucket holds")
    if p.kv_length > kv_capacity:
        raise ValueError(f"a step reads {p.kv_length} KV columns, the cache holds {kv_capacity}")
    segs = min(_pow2_at_least(n), max_segments)
    length = min(kv_bucket * _pow2_at_least(-(-p.kv_length // kv_bucket)), kv_capacity)
    if segment_rows is not None:
        return grid_bucket(segs, row_bucket(p.input_ids.numel()), length, segment_rows, rm)
    per_seg = row_bucket(rm)
    rows = min(row_bucket(p.input_ids.numel()), segs * per_seg)
    keep = min(row_bucket(logit_rows), rows)
    return StepBucket(segs, per_seg, rows, length, keep)


def grid_bucket(segments: int, rows: int, kv_length: int, segment_rows: int, widest: int = 1) -> StepBucket:
    """The bucket of ``segments`` segments, ``rows`` flattened rows (a :func:`row_bucket`) and
    ``kv_length`` columns when buckets follow ``segment_rows`` (:func:`step_bucket`): rows per
    segment ``rows`` for one segment, else ``min(rows, segment_rows)``, widened to the ``widest``
    segment's bucket and to what holds ``rows`` in ``segments`` segments; logit rows ``rows``."""
    per_seg = rows if segments == 1 else max(min(rows, segment_rows), row_bucket(widest),
                                             row_bucket(-(-rows // segments)))
    return StepBucket(segments, per_seg, rows, kv_length, rows)


def pad_packed(p: PackedRows, bucket: StepBucket, scratch_slot: int) -> PackedRows:
    """``p`` padded to ``bucket``'s fixed shapes; the first ``R`` flattened rows (and the first ``n``
    segments) are ``p``'s, unchanged in every value their outputs depend on.

    Padding never touches a real request's KV: padding flattened rows write their K/V at column 0
    of ``scratch_slot`` (a slot no request holds; the caller zero-fills its columns up to
    ``bucket.kv_length``), padding segments read that slot, and every padding row of the attention
    layout attends to exactly one column (no empty softmax row, hence no NaN). Padding flattened rows
    fill the layout's free places in row-major order (``row_index`` / ``padded_pos`` stay inverse);
    their outputs are garbage and never read. ``cu_rows`` and ``starts`` cover the real segments only.

    Raises:
        ValueError: ``p`` does not fit ``bucket``, or ``scratch_slot`` is one of ``p``'s slots.
    """
    n, rm = p.row_index.shape
    r = p.input_ids.numel()
    b = bucket
    if n > b.segments or rm > b.rows_per_segment or r > b.rows or p.kv_length > b.kv_length \
            or b.rows > b.segments * b.rows_per_segment:
        raise ValueError(f"a step of {n} segments x {rm} rows ({r} rows, {p.kv_length} KV columns) does not fit "
                         f"{b}")
    if bool((p.slots == scratch_slot).any()):
        raise ValueError(f"the scratch slot {scratch_slot} is held by a request of the step")
    dev = p.input_ids.device
    ns, rms, length = b.segments, b.rows_per_segment, b.kv_length
    row_index = torch.full((ns, rms), -1, dtype=torch.long, device=dev)
    row_index[:n, :rm] = p.row_index
    free = (row_index.flatten() < 0).nonzero().flatten()[:b.rows - r]  # places of the padding rows
    row_index.view(-1)[free] = torch.arange(r, b.rows, device=dev)
    padded_pos = torch.empty(b.rows, dtype=torch.long, device=dev)
    seg, col = p.padded_pos // rm, p.padded_pos % rm
    padded_pos[:r] = seg * rms + col
    padded_pos[r:] = free
    mask = torch.zeros(ns, 1, rms, length if p.attn_mask.shape[-1] else 0, dtype=torch.bool, device=dev)
    if p.attn_mask.shape[-1]:  # else packed without a mask: padded_step_mask builds it on the device
        mask[:n, :, :rm, :p.kv_length] = p.attn_mask
        # new padding rows of real segments: column `start` only, like pack_segments' padding rows
        mask[torch.arange(n, device=dev)[:, None], 0, torch.arange(rm, rms, device=dev)[None, :],
             p.starts.to(dev)[:, None]] = True
        mask[n:, 0, :, 0] = True  # padding segments: column 0 of the scratch slot
    slots = torch.cat([p.slots, torch.full((ns - n,), scratch_slot, dtype=torch.long, device=dev)])
    pad = b.rows - r
    return PackedRows(
        input_ids=torch.cat([p.input_ids, torch.zeros(pad, dtype=torch.long, device=dev)]),
        positions=torch.cat([p.positions, torch.zeros(pad, dtype=torch.long, device=dev)]),
        cu_rows=p.cu_rows, slots=slots, starts=p.starts, row_index=row_index, padded_pos=padded_pos,
        write_slot=torch.cat([p.write_slot, torch.full((pad,), scratch_slot, dtype=torch.long, device=dev)]),
        write_pos=torch.cat([p.write_pos, torch.zeros(pad, dtype=torch.long, device=dev)]),
        attn_mask=mask, kv_length=length)


def padded_tree_rows(segments: list[Segment], bucket: StepBucket) -> tuple[Tensor, Tensor, Tensor]:
    """What :func:`padded_step_mask` builds a padded step's mask from (host tensors, a few bytes
    per row instead of the ``[n', 1, Rm', L']`` mask).

    Returns:
        ``(starts [n'], num_rows [n'], parent_rows [n', Rm'])`` long: each segment's start and row
        count (padding segments: 0 and 0) and its rows' segment-local parent rows
        (:meth:`Segment.parents`; ``-1`` past its rows).
    """
    ns, rms = bucket.segments, bucket.rows_per_segment
    starts = torch.zeros(ns, dtype=torch.long)
    num_rows = torch.zeros(ns, dtype=torch.long)
    parents = torch.full((ns, rms), -1, dtype=torch.long)
    for i, seg in enumerate(segments):
        starts[i], num_rows[i] = seg.start, seg.num_rows
        parents[i, :seg.num_rows] = seg.parents()
    return starts, num_rows, parents


def padded_step_mask(starts: Tensor, num_rows: Tensor, parent_rows: Tensor, kv_length: int) -> Tensor:
    """A padded step's attention mask, built on the tensors' device with static shapes (no host
    read: a CUDA graph captures it), equal to :func:`pad_packed`'s host-built ``attn_mask`` for
    segments whose ``local_mask`` is the ancestor-or-self mask of their parent rows (trees from
    :func:`~services.tree.draft_tree.derive_buffers`, prompt chunks, lone rows).

    A segment's row ``j < num_rows`` sees the columns before its start and, of its own columns
    ``start + k``, its ancestors-or-self ``k`` (:func:`~services.tree.tree_mask.tree_mask_from_parents`);
    every other row of the layout (padding) sees column ``start`` alone.

    Args:
        starts, num_rows: ``[n']`` long; parent_rows: ``[n', Rm']`` long (:func:`padded_tree_rows`).
        kv_length: ``L'`` columns.
    Returns:
        ``[n', 1, Rm', L']`` bool.
    """
    ns, rms = parent_rows.shape
    dev = parent_rows.device
    tree = tree_mask_from_parents(parent_rows)  # [n', Rm', Rm']
    cols = torch.arange(kv_length, device=dev)
    rel = cols[None, :] - starts[:, None]  # [n', L'] column relative to each segment's start
    own = tree.gather(2, rel.clamp(0, rms - 1)[:, None, :].expand(ns, rms, kv_length))  # [n', Rm', L']
    own = own & ((rel >= 0) & (rel < rms))[:, None, :]
    real = (rel < 0)[:, None, :] | own
    valid = torch.arange(rms, device=dev)[None, :] < num_rows[:, None]  # [n', Rm']
    return torch.where(valid[..., None], real, (rel == 0)[:, None, :])[:, None]
