"""Self-distillation data: the target's own greedy and sampled continuations of training prompts.

Batched generation (left padding, bf16 on CPU), written in shards under ``out_dir`` and resumable:
a shard that exists is skipped. Each shard is a list of ``{"uid", "prompt_ids", "response_ids",
"sampled"}`` (response cut after the first EOS, EOS kept).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from services.datasets import load_train


def encode_prompt(tok, prompt, max_prompt_tokens: int) -> list[int]:
    """Token ids of a prompt (chat template with generation prompt, or raw text), truncated."""
    if prompt.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt.turns[0]}], tokenize=True,
                                      add_generation_prompt=True, return_dict=False)
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        return list(ids)[-max_prompt_tokens:]
    return tok.encode(prompt.turns[0])[:max_prompt_tokens]


def generate_shard(model, tok, batch: list[tuple[str, list[int]]], max_new_tokens: int, sampled: bool,
                   seed: int) -> list[dict]:
    """Generate continuations for one batch of (uid, prompt_ids) with left padding."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for _, p in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    att = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (_, p) in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        att[i, width - len(p):] = 1
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens,
                             do_sample=sampled, temperature=1.0 if sampled else None, top_p=None, top_k=None,
                             pad_token_id=pad, eos_token_id=tok.eos_token_id)
    rows = []
    for i, (uid, p) in enumerate(batch):
        resp = out[i, width:].tolist()
        if tok.eos_token_id in resp:
            resp = resp[:resp.index(tok.eos_token_id) + 1]
        rows.append({"uid": uid, "prompt_ids": p, "response_ids": resp, "sampled": sampled})
    return rows


LAYOUT_KEYS = ("num_prompts", "batch_size", "max_prompt_tokens", "max_new_tokens", "sampled_every")


def check_layout(out: Path, a) -> None:
    """Record the flags that define which prompts a shard holds in ``out/datagen.json``; refuse a resume
    with different ones (a shard that exists is skipped, so other flags would silently mix layouts).

    Raises:
        ValueError: ``out`` holds shards of another layout.
    """
    layout = {k: getattr(a, k) for k in LAYOUT_KEYS}
    path = out / "datagen.json"
    if path.exists():
        saved = json.loads(path.read_text())
        diff = {k: (saved.get(k), v) for k, v in layout.items() if saved.get(k) != v}
        if diff:
            raise ValueError(f"{out} holds shards made with other flags {diff} (saved, given): resume with the "
                             "saved ones or use another --out-dir")
    else:
        path.write_text(json.dumps(layout, indent=2))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="generate self-distillation data for drafter training")
    ap.add_argument("--target", default=None)
    ap.add_argument("--out-dir", default="data/gen")
    ap.add_argument("--num-prompts", type=int, default=3000)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--sampled-every", type=int, default=5, help="every k-th batch is sampled at T=1")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: 0 = torch's)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.models.registry import resolve_target

    path = resolve_target(a.target)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, a.dtype)).eval()
    prompts = load_train(a.num_prompts)
    enc = [(p.uid, encode_prompt(tok, p, a.max_prompt_tokens)) for p in prompts]
    enc.sort(key=lambda x: len(x[1]))  # batch similar lengths together: less padding
    batches = [enc[i:i + a.batch_size] for i in range(0, len(enc), a.batch_size)]
    order = list(range(len(batches)))
    torch.Generator().manual_seed(0)
    order = [order[i] for i in torch.randperm(len(order), generator=torch.Generator().manual_seed(0)).tolist()]
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_layout(out, a)
    t0, new_tokens = time.time(), 0
    todo = sum(not (out / f"shard_{b:05d}.pt").exists() for b in order)
    print(f"[datagen] {len(enc)} prompts, {len(batches)} shards of {a.batch_size}, {todo} to generate", flush=True)
    bar = tqdm(order, desc="datagen", mininterval=60)
    for b in bar:
        shard = out / f"shard_{b:05d}.pt"
        if shard.exists():
            continue
        rows = generate_shard(model, tok, batches[b], a.max_new_tokens, sampled=(b % a.sampled_every == 0), seed=b)
        tmp = shard.with_suffix(".tmp")
        torch.save(rows, tmp)
        tmp.rename(shard)
        n_new = sum(len(r["response_ids"]) for r in rows)
        new_tokens += n_new
        rate = new_tokens / (time.time() - t0)
        print(f"[datagen] {time.strftime('%H:%M:%S')} shard {b} ({'T=1' if b % a.sampled_every == 0 else 'greedy'}): "
              f"{n_new} new tokens; this run {new_tokens} tokens, {rate:.1f} tok/s", flush=True)
        bar.set_postfix(tok_s=f"{rate:.0f}", new_tokens=new_tokens)


if __name__ == "__main__":
    main()
