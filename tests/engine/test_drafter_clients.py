"""Every drafter client the engine may be given implements ``DrafterClient`` with its signatures."""

from __future__ import annotations

import inspect

import pytest

from services.verifier.drafter_client import DrafterClient, InprocDrafterClient
from services.verifier.remote_drafter import ZmqDrafterClient
from tests.doubles import FullTreeDrafter, OracleDrafter, RandomDrafter, ScriptedDrafterClient

METHODS = ("submit", "collect", "discard", "release", "info")


def test_the_protocol_is_what_the_engine_calls():
    declared = {n for n, v in vars(DrafterClient).items() if callable(v) and not n.startswith("_")}
    assert declared == set(METHODS)


@pytest.mark.parametrize("cls", [InprocDrafterClient, ZmqDrafterClient, ScriptedDrafterClient, OracleDrafter,
                                 RandomDrafter, FullTreeDrafter])
def test_clients_implement_the_protocol(cls):
    for name in METHODS:
        want = list(inspect.signature(getattr(DrafterClient, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == want, (cls.__name__, name)
