"""``GET /health/generate``: a deep readiness probe that runs a tiny greedy generation through the engine.

The probe is a normal request on the gateway's engine client (same path, same handshake, same
deadline mechanism) that skips the gateway's admission limit and its user-facing request metrics
(TTFT, end to end, finish reasons, tokens); the verifier and the drafter count it in their own
metrics like any request. Its request id starts with ``health-`` (in their logs).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from gateway.engine_client import EngineClient, EngineError
from gateway.text import TextModel
from services.params import SamplingParams, SpecParams
from services.protocol import Generate

PROMPT = "ping"
# The verifier's prefill emits the first token; the second needs a draft round, so the drafter is
# exercised too (with EOS ignored, exactly this many tokens come back unless something fails).
NUM_TOKENS = 2


class GenerateProbe:
    """One shared probe at a time: concurrent callers await the same generation.

    The route is open without the API key, so callers must not be able to multiply the engine work;
    a caller that arrives while a probe runs gets that probe's result (and its latency).

    Args:
        engine: the gateway's engine client; text: the tokenizer (for the prompt);
        timeout_s: deadline of the generation (past it the request is aborted and the probe fails).
    """

    def __init__(self, engine: EngineClient, text: TextModel, timeout_s: float):
        self.engine, self.timeout_s = engine, timeout_s
        self.prompt_ids = text.encode(PROMPT) or [0]
        self._running: asyncio.Future | None = None

    async def run(self) -> tuple[bool, str, float]:
        """``(ok, reason, seconds)``: whether the generation came back whole in time, why not, how long it took."""
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._generate())
        return await asyncio.shield(self._running)

    async def _generate(self) -> tuple[bool, str, float]:
        t0 = time.monotonic()
        sampling = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
        # an explicit budget: the goodput policy may skip drafting for a request that leaves it unset,
        # and this probe must go through the drafter whenever the server has one
        gen = Generate(f"health-{uuid.uuid4().hex[:16]}", list(self.prompt_ids), sampling, SpecParams(budget=2))
        num_tokens = draft_tokens = 0
        try:
            async for chunk in self.engine.generate(gen, deadline=t0 + self.timeout_s):
                num_tokens += len(chunk.token_ids)
                draft_tokens += chunk.num_draft_tokens
        except EngineError as err:
            why = f"no answer within {self.timeout_s:g} s" if err.status == 504 else err.message
            return False, why, time.monotonic() - t0
        if num_tokens != NUM_TOKENS:
            return False, f"{num_tokens} tokens came back, {NUM_TOKENS} were asked for", time.monotonic() - t0
        info = self.engine.info
        if info is not None and len(info.methods) > 1 and not draft_tokens:  # a drafter runs, but did not draft
            return False, "the drafter took no part (the verifier decodes without speculation while it is down)", \
                time.monotonic() - t0
        return True, "ok", time.monotonic() - t0
