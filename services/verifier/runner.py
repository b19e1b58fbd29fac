"""The model runner: ONE target forward for every request of a step, over a :class:`SlotKVCache`.

vLLM's / SGLang's *model runner*. The rows of all requests (verify trees, ``ar`` rows, prompt
chunks; :mod:`services.tree.batch`) run flattened through the HF model's own modules, so its
embeddings, norms, rotary embeddings, q/k norms and MLPs stay the reference (llama, qwen2, qwen3
alike); a Llama target's eager steps run the same computation, bit for bit, with fewer calls
(:mod:`services.verifier.lean_step`); only attention is ours (:mod:`services.verifier.slot_attention`:
once per request, on that request's rows against its slot read up to its own (bucketed) KV length,
with its own mask). Attention work therefore scales with each request's own context (rounded up to
``kv_bucket``), never with the configured capacity. This module lays a step out, sets it active for
the slot attention and runs the forward: eager, lean, compiled (its compile guards and private
frames) or padded through CUDA graphs.

Batch invariance (a request's logits do not depend on who shares its step). SDPA's CPU kernel
blocks its GEMMs by the query rows and the KV length of the call, so one padded
``[n, Hq, R_max, L]`` call for the whole step (``R_max`` the widest segment, ``L`` the longest
context) gave a request's rows other sums than its solo call (SmolLM2 in bfloat16: first
differences ~6e-5 at layer 2 of a 9-row step, a different greedy token at token 17 of an ``ar``
request beside two speculating ones). Per-request calls remove that by construction, in every
format. The other per-row ops (embedding, RMSNorm, rotary, SiLU, residual adds) compute each row
alone. What remains is the linears, which run on all ``R`` flattened rows at once, so whether a
row depends on ``R`` is the GEMM kernel's property (measured at 1 and 2 threads):

- ``q4`` (torch's int4 kernel, plus the int8-row lm_head of :class:`services.int8_head.Int8RowLinear`):
  every row bitwise equal to its 1-row result for ``R`` = 1..33 on SmolLM2-135M's shapes (on an
  AVX2-only AMD EPYC; the int8 lm_head for 1..9, 16, 17, 33, 64 and 80 rows on the AVX-512 VM).
- ``bfloat16`` (oneDNN-packed, :mod:`services.cpu_gemm`): the same for every SmolLM2 shape but the
  ``576 x 1536`` down projection, whose rows change in their last bits from ``R`` ~ 10-20 on that
  CPU (oneDNN picks its blocking per row count; its unpacked ``F.linear`` from ``R`` = 3). So on
  such a CPU a bfloat16 request is bitwise batch invariant only in steps of up to ~10 rows, else to
  bfloat16 rounding of that projection. ``pack_linears_bf16``'s load-time check samples a few rows
  per row count and may not notice.
- ``float32`` (MKL ``sgemm``, packed or not): rows change in their last bits with ``R`` (every
  ``R`` >= 2 differs from ``R`` = 1), so batched equals solo to float32 rounding (~1e-6 in the
  logits), not bitwise; with row-invariant linears the rest of the step is bitwise invariant
  (tests/engine/test_batch_invariance.py).
- Attention: the grouped attention's rows are bitwise independent of the rows beside them and of
  masked KV columns, so in q4 / bfloat16 a verify's rows equal the rows of plain decoding; SDPA
  (float32, or switched off) changes a row's last bits with the row count.
- Padded steps (``cuda_graphs``) run one padded attention call at the bucket's shape (a CUDA graph
  needs fixed shapes), and cuBLAS picks GEMM kernels per shape: no bitwise guarantee there, only
  equality to rounding.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass

import torch
from torch import Tensor

from services import hf_compat
from services.tree.batch import PackedRows, Segment, causal_segment, pack_segments
from services.verifier.attention import use_grouped
from services import native_lib as native
from services.verifier.graph_grid import DEFAULT_MAX_GRAPHS, verify_grid
from services.verifier.kv_cache import SlotKVCache
from services.verifier.padded_step import PaddedSteps
from services.verifier.swap_in import CompiledSwapIn
from services.verifier.lean_step import LeanLlamaStep, lean_step_enabled
from services.verifier.slot_attention import (ACTIVE, compiled_lean_attention, lean_attention, native_aten_lean_attention,
                                              native_lean_attention, native_step, request_parts, slot_attention)
from services.verifier.tree_attention import segment_parts, tree_attention_on


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


def _step_guards(entries) -> list[bool]:
    """torch.compile ``guard_filter_fn`` of the compiled steps: keep every guard but those on the
    model's parameters and module attributes. The model is frozen once the runner exists (packs are
    made before it, or added inside modules whose opaque op picks them at run time), so those guards
    can only pass, and checking them cost 1.7 ms of a ~25 ms q4 step (0.2 ms without them; ad-hoc
    torch.profiler run of 32 ar steps at one thread). Guards on the inputs (row counts, the graphs' 0/1
    specialisations) and on global state stay."""
    return [not ((e.guard_type == "TENSOR_MATCH" and isinstance(e.value, torch.nn.Parameter))
                 or e.orig_guard.source.is_unspecialized_nn_module()) for e in entries]


def _private_frame(fn):
    """``fn`` behind a function with a code object of its own, for ``torch.compile``.

    Dynamo keeps compiled graphs per code object, and :func:`_step_guards` drops the guards on the
    model's parameters and modules; two compiled runners would otherwise share the entries of one
    code object (``LeanLlamaStep.__call__``, a module's ``forward``), and a runner over another
    model (another weight format, other shapes) would run the first model's graph: a ``KeyError``
    on a missing module at best, wrong logits at worst. With a private frame each runner compiles
    and guards its own graphs (and its own recompile budget)."""
    def step(*args, **kwargs):
        return fn(*args, **kwargs)
    return types.FunctionType(step.__code__.replace(), step.__globals__, "dartree_step", None, step.__closure__)


class ModelRunner(CompiledSwapIn):
    """Runs batched steps of a :class:`TargetModel` over a slot KV cache (an eager lean step on CPU
    can swap in its compiled one later: :class:`~services.verifier.swap_in.CompiledSwapIn`).

    Guarantee (the module docstring's batch invariance): on unpadded steps (eager or compiled) a
    request's logits and features are those of the same request run alone: bitwise in q4, bitwise
    in bfloat16 where oneDNN's rows do not depend on the row count (not on every CPU and shape),
    to float32 rounding in float32; on padded steps (``cuda_graphs``) to rounding.

    Args:
        target: the target (its HF model switches to the slot attention, which falls back to SDPA
            outside a step, so :meth:`TargetModel.verify` / ``prefill`` keep working).
        num_slots: KV slots (concurrent requests); capacity: columns per slot.
        kv_bucket: the KV length a step reads is rounded up to a multiple of this.
        compile: run steps through ``torch.compile`` (inductor; CPU or CUDA). A llama target on CPU
            compiles its lean step (:class:`~services.verifier.lean_step.LeanLlamaStep` with
            ``compiled=True``: every step through the compiled pass, rows invariant to their step's
            other rows; ``docs/weights.md``, "Compiled steps"); other models compile the HF modules
            with each decoder layer a nested compile region
            (:func:`services.hf_compat.mark_layers_as_compile_regions`: one layer is traced and
            compiled, the others reuse it). Either way: a static graph for one-row steps,
            one with a dynamic row count for every other step (rows marked dynamic, KV length inside
            the opaque slot-attention op), and one more when only some rows need logits. Call
            :meth:`warm_up` at start (tens of seconds on a 2-core CPU; inductor caches its kernels on
            disk, so later starts are faster). The reference paths of :class:`TargetModel` stay eager.
            On a CUDA target with ``cuda_graphs`` (the default there) ``compile`` adds nothing.
        cuda_graphs: run every step *padded to a bucket* (:func:`~services.tree.batch.step_bucket`:
            segments and KV length rounded up to powers of two, row counts by
            :func:`~services.tree.batch.row_bucket`: 1, then multiples of 16) through
            :class:`~services.verifier.padded_step.PaddedSteps`: on CUDA :meth:`capture_graphs`
            captures a grid of buckets at start (:mod:`services.verifier.graph_grid`) and steps
            replay them (no host sync inside a step: attention gathers the slots, masks are built
            on the device); a step outside the grid runs the same padded step eagerly, counted in
            :attr:`num_eager_steps`. Off CUDA (or with ``DARTREE_CUDA_GRAPHS=0``) nothing is
            captured and padded steps run eagerly, which is how the padding is tested on CPU.
            Padding rows write to a scratch slot the cache holds in addition to ``num_slots``
            (:func:`~services.tree.batch.pad_packed`). None: on when the target is on CUDA.
        tree_attention: unpadded steps run :func:`~services.verifier.tree_attention.tree_verify_attention`
            per request (an unmasked prefix call merged with the ``[R_i, R_i]`` tree block by
            log-sum-exp; tree masks built on the device from parent rows; no host-built prefix mask,
            no host read of device values while the step is laid out). None: on for an eager CUDA
            target unless ``DARTREE_TREE_ATTENTION=0``; CPU keeps the dense per-request calls (the
            grouped attention's rows are bitwise row invariant, the merged ones equal to rounding).
    Raises:
        MemoryError: the cache does not fit (one line, with its size).
        ValueError: ``compile`` and ``cuda_graphs`` both set on a CPU target, or ``tree_attention``
            with ``compile`` / ``cuda_graphs``.
    """

    def __init__(self, target, num_slots: int, capacity: int, kv_bucket: int = 64, compile: bool = False,
                 cuda_graphs: bool | None = None, tree_attention: bool | None = None):
        self.target = target
        on_cuda = torch.device(target.device).type == "cuda"
        if compile and cuda_graphs and not on_cuda:
            raise ValueError("compile and cuda_graphs exclude each other off CUDA (inductor steps, or padded eager "
                             "steps that test the CUDA-graph path): pick one")
        self.graphed = on_cuda if cuda_graphs is None else bool(cuda_graphs)
        self.tree_attention = tree_attention_on(tree_attention, on_cuda, compile or self.graphed)
        self.cache = SlotKVCache.for_model(target.config, num_slots + int(self.graphed), capacity, target.dtype,
                                           target.device)
        self.kv_bucket = kv_bucket
        heads = int(target.config.num_attention_heads)
        self.query_groups = heads // int(getattr(target.config, "num_key_value_heads", None) or heads)  # G
        name = hf_compat.register_slot_attention(slot_attention)
        hf_compat.set_attention_implementation(target.model, name)
        self.compiled = bool(compile) and not self.graphed
        self.warm_up_seconds = 0.0  # all :meth:`warm_up` calls so far (the compile time when compiled)
        self._forward = target.model
        self.padded: PaddedSteps | None = None
        if self.graphed:
            self.scratch_slot = num_slots  # the cache's last slot; slots 0 .. num_slots - 1 serve requests
            self.cache.reserve(self.scratch_slot)
            self.padded = PaddedSteps(self.cache, self.scratch_slot, kv_bucket, self._padded_forward, target.device,
                                      enabled=on_cuda)
        self.graphs = self.padded.graphs if self.padded is not None else None
        self._lean_ok = not self.graphed and lean_step_enabled() and LeanLlamaStep.supports(target.model)
        self.deferred_rows: tuple[int, ...] | None = None  # rows whose compiled steps build off the critical path
        self._set_up_step(target, lean=self._lean_ok)

    def _set_up_step(self, target, lean: bool, share: LeanLlamaStep | None = None) -> None:
        """The step's callable: the lean step (a llama target off CUDA graphs), compiled or not, or
        the model compiled by layer regions; with the native slot attention where it builds."""
        self.lean = None  # unpadded steps of a llama target on CPU: services.verifier.lean_step
        self._lean_call = None  # compiled: the lean step's torch.compile'd pass
        if self.compiled:
            from services.machine_cache import use_inductor_cache

            use_inductor_cache()
        # the native slot attention (services.native_lib): compiled lean steps on the grouped path
        self.native = bool(self.compiled and lean and use_grouped(target.dtype, target.device) and native.load(build=True))
        if self.compiled and lean:
            attention = compiled_lean_attention
            if self.native:  # the fused kernel where it serves the head dim, else the ATen-call op
                fused = native.FUSED and native.fused_head_dim(self.cache.keys[0].shape[-1])
                attention = native_lean_attention if fused else native_aten_lean_attention
            self.lean = LeanLlamaStep(target.model, attention, target._taps, target.target_layer_ids, compiled=True,
                                      share=share)
            # no size/stride asserts in the generated code: dynamo's guards already check every input,
            # and the asserts cost ~1,100 calls a step (each of the 30 layer calls checks its weights)
            self._lean_call = torch.compile(_private_frame(self.lean.__call__), options={
                "guard_filter_fn": _step_guards, "emulate_precision_casts": True, "size_asserts": False,
                "scalar_asserts": False})
        elif self.compiled:
            for layer in hf_compat.decoder_layers(target.model):
                attn = layer.self_attn
                if "dartree_layer" not in attn._buffers:
                    attn.register_buffer("dartree_layer", torch.tensor(int(attn.layer_idx)), persistent=False)
            hf_compat.mark_layers_as_compile_regions(target.model)
            self._forward = torch.compile(_private_frame(target.model), options={"guard_filter_fn": _step_guards})
        elif lean:
            self.lean = LeanLlamaStep(target.model, lean_attention, target._taps, target.target_layer_ids)

    @property
    def num_eager_steps(self) -> int:
        """Padded steps run eagerly, uncaptured, because their bucket is not in the captured grid
        (0 unpadded)."""
        return self.padded.num_eager_steps if self.padded is not None else 0

    @torch.inference_mode()
    def capture_graphs(self, max_rows: int, segment_rows: int, max_graphs: int = DEFAULT_MAX_GRAPHS) -> dict:
        """Capture the verify step's grid (:func:`~services.verifier.graph_grid.verify_grid` of this
        runner's slots, KV bucket and capacity; ``max_rows``: the widest step, ``segment_rows``: a
        request's widest tree, B + 1), logged with its memory. Call once at start, before serving.

        Returns:
            :meth:`PaddedSteps.capture`'s summary.
        Raises:
            RuntimeError: the runner has no padded steps (``cuda_graphs`` off).
        """
        if self.padded is None:
            raise RuntimeError("this runner runs unpadded steps (cuda_graphs off): nothing to capture")
        grid = verify_grid(self.cache.num_slots - 1, max_rows, segment_rows, self.kv_bucket, self.cache.capacity,
                           max_graphs)
        info = self.padded.capture(grid, int(self.target.vocab_size), int(self.target.feature_dim), self.target.dtype)
        self.warm_up_seconds += info["seconds"]
        return info

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
                if n > 1 and self.compiled:  # first logits for 2 of n rows: the graph's row and logit-row
                    # counts then get sizes of their own (a first graph with all n rows would tie them, and
                    # a serving step whose counts differ, e.g. a prompt chunk beside decode rows, recompiles)
                    self.execute([causal_segment([1] * n, 0, slot)], torch.tensor([0, n - 1]))
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
        p = pack_segments(segments, self.kv_bucket, self.cache.capacity,
                          with_mask=not (self.tree_attention or self.graphed))  # else built on the device
        if self.graphed:
            return self._execute_padded(segments, p, logit_rows)
        self.cache.prepare(p.slots.tolist(), p.kv_length)
        dev = self.target.device
        tree_parts = segment_parts(segments, p, dev) if self.tree_attention else None  # host lists: no sync
        host, p = p, _to(p, dev)
        keep, no_logits = self._keep(p, logit_rows)
        parts = tree_parts or request_parts(p, self.query_groups, self.target.dtype, host)
        ids, pos = p.input_ids[None], p.positions[None]
        if self.compiled and ids.shape[1] > 1:  # one graph for every row count > 1 (1 row: its own)
            for t, dim in ((ids, 1), (pos, 1), (keep, 0)):
                torch._dynamo.maybe_mark_dynamic(t, dim)
        t0 = time.perf_counter()
        logits = self._run_forward(p, parts, ids, pos, keep)
        feats = self.target._features()
        if no_logits:
            logits = logits[:, :0]
        return StepOutput(logits[0].float(), feats, p, _elapsed(t0, dev))

    def _run_forward(self, p: PackedRows, parts: list[tuple], ids: Tensor, pos: Tensor, keep: Tensor) -> Tensor:
        """The forward of an unpadded step (``ids`` / ``pos`` ``[1, R]``, ``keep [K]``) with ``p`` and
        its per-request ``parts`` active for the slot attention (and handed to the native op when it
        runs): the lean step, compiled or not, else the HF model. Returns its logits ``[1, K, V]``."""
        ACTIVE.step = (self.cache, p, parts, "tree" if self.tree_attention else "dense")
        if self.native:
            native_step(self.cache, parts)
        try:
            if self.lean is not None:
                return (self._lean_call if self.lean.compiled else self.lean)(ids, pos, keep)
            return self._forward(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False,
                                 logits_to_keep=keep).logits
        finally:
            ACTIVE.step = None
            if self.native:
                torch.ops.dartree_native.clear_step()

    def _keep(self, p: PackedRows, logit_rows: Tensor | None) -> tuple[Tensor, bool]:
        """The ``[K]`` rows whose logits the forward computes (on the target's device), and whether
        the caller asked for none (a compiled step then computes the last row's and drops them)."""
        dev = self.target.device
        keep = logit_rows.to(dev) if logit_rows is not None else torch.arange(p.input_ids.numel(), device=dev)
        if self.compiled and not keep.is_inference():  # its dispatch keys would fail a guard: recompile
            keep = keep.clone()
        no_logits = self.compiled and keep.numel() == 0  # a prompt chunk before the last: no graph of its
        if no_logits:  # own for zero logit rows; the last row's are computed and dropped
            keep = torch.tensor([p.input_ids.numel() - 1], device=dev)
        return keep, no_logits

    def _execute_padded(self, segments: list[Segment], p: PackedRows, logit_rows: Tensor | None) -> StepOutput:
        """:meth:`execute` at the step's bucket (:meth:`PaddedSteps.execute`)."""
        dev = self.target.device
        t0 = time.perf_counter()
        logits, feats = self.padded.execute(segments, p, logit_rows)
        return StepOutput(logits, feats, _to(p, dev), _elapsed(t0, dev))

    def _padded_forward(self, p: PackedRows, ids: Tensor, pos: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        """The target's forward over a padded step's metadata ``p`` (one attention call a layer over the
        bucket's layout): ``(logits [K', V] float32, features [R', F])``; no host sync."""
        ACTIVE.step = (self.cache, p, None, "padded")
        try:
            with hf_compat.attention_without_mask(self.target.model):
                out = self.target.model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False,
                                        logits_to_keep=keep)
        finally:
            ACTIVE.step = None
        return out.logits[0].float(), self.target._features()


def auto_compile(target) -> bool:
    """Whether ``dartree serve``'s default (``--compile`` unset) compiles the target's steps: a llama
    target on CPU in a format whose registry entry sets ``compile_default`` (``q4``;
    :mod:`services.weight_formats`) that the lean step covers (:class:`~services.verifier.lean_step.LeanLlamaStep`;
    the compiled pass ran its plain decoding 15-20 % faster than eager steps on a 2-core AMD EPYC,
    ``docs/weights.md``, "Compiled steps"). Other formats and devices stay eager unless asked."""
    from services.weight_formats import FORMATS

    fmt = FORMATS.get(str(getattr(target, "weights", "")))
    return (torch.device(target.device).type == "cpu" and fmt is not None and fmt.compile_default
            and lean_step_enabled() and LeanLlamaStep.supports(target.model))


def _elapsed(t0: float, dev) -> float:
    """Seconds since ``t0``, after the device's queued work (CUDA: launches are asynchronous)."""
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def _to(p: PackedRows, dev) -> PackedRows:
    """``p`` with its tensors on ``dev``."""
    return PackedRows(**{f: (getattr(p, f).to(dev) if isinstance(getattr(p, f), Tensor) else getattr(p, f))
                         for f in PackedRows.__dataclass_fields__})
