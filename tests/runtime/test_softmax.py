"""The attention core's softmax (``partc.runtime.softmax``): autocast's values, a 16-bit
copy of its output kept for backward under autocast (also where the model asks for an
fp32 softmax, as Llama does), and softmax's own backward without."""

from __future__ import annotations

import pytest
import torch

from partc.passes.autocast_policy import cuda_autocast
from partc.runtime.softmax import softmax


def _kept(fn):
    kept = []

    def pack(tensor):
        kept.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return kept, out


def test_without_autocast_it_is_softmax_bit_for_bit():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    grad = torch.randn(2, 3, 8, 8)
    want = torch.softmax(x, -1)
    (want_grad,) = torch.autograd.grad(want, x, grad)
    kept, out = _kept(lambda: softmax(x, -1))
    assert torch.equal(out, want)
    assert [t.dtype for t in kept] == [torch.float32]
    (got,) = torch.autograd.grad(out, x, grad)
    assert torch.equal(got, want_grad)


@pytest.mark.parametrize("dtype, asked", [(torch.bfloat16, None), (torch.float32, None),
                                          (torch.bfloat16, torch.float32)],
                         ids=["bf16-in", "fp32-in", "bf16-in-fp32-asked"])
def test_under_cuda_autocast_it_keeps_its_output_in_bf16(dtype, asked):
    """CUDA's policy computes softmax in fp32: the output is autocast's, bit for bit; the
    kept copy is bf16 (half the bytes); the gradient is softmax's from that copy, within
    bf16's rounding of the probabilities."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16, dtype=dtype, requires_grad=True)
    grad = torch.randn(2, 3, 16, 16)
    with cuda_autocast(torch.bfloat16):
        want = torch.softmax(x, -1, dtype=asked)
        kept, out = _kept(lambda: softmax(x, -1, asked))
    assert out.dtype == want.dtype == torch.float32
    assert torch.equal(out, want)
    assert [(t.dtype, t.shape) for t in kept] == [(torch.bfloat16, out.shape)]
    (want_grad,) = torch.autograd.grad(want, x, grad)
    (got,) = torch.autograd.grad(out, x, grad)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want_grad, rtol=2e-2, atol=2e-2 * want_grad.abs().max())
    assert not torch.equal(got, want_grad)   # the kept copy is bf16, not fp32
