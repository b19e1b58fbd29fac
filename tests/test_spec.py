"""services.spec: one home for the method names, the tree knobs and their limits, the policy names."""

from __future__ import annotations

import math

import pytest

from services import protocol
from services.spec import (DEFAULT_METHOD, DEFAULT_POLICY, DFLASH_METHODS, EAGLE3_METHODS, HEAD_METHODS,
                           MARKOV_METHODS, MAX_BUDGET, MAX_CANDIDATES, MAX_WIDTH, METHODS, POLICIES, Method,
                           TreeKnobs, preferred_method, served_methods)


def test_methods_are_the_enum_in_its_order_and_the_old_homes_re_export_them():
    assert METHODS == ("ar", "dflash", "ddtree", "domino", "dartree-fixed", "dartree-pruned", "seqheap",
                       "domino-ddtree", "dspark", "dspark-dartree", "eagle3")
    assert METHODS[:len(DFLASH_METHODS)] == DFLASH_METHODS
    assert protocol.METHODS is METHODS and protocol.served_methods is served_methods
    assert Method("ddtree") == "ddtree" and DEFAULT_METHOD in METHODS and DEFAULT_POLICY in POLICIES


@pytest.mark.parametrize("method", list(Method))
def test_method_predicates(method):
    assert method.drafts == (method != "ar")
    assert method.needs_head == (method in HEAD_METHODS)
    assert method.is_tree == (method not in ("ar", "dflash", "domino", "dspark"))
    family = {"ar": "ar", "dspark": "dspark", "dspark-dartree": "dspark", "eagle3": "eagle3"}.get(method, "dflash")
    assert method.family == family
    kinds = [k for k in ("dflash", "domino", "dspark", "eagle3") if method.served_by(k)]
    assert kinds and ("ar" in method or method in served_methods(kinds[0]))


def test_served_methods_per_kind():
    assert served_methods("domino") == DFLASH_METHODS
    assert served_methods("dflash") == ("ar", "dflash", "ddtree")
    assert set(served_methods("dspark")) == {"ar", "dflash", "ddtree"} | MARKOV_METHODS
    assert set(served_methods("eagle3")) == {"ar"} | EAGLE3_METHODS
    with pytest.raises(ValueError, match="unknown drafter kind 'medusa'"):
        served_methods("medusa")
    assert preferred_method(served_methods("eagle3")) == "eagle3"
    assert preferred_method(served_methods("dflash")) == "ddtree"
    assert preferred_method(()) == "ar"


def test_policy_names_are_the_policies():
    pytest.importorskip("torch")
    from services.verifier.policy_base import SpecPolicy
    from services.verifier.policy_build import make_policy

    policies = [make_policy(name) for name in POLICIES]
    assert {p.name for p in policies} == set(POLICIES)
    assert all(isinstance(p, SpecPolicy) for p in policies)


@pytest.mark.parametrize("knobs, msg", [
    (dict(budget=0), "budget must be in [1, 1024]"), (dict(budget=MAX_BUDGET + 1), "budget must be in"),
    (dict(width=MAX_WIDTH + 1), "width must be in [1, 256]"), (dict(candidates=MAX_CANDIDATES + 1), "candidates"),
    (dict(budget=2.5), "budget must be an integer"), (dict(width=True), "width must be an integer"),
    (dict(depth_bonus=0.1), "depth_bonus must be a finite number <= 0"),
    (dict(depth_bonus=math.nan), "depth_bonus must be a finite number <= 0"),
])
def test_tree_knobs_limits(knobs, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        TreeKnobs(**knobs)


def test_tree_knobs_fill_only_what_is_unset():
    defaults = TreeKnobs(budget=8, width=12, depth_bonus=-0.2, candidates=64)
    assert TreeKnobs().filled_from(defaults) == defaults
    assert TreeKnobs(budget=4, depth_bonus=0.0).filled_from(defaults) == TreeKnobs(4, 12, 0.0, 64)
    with pytest.raises(ValueError, match=r"^speculative\.width must be in"):
        _unchecked(width=0).check()


def _unchecked(**kw) -> TreeKnobs:
    """A TreeKnobs that skipped ``__post_init__`` (to test ``check``'s request prefix)."""
    knobs = object.__new__(TreeKnobs)
    for name in ("budget", "width", "depth_bonus", "candidates"):
        object.__setattr__(knobs, name, kw.get(name))
    return knobs
