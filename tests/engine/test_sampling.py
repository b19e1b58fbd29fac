"""T > 0 (style.md R9): the first K emitted tokens at a fixed prefix are distributed exactly as plain
sampling from the target (chi-square on a vocabulary-8 model), the test has the power to see a wrong
distribution, and a seed fixes the tokens. With logit processors on (penalties, ``logit_bias``,
``min_tokens``, ``min_p``) the distribution at every tree node is the *processed* target
distribution along that node's own path (services/tree/logit_processors.py)."""

from __future__ import annotations

import math

import pytest
import torch

from services.testing import tiny_service, tiny_target
from services.verifier.drafter_client import InprocDrafterClient
from services.params import SamplingParams, SpecParams
from services.verifier.engine import SpecEngine
from tests.doubles import FullTreeDrafter, RandomDrafter, next_output

V = 8
PROMPT = [1, 5, 3]
Z_999 = 3.090232  # standard normal quantile at 1 - 0.001


def assert_target_distribution(counts, model) -> float:
    """``counts`` (first tokens, pairs) match the target's exact T = 1 joint (chi-square, >= 30 df) and
    reject two plausible wrong ones by a wide margin (the test's power). Returns the statistic."""
    stat, df = chi2_stat(counts, exact_joint(model))
    assert df >= 30
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} > critical {chi2_critical(df):.1f} (df {df})"
    for wrong in (exact_joint(model, parent_row_bug=True), exact_joint(model, temperature=0.8)):
        stat_w, df_w = chi2_stat(counts, wrong)
        assert stat_w > 2 * chi2_critical(df_w), f"wrong distribution not rejected: {stat_w:.1f} (df {df_w})"
    return stat


def chi2_critical(df: int) -> float:
    """Chi-square critical value at p = 0.001 (Wilson-Hilferty: within 2% of the exact value for df >= 4,
    slightly above it for small df, i.e. conservative)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z_999 * math.sqrt(a)) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; cells with expected count < 5 are pooled into one."""
    n = float(counts.sum())
    e, c = probs.flatten().double() * n, counts.flatten().double()
    small = e < 5
    e = torch.cat([e[~small], e[small].sum()[None]])
    c = torch.cat([c[~small], c[small].sum()[None]])
    keep = e > 0
    assert float(c[~keep].sum()) == 0, "a token of probability 0 was emitted"
    return float(((c[keep] - e[keep]) ** 2 / e[keep]).sum()), int(keep.sum()) - 1


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab_size=V, hidden_size=32, num_layers=2, init_std=0.3, eos_token_id=None,
                       target_layer_ids=[1])


def exact_joint(model, temperature=1.0, top_k=0, top_p=1.0, parent_row_bug=False):
    """P(t1, t2, t3) = p(t1|x) p(t2|x,t1) p(t3|x,t1,t2) from plain causal forwards (independent of the
    engine and of the tree library). ``parent_row_bug`` draws t3 from p(.|x,t1) instead."""
    x = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
    with torch.inference_mode():
        lg = model(x).logits.double() / temperature
    if top_k:
        kth = lg.topk(top_k, dim=-1).values[..., -1:]
        lg = lg.masked_fill(lg < kth, -math.inf)
    probs = torch.softmax(lg, -1)
    if top_p < 1.0:
        s, idx = probs.sort(-1, descending=True)
        before = s.cumsum(-1) - s
        s = s.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, s)
        probs = probs / probs.sum(-1, keepdim=True)
    p1 = probs[0, -3]
    p2 = probs[::V, -2]  # [t1, t2]
    p3 = probs[:, -1].view(V, V, V)  # [t1, t2, t3]
    if parent_row_bug:
        p3 = p2[:, None, :].expand(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def sample_counts(engine, n, k, method="dartree-pruned", **sampling):
    """Histogram ``[V] * k`` of the first ``k`` tokens of ``n`` seeded generations. A generation that
    ends early on its one stop token id counts that token as its last one."""
    counts = torch.zeros((V,) * k, dtype=torch.long)
    stop = sampling.get("stop_token_ids", ())
    for i in range(n):
        outs = list(engine.generate(f"s{i}", PROMPT, SamplingParams(max_tokens=k, seed=i, **sampling),
                                    SpecParams(method)))
        toks = [t for o in outs for t in o.token_ids]
        if len(toks) == k - 1 and len(stop) == 1 and outs[-1].finish_reason == "stop":
            toks.append(stop[0])
        assert len(toks) == k
        counts[tuple(toks)] += 1
    return counts


@pytest.mark.parametrize("drafter", ["full-tree", "random"])
def test_first_three_tokens_match_plain_sampling(target, drafter):
    """full-tree: every token at depths 1-2 is drafted, so t2 and t3 are both tree-walk samples of one
    round; random: trees that sometimes match, so rounds end at random depths."""
    client = FullTreeDrafter(V, depth=2) if drafter == "full-tree" else RandomDrafter(V, budget=12, depth=3, seed=1)
    engine = SpecEngine(target, client, max_draft_depth=3)
    n = 2000
    counts = sample_counts(engine, n, 3, temperature=1.0)
    if drafter == "full-tree":
        assert all(c.tree.num_nodes == V + V * V for c in client.calls)
    assert_target_distribution(counts, target.model)
    assert engine.num_active() == 0 and client.num_contexts() == 0


@pytest.mark.parametrize("filt", [dict(top_k=3), dict(top_p=0.7)])
def test_top_k_top_p_apply_to_every_tree_node(target, filt):
    engine = SpecEngine(target, FullTreeDrafter(V, depth=1), max_draft_depth=1)
    n = 1000
    counts = sample_counts(engine, n, 2, temperature=1.0, **filt)
    exact = exact_joint(target.model, **filt).sum(-1)  # [t1, t2]
    stat, df = chi2_stat(counts, exact)  # also asserts no filtered-out token was ever emitted
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} > critical {chi2_critical(df):.1f} (df {df})"
    stat_w, df_w = chi2_stat(counts, exact_joint(target.model).sum(-1))  # the unfiltered distribution
    assert stat_w > 2 * chi2_critical(df_w), f"unfiltered distribution not rejected: {stat_w:.1f} (df {df_w})"


def test_critical_value_matches_table():
    # published chi-square quantiles at p = 0.001
    for df, exact in ((4, 18.467), (8, 26.124), (10, 29.588), (30, 59.703), (50, 86.661), (100, 149.449)):
        assert 0 <= (chi2_critical(df) - exact) / exact < 0.02


@pytest.fixture(scope="module")
def domino_engine(target):
    return SpecEngine(target, InprocDrafterClient(tiny_service(target, block_size=6)), max_draft_depth=6)


@pytest.mark.parametrize("method", ["dartree-pruned", "ddtree", "domino", "ar"])
def test_same_seed_same_tokens_different_seed_different_tokens(domino_engine, method):
    def run(seed, rid="r"):
        return [t for o in domino_engine.generate(rid, PROMPT, SamplingParams(max_tokens=40, temperature=1.0,
                                                                              seed=seed), SpecParams(method))
                for t in o.token_ids]

    a, b = run(123), run(123)
    assert a == b and len(a) == 40
    others = [run(s) for s in (124, 125, 126)]
    assert all(o != a for o in others)


def test_seeded_request_is_unaffected_by_interleaved_requests(domino_engine):
    """The generator is per request: stepping another sampled request in between changes nothing."""
    sp = SamplingParams(max_tokens=30, temperature=1.0, seed=7)
    alone = [t for o in domino_engine.generate("a", PROMPT, sp, SpecParams("dartree-pruned")) for t in o.token_ids]
    domino_engine.add_request("a", PROMPT, sp, SpecParams("dartree-pruned"))
    domino_engine.add_request("b", [2, 2, 4], SamplingParams(max_tokens=200, temperature=1.0, seed=8),
                              SpecParams("ddtree"))
    mixed = []
    while True:
        out = next_output(domino_engine, "a")
        mixed += out.token_ids
        if out.finish_reason:
            break
        torch.rand(3)  # the global RNG must not matter either
        next_output(domino_engine, "b")
    domino_engine.abort("b")
    assert mixed == alone
    assert domino_engine.num_active() == 0


# ---------------------------------------------------------------------------------------------
# logit processors: each tree node samples from the processed distribution of its own path
# ---------------------------------------------------------------------------------------------
def processed_probs(logits: list[float], output: list[int], opts: dict, counted: list[int] | None = None,
                    temperature: float = 1.0) -> torch.Tensor:
    """``[V]`` float64, the distribution plain decoding samples after ``output`` (plain Python over one
    row, vLLM's order): min_tokens -> logit_bias -> repetition / frequency / presence penalties ->
    temperature -> min_p. ``counted``: the tokens the penalties count (default ``output``)."""
    counted = output if counted is None else counted
    x = list(logits)
    if len(output) < opts.get("min_tokens", 0):
        for t in opts.get("stop_token_ids", ()):
            x[t] = -math.inf
    for t, b in opts.get("logit_bias", {}).items():
        x[t] += b
    r, f, p = opts.get("repetition_penalty", 1.0), opts.get("frequency_penalty", 0.0), opts.get("presence_penalty", 0.0)
    for t in range(V):
        c = counted.count(t)
        if c or t in PROMPT:
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
        x[t] -= f * c + p * (c > 0)
    probs = torch.softmax(torch.tensor(x, dtype=torch.float64) / temperature, -1)
    probs = probs.masked_fill(probs < opts.get("min_p", 0.0) * probs.max(), 0.0)
    return probs / probs.sum()


def processed_joint(model, opts: dict, temperature=1.0, root_counts_bug=False, unprocessed=False) -> torch.Tensor:
    """P(t1, t2, t3) ``[V, V, V]`` with ``opts`` applied along each path (plain causal forwards, no
    engine or tree code). ``root_counts_bug``: every token of a round is penalised with the counts
    of the round's root (t3 ignores t2), the bug of applying the root's counts to every tree row;
    ``unprocessed``: the options are ignored."""
    x = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
    with torch.inference_mode():
        lg = model(x).logits.double().view(V, V, len(PROMPT) + 2, V).tolist()
    def row(logits, out, counted=None):
        return processed_probs(logits, [] if unprocessed else out, {} if unprocessed else opts, counted, temperature)
    p1 = row(lg[0][0][-3], [])
    p2 = torch.stack([row(lg[a][0][-2], [a]) for a in range(V)])  # [t1, t2]
    p3 = torch.stack([torch.stack([row(lg[a][b][-1], [a, b], [a] if root_counts_bug else None)
                                   for b in range(V)]) for a in range(V)])  # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


PROCESSOR_CASES = {
    "penalties": dict(presence_penalty=1.2, frequency_penalty=0.9, repetition_penalty=1.6),
    "bias+min_p": dict(logit_bias={4: 1.0}, min_p=0.03, presence_penalty=2.0, frequency_penalty=1.5,
                       repetition_penalty=1.3),
    "min_tokens": dict(stop_token_ids=(5,), min_tokens=2, presence_penalty=1.5),
}


@pytest.mark.parametrize("case,drafter", [(c, "full-tree") for c in PROCESSOR_CASES] + [("penalties", "random")])
def test_processed_distribution_at_every_tree_node(target, case, drafter):
    """t2 and t3 come from one round's tree walk (full tree: every token drafted at depths 1-2), so
    a row's penalties must count its own path (t1, t2: often a repeated token) and ``min_tokens``
    must read its own depth; the distribution equals the processed plain-decoding joint and rejects
    the root's counts for every row and the unprocessed joint (each at p = 0.001)."""
    opts = PROCESSOR_CASES[case]
    client = FullTreeDrafter(V, depth=2) if drafter == "full-tree" else RandomDrafter(V, budget=12, depth=3, seed=2)
    engine = SpecEngine(target, client, max_draft_depth=3)
    counts = sample_counts(engine, 2000, 3, temperature=1.0, **opts)
    if drafter == "full-tree":
        assert all(c.tree.num_nodes == V + V * V for c in client.calls)
    stat, df = chi2_stat(counts, processed_joint(target.model, opts))  # also: no token of probability 0
    assert df >= 30
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} > critical {chi2_critical(df):.1f} (df {df})"
    wrong = [processed_joint(target.model, opts, unprocessed=True)]
    if case != "min_tokens":  # (that case's wrong path is the output index: t3 may stop, t2 may not)
        wrong.append(processed_joint(target.model, opts, root_counts_bug=True))
    else:
        assert counts[:, :, 5].sum() > 0 and counts[:, 5, :].sum() == 0 and counts[5].sum() == 0
    for w in wrong:
        stat_w, df_w = chi2_stat(counts, w) if not (w == 0).logical_and(counts > 0).any() else (math.inf, 1)
        assert stat_w > chi2_critical(df_w), f"wrong distribution not rejected: {stat_w:.1f} (df {df_w})"
    assert engine.num_active() == 0 and client.num_contexts() == 0
