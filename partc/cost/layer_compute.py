"""A layer's compute per microbatch, in seconds: each compute-heavy op at its roofline
(:func:`op_seconds`), the light ops' bytes at the device's element-wise rate, the cost of
dispatching them (:func:`dispatched`), for forward, backward and each recompute mode's
replay (:func:`layer_work`), on the layer as the runtime runs it (:func:`run_layer`)."""

from __future__ import annotations

from typing import Any, Sequence

from partc.cost.fp8_pricing import Fp8Pricing, fp8_count, fp8_op_seconds
from partc.cost.roofline import op_seconds
from partc.problem import DeviceNumbers, HeavyOp, LayerCost, PlanningProblem


def roofline_seconds(ops: Sequence[HeavyOp], devices: DeviceNumbers, micro_batch: int,
                     scale: float, backward: bool = False,
                     fp8: Fp8Pricing | None = None) -> tuple[float, float]:
    """One microbatch of compute-heavy ``ops``, each at its roofline (:func:`op_seconds`)
    and its rate (a fused attention kernel at the device's attention share of peak, the
    matmuls at theirs: :meth:`DeviceNumbers.heavy_op_flops`), split into
    (compute-bound, memory-bound) seconds; the linears that run FP8 (``fp8``:
    :func:`partc.cost.fp8_pricing.fp8_count`) at FP8's rate with their casts."""
    bound = {True: 0.0, False: 0.0}
    for op in ops:
        compute, memory = op_seconds(op, devices.heavy_op_flops(op), devices.hbm_bandwidth,
                                     micro_batch, scale, backward, devices.matmul_overhead_s)
        in_fp8 = fp8_count(op, fp8, devices, micro_batch, scale)
        bound[compute >= memory] += (op.count - in_fp8) * max(compute, memory)
        if in_fp8:
            compute_s, memory_s = fp8_op_seconds(op, fp8, devices, micro_batch, scale,
                                                 backward)
            bound[True] += in_fp8 * compute_s
            bound[False] += in_fp8 * memory_s
    return bound[True], bound[False]


def op_step_seconds(op: HeavyOp, rate: float, hbm_bandwidth: float) -> float:
    """One op's forward and backward at the roofline, as measured (one microbatch of the
    traced batch, its dtype): what the tensor-parallel chooser charges a node."""
    return sum(max(op_seconds(op, rate, hbm_bandwidth, backward=backward))
               for backward in (False, True))


def layer_work(layer: LayerCost, devices: DeviceNumbers, micro_batch: int,
               scale: float, compiled: bool = False,
               fp8: Fp8Pricing | None = None) -> dict[str, Any]:
    """A layer's compute per microbatch as (compute-bound, memory-bound) seconds: forward,
    backward and, per recompute mode, the recomputed forward. Heavy ops by the roofline
    (:func:`roofline_seconds`); the other ops move their bytes at the device's
    element-wise rate (:attr:`DeviceNumbers.light_op_bandwidth`), backward's as measured
    (:attr:`LayerCost.bwd_mem_bytes`). A recompute mode replays the share of the heavy
    ops its FLOPs say (all or none, as estimated) and moves its bytes.

    Every op also pays the device's fixed overhead per call and microbatch
    (:attr:`DeviceNumbers.op_overhead_s` forward, ``op_overhead_backward_s`` per forward
    op in backward; :func:`dispatched`): what makes more, smaller microbatches cost more
    than fewer, larger ones. Selective recompute replays the layer's attention cores
    (``recompute_nodes``), full recompute all of its ops.

    ``compiled`` (``TrainSpec.compile``): the light ops of a layer that is not recomputed
    run as fused kernels, moving ``fused_mem_bytes`` (twice in backward) and paying the
    overhead of ``fused_kernels`` calls; a recomputed layer runs eagerly inside the
    compiled stage (:mod:`partc.runtime.compiled`), so its recompute entry carries what
    the unfused forward and backward cost beyond the fused ones.

    ``fp8`` (``TrainSpec.fp8``): the linears that run FP8 priced so
    (:mod:`partc.cost.fp8_pricing`); a recompute replays them in FP8 too."""
    compute, memory = roofline_seconds(layer.heavy_ops, devices, micro_batch, scale,
                                       fp8=fp8)
    back_compute, back_memory = roofline_seconds(layer.heavy_ops, devices, micro_batch,
                                                 scale, backward=True, fp8=fp8)

    def light(mem_bytes: float) -> float:
        return micro_batch * mem_bytes * scale / devices.light_op_bandwidth

    # The device's own time for the kernels each phase launches (0 where they were not
    # counted, or on a CPU).
    counted, per_kernel = layer.kernels, devices.kernel_overhead_s
    launched = {"forward": per_kernel * counted["forward"],
                "backward": per_kernel * counted["backward"],
                "recompute": {m: per_kernel * n for m, n in counted["recompute"].items()}}

    ops = layer.num_nodes
    heavy = sum(op.count for op in layer.heavy_ops)
    replayed = {m: layer.recompute_flops[m] / layer.fwd_flops if layer.fwd_flops else 0.0
                for m in layer.modes}
    rerun_ops = {m: layer.recompute_nodes.get(
        m, 0 if m == "none" else ops if m == "full" else max(0, ops - heavy))
        for m in layer.modes}
    eager = {"forward": dispatched(compute, memory + light(layer.fwd_mem_bytes)
                                   + launched["forward"],
                                   ops * devices.op_overhead_s, devices),
             "backward": dispatched(back_compute, back_memory + light(layer.bwd_mem_bytes)
                                    + launched["backward"],
                                    ops * devices.op_overhead_backward_s, devices),
             "recompute": {m: dispatched(replayed[m] * compute,
                                         replayed[m] * memory
                                         + light(layer.recompute_mem_bytes[m])
                                         + launched["recompute"][m],
                                         rerun_ops[m] * devices.op_overhead_s, devices)
                           for m in layer.modes}}
    if not compiled or layer.fused_mem_bytes is None:
        return eager
    kernels = heavy + (layer.fused_kernels or 0)
    # The fused kernels' own time, where the layer's were counted: backward launches as
    # many more per forward kernel as the eager layer's does.
    per_kernel = per_kernel if layer.forward_kernels else 0.0
    backward_share = counted["backward"] / counted["forward"] if counted["forward"] else 2.0
    forward = dispatched(compute, memory + light(layer.fused_mem_bytes)
                         + kernels * per_kernel,
                         kernels * devices.op_overhead_s, devices)
    backward = dispatched(back_compute, back_memory + light(2.0 * layer.fused_mem_bytes)
                          + backward_share * kernels * per_kernel,
                          kernels * devices.op_overhead_backward_s, devices)
    unfused = sum(eager["forward"]) + sum(eager["backward"]) - sum(forward) - sum(backward)
    recompute = {m: (c, memory + (unfused if m != "none" else 0.0))
                 for m, (c, memory) in eager["recompute"].items()}
    return {"forward": forward, "backward": backward, "recompute": recompute}


def dispatched(compute: float, memory: float, dispatch: float,
               devices: DeviceNumbers) -> tuple[float, float]:
    """A phase's (compute-bound, memory-bound) kernel seconds with its ops' ``dispatch``
    seconds (their count times the op overhead) added to the memory-bound part. Where the
    host dispatches ahead of the device (:attr:`DeviceNumbers.dispatch_ahead`, a GPU's
    launch queue) the phase takes the longer of its kernels and its dispatch: only the
    dispatch the kernels cannot hide is added (a layer of many small ops on small
    microbatches runs at the host's pace); on a CPU all of it."""
    if devices.dispatch_ahead:
        return compute, memory + max(0.0, dispatch - compute - memory)
    return compute, memory + dispatch


def run_layer(problem: PlanningProblem, index: int, micro_batch: int) -> LayerCost:
    """Layer ``index`` as the runtime runs it on microbatches of ``micro_batch`` samples:
    its sequence-parallel linears as rings where ``TrainSpec.tp_overlap`` has them so
    (:meth:`LayerCost.as_rings`)."""
    layer = problem.layers[index]
    return layer.as_rings(micro_batch) if problem.train.tp_overlap else layer
