"""Name a target and its drafter at start: resolve both, check the target's architecture, and check
that the drafter was made for this target (or decide that plain decoding runs without one).

Torch-free: ``dartree serve``'s supervisor and ``dartree generate`` run it before any model loads,
so every refusal is one line at start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.models.architectures import check_target_dir, read_config
from services.models.registry import DEFAULT_DRAFTER_DIR, DEFAULT_TARGET, resolve_model_dir, resolve_target


@dataclass(frozen=True)
class ModelPair:
    """The models of one start.

    Attributes:
        target_dir: the target's local directory; None for the default target (converted later,
            by whoever loads it first: :func:`services.models.registry.resolve_target`).
        drafter: ``""`` (the shipped drafter), a local drafter directory, or ``"none"`` (no drafter:
            plain decoding only).
        note: why the drafter is ``"none"`` when this function chose it ("" otherwise).
    """

    target_dir: Path | None
    drafter: str
    note: str = ""


def drafter_mismatch(drafter_dir: Path, target_cfg: Mapping) -> str | None:
    """Why the drafter in ``drafter_dir`` cannot draft for a target with config ``target_cfg``
    (hidden size, vocabulary, a tapped layer past the target's last), or None when it fits or its
    layout does not say (an EAGLE-3 checkpoint)."""
    from services.drafter.config import DrafterConfig, drafter_kind

    if drafter_kind(drafter_dir) == "eagle3":
        return None
    d = DrafterConfig.from_hf(read_config(drafter_dir))
    layers, hidden = int(target_cfg.get("num_hidden_layers", 0)), int(target_cfg.get("hidden_size", 0))
    vocab = int(target_cfg.get("vocab_size", 0))
    have = (hidden, vocab, max(d.target_layer_ids) < layers)
    if have == (d.target_hidden_size, d.vocab_size, True):
        return None
    return (f"it was made for a target of hidden size {d.target_hidden_size}, vocabulary {d.vocab_size}, "
            f"tapping layers {d.target_layer_ids}; this target has hidden size {hidden}, vocabulary {vocab}, "
            f"{layers} layers")


def resolve_pair(target_ref: str | None, drafter_ref: str | None, *, max_context: int = 0, ar_only: bool = False,
                 ar_flag: str = "--default-method ar",
                 context_fix: str = "pass --max-context {limit} or less") -> ModelPair:
    """Resolve ``target_ref`` / ``drafter_ref`` (local directories or hub ids; see
    :mod:`services.models.registry`), refuse a target architecture not served exactly in
    ``max_context`` tokens (:func:`services.models.architectures.check_architecture`, its refusal
    ending with ``context_fix``), and pair the
    drafter: a given drafter must fit the target; without one, the shipped drafter is used when it
    fits, else plain decoding runs when ``ar_only`` (the default method is ``ar``), else refused.

    Raises:
        ValueError (``UnsupportedArchitecture`` included), ModelNotFoundError (a RuntimeError): one
            line naming what to change.
    """
    drafter = (drafter_ref or "").strip()
    if drafter.lower() == "none":
        drafter = "none"
    elif drafter:
        drafter = str(resolve_model_dir(drafter, "drafter"))
    if target_ref in (None, "", DEFAULT_TARGET):  # the shipped drafter's own target (llama, full attention)
        return ModelPair(None, drafter)
    target_dir = resolve_target(target_ref)
    check_target_dir(target_dir, max_context, repr(target_ref), context_fix)
    if drafter == "none" or not (drafter or (DEFAULT_DRAFTER_DIR / "config.json").is_file()):
        return ModelPair(target_dir, drafter)
    why = drafter_mismatch(Path(drafter or DEFAULT_DRAFTER_DIR), read_config(target_dir))
    if why is None:
        return ModelPair(target_dir, drafter)
    if drafter:
        raise ValueError(f"--drafter {drafter_ref}: {why}")
    if ar_only:
        return ModelPair(target_dir, "none", f"no shipped drafter fits target {target_ref!r}: plain decoding only")
    raise ValueError(f"target {target_ref!r} has no matching shipped drafter ({why}): pass --drafter DIR or "
                     f"HUB_ID (a drafter made for this target), or serve plain decoding with {ar_flag}")
