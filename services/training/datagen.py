"""Self-distillation data: the target's own greedy and sampled continuations of training prompts.

Two backends, written in shards under ``out_dir`` and resumable (a shard that exists is skipped):

- ``--backend engine`` (default): our batched engine (:class:`~services.verifier.engine.SpecEngine`,
  method ``ar``) with continuous batching across shards: ``--batch-size`` requests in flight, a finished
  request's slot goes to the next prompt at once, a shard is written when its last request ends.
  ``--weights`` picks the target format (:mod:`services.weights`; ``q4`` is what ``auto`` serves on
  this CPU, so the data is on-policy for the served model).
- ``--backend hf``: ``transformers`` ``generate`` per shard (left padding, ``--dtype``).

Each shard is a list of ``{"uid", "prompt_ids", "response_ids", "sampled", "backend"}`` (response cut
after the first EOS, EOS kept; ``backend`` e.g. ``engine:q4`` or ``hf:bfloat16``).
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
        rows.append({"uid": uid, "prompt_ids": p, "response_ids": resp, "sampled": sampled,
                     "backend": f"hf:{str(model.dtype).removeprefix('torch.')}"})
    return rows


def generate_engine(engine, shards: dict[int, list[tuple[str, list[int]]]], max_new_tokens: int,
                    sampled_every: int, in_flight: int, on_shard) -> None:
    """Continuous batching over many shards with :class:`SpecEngine` (method ``ar``).

    Args:
        engine: a ``SpecEngine`` with at least ``in_flight`` KV slots (no drafter needed).
        shards: shard index -> its (uid, prompt_ids) batch, in the order to generate.
        sampled_every: shard ``b`` is sampled at T = 1 (seed ``b * 1000 + i``) when ``b % sampled_every
            == 0``, else greedy; the same rule as the ``hf`` backend.
        on_shard: called ``on_shard(b, rows)`` as soon as shard ``b``'s last request finishes; rows
            in the shard's prompt order.
    Raises:
        whatever a step raised for a request (the run stops; finished shards are already written).
    """
    from services.params import SamplingParams, SpecParams
    from services.spec import Method

    eos = engine.eos_token_ids[0] if engine.eos_token_ids else None
    queue = [(b, i) for b in shards for i in range(len(shards[b]))]
    queue.reverse()  # pop() from the end = shard order
    pending = {b: [None] * len(batch) for b, batch in shards.items()}
    live: dict[str, tuple[int, int, list[int]]] = {}
    backend = f"engine:{engine.target.weights}"
    n = 0
    while queue or live:
        while queue and len(live) < in_flight:
            b, i = queue.pop()
            uid, p = shards[b][i]
            sampled = b % sampled_every == 0
            rid = f"{b}-{i}-{n}"
            n += 1
            engine.add_request(rid, p, SamplingParams(max_tokens=max_new_tokens, temperature=1.0 if sampled else 0.0,
                                                      seed=b * 1000 + i),
                               SpecParams(Method.AR))
            live[rid] = (b, i, [])
        for rid, out in engine.step_batch(list(live)).items():
            if isinstance(out, BaseException):
                raise out
            if out is None:
                continue
            b, i, toks = live[rid]
            toks += out.token_ids
            if out.finish_reason is None:
                continue
            del live[rid]
            if out.finish_reason == "stop" and eos is not None:
                toks.append(eos)
            uid, p = shards[b][i]
            pending[b][i] = {"uid": uid, "prompt_ids": p, "response_ids": toks,
                             "sampled": b % sampled_every == 0, "backend": backend}
            if all(r is not None for r in pending[b]):
                on_shard(b, pending.pop(b))


LAYOUT_KEYS = ("num_prompts", "batch_size", "max_prompt_tokens", "max_new_tokens", "sampled_every")


def _saved_run(out: Path) -> dict:
    """``out/datagen.json`` as a dict (``{}`` when absent).

    Raises:
        ValueError: it cannot be read or is not a JSON object (one line naming the file).
    """
    path = out / "datagen.json"
    if not path.exists():
        return {}
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} cannot be read ({exc}): fix or delete it, or use another --out-dir") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} is not a JSON object: fix or delete it, or use another --out-dir")
    return saved


def _shard_backend(out: Path) -> str | None:
    """The ``backend`` of the first row of ``out``'s first shard (None: no shards).

    Raises:
        ValueError: that shard cannot be read or holds no datagen rows.
    """
    shards = sorted(out.glob("shard_*.pt"))
    if not shards:
        return None
    why = None
    try:
        rows = torch.load(shards[0], weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable shard is one error line
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    else:
        if not (isinstance(rows, list) and rows and isinstance(rows[0], dict) and "backend" in rows[0]):
            why = "no list of datagen rows with a 'backend'"
    if why:
        raise ValueError(f"{shards[0]} is not a readable datagen shard ({why}): delete it (it is generated "
                         "again) or use another --out-dir")
    return str(rows[0]["backend"])


def check_layout(out: Path, a, write: bool = True) -> None:
    """Record the flags that define which prompts a shard holds in ``out/datagen.json``; refuse a resume
    with different ones (a shard that exists is skipped, so other flags would silently mix layouts).

    ``write=False`` only checks (the caller writes once every check passed).

    Raises:
        ValueError: ``out`` holds shards of another layout, or an unreadable datagen.json.
    """
    layout = {k: getattr(a, k) for k in LAYOUT_KEYS}
    saved = _saved_run(out)
    if saved:
        diff = {k: (saved.get(k), v) for k, v in layout.items() if saved.get(k) != v}
        if diff:
            raise ValueError(f"{out} holds shards made with other flags {diff} (saved, given): resume with the "
                             "saved ones or use another --out-dir")
    elif write:
        (out / "datagen.json").write_text(json.dumps(layout, indent=2))


def check_backend(out: Path, backend: str, write: bool = True) -> None:
    """Record the backend and weight format (``engine:bfloat16``, ``hf:float32``, ...) in
    ``out/datagen.json``; refuse a resume with another one, which would mix policies silently.

    A directory written before the format was recorded takes it from its first shard's rows.
    ``write=False`` only checks.

    Raises:
        ValueError: ``out`` was made with another backend or weight format, or its datagen.json / first
            shard cannot be read.
    """
    saved = _saved_run(out)
    have = saved.get("backend")
    if have is None:
        have = _shard_backend(out)
    if have is not None and have != backend:
        raise ValueError(f"{out} is a datagen directory of {have!r}, this run would add {backend!r}: resume "
                         f"with the same --backend / --weights / --dtype or use another --out-dir")
    if write and saved.get("backend") != backend:
        (out / "datagen.json").write_text(json.dumps({**saved, "backend": backend}, indent=2))


HF_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_causal_lm(path: Path) -> None:
    """Refuse a target directory whose config.json is not a causal LM's (e.g. a drafter's: ``architectures``
    ``["DFlashDraftModel"]``), before anything is loaded.

    Raises:
        ValueError: one line naming the directory.
    """
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{Path(path) / 'config.json'} cannot be read ({exc})".splitlines()[0]) from None
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    drafter = isinstance(cfg, dict) and any(k in cfg for k in ("dflash_config", "eagle_config", "markov_rank"))
    if drafter or not isinstance(cfg, dict) or (archs and not any(str(x).endswith("ForCausalLM") for x in archs)):
        raise ValueError(f"target {path} is not a causal LM (config.json architectures {archs}; a drafter "
                         "directory is not a target)")


def _shards(n: int) -> str:
    return f"{n} shard" if n == 1 else f"{n} shards"


def _parse_part(text: str) -> tuple[int, int]:
    """``"K/N"`` -> ``(K, N)``. Raises ValueError (one line) unless 0 <= K < N."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--part must be K/N with integers, e.g. 0/2 (got {text!r})") from None
    if not 0 <= k < n:
        raise ValueError(f"--part K/N needs 0 <= K < N (got {text!r})")
    return k, n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="generate self-distillation data for drafter training")
    ap.add_argument("--target", default=None,
                    help="the target model (name or directory; default: SmolLM2-135M-Instruct)")
    ap.add_argument("--out-dir", default="data/gen",
                    help="where shard_NNNNN.pt files and datagen.json go; a run resumes the shards not yet there")
    ap.add_argument("--num-prompts", type=int, default=3000,
                    help="train-split prompts to draw (services/datasets.py load_train; part of the layout)")
    ap.add_argument("--batch-size", type=int, default=24, help="prompts per shard (part of the layout)")
    ap.add_argument("--max-new-tokens", type=int, default=256,
                    help="response tokens per prompt at most (part of the layout)")
    ap.add_argument("--max-prompt-tokens", type=int, default=384,
                    help="prompt tokens kept (the first ones; part of the layout)")
    ap.add_argument("--sampled-every", type=int, default=5,
                    help="every k-th shard is sampled at T=1, the others greedy (part of the layout)")
    ap.add_argument("--backend", choices=("engine", "hf"), default="engine",
                    help="engine: our batched engine, continuous batching (default); hf: transformers generate")
    ap.add_argument("--in-flight", type=int, default=0,
                    help="engine backend: requests decoding at once (default: --batch-size; not part of the layout)")
    ap.add_argument("--weights", default="float32",
                    help="engine backend: the target's weight format (float32, bfloat16, q4, auto)")
    ap.add_argument("--dtype", default="bfloat16", help="hf backend: the model's dtype (float32, bfloat16, float16)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: 0 = torch's)")
    ap.add_argument("--part", default="0/1", metavar="K/N",
                    help="generate only the K-th of N interleaved parts of the shard order (0 <= K < N), so that N "
                         "processes (e.g. one per core, --threads 1) can fill one --out-dir together "
                         "(not part of the layout; default: 0/1 = every shard)")
    a = ap.parse_args(argv)
    from services.weights import check_format

    try:  # bad flags: one line, before anything is loaded or written
        for flag, value, least in (("--num-prompts", a.num_prompts, 1), ("--batch-size", a.batch_size, 1),
                                   ("--max-new-tokens", a.max_new_tokens, 1), ("--in-flight", a.in_flight, 0),
                                   ("--max-prompt-tokens", a.max_prompt_tokens, 1),
                                   ("--sampled-every", a.sampled_every, 1), ("--threads", a.threads, 0)):
            if value < least:
                raise ValueError(f"{flag} must be >= {least} (got {value})")
        part, parts = _parse_part(a.part)
        if a.backend == "engine":
            check_format(a.weights)
        elif not isinstance(getattr(torch, a.dtype, None), torch.dtype):
            raise ValueError(f"--dtype {a.dtype!r} is not a torch dtype")
        elif getattr(torch, a.dtype) not in HF_DTYPES:
            raise ValueError(f"--dtype {a.dtype!r}: the hf backend generates in float32, bfloat16 or float16")
        if Path(a.out_dir).exists() and not Path(a.out_dir).is_dir():
            raise ValueError(f"--out-dir {a.out_dir} is a file, not a directory")
    except ValueError as exc:
        ap.exit(2, f"datagen: error: {exc}\n")
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    from services.models.registry import ModelNotFoundError, resolve_target

    try:
        path = resolve_target(a.target)
        check_causal_lm(path)
    except (ModelNotFoundError, ValueError) as exc:  # an unknown target or a missing package, a drafter: one line
        ap.exit(2, f"datagen: error: {exc}\n")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = load_train(a.num_prompts)
    if len(prompts) < a.num_prompts:  # a small request can find fewer usable items in a source (see load_train)
        print(f"[datagen] note: {len(prompts)} of the {a.num_prompts} prompts asked for are usable (too long, "
              f"empty or evaluation texts were dropped)", flush=True)
    enc = [(p.uid, encode_prompt(tok, p, a.max_prompt_tokens)) for p in prompts]
    enc.sort(key=lambda x: len(x[1]))  # batch similar lengths together: less padding
    batches = [enc[i:i + a.batch_size] for i in range(0, len(enc), a.batch_size)]
    order = [int(i) for i in torch.randperm(len(batches), generator=torch.Generator().manual_seed(0)).tolist()]
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:  # a resume with other flags or another policy: one line, nothing generated or written
        if a.backend == "engine":
            from services.weights import choose_weights

            weights = choose_weights(a.weights, path)
            backend = f"engine:{weights}"
        else:  # the resolved name, as the rows record it ("half" -> "float16")
            backend = f"hf:{str(getattr(torch, a.dtype)).removeprefix('torch.')}"
        check_layout(out, a, write=False)
        check_backend(out, backend, write=False)
        check_layout(out, a)
        check_backend(out, backend)
    except ValueError as exc:
        ap.exit(2, f"datagen: error: {exc}\n")
    mine = order[part::parts]
    todo = [b for b in mine if not (out / f"shard_{b:05d}.pt").exists()]
    which = f" in part {part}/{parts}" if parts > 1 else ""
    print(f"[datagen] {len(enc)} prompts, {_shards(len(batches))} of {min(a.batch_size, len(enc))}"
          f"{f' ({len(mine)}{which})' if which else ''}, {len(todo)} to generate ({a.backend} backend)", flush=True)
    if not todo:
        print(f"[datagen] done: nothing left to generate{which}: {_shards(len(mine))} in {out}", flush=True)
        return
    t0, new_tokens = time.time(), 0
    bar = tqdm(total=len(todo), desc="datagen", mininterval=60)

    def save(b: int, rows: list[dict]) -> None:
        nonlocal new_tokens
        shard = out / f"shard_{b:05d}.pt"
        tmp = shard.with_suffix(".tmp")
        torch.save(rows, tmp)
        tmp.rename(shard)
        n_new = sum(len(r["response_ids"]) for r in rows)
        new_tokens += n_new
        rate = new_tokens / (time.time() - t0)
        print(f"[datagen] {time.strftime('%H:%M:%S')} shard {b} ({'T=1' if rows[0]['sampled'] else 'greedy'}, "
              f"{rows[0]['backend']}): {n_new} new tokens; this run {new_tokens} tokens, {rate:.1f} tok/s", flush=True)
        bar.update(1)
        bar.set_postfix(tok_s=f"{rate:.0f}", new_tokens=new_tokens)

    if a.backend == "engine":
        from services.verifier.build import build_engine
        from services.verifier.engine import EngineConfig
        from services.verifier.target import TargetModel

        target = TargetModel.from_pretrained(path, weights=weights)
        in_flight = a.in_flight or a.batch_size
        engine = build_engine(target, None, EngineConfig(max_running=in_flight,
                                                         max_context=a.max_prompt_tokens + a.max_new_tokens),
                              max_draft_depth=1)
        generate_engine(engine, {b: batches[b] for b in todo}, a.max_new_tokens, a.sampled_every, in_flight, save)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, a.dtype)).eval()
        for b in todo:
            save(b, generate_shard(model, tok, batches[b], a.max_new_tokens, sampled=(b % a.sampled_every == 0),
                                   seed=b))
    bar.close()
    elapsed = time.time() - t0
    print(f"[datagen] done: {_shards(len(todo))}, {new_tokens} new tokens in {elapsed / 60:.1f} min "
          f"({new_tokens / max(elapsed, 1e-9):.1f} tok/s); nothing left to generate{which}: "
          f"{_shards(len(mine))} in {out}", flush=True)


if __name__ == "__main__":
    main()
