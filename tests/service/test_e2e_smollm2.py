"""``dartree serve`` on the real default target (SmolLM2-135M-Instruct) with the openai client (slow on CPU).

Uses the shipped drafter when present, else plain decoding (``--drafter none``). Checks stream ==
non-stream for completions and chat, and that the greedy served answer equals plain AR decoding
of the same target in this process (what ``dartree generate --method ar`` prints).
"""

from __future__ import annotations

import pytest

from services.testing import start_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    from services.models.registry import DEFAULT_DRAFTER_DIR, resolve_target

    target_dir = resolve_target(None)  # converts the GGUF once (~20 s) if needed
    drafter = str(DEFAULT_DRAFTER_DIR) if (DEFAULT_DRAFTER_DIR / "config.json").is_file() else "none"
    log = tmp_path_factory.mktemp("smol") / "serve.log"
    with start_server("--default-temperature", "0", log=log, target=target_dir, drafter=drafter, ready_timeout=600,
                      stop_timeout=120) as srv:
        yield srv


def test_smollm2_served_greedy_equals_plain_decoding_and_streams_match(smol):
    import openai

    from gateway.text import TextModel
    from services.params import SamplingParams, SpecParams
    from services.verifier.engine import SpecEngine
    from services.verifier.target import TargetModel

    client = openai.OpenAI(base_url=smol.base + "/v1", api_key="x", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    prompt = "The capital of France is"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=16, extra_body={"return_token_ids": True})
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=16, stream=True) if c.choices)
    assert streamed == plain.choices[0].text
    engine = SpecEngine(TargetModel.from_pretrained(smol.target_dir), None)
    ids = [t for r in engine.generate("ref", TextModel(smol.target_dir).encode(prompt), SamplingParams(max_tokens=16),
                                      SpecParams(method="ar")) for t in r.token_ids]
    assert plain.choices[0].model_extra["token_ids"] == ids
    messages = [{"role": "user", "content": "Say hello in French and in Japanese 😀"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=24)
    chunks = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=24, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
