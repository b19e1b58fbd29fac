"""Where the engine's draft phase goes at c = 1 (q4, 1 thread, fixed B = 3, six GSM8K prompts x 64 tokens):
the engine's job preparation, the drafter's context append, block forward and tree build, each timed by a
wrapper. Run from a checkout: ``PYTHONPATH=$PWD python draft_path.py``.

Measured at commit 9a75e25 (``commit.txt``, ``draft_path.log``), where the engine's own ``_draft_job`` and
``_submit`` made and sent the jobs; since the engine was carved by concern they are its drafter link's
``job`` and ``submit`` (``services/verifier/drafts.py``), timed here under the same names. A wrapped
method that no longer exists stops the script with one line naming it.
"""
import functools
import statistics
import sys
import time

import torch

# (owner, method, key in the printout): the owner is found from the engine at run time
WRAPPED = (("drafts", "job", "draft_job"), ("drafts", "submit", "submit"), ("service", "draft_batch", "draft_batch"),
           ("service", "append_context", "append_context"), ("service", "_block", "block"),
           ("service", "_build", "build"))


def instrument(engine, timings: dict) -> None:
    """Wrap each :data:`WRAPPED` method of ``engine``'s drafter link / in-process drafter service so that
    every call appends its wall seconds to ``timings[key]``; exits with one line when one is missing."""
    owners = {"drafts": getattr(engine, "drafts", None), "service": getattr(engine.drafter, "service", None)}
    for owner, name, key in WRAPPED:
        obj = owners[owner]
        if obj is None or not callable(getattr(obj, name, None)):
            sys.exit(f"draft_path.py: engine.{owner}.{name} is gone; this script times the draft path of "
                     "the engine as of 2026-12-07 (engine.drafts: DrafterLink) and of commit 9a75e25 before that")
        f = getattr(obj, name)

        @functools.wraps(f)
        def timed(*a, _f=f, _key=key, **k):
            t0 = time.perf_counter()
            r = _f(*a, **k)
            timings.setdefault(_key, []).append(time.perf_counter() - t0)
            return r
        setattr(obj, name, timed)


def main() -> None:
    from benchmarks.bench_goodput import _prompts, run_level
    from services.generate import build_inprocess

    torch.set_num_threads(1)
    engine, tok, note = build_inprocess(None, None, torch.bfloat16, weights="q4")
    timings: dict[str, list[float]] = {}
    instrument(engine, timings)
    prompts = _prompts(tok, "gsm8k", 6)
    run_level(engine, prompts[:1], 1, "dartree-pruned", 3, 16)
    timings.clear()
    r = run_level(engine, prompts, 1, "dartree-pruned", 3, 64)
    print("tau", r["tau"], r["step_ms"])
    for k, v in timings.items():
        print(f"{k:15s} n {len(v):4d} median {1e3 * statistics.median(v):.3f} ms mean {1e3 * statistics.mean(v):.3f}")


if __name__ == "__main__":
    main()
