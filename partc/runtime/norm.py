"""LayerNorm whose output is in the training's 16-bit dtype, as Megatron's LayerNorm's is.

Under mixed precision a GPU's autocast runs ``layer_norm`` in fp32: it casts the bf16
input to fp32, keeps that fp32 copy for backward (4 bytes an element), and returns fp32,
which the next matmul casts back to bf16; under sequence parallelism the fp32 output is
what the all-gather before that matmul moves. Megatron's and Transformer Engine's
LayerNorm keep the bf16 input and write bf16.

:func:`layer_norm` does what autocast does, keeping and returning less: where autocast
is on and the input is in its dtype, it computes the norm in fp32 from the input widened,
returns the output narrowed to the input's dtype (what the matmul reading autocast's fp32
output rounds it to: the same values), and keeps for backward the bf16 input, the weight
and bias and the fp32 mean and inverse deviation. Backward widens them again and runs
torch's fp32 LayerNorm backward, giving each gradient in its input's dtype as autocast's
casts would: the same values where one matmul reads the output (where several do, their
gradients add in bf16 before the norm rather than in fp32 after the cast, as in
Megatron). Torch's own bf16 LayerNorm is not used: on CPU it keeps a bf16 mean and
deviation and sums the weight's gradient in bf16 (2.6% off fp32's on a 512 x 768 input).
Anywhere else (no autocast, an fp32 input) it is ``torch.nn.functional.layer_norm``.

The ``norm_dtype`` pass (``partc.passes.norm_dtype``) puts it in place of a norm only
where every reader of its output computes in the 16-bit dtype anyway.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def layer_norm(input: torch.Tensor, normalized_shape: Sequence[int],
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` as autocast computes it, returned in the input's 16-bit dtype
    (see the module)."""
    device = input.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device) \
            and input.dtype == torch.get_autocast_dtype(device) \
            and input.dtype.itemsize < 4:
        return _LayerNorm.apply(input, tuple(normalized_shape), weight, bias, eps)
    return F.layer_norm(input, normalized_shape, weight, bias, eps)


# Its result is a cast of the fp32 norm, a kernel of its own: the estimate prices it
# (``partc.passes.estimate``), as it prices autocast's casts.
layer_norm.casts_its_result = True


def _wide(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.float()


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shape, weight, bias, eps):
        with torch.autocast(x.device.type, enabled=False):
            out, mean, rstd = torch.ops.aten.native_layer_norm(
                x.float(), list(shape), _wide(weight), _wide(bias), eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.shape = shape
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        wanted = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2],
                  bias is not None and ctx.needs_input_grad[3]]
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            grad.float(), x.float(), list(ctx.shape), mean, rstd, _wide(weight),
            _wide(bias), wanted)
        return (None if dx is None else dx.to(x.dtype), None,
                None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype), None)
