"""A request's sampling and speculation parameters: one torch-free type from the gateway to the engine.

The gateway fills :class:`SamplingParams` and :class:`SpecParams` from the OpenAI body
(``gateway/requests.py``) and calls :meth:`~SamplingParams.check`; the wire ``Generate`` message
carries them as they are (``services/protocol.py``); the verifier's engine reads them directly
and derives its logit processors' options from them with one function
(``services.verifier.sampling.logit_options``). Nothing copies them field by field.

A new request option is a field here (with its range in ``check``), the OpenAI field in
``gateway/schemas.py`` plus its line in ``gateway/requests.py:prepare``, and its processor
(docs/design.md, "Add a request option").

Units: token counts and ids are integers; probabilities in ``[0, 1]``; penalties and biases are
added to logits (natural-log units).
"""

from __future__ import annotations

from math import isfinite

import msgspec

from services.spec import DEFAULT_METHOD, METHODS, Method, TreeKnobs, check_tree_knobs

MAX_TOP_LOGPROBS = 20       # alternatives per token a request may ask for (OpenAI chat's top_logprobs limit)
MAX_LOGIT_BIAS = 300        # logit_bias entries a request may send (OpenAI's limit)
MAX_GRAMMAR_CHARS = 256 * 1024  # largest grammar a request may carry (gateway.tools refuses larger: 400)


class ParamError(ValueError):
    """A parameter out of range: the one-line message and the request field it names (``param``,
    the OpenAI-shaped error's ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _opts() -> dict:
    return {"array_like": True, "omit_defaults": True, "gc": False, "forbid_unknown_fields": True}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and isfinite(v)


class SamplingParams(msgspec.Struct, **_opts()):
    """How one request's tokens are chosen and when it stops. ``temperature == 0`` is greedy.

    Attributes:
        max_tokens: most tokens to emit (>= 1); temperature (>= 0), top_p (in (0, 1]), top_k (>= 0,
            0 = off), min_p (in [0, 1], relative probability floor, T > 0): the sampler's filters;
        seed: T > 0: the token at position t is drawn from this seed's uniform at t (None: a
            random seed); stop_token_ids: ids that end the request (excluded from the output);
        ignore_eos: keep going past EOS; logprobs: None (off) or k in ``[0, MAX_TOP_LOGPROBS]``:
            each emitted token's raw target logprob and its top-k alternatives;
        presence_penalty, frequency_penalty: in [-2, 2], over output tokens (times the count for
            frequency); repetition_penalty: > 0, over prompt + output tokens; logit_bias: token id ->
            bias in [-100, 100], at most ``MAX_LOGIT_BIAS`` entries; min_tokens: EOS / stop ids are
            masked before this many output tokens (``<= max_tokens``); grammar: an llguidance grammar
            the output must match (at most ``MAX_GRAMMAR_CHARS`` characters).
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    min_tokens: int = 0
    min_p: float = 0.0
    grammar: str | None = None

    def check(self, vocab_size: int | None = None) -> None:
        """Every field's range, in declaration order (the one range check of a request's sampling).

        Args:
            vocab_size: token ids (stop ids, logit_bias keys) must be below it (None: not checked).
        Raises:
            ParamError: one line naming the first bad field.
        """
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ParamError("max_tokens", f"max_tokens must be a positive integer (got {self.max_tokens!r})")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ParamError("temperature", f"temperature must be a finite number >= 0 (got {self.temperature!r})")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ParamError("top_p", f"top_p must be in (0, 1] (got {self.top_p!r})")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ParamError("top_k", f"top_k must be an integer >= 0 (got {self.top_k!r})")
        if self.seed is not None and not _is_int(self.seed):
            raise ParamError("seed", f"seed must be an integer or None (got {self.seed!r})")
        self._check_ids(self.stop_token_ids, "stop_token_ids", vocab_size)
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS):
            raise ParamError("logprobs", f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None (got {lp!r})")
        for name, lo, hi in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2), ("min_p", 0, 1)):
            v = getattr(self, name)
            if not _is_number(v) or not lo <= v <= hi:
                raise ParamError(name, f"{name} must be a number in [{lo}, {hi}] (got {v!r})")
        r = self.repetition_penalty
        if not _is_number(r) or r <= 0:
            raise ParamError("repetition_penalty", f"repetition_penalty must be a finite number > 0 (got {r!r})")
        self._check_bias(vocab_size)
        m = self.min_tokens
        if not _is_int(m) or not 0 <= m <= self.max_tokens:
            raise ParamError("min_tokens", f"min_tokens must be an integer in [0, max_tokens] (got {m!r})")
        if self.grammar is not None and len(self.grammar) > MAX_GRAMMAR_CHARS:
            raise ParamError("grammar", f"the grammar has {len(self.grammar)} characters; at most "
                                        f"{MAX_GRAMMAR_CHARS} are allowed")

    @staticmethod
    def _check_ids(ids, name: str, vocab_size: int | None) -> None:
        for i, t in enumerate(ids):
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                top = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ParamError(f"{name}[{i}]", f"{name} must be token ids in {top} (got {t!r})")

    def _check_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ParamError("logit_bias", f"logit_bias has {len(self.logit_bias)} entries; at most "
                                           f"{MAX_LOGIT_BIAS} are allowed")
        for t, b in self.logit_bias.items():
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                top = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ParamError("logit_bias", f"logit_bias token id {t!r} is outside the vocabulary {top}")
            if not _is_number(b) or not -100 <= b <= 100:
                raise ParamError(f"logit_bias.{t}", f"logit_bias[{t}] must be a number in [-100, 100] (got {b!r})")


class SpecParams(msgspec.Struct, **_opts()):
    """How one request speculates: its method and tree knobs (``None`` = the server's default).

    Attributes:
        method: a :class:`~services.spec.Method` value (``"ar"``: plain decoding, no drafter).
        budget, width, depth_bonus, candidates: the tree knobs (:class:`~services.spec.TreeKnobs`).
    """

    method: str | None = None
    budget: int | None = None
    width: int | None = None
    depth_bonus: float | None = None
    candidates: int | None = None

    def check(self) -> None:
        """The method's name and the knobs' ranges.

        Raises:
            ParamError: one line naming the first bad field (``speculative.<field>``).
        """
        if self.method is not None and self.method not in METHODS:
            raise ParamError("speculative.method", f"unknown speculative method {self.method!r} "
                                                   f"(choose from {', '.join(METHODS)})")
        try:
            check_tree_knobs(self.budget, self.width, self.depth_bonus, self.candidates)
        except ValueError as exc:
            raise ParamError(str(exc).split(" ", 1)[0], str(exc)) from None

    def method_or(self, default: str = DEFAULT_METHOD) -> Method:
        """The request's :class:`~services.spec.Method` (``default`` when it names none).

        Raises:
            ValueError: an unknown method name.
        """
        return Method(self.method if self.method is not None else default)

    @property
    def knobs(self) -> TreeKnobs:
        """The request's own tree knobs (unset ones ``None``)."""
        return TreeKnobs(self.budget, self.width, self.depth_bonus, self.candidates)
