"""The lm_head over the GGUF's Q8_0 blocks (int8 values, one scale per 32) with torch's kernels, at
SmolLM2-135M's shape (49,152 x 576), one row, 2 threads, caches evicted before each call.

    python benchmarks/results/2026-12-05-serving-overhead/lm_head_probe.py

``bf16``: the dense bfloat16 weights through ``F.linear`` (the served lm_head runs the oneDNN-packed
form of these, 1.23 ms in the profile). ``q8``: the activations quantised per 32 values (as ggml
does) and placed block-diagonally in a [576, 18] int8 matrix, one ``torch._int_mm`` giving every
row's 18 group dot products exactly in int32 (so a row's result cannot depend on the other rows),
then the scales applied in float32.
"""
import torch, time
torch.set_num_threads(2)
N,K,G=49152,576,18
q=torch.randint(-127,128,(N,K),dtype=torch.int8)
d=torch.rand(N,G)*0.01
wb=(q.float().view(N,G,32)*d[:,:,None]).view(N,K).to(torch.bfloat16)
x=torch.randn(1,K,dtype=torch.bfloat16)
big=torch.empty(64*1024*1024//4)
def evict(): big.add_(1)
def t(f,n=20):
    for _ in range(3): f()
    ts=[]
    for _ in range(n):
        evict(); s=time.perf_counter(); f(); ts.append(time.perf_counter()-s)
    ts.sort(); return ts[len(ts)//2]*1e3
lin=torch.nn.Linear(K,N,bias=False).to(torch.bfloat16); lin.weight.data=wb
def bf16(): return torch.nn.functional.linear(x,wb)
eye=torch.zeros(G,K,dtype=torch.bool)
for g in range(G): eye[g,g*32:(g+1)*32]=True
def q8():
    xg=x.float().view(G,32)
    dx=xg.abs().amax(1)/127
    xq=torch.round(xg/dx[:,None].clamp(min=1e-30)).to(torch.int8)  # [G,32]
    xbd=torch.zeros(K,G,dtype=torch.int8)
    xbd.view(G,32,G)[torch.arange(G),:,torch.arange(G)]=xq
    P=torch._int_mm(q,xbd)  # [N,G] int32
    return (P.float()*d*dx).sum(1)
try:
    print('bf16 F.linear %.3f ms'%t(bf16))
    print('q8 int_mm %.3f ms'%t(q8))
    ref=(q.float().view(N,G,32)*d[:,:,None]).view(N,K)@x.float()[0]
    print('err bf16', (bf16().float()[0]-ref).abs().max().item(), 'err q8', (q8()-ref).abs().max().item())
    xbd=torch.zeros(K,G,dtype=torch.int8)
    print('int_mm alone %.3f ms'%t(lambda: torch._int_mm(q,xbd)))
    print('int_mm M=9 style (N=162) %.3f ms'%t(lambda: torch._int_mm(q,torch.zeros(K,G*9,dtype=torch.int8))))
except Exception as e: print('ERR',e)
