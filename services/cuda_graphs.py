"""CUDA-graph capture of fixed-shape steps (verify / draft buckets), with an eager fallback.

A step whose shapes are fixed by a *bucket* (rows padded to a bucket size, KV length rounded up to
``kv_bucket``, requests padded to a slot count) launches the same kernels every time; on a GPU the
eager launches of a 30-layer model cost more than the small kernels themselves. Capturing the step
once per bucket in a ``torch.cuda.CUDAGraph`` and replaying it turns hundreds of launches into one
(gpt-fast's ``reduce-overhead``, vLLM's and SGLang's CUDA-graph runners). This module only uses
torch's public graph API; it writes no kernels.

Rules a captured callable must follow (PyTorch's, restated):

- Its tensor inputs are the graph's *static inputs*: every call copies new values into them, so
  shapes, dtypes and devices never change within a bucket (checked on every call, one-line error).
- No host synchronisation inside (no ``.item()``, ``.tolist()``, ``.cpu()``, printing tensors), no
  data-dependent shapes, no CPU tensors created inside: prepare those before the call.
- In-place writes into tensors that live outside the call (a KV cache) are replayed as written:
  the cache must be pre-allocated and stay at the same address (``SlotKVCache`` does).
- Warm-up and capture *execute* the callable on the example inputs (warm-up really runs, and
  in-place writes land), so capture with inputs that write where nothing is read yet (a free slot,
  positions past every committed length).
- The returned tensors are the graph's static outputs: the next replay of the same graph
  overwrites them; clone what must outlive it.

Off CUDA (CPU tensors, or ``enabled=False`` / ``DARTREE_CUDA_GRAPHS=0``) every class here calls the
callable eagerly with the same signature, so callers have one code path and a switch back (docs/design.md "Reference and switch").

Used by :class:`services.verifier.runner.ModelRunner` (``cuda_graphs``; on by ``compile`` on a CUDA
target): a step is keyed by its :class:`~services.tree.batch.StepBucket` (segments, rows per segment,
rows, KV length, logit rows; row counts by :func:`~services.tree.batch.row_bucket`), its :class:`~services.tree.batch.PackedRows` padded to
the key (:func:`~services.tree.batch.pad_packed`: padding rows write to a scratch slot), the key's
callable runs the target's eager forward with the padded step metadata as tensor inputs, and the
runner slices the real rows out of the static outputs (a grid of buckets captured at start:
:mod:`services.verifier.graph_grid`). The drafter's block forward is captured the same way, keyed by
batch, block rows and context length (:mod:`services.drafter.graphed_block`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

Outputs = Tensor | tuple[Tensor, ...]


def graphs_enabled(default: bool = True) -> bool:
    """Whether CUDA graphs may be used: a CUDA device is present and ``DARTREE_CUDA_GRAPHS`` is not 0."""
    return default and os.environ.get("DARTREE_CUDA_GRAPHS", "1") != "0" and torch.cuda.is_available()


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket ``>= n`` (``buckets`` ascending or not).

    Raises:
        ValueError: ``n`` exceeds every bucket, or ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"bucket size must be >= 1 (got {n})")
    fit = [b for b in buckets if b >= n]
    if not fit:
        raise ValueError(f"{n} exceeds the largest bucket {max(buckets)}")
    return min(fit)


def kv_lengths(kv_bucket: int, capacity: int) -> tuple[int, ...]:
    """The KV lengths a step reads: ``kv_bucket`` times a power of two, the last capped at ``capacity``.

    Raises:
        ValueError: ``kv_bucket`` or ``capacity`` below 1.
    """
    if kv_bucket < 1 or capacity < 1:
        raise ValueError(f"kv_bucket and capacity must be >= 1 (got {kv_bucket}, {capacity})")
    out, length = [], kv_bucket
    while length < capacity:
        out.append(length)
        length *= 2
    return tuple(out) + (capacity,)


def segment_counts(max_segments: int) -> tuple[int, ...]:
    """The segment counts of padded steps: powers of two below ``max_segments``, then ``max_segments``."""
    out, n = [], 1
    while n < max_segments:
        out.append(n)
        n *= 2
    return tuple(out) + (max_segments,)


def _sig(t: Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.device


class GraphedStep:
    """``fn(*inputs)`` captured once in a CUDA graph for the shapes of ``example_inputs``.

    Args:
        fn: ``fn(*tensors) -> Tensor | tuple[Tensor, ...]``, capturable (see the module docstring).
        example_inputs: tensors fixing each input's shape / dtype / device; copied into the static
            input buffers (so the caller keeps its own tensors).
        warmup: eager calls on a side stream before capture (cuBLAS handles, lazy init).
        pool: a memory pool shared with other graphs of the same runner
            (``torch.cuda.graph_pool_handle()``); graphs sharing a pool must be replayed one at a time.
        enabled: False forces eager calls (also the case off CUDA).
        share_inputs: the example inputs ARE the static inputs (no copies kept): the caller writes
            each call's values into them (views of buffers shared by several graphs) and calls with
            the same tensors.
    Attributes:
        captured: True when calls replay a graph, False when they run ``fn`` eagerly.
    Raises:
        ValueError: no example inputs, inputs on different devices, or ``fn`` returned something
            other than a tensor or a tuple of tensors.
        RuntimeError: the capture failed (torch's message: an op that synchronises or is not capturable).
    """

    def __init__(self, fn: Callable[..., Outputs], example_inputs: Sequence[Tensor], warmup: int = 2,
                 pool=None, enabled: bool = True, share_inputs: bool = False):
        if not example_inputs:
            raise ValueError("GraphedStep needs at least one example input tensor")
        devices = {t.device for t in example_inputs}
        if len(devices) != 1:
            raise ValueError(f"all inputs of a graphed step must be on one device (got {sorted(map(str, devices))})")
        self.fn = fn
        self.signature = [_sig(t) for t in example_inputs]
        self.device = devices.pop()
        self.captured = enabled and self.device.type == "cuda" and graphs_enabled()
        self.graph: torch.cuda.CUDAGraph | None = None
        if self.captured:
            self.static_inputs = [t if share_inputs else t.detach().clone() for t in example_inputs]
            self._capture(warmup, pool)

    def _capture(self, warmup: int, pool) -> None:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.fn(*self.static_inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a drafter thread's CUDA work elsewhere in the process does not break the capture
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            out = self.fn(*self.static_inputs)
        self._tuple = isinstance(out, tuple)
        outs = out if self._tuple else (out,)
        if not all(isinstance(o, Tensor) for o in outs):
            raise ValueError("a graphed step must return a tensor or a tuple of tensors")
        self.static_outputs = outs

    def check(self, inputs: Sequence[Tensor]) -> None:
        """Raises ValueError (one line) when ``inputs`` do not match the captured signature."""
        if len(inputs) != len(self.signature):
            raise ValueError(f"graphed step takes {len(self.signature)} inputs (got {len(inputs)})")
        for i, (t, sig) in enumerate(zip(inputs, self.signature)):
            if _sig(t) != sig:
                raise ValueError(f"input {i}: {tuple(t.shape)} {t.dtype} on {t.device} does not match the captured "
                                 f"{sig[0]} {sig[1]} on {sig[2]} (pad to the bucket)")

    def __call__(self, *inputs: Tensor) -> Outputs:
        """Replay (or run eagerly) on ``inputs``; see the class docstring for the output lifetime."""
        self.check(inputs)
        if not self.captured:
            return self.fn(*inputs)
        for dst, src in zip(self.static_inputs, inputs):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.static_outputs if self._tuple else self.static_outputs[0]


class GraphBuckets:
    """One :class:`GraphedStep` per bucket key, all sharing one memory pool.

    Two ways to fill it: ``lazy`` (a key is captured on its first use, up to ``max_graphs``), or
    up front (``lazy=False``: :meth:`capture` each key at start; a key never captured runs its
    callable eagerly, uncaptured, and is counted in :attr:`num_eager_overflow`). Capture the widest
    shapes first: a later capture reuses what the earlier ones freed in the shared pool.

    Args:
        make_fn: ``make_fn(key) -> fn`` the callable of a bucket (e.g. the runner's forward with the
            bucket's static step metadata bound), called once per key (and per eager call of a key
            that is not captured).
        enabled: False (or no CUDA) runs every bucket eagerly through the same interface.
        warmup: see :class:`GraphedStep`; max_graphs: lazy captures kept at most.
        overflow: what a new key beyond ``max_graphs`` does when ``lazy``: ``"raise"`` (ValueError)
            or ``"eager"`` (its callable runs eagerly, uncaptured, every time: slower, same results).
        lazy: capture keys on first use (True) or only by :meth:`capture` (False).
        share_inputs: see :class:`GraphedStep` (every key's inputs are views the caller fills).
    Raises (from :meth:`run`):
        ValueError: a new key beyond ``max_graphs`` with ``overflow="raise"``, or inputs not matching
            the key's capture.
    """

    def __init__(self, make_fn: Callable[[Hashable], Callable[..., Outputs]], enabled: bool = True,
                 warmup: int = 2, max_graphs: int = 64, overflow: str = "raise", lazy: bool = True,
                 share_inputs: bool = False):
        if overflow not in ("raise", "eager"):
            raise ValueError(f"overflow must be 'raise' or 'eager' (got {overflow!r})")
        self.make_fn, self.warmup, self.max_graphs, self.overflow = make_fn, warmup, max_graphs, overflow
        self.lazy, self.share_inputs = lazy, share_inputs
        self.num_eager_overflow = 0  # calls run eagerly: past every graph place (lazy) or never captured
        self.enabled = enabled and graphs_enabled()
        self.steps: dict[Hashable, GraphedStep] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None

    def capture(self, key: Hashable, *inputs: Tensor) -> GraphedStep:
        """Capture ``key``'s step from ``inputs`` now (runs it ``warmup + 1`` times on CUDA; off CUDA
        or disabled it only records the key: its calls run eagerly, uncounted). A key captured
        already is kept as it is."""
        step = self.steps.get(key)
        if step is None:
            step = GraphedStep(self.make_fn(key), inputs, self.warmup, self.pool,
                               enabled=self.enabled and inputs[0].device.type == "cuda", share_inputs=self.share_inputs)
            self.steps[key] = step
        return step

    def run(self, key: Hashable, *inputs: Tensor) -> Outputs:
        """The bucket ``key``'s step on ``inputs`` (lazy: captured from these inputs on the key's first call)."""
        step = self.steps.get(key)
        if step is None:
            if not self.lazy:
                self.num_eager_overflow += 1
                return self.make_fn(key)(*inputs)
            if len(self.steps) >= self.max_graphs:
                if self.overflow == "eager":
                    self.num_eager_overflow += 1
                    return self.make_fn(key)(*inputs)
                raise ValueError(f"more than {self.max_graphs} graph buckets requested (key {key!r}); "
                                 "coarsen the buckets")
            step = self.capture(key, *inputs)
        return step(*inputs)

    def num_captured(self) -> int:
        """Buckets that replay a CUDA graph (0 on CPU)."""
        return sum(1 for s in self.steps.values() if s.captured)
