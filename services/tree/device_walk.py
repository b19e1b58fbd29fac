"""The accept walk of a whole step's verify segments on the device, with static shapes.

:func:`~services.tree.accept.walk` follows one tree on the host (one ``.tolist()`` or one mask
reduction per request). :func:`walk_segments` does the same for every verify segment of a batched
step in a fixed number of tensor ops (no data-dependent shape, no host synchronisation: a CUDA
graph can capture it), and :meth:`SegmentWalk.packed` lays the outcome out as one ``[n, Rm + 2]``
tensor, so the host reads a round's accepted paths, accept lengths and bonus tokens with a single
device-to-host transfer.

Rule (as :func:`~services.tree.accept.walk`): a draft row is *matched* when its token equals the
target token of its parent row; it is accepted when it and all its ancestors are matched
(:func:`~services.tree.tree_mask.path_all`). Siblings carry distinct tokens, so a segment's accepted
rows form one root-to-node path, with at most one accepted row per depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from services.tree.tree_mask import depths_from_parents, path_all


@dataclass(frozen=True)
class SegmentWalk:
    """Accepted paths of ``n`` verify segments (``Rm`` = the widest segment's rows).

    Attributes:
        accepted_rows: ``[n, Rm]`` long, segment-local verify rows of the accepted path by depth
            (root row 0 first), ``-1`` past the path.
        accept_lengths: ``[n]`` long accepted draft rows (root and bonus excluded).
        bonus_tokens: ``[n]`` long, the target token of each path's last row.
    """

    accepted_rows: Tensor
    accept_lengths: Tensor
    bonus_tokens: Tensor

    def packed(self) -> Tensor:
        """``[n, Rm + 2]`` long: ``accept_length, bonus_token, accepted_rows...`` per segment (one
        tensor for the round's single device-to-host copy; :func:`unpack_walk` reads it back)."""
        return torch.cat([self.accept_lengths[:, None], self.bonus_tokens[:, None], self.accepted_rows], dim=1)


def unpack_walk(packed: Tensor) -> list[tuple[list[int], int]]:
    """Per segment ``(accepted_rows, bonus_token)`` from :meth:`SegmentWalk.packed` (moves it to the
    host once). ``accepted_rows`` are segment-local, root (0) first."""
    rows = packed.tolist()  # one device-to-host copy
    return [(r[2:3 + r[0]], r[1]) for r in rows]


def walk_segments(input_ids: Tensor, parent_rows: Tensor, cu_rows: Tensor, target_tokens: Tensor,
                  max_rows: int) -> SegmentWalk:
    """The accept walk of every segment of a packed step (see the module docstring).

    Args:
        input_ids: ``[R]`` long verify tokens of all segments, flattened (each segment: root, then
            its draft nodes in topological order).
        parent_rows: ``[R]`` long segment-local parent row of every row, ``-1`` for a segment's root
            (``VerifyBuffers.parent_rows`` of each segment, concatenated).
        cu_rows: ``[n + 1]`` long, segment ``i`` owns rows ``cu_rows[i]:cu_rows[i+1]`` (none empty).
        target_tokens: ``[R]`` long, the target's token at every row (argmax or sample).
        max_rows: ``Rm``, at least the widest segment's rows (a static bound: the result's width).
    Returns:
        :class:`SegmentWalk` on the inputs' device; equal, segment by segment, to
        :func:`~services.tree.accept.walk` of that segment.
    """
    r = input_ids.numel()
    assert input_ids.shape == parent_rows.shape == target_tokens.shape == (r,), "need [R] rows"
    assert cu_rows.ndim == 1 and cu_rows.numel() >= 2, "cu_rows must be [n + 1]"
    dev = input_ids.device
    n = cu_rows.numel() - 1
    rows = torch.arange(r, device=dev)
    seg = torch.searchsorted(cu_rows[1:], rows, right=True)  # [R] segment of each row
    local = rows - cu_rows[seg]  # [R] segment-local row
    is_root = parent_rows < 0
    gparent = torch.where(is_root, rows, parent_rows + cu_rows[seg])  # [R] global parent (root: itself)
    matched = (input_ids == target_tokens[gparent]) | is_root
    ok = path_all(torch.where(is_root, -1, gparent), matched)  # [R] accepted rows
    depth = depths_from_parents(torch.where(is_root, -1, gparent))  # [R]
    flat = torch.full((n * max_rows,), -1, dtype=torch.long, device=dev)
    flat.scatter_reduce_(0, seg * max_rows + depth.clamp(max=max_rows - 1), torch.where(ok, local, -1), "amax")
    accepted = flat.view(n, max_rows)
    lengths = torch.zeros(n, dtype=torch.long, device=dev).scatter_add_(0, seg, ok.long()) - 1
    last = accepted.gather(1, lengths[:, None]).squeeze(1)  # [n] local row of each path's end
    bonus = target_tokens[cu_rows[:-1] + last]
    return SegmentWalk(accepted, lengths, bonus)
