"""Text <-> token ids for the gateway: HF ``tokenizers`` + jinja2 chat templates (no transformers, no torch),
incremental detokenization and stop strings.

Special tokens in chat prompts: only the chat template's own markers become special tokens. Text a
client sends (message content and names, tool and assistant turns included, and string values of
``chat_template_kwargs``) is tokenized as text: ``"<|im_end|>"`` typed into a message is the seven
or so ordinary tokens that spell it, never the control token, so a message cannot close its turn
or forge another one (:meth:`TextModel.chat_prompt`). A raw ``/v1/completions`` string prompt is
different: there the client writes the whole prompt, template markers included, so special-token
text in it maps to the special tokens (as llama.cpp and vLLM do by default; :meth:`TextModel.encode`).

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

import json
import re
import secrets
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer

from services.protocol import config_eos_token_id, special_token_ids, tokenizer_hash

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 6  # prompt tokens decoded before the first generated one (leading-space rules)
# Texts longer than this (characters, ids) go through the ``*_batch`` calls of ``tokenizers``, which
# release the GIL: a multi-megabyte prompt tokenized on a worker thread then leaves the event loop free.
GIL_FREE_MIN = 4096
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback token


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (``bytes_to_unicode``) inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_decoder()


class TemplateError(ValueError):
    """The chat template is missing or failed on these messages (a 400 for the client)."""


class PromptTooLong(ValueError):
    """A prompt refused before tokenizing it: it has at least ``min_tokens`` tokens, over the limit."""

    def __init__(self, min_tokens: int, limit: int):
        super().__init__(f"the prompt has at least {min_tokens} tokens, over the limit of {limit}")
        self.min_tokens, self.limit = min_tokens, limit


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
        # The same tokenizer with special-token matching off (``split_special_tokens``): for client text.
        # A second instance rather than toggling the flag, so concurrent encodes never see it flip.
        self._text_tokenizer = Tokenizer.from_file(str(path))
        self._text_tokenizer.encode_special_tokens = True
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
        self._variables: tuple[str, frozenset[str]] | None = None  # (template, names it reads)
        spec = json.loads(path.read_text())
        self._added = {int(t["id"]): t["content"] for t in spec.get("added_tokens", [])}
        self._special = {t["content"]: int(t["id"]) for t in spec.get("added_tokens", []) if t.get("special")}
        # longest first, so a special token that extends another (``<|im_end|>`` vs ``<|im``) wins
        self._special_re = (re.compile("|".join(re.escape(t) for t in sorted(self._special, key=len, reverse=True)))
                            if self._special else None)
        self._decoders = _decoder_types(spec.get("decoder"))
        self._byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
        # byte-level BPE without a normalizer: every token stands for at most _max_token_bytes bytes of text
        self._bounded = (spec.get("normalizer") is None and "ByteLevel" in self._decoders
                         and (spec.get("model") or {}).get("type") == "BPE" and _keeps_text(spec.get("pre_tokenizer")))
        self._max_token_bytes = 0
        self._token_bytes: dict[int, bytes] = {}

    def _load_template(self) -> str | None:
        jinja = self.model_dir / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        tpl = self.tokenizer_config.get("chat_template")
        if isinstance(tpl, list):  # named templates: use "default"
            tpl = next((t["template"] for t in tpl if t.get("name") == "default"), None)
        return tpl

    def min_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens of ``text`` (either way of treating special-token
        text), without tokenizing it: its UTF-8 length over the longest token's. 0 when the tokenizer
        gives no such bound (a normalizer may shrink text; a model may fold unknown text into one token)."""
        if not self._bounded:
            return 0
        if not self._max_token_bytes:
            self._max_token_bytes = max(len(self._raw_bytes(i)) for i in range(self.vocab_size)) or 1
        return -(-len(text.encode("utf-8", errors="surrogatepass")) // self._max_token_bytes)

    def check_length(self, text: str, limit: int) -> None:
        """Raise :class:`PromptTooLong` when ``text`` surely has more than ``limit`` tokens (0: no limit)."""
        if limit and len(text) > limit:  # (shorter texts are left to the exact count: cheap to tokenize)
            n = self.min_tokens(text)
            if n > limit:
                raise PromptTooLong(n, limit)

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``.

        Args:
            add_special_tokens: add the tokenizer's own BOS/EOS (its post-processor), if it has any.
            split_special_tokens: False (raw prompts): special-token text (e.g. ``<|im_end|>``) maps to
                its id. True (text a client wrote inside a message): it is encoded as ordinary text.

        Long texts release the GIL while they are tokenized (see :data:`GIL_FREE_MIN`).
        """
        tok = self._text_tokenizer if split_special_tokens else self.tokenizer
        if len(text) > GIL_FREE_MIN:
            return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (incomplete UTF-8 shows as U+FFFD); long lists release the GIL."""
        if len(ids) > GIL_FREE_MIN:
            return self.tokenizer.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, on its own: a piece of a multibyte character stays partial
        (OpenAI's logprobs ``bytes``). Byte-level BPE and SentencePiece byte fallback are mapped
        exactly; other tokenizers use the token's own decoded text."""
        out = self._token_bytes.get(token_id)
        if out is None:
            out = self._token_bytes[token_id] = self._raw_bytes(token_id)
        return out

    def token_text(self, token_id: int) -> str:
        """The token as a string: its bytes as UTF-8, bytes of an incomplete character as ``\\xNN``."""
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")

    def _raw_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if "ByteLevel" in self._decoders and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if self._byte_fallback and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m[1], 16)])
        if self._decoders & {"Metaspace", "Replace"}:
            return piece.replace("\u2581", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text of a conversation under the model's chat template (for display: its
        tokenization is :meth:`chat_prompt`'s, which keeps client text from becoming special tokens).

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

    def template_variables(self) -> frozenset[str]:
        """Names the chat template reads from its context (``messages``, ``add_generation_prompt``, the
        options a ``chat_template_kwargs`` key may set...); empty without a template.

        Raises:
            TemplateError: the template does not parse.
        """
        if self.chat_template is None:
            return frozenset()
        if self._variables is None or self._variables[0] != self.chat_template:
            from jinja2 import TemplateSyntaxError, meta

            try:
                names = meta.find_undeclared_variables(_environment().parse(self.chat_template))
            except TemplateSyntaxError as exc:
                raise TemplateError(f"chat template failed: {exc}") from None
            self._variables = (self.chat_template, frozenset(names))
        return self._variables[1]

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Token ids of a rendered conversation (see :meth:`chat_prompt`)."""
        return self.chat_prompt(messages, add_generation_prompt, **kwargs)[0]

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, token_limit: int = 0,
                    **kwargs) -> tuple[list[int], str]:
        """``(token ids, text)`` of a conversation under the chat template; only the template's own
        markers are special tokens.

        Every string the client supplied (``messages`` and ``kwargs``, at any depth) has its
        special-token text swapped for a private placeholder before rendering, so the template sees
        the same conversation but its output tells the client's special-token text from its own
        markers. Without any such text (the usual case) the rendered text is encoded in one piece,
        exactly as before; otherwise it is cut at the template's markers (their ids are emitted) and
        each piece between them is encoded with :meth:`encode`'s ``split_special_tokens``, the
        placeholders turned back into the text the client wrote. The template's own BOS/EOS markers
        come from it; the tokenizer adds none.

        ``token_limit`` (0: none): a rendered prompt that surely has more tokens is refused before it
        is tokenized (:meth:`check_length`).

        Raises:
            TemplateError: no template, or the template raised on these messages.
            PromptTooLong: see ``token_limit``.
        """
        guard = _SpecialTextGuard(self._special_re)
        rendered = self.render_chat(guard.protect(messages), add_generation_prompt, **guard.protect(kwargs))
        self.check_length(rendered, token_limit)
        if not guard.used:
            return self.encode(rendered, add_special_tokens=False), rendered
        ids: list[int] = []
        start = 0
        for m in self._special_re.finditer(rendered):  # the template's markers (client text is placeholders)
            ids += self._encode_text(guard.restore(rendered[start:m.start()]))
            ids.append(self._special[m.group()])
            start = m.end()
        ids += self._encode_text(guard.restore(rendered[start:]))
        return ids, guard.restore(rendered)

    def _encode_text(self, text: str) -> list[int]:
        return self.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []


class _SpecialTextGuard:
    """Swaps special-token text in client strings for placeholders and back (one conversation).

    A placeholder is ``U+E000 <random nonce> <n> U+E001`` (private-use characters): it has no
    special-token text in it and, with a fresh 64-bit nonce per conversation, cannot be forged.
    """

    def __init__(self, special_re: re.Pattern | None):
        self._re = special_re
        self._nonce = secrets.token_hex(8)
        self._texts: list[str] = []
        self._index: dict[str, int] = {}
        self._back = re.compile("\ue000" + self._nonce + r"(\d+)\ue001")

    @property
    def used(self) -> bool:
        """Whether any client string held special-token text."""
        return bool(self._texts)

    def protect(self, value):
        """``value`` (str, or lists / tuples / dicts of them at any depth) with special-token text swapped."""
        if isinstance(value, str):
            return self._re.sub(self._placeholder, value) if self._re is not None else value
        if isinstance(value, dict):
            return {k: self.protect(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.protect(v) for v in value)
        return value

    def restore(self, text: str) -> str:
        """``text`` with every placeholder turned back into the special-token text it stands for."""
        return self._back.sub(lambda m: self._texts[int(m.group(1))], text) if self._texts else text

    def _placeholder(self, m: re.Match) -> str:
        n = self._index.get(m.group())
        if n is None:
            n = self._index[m.group()] = len(self._texts)
            self._texts.append(m.group())
        return f"\ue000{self._nonce}{n}\ue001"


def _keeps_text(pre: dict | None) -> bool:
    """Whether a ``tokenizer.json`` pre-tokenizer only splits (never drops) text."""
    if not pre:
        return True
    if pre.get("type") == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") in ("ByteLevel", "Split", "Digits", "Punctuation") and pre.get("behavior") != "Removed"


def _decoder_types(decoder: dict | None) -> set[str]:
    """Types of a ``tokenizer.json`` decoder, a ``Sequence`` flattened."""
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return set().union(*(_decoder_types(d) for d in decoder.get("decoders", [])))
    return {decoder.get("type", "")}


def _compile(source: str):
    return _environment().from_string(source)


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                               ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


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
