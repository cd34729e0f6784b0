"""One compute-heavy op at its roofline: its FLOPs at a rate against its bytes at the
memory bandwidth (:func:`op_seconds`), what the layers' compute
(:mod:`partc.cost.layer_compute`) and FP8 linears (:mod:`partc.cost.fp8_pricing`) build on."""

from __future__ import annotations

from partc.problem import HeavyOp


def op_seconds(op: HeavyOp, rate: float, hbm_bandwidth: float, micro_batch: int = 1,
               scale: float = 1.0, backward: bool = False,
               overhead_s: float = 0.0) -> tuple[float, float]:
    """One of ``op``'s equal ops on one microbatch as (compute, memory) seconds: its FLOPs
    at ``rate`` (achievable FLOP/s) and its bytes at ``hbm_bandwidth``, with its weight
    read once per microbatch; its time is the larger (the roofline). ``scale`` converts
    the measured dtype's bytes to the training dtype's (``TrainNumbers.measured_scale``).
    ``backward``: an op's gradients w.r.t. its input and its weight are two ops of its
    FLOPs (plus what a fused kernel recomputes), each reading the output's gradient and
    the weight or the input and writing the input's or the weight's gradient: its bytes
    twice. ``overhead_s``: what each kernel call costs beyond its FLOPs at ``rate``
    (:attr:`DeviceNumbers.matmul_overhead_s`: small matmuls run below the rate)."""
    factor = 2 if backward else 1
    flops = factor * op.flops + (op.bwd_extra_flops if backward else 0.0)
    compute = micro_batch * flops / rate + factor * overhead_s
    memory = factor * (micro_batch * op.activation_bytes + op.weight_bytes) * scale \
        / hbm_bandwidth
    return compute, memory
