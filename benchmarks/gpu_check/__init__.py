"""``make gpu-check``: on a CUDA machine, the gpu-marked tests, the served stack and the round cost, in one go.

Questions answered, on this GPU (or on the CPU with ``--smoke``, tiny configs, what CI runs):

1. **Tests**: do the gpu-marked tests pass (``pytest -m gpu`` on the files that use the marker)?
2. **Served** (:mod:`~benchmarks.gpu_check.serve`): do the gateway, the verifier and the drafter,
   as separate processes started by ``dartree serve`` (CUDA IPC between the two workers on a GPU),
   serve 8 concurrent streams on a tiny random-weight model whose token ids equal plain decoding on
   the same server, and how long does the server take to be ready? Run again under MPS where the
   machine has ``nvidia-cuda-mps-control`` (else the JSON says ``mps: not available``).
3. **Round cost** (:mod:`~benchmarks.gpu_check.engines`, :mod:`~benchmarks.gpu_check.breakdown`):
   where does a speculative round's time go (draft / tree build / verify / commit) per method and
   tree budget B = 8 / 16 / 32 / 64, for Qwen3-4B- and Qwen3-8B-shaped targets (SmolLM2-135M with
   ``--shapes``), random weights, bfloat16? How much do CUDA graphs save on a verify-sized forward,
   and what does one verify step of 1 ... 129 rows cost per attention path
   (:mod:`benchmarks.gpu_verify_curve`)? With ``--graphs`` (the default) ``ar`` and
   ``dartree-pruned`` also run on an engine whose runner captures its padded steps in CUDA graphs.
4. **Predicted speedup** (:mod:`~benchmarks.gpu_check.predict`): τ(B) × t_step(1 row) / t_round(B)
   per budget from the measured round cost and our replayed τ (the paper's per-budget τ are not in
   the repository: ``--paper-tau B=τ`` adds them).

Writes ``<out>/gpu_check.json`` and ``<out>/gpu_check.png`` (phases per round; predicted speedup
per budget); prints a table and, last, one JSON line. Stays under ``--time-limit`` seconds (default
420: < 8 min with start-up); cells past it are reported as skipped.

On a bare machine without network (an image with torch and transformers but not the serving
stack), ``--bundle DIR`` first unpacks the wheels ``make gpu-bundle`` wrote into a scratch target
directory, puts it first on ``sys.path`` (and on the ``PYTHONPATH`` of the tests and of the served
processes) and imports every module the check needs; the JSON's ``bundle`` section lists each
module's version and whether it came from the bundle or the image (:mod:`benchmarks.gpu_bundle`).
Needs torch >= 2.11 and transformers >= 5.17 (refused below, one line); an API the code paths need
that this torch or transformers lacks is listed under ``skipped`` with its reason, and the part
that needs it is left out (:mod:`~benchmarks.gpu_check.compat`).

Usage: ``make gpu-check [OUT=dir]`` or ``python -m benchmarks.gpu_check --out DIR [--smoke] [--bundle DIR]``.
Exit code 0 when the tests passed (under --smoke: skipped, no GPU), the served streams equalled
plain decoding and every cell ran, 1 otherwise, 2 on bad arguments.
"""

from benchmarks.gpu_check.compat import MIN_VERSIONS
from benchmarks.gpu_check.engines import PHASES
from benchmarks.gpu_check.cli import main

__all__ = ["MIN_VERSIONS", "PHASES", "main"]
