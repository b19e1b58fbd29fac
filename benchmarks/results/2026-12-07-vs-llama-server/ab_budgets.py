"""One stream, our server alone: plain decoding against per-request tree budgets, interleaved.

Starts ``python -m services.serve --weights q4 --max-running 8`` plus the given flags, then sends the
3 GSM8K-style prompts of :mod:`benchmarks.vs_llama_server` (128 tokens, T = 0, ``ignore_eos``) per arm:
``ar`` (``"speculative": {"method": "ar"}``), the server's default, and ``"speculative": {"budget": B}``
for B = 1, 2, 3; two passes, the second in reverse order. Prints per arm the decode tok/s of each pass
and the best pass over ``ar``'s best. Run from the repository root:

    PYTHONPATH=$PWD python benchmarks/results/2026-12-07-vs-llama-server/ab_budgets.py --spec-policy fixed
    DARTREE_NATIVE_ATTENTION=aten PYTHONPATH=$PWD python benchmarks/results/2026-12-07-vs-llama-server/ab_budgets.py --spec-policy fixed
"""
import sys, json, httpx
from benchmarks.vs_llama_server import chat, decode_tps, PROMPTS, _start, _stop
from services.runtime import free_loopback_ports
port, vp, dp = free_loopback_ports(3)
extra = sys.argv[1:]
argv = [sys.executable, "-m", "services.serve", "--port", str(port), "--verifier-metrics-port", str(vp),
        "--drafter-metrics-port", str(dp), "--weights", "q4", "--max-running", "8"] + extra
base = f"http://127.0.0.1:{port}"
proc = _start(argv, base + "/health/ready", "/tmp/ab-server.log", 900)
arms = {"ar": {"speculative": {"method": "ar"}}, "default": None,
        "B1": {"speculative": {"budget": 1}}, "B2": {"speculative": {"budget": 2}}, "B3": {"speculative": {"budget": 3}}}
res = {k: [] for k in arms}
try:
    with httpx.Client(timeout=600) as c:
        for k, e in arms.items():
            chat(c, base, [{"role": "user", "content": PROMPTS[0]}], 16, e)
        for p in range(2):
            for k, e in (list(arms.items())[p % 2::1] if p % 2 == 0 else list(reversed(arms.items()))):
                recs = [chat(c, base, [{"role": "user", "content": q}], 128, e) for q in PROMPTS[:3]]
                res[k].append(decode_tps(recs))
finally:
    _stop(proc)
ar = max(res["ar"])
print(json.dumps({k: [round(v, 1) for v in vals] + [round(max(vals) / ar, 3)] for k, vals in res.items()}))
