"""Several int4 linears over one input as ONE kernel call (the drafter's layers and the verifier's
lean Llama step share it)."""

from __future__ import annotations

import torch
from torch import nn

# torch's int4 CPU pack (``_convert_weight_to_int4pack_for_cpu``) interleaves the weight's rows in
# blocks of 64, so packs concatenate row-wise only at multiples of 64 rows.
INT4_PACK_ROWS = 64


class FusedInt4:
    """Several int4 linears over the same input as ONE kernel call: their outputs concatenated.

    The fused module is built on first use from the linears' packed weights (rows stacked; the
    per-column results are bit-identical to separate calls: the int4 CPU kernel computes each
    output column on its own, ``tests/engine/test_drafter_lean.py``; a probe call checks it when the
    module is built) and rebuilt when a linear is replaced. :meth:`get` gives None, so the caller
    runs the linears one by one, when one of them is not a :class:`services.q4_weights.Int4Linear`
    (float32 / dense bfloat16 drafters: their GEMMs make no per-column promise), when they use
    different kernels, when (torch's kernel) a linear but the last has rows that are not a multiple
    of :data:`INT4_PACK_ROWS` (the integer-dot kernel stacks any), or inside ``torch.compile``
    unless it was built before (an eager call first: :meth:`build`; a traced graph then calls the
    fused kernel as eager code does, where building inside the trace would trace the probe). Not a
    registered submodule: state dicts and ``.to()`` see only the linears themselves.
    """

    def __init__(self):
        self._key: tuple[nn.Module, ...] = ()
        self._mod: nn.Module | None = None

    def get(self, *linears: nn.Module) -> nn.Module | None:
        """The fused ``[..., K] -> [..., sum N_i]`` module of ``linears``, or None (see the class)."""
        if len(self._key) == len(linears) and all(a is b for a, b in zip(self._key, linears)):
            return self._mod
        if torch.compiler.is_compiling():
            return None
        return self.build(*linears)

    def build(self, *linears: nn.Module) -> nn.Module | None:
        """Build (or rebuild) the fused module of ``linears`` eagerly; returns what :meth:`get` returns."""
        from services.q4_weights import Int4Linear

        self._key, self._mod = tuple(linears), None
        if not (all(type(m) is Int4Linear and m.bias is None for m in linears)
                and len({(m.in_features, m.act_dtype, m.kernel) for m in linears}) == 1):
            return None
        if linears[0].kernel == "int_dot":  # tiles of 16 rows: any q4 linears stack
            fused = Int4Linear.from_int_dot(torch.cat([m.qw for m in linears]), torch.cat([m.dm for m in linears]),
                                            dtype=linears[0].act_dtype)
        elif all(m.out_features % INT4_PACK_ROWS == 0 for m in linears[:-1]):
            fused = Int4Linear.from_packed(torch.cat([m.packed for m in linears]),
                                           torch.cat([m.scale_zeros for m in linears], 1).contiguous())
        else:
            return None
        with torch.inference_mode():  # a probe: a kernel whose packing or columns changed is not used
            x = torch.randn(3, fused.in_features, generator=torch.Generator().manual_seed(0)).to(fused.act_dtype)
            same = torch.equal(fused(x), torch.cat([m(x) for m in linears], -1))
        self._mod = fused if same else None
        return self._mod
