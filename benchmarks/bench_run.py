"""Measurement of one ``dartree bench`` cell: (method, dataset, temperature, tree knobs) over prompts.

Two runners, one record format:

- :func:`run_engine_cell` drives :class:`services.verifier.engine.SpecEngine` round by round. The
  engine's drafter client is wrapped in :class:`RecordingDrafter` (a proxy, no library change) so
  every round's :class:`services.tree.DraftTree` is seen: node-depth histograms for all drafting
  methods, and a few whole trees (token text, accepted path) for the example-tree figures.
- :func:`hf_runner` runs the peers a user would pick instead, on the same target weights:
  Hugging Face ``generate`` greedy (``hf-generate``) and its prompt-lookup assisted generation
  (``hf-prompt-lookup``, ``prompt_lookup_num_tokens=10``). A streamer timestamps each emitted chunk.
- :func:`benchmarks.bench_llama.llama_runner` runs llama.cpp (``llama-cpp``) on the GGUF file the
  default target is dequantized from, fed the same prompt ids, timed per token the same way.

Clock rules (docs/algorithms.md §6, as adopted here): the first engine step (prefill, emits token 1) is
TTFT; the decode clock covers the remaining steps; ``TPOT = decode time / tokens after the first``.
Only the engine/``generate`` calls are inside the clock (bookkeeping between steps is not).
``tau`` of a round = tokens it emitted (bonus included), counting a terminator (EOS) the round
produced as an emitted token (the engine cuts it from ``token_ids``). MT-Bench turn 2 is sent with
the method's own decoded turn-1 answer as history; every (prompt, turn) is one sample.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from dataclasses import dataclass, field

import torch

from services.replay import accepted_nodes, replay_rounds
from services.spec import METHODS

ENGINE_METHODS = METHODS  # dspark, dspark-dartree and eagle3 need a DSpark / EAGLE-3 --drafter
PEERS = ("hf-generate", "hf-prompt-lookup", "llama-cpp")
NOT_LOSSLESS_PEERS = ("llama-cpp",)  # other weights' kernels: token agreement reported, not a lossless check
PROMPT_LOOKUP_TOKENS = 10
# Tree knobs that change each method's trees (others are dropped from the cell key, so e.g. the
# ``ar`` cell is shared by every sweep point).
KNOBS_BY_METHOD = {
    "ar": (), "dflash": (), "domino": (), "hf-generate": (), "hf-prompt-lookup": (), "llama-cpp": (),
    "ddtree": ("budget",), "domino-ddtree": ("budget",),
    "dartree-fixed": ("budget", "candidates"),
    "seqheap": ("budget", "depth_bonus", "candidates"),
    "dartree-pruned": ("budget", "width", "depth_bonus", "candidates"),
    "dspark": (), "dspark-dartree": ("budget", "width", "depth_bonus", "candidates"), "eagle3": ("budget",),
}
PHASES = ("draft", "tree_build", "verify", "commit", "total")
EXAMPLE_ROUNDS = 4  # whole trees kept from the first sample of each T=0 cell


def method_knobs(method: str, knobs: dict) -> dict:
    """The subset of ``knobs`` that affects ``method``."""
    return {k: knobs[k] for k in KNOBS_BY_METHOD.get(method, ()) if knobs.get(k) is not None}


def sample_seed(uid: str, turn: int) -> int:
    """Stable per-sample sampling seed (the same for every method)."""
    return zlib.crc32(f"{uid}#{turn}".encode()) & 0x7FFFFFFF


class RecordingDrafter:
    """Proxy around the engine's drafter client that remembers the last tree it returned."""

    def __init__(self, inner):
        self.inner = inner
        self.last_tree = None

    def collect(self, handle):
        """A submitted draft is recorded when collected."""
        tree, timings = self.inner.collect(handle)
        self.last_tree = tree
        return tree, timings

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def install_recorder(engine) -> RecordingDrafter | None:
    """Wrap ``engine.drafter`` in a :class:`RecordingDrafter` (idempotent)."""
    if engine.drafter is None:
        return None
    if not isinstance(engine.drafter, RecordingDrafter):
        engine.drafter = RecordingDrafter(engine.drafter)
    return engine.drafter


@dataclass
class CellStats:
    """Everything measured in one cell (JSON-serialisable via :meth:`to_json`)."""

    samples: list[dict] = field(default_factory=list)
    accept_hist: Counter = field(default_factory=Counter)  # accepted draft tokens per round -> rounds
    phase: dict[str, list[float]] = field(default_factory=lambda: {p: [0, 0.0, 0.0] for p in PHASES})
    depth_hist: Counter = field(default_factory=Counter)  # node depth -> nodes, over all trees
    num_trees: int = 0
    examples: list[dict] = field(default_factory=list)

    def add_round(self, accept_length: int, timings: dict[str, float]) -> None:
        self.accept_hist[int(accept_length)] += 1
        for p in PHASES:
            if p in timings:
                acc = self.phase[p]
                acc[0] += 1
                acc[1] += timings[p]
                acc[2] += timings[p] ** 2

    def add_tree(self, tree) -> None:
        self.num_trees += 1
        for d, c in Counter(tree.depths.tolist()).items():
            self.depth_hist[int(d)] += c

    @classmethod
    def from_json(cls, d: dict) -> "CellStats":
        """Inverse of :meth:`to_json` (resuming a partially measured cell)."""
        st = cls(samples=list(d.get("samples", [])), num_trees=int(d.get("num_trees", 0)),
                 examples=list(d.get("examples", [])))
        st.accept_hist.update({int(k): v for k, v in d.get("accept_hist", {}).items()})
        st.depth_hist.update({int(k): v for k, v in d.get("depth_hist", {}).items()})
        for p, v in d.get("phase", {}).items():
            st.phase[p] = list(v)
        return st

    def to_json(self) -> dict:
        return {"samples": self.samples, "accept_hist": {str(k): v for k, v in sorted(self.accept_hist.items())},
                "phase": self.phase, "depth_hist": {str(k): v for k, v in sorted(self.depth_hist.items())},
                "num_trees": self.num_trees, "examples": self.examples}


def tree_record(tree, root: int, accepted: list[int], bonus: int | None, tok, round_index: int) -> dict:
    """A drawable tree: tokens, their text, parents, depths, scores and the accepted path."""
    toks, pars = tree.draft_tokens.tolist(), tree.parents.tolist()
    return {"round": round_index, "root": root, "root_text": tok.decode([root]), "tokens": toks,
            "texts": [tok.decode([t]) for t in toks], "parents": pars, "depths": tree.depths.tolist(),
            "scores": [round(float(s), 4) for s in tree.scores.tolist()],
            "accepted_nodes": accepted_nodes(toks, pars, accepted), "bonus": bonus,
            "bonus_text": tok.decode([bonus]) if bonus is not None else None}


def chat_ids(tok, turns: list[str], answers: list[str], chat: bool) -> list[int]:
    """Prompt ids of the next turn: user turns interleaved with the method's own earlier answers."""
    if not chat:
        return tok.encode(turns[len(answers)])
    messages = []
    for i, q in enumerate(turns[:len(answers) + 1]):
        messages.append({"role": "user", "content": q})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    kw = dict(tokenize=True, add_generation_prompt=True, return_dict=False)
    try:
        ids = tok.apply_chat_template(messages, enable_thinking=False, **kw)
    except TypeError:
        ids = tok.apply_chat_template(messages, **kw)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def _clip_max_tokens(max_new: int, prompt_len: int, max_context: int) -> int:
    return max(0, min(max_new, max_context - prompt_len - 1))


def engine_turn(engine, rec: RecordingDrafter | None, tok, prompt_ids: list[int], method: str, knobs: dict,
                temperature: float, max_tokens: int, seed: int, stats: CellStats, keep_examples: int,
                request_id: str) -> dict:
    """Generate one turn with the engine; fold its rounds into ``stats``; return the sample record."""
    from services.params import SamplingParams, SpecParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    spec = SpecParams(method, **knobs)
    gen = engine.generate(request_id, prompt_ids, sampling, spec)
    tokens: list[int] = []
    taus: list[int] = []
    ttft = decode = 0.0
    finish = None
    while True:
        if rec is not None:
            rec.last_tree = None
        t0 = time.perf_counter()
        try:
            out = next(gen)
        except StopIteration:
            break
        dt = time.perf_counter() - t0
        root = tokens[-1] if tokens else None
        tokens += out.token_ids
        finish = out.finish_reason
        if out.is_prefill:
            ttft = dt
            continue
        decode += dt
        taus.append(len(out.token_ids) + (1 if out.finish_reason == "stop" else 0))
        stats.add_round(out.accept_length, out.timings)
        tree = rec.last_tree if rec is not None else None
        if tree is not None and tree.num_nodes:
            stats.add_tree(tree)
            if len(stats.examples) < keep_examples and root is not None:
                acc = out.token_ids[:out.accept_length]
                bonus = out.token_ids[out.accept_length] if len(out.token_ids) > out.accept_length else None
                stats.examples.append(tree_record(tree, root, acc, bonus, tok, len(taus)))
    return {"tokens": tokens, "finish": finish, "ttft_s": ttft, "decode_s": decode, "rounds": len(taus),
            "tau": sum(taus) / len(taus) if taus else None, "taus_sum": sum(taus)}


class _ChunkClock:
    """A transformers streamer that timestamps every ``put`` (the first put is the prompt)."""

    def __init__(self):
        self.puts: list[tuple[float, int]] = []

    def put(self, value) -> None:
        if torch.cuda.is_available() and getattr(value, "is_cuda", False):
            torch.cuda.synchronize()
        self.puts.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass


def hf_turn(model, prompt_ids: list[int], method: str, max_tokens: int, eos_ids: tuple[int, ...],
            pad_id: int | None) -> dict:
    """One greedy turn with HF ``generate`` (optionally prompt-lookup assisted), timed per chunk.

    Chunks after the first generated one are the rounds (``tau`` = mean tokens per chunk; 1 for plain
    greedy). Tokens after the first terminator are cut, as the engine does.
    """
    from transformers import GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    class Clock(_ChunkClock, BaseStreamer):
        pass

    cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=list(eos_ids) or None,
                           pad_token_id=pad_id if pad_id is not None else (eos_ids[0] if eos_ids else None),
                           prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS if method == "hf-prompt-lookup" else None)
    dev = next(model.parameters()).device
    x = torch.tensor([prompt_ids], device=dev)
    clock = Clock()
    t0 = time.perf_counter()
    with torch.inference_mode():
        seq = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg, streamer=clock)
    t_end = time.perf_counter()
    new = seq[0, len(prompt_ids):].tolist()
    finish = "length"
    for i, t in enumerate(new):
        if t in eos_ids:
            new, finish = new[:i], "stop"
            break
    chunks = clock.puts[1:]  # drop the prompt put
    if not chunks:
        return {"tokens": new, "finish": finish, "ttft_s": t_end - t0, "decode_s": 0.0, "rounds": 0, "tau": None,
                "taus_sum": 0, "first_chunk": len(new)}
    t_first, n_first = chunks[0]
    rounds = [n for _, n in chunks[1:]]
    times = [t for t, _ in chunks]
    return {"tokens": new, "finish": finish, "ttft_s": t_first - t0, "decode_s": t_end - t_first,
            "rounds": len(rounds), "tau": sum(rounds) / len(rounds) if rounds else None, "taus_sum": sum(rounds),
            "first_chunk": n_first, "_chunks": [(n, b - a) for n, a, b in zip(rounds, times, times[1:])]}


def run_cell(runner, tok, prompts, max_new: int, max_context: int, keep_examples: int, progress=None,
             stats: CellStats | None = None, checkpoint=None) -> CellStats:
    """Run every prompt (every turn) of one cell with ``runner(prompt_ids, max_tokens, seed, stats, keep)``.

    ``stats`` resumes a partial cell (prompts whose uid it holds are skipped); ``checkpoint(stats)``
    is called after each finished prompt.
    """
    stats = stats or CellStats()
    done = {s["uid"] for s in stats.samples}
    for idx, p in enumerate(prompts):
        if p.uid in done:
            if progress is not None:
                progress.update(len(p.turns))
            continue
        answers: list[str] = []
        for turn in range(len(p.turns)):
            ids = chat_ids(tok, p.turns, answers, p.chat)
            max_tokens = _clip_max_tokens(max_new, len(ids), max_context)
            if max_tokens < 1:
                stats.samples.append({"uid": p.uid, "turn": turn, "skipped": "prompt fills the context window"})
                break
            keep = keep_examples if idx == 0 and turn == 0 else 0
            rec = runner(ids, max_tokens, sample_seed(p.uid, turn), stats, keep)
            toks = rec.pop("tokens")
            text = tok.decode(toks, skip_special_tokens=True)
            n_after = max(0, len(toks) - (rec.get("first_chunk") or 1))
            stats.samples.append({"uid": p.uid, "turn": turn, "prompt_tokens": len(ids), "max_tokens": max_tokens,
                                  "num_tokens": len(toks), "tokens_after_first": n_after, "token_ids": toks,
                                  **rec})
            answers.append(text)
            if progress is not None:
                progress.update(1)
        if checkpoint is not None:
            checkpoint(stats)
    return stats


def engine_runner(engine, tok, method: str, knobs: dict, temperature: float):
    """A ``runner`` for :func:`run_cell` over the in-process engine."""
    rec = install_recorder(engine) if method != "ar" else None
    counter = iter(range(10**9))

    def run(ids, max_tokens, seed, stats, keep):
        return engine_turn(engine, rec, tok, ids, method, knobs, temperature, max_tokens, seed, stats,
                           keep if temperature == 0 else 0, f"bench-{method}-{next(counter)}")
    return run


def hf_runner(model, method: str, eos_ids: tuple[int, ...], pad_id: int | None):
    """A ``runner`` for :func:`run_cell` over HF ``generate`` (greedy only)."""
    def run(ids, max_tokens, seed, stats, keep):
        rec = hf_turn(model, ids, method, max_tokens, eos_ids, pad_id)
        for n, dt in rec.pop("_chunks", []):
            stats.add_round(n - 1, {"total": dt})
        return rec
    return run


@torch.inference_mode()
def replay_turn(engine, tok, prompt_ids: list[int], ref: list[int], finish: str | None, method: str, knobs: dict,
                stats: CellStats, keep_examples: int, request_id: str) -> dict:
    """Acceptance of ``method`` at T = 0 replayed against the greedy reference ``ref`` (no target verify).

    At T = 0 the engine's output is the greedy continuation whatever the method (lossless), so the
    round structure is fixed by the reference: round k drafts from the committed prefix, accepts the
    longest tree path equal to the reference and emits it plus the bonus token. This runs the
    engine's own drafter client and tree builders with the drafter context fed from ONE
    teacher-forced target forward over ``prompt + ref`` instead of per-round tree verifies: the
    ``τ``, accept histogram and tree shapes equal the engine's up to float near-ties in the drafter
    (features differ from the incremental verify's by ~1e-6; tests/bench/test_replay.py checks
    equality on tiny models). It measures no time (``decode_s = 0``, no speedup).

    Args:
        ref: the ``ar`` output token ids (terminator excluded, as the engine returns them);
        finish: its finish reason ("stop" appends the target's greedy terminator, counted as emitted
            like :func:`engine_turn` does).
    Returns:
        The sample record of :func:`engine_turn` with ``replay: True``.
    """
    from services.params import SpecParams

    spec = SpecParams(method, **knobs)  # replay_rounds resolves the unset knobs as the engine's policy does
    taus: list[int] = []
    for r in replay_rounds(engine, prompt_ids, ref, finish, spec, request_id):
        taus.append(r.emitted)
        stats.add_round(min(r.accepted, r.emitted - (1 if r.hits_stop else 0)), r.timings)
        if r.tree.num_nodes:
            stats.add_tree(r.tree)
            if len(stats.examples) < keep_examples:
                seq = r.seq
                acc = seq[r.i + 1:r.i + 1 + r.accepted]
                bonus = seq[r.i + 1 + r.accepted] if r.i + 1 + r.accepted < len(seq) else None
                stats.examples.append(tree_record(r.tree, seq[r.i], acc, bonus, tok, len(taus)))
    return {"tokens": list(ref), "finish": finish, "ttft_s": 0.0, "decode_s": 0.0, "rounds": len(taus),
            "tau": sum(taus) / len(taus) if taus else None, "taus_sum": sum(taus), "replay": True}


def replay_runner(engine, tok, method: str, knobs: dict, reference):
    """A ``runner`` for :func:`run_cell` that replays ``method`` against greedy references (T = 0 only).

    ``reference(prompt_ids, max_tokens) -> (token ids, finish)`` gives the greedy output (the ``ar``
    cell's, or a fresh ``ar`` run).
    """
    counter = iter(range(10**9))

    def run(ids, max_tokens, seed, stats, keep):
        ref, finish = reference(ids, max_tokens)
        return replay_turn(engine, tok, ids, ref, finish, method, knobs, stats, keep,
                           f"replay-{method}-{next(counter)}")
    return run
