"""The attention core's softmax (``partc.runtime.softmax``): autocast's values, a 16-bit
copy of its output kept for backward under autocast (also where the model asks for an
fp32 softmax, as Llama does), and softmax's own backward without."""

from __future__ import annotations

import pytest
import torch

from partc.autocast_policy import cuda_autocast
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


def test_probabilities_only_a_product_reads_are_handed_over_in_bf16():
    """``softmax_for_product``: under autocast the product reads the kept bf16 copy, the
    one autocast's cast would make: the product's output and every gradient equal the
    plain softmax's bit for bit, and the probabilities are kept once (one storage, which
    the softmax and the product both keep) instead of twice. Without autocast, as
    softmax."""
    from partc.runtime.softmax import softmax_for_product

    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 16, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 3, 16, 8, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(2, 3, 16, 8, dtype=torch.bfloat16)
    results = {}
    for fn in (softmax, softmax_for_product):
        with cuda_autocast(torch.bfloat16):
            kept, out = _kept(lambda: fn(x, -1) @ v)
        grads = torch.autograd.grad(out, (x, v), grad)
        probs = {t.untyped_storage().data_ptr() for t in kept if t.numel() == x.numel()}
        results[fn.__name__] = out, grads, len(probs)
    (want, want_grads, copies), (got, got_grads, once) = results.values()
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))
    assert (copies, once) == (2, 1)
    plain = torch.randn(2, 3, 16, 16, requires_grad=True)
    assert torch.equal(softmax_for_product(plain, -1), torch.softmax(plain, -1))
