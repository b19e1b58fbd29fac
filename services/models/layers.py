"""Which target layers a drafter reads its context features from (torch-free)."""

from __future__ import annotations


def default_target_layer_ids(num_target_layers: int, n: int = 5) -> list[int]:
    """``round(1 + i * (L - 4) / (n - 1))`` for ``i < n`` (single layer: ``L // 2``), docs/algorithms.md §1.1."""
    if n == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]
