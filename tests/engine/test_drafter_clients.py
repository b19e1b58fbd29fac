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


class _CountingService:
    """A drafter service double: records the intra-op thread count each ``draft_batch`` ran with."""

    def __init__(self, fail: set[str] = frozenset()):
        self.fail, self.threads_seen, self.contexts = fail, [], set()

    def draft_batch(self, jobs):
        import torch

        self.threads_seen.append(torch.get_num_threads())
        out = []
        for j in jobs:
            if j in self.fail:
                out.append(RuntimeError(f"no draft for {j}"))
            else:
                self.contexts.add(j)
                out.append((f"tree-{j}", {"draft": 0.002, "tree_build": 0.001}))
        return out

    def num_contexts(self):
        return len(self.contexts)

    def release(self, request_id):
        self.contexts.discard(request_id)

    def info(self):
        return {}


def test_the_in_process_client_drafts_on_its_threads_and_restores_the_callers():
    import torch

    before = torch.get_num_threads()
    service = _CountingService()
    InprocDrafterClient(service, threads=1).submit(["a"])
    InprocDrafterClient(service).submit(["b"])
    assert service.threads_seen == [1, before]
    assert torch.get_num_threads() == before


def test_the_in_process_client_records_the_drafter_metrics():
    from services.metrics import DrafterMetrics

    metrics = DrafterMetrics()
    service = _CountingService(fail={"bad"})
    client = InprocDrafterClient(service, metrics)
    handles = client.submit(["a", "bad", "c"])
    assert client.collect(handles[0])[0] == "tree-a"
    with pytest.raises(RuntimeError, match="no draft for bad"):
        client.collect(handles[1])
    value = lambda name, **labels: metrics.registry.get_sample_value(name, labels)  # noqa: E731
    assert value("dartree_drafter_calls_total", type="draft_batch") == 1
    assert value("dartree_drafter_errors_total") == 1
    assert value("dartree_drafter_batch_jobs_count") == 1 and value("dartree_drafter_batch_jobs_sum") == 3
    assert value("dartree_drafter_seconds_count", phase="draft") == 2
    assert value("dartree_drafter_seconds_sum", phase="tree_build") == pytest.approx(0.002)
    assert value("dartree_drafter_contexts") == 2
    client.release("a")
    assert value("dartree_drafter_contexts") == 1 and value("dartree_drafter_calls_total", type="release") == 1
