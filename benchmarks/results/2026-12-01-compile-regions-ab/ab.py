import sys, time, json, torch
torch.set_num_threads(1)
from services.generate import build_inprocess, encode
from services.weights import compute_dtype
from services.verifier.engine import EngineConfig, SpecEngine
from services.models.registry import GGUF_FILE, _gguf_dir
from benchmarks.bench_step import engine_stats, llama_cpp_peer, llama_cpp_ms, PROMPT
engine, tok, _ = build_inprocess(None, None, compute_dtype("q4"), weights="q4")
t0 = time.perf_counter()
e = SpecEngine(engine.target, engine.drafter, EngineConfig(compile=True), max_draft_depth=engine.max_draft_depth)
w = e.runner.warm_up((1, 9, 17))
llm = llama_cpp_peer(_gguf_dir() / GGUF_FILE, 4096, 1)
ids = encode(tok, PROMPT, chat=True)
engine_stats(e, ids, 8, "ar")
ours, peer, v9, tok_ms = [], [], [], []
for _ in range(int(sys.argv[2])):
    r = engine_stats(e, ids, 64, "ar"); ours.append(r["forward_ms"][1]); tok_ms.append(r["ms_per_token"])
    peer.append(llama_cpp_ms(llm, ids, 64)["ms_per_token"])
    v9.append(engine_stats(e, ids, 32, "dartree-pruned", 8)["forward_ms"].get(9, float("nan")))
import statistics as st
print(json.dumps({"tree": sys.argv[1], "warm_up_s": round(w, 1), "ar_fwd_ms": round(st.median(ours), 2), "llama_ms": round(st.median(peer), 2),
                  "ratio_fwd": round(st.median(peer) / st.median(ours), 3), "ar_ms_tok": round(st.median(tok_ms), 2), "ratio": round(st.median(peer) / st.median(tok_ms), 3), "v9_x": round(st.median(v9) / st.median(ours), 2),
                  "ours": [round(x, 1) for x in ours], "peer": [round(x, 1) for x in peer]}), flush=True)
