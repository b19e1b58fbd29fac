"""``python -m services.training.train_eagle3``: train an EAGLE-3 drafter on the featurized shards.

Same data as ``dartree train-drafter`` (``featurize`` shards: ids, the target's greedy labels, tapped
features). EAGLE-3 fuses 3 of the stored taps (low / mid / high, ``--layer-ids``, which must be among
the shard's tapped layers). Training-time test (EAGLE-3 §3.2, ``cnets.py``): step 0 runs the layer
causally over the pairs ``(fc(f_i), x_{i+1})``; step ``j >= 1`` feeds row ``i`` its own step ``j - 1``
output as hidden and the realised token ``x_{i+1+j}``, at position ``i + j``, attending to the step-0
rows ``<= i`` and to its own rows of steps ``1..j`` (the tree mask a chain of draft nodes sees at
inference). Row ``i`` at step ``j`` predicts the target's greedy token at ``i + 2 + j`` (label
``labels[i + 1 + j]``, hard labels: the shards store the greedy token, not the distribution); loss =
sum_j 0.8^j CE_j over the draft vocabulary (labels outside it are ignored), response rows only.
Resumable (``--resume``: model, optimiser, step, data position, RNG) like ``train-drafter``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from services.drafter.eagle3 import Eagle3Config, Eagle3Drafter
from services.drafter.model import save_drafter
from services.training.train_data import DataStream
from services.training.train_loop import Schedule


class Eagle3Trainer:
    """The loss of one sequence under the training-time test.

    Args:
        drafter: the EAGLE-3 drafter (train mode); embed_w: the target's embedding ``[V, H]`` (frozen);
        columns: ``[3 * Ht]`` long, the stored feature columns of the low / mid / high taps;
        steps: TTT steps; max_len: sequences are cut to this many tokens.
    """

    def __init__(self, drafter: Eagle3Drafter, embed_w: torch.Tensor, columns: torch.Tensor, steps: int,
                 max_len: int):
        self.m, self.embed_w, self.cols, self.steps, self.max_len = drafter, embed_w, columns, steps, max_len
        c = drafter.config
        self.label_map = torch.full((c.vocab_size,), -100, dtype=torch.long)
        self.label_map[drafter.draft_to_target()] = torch.arange(c.draft_vocab_size)

    def step_logits(self, ids: torch.Tensor, feats: torch.Tensor) -> list[torch.Tensor]:
        """Training-time-test forward of one sequence: ``ids [T]``, stored taps ``feats [>= T - 1, 3 Ht]``
        -> per step j, logits ``[T - 1, N]`` of row i (the draft of the token at ``i + 2 + j``)."""
        m, T = self.m, ids.numel()
        n = T - 1  # pairs i = 0 .. T - 2: (f_i, x_{i+1})
        hid = m.fuse(feats[:n].float())[None]  # [1, n, H]
        i = torch.arange(n)
        causal = i[None, :] <= i[:, None]  # [n, n]
        eye = torch.eye(n, dtype=torch.bool)
        past_k = past_v = None
        out = []
        for j in range(self.steps):
            emb = F.embedding(ids[(i + 1 + j).clamp(max=T - 1)], self.embed_w)[None]  # token x_{i+1+j}
            # step 0: causal over the pairs; step j: step-0 rows <= i plus row i's own rows of steps 1..j
            mask = causal[None] if j == 0 else torch.cat([causal] + [eye] * j, dim=1)[None]
            h, k, v = m.midlayer(emb, hid, i + j, past_k, past_v, mask)
            past_k = k if past_k is None else torch.cat([past_k, k], 2)
            past_v = v if past_v is None else torch.cat([past_v, v], 2)
            out.append(m.logits(h[0]))
            hid = h
        return out

    def loss(self, row: dict) -> tuple[torch.Tensor, dict] | None:
        """``(loss, stats)`` of one featurized sequence, or None when it has no response row to learn."""
        ids, labels = row["ids"][: self.max_len].long(), row["labels"][: self.max_len].long()
        T, p = ids.numel(), int(row["prompt_len"])
        n = T - 1
        if n < 2 or p >= T:
            return None
        i = torch.arange(n)
        total, stats, weight_sum = 0.0, {}, 0.0
        for j, logits in enumerate(self.step_logits(ids, row["feats"][:n, self.cols])):
            lab_idx = i + 1 + j  # label: the target's greedy token after ids[: i + 2 + j]
            tgt = torch.where(lab_idx < T, self.label_map[labels[lab_idx.clamp(max=T - 1)]], torch.tensor(-100))
            tgt = torch.where(lab_idx + 1 >= p, tgt, torch.tensor(-100))  # predicted position in the response
            valid = tgt >= 0
            if valid.any():
                total = total + (0.8 ** j) * F.cross_entropy(logits.float(), tgt, ignore_index=-100)
                weight_sum += 0.8 ** j
            with torch.no_grad():
                stats[f"acc{j}"] = float(((logits.argmax(-1) == tgt) & valid).sum() / valid.sum().clamp(min=1))
        if weight_sum == 0:
            return None
        loss = total / weight_sum
        stats["loss"] = float(loss.detach())
        return loss, stats


def feature_columns(shard_layer_ids: list[int], layer_ids: list[int], hidden: int) -> torch.Tensor:
    """Columns ``[3 * hidden]`` of the stored features for ``layer_ids`` (each must be a stored tap).

    Raises:
        ValueError: a requested layer is not among the shard's taps.
    """
    cols = []
    for lid in layer_ids:
        if lid not in shard_layer_ids:
            raise ValueError(f"layer {lid} is not among the stored feature taps {shard_layer_ids}")
        k = shard_layer_ids.index(lid)
        cols.append(torch.arange(k * hidden, (k + 1) * hidden))
    return torch.cat(cols)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None)
    ap.add_argument("--feat-dir", default="data/feats")
    ap.add_argument("--shard-layer-ids", type=int, nargs="+", default=[1, 8, 14, 20, 27],
                    help="the target layers the shards store, in order (featurize's taps; default SmolLM2's)")
    ap.add_argument("--layer-ids", type=int, nargs=3, default=[1, 14, 27],
                    help="low / mid / high taps (default 1 14 27: EAGLE-3's [1, L/2-1, L-4] = [1, 14, 26] "
                         "for SmolLM2, with 27 for 26 because the shards store 27)")
    ap.add_argument("--work-dir", default="data/train_eagle3")
    ap.add_argument("--out", default="models/smollm2-135m-eagle3-drafter")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--vocab-counts", default="data/vocab_counts.pt")
    ap.add_argument("--depth", type=int, default=6, help="tree depth at inference = TTT steps (default 6)")
    ap.add_argument("--top-k", type=int, default=8, help="tree top-k at inference (default 8)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--schedule-steps", type=int, default=1000)
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--max-minutes", type=float, default=30.0, help="wall-time budget (default 30)")
    ap.add_argument("--max-len", type=int, default=384, help="tokens per training sequence (default 384)")
    ap.add_argument("--save-every-min", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    from services.models.registry import resolve_target
    from services.training.vocab import coverage, top_ids
    from services.verifier.target import TargetModel

    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    target = TargetModel.from_pretrained(resolve_target(a.target), [0], dtype=torch.float32)
    tc = target.config
    ckpt = work / "ckpt.pt"
    st = torch.load(ckpt, weights_only=False) if a.resume and ckpt.exists() else None
    if st is not None:
        cfg = Eagle3Config.from_hf(st["config"])
    else:
        heads = int(tc.num_attention_heads)
        cfg = Eagle3Config(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
                           num_attention_heads=heads, num_key_value_heads=int(tc.num_key_value_heads),
                           head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
                           vocab_size=tc.vocab_size, draft_vocab_size=a.draft_vocab, rms_norm_eps=tc.rms_norm_eps,
                           rope_theta=float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 1e4)),
                           max_position_embeddings=tc.max_position_embeddings, target_hidden_size=tc.hidden_size,
                           num_target_layers=tc.num_hidden_layers, target_layer_ids=list(a.layer_ids),
                           depth=a.depth, top_k=a.top_k)
    drafter = Eagle3Drafter(cfg)
    if st is None:
        saved = torch.load(a.vocab_counts)
        ids = top_ids(saved["counts"], a.draft_vocab, always=tuple(target.eos_token_ids),
                      secondary=saved.get("secondary"))
        drafter.set_draft_vocab(ids)
        print(f"[eagle3] draft vocabulary {a.draft_vocab}: covers {coverage(saved['counts'], [a.draft_vocab])} of "
              "the counted response tokens", flush=True)
        with torch.no_grad():
            drafter.norm.weight.copy_(target.model.model.norm.weight.float())
    embed_w = target.embed_tokens().weight.detach().float()
    opt = torch.optim.AdamW(drafter.parameters(), lr=a.lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = Schedule(a.lr, a.warmup, a.schedule_steps, 0.0, 0.0)
    step, elapsed_prev, cpu_prev, data_state = 0, 0.0, 0.0, None
    rng = random.Random(a.seed)
    if st is not None:
        drafter.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed_prev, cpu_prev, data_state = st["step"], st["elapsed"], st["cpu_elapsed"], st["data"]
        sched = Schedule(**st["schedule"])
        rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"])
        print(f"[eagle3] resumed at step {step} ({elapsed_prev / 60:.1f} min)", flush=True)
    drafter.train()
    trainer = Eagle3Trainer(drafter, embed_w, feature_columns(a.shard_layer_ids, cfg.target_layer_ids,
                                                              cfg.target_hidden_size), cfg.depth, a.max_len)
    stream = DataStream(Path(a.feat_dir), a.seed, data_state)
    (work / "config.json").write_text(json.dumps({"args": vars(a), "drafter": cfg.to_hf(),
                                                  "schedule": dataclasses.asdict(sched)}, indent=2))
    t0, cpu0, last_save = time.time(), time.process_time(), time.time()
    ema: dict[str, float] = {}
    log = open(work / "train_log.jsonl", "a")

    def save(final: bool = False) -> None:
        elapsed, cpu = elapsed_prev + time.time() - t0, cpu_prev + time.process_time() - cpu0
        torch.save({"model": drafter.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                    "cpu_elapsed": cpu, "data": stream.state(), "schedule": dataclasses.asdict(sched),
                    "rng": rng.getstate(), "torch_rng": torch.get_rng_state(), "config": cfg.to_hf()},
                   work / "ckpt.tmp")
        (work / "ckpt.tmp").rename(ckpt)
        save_drafter(drafter, a.out, extra={"training": {"steps": step, "schedule_steps": sched.steps,
                                                          "minutes": round(elapsed / 60, 1),
                                                          "cpu_minutes": round(cpu / 60, 1), "final": final}})

    while step < a.max_steps and (elapsed_prev + time.time() - t0) / 60 < a.max_minutes:
        out = trainer.loss(stream.next())
        if out is None:
            continue
        loss, stats = out
        for g in opt.param_groups:
            g["lr"] = sched.lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        for key, val in stats.items():
            ema[key] = val if key not in ema else 0.98 * ema[key] + 0.02 * val
        if step % 25 == 0:
            line = {"step": step, "lr": sched.lr_at(step), **{f"ema_{k}": round(v, 4) for k, v in ema.items()}}
            log.write(json.dumps(line) + "\n")
            log.flush()
            print(f"[eagle3] {json.dumps(line)}", flush=True)
        if time.time() - last_save > a.save_every_min * 60:
            save()
            last_save = time.time()
    log.close()
    save(final=True)
    print(f"[eagle3] stopped at step {step}; exported to {a.out}", flush=True)


if __name__ == "__main__":
    main()
