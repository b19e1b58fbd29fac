"""OpenAI ``logprobs`` objects from the verifier's per-token logprobs (completions and chat shapes).

The values are the target's raw logprobs (``log_softmax`` of its logits before temperature, top-p
and top-k, like vLLM's default), one entry per emitted token; which tokens an entry list covers
(a stream chunk's or the whole response's) is decided by :class:`gateway.detokenize.CompletionText`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.text import TextModel


@dataclass
class TokenOut:
    """One emitted token as the response reports it.

    Attributes:
        token_id: the token; offset: where its text starts in the response text (characters).
        logprob: its raw logprob (None when the request did not ask for logprobs).
        top: ``(token id, logprob)`` of the most likely tokens at its position, most likely first.
    """

    token_id: int
    offset: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


def completion_logprobs(tokens: list[TokenOut], text: TextModel) -> dict:
    """The legacy completions shape ``{tokens, token_logprobs, top_logprobs, text_offset}``.

    ``top_logprobs[i]`` maps token strings to logprobs: the top-k, plus the emitted token when it is
    not among them (OpenAI: "up to logprobs + 1 elements").
    """
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        token = text.token_text(t.token_id)
        top: dict[str, float] = {}
        for i, v in t.top:
            top.setdefault(text.token_text(i), v)
        top.setdefault(token, t.logprob)
        out["tokens"].append(token)
        out["token_logprobs"].append(t.logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(t.offset)
    return out


def chat_logprobs(tokens: list[TokenOut], text: TextModel) -> dict:
    """The chat shape ``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""
    return {"content": [{**_entry(t.token_id, t.logprob, text),
                         "top_logprobs": [_entry(i, v, text) for i, v in t.top]} for t in tokens]}


def _entry(token_id: int, logprob: float | None, text: TextModel) -> dict:
    return {"token": text.token_text(token_id), "logprob": logprob, "bytes": list(text.token_bytes(token_id))}
