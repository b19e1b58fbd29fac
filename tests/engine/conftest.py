"""Shared tiny targets of the engine tests (float32, 128-token vocabulary, 3 layers)."""

from __future__ import annotations

import pytest

from services.testing import tiny_target

V = 128
TARGET_KW = dict(vocab_size=V, hidden_size=32, num_layers=3, max_position_embeddings=256)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request):
    """One tiny target per supported architecture."""
    return tiny_target(request.param, **TARGET_KW)


@pytest.fixture(scope="module")
def llama():
    """A tiny llama target."""
    return tiny_target("llama", **TARGET_KW)
