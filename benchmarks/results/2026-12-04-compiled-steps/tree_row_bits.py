"""One token three ways deep: as plain decoding's 1-row steps (t1, t2, t3) and as one tree verify
[t1, t2, sibling s of t2, t3 under t2] (eager runner, SmolLM2 q4, random prompts of 40-600 tokens).
Counts the trials where t3's logits differ in their bits and, for those, the first layer whose
K/V of t3 differ (t3 sits at column P + 2 in the chain, P + 3 behind the masked sibling in the tree).

    python benchmarks/results/2026-12-04-compiled-steps/tree_row_bits.py [THREADS]
"""
import sys, torch, random
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
from services.generate import build_inprocess
from services.weights import compute_dtype
from services.tree.batch import Segment, causal_segment
from services.verifier.runner import ModelRunner
engine, tok, _ = build_inprocess(None, None, compute_dtype("q4"), weights="q4", compile=False)
tgt = engine.target
run = ModelRunner(tgt, num_slots=2, capacity=2048, kv_bucket=64)
rng = random.Random(0)
diffs = {"logit": 0, "kv_layer_first": {}}
N = 30
for trial in range(N):
    P = rng.randrange(40, 600)
    prompt = [rng.randrange(100, 40000) for _ in range(P)]
    t1, t2, s, t3 = (rng.randrange(100, 40000) for _ in range(4))
    a, b = run.cache.alloc(), run.cache.alloc()
    for slot in (a, b):
        run.execute([causal_segment(prompt, 0, slot)], torch.tensor([P - 1])); run.cache.extend(slot, P)
    chain = []
    for t in (t1, t2, t3):
        out = run.execute([causal_segment([t], run.cache.length(a), a)]); run.cache.extend(a, 1); chain.append(out.logits[0])
    ids = torch.tensor([t1, t2, s, t3]); off = torch.tensor([0, 1, 1, 2])
    m = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    out = run.execute([Segment(ids, off, m, P, b)])
    if not torch.equal(out.logits[3], chain[2]):
        diffs["logit"] += 1
    # K/V of t3: chain column P+2, tree column P+3
    for layer in range(len(run.cache.keys)):
        ka, kb = run.cache.keys[layer][a, :, P + 2], run.cache.keys[layer][b, :, P + 3]
        va, vb = run.cache.values[layer][a, :, P + 2], run.cache.values[layer][b, :, P + 3]
        if not (torch.equal(ka, kb) and torch.equal(va, vb)):
            diffs["kv_layer_first"][layer] = diffs["kv_layer_first"].get(layer, 0) + 1
            break
    # t2's row (no gap) for reference
    run.cache.free(a); run.cache.free(b)
print(sys.argv, "of", N, "trials:", diffs)
