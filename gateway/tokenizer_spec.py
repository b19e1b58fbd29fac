"""What the gateway reads from a ``tokenizer.json`` besides the tokenizer itself: its added and special
tokens, its decoder kinds, and the bytes one token piece stands for."""

from __future__ import annotations

import re
from dataclasses import dataclass

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback token


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (``bytes_to_unicode``) inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


BYTE_LEVEL = _byte_level_decoder()


def keeps_text(pre: dict | None) -> bool:
    """Whether a ``tokenizer.json`` pre-tokenizer only splits (never drops) text."""
    if not pre:
        return True
    if pre.get("type") == "Sequence":
        return all(keeps_text(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") in ("ByteLevel", "Split", "Digits", "Punctuation") and pre.get("behavior") != "Removed"


def decoder_types(decoder: dict | None) -> set[str]:
    """Types of a ``tokenizer.json`` decoder, a ``Sequence`` flattened."""
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return set().union(*(decoder_types(d) for d in decoder.get("decoders", [])))
    return {decoder.get("type", "")}


@dataclass(frozen=True)
class TokenizerSpec:
    """The parts of a parsed ``tokenizer.json`` the gateway uses beyond encoding and decoding.

    ``added``: added-token id -> text; ``special``: special-token text -> id; ``special_re`` matches
    any special-token text, longest first (None without special tokens); ``decoders``: decoder types;
    ``byte_fallback``: SentencePiece ``<0xNN>`` pieces; ``bounded``: byte-level BPE without a
    normalizer, so every token stands for at most its longest piece's bytes of text.
    """

    added: dict[int, str]
    special: dict[str, int]
    special_re: re.Pattern | None
    decoders: frozenset[str]
    byte_fallback: bool
    bounded: bool

    @classmethod
    def from_json(cls, spec: dict) -> TokenizerSpec:
        """The spec of a ``tokenizer.json`` (its parsed JSON object)."""
        added_tokens = spec.get("added_tokens", [])
        special = {t["content"]: int(t["id"]) for t in added_tokens if t.get("special")}
        # longest first, so a special token that extends another (``<|im_end|>`` vs ``<|im``) wins
        special_re = (re.compile("|".join(re.escape(t) for t in sorted(special, key=len, reverse=True)))
                      if special else None)
        decoders = frozenset(decoder_types(spec.get("decoder")))
        model = spec.get("model") or {}
        bounded = (spec.get("normalizer") is None and "ByteLevel" in decoders and model.get("type") == "BPE"
                   and keeps_text(spec.get("pre_tokenizer")))
        return cls({int(t["id"]): t["content"] for t in added_tokens}, special, special_re, decoders,
                   bool(model.get("byte_fallback")), bounded)

    def piece_bytes(self, piece: str) -> bytes | None:
        """The bytes a vocabulary piece stands for, when its kind maps exactly (byte-level BPE,
        SentencePiece byte fallback, Metaspace / Replace); None otherwise (decode the token instead)."""
        if "ByteLevel" in self.decoders and all(c in BYTE_LEVEL for c in piece):
            return bytes(BYTE_LEVEL[c] for c in piece)
        if self.byte_fallback and (m := BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m[1], 16)])
        if self.decoders & {"Metaspace", "Replace"}:
            return piece.replace("\u2581", " ").encode()
        return None
