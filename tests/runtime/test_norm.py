"""partc's LayerNorm (``partc.runtime.norm``): under CUDA's autocast policy a matmul
reading it computes what it computes reading autocast's fp32 LayerNorm, forward and
backward, bit for bit, while the norm keeps its bf16 input (not an fp32 copy) and
returns bf16; without autocast it is ``F.layer_norm`` bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from partc.autocast_policy import cuda_autocast
from partc.runtime.norm import layer_norm
from tests.runtime.test_softmax import _kept   # what autograd keeps, and the output


def _operands(shape, affine: bool, seed: int = 0):
    torch.manual_seed(seed)
    x = (torch.randn(*shape) * 3 + 1).bfloat16().requires_grad_()
    width = shape[-1]
    weight = torch.randn(width).bfloat16().requires_grad_() if affine else None
    bias = torch.randn(width).bfloat16().requires_grad_() if affine else None
    return x, weight, bias


@pytest.mark.parametrize("shape", [(2, 16, 64), (4, 128, 768), (3, 7, 1000)])
@pytest.mark.parametrize("affine", [True, False])
def test_a_matmul_reading_it_computes_what_it_does_under_autocast(shape, affine):
    x, w, b = _operands(shape, affine)
    twins = [None if t is None else t.detach().clone().requires_grad_() for t in (x, w, b)]
    proj = torch.randn(32, shape[-1]).bfloat16()
    with cuda_autocast(torch.bfloat16):
        kept, normed = _kept(lambda: layer_norm(x, shape[-1:], w, b, 1e-5))
        ours = F.linear(normed, proj)
        theirs_kept, theirs_normed = _kept(
            lambda: F.layer_norm(twins[0], shape[-1:], twins[1], twins[2], 1e-5))
        theirs = F.linear(theirs_normed, proj)
    assert normed.dtype == torch.bfloat16 and theirs_normed.dtype == torch.float32
    assert torch.equal(ours, theirs)
    grad = torch.randn_like(ours)
    inputs = [t for t in (x, w, b) if t is not None]
    got = torch.autograd.grad(ours, inputs, grad)
    want = torch.autograd.grad(theirs, [t for t in twins if t is not None], grad)
    for g, expected, operand in zip(got, want, inputs):
        assert g.dtype == operand.dtype and torch.equal(g, expected)
    # Kept: the bf16 input itself (no copy), the weight and bias, fp32 statistics; the
    # linear's input is the bf16 output. Autocast keeps an fp32 copy of the input.
    rows = x.numel() // shape[-1]
    assert kept[0] is x and sum(t.numel() for t in kept if t.dtype == torch.float32) \
        == 2 * rows
    assert any(t.dtype == torch.float32 and t.shape == x.shape for t in theirs_kept)


def test_without_autocast_it_is_layer_norm_bit_for_bit():
    torch.manual_seed(0)
    x = torch.randn(4, 16, 32, requires_grad=True)
    w, b = torch.randn(32, requires_grad=True), torch.randn(32, requires_grad=True)
    out = layer_norm(x, (32,), w, b, 1e-5)
    want = F.layer_norm(x, (32,), w, b, 1e-5)
    assert torch.equal(out, want)
    grad = torch.randn_like(out)
    for g, e in zip(torch.autograd.grad(out, (x, w, b), grad),
                    torch.autograd.grad(want, (x, w, b), grad)):
        assert torch.equal(g, e)


def test_an_fp32_input_under_autocast_is_autocasts_norm():
    x = torch.randn(2, 8, 16)
    with cuda_autocast(torch.bfloat16):
        assert torch.equal(layer_norm(x, (16,)), F.layer_norm(x, (16,)))
        assert layer_norm(x, (16,)).dtype == torch.float32
