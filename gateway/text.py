"""Text <-> token ids for the gateway: HF ``tokenizers`` + jinja2 chat templates (no transformers, no torch).

Special tokens in chat prompts: only the chat template's own markers become special tokens. Text a
client sends (message content and names, tool and assistant turns included, and string values of
``chat_template_kwargs``) is tokenized as text: ``"<|im_end|>"`` typed into a message is the seven
or so ordinary tokens that spell it, never the control token, so a message cannot close its turn
or forge another one (:meth:`TextModel.chat_prompt`). A raw ``/v1/completions`` string prompt is
different: there the client writes the whole prompt, template markers included, so special-token
text in it maps to the special tokens (as llama.cpp and vLLM do by default; :meth:`TextModel.encode`).

Generated ids become response text in :mod:`gateway.detokenize` (incremental detokenization and
stop strings); its names are importable from here too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from gateway.chat_template import (SpecialTextGuard, TemplateError, compile_template, load_template,
                                   template_variables, token_content)
from gateway.detokenize import (PROMPT_CONTEXT_TOKENS, REPLACEMENT, CompletionText, IncrementalDetokenizer,
                                TextDelta, TokenSpan)
from gateway.tokenizer_spec import TokenizerSpec
from services.protocol import config_eos_token_id, special_token_ids, tokenizer_hash

__all__ = ["GIL_FREE_MIN", "PROMPT_CONTEXT_TOKENS", "REPLACEMENT", "CompletionText", "IncrementalDetokenizer",
           "PromptTooLong", "TemplateError", "TextDelta", "TextModel", "TokenSpan"]

# Texts longer than this (characters, ids) go through the ``*_batch`` calls of ``tokenizers``, which
# release the GIL: a multi-megabyte prompt tokenized on a worker thread then leaves the event loop free.
GIL_FREE_MIN = 4096


class PromptTooLong(ValueError):
    """A prompt refused before tokenizing it: it has at least ``min_tokens`` tokens, over the limit."""

    def __init__(self, min_tokens: int, limit: int):
        super().__init__(f"the prompt has at least {min_tokens} tokens, over the limit of {limit}")
        self.min_tokens, self.limit = min_tokens, limit


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
        self.eos_token_id = self._eos_token_id()
        self.chat_template = load_template(self.model_dir, self.tokenizer_config)
        self._compiled = None
        self._variables: tuple[str, frozenset[str]] | None = None  # (template, names it reads)
        self._spec = TokenizerSpec.from_json(json.loads(path.read_text()))
        self._max_token_bytes = 0  # (bounded spec) the longest token's bytes, 0 until first needed
        self._token_bytes: dict[int, bytes] = {}

    def _eos_token_id(self) -> int:
        """``config.json``'s EOS id, else the id of ``tokenizer_config.json``'s ``eos_token``; -1 without either."""
        eos = config_eos_token_id(self.model_dir)
        if eos < 0:
            eos_text = token_content(self.tokenizer_config.get("eos_token"))
            eos = self.tokenizer.token_to_id(eos_text) if eos_text else None
            eos = -1 if eos is None else eos
        return eos

    def min_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens of ``text`` (either way of treating special-token
        text), without tokenizing it: its UTF-8 length over the longest token's. 0 when the tokenizer
        gives no such bound (a normalizer may shrink text; a model may fold unknown text into one token)."""
        if not self._spec.bounded:
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
        if token_id in self._spec.added:
            return self._spec.added[token_id].encode()
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        out = self._spec.piece_bytes(piece)
        return out if out is not None else self.decode([token_id], skip_special_tokens=False).encode()

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text of a conversation under the model's chat template (for display: its
        tokenization is :meth:`chat_prompt`'s, which keeps client text from becoming special tokens).

        Raises:
            TemplateError: no template, or the template raised on these messages.
        """
        if self.chat_template is None:
            raise TemplateError("this model has no chat template; use /v1/completions")
        if self._compiled is None:
            self._compiled = compile_template(self.chat_template)
        cfg = self.tokenizer_config
        special = {k: token_content(cfg.get(k)) or "" for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
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
            self._variables = (self.chat_template, template_variables(self.chat_template))
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
        guard = SpecialTextGuard(self._spec.special_re)
        rendered = self.render_chat(guard.protect(messages), add_generation_prompt, **guard.protect(kwargs))
        self.check_length(rendered, token_limit)
        if not guard.used:
            return self.encode(rendered, add_special_tokens=False), rendered
        ids: list[int] = []
        start = 0
        for m in self._spec.special_re.finditer(rendered):  # the template's markers (client text is placeholders)
            ids += self._encode_text(guard.restore(rendered[start:m.start()]))
            ids.append(self._spec.special[m.group()])
            start = m.end()
        ids += self._encode_text(guard.restore(rendered[start:]))
        return ids, guard.restore(rendered)

    def _encode_text(self, text: str) -> list[int]:
        return self.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []

