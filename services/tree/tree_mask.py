"""Tree masks, depths and path flags from a parent array, on the tensors' own device (static shapes).

:func:`~services.tree.draft_tree.derive_buffers` builds a verify round's ``tree_mask`` on the host
from Python lists; these functions compute the same values from ``parent_rows [R]`` alone with a
fixed number of tensor ops (pointer doubling: ``ceil(log2 R)`` passes, each a gather over all rows),
so a GPU builds them without a host synchronisation and a CUDA graph can capture them (the pass
count depends on the shape only). Rows are in topological order (``parent_rows[i] < i``, ``-1`` for
a root), as every verify segment's rows are.

Pointer doubling: ``up_k[i]`` is the ancestor ``2**k`` levels above row ``i`` (a root is its own
parent), and a quantity over the path from ``i`` up to ``up_k[i]`` combines the quantities of the
two halves, ``i .. up_{k-1}[i]`` and ``up_{k-1}[i] .. up_k[i]``. After ``ceil(log2 R)`` passes the
jump spans every path (a path has at most ``R`` rows).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _passes(rows: int) -> int:
    """Doubling passes that cover a path of ``rows`` rows: ``ceil(log2 rows)`` (0 for one row)."""
    return max(0, int(rows) - 1).bit_length()


def _self_parents(parent_rows: Tensor) -> Tensor:
    """``[..., R]`` long: each row's parent row, a root (``-1``) pointing at itself."""
    rows = torch.arange(parent_rows.shape[-1], device=parent_rows.device)
    return torch.where(parent_rows < 0, rows, parent_rows.long())


def tree_mask_from_parents(parent_rows: Tensor) -> Tensor:
    """The ancestor-or-self mask of a tree (or forest) given by its parent rows.

    Worked example (the tree of :func:`~services.tree.draft_tree.derive_buffers`: rows
    ``[r, a, b, c]``, ``a`` and ``b`` below the root, ``c`` below ``a``)::

        parent_rows = [-1, 0, 0, 1]   ->   tree_mask = [[1, 0, 0, 0],
                                                        [1, 1, 0, 0],
                                                        [1, 0, 1, 0],
                                                        [1, 1, 0, 1]]

    A chain ``[-1, 0, 1, ...]`` gives the lower-triangular (causal) mask.

    Args:
        parent_rows: ``[R]`` or ``[B, R]`` (a batch of trees) long, ``-1`` for a root, else
            ``parent_rows[..., i] < i``.
    Returns:
        ``[R, R]`` (or ``[B, R, R]``) bool on ``parent_rows``' device, ``tree_mask[i, j]`` = row
        ``j`` is an ancestor-or-self of row ``i`` (equal to ``VerifyBuffers.tree_mask``).
    """
    assert parent_rows.ndim in (1, 2), "parent_rows must be [R] or [B, R]"
    batch = parent_rows if parent_rows.ndim == 2 else parent_rows[None]  # [B, R]
    r = batch.shape[-1]
    up = _self_parents(batch)  # [B, R]
    cols = torch.arange(r, device=batch.device)
    mask = (cols == cols[:, None]) | (cols == up[..., None])  # [B, R, R] ancestors at distance 0 and 1
    for _ in range(_passes(r)):  # mask covers distances < 2**(k+1) after pass k
        mask = mask | mask.gather(1, up[..., None].expand(-1, -1, r))
        up = up.gather(1, up)
    return mask if parent_rows.ndim == 2 else mask[0]


def depths_from_parents(parent_rows: Tensor) -> Tensor:
    """``[R]`` long depth of every row below its root (a root: 0), from ``parent_rows [R]``."""
    assert parent_rows.ndim == 1, "parent_rows must be [R]"
    up = _self_parents(parent_rows)
    depth = (parent_rows >= 0).long()  # rows from i up to up[i], exclusive of up[i]
    for _ in range(_passes(parent_rows.numel())):
        depth = depth + depth[up]
        up = up[up]
    return depth


def path_all(parent_rows: Tensor, flags: Tensor) -> Tensor:
    """``[R]`` bool: ``flags`` holds at a row and at every ancestor of it (a root: its own flag).

    Args:
        parent_rows: ``[R]`` long (see :func:`tree_mask_from_parents`); flags: ``[R]`` bool.
    """
    assert parent_rows.shape == flags.shape and parent_rows.ndim == 1, "need parent_rows, flags [R]"
    up = _self_parents(parent_rows)
    ok = flags.bool()
    ok = ok & ok[up]
    for _ in range(_passes(parent_rows.numel())):
        up = up[up]
        ok = ok & ok[up]
    return ok
