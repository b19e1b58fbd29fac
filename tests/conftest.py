"""Shared pytest hooks: skip ``gpu``-marked tests on machines without CUDA."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every ``@pytest.mark.gpu`` test as skipped when no CUDA device is available."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # lazy: collecting torch-free tests (gateway) must not import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    """Pin the target's weight format of every server, CLI and bench the tests start to float32
    (``--weights`` defaults to ``auto``, which measures the machine): the exactness tests are float32
    ones; the other formats are tested explicitly (tests/engine/test_weights.py). Point the
    per-machine state caches (weight choice, cost sweeps, oneDNN row verdicts, q4 packs:
    :mod:`services.machine_cache`) at a temporary directory, so no test reads or writes the user's
    ``~/.cache/dartree`` state (the converted models stay where they are: ``$DARTREE_CACHE``)."""
    import atexit
    import os
    import shutil
    import tempfile

    os.environ.setdefault("DARTREE_WEIGHTS", "float32")
    state = tempfile.mkdtemp(prefix="dartree-test-state-")
    os.environ["DARTREE_CACHE_DIR"] = state
    atexit.register(shutil.rmtree, state, ignore_errors=True)  # ~64 MB of q4 packs and sweeps a run
