"""What the check's code paths need from torch and transformers, probed on the machine that runs it.

The lent GPU images bring torch 2.11 and transformers 5.17; the project pins newer ones. The check
refuses versions below :data:`MIN_VERSIONS` (one line) and, above them, probes every API of
:data:`FEATURES` before it runs: an API that is missing is listed in the JSON's ``skipped`` with
the package version and the part of the check that cannot run without it, and that part is left
out (e.g. no CUDA-graph cells without ``torch.cuda.graph``).

:data:`VERSION_GATED` names the calls whose spelling differs between the versions in use; they are
made only in the modules listed there (transformers' through :mod:`services.hf_compat`), which the
tests check on the source of ``services/`` and of this check.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata

MIN_VERSIONS = {"torch": "2.11", "transformers": "5.17"}  # what the lent GPU images bring


@dataclass(frozen=True)
class Feature:
    """An API the check's code paths call: ``api`` (dotted path), what uses it, and what is skipped
    without it (``skips``: a key of :func:`skipped_parts`' plan, or ``""``: only reported)."""

    api: str
    used_by: str
    skips: str = ""


FEATURES = (
    Feature("torch.cuda.graph", "services.cuda_graphs (captured verify steps)", "graphs"),
    Feature("torch.cuda.CUDAGraph", "services.cuda_graphs (captured verify steps)", "graphs"),
    Feature("torch.library.custom_op", "services.verifier.slot_attention (the slot attention op)"),
    Feature("torch.compiler.nested_compile_region", "services.hf_compat / lean_step (compiled steps)"),
    Feature("torch.nn.attention.flex_attention.flex_attention", "a device-built tree mask (block mask)"),
    Feature("transformers.AttentionInterface", "services.hf_compat.register_slot_attention"),
    Feature("transformers.masking_utils.sdpa_mask", "services.hf_compat.register_slot_attention"),
    Feature("transformers.integrations.sdpa_attention.sdpa_attention_forward", "services.hf_compat.sdpa_attention"),
    Feature("transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS", "services.hf_compat.rope_inv_freq"),
    Feature("transformers.Qwen3ForCausalLM", "the Qwen3-shaped targets", "qwen3"),
)

# call or import names whose spelling differs across the supported versions -> the only source files
# (relative to the repository) allowed to use them directly
VERSION_GATED = {
    "AttentionInterface": ("services/hf_compat.py",),
    "masking_utils": ("services/hf_compat.py",),
    "sdpa_attention_forward": ("services/hf_compat.py",),
    "modeling_rope_utils": ("services/hf_compat.py",),
    "DynamicCache": ("services/hf_compat.py",),
    "key_cache": ("services/hf_compat.py",),
    "past_key_values": ("services/hf_compat.py",),
    "set_attn_implementation": ("services/hf_compat.py",),
    "nested_compile_region": ("services/hf_compat.py", "services/verifier/lean_step.py"),
    "flex_attention": ("services/hf_compat.py", "benchmarks/gpu_check/compat.py"),
}


def resolve(api: str):
    """The object at dotted path ``api`` (the longest importable module prefix, then attributes).

    Raises:
        ImportError / AttributeError: it does not exist here.
    """
    parts = api.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            if i == 1:
                raise
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(api)


def probe(features=None) -> list[dict]:
    """Per feature of ``features`` (None: :data:`FEATURES`): ``api``, ``used_by``, ``available`` and,
    when missing, ``reason`` (package and version, the error)."""
    out = []
    for f in FEATURES if features is None else features:
        row = {"api": f.api, "used_by": f.used_by, "available": True}
        try:
            resolve(f.api)
        except (ImportError, AttributeError) as e:
            pkg = f.api.split(".")[0]
            row.update(available=False, skips=f.skips,
                       reason=f"not in {pkg} {metadata.version(pkg)} ({type(e).__name__}: {e})"[:300])
        out.append(row)
    return out


def missing_skips(features: list[dict]) -> set[str]:
    """The parts of the check (``skips`` keys) that cannot run with these probe results."""
    return {f["skips"] for f in features if not f["available"] and f.get("skips")}


def skipped_lines(features: list[dict]) -> list[str]:
    """One ``skipped`` line per missing API: what it is, why, what is left out."""
    return [f"{f['api']}: {f['reason']}; needed by {f['used_by']}"
            + (f" ({f['skips']} left out)" if f.get("skips") else "") for f in features if not f["available"]]


def version_too_old() -> str | None:
    """The first package older than :data:`MIN_VERSIONS` (one line), or None."""
    from packaging.version import Version

    for name, least in MIN_VERSIONS.items():
        have = metadata.version(name)
        if Version(have).release < Version(least).release:
            return f"{name} {have} is older than the {least} this check supports"
    return None
