"""GPU memory plan of one server: what the device must hold beyond the loaded weights, and the
``--max-running`` / ``--max-context`` that fit a fraction of it.

Torch-free arithmetic (:func:`plan_memory`) plus a thin probe of the device's free memory
(:func:`device_memory`). The verifier plans after both models are loaded (the drafter process
connects first), from the device's free memory then, so the weights of both models, their CUDA
contexts and anything else already on the device are counted as used. As vLLM's
``--gpu-memory-utilization``, the server may use ``utilization`` of the device's total memory::

    budget     = free - total x (1 - utilization)          (what this server may still take)
    per slot   = KV + feature history + drafter context, for a context of C tokens:
      KV       = (C + segment room) x layers x 2 x kv_heads x head_dim x bytes(activations)
      features = C x F x bytes(activations)       the target features the verifier keeps per
                                                  request for the drafter (F = hidden x tapped layers)
      drafter  = C x drafter bytes a position     the drafter's context buffer (every drafter layer's
                                                  K/V) and its share of the batch scratch, as the
                                                  drafter reports it at handshake (PeerInfo.context_bytes)
      gathers  = 2 x (C + segment room) x 2 x kv_heads x head_dim x bytes(activations)
                                                  padded steps only: one layer's K/V of every segment,
                                                  gathered per layer, in the graph pool and in an
                                                  eager step past the grid
    fixed      = step activations (the CUDA graph pool: the widest step's logits in the model dtype
                 and float32, its hidden / MLP activations and features, its attention mask)
               + with padded steps (CUDA graphs): the same again for steps run eagerly past the
                 captured grid (the graph pool's memory is not theirs to use)
               + IPC slots (each process's CUDA-IPC send ring) + the prefix cache's bound
    slots      = max_running (+ 1 scratch slot that padded CUDA-graph steps write to)

``segment room`` is what :meth:`services.verifier.engine.SpecEngine.kv_positions` adds past the
context (the widest tree or prompt chunk a step may write). What is derived and what is checked:

- both flags given: checked; a refusal names both with the largest value of each that fits;
- ``--max-context`` given: ``--max-running`` = the most slots that fit, at most
  :data:`DEFAULT_MAX_RUNNING`; not one fits: a refusal naming ``--max-context``;
- ``--max-running`` given: the context = the target's window, or the longest that fits (a multiple of
  :data:`CONTEXT_STEP`); below :data:`MIN_CONTEXT`: a refusal naming ``--max-running``;
- neither: :data:`DEFAULT_MAX_RUNNING` slots at the longest context that fits, down to
  :data:`PREFERRED_CONTEXT` tokens (or the target's window when shorter); below that, fewer slots at
  that context; not even one: a refusal naming ``--gpu-memory-utilization`` and ``--max-context``.

``python -m services.memory_plan --shape qwen3-4b --device-gib 24`` prints the plan of a target's
shape on a device of that size (free memory estimated from the weights' bytes; docs/memory-plan.md).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

from services.spec import MAX_BUDGET

GIB = 2**30
DEFAULT_UTILIZATION = 0.9   # as vLLM's --gpu-memory-utilization
DEFAULT_MAX_RUNNING = 8     # slots planned when --max-running is not given (and the CPU default)
PREFERRED_CONTEXT = 8192    # a derived context is not cut below this while fewer slots would do
MIN_CONTEXT = 2048          # a derived context below this is refused
CONTEXT_STEP = 256          # a derived context is a multiple of this
LOGIT_BYTES = 4             # logits are read in float32
CUDA_CONTEXT_BYTES = 512 * 2**20  # a process's CUDA context (the offline estimate only)

# the paper's targets, from their config.json (Qwen/Qwen3-4B, Qwen/Qwen3-8B)
SHAPES = {
    "qwen3-4b": {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "hidden_size": 2560, "intermediate_size": 9728, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "tie_word_embeddings": True},
    "qwen3-8b": {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "hidden_size": 4096, "intermediate_size": 12288, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "tie_word_embeddings": False},
}


@dataclass(frozen=True)
class TargetShape:
    """The numbers of a decoder-only target that size its memory.

    Attributes:
        layers, heads, kv_heads, head_dim, hidden, intermediate, vocab: as in its ``config.json``.
        max_context: its position limit (``max_position_embeddings``).
        tied: whether the output head shares the embedding's weights.
    """

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    max_context: int
    tied: bool = False

    @classmethod
    def from_config(cls, cfg: dict) -> "TargetShape":
        """The shape of a HF ``config.json`` (``head_dim`` defaults to hidden / heads, ``kv_heads`` to heads).

        Raises:
            KeyError: a field every decoder config has is missing.
        """
        heads = int(cfg["num_attention_heads"])
        return cls(layers=int(cfg["num_hidden_layers"]), heads=heads,
                   kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                   hidden=int(cfg["hidden_size"]), intermediate=int(cfg["intermediate_size"]),
                   vocab=int(cfg["vocab_size"]), max_context=int(cfg.get("max_position_embeddings", 2048)),
                   tied=bool(cfg.get("tie_word_embeddings", False)))

    def kv_bytes_per_position(self, act_bytes: int) -> int:
        """Keys and values of one position, every layer: layers x 2 x kv_heads x head_dim x bytes."""
        return self.layers * 2 * self.kv_heads * self.head_dim * act_bytes

    def parameters(self) -> int:
        """Parameters of a dense llama / qwen-style decoder of this shape (embedding, attention,
        gated MLP, norms; the head unless tied)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate + 2 * self.hidden + 2 * self.head_dim
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * layer + self.hidden


@dataclass(frozen=True)
class MemoryNeeds:
    """What one server keeps on the device beyond the weights (module doc's formula).

    Attributes:
        target: the target's shape; act_bytes: bytes of its activation dtype (bfloat16: 2).
        feature_dim: F, the width of the features kept per request for the drafter (0: no drafter).
        drafter_bytes_per_position: the drafter's context bytes a position (every drafter layer's
            K and V and its batch scratch's share; 0: no drafter).
        segment_room: KV positions a slot holds past the context (the widest step segment).
        extra_slots: KV slots beyond ``max_running`` (1: the scratch slot of padded CUDA-graph steps).
        step_rows: rows of the widest step (``--max-step-tokens``).
        ipc_bytes: the CUDA-IPC send rings of both processes (0 without them).
        prefix_cache_bytes: the prefix cache's bound beyond the KV slots (``--prefix-cache-mib``).
        padded_steps: steps run padded through CUDA graphs (the graph pool's K/V gathers per slot,
            and the activations of eager steps past the captured grid besides the pool).
    """

    target: TargetShape
    act_bytes: int = 2
    feature_dim: int = 0
    drafter_bytes_per_position: int = 0
    segment_room: int = 1025
    extra_slots: int = 0
    step_rows: int = 512
    ipc_bytes: int = 0
    prefix_cache_bytes: int = 0
    padded_steps: bool = False

    def per_slot(self, context: int) -> dict[str, int]:
        """Bytes of one request slot at a context of ``context`` tokens, by part."""
        kv = (context + self.segment_room) * self.target.kv_bytes_per_position(self.act_bytes)
        return {"KV cache": kv, "feature history": context * self.feature_dim * self.act_bytes,
                "drafter contexts": context * self.drafter_bytes_per_position,
                "padded-step K/V gathers": 2 * kv // self.target.layers if self.padded_steps else 0}

    def fixed(self, context: int) -> dict[str, int]:
        """Bytes that do not grow with the slots, by part (the attention mask grows with ``context``)."""
        t, a, rows = self.target, self.act_bytes, self.step_rows
        per_row = t.vocab * (a + LOGIT_BYTES) + a * (4 * t.hidden + 3 * t.intermediate + self.feature_dim)
        step = rows * per_row + rows * (context + self.segment_room)
        return {"step activations (CUDA graph pool)": step,
                "eager steps past the graph grid": step if self.padded_steps else 0,
                "IPC slots": self.ipc_bytes, "prefix cache": self.prefix_cache_bytes}

    def slot_bytes(self, context: int) -> int:
        """Bytes of one request slot at a context of ``context`` tokens, all parts."""
        return sum(self.per_slot(context).values())


@dataclass(frozen=True)
class MemoryPlan:
    """A planned server: its limits and the bytes of each part.

    Attributes:
        total, free: the device's bytes, and those free after both models loaded.
        utilization: the fraction of ``total`` the server may use; budget: what it may still take.
        max_running, max_context: the planned limits; derived: which of the two flags were derived.
        slots: KV slots reserved (``max_running`` + extra); parts: bytes by part (slots included).
    """

    total: int
    free: int
    utilization: float
    budget: int
    max_running: int
    max_context: int
    slots: int
    parts: dict[str, int] = field(default_factory=dict)
    derived: tuple[str, ...] = ()

    def planned(self) -> int:
        """Bytes of every part together."""
        return sum(self.parts.values())

    def lines(self) -> list[str]:
        """The start-up log's block: one line per part, then the limits and what is left."""
        how = lambda flag: "derived" if flag in self.derived else "given"  # noqa: E731
        out = [f"GPU memory plan: {gib(self.total)} total, {gib(self.total - self.free)} in use after loading the "
               f"models, {gib(self.budget)} left at --gpu-memory-utilization {self.utilization:g}"]
        out += [f"  {name:<36} {gib(n):>10}" for name, n in self.parts.items()]
        out.append(f"  {'planned':<36} {gib(self.planned()):>10} ({gib(self.budget - self.planned())} spare)")
        out.append(f"  --max-running {self.max_running} ({how('--max-running')}), --max-context {self.max_context} "
                   f"({how('--max-context')}), {self.slots} KV slots")
        return out


def gib(n: float) -> str:
    """``n`` bytes as ``"12.34 GiB"``."""
    return f"{n / GIB:.2f} GiB"


def _longest_context(needs: MemoryNeeds, room: int, slots: int, cap: int) -> int:
    """The longest context (a multiple of :data:`CONTEXT_STEP`, at most ``cap``) at which ``slots``
    slots and the fixed parts fit ``room`` bytes; 0 when none does."""
    if slots < 1:
        return 0
    lo, hi = 0, cap // CONTEXT_STEP
    while lo < hi:  # the fixed parts grow with the context too (the mask): bisect on the step count
        mid = (lo + hi + 1) // 2
        c = mid * CONTEXT_STEP
        if slots * needs.slot_bytes(c) + sum(needs.fixed(c).values()) <= room:
            lo = mid
        else:
            hi = mid - 1
    return cap if _fits(needs, room, slots, cap) else lo * CONTEXT_STEP


def _fits(needs: MemoryNeeds, room: int, slots: int, context: int) -> bool:
    return slots * needs.slot_bytes(context) + sum(needs.fixed(context).values()) <= room


def _most_slots(needs: MemoryNeeds, room: int, context: int) -> int:
    """Request slots (``max_running``) that fit ``room`` at ``context`` (the extra slots counted)."""
    left = room - sum(needs.fixed(context).values())
    return max(left // needs.slot_bytes(context) - needs.extra_slots, 0)


def plan_memory(needs: MemoryNeeds, free: int, total: int, utilization: float = DEFAULT_UTILIZATION,
                max_running: int | None = None, max_context: int | None = None) -> MemoryPlan:
    """The plan for a device with ``free`` of ``total`` bytes free after both models loaded.

    Args:
        needs: what the server keeps beyond the weights.
        utilization: the fraction of ``total`` the server may use, in ``(0, 1]``.
        max_running, max_context: the flags' values, None where not given (derived, module doc).
    Raises:
        ValueError: nothing fits, or the given flags do not (one line naming the flags to change).
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1] (got {utilization})")
    budget = free - (total - int(total * utilization))
    cap = needs.target.max_context
    derived = tuple(flag for flag, v in (("--max-running", max_running), ("--max-context", max_context)) if not v)
    context = min(max_context, cap) if max_context else None
    where = (f"{gib(max(budget, 0))} are left for them (--gpu-memory-utilization {utilization:g} of "
             f"{gib(total)}, {gib(total - free)} in use after loading the models)")
    if max_running is not None and context is not None:
        _check_given(needs, budget, max_running, context, where)
    elif context is not None:
        max_running = min(DEFAULT_MAX_RUNNING, _most_slots(needs, budget, context))
        if max_running < 1:
            best = _longest_context(needs, budget, 1 + needs.extra_slots, cap)
            need = (1 + needs.extra_slots) * needs.slot_bytes(context) + sum(needs.fixed(context).values())
            raise ValueError(f"--max-context {context}: one request needs {gib(need)} of device memory with the "
                             f"step's buffers, {where}: lower --max-context" + (f" to {best} or less" if best else ""))
    elif max_running is not None:
        context = _longest_context(needs, budget, max_running + needs.extra_slots, cap)
        if context < min(MIN_CONTEXT, cap):
            most = _most_slots(needs, budget, min(MIN_CONTEXT, cap))
            raise ValueError(f"--max-running {max_running} leaves room for a context of {context} tokens a request "
                             f"(at least {min(MIN_CONTEXT, cap)} needed), {where}: lower --max-running"
                             + (f" to {most} or less" if most else ""))
    else:
        max_running, context = _derive_both(needs, budget, cap, where)
    return _plan(needs, free, total, utilization, budget, max_running, context, derived)


def _derive_both(needs: MemoryNeeds, budget: int, cap: int, where: str) -> tuple[int, int]:
    """``(max_running, max_context)`` when neither flag is given (module doc)."""
    floor = min(PREFERRED_CONTEXT, cap)
    context = _longest_context(needs, budget, DEFAULT_MAX_RUNNING + needs.extra_slots, cap)
    if context >= floor:
        return DEFAULT_MAX_RUNNING, context
    running = _most_slots(needs, budget, floor)
    if running >= 1:
        return running, floor
    context, least = _longest_context(needs, budget, 1 + needs.extra_slots, cap), min(MIN_CONTEXT, cap)
    if context < least:
        need = (1 + needs.extra_slots) * needs.slot_bytes(least) + sum(needs.fixed(least).values())
        smaller = f", or pass --max-context {context} or less" if context else ""
        raise ValueError(f"not even one request with a {least}-token context fits: it needs "
                         f"{gib(need)} with the step's buffers, {where}: raise --gpu-memory-utilization or free "
                         f"the device{smaller}")
    return 1, context


def _check_given(needs: MemoryNeeds, budget: int, running: int, context: int, where: str) -> None:
    """ValueError naming both flags unless ``running`` slots at ``context`` fit ``budget``."""
    slots = running + needs.extra_slots
    if _fits(needs, budget, slots, context):
        return
    need = slots * needs.slot_bytes(context) + sum(needs.fixed(context).values())
    best_c = _longest_context(needs, budget, slots, needs.target.max_context)
    best_r = _most_slots(needs, budget, context)
    fixes = []
    if best_c >= min(MIN_CONTEXT, context):
        fixes.append(f"--max-context to {best_c}")
    if best_r >= 1:
        fixes.append(f"--max-running to {best_r}")
    raise ValueError(f"--max-running {running} at --max-context {context} needs {gib(need)} of device memory, "
                     f"{where}: lower " + (" or ".join(fixes) if fixes else "both") +
                     " (or raise --gpu-memory-utilization)")


def _plan(needs, free, total, utilization, budget, running, context, derived) -> MemoryPlan:
    slots = running + needs.extra_slots
    parts = {k: slots * v for k, v in needs.per_slot(context).items()}
    parts.update(needs.fixed(context))
    return MemoryPlan(total, free, utilization, budget, running, context, slots,
                      {k: v for k, v in parts.items() if v}, derived)


def segment_room(prefill_chunk: int) -> int:
    """KV positions a slot holds past its context (as ``SpecEngine.kv_positions``)."""
    return max(MAX_BUDGET + 1, prefill_chunk)


def plan_verifier_memory(config, target, drafter, graphed: bool, transport=None, probe=None) -> MemoryPlan:
    """The verifier's plan on its CUDA device, after the target (and the drafter) loaded; logged as
    one block.

    Args:
        config: the :class:`~services.verifier.config.VerifierWorkerConfig` (``engine.max_running``
            None and ``engine.max_context`` 0 are derived; ``gpu_memory_utilization``,
            ``engine.prefill_chunk``, ``engine.max_step_tokens``, ``engine.prefix_cache``,
            ``prefix_cache_mib``).
        target: the loaded :class:`~services.verifier.target.TargetModel` (``config``, ``dtype``,
            ``feature_dim``, ``max_context``, ``device``).
        drafter: the drafter's :class:`~services.protocol.PeerInfo` (``context_bytes``), None without one.
        graphed: steps run through CUDA graphs (one more KV slot, the padded steps' scratch, and
            :class:`MemoryNeeds`' ``padded_steps`` parts).
        transport: the drafter link's tensor transport; a CUDA-IPC one holds two rings of
            ``num_slots x slot_bytes`` (this side's and the drafter's, both allocated already).
        probe: ``device -> (free, total)`` (None: :func:`device_memory`).
    Raises:
        ValueError: the limits do not fit (one line naming the flags).
    """
    import logging

    shape = TargetShape.from_config(target.config.to_dict())
    shape = TargetShape(**{**shape.__dict__, "max_context": int(target.max_context)})
    ipc = 0
    if getattr(transport, "kind", "") == "cuda_ipc":
        ipc = 2 * transport.num_slots * transport.slot_bytes
    needs = MemoryNeeds(shape, target.dtype.itemsize, target.feature_dim if drafter is not None else 0,
                        int(getattr(drafter, "context_bytes", 0) or 0), segment_room(config.engine.prefill_chunk),
                        extra_slots=int(bool(graphed)), step_rows=config.engine.max_step_tokens, ipc_bytes=ipc,
                        prefix_cache_bytes=config.prefix_cache_mib * 2**20 if config.engine.prefix_cache else 0,
                        padded_steps=bool(graphed))
    free, total = (probe or device_memory)(str(target.device))
    plan = plan_memory(needs, free + ipc, total, config.gpu_memory_utilization, config.engine.max_running,
                       config.engine.max_context or None)
    logging.getLogger("verifier").info("%s", "\n".join(plan.lines()))
    return plan


def device_memory(device: str) -> tuple[int, int]:
    """``(free, total)`` bytes of a CUDA device now (``torch.cuda.mem_get_info``: every process's
    allocations count as used)."""
    import torch

    return torch.cuda.mem_get_info(torch.device(device))


# ------------------------------------------------------------------------- offline plan (docs, CLI)

def drafter_bytes(shape: TargetShape, layers: int = 5, act_bytes: int = 2) -> int:
    """Context bytes a position of an eager :func:`drafter_like` drafter (its layers' K/V and one
    layer's share of the batch scratch, as ``DrafterService.context_bytes_per_position``)."""
    return 2 * shape.kv_heads * shape.head_dim * act_bytes * (layers + 1) if layers else 0


def drafter_like(shape: TargetShape, layers: int = 5) -> TargetShape:
    """A DFlash-style drafter of ``layers`` decoder layers at the target's width (its heads, MLP and
    vocabulary: the embedding and head are the target's, borrowed)."""
    return TargetShape(layers, shape.heads, shape.kv_heads, shape.head_dim, shape.hidden, shape.intermediate,
                       shape.vocab, shape.max_context, shape.tied)


def offline_free(total: int, target: TargetShape, drafter_layers: int, taps: int, act_bytes: int = 2) -> int:
    """Free bytes after loading, estimated without a device: ``total`` less the target's weights,
    the drafter's (its layers, its ``taps x hidden -> hidden`` projection, its copy of the borrowed
    embedding and head) and two CUDA contexts (:data:`CUDA_CONTEXT_BYTES`)."""
    d = drafter_like(target, drafter_layers)
    borrowed = target.vocab * target.hidden * (1 if target.tied else 2)
    drafter = (d.parameters() - d.vocab * d.hidden * (1 if d.tied else 2) + taps * d.hidden * d.hidden + borrowed) \
        if drafter_layers else 0
    return total - (target.parameters() + drafter) * act_bytes - CUDA_CONTEXT_BYTES * (2 if drafter_layers else 1)


def main(argv: list[str] | None = None) -> int:
    """``python -m services.memory_plan``: print the plan of a target shape on a device of a given size."""
    ap = argparse.ArgumentParser(prog="python -m services.memory_plan", description=main.__doc__)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b", help="the target's shape")
    ap.add_argument("--device-gib", type=float, required=True, help="the device's total memory, GiB")
    ap.add_argument("--drafter-layers", type=int, default=5, help="drafter decoder layers (0: no drafter)")
    ap.add_argument("--taps", type=int, default=5, help="target layers whose features the drafter reads")
    ap.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_UTILIZATION)
    ap.add_argument("--max-running", type=int, default=None)
    ap.add_argument("--max-context", type=int, default=None)
    a = ap.parse_args(argv)
    target = TargetShape.from_config(SHAPES[a.shape])
    total = int(a.device_gib * GIB)
    needs = MemoryNeeds(target, 2, a.taps * target.hidden if a.drafter_layers else 0,
                        drafter_bytes(target, a.drafter_layers),
                        segment_room(256), extra_slots=1, step_rows=512,
                        ipc_bytes=2 * 16 * (8 << 20) if a.drafter_layers else 0, prefix_cache_bytes=256 * 2**20,
                        padded_steps=True)
    try:
        plan = plan_memory(needs, offline_free(total, target, a.drafter_layers, a.taps), total,
                           a.gpu_memory_utilization, a.max_running, a.max_context)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(plan.lines()))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
