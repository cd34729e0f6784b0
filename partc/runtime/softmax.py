"""The softmax of an attention core, kept for backward in the autocast dtype.

Under mixed precision a GPU's autocast computes softmax in fp32, and autograd keeps its
fp32 output for backward: 4 bytes for each of the (seq x seq) probabilities of every
head, twice what the probabilities take in bf16. Megatron's fused softmax keeps its
output in the training's 16-bit dtype, and so does :func:`softmax` (which the
``attention_softmax`` pass puts in place of each attention core's softmax): the forward
computes and returns exactly what autocast's softmax does; backward computes softmax's
gradient in that same dtype from the kept output widened again, so only the rounding of
the kept probabilities (bf16's, as Megatron's) differs from autocast's backward. Without
autocast, or where softmax computes in the autocast dtype already, it keeps its output as
softmax does and backward is softmax's own, bit for bit.

Where the probabilities' only reader is the core's second product (directly, or through
a dropout of probability 0, which returns its input), autocast would cast them to the
low dtype for that matmul: a second copy of what backward keeps, made and kept again.
:func:`softmax_for_product` returns the kept low-precision copy itself (the same values
the cast makes), so the product reads it with no cast and backward keeps one copy, as
Megatron's fused softmax hands the product its 16-bit output. The gradient the product
returns is widened in backward exactly as autocast's cast would widen it.
"""

from __future__ import annotations

import torch


def softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.softmax(x, dim, dtype=dtype)`` as autocast computes it, keeping for
    backward its output in the autocast dtype where that is narrower."""
    return _Softmax.apply(x, dim, dtype, False)


def softmax_for_product(x: torch.Tensor, dim: int,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`softmax` for probabilities that only a matmul computing in the autocast
    dtype reads: under autocast they come back in that dtype (rounded once from the fp32
    result, as autocast's cast for the product would round them), and that one tensor is
    what backward keeps. Without autocast, as :func:`softmax`."""
    return _Softmax.apply(x, dim, dtype, True)


def _backward_working_set(result: torch.Tensor) -> int:
    """Bytes live at once in :class:`_Softmax`'s backward for ``result`` where it kept a
    narrowed copy: the incoming gradient in fp32 (widened from the low dtype where the
    result was handed over in it, both then live), the kept copy widened, softmax's
    gradient in fp32 and its narrowing to the input's dtype: 3 x 4 + 2 bytes an element
    in bf16, 2 more for a narrowed result. 0 (twice the output, the estimate's default)
    otherwise."""
    low = _autocast_dtype(result.device.type)
    if low is None or low.itemsize >= 4:
        return 0
    handed_over = low.itemsize if result.dtype == low else 0
    return result.numel() * (3 * 4 + low.itemsize + handed_over)


# The narrowing to the autocast dtype is a kernel of its own beside softmax's (what
# passes/estimate counts as a cast); what backward allocates, as the estimate prices it;
# to the passes (attention cores, tensor-parallel rules) it is a softmax.
softmax_for_product.casts_its_result = True
softmax_for_product.op_name = "softmax"
softmax.backward_working_set = softmax_for_product.backward_working_set = \
    _backward_working_set


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, dtype, narrow_output):
        # Autocast's policy applies here as it does to the op itself.
        out = torch.softmax(x, dim, dtype=dtype)
        low = _autocast_dtype(x.device.type)
        narrower = low is not None and low.itemsize < out.dtype.itemsize
        kept = out.to(low) if narrower else out
        ctx.save_for_backward(kept)
        ctx.dim, ctx.dtypes = dim, (x.dtype, out.dtype)
        return kept if narrow_output else out

    @staticmethod
    def backward(ctx, grad):
        kept, = ctx.saved_tensors
        x_dtype, out_dtype = ctx.dtypes
        out = kept.to(out_dtype)
        grad_x = torch._softmax_backward_data(grad.to(out_dtype), out, ctx.dim, out_dtype)
        return grad_x.to(x_dtype), None, None, None
