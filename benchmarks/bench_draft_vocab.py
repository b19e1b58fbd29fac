"""Draft cost and replayed τ of one drafter cut to frequency-ranked draft vocabularies.

For each draft vocabulary size N (0 = the full vocabulary) the drafter is cut to the N most
frequent ids of ``--counts`` (``python -m services.training.vocab``) WITHOUT retraining
(:func:`services.drafter.model.reduce_draft_vocab`: logits at the kept ids are unchanged), then
dartree-pruned rounds are replayed at T = 0 against the target's greedy output on held-out prompts
(:mod:`services.replay`). Reported per N: τ, and the median per-round drafter time (``draft`` = block
forward + output projection, ``tree_build``), next to the median ``ar`` step of the target measured
in the same run; ``coverage``: share of the counted tokens inside the map; ``heldout_coverage``:
share of the held-out greedy reference tokens inside it. A drafter that already has a reduced map (e.g. the
shipped v2) is measured over its own map only (``--sizes 0``; other sizes exit with one line). Sizes are interleaved prompt by prompt so that background load hits all alike.

    python -m benchmarks.bench_draft_vocab --counts data/vocab_counts.pt --sizes 8192 16384 0 --threads 1

``--weights`` picks the target's weight format (default float32); the drafter runs as ``dartree
serve --weights`` runs it (:func:`services.weights.drafter_dtype`: float32 on a CPU without native bf16), so the ratio is
the one a served round pays; ``--drafter-dtype`` overrides that (e.g. bfloat16 to compare).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None, help="drafter dir (default: the shipped drafter)")
    ap.add_argument("--counts", default="data/vocab_counts.pt")
    ap.add_argument("--sizes", type=int, nargs="+", default=None,
                    help="draft vocabulary sizes; 0 = full (default: 8192 16384 0 for a full-vocabulary drafter, "
                         "0 = its own map for a reduced one)")
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--width", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (datasets.load_heldout)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--weights", default="float32", choices=["float32", "bfloat16", "q4"],
                    help="the target's weight format (the drafter runs as `dartree serve --weights FMT` runs it: "
                         "services.weights.drafter_dtype)")
    ap.add_argument("--drafter-dtype", default=None, choices=["float32", "bfloat16"],
                    help="run the drafter in this dtype instead (default: as the server does)")
    ap.add_argument("--turns-cache", default=None,
                    help="cache of the greedy references (e.g. data/train/heldout_turns.pt; reused when it matches)")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    a = ap.parse_args(argv)
    if not Path(a.counts).is_file():
        raise SystemExit(f"bench_draft_vocab: no token counts at {a.counts} (python -m services.training.vocab writes them)")
    torch.set_num_threads(a.threads)
    from services.drafter.model import load_drafter, reduce_draft_vocab
    from services.drafter.build import borrow_target_io, build_drafter
    from services.models.registry import DEFAULT_DRAFTER_DIR, resolve_target
    from services.replay import replay_rounds
    from services.training.heldout import greedy_turns, heldout_prompt_ids
    from services.training.vocab import coverage, top_ids
    from services.verifier.drafter_client import InprocDrafterClient
    from services.spec import DEFAULT_KNOBS, TreeKnobs
    from services.verifier.build import build_engine
    from services.params import SamplingParams, SpecParams
    from services.verifier.target import TargetModel
    from services.weights import compute_dtype, drafter_dtype

    tdir = resolve_target(a.target)
    ddtype = getattr(torch, a.drafter_dtype) if a.drafter_dtype else drafter_dtype(compute_dtype(a.weights))
    ddir = Path(a.drafter) if a.drafter else DEFAULT_DRAFTER_DIR
    try:
        full = load_drafter(ddir, dtype=ddtype)
    except (FileNotFoundError, ValueError) as e:  # load_drafter names the missing / damaged file
        raise SystemExit(f"bench_draft_vocab: {ddir} is not a drafter directory ({e})") from None
    own = full.draft_to_target()  # an already-reduced drafter is measured over its own map only
    if own is not None:
        if a.sizes is not None and any(n not in (0, own.numel()) for n in a.sizes):
            raise SystemExit(f"bench_draft_vocab: {ddir} already drafts over {own.numel()} ids; "
                             f"it cannot be cut to other sizes (use --sizes 0, or a full-vocabulary drafter)")
        a.sizes = [0]
    elif a.sizes is None:
        a.sizes = [8192, 16384, 0]
    try:
        target = TargetModel.from_pretrained(tdir, full.config.target_layer_ids, weights=a.weights)
    except ValueError as e:  # a format this machine cannot run (one line)
        raise SystemExit(f"bench_draft_vocab: {e}") from None
    embed, head = borrow_target_io(target.embed_tokens(), target.lm_head(), ddtype)  # as the drafter worker does
    saved = torch.load(a.counts)
    counts = saved["counts"]
    engines, maps = {}, {}
    for n in a.sizes:
        d = full if n in (0, full.config.vocab_size) else reduce_draft_vocab(
            full, top_ids(counts, n, target.eos_token_ids, secondary=saved.get("secondary")))
        maps[n] = d.draft_to_target()
        svc = build_drafter(d, embed, head)  # the requests set --budget / --width themselves
        engines[n] = build_engine(target, InprocDrafterClient(svc), max_draft_depth=full.config.num_draft_slots,
                                  defaults=TreeKnobs(a.budget, a.width).filled_from(DEFAULT_KNOBS))
    ar = build_engine(target, None, packed_gemm=False)
    turns = greedy_turns(target, heldout_prompt_ids(tdir, a.prompts), a.max_tokens,
                         Path(a.turns_cache) if a.turns_cache else None)
    spec = SpecParams("dartree-pruned", budget=a.budget, width=a.width)
    per = {n: {"rounds": 0, "emitted": 0, "draft": [], "tree_build": []} for n in a.sizes}
    ar_steps: list[float] = []
    for k, t in enumerate(turns):
        outs = list(ar.generate(f"ar-{k}", t.prompt_ids, SamplingParams(max_tokens=32), SpecParams("ar")))
        ar_steps += [o.timings["total"] for o in outs[1:]]
        for n in a.sizes:
            for r in replay_rounds(engines[n], t.prompt_ids, t.ref, t.finish, spec, f"v{n}-{k}"):
                p = per[n]
                p["rounds"] += 1
                p["emitted"] += r.emitted
                if r.timings:
                    p["draft"].append(r.timings["draft"])
                    p["tree_build"].append(r.timings["tree_build"])
    ar_ms = 1e3 * statistics.median(ar_steps)
    cov = coverage(counts, [n for n in a.sizes if n])
    ref_toks = torch.tensor([x for t in turns for x in t.ref], dtype=torch.long)

    def heldout_cov(n: int) -> float:  # share of the held-out greedy tokens the draft vocabulary holds
        m = maps[n]
        return 1.0 if m is None else float(torch.isin(ref_toks, m).double().mean())
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "drafter": str(ddir), "budget": a.budget,
           "width": a.width, "prompts": len(turns), "max_tokens": a.max_tokens, "threads": a.threads,
           "weights": a.weights, "drafter_dtype": str(ddtype).removeprefix("torch."),
           "counted_tokens": int(counts.sum()), "ar_step_ms": round(ar_ms, 2), "sizes": {}}
    if own is not None:  # share of the counted tokens inside the drafter's own map
        cov[0] = float(counts[own].sum()) / max(float(counts.sum()), 1.0)
    for n, p in per.items():
        dm, tm = 1e3 * statistics.median(p["draft"]), 1e3 * statistics.median(p["tree_build"])
        res["sizes"][str(n or (own.numel() if own is not None else full.config.vocab_size))] = {
            "tau": round(p["emitted"] / p["rounds"], 3), "draft_ms": round(dm, 2), "tree_build_ms": round(tm, 2),
            "draft_phase_over_ar": round((dm + tm) / ar_ms, 3), "coverage": round(cov.get(n, 1.0), 4),
            "heldout_coverage": round(heldout_cov(n), 4)}
    print(json.dumps(res, indent=2))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
