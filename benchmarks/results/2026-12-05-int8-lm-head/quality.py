"""What serving SmolLM2-135M's lm_head as int8 rows (one scale per row, ``services.weights.Int8RowLinear``)
does to the logits, against the GGUF's exact Q8_0 values, and what each form costs a call.

    python benchmarks/results/2026-12-05-int8-lm-head/quality.py > quality.txt

Hidden states: the float32 model's final-norm output over the first 2,048 tokens of README.md and
docs/serving.md. Reference logits: those states (float32) times the exact Q8_0 weights (``d * q``
per block of 32). Compared: the dense bfloat16 weight (the lm_head served before, states rounded to
bfloat16 as served), the int8 rows (the same bfloat16 states), and what llama.cpp computes (states
quantised to Q8_0 blocks of 32, as ggml does before its Q8_0 dot products). Per form: next-token
NLL of the text, the share of positions whose argmax equals the reference's, the mean |logit error|.
Timing: one call of M rows, 2 threads, caches evicted before each call (median of 30).
"""
import time

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.models import registry
from services.weights import gguf_source

torch.set_num_threads(2)
target = registry.cache_root() / registry.DEFAULT_TARGET
reader = gguf.GGUFReader(str(gguf_source(target)))
emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
N, G = emb.data.shape[0], emb.data.shape[1] // 34
K = G * 32
raw = np.asarray(emb.data).reshape(N, G, 34)
d = torch.from_numpy(raw[:, :, :2].copy().view(np.float16).reshape(N, G)).float()
q = torch.from_numpy(raw[:, :, 2:].copy().view(np.int8)).reshape(N, K)
W = (q.float().view(N, G, 32) * d[:, :, None]).view(N, K)  # exact Q8_0
Wb = W.to(torch.bfloat16)


def int8_rows(w):  # as Int8RowLinear.requantize
    s = (w.abs().amax(1) / 127).to(torch.bfloat16)
    return torch.round(w / s.float()[:, None]).clamp(-127, 127).to(torch.int8), s


q8, s = int8_rows(W)  # from the exact values (served)
q8b, sb = int8_rows(Wb.float())  # from the bfloat16-rounded weight

model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(target)
text = open("README.md").read()[:6000] + open("docs/serving.md").read()[:4000]
ids = tok(text, return_tensors="pt").input_ids[:, :2048]
with torch.no_grad():
    h = model.model(ids).last_hidden_state[0]
hb = h.to(torch.bfloat16)
ref = h @ W.T
nxt = ids[0, 1:]
hg = h.view(-1, G, 32)
dx = hg.abs().amax(2, keepdim=True) / 127
h_q8 = (torch.round(hg / dx.clamp(min=1e-30)) * dx.half().float()).view(-1, K)
forms = {
    "exact Q8_0, float32 states (reference)": ref,
    "dense bfloat16 (served before)": torch.nn.functional.linear(hb, Wb).float(),
    "int8 rows from exact Q8_0 (served now)": torch.ops.aten._weight_int8pack_mm(hb, q8, s).float(),
    "int8 rows from the bfloat16 weight": torch.ops.aten._weight_int8pack_mm(hb, q8b, sb).float(),
    "llama.cpp-like (Q8_0 states x Q8_0)": h_q8 @ W.T,
}
print(f"{len(nxt)} next-token positions")
print(f"{'form':42s} {'NLL':>8s} {'argmax = ref':>13s} {'mean |err|':>11s} {'max |err|':>10s}")
for name, y in forms.items():
    nll = torch.nn.functional.cross_entropy(y[:-1], nxt).item()
    agree = (y.argmax(1) == ref.argmax(1)).float().mean().item()
    err = (y - ref).abs()
    print(f"{name:42s} {nll:8.4f} {agree:13.4f} {err.mean().item():11.4f} {err.max().item():10.4f}")

big = torch.empty(16 * 1024 * 1024)


def median_ms(f, n=30):
    for _ in range(3):
        f()
    ts = []
    for _ in range(n):
        big.add_(1)
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


print("\nms a call (caches evicted), 2 threads")
print(f"{'rows':>4s} {'bf16 F.linear':>14s} {'int8 rows':>10s}")
for m in (1, 2, 4, 9, 17):
    x = hb[:m].contiguous()
    a = median_ms(lambda: torch.nn.functional.linear(x, Wb))
    b = median_ms(lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s))
    print(f"{m:4d} {a:14.3f} {b:10.3f}")
