"""Test doubles for the service: tiny tokenizer directories and a scripted engine client.

Nothing here loads a model: tokenizers are built in milliseconds with the ``tokenizers`` library,
and the engine client plays scripted multi-token rounds (style.md R10: mock the model, not the
machinery). The engine and drafter doubles of the workers live in :mod:`tests.doubles`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.engine_client import InprocEngineClient, _QueueClient
from services.protocol import Abort, Generate, Limits, PeerInfo, RequestError, RoundChunk, TokenLogprobs
from services.spec import DFLASH_METHODS
from services.tiny_models import CHAT_TEMPLATE, bytefallback_model_dir, bytelevel_model_dir  # noqa: F401

METHODS = DFLASH_METHODS  # a Domino drafter's methods
def verifier_info(vocab_size: int, max_context: int = 256, **kw) -> PeerInfo:
    base = dict(role="verifier", epoch="fake", vocab_size=vocab_size, eos_token_id=2, max_context=max_context,
                model="tiny", methods=METHODS,
                limits=Limits(max_context=max_context, max_budget=64, max_running=4, max_waiting=8,
                              max_width=64, max_candidates=64))
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
    stop_token_id: int | None = None       # with finish "stop": the stop id the engine cut at

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
                                  accept_length=max(0, len(chunk) - 1), logprobs=lp,
                                  stop_token_id=self.stop_token_id if done and finish == "stop" else None))
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

class InprocWorkerStack:
    """The gateway app (``self.app``) over an :class:`InprocEngineClient` and a verifier worker thread
    running ``engine`` (a real ``SpecEngine``): HTTP (ASGI) -> gateway -> worker -> engine in one
    process. ``gateway_kw``: more :class:`GatewayConfig` fields. ``close()`` stops the worker thread."""

    def __init__(self, model_dir, text, engine, info: PeerInfo, **gateway_kw):
        from gateway.app import create_app
        from gateway.config import GatewayConfig
        from services.verifier.worker import VerifierWorker, VerifierWorkerConfig

        self.text, self.engine = text, engine
        self.worker = VerifierWorker(engine, info, VerifierWorkerConfig())
        self.client = InprocEngineClient(post=lambda m: self.worker.post(b"inproc", m), hello=self.worker.hello,
                                         status=self.worker.status, local=PeerInfo(role="gateway", epoch="g"))
        self.worker.send = self._send
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.worker.event_loop, args=(self.stop,), daemon=True)
        self.thread.start()
        self.app = create_app(GatewayConfig(target=str(model_dir), served_model_name="tiny", default_temperature=0.0,
                                            **gateway_kw), self.client, self.text)

    def _send(self, identity, msg, frames=()) -> None:
        try:
            self.client.deliver_threadsafe(msg)
        except RuntimeError:  # a late round for a request whose test event loop is closed
            pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
