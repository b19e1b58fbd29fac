"""The model runner: ONE target forward for every request of a step, over a :class:`SlotKVCache`.

vLLM's / SGLang's *model runner*. The rows of all requests (verify trees, ``ar`` rows, prompt
chunks; :mod:`services.tree.batch`) run flattened through the HF model's own modules, so its
embeddings, norms, rotary embeddings, q/k norms and MLPs stay the reference (llama, qwen2, qwen3
alike); only attention is ours, registered with transformers' ``AttentionInterface``
(:func:`services.hf_compat.register_slot_attention`): it writes the step's K/V rows into their
slots, reads each request's slot up to the step's (bucketed) KV length, and runs
``F.scaled_dot_product_attention`` on a padded ``[n, Hq, R_max, Dh]`` view with per-request masks.
A step of one request skips the row gather and scatter: SDPA on the HF query as is (same KV
length and mask, so the same sums as the padded path).
Attention work therefore scales with the longest context *in the step* (rounded up to
``kv_bucket``), never with the configured capacity. A forward without step metadata (the HF
reference paths of :class:`TargetModel`) falls through to transformers' SDPA.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from services import hf_compat
from services.cuda_graphs import GraphBuckets, graphs_enabled
from services.tree.batch import PackedRows, Segment, StepBucket, causal_segment, pack_segments, pad_packed, step_bucket
from services.verifier.kv_cache import SlotKVCache

_ACTIVE = threading.local()  # the step being run by this thread's forward (None outside a step)


@dataclass(frozen=True)
class StepOutput:
    """What one batched forward produced.

    Attributes:
        logits: ``[K, V]`` float32, one row per entry of the ``logit_rows`` asked for.
        features: ``[R, F]`` tapped target features of every flattened row.
        packed: the step's row layout (``cu_rows`` splits ``features``).
        seconds: wall time of the forward (on CUDA up to a device synchronisation: the goodput
            policy's cost model needs the device time, and the caller reads the logits right after).
    """

    logits: Tensor
    features: Tensor
    packed: PackedRows
    seconds: float


def _slot_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """Attention of one layer over the slot cache (see the module docstring); shapes as HF's SDPA.

    Under ``torch.compile`` (``ModelRunner(compile=True)``; only steps run compiled) it is the opaque
    custom op ``dartree::slot_attention``, whose eager body is this function: the compiler sees a
    pure ``[1, Hq, R, Dh] x 3 -> [1, R, Hq, Dh]`` op and the slot writes stay out of its graph."""
    if torch.compiler.is_compiling():
        scaling = kwargs.get("scaling")
        return torch.ops.dartree.slot_attention(query, key, value, module.dartree_layer,
                                                float(scaling if scaling is not None else module.scaling)), None
    return _slot_attention_eager(module.layer_idx, query, key, value, attention_mask, module, **kwargs)


def _slot_attention_eager(layer: int, query: Tensor, key: Tensor, value: Tensor, attention_mask, module=None,
                          **kwargs):
    step = getattr(_ACTIVE, "step", None)
    if step is None:
        return hf_compat.sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    cache, p, single, fixed = step
    cache.write(layer, p.write_slot, p.write_pos, key[0].transpose(0, 1), value[0].transpose(0, 1))
    if single is not None:  # one request: its rows in order, no gather / scatter
        length, mask = single
        k, v = cache.read(layer, p.slots, length)  # [1, Hkv, L, Dh]
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=kwargs.get("scaling"),
                                             enable_gqa=k.shape[1] != query.shape[1])
        return out.transpose(1, 2), None
    k, v = cache.read(layer, p.slots, p.kv_length, gather=fixed)  # [n, Hkv, L, Dh]
    safe = p.row_index.clamp(min=0)
    q = query[0].transpose(0, 1)[safe].transpose(1, 2)  # [n, Hq, Rm, Dh]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=p.attn_mask, scale=kwargs.get("scaling"),
                                         enable_gqa=k.shape[1] != q.shape[1])
    out = out.transpose(1, 2).flatten(0, 1)[p.padded_pos]  # [R, Hq, Dh], flattened row order
    return out[None], None


@torch.library.custom_op("dartree::slot_attention", mutates_args=())
def _slot_attention_op(query: Tensor, key: Tensor, value: Tensor, layer: Tensor, scaling: float) -> Tensor:
    """The slot attention of the active step as one opaque op (for compiled steps; writes the step's
    K/V into the slot cache as a side effect the compiler does not see: each call's output is used,
    so it runs exactly once per layer, in order). ``layer``: the layer index as a 0-d int64 tensor
    (the attention module's ``dartree_layer`` buffer), an input of the compiled layer rather than a
    constant baked into it, so one compiled layer serves every layer."""
    return _slot_attention_eager(int(layer), query, key, value, None, scaling=scaling)[0].contiguous()


@_slot_attention_op.register_fake
def _(query, key, value, layer, scaling):
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def _step_guards(entries) -> list[bool]:
    """torch.compile ``guard_filter_fn`` of the compiled steps: keep every guard but those on the
    model's parameters and module attributes. The model is frozen once the runner exists (packs are
    made before it, or added inside modules whose opaque op picks them at run time), so those guards
    can only pass, and checking them cost 1.7 ms of a ~25 ms q4 step (0.2 ms without them; ad-hoc
    torch.profiler run, 2026-12-01, one thread, data generation and training running on the other core). Guards on the inputs (row counts, the graphs' 0/1
    specialisations) and on global state stay."""
    return [not ((e.guard_type == "TENSOR_MATCH" and isinstance(e.value, torch.nn.Parameter))
                 or e.orig_guard.source.is_unspecialized_nn_module()) for e in entries]


class ModelRunner:
    """Runs batched steps of a :class:`TargetModel` over a slot KV cache.

    Args:
        target: the target (its HF model switches to the slot attention, which falls back to SDPA
            outside a step, so :meth:`TargetModel.verify` / ``prefill`` keep working).
        num_slots: KV slots (concurrent requests); capacity: columns per slot.
        kv_bucket: the KV length a step reads is rounded up to a multiple of this.
        compile: run steps through ``torch.compile`` (inductor; CPU or CUDA) with each decoder
            layer a nested compile region (:func:`services.hf_compat.mark_layers_as_compile_regions`:
            one layer is traced and compiled, the others reuse it): a static graph for one-row steps,
            one with a dynamic row count for every other step (rows marked dynamic, KV length inside
            the opaque slot-attention op), and one more when only some rows need logits. Call
            :meth:`warm_up` at start (tens of seconds on a 2-core CPU; inductor caches its kernels on
            disk, so later starts are faster). The reference paths of :class:`TargetModel` stay eager.
            On a CUDA target ``compile`` means CUDA graphs instead (``cuda_graphs`` below).
        cuda_graphs: run every step *padded to a bucket* (:func:`~services.tree.batch.step_bucket`:
            segments, rows per segment, rows, logit rows and KV length rounded up to powers of two)
            through :class:`services.cuda_graphs.GraphBuckets`: on CUDA each bucket's eager forward
            is captured once in a CUDA graph and replayed (no host sync inside a step: attention
            gathers the slots, masks are built before the call); off CUDA (or with
            ``DARTREE_CUDA_GRAPHS=0``) the same padded step runs eagerly, which is how the padding
            is tested on CPU. Padding rows write to a scratch slot the cache holds in addition to
            ``num_slots`` (:func:`~services.tree.batch.pad_packed`). None: on when ``compile`` and
            the target is on CUDA.
    Raises:
        MemoryError: the cache does not fit (one line, with its size).
        ValueError: ``compile`` and ``cuda_graphs`` both set on a CPU target.
    """

    def __init__(self, target, num_slots: int, capacity: int, kv_bucket: int = 64, compile: bool = False,
                 cuda_graphs: bool | None = None):
        self.target = target
        on_cuda = torch.device(target.device).type == "cuda"
        if compile and cuda_graphs and not on_cuda:
            raise ValueError("compile and cuda_graphs exclude each other off CUDA (inductor steps, or padded eager "
                             "steps that test the CUDA-graph path): pick one")
        self.graphed = bool(compile and on_cuda) if cuda_graphs is None else bool(cuda_graphs)
        self.cache = SlotKVCache.for_model(target.config, num_slots + int(self.graphed), capacity, target.dtype,
                                           target.device)
        self.kv_bucket = kv_bucket
        name = hf_compat.register_slot_attention(_slot_attention)
        hf_compat.set_attention_implementation(target.model, name)
        self.compiled = bool(compile) and not self.graphed
        self.warm_up_seconds = 0.0  # all :meth:`warm_up` calls so far (the compile time when compiled)
        self._forward = target.model
        self.graphs: GraphBuckets | None = None
        if self.graphed:
            self.scratch_slot = num_slots  # the cache's last slot; slots 0 .. num_slots - 1 serve requests
            self.cache.reserve(self.scratch_slot)
            self.graphs = GraphBuckets(self._make_step, enabled=on_cuda and graphs_enabled(), max_graphs=96,
                                       overflow="eager")
        if self.compiled:
            for layer in hf_compat.decoder_layers(target.model):
                attn = layer.self_attn
                if "dartree_layer" not in attn._buffers:
                    attn.register_buffer("dartree_layer", torch.tensor(int(attn.layer_idx)), persistent=False)
            hf_compat.mark_layers_as_compile_regions(target.model)
            self._forward = torch.compile(target.model, options={"guard_filter_fn": _step_guards})

    @torch.inference_mode()
    def warm_up(self, rows: tuple[int, ...] = (1, 9)) -> float:
        """Run one step of each row count on a scratch slot, with logits for every row and, for more
        than one row, for the last row only (a prompt chunk): compiles every graph when compiled.

        Returns seconds taken. Raises RuntimeError (:meth:`SlotKVCache.alloc`) when no slot is free
        (call it before serving).
        """
        t0 = time.perf_counter()
        slot = self.cache.alloc()
        try:
            for n in rows:
                self.execute([causal_segment([1] * n, 0, slot)])
                if n > 1:
                    self.execute([causal_segment([1] * n, 0, slot)], torch.tensor([n - 1]))
        finally:
            self.cache.free(slot)
        took = time.perf_counter() - t0
        self.warm_up_seconds += took
        return took

    @torch.inference_mode()
    def execute(self, segments: list[Segment], logit_rows: Tensor | None = None) -> StepOutput:
        """One forward for all ``segments`` (distinct slots; each written from its ``start``).

        Args:
            logit_rows: ``[K]`` flattened rows whose logits are needed (None = every row).
        Returns:
            :class:`StepOutput`. Slot lengths are unchanged: the caller commits
            (:meth:`SlotKVCache.commit` / :meth:`SlotKVCache.extend`).
        Raises:
            ValueError: from :func:`pack_segments` (bad segments, rows past the capacity).
        """
        p = pack_segments(segments, self.kv_bucket, self.cache.capacity)
        if self.graphed:
            return self._execute_padded(p, logit_rows)
        self.cache.prepare(p.slots.tolist(), p.kv_length)
        dev = self.target.device
        p = _to(p, dev)
        keep = logit_rows.to(dev) if logit_rows is not None else torch.arange(p.input_ids.numel(), device=dev)
        if self.compiled and not keep.is_inference():  # its dispatch keys would fail a guard: recompile
            keep = keep.clone()
        # one segment (a lone request): no gather / scatter of rows. Same KV length and mask as the
        # padded path (an exact length would change SDPA's bf16 sums: plain rounds vs verify rows)
        single = (p.kv_length, p.attn_mask) if p.row_index.shape[0] == 1 else None
        ids, pos = p.input_ids[None], p.positions[None]
        if self.compiled and ids.shape[1] > 1:  # one graph for every row count > 1 (1 row: its own)
            for t, dim in ((ids, 1), (pos, 1), (keep, 0)):
                torch._dynamo.maybe_mark_dynamic(t, dim)
        t0 = time.perf_counter()
        _ACTIVE.step = (self.cache, p, single, False)
        try:
            out = self._forward(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False,
                                logits_to_keep=keep)
        finally:
            _ACTIVE.step = None
        feats = self.target._features()
        return StepOutput(out.logits[0].float(), feats, p, _elapsed(t0, dev))

    def _execute_padded(self, p: PackedRows, logit_rows: Tensor | None) -> StepOutput:
        """:meth:`execute` at the step's bucket: pad, run (replay) the bucket's step, slice the real rows."""
        r = p.input_ids.numel()
        k = r if logit_rows is None else int(logit_rows.numel())
        bucket = step_bucket(p, k, self.scratch_slot, self.kv_bucket, self.cache.capacity)  # = request slots
        padded = pad_packed(p, bucket, self.scratch_slot)
        self.cache.prepare(sorted(set(padded.slots.tolist())), bucket.kv_length)
        keep = torch.zeros(bucket.logit_rows, dtype=torch.long)
        keep[:k] = torch.arange(k) if logit_rows is None else logit_rows.long().cpu()
        dev = self.target.device
        t0 = time.perf_counter()
        logits, feats = self.graphs.run(bucket, *(t.to(dev) for t in (
            padded.input_ids[None], padded.positions[None], padded.write_slot, padded.write_pos, padded.slots,
            padded.row_index, padded.padded_pos, padded.attn_mask, keep)))
        # a replay's outputs are the graph's static buffers: the next replay overwrites them
        logits, feats = logits[:k].clone(), feats[:r].clone()
        return StepOutput(logits, feats, _to(p, dev), _elapsed(t0, dev))

    def _make_step(self, bucket: StepBucket):
        """The callable of one bucket (captured by :class:`GraphBuckets`): tensors in, ``(logits [K', V]
        float32, features [R', F])`` out; every shape fixed by ``bucket``, no host sync inside."""

        def step(ids, pos, write_slot, write_pos, slots, row_index, padded_pos, attn_mask, keep):
            none = ids.new_zeros(0)
            p = PackedRows(input_ids=ids[0], positions=pos[0], cu_rows=none, slots=slots, starts=none,
                           row_index=row_index, padded_pos=padded_pos, write_slot=write_slot, write_pos=write_pos,
                           attn_mask=attn_mask, kv_length=bucket.kv_length)
            _ACTIVE.step = (self.cache, p, None, True)
            try:
                with hf_compat.attention_without_mask(self.target.model):
                    out = self.target.model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False,
                                            logits_to_keep=keep)
            finally:
                _ACTIVE.step = None
            return out.logits[0].float(), self.target._features()

        return step


def _elapsed(t0: float, dev) -> float:
    """Seconds since ``t0``, after the device's queued work (CUDA: launches are asynchronous)."""
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def _to(p: PackedRows, dev) -> PackedRows:
    """``p`` with its tensors on ``dev``."""
    return PackedRows(**{f: (getattr(p, f).to(dev) if isinstance(getattr(p, f), Tensor) else getattr(p, f))
                         for f in PackedRows.__dataclass_fields__})
