"""Chat templates for the gateway: loading one, the sandboxed jinja2 environment that renders it, and
the guard that keeps special-token text a client wrote from becoming the template's control tokens."""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from pathlib import Path


class TemplateError(ValueError):
    """The chat template is missing or failed on these messages (a 400 for the client)."""


def token_content(value) -> str | None:
    """The text of a ``tokenizer_config.json`` special-token entry (a string, or a dict with ``content``)."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def load_template(model_dir: Path, tokenizer_config: dict) -> str | None:
    """A model directory's chat template source: ``chat_template.jinja``, else the
    ``tokenizer_config.json`` ``chat_template`` (of a list of named ones, ``"default"``); None without one."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tpl = tokenizer_config.get("chat_template")
    if isinstance(tpl, list):  # named templates: use "default"
        tpl = next((t["template"] for t in tpl if t.get("name") == "default"), None)
    return tpl


def compile_template(source: str):
    """``source`` compiled in :func:`environment` (a ``jinja2.Template``).

    Raises:
        jinja2.TemplateSyntaxError: the template does not parse.
    """
    return environment().from_string(source)


def template_variables(source: str) -> frozenset[str]:
    """Names the template ``source`` reads from its context (``messages``, ``add_generation_prompt``...).

    Raises:
        TemplateError: the template does not parse.
    """
    from jinja2 import TemplateSyntaxError, meta

    try:
        return frozenset(meta.find_undeclared_variables(environment().parse(source)))
    except TemplateSyntaxError as exc:
        raise TemplateError(f"chat template failed: {exc}") from None


def environment():
    """The sandboxed, immutable jinja2 environment of HF chat templates: ``trim_blocks``,
    ``lstrip_blocks``, loop controls, a ``tojson`` filter, and the globals ``raise_exception``
    (raises :class:`TemplateError`) and ``strftime_now``."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                               ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class SpecialTextGuard:
    """Swaps special-token text in client strings for placeholders and back (one conversation).

    A placeholder is ``U+E000 <random nonce> <n> U+E001`` (private-use characters): it has no
    special-token text in it and, with a fresh 64-bit nonce per conversation, cannot be forged.

    Args:
        special_re: matches the tokenizer's special-token texts (None: the tokenizer has none).
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
