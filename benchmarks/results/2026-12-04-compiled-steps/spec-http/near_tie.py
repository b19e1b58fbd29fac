"""Where a default-method answer differs from `ar`'s at T = 0, how close were the target's top two
tokens there? Starts the default server (q4), sends one prompt with `ar` and then with the default
method ``--tries`` times (each with the target's top-5 logprobs), and prints, for each answer that
differs, the first differing position with `ar`'s two best logprobs at it.

    PYTHONPATH=<checkout> python near_tie.py --uid sharegpt/991 --tries 6 [--serve-args ...]
"""
import argparse
import json
import sys
from pathlib import Path

import httpx

from benchmarks.bench_small_trees import _prompts
from services.models.registry import resolve_target
from services.testing import start_server


def ask(base, ids, method, n):
    body = {"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 5,
            "return_token_ids": True}
    if method:
        body["speculative"] = {"method": method}
    r = httpx.post(base + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    ch = r.json()["choices"][0]
    return ch["token_ids"], ch["logprobs"]["top_logprobs"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--uid", default="sharegpt/991")
    p.add_argument("--tries", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[])
    a = p.parse_args()
    ds = a.uid.split("/")[0]
    ids = dict(_prompts(resolve_target("smollm2-135m-instruct"), [ds], 8))[a.uid]
    out = {"uid": a.uid, "tries": []}
    with start_server("--weights", "q4", *a.serve_args, log=Path("/tmp/near-tie-serve.log")) as srv:
        ref, ref_top = ask(srv.base, ids, "ar", a.max_tokens)
        for _ in range(a.tries):
            got, got_top = ask(srv.base, ids, None, a.max_tokens)
            if got == ref:
                out["tries"].append({"same": True})
                continue
            k = next(i for i, (x, y) in enumerate(zip(ref, got)) if x != y)
            top = sorted(ref_top[k].items(), key=lambda kv: -kv[1])[:2]
            gtop = sorted(got_top[k].items(), key=lambda kv: -kv[1])[:2]
            out["tries"].append({"same": False, "position": k, "ar_top2": top, "default_top2": gtop,
                                 "ar_margin": top[0][1] - top[1][1]})
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
