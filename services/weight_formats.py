"""The target's weight formats (``--weights``), one :class:`WeightFormat` each, and their registry.

A format knows its name, the dtype its activations (and the KV cache) run in, the bytes one
parameter holds resident (the start-up fit check), its kernels' version (a cached ``auto`` choice,
a cached pack and a cached step-cost sweep are made again when it changes), its rank and reason in
``auto``'s rule (fewest bytes per step first), whether ``serve`` compiles its CPU steps by default,
where its packs are cached, why it cannot run on a device or for a target, and the hook that swaps
its kernels into a freshly loaded model. Everything else reads this registry: the command lines'
choices (:mod:`services.runtime`), loading and ``auto`` (:mod:`services.weights`,
:mod:`services.weight_choice`), the fit check (:mod:`services.startup`), the compile default
(:func:`services.verifier.runner.auto_compile`), the cost-sweep key
(:func:`services.verifier.build.sweep_key`) and the drafter's int4 linears.

Torch-free: the hooks are ``"module:function"`` names imported on first use (docs/weights.md, "Add a
weight format").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


def _hook(ref: str | None) -> Callable | None:
    """The function ``"package.module:name"`` names (imported now), or None."""
    if not ref:
        return None
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class WeightFormat:
    """One weight format of the target.

    Attributes:
        name: the ``--weights`` value.
        act_dtype: torch dtype name of the activations and the KV cache (``"float32"``, ``"bfloat16"``).
        bytes_per_param: resident bytes per parameter (weights plus their scales; a load's estimate).
        kernels_version: bumped when the format's kernels change (cached packs, ``auto`` choices
            and step-cost sweeps keyed by it are made again).
        rank, reason: ``auto``'s rule without a measurement takes the available format of the lowest
            rank, for ``reason`` (one line).
        compile_default: ``serve`` with ``--compile`` unset compiles a llama target's CPU steps in
            this format (the lean step; :func:`services.verifier.runner.auto_compile`).
        needs_native_bf16: a candidate of ``auto`` only on a CPU that multiplies bfloat16 natively.
        packs_dir: folder under the state directory holding the format's cached packs (None: none).
        device_check: ``"module:function"``, ``f(device) -> str | None``: why the format cannot
            run on ``device`` (one line), None when it can (None: runs everywhere).
        target_check: ``"module:function"``, ``f(target_dir) -> str | None``: why it cannot run
            for that target (e.g. no GGUF source), None when it can (None: any target).
        prepare: ``"module:function"``, ``f(model, target_dir, device) -> None``: swap the format's
            kernels into the HF model just loaded in ``act_dtype`` (None: the dense model as loaded).
    """

    name: str
    act_dtype: str
    bytes_per_param: float
    kernels_version: int
    rank: int
    reason: str
    compile_default: bool = False
    needs_native_bf16: bool = False
    packs_dir: str | None = None
    device_check: str | None = None
    target_check: str | None = None
    prepare: str | None = None

    def unavailable(self, device: str = "cpu", target_dir=None) -> str | None:
        """Why this format cannot run on ``device`` (and, given ``target_dir``, for that target):
        one line, or None when it can."""
        why = _hook(self.device_check)(device) if self.device_check else None
        if why is None and target_dir is not None and self.target_check:
            why = _hook(self.target_check)(target_dir)
        return why

    def available(self, device: str = "cpu", target_dir=None) -> bool:
        """Whether this format runs on ``device`` (and for ``target_dir`` when given)."""
        return self.unavailable(device, target_dir) is None

    def prepare_model(self, model, target_dir, device: str) -> None:
        """Swap this format's kernels into ``model`` (a HF causal LM loaded in ``act_dtype``), in place."""
        if self.prepare:
            _hook(self.prepare)(model, target_dir, device)


FORMATS: dict[str, WeightFormat] = {}


def register(fmt: WeightFormat) -> WeightFormat:
    """Add ``fmt`` to :data:`FORMATS` (ValueError: the name is taken)."""
    if fmt.name in FORMATS or fmt.name == "auto":
        raise ValueError(f"weight format {fmt.name!r} is already registered")
    FORMATS[fmt.name] = fmt
    return fmt


def get(name: str) -> WeightFormat:
    """The registered format ``name``.

    Raises:
        ValueError: unknown format (one line, naming the registered ones).
    """
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"weights {name!r} is not supported (choose from {', '.join(FORMATS)})")
    return fmt


def names() -> tuple[str, ...]:
    """The registered formats' names, in registration order."""
    return tuple(FORMATS)


def kernels_version() -> int:
    """The version of all formats' kernels together (the newest one's): a key part of what is
    cached across them (``auto``'s choice, the step-cost sweeps)."""
    return max(f.kernels_version for f in FORMATS.values())


def by_rank(candidates) -> list[WeightFormat]:
    """The registered formats among ``candidates`` (names), ``auto``'s rule order first."""
    return sorted((get(n) for n in candidates), key=lambda f: f.rank)


# ------------------------------------------------------------------------------------ the formats

register(WeightFormat(
    "float32", act_dtype="float32", bytes_per_param=4.0, kernels_version=1, rank=30,
    reason="the only dense format this CPU multiplies natively"))
register(WeightFormat(
    "bfloat16", act_dtype="bfloat16", bytes_per_param=2.0, kernels_version=2, rank=20,  # 2: oneDNN-packed linears
    reason="native bf16 GEMMs read half float32's bytes", needs_native_bf16=True))
register(WeightFormat(
    # 5: the lm_head through torch's weight-only int8 kernel (services.int8_head); 6: the integer-dot
    # kernels (services.int_dot) where the CPU has AVX-512 VNNI
    "q4", act_dtype="bfloat16", bytes_per_param=0.6, kernels_version=6, rank=10,
    reason="4-bit weights read the fewest bytes per step", compile_default=True, packs_dir="q4",
    device_check="services.q4_weights:device_unavailable", target_check="services.q4_weights:target_unavailable",
    prepare="services.q4_weights:prepare"))
