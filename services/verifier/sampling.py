"""Per-path sampling and logprobs of one request: the target's token at every verify row, and the
raw logprobs of the emitted tokens.

A request's :class:`~services.params.SamplingParams` become a :class:`Sampler` at admission: its
seed (T > 0), its logit processors' options (:func:`logit_options`, the one place they are derived
from the params), the count tensors the penalties read, and its grammar. Every verify row is
sampled as if its root-to-node path had been emitted token by token (logit_processors.py,
grammar.py), and at T > 0 row ``i`` draws with the uniform of the absolute position it predicts
(accept.py), so a request's tokens do not depend on how many rows a round verifies.

Logprobs (only when a request asks): the raw target distribution, ``log_softmax`` of the logits
before the logit processors, temperature / top-p / top-k / min_p (vLLM's default), at the row that
produced each emitted token: an accepted draft's parent row on the accepted path, the last
accepted row for the bonus token, the prompt's last position for the first token (docs/design.md,
"Logprobs come from the target": never the draft's q or a constant).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from services.params import SamplingParams
from services.protocol import LOGPROB_FLOOR
from services.tree import sample_target_tokens
from services.tree.accept import position_uniforms
from services.tree.grammar import GrammarState, mask_logits
from services.tree.logit_processors import LogitOptions, path_counts, process_logits, sample_processed, token_counts


@dataclass
class TokenLogprobs:
    """Raw target logprobs of a round's emitted tokens, one row per token (see the module docstring).

    Attributes:
        logprobs: each emitted token's logprob, clamped to ``[LOGPROB_FLOOR, 0]``.
        top_ids, top_logprobs: the k most likely tokens of the same row, most likely first.
    """

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> TokenLogprobs:
    """``log_softmax`` of ``logits [n, V]`` (row i produced ``token_ids[i]``) at the tokens, plus top-k.

    Ties are broken by ascending token id, the way greedy decoding breaks them (``torch.argmax``
    takes the first maximum): equal logprobs are listed lowest id first, and where more tokens tie
    at the k-th value than fit, the lowest ids are kept. So at T = 0 a row's first entry is the
    token plain decoding emits (``torch.topk`` alone leaves both orders unspecified).
    """
    lp = torch.log_softmax(logits.float(), dim=-1)
    lp = torch.nan_to_num(lp, nan=LOGPROB_FLOOR).clamp_(LOGPROB_FLOOR, 0.0)
    chosen = lp.gather(1, torch.tensor(token_ids, dtype=torch.long, device=lp.device)[:, None])[:, 0]
    top_ids, top_lps = [], []
    if k:
        kth = lp.topk(k, dim=-1).values[:, -1]
        for row, v in zip(lp, kth):
            above = (row > v).nonzero()[:, 0]  # ascending ids, fewer than k
            ids = torch.cat([above, (row == v).nonzero()[:, 0][:k - above.numel()]]).sort().values
            vals = row[ids]
            order = vals.argsort(descending=True, stable=True)  # by value, ties by ascending id
            top_ids.append(ids[order].cpu().tolist())
            top_lps.append(vals[order].cpu().tolist())
    else:
        top_ids = top_lps = [[] for _ in token_ids]
    return TokenLogprobs(chosen.cpu().tolist(), top_ids, top_lps)


def logit_options(sampling: SamplingParams, eos_token_ids) -> LogitOptions | None:
    """The request's :class:`LogitOptions`, the one place they are derived from its params: each
    option field is the params field of the same name (a float one as a float), ``logit_bias`` as
    ``(id, bias)`` pairs, ``terminator_ids`` (what ``min_tokens`` masks) EOS unless ignored plus the
    stop token ids. None when nothing changes the logits and no filter is on: the raw logits are
    sampled."""
    derived = {"logit_bias": tuple((int(t), float(b)) for t, b in sampling.logit_bias.items()),
               "terminator_ids": tuple(dict.fromkeys((() if sampling.ignore_eos else tuple(eos_token_ids))
                                                     + tuple(sampling.stop_token_ids)))}
    kw = {}
    for f in dataclasses.fields(LogitOptions):
        if f.name in derived:
            kw[f.name] = derived[f.name]
        else:
            v = getattr(sampling, f.name)
            kw[f.name] = float(v) if isinstance(f.default, float) else v
    opts = LogitOptions(**kw)
    return opts if opts.changes_logits or opts.filters else None


class Sampler:
    """One request's sampling state: seed, logit processors, penalty counts, grammar.

    Args:
        params: the request's sampling parameters; prompt_ids: its prompt (the repetition penalty's
        tokens; output positions start after it); vocab_size: the target's; eos_token_ids: the
        target's EOS ids; grammar: the output's grammar state (None: unconstrained).

    An unseeded request at T > 0 takes its seed from torch's global RNG (``torch.manual_seed``
    fixes it); T = 0 needs none.
    """

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, eos_token_ids,
                 grammar: GrammarState | None = None):
        self.params, self.prompt_len, self.grammar = params, len(prompt_ids), grammar
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item()) if params.temperature > 0 else 0
        self.seed = seed  # T > 0: the token at position t is drawn with position_uniforms(seed, t)
        self.grammar_masked = 0  # draft nodes the grammar forbade in the last round
        self.opts = logit_options(params, eos_token_ids)
        self.out_counts = self.prompt_mask = None  # [V] float emitted-token counts / [V] bool prompt tokens
        if self.opts is not None and self.opts.needs_counts:
            self.out_counts = token_counts([], vocab_size)
            self.prompt_mask = token_counts(prompt_ids, vocab_size) > 0

    @property
    def processes(self) -> bool:
        """Whether logits go through processors or a grammar mask before sampling."""
        return self.opts is not None or self.grammar is not None

    def sample(self, logits: torch.Tensor, positions: torch.Tensor, buffers=None,
               host_positions: list[int] | None = None) -> torch.Tensor:
        """One token per row of ``logits [R, V]``; row i predicts the token at absolute position
        ``positions[i]`` (``[R]`` long) and, at T > 0, draws it with that position's uniform.

        With logit processors on, each row's logits are processed as if its path had been emitted
        token by token (``buffers``: the round's verify buffers; None for the prompt's last row). A
        grammar masks each row first, at its own path's state (services/tree/grammar.py).
        ``host_positions``: ``positions`` as a list (the uniforms are then made without reading a
        tensor); the tokens are the same.
        """
        s = self.params
        u = None if s.temperature == 0 else position_uniforms(
            self.seed, positions if host_positions is None else host_positions)
        if self.grammar is not None:
            if buffers is None:
                allowed, self.grammar_masked = self.grammar.current_mask(), 0
            else:
                allowed, self.grammar_masked = self.grammar.tree_masks(buffers.input_ids, buffers.parent_rows)
            logits = mask_logits(logits, allowed)
        opts = self.opts
        if opts is None:
            return sample_target_tokens(logits, s.temperature, s.top_p, s.top_k, uniforms=u)
        counts = None
        if opts.needs_counts:
            if self.out_counts.device != logits.device:  # once: the counts live with the logits
                self.out_counts, self.prompt_mask = self.out_counts.to(logits.device), self.prompt_mask.to(logits.device)
            counts = (self.out_counts[None, :] if buffers is None
                      else path_counts(self.out_counts, buffers.input_ids, buffers.tree_mask))
        x = process_logits(logits, opts, counts, self.prompt_mask, positions - self.prompt_len)
        return sample_processed(x, s.temperature, s.top_p, s.top_k, opts, uniforms=u)

    def count(self, ids: list[int]) -> None:
        """Add emitted ``ids`` to the output counts (when a penalty is on)."""
        if self.out_counts is not None and ids:
            self.out_counts += token_counts(ids, self.out_counts.shape[0], device=self.out_counts.device)

    def logprobs(self, logits: torch.Tensor, rows: torch.Tensor, ids: list[int]) -> TokenLogprobs | None:
        """Logprobs of the emitted ``ids``; ``ids[i]`` came from ``logits[rows[i]]`` (None unless asked)."""
        k = self.params.logprobs
        return None if k is None else token_logprobs(logits[rows[:len(ids)].to(logits.device)], ids, k)


def compile_grammar(tokenizer, grammar: str, vocab_size: int) -> GrammarState:
    """A request's :class:`GrammarState` for an llguidance ``grammar`` (a JSON schema's, from
    ``llguidance.LLMatcher.grammar_from_json_schema``; docs/serving.md "Structured output") over
    ``tokenizer`` (an ``llguidance.LLTokenizer``) and the target's ``vocab_size``.

    Raises:
        ValueError: the grammar does not compile.
    """
    import llguidance

    return GrammarState(llguidance.LLMatcher(tokenizer, grammar, log_level=0), vocab_size, tokenizer.vocab_size)


def grammar_tokenizer(target, vocab_size: int, eos_token_ids):
    """The ``llguidance.LLTokenizer`` of grammar requests, built (about 0.4 s for a 49k vocabulary)
    from ``tokenizer.json`` in the target's directory, EOS = the target's first EOS id.

    Raises:
        ValueError: the target's directory has no ``tokenizer.json`` or the target no EOS.
    """
    from pathlib import Path

    import llguidance

    path = Path(getattr(getattr(target, "config", None), "_name_or_path", "") or ".") / "tokenizer.json"
    if not path.is_file() or not eos_token_ids:
        raise ValueError("this server cannot constrain output to a grammar: the target has no "
                         "tokenizer.json or no EOS token")
    return llguidance.LLTokenizer(path.read_text(), n_vocab=vocab_size, eos_token=eos_token_ids[0])
