"""What the data-parallel, tensor-parallel and pipeline traffic costs, priced by
:mod:`partc.cost.collectives`: ZeRO's collectives and the runtime's own work beside them
(:func:`zero_comm_seconds`, :func:`zero_overhead_seconds`, :func:`gradient_work_seconds`),
what the step adds after the pipeline drains (the gradient reduction, ZeRO-1's weight
gather and the optimizer step: :func:`sync_ps`, :func:`gather_ps`, :func:`tail_ps` and the
once-per-step latencies), a layer's tensor-parallel collectives (what the step pays,
:func:`tp_comm_seconds`; each one's own time and exposed part, :func:`tp_collective_times`)
and the sends across each cut (:func:`cut_table`)."""

from __future__ import annotations

import math
from typing import Iterable

from partc.cost.collectives import Group, collective_seconds
from partc.cost.experts_cost import moe_layer_figures
from partc.cost.host_offload import host_seconds
from partc.cost.pipeline_config import PipelineConfig, exposed_seconds, stage_ranks, to_ps
from partc.problem import SMALL_UNITS_SHARE, PlanningProblem


def zero_comm_seconds(problem: PlanningProblem, config: PipelineConfig,
                      params: int) -> dict[str, float]:
    """ZeRO-2/3 collectives of ``params`` parameters over dp (ring), by when they run:
    per microbatch in forward or backward, or once per step ("step" in the tail, "sync"
    overlapping the last microbatch's backward: ZeRO-2's one reduce-scatter when it
    reduces once per step)."""
    zero = config.effective_zero_stage
    result = {"forward": 0.0, "backward": 0.0, "step": 0.0, "sync": 0.0}
    if zero < 2:
        return result
    precision = problem.train.precision
    group = dp_group(problem, config)
    gather = collective_seconds("all_gather", params * precision.compute_bytes, group)
    scatter = collective_seconds("reduce_scatter", params * precision.master_bytes, group)
    if zero == 2 and config.reduces_once:
        result.update(sync=scatter, step=gather)
    elif zero == 2:
        result.update(backward=scatter, step=gather)
    else:
        result.update(forward=gather, backward=gather + scatter)
    return result


def zero_overhead_seconds(problem: PlanningProblem, config: PipelineConfig,
                          params: int, tensors: int = 1) -> dict[str, float]:
    """The runtime's own work on a unit of ``params`` parameters beside its layers'
    compute, by when it runs (the keys of :func:`zero_comm_seconds`): under ZeRO 0/1
    its passes over the gradients (:func:`gradient_work_seconds`); under ZeRO-2/3
    FSDP's, with the collectives it goes with: its forward and
    backward hooks every microbatch (``DeviceNumbers.fsdp_unit_overhead_s``,
    ``fsdp_unit_overhead_backward_s``), the optimizer step's dispatch over its
    ``tensors`` sharded parameters once per step (``fsdp_step_overhead_s`` each), and
    around each all-gather and reduce-scatter the unit runs, the fixed work
    (``fsdp_gather_overhead_s``, ``fsdp_scatter_overhead_s``) and the copies: an
    all-gather copies the rank's shard in and the whole weights out (compute dtype), a
    reduce-scatter the whole gradient in and the shard out (fp32), each byte read and
    written (at :attr:`DeviceNumbers.fsdp_copy_rate`). ZeRO-2 reducing once per step
    accumulates every microbatch's whole fp32 gradient instead of copying it out, about
    as many bytes, a kernel per parameter tensor. It runs on the rank's own thread
    beside its compute: none of it overlaps.

    A layer too small to be a unit of its own (under ``SMALL_UNITS_SHARE`` of a stage's
    parameters, about 1/pp of the model's: the runtime joins it to the next unit) adds
    its bytes to that unit's copies but no work of a unit."""
    zero = config.effective_zero_stage
    result = {"forward": 0.0, "backward": 0.0, "step": 0.0, "sync": 0.0}
    if params == 0:
        return result
    if zero < 2:
        return result | gradient_work_seconds(problem, config, params, tensors)
    devices, precision = problem.devices, problem.train.precision
    units = 1.0 if params > SMALL_UNITS_SHARE * _rank_params(problem) / config.pp else 0.0
    copied = 2 * (1 + 1 / config.dp) * params / devices.fsdp_copy_rate
    gather = units * devices.fsdp_gather_overhead_s + copied * precision.compute_bytes
    scatter = units * devices.fsdp_scatter_overhead_s + copied * precision.master_bytes
    result.update(forward=units * devices.fsdp_unit_overhead_s,
                  backward=units * devices.fsdp_unit_overhead_backward_s,
                  step=tensors * devices.fsdp_step_overhead_s)
    if zero == 2 and config.reduces_once:
        # Autograd adds each parameter's gradient into its whole fp32 one: a kernel per
        # tensor (DeviceNumbers.kernel_overhead_s), as ZeRO 0/1's adds into buckets.
        accumulate = copied * precision.master_bytes + tensors * devices.kernel_overhead_s
        result.update(backward=result["backward"] + accumulate, sync=scatter,
                      step=result["step"] + gather)
    elif zero == 2:
        result.update(backward=result["backward"] + scatter, step=result["step"] + gather)
    else:
        result.update(forward=result["forward"] + gather,
                      backward=result["backward"] + gather + scatter)
    return result


def gradient_work_seconds(problem: PlanningProblem, config: PipelineConfig,
                           params: int, tensors: int = 0) -> dict[str, float]:
    """The runtime's element-wise passes over the gradients of ``params`` parameters under
    ZeRO 0/1, at the device's element-wise rate (none of it overlaps: the rank's own
    thread or stream runs it between its layers' kernels).

    Where the runtime keeps fp32 gradient buckets (dp > 1, mixed precision, or experts
    folded over fewer ranks than dp x tp: ``partc/runtime/module.py``), every
    microbatch's backward adds each gradient into its bucket (the gradient read, the
    bucket read and written); once per step the mean over dp and over the microbatches
    each take a pass over the rank's part of the buckets (read and written; the whole
    under ZeRO-0, 1/dp under ZeRO-1), and the buckets are zeroed for the next step.
    Without buckets autograd accumulates ``.grad`` itself: every microbatch's gradient
    but the first is added to it, and the schedule divides it by the microbatches.
    Each add is a kernel per parameter tensor (``tensors`` of them), each paying the
    device's time per kernel (:attr:`DeviceNumbers.kernel_overhead_s`)."""
    precision = problem.train.precision
    rate = problem.devices.light_op_bandwidth
    master, m = precision.master_bytes, config.num_microbatches
    kernels = tensors * problem.devices.kernel_overhead_s
    if keeps_buckets(problem, config):
        added = precision.compute_bytes + 2 * master
        mine = params / config.dp if config.effective_zero_stage == 1 else params
        means = (config.dp > 1) + (m > 1)
        return {"backward": params * added / rate + kernels,
                "step": (2 * master * means * mine + master * params) / rate}
    return {"backward": (m - 1) / m * (params * 3 * master / rate + kernels),
            "step": (m > 1) * params * 2 * master / rate}


def keeps_buckets(problem: PlanningProblem, config: PipelineConfig) -> bool:
    """Whether the runtime keeps fp32 gradient buckets under ZeRO 0/1 (dp > 1, mixed
    precision, or experts folded over fewer ranks than dp x tp): then a step's
    microbatches count only as one or several (:func:`gradient_work_seconds`)."""
    return (config.dp > 1 or problem.train.precision.mixed
            or config.dp * config.tp > config.ep > 1)


def dp_group(problem: PlanningProblem, config: PipelineConfig) -> Group:
    # Ranks are ordered (pp, dp, tp) with tp innermost: a dp group spans dp * tp ranks.
    return Group.over(problem.devices, config.dp, config.dp * config.tp)


def tail_ps(problem: PlanningProblem, config: PipelineConfig, params: int,
            tensors: int = 1) -> int:
    """The optimizer step; under ZeRO-1 each rank steps 1/dp of the parameters, then the
    updated weights are all-gathered, bucket by bucket ((d-1)/d of the bytes; in the
    compute dtype, cast from the fp32 masters, in mixed precision), here unless that
    all-gather overlaps the next forward (:func:`gather_ps`). Offloaded, the step and
    the copies to and from the host (:func:`partc.cost.host_offload.host_seconds`). Under
    ZeRO-2/3 gradients were reduce-scattered during backward: each rank steps its shard,
    and ZeRO-2 gathers the parameters once per step; FSDP's work on the ``tensors``
    parameter tensors then (:func:`zero_overhead_seconds`). (ZeRO 0/1's gradient
    all-reduce is :func:`sync_ps`.)"""
    devices = problem.devices
    seconds = zero_overhead_seconds(problem, config, params, tensors)["step"]
    stepped = params
    if config.effective_zero_stage >= 2:
        stepped = params / config.dp
        seconds += zero_comm_seconds(problem, config, params)["step"]
    elif config.effective_zero_stage == 1:
        stepped = params / config.dp
        if not gather_overlaps(problem, config):   # else beside the forward: gather_ps
            seconds += _gather_seconds(problem, config, params)
    # At the rate the device's optimizer moves the bytes a step touches (a fused step's
    # HBM bandwidth, or the calibrated rate of torch's unfused one).
    if config.offload_optimizer:   # the step on the host, and the copies each way
        seconds += host_seconds(problem, config, params)
    else:
        seconds += stepped * problem.train.precision.step_bytes \
            / devices.optimizer_step_bandwidth(problem.train.fused_optimizer)
    return to_ps(seconds)


def sync_ps(problem: PlanningProblem, config: PipelineConfig, params: int) -> int:
    """The gradient reduction over dp that runs beside the last microbatch's backward
    (:func:`partc.cost.evaluate.exposed_sync_ps`). ZeRO 0/1: the fp32 gradient buckets'
    reduction of ``params`` parameters, an all-reduce under ZeRO-0 (ring: 2 (d-1)/d of the
    bytes), a reduce-scatter under ZeRO-1 ((d-1)/d), with their share of the buckets'
    latencies (one collective per ``TrainSpec.bucket_elements``), latency and all. ZeRO-2
    reducing once per step: the unit's one reduce-scatter, latency included."""
    if config.reduces_once:
        return to_ps(zero_comm_seconds(problem, config, params)["sync"]
                     + zero_overhead_seconds(problem, config, params)["sync"])
    if config.dp == 1 or config.effective_zero_stage >= 2:
        return 0
    return to_ps(_reduction_seconds(problem, config, params,
                                    params / problem.train.bucket_elements))


def _reduction_seconds(problem: PlanningProblem, config: PipelineConfig, params: float,
                       calls: float) -> float:
    """ZeRO 0/1's reduction over dp of ``params`` fp32 gradients in ``calls``
    collectives: an all-reduce under ZeRO-0 (ring: 2 (d-1)/d of the bytes), a
    reduce-scatter under ZeRO-1 ((d-1)/d), latency and all."""
    group = dp_group(problem, config)
    kind = "reduce_scatter" if config.effective_zero_stage == 1 else "all_reduce"
    moved = (1 if kind == "reduce_scatter" else 2) * (config.dp - 1) / config.dp
    return (moved * params * problem.train.precision.master_bytes / group.link(kind)[1]
            + calls * collective_seconds(kind, 0.0, group))


def gather_overlaps(problem: PlanningProblem, config: PipelineConfig) -> bool:
    """Whether ZeRO-1's all-gather of the stepped weights runs beside the next step's
    forward (``TrainSpec.overlap_param_gather``) rather than after the optimizer step."""
    return config.effective_zero_stage == 1 and problem.train.param_gather_overlap


def _gather_seconds(problem: PlanningProblem, config: PipelineConfig, params: float) -> float:
    """ZeRO-1's all-gather of ``params`` stepped weights, bandwidth only: (d-1)/d of
    their bytes in the compute dtype."""
    bandwidth = dp_group(problem, config).link("all_gather")[1]
    moved = problem.train.precision.compute_bytes
    return (config.dp - 1) / config.dp * params * moved / bandwidth


def stepped_gather_seconds(problem: PlanningProblem, config: PipelineConfig,
                           params: float) -> float:
    """ZeRO-1's all-gather of ``params`` stepped weights after the optimizer step (in
    :func:`tail_ps` where it does not overlap the next forward), bandwidth only; its
    latencies are :func:`bucket_latency_seconds`."""
    return _gather_seconds(problem, config, params)


def gather_ps(problem: PlanningProblem, config: PipelineConfig, params: int) -> int:
    """ZeRO-1's all-gather of ``params`` stepped weights where it overlaps the next
    step's forward (:func:`gather_overlaps`; what forward leaves exposed is
    :func:`partc.cost.evaluate.exposed_gather_ps`), with their share of the buckets'
    latencies (one all-gather per ``TrainSpec.bucket_elements``), as :func:`sync_ps` prices
    the reduce-scatter beside backward. 0 otherwise: the all-gather is in the tail
    (:func:`tail_ps`)."""
    if config.dp == 1 or not gather_overlaps(problem, config):
        return 0
    latency = params / problem.train.bucket_elements * collective_seconds(
        "all_gather", 0.0, dp_group(problem, config))
    return to_ps(_gather_seconds(problem, config, params) + latency)


def first_gather_ps(problem: PlanningProblem, config: PipelineConfig) -> int:
    """One bucket's all-gather, latency and bytes: what the first layer of a stage
    waits for before the forward it overlaps has begun, charged whole once per step. A
    bucket holds ``TrainSpec.bucket_elements``, or a stage's parameters (about 1/pp of
    the tp rank's) when fewer."""
    if config.dp == 1 or not gather_overlaps(problem, config):
        return 0
    bucket = _stage_bucket(problem, _rank_params(problem), config)
    return to_ps(_gather_seconds(problem, config, bucket)
                 + collective_seconds("all_gather", 0.0, dp_group(problem, config)))


def last_sync_ps(whole: PlanningProblem, problem: PlanningProblem,
                 config: PipelineConfig) -> int:
    """ZeRO 0/1: the gradient reduction of the last bucket backward fills, latency and
    bytes. It starts as the step's last backward ends (the bucket holds the stage's first
    parameters), so nothing hides it: charged whole once per step. The bucket is
    :func:`_stage_bucket` of the parameters reduced over dp (the routed experts' aside
    under expert parallelism: their buckets are reduced over their own group).
    ``whole``: the problem before its tensor-parallel variant ``problem``."""
    if config.dp == 1 or config.effective_zero_stage >= 2:
        return 0
    synced = _rank_params(problem)
    if config.ep > 1:
        for index, layer in enumerate(whole.layers):
            if layer.moe is not None:
                local = problem.layers[index]
                figures = moe_layer_figures(layer.moe, local, problem, config)
                synced -= local.param_count - figures.dense_params
    return to_ps(_reduction_seconds(problem, config, _stage_bucket(problem, synced, config), 1))


def _stage_bucket(problem: PlanningProblem, params: int, config: PipelineConfig) -> int:
    """The elements of a stage's first (or last) bucket, its model's ``params`` spread
    over ``pp`` stages: ``TrainSpec.bucket_elements``, or the stage's parameters when
    fewer."""
    return min(problem.train.bucket_elements, math.ceil(params / config.pp))


def _rank_params(problem: PlanningProblem) -> int:
    """The parameters of the model (a tensor-parallel rank's, in its variant)."""
    return problem.model.param_count


def bucket_latency_seconds(problem: PlanningProblem, config: PipelineConfig) -> float:
    """ZeRO-1's all-gathers' latencies, once per step, after the optimizer step (the
    gradient collectives' are in :func:`sync_ps`): one per bucket. A stage holds about
    1/pp of the (tp rank's) parameters, in buckets of ``TrainSpec.bucket_elements``. None where
    the all-gathers overlap the next forward: their latencies are in :func:`gather_ps`."""
    if config.dp == 1 or config.effective_zero_stage != 1 or gather_overlaps(problem, config):
        return 0.0
    group = dp_group(problem, config)
    buckets = max(1, math.ceil(_rank_params(problem) / config.pp
                               / problem.train.bucket_elements))
    return buckets * collective_seconds("all_gather", 0.0, group)


def shared_tail_ps(problem: PlanningProblem, config: PipelineConfig, params: int) -> int:
    """A tied weight's tail; under ZeRO-2/3 the stage's root unit holds it, whose
    collectives (every microbatch's, or ZeRO-2's one per step) are not overlapped:
    charged here, with FSDP's work on it."""
    zero = zero_comm_seconds(problem, config, params)
    own = zero_overhead_seconds(problem, config, params)
    per_microbatch = sum(zero[p] + own[p] for p in ("forward", "backward"))
    return tail_ps(problem, config, params) + to_ps(
        config.num_microbatches * per_microbatch + zero["sync"] + own["sync"])


def tp_comm_seconds(problem: PlanningProblem, config: PipelineConfig,
                    layer) -> dict[str, float]:
    """A layer's tensor-parallel collectives per microbatch, by phase: what the step pays
    for them (:func:`tp_collective_times`' exposed parts)."""
    result = {"forward": 0.0, "backward": 0.0}
    for phase, _, exposed in tp_collective_times(problem, config, layer):
        result[phase] += exposed
    return result


def tp_collective_times(problem: PlanningProblem, config: PipelineConfig,
                        layer) -> list[tuple[str, float, float]]:
    """Each of a layer's tensor-parallel collectives per microbatch (ring, in a node), in
    ``LayerCost.tp_comm``'s order: its phase, its own time, and what of it the step pays.

    A collective the runtime runs as a ring beside its linears' matmuls
    (``LayerCost.tp_overlap_flops``, ``TrainSpec.tp_overlap``) costs its exposed part
    only, :func:`exposed_seconds` of its time ``c`` beside ``t``: the share of those
    matmuls that runs while the ring moves data, ``(tp - 1) / tp`` of them (the chunk
    this rank holds first, or sums last, runs alone), at the compute-bound rate; the
    share ``DeviceNumbers.comm_overlap`` of ``min(c, t)`` is hidden. Any other is paid
    whole."""
    devices = problem.devices
    group = Group.over(devices, config.tp, config.tp)
    samples = config.micro_batch_size * config.tokens_share   # a cp rank's tokens
    scale = samples * problem.train.measured_scale
    beside = layer.tp_overlap_flops if problem.train.tp_overlap else ()
    rate = devices.peak_flops * devices.flops_efficiency
    share = (config.tp - 1) / config.tp
    times = []
    for index, (kind, phase, nbytes) in enumerate(layer.tp_comm):
        seconds = exposed = collective_seconds(kind, nbytes * scale, group)
        if beside and beside[index]:
            matmul = share * beside[index] * samples / rate
            exposed = exposed_seconds(seconds, matmul, devices.comm_overlap)
        times.append((phase, seconds, exposed))
    return times


def collectives_seconds(collectives: Iterable[tuple[str, str, float]],
                        group: Group) -> dict[str, float]:
    """Collectives ``(kind, phase, bytes of the whole tensor)`` over ``group``
    (:func:`partc.cost.collectives.collective_seconds`), summed by phase."""
    result = {"forward": 0.0, "backward": 0.0}
    for kind, phase, nbytes in collectives:
        result[phase] += collective_seconds(kind, nbytes, group)
    return result


def _p2p_link(problem: PlanningProblem, config: PipelineConfig, boundary: int) -> Group:
    """The link across ``boundary`` (run ``boundary`` to run ``boundary + 1``, on ranks
    ``boundary % pp`` and the next, wrapping to rank 0 when interleaved): the network if
    any pair of ranks crosses a node."""
    node = problem.devices.devices_per_node
    here = stage_ranks(problem, config, config.rank_of(boundary))
    there = stage_ranks(problem, config, config.rank_of(boundary + 1))
    crosses = any(a // node != b // node for a, b in zip(here, there))
    return Group.over(problem.devices, 2, 2 * node if crosses else 2)


def cut_table(problem: PlanningProblem, config: PipelineConfig) -> tuple[tuple[int, ...], ...]:
    """[cut l][boundary j]: the sends of cut ``l`` as the boundary ``j -> j + 1``, both
    ways; 0 where both runs are on one rank (the V schedules' turn), which passes the
    tensors on without a send."""
    # A sequence-sharded rank (context parallelism) sends its share of the tokens.
    scale = problem.train.measured_scale * config.micro_batch_size * config.tokens_share
    links = [None if config.rank_of(j) == config.rank_of(j + 1)
             else _p2p_link(problem, config, j) for j in range(config.virtual_stages - 1)]
    rows: dict[float, tuple[int, ...]] = {}   # equal cuts (between blocks) share a row
    for crossing in set(problem.model.cut_bytes):
        # Forward sends the activation, backward returns its gradient: twice the bytes.
        rows[crossing] = tuple(
            0 if link is None else to_ps(2 * collective_seconds("send", scale * crossing, link))
            for link in links)
    return tuple(rows[crossing] for crossing in problem.model.cut_bytes)


def cut_bytes(problem: PlanningProblem, config: PipelineConfig) -> tuple[int, ...]:
    """Bytes crossing each cut per microbatch, in the training dtype."""
    # A sequence-sharded rank (context parallelism) sends its share of the tokens.
    scale = problem.train.measured_scale * config.micro_batch_size * config.tokens_share
    return tuple(math.ceil(scale * crossing) for crossing in problem.model.cut_bytes)
