"""The integer-dot q4 kernels (services/int_dot.py, services/verifier/int_dot.h): the native ops give
their torch reference's bits for every row count a step runs, each row ignores the others, the packs
round-trip, and the switch keeps torch's kernels."""

from __future__ import annotations

import pytest
import torch

from services import int_dot
from services.gguf_blocks import quantize_q4_1
from services.q4_weights import Int4Linear

from services import native_lib as native

pytestmark = pytest.mark.skipif(not native.load(build=True), reason="the native library cannot be built here")

ROWS = (1, 2, 3, 4, 5, 8, 9, 17, 33)  # ar, small trees' verifies, batched rounds, prompt chunks


def _q4(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    return q, d, m


@pytest.mark.parametrize("n,k", [(64, 96), (576, 576), (48, 1536)])
def test_q4_mm_is_its_reference_bit_for_bit_at_every_row_count(n, k):
    q, d, m = _q4(n, k, n + k)
    qw, dm = int_dot.pack_q4(q, d, m)
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(max(ROWS), k, generator=g).to(dtype)
        x[0, :32] = 0  # an all-zero block
        full = torch.ops.dartree_native.q4_mm(x, qw, dm)
        assert full.dtype == dtype and torch.equal(full, int_dot.q4_reference(x, qw, dm))
        for r in ROWS:  # a row's output is the same alone or beside any other rows
            assert torch.equal(torch.ops.dartree_native.q4_mm(x[:r], qw, dm), full[:r])
            assert torch.equal(torch.ops.dartree_native.q4_mm(x[r - 1:r], qw, dm), full[r - 1:r])
    exact = d.repeat_interleave(32, 1) * q + m.repeat_interleave(32, 1)
    want = x.float() @ exact.T
    assert float((full.float() - want).norm()) <= 0.01 * float(want.norm())  # 8-bit activations


def test_q8_mm_is_its_reference_bit_for_bit_at_every_row_count():
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-127, 128, (160, 96), generator=g).to(torch.int8)
    scale = (torch.rand(160, generator=g) * 0.01).bfloat16()
    qw = int_dot.pack_q8(q)
    x = torch.randn(max(ROWS), 96, generator=g).bfloat16()
    full = torch.ops.dartree_native.q8_mm(x, qw, scale)
    assert torch.equal(full, int_dot.q8_reference(x, qw, scale))
    for r in ROWS:
        assert torch.equal(torch.ops.dartree_native.q8_mm(x[r - 1:r], qw, scale), full[r - 1:r])
    want = x.float() @ (q.float() * scale.float()[:, None]).T
    assert float((full.float() - want).norm()) <= 0.01 * float(want.norm())


def test_packs_round_trip_and_refuse_shapes_they_cannot_tile():
    q, d, m = _q4(32, 64, 3)
    qw, dm = int_dot.pack_q4(q, d, m)
    assert qw.shape == (2, 8, 16, 4) and dm.shape == (2, 2, 2, 16)
    back = int_dot.unpack_q4(qw, dm)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, d, m)))
    with pytest.raises(ValueError, match="N % 16"):
        int_dot.pack_q4(q[:8], d[:8], m[:8])
    with pytest.raises(ValueError, match="int8"):
        int_dot.pack_q8(torch.zeros(16, 32, dtype=torch.int32))


def test_native_ops_refuse_bad_input_with_a_message():
    q, d, m = _q4(32, 64, 4)
    qw, dm = int_dot.pack_q4(q, d, m)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.dartree_native.q4_mm(torch.randn(2, 96).bfloat16(), qw, dm)
    with pytest.raises(RuntimeError, match="qw must be"):
        torch.ops.dartree_native.q4_mm(torch.randn(2, 64).bfloat16(), qw.float(), dm)


def test_int4_linear_uses_the_integer_dot_kernel_unless_switched_off(monkeypatch):
    w = 0.1 * torch.randn(64, 96, generator=torch.Generator().manual_seed(5))
    on = Int4Linear(quantize_q4_1(w))
    assert on.kernel == ("int_dot" if int_dot.enabled() else "torch")
    monkeypatch.setenv("DARTREE_INT_DOT", "0")
    assert not int_dot.enabled() and Int4Linear(quantize_q4_1(w)).kernel == "torch"
    with pytest.raises(ValueError, match="unknown q4 kernel"):
        Int4Linear(quantize_q4_1(w), kernel="fast")


@pytest.mark.skipif(not int_dot.enabled(), reason="the integer-dot kernels do not serve on this CPU")
def test_a_compiled_int4_linear_calls_the_same_op_with_the_same_bits():
    lin = Int4Linear(quantize_q4_1(0.1 * torch.randn(64, 96, generator=torch.Generator().manual_seed(6))))
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    x = torch.randn(3, 96).bfloat16()
    with torch.inference_mode():
        out = torch.compile(lin, backend=backend)(x)
        assert torch.equal(out, lin(x))
    assert any("q4_mm" in t for t in seen), seen
