"""Test doubles for the service: tiny tokenizer directories, a scripted engine client, a fake engine.

Nothing here loads a model: tokenizers are built in milliseconds with the ``tokenizers`` library,
and engines emit scripted multi-token rounds (style.md R10: mock the model, not the machinery).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from gateway.engine_client import _QueueClient
from services.protocol import Abort, Generate, Limits, PeerInfo, RequestError, RoundChunk, SpecSpec, TokenLogprobs

METHODS = ("ar", "dflash", "ddtree", "domino", "dartree-fixed", "dartree-pruned", "seqheap", "domino-ddtree")
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
CORPUS = ["Hello world, this is a test.", "你好，世界！这是一个测试。", "Emoji 😀🎉 party time",
          "The quick brown fox jumps over the lazy dog", "STOP here. END of text"] * 4


def _write_dir(path: Path, tok: Tokenizer, eos: str, eos_id: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "bos_token": "<|im_start|>"}))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (path / "config.json").write_text(json.dumps({"eos_token_id": eos_id, "vocab_size": tok.get_vocab_size(),
                                                  "max_position_embeddings": 256}))
    return path


def bytelevel_model_dir(path: Path) -> Path:
    """A GPT-2/SmolLM2-style byte-level BPE (CJK and emoji split across tokens)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return _write_dir(path, tok, "<|im_end|>", 2)


def bytefallback_model_dir(path: Path) -> Path:
    """A SentencePiece/Llama-style tokenizer: Metaspace + byte-fallback tokens ``<0xE4>``."""
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'", "你", "好", "世", "界"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<|endoftext|>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    return _write_dir(path, tok, "<|im_end|>", 2)


def verifier_info(vocab_size: int, max_context: int = 256, **kw) -> PeerInfo:
    base = dict(role="verifier", epoch="fake", vocab_size=vocab_size, eos_token_id=2, max_context=max_context,
                model="tiny", methods=METHODS, default_spec=SpecSpec(method="dartree-pruned", budget=8),
                limits=Limits(max_context=max_context, max_budget=64, max_running=4, max_waiting=8))
    base.update(kw)
    return PeerInfo(**base)


@dataclass
class Script:
    """What the fake engine emits for a request: token ids split into rounds."""

    token_ids: list[int]
    round_sizes: list[int] = field(default_factory=lambda: [1, 3, 2, 4])
    finish_reason: str = "stop"            # when the ids run out before max_tokens
    error_after_rounds: int | None = None  # send a RequestError after this many rounds
    error_status: int = 500
    delay_s: float = 0.0                   # sleep between rounds

    def rounds(self, max_tokens: int, logprobs: int | None = None) -> list[RoundChunk | RequestError]:
        """The rounds; with ``logprobs`` (top-k), each token carries :func:`fake_logprobs` of its position."""
        ids = self.token_ids[:max_tokens]
        finish = "length" if len(self.token_ids) >= max_tokens else self.finish_reason
        out, i, k = [], 0, 0
        while True:
            if self.error_after_rounds is not None and k == self.error_after_rounds:
                return out + [RequestError("?", self.error_status, "scripted failure", None, "scripted")]
            n = self.round_sizes[k % len(self.round_sizes)]
            chunk = ids[i:i + n]
            i, k = i + n, k + 1
            done = i >= len(ids)
            lp = None if logprobs is None else fake_logprobs(chunk, range(i - n, i - n + len(chunk)), logprobs)
            out.append(RoundChunk("?", chunk, finish if done else None, num_draft_tokens=8,
                                  accept_length=max(0, len(chunk) - 1), logprobs=lp))
            if done:
                return out


def fake_logprobs(token_ids, positions, k: int) -> TokenLogprobs:
    """Scripted logprobs: the token at output position p has logprob ``-(p + 1) / 1000`` (so a test can
    tell which position an entry came from) and top-k alternatives ``3 + (id + j) % 200`` at ``-1 - j``."""
    return TokenLogprobs([-(p + 1) / 1000 for p in positions],
                         [[3 + (t + j) % 200 for j in range(k)] for t in token_ids],
                         [[-1.0 - j for j in range(k)] for _ in token_ids])


class FakeEngineClient(_QueueClient):
    """An EngineClient that plays a :class:`Script` per request and records aborts."""

    def __init__(self, info: PeerInfo, script: Callable[[Generate], Script]):
        super().__init__()
        self.info, self.script = info, script
        self.is_ready = True
        self.generated: list[Generate] = []
        self.aborts: list[Abort] = []
        self._tasks: set[asyncio.Task] = set()

    @property
    def ready(self) -> bool:
        return self.is_ready

    @property
    def detail(self) -> str:
        return "" if self.is_ready else "starting"

    def _send(self, msg) -> None:
        if isinstance(msg, Abort):
            self.aborts.append(msg)
            return
        assert isinstance(msg, Generate)
        self.generated.append(msg)
        script = self.script(msg)  # raises here (inside generate) when a test scripts a bug
        task = asyncio.get_running_loop().create_task(self._play(msg, script))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _play(self, gen: Generate, script: Script) -> None:
        for item in script.rounds(gen.sampling.max_tokens, gen.sampling.logprobs):
            await asyncio.sleep(script.delay_s)
            if any(a.request_id == gen.request_id for a in self.aborts):
                return
            item.request_id = gen.request_id
            self._deliver(item)


# ------------------------------------------------------------------------------------ worker fakes

@dataclass
class FakeRound:
    """Duck-typed ``RoundOutput``."""

    token_ids: list[int]
    finish_reason: str | None
    num_draft_tokens: int = 4
    accept_length: int = 0
    accepted_per_depth: list[int] = field(default_factory=list)
    timings: dict = field(default_factory=lambda: {"draft": 0.001, "verify": 0.002, "total": 0.004})
    prefill_seconds: float = 0.0
    is_prefill: bool = False


class FakeEngine:
    """``SpecEngine``'s four methods over scripted rounds; records the step order and frees."""

    vocab_size, max_context, eos_token_ids = 400, 256, (2,)

    def __init__(self, rounds: list[list[int]] | None = None, step_delay_s: float = 0.0, fail_on_step: int | None = None,
                 fail_with: Exception | None = None):
        import threading

        self.rounds = rounds or [[5], [6, 7, 8], [9, 10], [11]]
        self.step_delay_s, self.fail_on_step, self.fail_with = step_delay_s, fail_on_step, fail_with
        self.active: dict[str, int] = {}
        self.steps: list[str] = []
        self.knobs: list[tuple[int, tuple[int, int] | None]] = []  # (active requests, tree_knobs) per step
        self.aborted: list[str] = []
        self.lock = threading.Lock()

    def add_request(self, request_id, prompt_ids, sampling, spec) -> None:
        if 399 in prompt_ids:
            raise ValueError("prompt (1 tokens) + max_tokens (9999) exceeds the context window of 256 tokens")
        self.active[request_id] = 0

    def step(self, request_id: str, tree_knobs: tuple[int, int] | None = None) -> FakeRound:
        import time

        time.sleep(self.step_delay_s)
        k = self.active[request_id]
        self.steps.append(request_id)
        self.knobs.append((len(self.active), tree_knobs))
        if self.fail_on_step is not None and k == self.fail_on_step:
            self.abort(request_id)
            raise self.fail_with or RuntimeError("boom")
        self.active[request_id] = k + 1
        last = k == len(self.rounds) - 1
        ids = self.rounds[k]
        out = FakeRound(list(ids), "stop" if last else None, accept_length=len(ids) - 1,
                        accepted_per_depth=[1] * (len(ids) - 1), is_prefill=k == 0)
        if last:
            self.abort(request_id)
        return out

    def abort(self, request_id: str) -> None:
        if self.active.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def num_active(self) -> int:
        return len(self.active)


def fake_params(gen: Generate, method: str):
    from types import SimpleNamespace

    return gen.sampling, SimpleNamespace(method=method)


class FakeDrafterService:
    """``DrafterService`` stand-in: a chain tree ``root+1, root+2, ...`` of ``budget`` nodes."""

    def __init__(self, hang_s: float = 0.0, fail: bool = False, fail_ids: tuple[str, ...] = ()):
        self.hang_s, self.fail, self.fail_ids = hang_s, fail, set(fail_ids)
        self.contexts: dict[str, int] = {}
        self.calls: list[tuple] = []
        self.batches: list[list[str]] = []  # request ids of each draft_batch call

    def info(self) -> dict:
        return {"vocab_size": 400, "block_size": 4, "mask_token_id": 3, "feature_dim": 8, "max_position": 256,
                "methods": list(METHODS), "target_layer_ids": [1, 2], "description": "fake"}

    def num_contexts(self) -> int:
        return len(self.contexts)

    def draft(self, request_id, committed_ids, features, root_token, start, spec, max_depth=None):
        import time

        import torch

        from services.tree.draft_tree import tree_from_parents

        time.sleep(self.hang_s)
        if self.fail:
            raise ValueError("scripted drafter failure")
        assert features.shape == (len(committed_ids), 8)
        self.calls.append((request_id, list(committed_ids), features.clone(), root_token, start, spec.method, max_depth))
        self.contexts[request_id] = start
        n = min(spec.budget or 3, max_depth or 99)
        tree = tree_from_parents([root_token + 1 + i for i in range(n)], list(range(-1, n - 1)))
        return tree, {"draft": 0.0005, "tree_build": 0.0001}

    def draft_batch(self, jobs) -> list:
        """``draft`` per job; a job's error is returned in its place (as ``DrafterService.draft_batch``)."""
        self.batches.append([j.request_id for j in jobs])
        out = []
        for j in jobs:
            try:
                if j.request_id in self.fail_ids:
                    raise ValueError(f"scripted failure of {j.request_id}")
                out.append(self.draft(j.request_id, j.committed_ids, j.features, j.root_token, j.start, j.spec,
                                      max_depth=j.max_depth))
            except Exception as exc:
                out.append(exc)
        return out

    def release(self, request_id: str) -> None:
        self.contexts.pop(request_id, None)
