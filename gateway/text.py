"""Text <-> token ids for the gateway: HF ``tokenizers`` + jinja2 chat templates (no transformers, no torch),
incremental detokenization and stop strings.

:class:`CompletionText` is the one place where generated token ids become response text. Streaming
and non-streaming both run it round by round, so the concatenated deltas equal the non-streamed text
byte for byte. It holds back incomplete UTF-8 (text ending in U+FFFD) and any suffix that could be
the start of a stop string; a stop string ends generation at the token that completes it: text is
cut before the stop string, and that token is the last one counted in ids and usage.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer

from services.protocol import config_eos_token_id, special_token_ids, tokenizer_hash

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 6  # prompt tokens decoded before the first generated one (leading-space rules)


class TemplateError(ValueError):
    """The chat template is missing or failed on these messages (a 400 for the client)."""


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class TextModel:
    """A model directory's tokenizer and chat template.

    Args:
        model_dir: directory with ``tokenizer.json`` and optionally ``tokenizer_config.json``,
            ``chat_template.jinja``, ``config.json``.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {self.model_dir}")
        self.tokenizer = Tokenizer.from_file(str(path))
        cfg_path = self.model_dir / "tokenizer_config.json"
        self.tokenizer_config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.tokenizer_hash = tokenizer_hash(self.model_dir)
        self.special_token_ids = special_token_ids(self.model_dir)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        eos = config_eos_token_id(self.model_dir)
        if eos < 0:
            eos_text = _token_content(self.tokenizer_config.get("eos_token"))
            eos = self.tokenizer.token_to_id(eos_text) if eos_text else None
            eos = -1 if eos is None else eos
        self.eos_token_id = eos
        self.chat_template = self._load_template()
        self._compiled = None

    def _load_template(self) -> str | None:
        jinja = self.model_dir / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        tpl = self.tokenizer_config.get("chat_template")
        if isinstance(tpl, list):  # named templates: use "default"
            tpl = next((t["template"] for t in tpl if t.get("name") == "default"), None)
        return tpl

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token text (e.g. ``<|im_end|>``) maps to its id."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (incomplete UTF-8 shows as U+FFFD)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text of a conversation under the model's chat template.

        Raises:
            TemplateError: no template, or the template raised on these messages.
        """
        if self.chat_template is None:
            raise TemplateError("this model has no chat template; use /v1/completions")
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        cfg = self.tokenizer_config
        special = {k: _token_content(cfg.get(k)) or "" for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **special, **kwargs)
        except TemplateError:
            raise
        except Exception as exc:  # jinja errors: a bad conversation for this template
            raise TemplateError(f"chat template failed: {exc}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Token ids of a rendered conversation (the template already adds special tokens)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **kwargs), add_special_tokens=False)


def _compile(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                               ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


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

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.model, self.prompt_ids, self.skip_special_tokens)
        self._max_stop = max((len(s) for s in self.stop), default=0)

    def feed(self, token_ids: Sequence[int]) -> TextDelta:
        """Process one round's tokens; after a stop string matched, the rest of the round is dropped."""
        if self.stopped is not None:
            return TextDelta("", [])
        for i, tok in enumerate(token_ids):
            self._pending += self._detok.push(tok)
            cut = self._find_stop()
            if cut is not None:
                self.num_tokens += i + 1
                return TextDelta(cut, list(token_ids[:i + 1]), self.stopped)
        self.num_tokens += len(token_ids)
        return TextDelta(self._release(), list(token_ids))

    def finish(self) -> str:
        """Text held back at the end of generation (stop strings still apply)."""
        if self.stopped is not None:
            return ""
        self._pending += self._detok.flush()
        cut = self._find_stop()
        if cut is not None:
            return cut
        out, self._pending = self._pending, ""
        return out

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
