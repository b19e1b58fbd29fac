"""The goodput policy replayed on an acceptance trace, in the model: modelled tokens/s, no timing.

At T = 0 the text a request emits is fixed (lossless), so what a draft at position ``i`` of it would
have accepted is fixed too (:mod:`services.replay`). A trace holds, per position, the drafter's tree
at the largest budget (nodes in the builder's order: the first B nodes are the B-budget tree, every
prefix prefix-closed) with each node's path score and whether its path equals the text. Replaying it,
each arm (``ar``, fixed B, a :class:`~services.verifier.policy.GoodputPolicy`) runs the rounds it would
run, and each step is charged by a cost curve: ``forward(rows)`` seconds, a drafter call
``draft_s + catch_up_s * owed`` (owed: context tokens its drafter has not seen), ``overhead_s`` per
request. ``c`` requests decode together, one trace each; a request ends every ``request_tokens``
tokens and the next starts owing ``prompt_tokens``.

    python -m benchmarks.policy_replay --c 1 --node-p 0.95 0.9 0.8 0.6 0.3

prints modelled tokens/s of ``ar``, fixed B = 1, 2, 3, 8 and goodput at ``B_max`` = 1 and 8 on a
synthetic trace (each chain node right, given its parent, with a probability drawn from
``--node-p``, its score that probability), the q4 SmolLM2 CPU cost curve by default.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from services.tree import DraftTree

# q4 SmolLM2-135M on the 2-core CPU (benchmarks/results/2026-12-03-cpu-small-trees): a forward of M
# rows in one-row forwards; the 5th row crosses the int4 kernel's 4-row tile
Q4_CURVE = {1: 1.0, 2: 1.03, 3: 1.11, 4: 1.22, 5: 1.63, 6: 1.63, 7: 1.69, 8: 1.69, 9: 1.95}
Q4_ONE_ROW_S = 0.0233


@dataclass(frozen=True)
class Position:
    """The drafter's tree at one position of the text: ``parents`` (-1 = root), path ``scores`` (log q)
    and ``hits`` (the node's path equals the text), nodes in the builder's order."""

    parents: tuple[int, ...]
    scores: tuple[float, ...]
    hits: tuple[bool, ...]

    def tree(self, budget: int) -> DraftTree:
        """The first ``budget`` nodes as a tree; a hit node's token is its depth, a miss's 1000 + index."""
        n = min(budget, len(self.parents))
        if n <= 0:
            return DraftTree.empty()
        depths = []
        for i in range(n):
            depths.append(1 if self.parents[i] < 0 else depths[self.parents[i]] + 1)
        tokens = [d if self.hits[i] else 1000 + i for i, d in enumerate(depths)]
        return DraftTree(torch.tensor(tokens), torch.tensor(self.parents[:n]), torch.tensor(depths),
                         torch.tensor(self.scores[:n], dtype=torch.float32))

    def accepted(self, tree: DraftTree) -> int:
        """Accepted draft tokens of a verified (prefix-closed) subtree: the deepest hit among its nodes."""
        return max((d for t, d in zip(tree.draft_tokens.tolist(), tree.depths.tolist()) if t == d), default=0)

    def continuation(self) -> list[int]:
        """The text after the root as the labels see it: the hit path's tokens, then a token no node has."""
        deepest = max((d for d, h in zip(self.tree(len(self.parents)).depths.tolist(), self.hits) if h), default=0)
        return list(range(1, deepest + 1)) + [0] * (len(self.parents) + 1)


def synthetic_trace(n: int, node_p: list[float], seed: int = 0, nodes: int = 8) -> list[Position]:
    """``n`` positions of chains of ``nodes``: node d is right, given its parent, with a probability drawn
    from ``node_p``, its path score the log of the product of those probabilities (a calibrated drafter)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        scores, hits, alive, s = [], [], True, 0.0
        for _ in range(nodes):
            p = rng.choice(node_p)
            s += math.log(p)
            alive = alive and rng.random() < p
            scores.append(s)
            hits.append(alive)
        out.append(Position(tuple(range(-1, nodes - 1)), tuple(scores), tuple(hits)))
    return out


@dataclass
class CostCurve:
    """Seconds of a step: ``forward(rows)``, a drafter call ``draft_s + catch_up_s * owed``, ``overhead_s``
    per request."""

    forward: Callable[[int], float]
    draft_s: float
    catch_up_s: float = 3e-5     # per owed position: 13-20 us through the dense catch-up, 29-34 us on int4
    overhead_s: float = 0.0015

    def draft(self, owed: int) -> float:
        """One drafter call of a request owing ``owed`` context tokens."""
        return self.draft_s + self.catch_up_s * owed


def table_forward(table: dict[int, float], one_row_s: float) -> Callable[[int], float]:
    """``forward(rows)`` from a table in one-row forwards, linear between and beyond its row counts."""
    xs = sorted(table)

    def forward(rows: int) -> float:
        if rows >= xs[-1]:
            slope = table[xs[-1]] - table[xs[-2]] if len(xs) > 1 else 0.0
            return one_row_s * (table[xs[-1]] + slope * (rows - xs[-1]))
        hi = next(x for x in xs if x >= rows)
        lo = max((x for x in xs if x <= rows), default=hi)
        y = table[lo] if hi == lo else table[lo] + (table[hi] - table[lo]) * (rows - lo) / (hi - lo)
        return one_row_s * y

    return forward


def seeded_policy(cost: CostCurve, max_budget: int | None = None, **kw):
    """A :class:`GoodputPolicy` whose cost model starts where a server's would: the forward curve swept,
    the drafter's cost seen with short and long catch-ups, the per-request overhead."""
    from services.verifier.calibration import AcceptanceCalibrator
    from services.verifier.cost_model import SWEEP_ROWS, StepCostModel
    from services.verifier.policy import GoodputPolicy

    model = StepCostModel()
    model.seed([(r, cost.forward(r)) for r in SWEEP_ROWS])
    for owed in (1, 300) * 10:  # the fit of d + e * owed
        model.observe_draft(cost.draft(owed), 1, owed)
    model.observe_overhead(cost.overhead_s, 1, 0)
    return GoodputPolicy(model, AcceptanceCalibrator(), max_budget=max_budget, **kw)



def position_of(tree: DraftTree, seq: list[int], i: int, depth_bonus: float) -> Position:
    """The :class:`Position` of a tree drafted after ``seq[: i + 1]``: its nodes in the builder's order
    (path score + ``depth_bonus`` x depth, descending, ties to the shallower node: the top-B rule of
    ``dartree-pruned``, so each prefix is the B-budget tree), each node's hit = its path equals
    ``seq[i + 1 :]``."""
    toks, pars = tree.draft_tokens.tolist(), tree.parents.tolist()
    depth, score = tree.depths.tolist(), tree.scores.tolist()
    order = sorted(range(len(toks)), key=lambda k: (-(score[k] + depth_bonus * depth[k]), depth[k], k))
    rank = {k: r for r, k in enumerate(order)}
    hits = []
    for k in order:
        path, n = [], k
        while n >= 0:
            path.append(toks[n])
            n = pars[n]
        hits.append(path[::-1] == seq[i + 1:i + 1 + len(path)])
    parents = tuple(rank[pars[k]] if pars[k] >= 0 else -1 for k in order)
    if any(p >= r for r, p in enumerate(parents)):
        raise ValueError("the builder's order is not prefix-closed for this tree")
    return Position(parents, tuple(score[k] for k in order), tuple(hits))


def record_trace(engine, prompt_ids: list[int], ref: list[int], spec, request_id: str) -> list[Position]:
    """The trace of one turn at T = 0: the drafter's tree with ``spec``'s knobs at every position of
    ``ref`` (the ``ar`` output), its context fed from one teacher-forced target forward, one token at a
    time (as :func:`services.replay.replay_rounds`, which jumps by a round's accepted tokens)."""
    from services.verifier.drafter_client import DraftJob
    from services.verifier.policy import resolve_knobs

    knobs = resolve_knobs(spec, engine.policy.defaults)
    _, feats = engine.target.teacher_forced(list(prompt_ids) + list(ref))
    p0, out = len(prompt_ids), []
    ctx_ids, ctx_feats = list(prompt_ids), feats[:p0]
    try:
        for i in range(len(ref) - 1):
            start = p0 + i
            depth = engine.draft_depth(start)
            if depth <= 0:
                break
            job = DraftJob(request_id, ctx_ids, ctx_feats, ref[i], start, spec.method, knobs, depth)
            tree, _ = engine.drafter.collect(engine.drafter.submit([job])[0])
            out.append(position_of(tree, ref, i, knobs.depth_bonus))
            ctx_ids, ctx_feats = ref[i:i + 1], feats[start:start + 1]
    finally:
        engine.drafter.release(request_id)
    return out


def save_trace(path: Path, traces: dict[str, list[Position]], meta: dict) -> None:
    """Write ``{"meta": meta, "turns": {uid: [[parents, scores, hits], ...]}}`` as JSON."""
    turns = {uid: [[list(p.parents), [round(x, 5) for x in p.scores], [int(h) for h in p.hits]] for p in t]
             for uid, t in traces.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "turns": turns}, separators=(",", ":")))


def load_trace(path: Path) -> list[Position]:
    """A saved trace's turns one after another (one text, as a request stream replays it)."""
    turns = json.loads(Path(path).read_text())["turns"]
    return [Position(tuple(a), tuple(b), tuple(bool(h) for h in c)) for t in turns.values() for a, b, c in t]

class _Slot:
    """One of the ``c`` decoding slots: its trace, position, request and the drafter's owed context."""

    def __init__(self, trace: list[Position], k: int, prompt_tokens: int, request_tokens: int):
        self.trace, self.k, self.i, self.n = trace, k, 0, 0
        self.prompt_tokens, self.request_tokens = prompt_tokens, request_tokens
        self.rid, self.left, self.owed = f"s{k}-0", request_tokens, prompt_tokens

    def advance(self, emitted: int, drafted: bool, policy) -> None:
        emitted = min(emitted, self.left)
        self.i += emitted
        self.left -= emitted
        self.owed = 1 if drafted else self.owed + emitted
        if self.left <= 0:
            if policy is not None:
                policy.release(self.rid)
            self.n += 1
            self.rid, self.left, self.owed = f"s{self.k}-{self.n}", self.request_tokens, self.prompt_tokens


class _Spec:
    """A request's ``speculative`` values, all unset (the policy's defaults)."""

    method, budget, width, depth_bonus, candidates = "dartree-pruned", None, None, None, None


def _policy_round(policy, slots: list[_Slot], pos: list[Position]) -> tuple[list[bool], list[DraftTree], int]:
    """One step's choice of a goodput policy: ``(drafted, verified trees)`` per slot and the nodes drafted."""
    from services.verifier.policy import Drafted, RoundInfo

    infos = [RoundInfo(s.rid, _Spec.method, 0.0, True, owed=s.owed, remaining=s.left) for s in slots]
    policy.begin_step(infos, num_running=len(slots))
    knobs = [policy.draft_knobs(s.rid, _Spec()) for s in slots]
    drafted = [k is not None for k in knobs]
    made = [p.tree(k.budget) if k is not None else DraftTree.empty() for p, k in zip(pos, knobs)]
    chosen = policy.select([Drafted(i, t, d) for i, t, d in zip(infos, made, drafted)])
    return drafted, [chosen[s.rid].tree for s in slots], sum(t.num_nodes for t in made)


def replay(traces: list[list[Position]], arm, cost: CostCurve, request_tokens: int = 128,
           prompt_tokens: int = 300) -> dict:
    """Replay ``arm`` (``"ar"``, an int B: fixed, or a goodput policy) with one trace per decoding slot
    until the first slot's trace ends. Returns ``tokens_per_s`` (modelled), ``steps``, ``drafts``
    (drafter calls), ``verified`` (draft nodes verified) and ``drafted`` (draft nodes drafted: those
    beyond ``verified`` were cut after their drafter call)."""
    from services.verifier.engine import StepStats

    policy = arm if not isinstance(arm, (int, str)) else None
    slots = [_Slot(t, k, prompt_tokens, request_tokens) for k, t in enumerate(traces)]
    tokens = seconds = 0.0
    steps = drafts = verified = made = 0
    while all(s.i < len(s.trace) for s in slots):
        pos = [s.trace[s.i] for s in slots]
        if policy is None:
            drafted = [arm != "ar"] * len(slots)
            trees = [p.tree(0 if arm == "ar" else int(arm)) for p in pos]
            made += sum(t.num_nodes for t in trees)
        else:
            drafted, trees, nodes = _policy_round(policy, slots, pos)
            made += nodes
        rows = sum(1 + t.num_nodes for t in trees)
        wait = sum(cost.draft(s.owed) for s, d in zip(slots, drafted) if d)
        owed = sum(s.owed for s, d in zip(slots, drafted) if d)
        fwd = cost.forward(rows)
        wall = fwd + wait + cost.overhead_s * len(slots)
        seconds += wall
        steps, drafts, verified = steps + 1, drafts + sum(drafted), verified + rows - len(slots)
        for s, p, t, d in zip(slots, pos, trees, drafted):
            emitted = min(p.accepted(t) + 1, s.left)
            tokens += emitted
            if policy is not None:
                policy.observe_round(s.rid, p.continuation())
            s.advance(emitted, d, policy)
        if policy is not None:
            policy.observe_step(StepStats(len(slots), rows, 0, fwd, wait, wait, len(slots), sum(drafted),
                                          sum(1 for t in trees if t.num_nodes), wall, draft_owed=owed))
    return {"tokens_per_s": tokens / seconds if seconds else 0.0, "steps": steps, "drafts": drafts,
            "verified": verified, "drafted": made}


def record(a) -> dict:
    """``--record``: traces of ``--datasets`` (first turns, chat template) against the float32 target's
    greedy output, the shipped drafter, ``dartree-pruned`` at ``--budget`` (W = 12, beta = -0.2)."""
    import torch

    from benchmarks.bench_small_trees import _engine, _prompts
    from services.drafter.model import load_drafter
    from services.models.registry import DEFAULT_DRAFTER_DIR, resolve_target
    from services.training.heldout import greedy_turns
    from services.params import SpecParams
    from services.verifier.target import TargetModel

    tdir = resolve_target(None)
    drafter = load_drafter(DEFAULT_DRAFTER_DIR, dtype=torch.float32)
    target = TargetModel.from_pretrained(tdir, drafter.config.target_layer_ids, weights="float32")
    engine = _engine(target, drafter, torch.float32, 16, packed=False)
    spec = SpecParams("dartree-pruned", budget=a.budget, width=12, depth_bonus=-0.2)
    traces = {}
    for t in greedy_turns(target, _prompts(tdir, a.datasets, a.prompts), a.max_tokens):
        traces[t.uid] = record_trace(engine, t.prompt_ids, t.ref, spec, f"trace-{t.uid}")
    meta = {"target": str(tdir.name), "drafter": str(DEFAULT_DRAFTER_DIR.name), "method": "dartree-pruned",
            "budget": a.budget, "width": 12, "depth_bonus": -0.2, "max_tokens": a.max_tokens,
            "datasets": a.datasets, "prompts_per_dataset": a.prompts, "weights": "float32"}
    save_trace(Path(a.record), traces, meta)
    return {"recorded": a.record, "turns": len(traces), "positions": sum(len(t) for t in traces.values())}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--c", type=int, default=1, help="requests decoding together")
    ap.add_argument("--node-p", type=float, nargs="+", default=[0.95, 0.9, 0.8, 0.6, 0.3],
                    help="acceptance probabilities a chain node's is drawn from (synthetic traces)")
    ap.add_argument("--positions", type=int, default=3000, help="synthetic trace length per request slot")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", default=None, help="replay this recorded trace (every slot starts at another turn)")
    ap.add_argument("--draft-steps", type=float, default=0.35, help="a drafter call in one-row forwards")
    ap.add_argument("--record", default=None, help="record a trace to this JSON file instead (models needed)")
    ap.add_argument("--datasets", nargs="+", default=["gsm8k"], help="--record: prompt sets")
    ap.add_argument("--prompts", type=int, default=4, help="--record: prompts per set")
    ap.add_argument("--max-tokens", type=int, default=128, help="--record: tokens per turn")
    ap.add_argument("--budget", type=int, default=8, help="--record: the drafter's budget (the largest replayed)")
    a = ap.parse_args(argv)
    if a.c < 1 or a.positions < 1 or not all(0 < p <= 1 for p in a.node_p):
        ap.error("--c and --positions must be >= 1 and every --node-p in (0, 1]")
    if a.record:
        out = record(a)
        print(json.dumps(out))
        return out
    cost = CostCurve(table_forward(Q4_CURVE, Q4_ONE_ROW_S), a.draft_steps * Q4_ONE_ROW_S)
    if a.trace:
        one = load_trace(Path(a.trace))
        traces = [one[k * len(one) // a.c:] + one[:k * len(one) // a.c] for k in range(a.c)]
    else:
        traces = [synthetic_trace(a.positions, a.node_p, a.seed + k) for k in range(a.c)]
    arms = {"ar": "ar", **{f"fixed B={b}": b for b in (1, 2, 3, 8)}}
    res = {name: replay(traces, arm, cost)["tokens_per_s"] for name, arm in arms.items()}
    for mb in (1, 8):
        res[f"goodput B_max={mb}"] = replay(traces, seeded_policy(cost, mb), cost)["tokens_per_s"]
    out = {"c": a.c, "trace": a.trace, "node_p": None if a.trace else a.node_p,
           "positions": len(traces[0]), "seed": a.seed,
           "modelled_tokens_per_s": {k: round(v, 2) for k, v in res.items()}}
    print(json.dumps(out))
    return out

if __name__ == "__main__":
    main()
