"""FP8 linears as the plan's ``fp8`` section names them: torchao's float8 training.

The lowering pass :func:`partc.passes.fp8_linears.fp8_linears` replaces each such linear
call in a stage's graph with :func:`linear`, which runs what torchao's ``Float8Linear``
runs in its forward (``torchao.float8``): ``matmul_with_hp_or_float8_args``, torchao's
autograd function that casts the input and the weight (and in backward the output's
gradient) to FP8 with dynamic scales and multiplies them, under the recipe's
``Float8LinearConfig`` (``"tensorwise"``, ``"rowwise"``). The weight stays the stage's
own parameter (ZeRO, checkpoints and the optimizer see it unchanged); only the matmuls
run FP8. Where the device has no FP8 matmuls (the CPU) torchao emulates them
(``emulate=True``): the same casts and scales, the matmuls in fp32.

torchao is an optional dependency (``pip install partc[fp8]``); it is imported when a
plan with FP8 linears runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from partc.errors import PartcError


def _torchao() -> Any:
    try:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
    except ImportError as error:
        raise PartcError(f"the plan runs FP8 linears (TrainSpec(fp8=True)), which need "
                         f"torchao: pip install 'partc[fp8]' ({error})") from None
    return Float8LinearConfig, matmul_with_hp_or_float8_args, LinearMMConfig, ScaledMMConfig


def config(recipe: str, emulate: bool) -> Any:
    """torchao's ``Float8LinearConfig`` of ``recipe``, emulated or not."""
    float8_config = _torchao()[0]
    return dataclasses.replace(float8_config.from_recipe_name(recipe), emulate=emulate)


def mm_config(float8: Any) -> Any:
    """The per-matmul settings torchao's ``Float8Linear`` makes from its config (output,
    input gradient, weight gradient)."""
    _, _, linear_mm_config, scaled_mm_config = _torchao()
    gemms = (float8.gemm_config_output, float8.gemm_config_grad_input,
             float8.gemm_config_grad_weight)
    return linear_mm_config(*(scaled_mm_config(float8.emulate, gemm.use_fast_accum, False,
                                               float8.pad_inner_dim) for gemm in gemms))


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           recipe: str = "tensorwise") -> torch.Tensor:
    """``F.linear(input, weight, bias)`` with its matmuls in FP8 (torchao's float8
    training, ``recipe``), emulated off a GPU. Under autocast the input is cast to the
    autocast dtype first, as ``Float8Linear`` does, and the output is in that dtype."""
    device = input.device.type
    if torch.is_autocast_enabled(device):
        input = input.to(torch.get_autocast_dtype(device))
    float8 = config(recipe, emulate=device != "cuda")
    matmul = _torchao()[1]
    output = matmul.apply(input, weight.t(), mm_config(float8), float8)
    if bias is not None:
        output = output + bias.to(output.dtype)
    return output
