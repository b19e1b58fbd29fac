"""Grammar-constrained decoding along each tree path: one llguidance token mask per verify row.

A request with a grammar (a JSON schema, ``response_format``, a forced tool call) holds one
``llguidance.LLMatcher`` advanced by its emitted tokens. Every verify row of a tree predicts the
token after its own root-to-node path, so its mask is the grammar state after that path: the tree is
walked depth first, consuming a node's token on the way down and rolling it back on the way up
(:meth:`GrammarState.tree_masks`). A draft node whose token the grammar forbids at its parent's
state is *grammar-masked*: its parent's target token is drawn from masked logits, so it can never
equal the node, and the walk (accept.py) never accepts it or anything below it. The rows of such
subtrees are left unmasked (their tokens are never emitted). The mask comes first, before the logit
processors (vLLM's order: grammar bitmask, then the sampler's processors; docs/serving.md
"Structured output and tool calls"). The matcher enters through the narrow :class:`Matcher`
protocol: the tree package stays torch-only (tests/test_layering.py); compiling grammars and
tokenizers is the verifier's job.

The walk is a Python loop over the tree's nodes (a grammar state is inherently sequential, as in
vLLM's and SGLang's speculative grammar support); the masks are applied to all rows at once.

Shapes: R verify rows, V vocabulary (of the logits), W = ceil(V_tok / 32) int32 words per bitmask
row (V_tok: the grammar tokenizer's vocabulary).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor


class Matcher(Protocol):
    """The grammar matcher the walk needs (``llguidance.LLMatcher`` is one; built by the verifier)."""

    def consume_token(self, token: int) -> bool: ...
    def rollback(self, num_tokens: int) -> bool: ...
    def is_stopped(self) -> bool: ...
    def is_error(self) -> bool: ...
    def get_error(self) -> str: ...
    def unsafe_compute_mask_ptr(self, trg_pointer: int, trg_byte_size: int) -> None: ...


class GrammarState:
    """One request's grammar matcher, at the request's emitted tokens.

    Args:
        matcher: a fresh :class:`Matcher` of the request's grammar (``llguidance.LLMatcher``).
        vocab_size: V, the logit columns (columns past the matcher's vocabulary are always masked).
        matcher_vocab_size: V_tok, the matcher tokenizer's vocabulary (bits per mask row, rounded up to 32).
    Raises:
        ValueError: the grammar did not compile (the matcher's one-line error).
    """

    def __init__(self, matcher: Matcher, vocab_size: int, matcher_vocab_size: int):
        if matcher.is_error():
            raise ValueError(f"invalid grammar: {(matcher.get_error().splitlines() or ['?'])[0]}")
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.words = (matcher_vocab_size + 31) // 32  # W

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but EOS may follow (the request ends here)."""
        return self.matcher.is_stopped()

    def advance(self, token: int) -> None:
        """Consume one emitted token.

        Raises:
            RuntimeError: the grammar forbids it (an engine bug: emitted tokens are drawn from masked rows).
        """
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused emitted token {token}: {self.matcher.get_error()}")

    def tree_masks(self, input_ids: Tensor, parent_rows: Tensor) -> tuple[Tensor, int]:
        """Allowed tokens at every verify row of a tree, each at the state of its own path.

        Args:
            input_ids: ``[R]`` long, row 0 = the root (already consumed: the last emitted token).
            parent_rows: ``[R]`` long, each row's parent row (-1 for the root; parents precede children).
        Returns:
            ``(allowed [R, V] bool, num_masked)``: ``num_masked`` counts draft rows whose token the
            grammar forbids at their parent's state (rows below them are unmasked: never accepted).
        """
        assert input_ids.ndim == 1 and parent_rows.shape == input_ids.shape, "need input_ids [R], parent_rows [R]"
        r = input_ids.shape[0]
        bits = torch.zeros((r, self.words), dtype=torch.int32)  # [R, W]; rows below a masked node: all ones
        ids, parents = input_ids.tolist(), parent_rows.tolist()
        children: list[list[int]] = [[] for _ in range(r)]
        for i in range(1, r):
            children[parents[i]].append(i)
        live = [False] * r
        masked = 0
        stack: list[tuple[int, bool]] = [(0, True)]  # (row, entering); leaving a row rolls its token back
        while stack:
            row, entering = stack.pop()
            if not entering:
                self.matcher.rollback(1)
                continue
            if row > 0 and not self.matcher.consume_token(ids[row]):  # the path now ends at this row
                raise RuntimeError(f"grammar walk failed at row {row}: {self.matcher.get_error()}")
            live[row] = True
            self._fill(bits, row)
            for c in reversed(children[row]):
                tok = ids[c]
                if tok < self.words * 32 and int(bits[row, tok >> 5]) >> (tok & 31) & 1:
                    stack.append((c, False))
                    stack.append((c, True))
                else:
                    masked += 1
        allowed = unpack_bitmask(bits, self.vocab_size)
        if not all(live):
            allowed[~torch.tensor(live)] = True
        return allowed, masked

    def _fill(self, bits: Tensor, row: int) -> None:
        """Write the current state's bitmask into ``bits[row]``."""
        v = bits[row]
        self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def current_mask(self) -> Tensor:
        """``[1, V]`` bool, the tokens allowed after the emitted tokens."""
        bits = torch.zeros((1, self.words), dtype=torch.int32)
        self._fill(bits, 0)
        return unpack_bitmask(bits, self.vocab_size)


def unpack_bitmask(bits: Tensor, vocab_size: int) -> Tensor:
    """``[R, W]`` int32 bitmask (bit ``t & 31`` of word ``t >> 5`` = token ``t`` allowed) -> ``[R, V]``
    bool; tokens past ``32 * W`` are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)  # [R, 32 W]
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size].clone()
    pad = torch.zeros((bits.shape[0], vocab_size - allowed.shape[1]), dtype=torch.bool)
    return torch.cat([allowed, pad], dim=1)


def mask_logits(logits: Tensor, allowed: Tensor) -> Tensor:
    """``logits [R, V]`` with the tokens ``allowed [R, V]`` forbids at ``-inf`` (a new tensor)."""
    assert logits.shape == allowed.shape, "logits and allowed must both be [R, V]"
    return torch.where(allowed.to(logits.device), logits, float("-inf"))  # one pass (no inverted mask)

