"""Generated token ids -> response text: incremental detokenization and stop strings.

:class:`CompletionText` is the one place where generated token ids become response text. Streaming
and non-streaming both run it round by round, so the concatenated deltas equal the non-streamed text
byte for byte. It holds back incomplete UTF-8 (text ending in U+FFFD) and any suffix that could be
the start of a stop string; a stop string ends generation at the token that completes it: text is
cut before the stop string, and that token is the last one counted in ids and usage.

It also says which tokens each piece of released text belongs to (:meth:`CompletionText.take_tokens`):
a token's text is what the detokenizer produced when it was pushed (a token that only starts a
character shares the text of the token that completes it), and a token is handed out with the
release that carries the end of its text. A stop string or the end of generation hands out every
counted token. So per-token data (ids, logprobs) rides with its own text in a stream.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.text import TextModel

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 6  # prompt tokens decoded before the first generated one (leading-space rules)


class IncrementalDetokenizer:
    """Token-by-token text that never emits a partial UTF-8 character.

    Decodes a sliding window (``prefix_offset .. end``) and emits the growth over the window's
    previous text. A trailing run of U+FFFD (an incomplete character) is held back, but the
    complete characters before it are emitted at once: a token carrying the end of one
    character and the first bytes of the next completes that character (a stop string ending
    there matches at that token, not one later). Seeded with the prompt's last tokens so
    leading-space rules (SentencePiece) come out as in the full text.
    """

    def __init__(self, model: TextModel, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._model = model
        self._skip = skip_special_tokens
        tail = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        if tail and model.decode(tail, skip_special_tokens).endswith(REPLACEMENT):
            tail = []
        self.ids: list[int] = tail
        self._prefix_offset = 0
        self._read_offset = len(tail)
        self._emitted = 0  # characters of the window's growth already emitted (before a trailing U+FFFD run)
        self.num_prompt = len(tail)

    def _window_texts(self) -> tuple[str, str]:
        ids = self.ids
        prefix = self._model.decode(ids[self._prefix_offset:self._read_offset], self._skip)
        return prefix, self._model.decode(ids[self._prefix_offset:], self._skip)

    def push(self, token_id: int) -> str:
        """Append one token; the text it completes (possibly ``""``)."""
        self.ids.append(token_id)
        prefix, new = self._window_texts()
        if len(new) <= len(prefix):
            return ""
        done = len(prefix) + self._emitted
        if not new.endswith(REPLACEMENT):
            self._prefix_offset, self._read_offset, self._emitted = self._read_offset, len(self.ids), 0
            return new[done:]
        stable = new.rstrip(REPLACEMENT)  # complete characters before the incomplete one are final
        if len(stable) > done:
            self._emitted = len(stable) - len(prefix)
            return stable[done:]
        return ""

    def flush(self) -> str:
        """Everything held back (at the end of generation, incomplete characters included)."""
        prefix, new = self._window_texts()
        done = len(prefix) + self._emitted
        self._prefix_offset = self._read_offset = len(self.ids)
        self._emitted = 0
        return new[done:] if len(new) > done else ""


@dataclass
class TextDelta:
    """What one round adds to a response."""

    text: str                      # new text (may be "" when everything is held back)
    token_ids: list[int]           # the round's tokens that count (cut after a stop string)
    stop: str | None = None        # the stop string that ended generation, if any


@dataclass(frozen=True)
class TokenSpan:
    """A counted token handed out with released text: its id and where its text starts in the
    response text (clamped to the text's length for text cut away by a stop string)."""

    token_id: int
    offset: int


@dataclass
class CompletionText:
    """Turns rounds of generated ids into response text, applying stop strings (see module docstring)."""

    model: TextModel
    prompt_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    skip_special_tokens: bool = True
    num_tokens: int = 0            # tokens counted so far (usage.completion_tokens)
    stopped: str | None = None
    _pending: str = ""
    _detok: IncrementalDetokenizer = field(init=False)
    _decoded: int = 0              # characters decoded so far (before any stop-string cut)
    _released: int = 0             # characters released so far
    _open: list = field(default_factory=list)      # (id, start) of tokens whose text is not complete yet
    _done: deque = field(default_factory=deque)    # (id, start, end) of tokens with text, not handed out
    _out: list = field(default_factory=list)       # TokenSpans released, not yet taken

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.model, self.prompt_ids, self.skip_special_tokens)
        self._max_stop = max((len(s) for s in self.stop), default=0)

    def feed(self, token_ids: Sequence[int]) -> TextDelta:
        """Process one round's tokens; after a stop string matched, the rest of the round is dropped."""
        if self.stopped is not None:
            return TextDelta("", [])
        for i, tok in enumerate(token_ids):
            self._push(tok)
            cut = self._find_stop()
            if cut is not None:
                self.num_tokens += i + 1
                self._hand_out(cut, everything=True)
                return TextDelta(cut, list(token_ids[:i + 1]), self.stopped)
        self.num_tokens += len(token_ids)
        out = self._release()
        self._hand_out(out)
        return TextDelta(out, list(token_ids))

    def finish(self) -> str:
        """Text held back at the end of generation (stop strings still apply); every token is handed out."""
        if self.stopped is not None:
            return ""
        self._pending += self._detok.flush()
        cut = self._find_stop()
        if cut is not None:
            self._hand_out(cut, everything=True)
            return cut
        out, self._pending = self._pending, ""
        self._hand_out(out, everything=True)
        return out

    def take_tokens(self) -> list[TokenSpan]:
        """Counted tokens whose text has been released since the last call, in order."""
        out, self._out = self._out, []
        return out

    def _push(self, tok: int) -> None:
        piece = self._detok.push(tok)
        self._open.append((tok, self._decoded))
        self._pending += piece
        self._decoded += len(piece)
        if piece:  # completes the text of this token and of the ones before it that started a character
            self._done.extend((t, start, self._decoded) for t, start in self._open)
            self._open.clear()

    def _hand_out(self, text: str, everything: bool = False) -> None:
        """``text`` was released: hand out the tokens whose text ends within what is released."""
        self._released += len(text)
        while self._done and (everything or self._done[0][2] <= self._released):
            t, start, _ = self._done.popleft()
            self._out.append(TokenSpan(t, min(start, self._released)))
        if everything:
            self._out += [TokenSpan(t, min(start, self._released)) for t, start in self._open]
            self._open.clear()

    def _find_stop(self) -> str | None:
        """If a stop string occurs in the pending text: mark it and return the text before it."""
        if not self.stop or not self._pending:
            return None
        best = None
        for s in self.stop:
            idx = self._pending.find(s)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.stopped = best[1]
        out, self._pending = self._pending[:best[0]], ""
        return out

    def _release(self) -> str:
        """Emit pending text except a suffix that may start a stop string."""
        hold = 0
        for k in range(min(self._max_stop - 1, len(self._pending)), 0, -1):
            tail = self._pending[-k:]
            if any(s.startswith(tail) for s in self.stop):
                hold = k
                break
        out = self._pending[:len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold:]
        return out
