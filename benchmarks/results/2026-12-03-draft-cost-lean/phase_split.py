"""Phase split of one request's draft round at small budgets, shipped drafter, bfloat16 + int4 linears.

Run from a checkout's root: ``PYTHONPATH=$PWD python <this file> --threads 1 --rounds 300``.
Per round: append 2 new random feature rows to a ~300-800 position context (``append_context``),
the block forward over B + 1 rows (``_block`` less the output projection), the output projection
over the B reachable slots (the borrowed lm_head, timed alone), and the ``dartree-pruned`` build
(``_build``, W = 12, K = 64, beta = -0.2). Medians in ms; the last stdout line is JSON.
"""
import argparse
import json
import statistics
import time

import torch

from services.drafter.model import load_drafter
from services.drafter.build import load_borrowed_weights
from services.drafter.service import DrafterService
from services.models.registry import DEFAULT_DRAFTER_DIR, resolve_target
from services.spec import TreeKnobs


class _Timed(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m, self.weight, self.seconds = m, m.weight, 0.0

    def forward(self, x):
        t0 = time.perf_counter()
        y = self.m(x)
        self.seconds = time.perf_counter() - t0
        return y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=300)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dr = load_drafter(DEFAULT_DRAFTER_DIR, dtype=torch.bfloat16)
    embed, head = load_borrowed_weights(resolve_target(None), torch.bfloat16)
    svc = DrafterService(dr, embed, head)
    svc.lm_head = _Timed(svc.lm_head)
    g = torch.Generator().manual_seed(0)
    feat = dr.config.feature_dim
    start, out = 0, {}
    with torch.inference_mode():
        for b in (1, 2, 3):
            spec, t = TreeKnobs(b, 12, -0.2, 64), {}
            for it in range(a.rounds + 10):
                if start == 0 or start > 800:
                    svc.release("r")
                    svc.append_context("r", torch.randn(300, feat, generator=g).bfloat16(), 300)
                    start = 300
                rows = torch.randn(2, feat, generator=g).bfloat16()
                t0 = time.perf_counter()
                svc.append_context("r", rows, start + 2)
                start += 2
                t1 = time.perf_counter()
                hd, base = svc._block("r", 123, start, b)
                t2 = time.perf_counter()
                svc._build("dartree-pruned", spec, hd[:b], base[:b], 123)
                t3 = time.perf_counter()
                proj = svc.lm_head.seconds
                if it >= 10:
                    for k, s in (("append", t1 - t0), ("block", t2 - t1 - proj), ("projection", proj),
                                 ("build", t3 - t2)):
                        t.setdefault(k, []).append(s)
            out[b] = {k: round(1e3 * statistics.median(v), 3) for k, v in t.items()}
            out[b]["sum"] = round(sum(out[b].values()), 3)
            print(b, out[b], flush=True)
    print(json.dumps({"threads": a.threads, "rounds": a.rounds, "ms": out}))


if __name__ == "__main__":
    main()
