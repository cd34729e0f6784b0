"""FP8 linears (``TrainSpec.fp8``): what a linear costs run in FP8, and which run so.

torchao's float8 training (``torchao.float8``, the runtime's :mod:`partc.runtime.fp8`)
runs a linear's three matmuls (output, input gradient, weight gradient) on FP8 operands
scaled dynamically: before each matmul every operand is measured (its absolute maximum,
per tensor or per row: the recipe) and cast to e4m3 (inputs, weights) or e5m2 (output
gradients). torchao keeps the input and the weight in the training dtype for backward
and casts them again there, so per microbatch a linear of ``m`` tokens, ``k`` inputs and
``n`` outputs casts

- forward: the input (m x k) and the weight (k x n);
- backward: the output gradient (m x n; twice under the row-wise recipe, whose scales
  run along each matmul's own reduction axis), the weight and the input again.

Each cast reads its operand twice in eager mode (the maximum, then the scaled cast) and
writes one byte per element, 2e + 1 bytes per element of e bytes, two kernels; under
``torch.compile`` the two fuse into one pass, e + 1 bytes and one kernel. The matmuls
run at the device's ``fp8_peak_flops`` times FP8 matmuls' share of it
(``fp8_efficiency``, else the matmuls' ``flops_efficiency``), against the training
dtype's peak times ``flops_efficiency``: Hopper's FP8 tensor cores peak at twice bf16's
rate, and its presets' FP8 matmuls reach 1.7 times bf16's (0.6 of the FP8 peak against
0.7 of bf16's: the presets say where that comes from).

A linear runs FP8 where that is faster, forward and backward together, on the
configuration's microbatch (:func:`fp8_count`), except the model's output layer (its
last linear, :func:`output_linears`: the logits in e4m3's 3-bit mantissas learn visibly
worse, benchmarks/fp8_curve.py; torchtitan keeps its output layer out of FP8 too),
which runs FP8 only where pinned; its in and out features must be
multiples of 16 (FP8 matmul kernels need it; torchao refuses others). Small linears lose
to their casts and kernels: torchao's guidance that shapes below a few thousand do not
gain follows from the same pricing. A device without an FP8 peak (the CPU preset:
torchao's emulation) prices FP8 at the training dtype's rate, so only pinned linears
(``Constraints.fp8_linears``) run FP8 there. Under tensor parallelism no linear runs FP8
(the runtime refuses the combination; partc's tensor-parallel rewrite calls its own
collectives around plain linears, which torchao's float8 sharding does not know).

While a linear runs, its FP8 copies are held beside it: the input's and the weight's
(one byte per element) and the output gradient's in backward, with their scales
(:func:`fp8_workspace_bytes`): the layer's workspace grows by the largest of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from partc.cost.roofline import op_seconds
from partc.device.figures import DeviceFigures
from partc.problem import DeviceNumbers, HeavyOp, LayerCost, PlanningProblem

# FP8 matmul kernels (cuBLASLt's, through torch._scaled_mm) need both dimensions of the
# weight to be multiples of this.
FP8_ALIGNMENT = 16
# Bytes of one FP8 element and of one fp32 scale.
FP8_BYTES = 1
SCALE_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class Fp8Pricing:
    """What pricing FP8 linears needs of a configuration: the recipe, the FP8 matmul
    rate over the training dtype's (``speedup``; 1 where the device has no FP8 peak and
    emulates it), the bytes of one training-dtype element, whether the casts are fused
    (compiled), and the pinned linears (None: where it pays; "all"; "none"; names)."""

    recipe: str
    speedup: float
    element_bytes: float
    compiled: bool
    pinned: tuple[str, ...] | str | None = None
    kept: tuple[str, ...] = ()    # left in the training dtype unless pinned

    @property
    def cast_bytes_per_element(self) -> float:
        reads = 1 if self.compiled else 2
        return reads * self.element_bytes + FP8_BYTES

    @property
    def kernels_per_cast(self) -> int:
        return 1 if self.compiled else 2


def pricing(problem: PlanningProblem, tp: int = 1) -> Fp8Pricing | None:
    """FP8's pricing for ``problem`` at tensor-parallel degree ``tp``; None where no
    linear can run FP8 (``TrainSpec.fp8`` off, pinned "none", or ``tp`` > 1)."""
    train, devices = problem.train, problem.devices
    if train.fp8 is None or tp > 1 or problem.pins.fp8_linears == "none":
        return None
    return Fp8Pricing(recipe=train.fp8, speedup=fp8_speedup(devices),
                      element_bytes=train.precision.compute_bytes, compiled=train.compiled,
                      pinned=problem.pins.fp8_linears, kept=train.fp8_kept)


def fp8_speedup(devices: DeviceNumbers) -> float:
    """FP8 matmuls' rate over the training dtype's: the FP8 peak at ``fp8_efficiency``
    (else ``flops_efficiency``) over the peak at ``flops_efficiency``; 1 without an FP8
    peak (emulated)."""
    if not devices.fp8_peak_flops:
        return 1.0
    return devices.fp8_peak_flops * fp8_share(devices) / (
        devices.peak_flops * devices.flops_efficiency)


def fp8_share(figures: DeviceNumbers | DeviceFigures) -> float:
    """The share of the FP8 peak FP8 matmuls reach: ``fp8_efficiency``, else the
    matmuls' ``flops_efficiency``."""
    return figures.fp8_efficiency or figures.flops_efficiency


def output_linears(layers: Sequence[LayerCost]) -> tuple[str, ...]:
    """The model's output layer: the linears of the last layer that has any, the last of
    them (an LM head; a tied one goes by its embedding's weight)."""
    for layer in reversed(layers):
        names = [name for op in layer.heavy_ops for name in op.linear_names]
        if names:
            return (names[-1],)
    return ()


def shape(op: HeavyOp) -> tuple[float, int, int]:
    """A linear op's (tokens per sample, in features, out features)."""
    k, n = op.linear
    return op.flops / (2.0 * k * n), k, n


def cast_elements(op: HeavyOp, micro_batch: int, recipe: str) -> tuple[float, float]:
    """Elements a linear casts to FP8 per microbatch: (forward, backward)."""
    m, k, n = shape(op)
    tokens = micro_batch * m
    grads = 2 if recipe == "rowwise" else 1
    return tokens * k + k * n, grads * tokens * n + k * n + tokens * k


def fp8_op_seconds(op: HeavyOp, price: Fp8Pricing, devices: DeviceNumbers, micro_batch: int,
                   scale: float, backward: bool) -> tuple[float, float]:
    """One of ``op``'s linears in FP8 on one microbatch as (compute-bound, memory-bound)
    seconds: its matmuls at the FP8 rate by the roofline, its casts' bytes at the
    element-wise rate and their kernels' overhead (memory-bound)."""
    rate = devices.heavy_op_flops(op) * price.speedup
    compute, memory = op_seconds(op, rate, devices.hbm_bandwidth, micro_batch, scale,
                                 backward, devices.matmul_overhead_s)
    elements = cast_elements(op, micro_batch, price.recipe)[1 if backward else 0]
    casts = 3 if backward else 2
    if backward and price.recipe == "rowwise":
        casts += 1
    cast_s = elements * price.cast_bytes_per_element / devices.light_op_bandwidth \
        + casts * price.kernels_per_cast * devices.kernel_overhead_s
    bound = max(compute, memory)
    return (bound, cast_s) if compute >= memory else (0.0, bound + cast_s)


def eligible(op: HeavyOp) -> bool:
    """A linear whose features FP8 kernels take."""
    return op.linear is not None and all(d % FP8_ALIGNMENT == 0 for d in op.linear)


def pays(op: HeavyOp, price: Fp8Pricing, devices: DeviceNumbers, micro_batch: int,
         scale: float) -> bool:
    """Whether an eligible linear is faster in FP8, forward and backward together."""
    if not eligible(op):
        return False
    rate = devices.heavy_op_flops(op)
    plain = sum(max(op_seconds(op, rate, devices.hbm_bandwidth, micro_batch, scale, b,
                               devices.matmul_overhead_s)) for b in (False, True))
    fp8 = sum(sum(fp8_op_seconds(op, price, devices, micro_batch, scale, b))
              for b in (False, True))
    return fp8 < plain


def fp8_count(op: HeavyOp, price: Fp8Pricing | None, devices: DeviceNumbers,
              micro_batch: int, scale: float) -> int:
    """How many of ``op``'s ``count`` linears run FP8: the pinned ones, else where it
    pays all but the output layer (``kept``), else none."""
    if price is None or op.linear is None or not op.linear_names:
        return 0
    if price.pinned == "all":
        return op.count
    if isinstance(price.pinned, tuple):
        return sum(1 for name in op.linear_names if name in price.pinned)
    if not pays(op, price, devices, micro_batch, scale):
        return 0
    return op.count - sum(1 for name in op.linear_names if name in price.kept)


def fp8_names(layer: LayerCost, price: Fp8Pricing | None, devices: DeviceNumbers,
              micro_batch: int, scale: float) -> tuple[str, ...]:
    """The layer's linears (weight FQNs) that run FP8."""
    names: list[str] = []
    for op in layer.heavy_ops:
        count = fp8_count(op, price, devices, micro_batch, scale)
        if count == op.count:
            names.extend(op.linear_names)
        elif count:
            chosen = price.pinned if isinstance(price.pinned, tuple) else ()
            names.extend(n for n in op.linear_names
                         if n in chosen or (not chosen and n not in price.kept))
    return tuple(names)


def fp8_workspace_bytes(layer: LayerCost, price: Fp8Pricing | None, devices: DeviceNumbers,
                        micro_batch: int, scale: float) -> float:
    """The FP8 copies and scales the layer's largest FP8 linear holds while it runs (its
    input's and weight's, and in backward the output gradient's), per microbatch."""
    largest = 0.0
    for op in layer.heavy_ops:
        if fp8_count(op, price, devices, micro_batch, scale):
            m, k, n = shape(op)
            tokens = micro_batch * m
            copies = FP8_BYTES * (tokens * k + k * n + tokens * n)
            scales = SCALE_BYTES * (2 * tokens + k + n if price.recipe == "rowwise" else 3)
            largest = max(largest, copies + scales)
    return largest
