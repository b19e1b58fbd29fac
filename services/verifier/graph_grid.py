"""The CUDA-graph grid of the verify step: which padded step shapes a CUDA target captures at start.

A padded step (:meth:`services.verifier.runner.ModelRunner.execute` with ``cuda_graphs``) runs at a
:class:`~services.tree.batch.StepBucket`. With the grid's bucketing
(:func:`~services.tree.batch.step_bucket` with ``segment_rows``) a bucket is fixed by three numbers:

- rows ``R'``: the step's flattened rows by :func:`~services.tree.batch.row_bucket` (1, 16, 32, ...),
  up to the widest step the engine runs: ``max_running x (B + 1)`` rows bounded by
  ``--max-step-tokens`` (B: the largest tree a request verifies);
- KV length ``L'``: the step's longest context rounded up to ``kv_bucket`` times a power of two
  (64, 128, 256, ... at the default ``--kv-bucket 64``), capped at the slot capacity;
- segments ``n'``: requests in the step, rounded up to a power of two, capped at ``max_running``.

Rows per segment and logit rows follow from them (:func:`~services.tree.batch.grid_bucket`; a
segment holds at most ``segment_rows`` rows, the bucket of ``B + 1``, unless it is alone). Only the
combinations a step can reach are in the grid: ``n'`` segments hold more requests than ``n'/2``,
each of at least one and at most ``segment_rows`` rows. A step outside the grid (a prompt chunk
beside other requests, a tree wider than ``B + 1``, more rows than the widest step) runs the same
padded step eagerly and is counted (``dartree_graph_eager_steps_total``). When the grid holds more
than ``max_graphs`` buckets its widest rows are left out first (those steps are the least
launch-bound), and the start-up log says which.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.cuda_graphs import kv_lengths, segment_counts
from services.tree.batch import StepBucket, grid_bucket, row_bucket

DEFAULT_MAX_GRAPHS = 256  # captures at most (each a few tens of ms at start on a GPU; memory is one shared pool)


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """Every :func:`~services.tree.batch.row_bucket` up to the one of ``max_rows``: ``(1, 16, 32, ...)``."""
    top = row_bucket(max_rows)
    return (1,) + tuple(range(16, top + 1, 16))


@dataclass(frozen=True)
class GraphGrid:
    """The buckets a runner captures at start.

    Attributes:
        buckets: the captured shapes, in capture order (widest first: later, smaller captures reuse
            the shared pool's memory).
        segment_rows: rows a segment holds in a multi-segment bucket (the bucket of ``B + 1``).
        rows: the row buckets kept; kv_lengths: the KV lengths; segments: the segment counts.
        dropped_rows: row buckets left out to stay within ``max_graphs``.
    """

    buckets: tuple[StepBucket, ...]
    segment_rows: int
    rows: tuple[int, ...]
    kv_lengths: tuple[int, ...]
    segments: tuple[int, ...]
    dropped_rows: tuple[int, ...] = ()

    def __contains__(self, bucket: StepBucket) -> bool:
        return bucket in set(self.buckets)

    def describe(self) -> str:
        """One line for the start-up log: how many graphs and over which shapes."""
        rows = f"rows {self.rows[0]}..{self.rows[-1]} by 16" if len(self.rows) > 1 else f"rows {self.rows[0]}"
        text = (f"{len(self.buckets)} graphs: {rows} x KV lengths {','.join(map(str, self.kv_lengths))} x "
                f"segments {','.join(map(str, self.segments))} (up to {self.segment_rows} rows a segment)")
        if self.dropped_rows:
            text += f"; rows {self.dropped_rows[0]}..{self.dropped_rows[-1]} left out (graph limit), run eager"
        return text


def _reachable(segments: tuple[int, ...], rows: tuple[int, ...], segment_rows: int) -> list[tuple[int, int]]:
    """``(n', R')`` pairs a step can reach: more than the previous count's requests, each of 1 to
    ``segment_rows`` rows (one segment alone: up to ``segment_rows`` rows)."""
    pairs, prev = [], 0
    for n in segments:
        lo, hi = row_bucket(prev + 1), row_bucket(n * segment_rows)
        pairs += [(n, r) for r in rows if lo <= r <= hi]
        prev = n
    return pairs


def verify_grid(max_segments: int, max_rows: int, segment_rows: int, kv_bucket: int, capacity: int,
                max_graphs: int = DEFAULT_MAX_GRAPHS) -> GraphGrid:
    """The grid of a runner with ``max_segments`` request slots whose widest step has ``max_rows``
    rows, each request at most ``segment_rows`` rows (``B + 1``), over slots of ``capacity`` columns
    read in multiples of ``kv_bucket``; at most ``max_graphs`` buckets (widest rows dropped first).

    Raises:
        ValueError: a limit below 1.
    """
    for name, v in (("max_segments", max_segments), ("max_rows", max_rows), ("segment_rows", segment_rows),
                    ("max_graphs", max_graphs)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1 (got {v})")
    seg_rows = row_bucket(segment_rows)
    rows, lengths, segs = row_buckets(max_rows), kv_lengths(kv_bucket, capacity), segment_counts(max_segments)
    pairs = _reachable(segs, rows, seg_rows)
    dropped = []
    while len(pairs) * len(lengths) > max_graphs and len(rows) > 1:
        dropped.insert(0, rows[-1])
        rows = rows[:-1]
        pairs = [(n, r) for n, r in pairs if r <= rows[-1]]
    if len(pairs) * len(lengths) > max_graphs:  # one row bucket left: the shortest KV lengths first
        lengths = lengths[:max(1, max_graphs // max(1, len(pairs)))]
    buckets = [grid_bucket(n, r, length, seg_rows) for length in reversed(lengths) for n, r in reversed(pairs)]
    return GraphGrid(tuple(buckets[:max_graphs]), seg_rows, rows, lengths, segs, tuple(dropped))
