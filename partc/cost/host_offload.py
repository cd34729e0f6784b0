"""Offload's costs: what a rank keeps on the host instead of the device, what crosses
the host link each step, and the host's optimizer step, as the runtime runs them
(``partc/runtime/offload.py``; ``PipelineConfig.offload_optimizer`` and
``offload_params``).

Optimizer offload (ZeRO-Offload): the host holds, for the parameters the rank steps
(all of its own under ZeRO-0, 1/dp under ZeRO-1/2/3), the fp32 master, the fp32
gradient and the optimizer state; the device holds none of the state and makes no step
temporaries. Where the rank's gradients are accumulated in buckets that need no
collective (ZeRO-0 with one replica), the buckets themselves live on the host: every
microbatch's gradient is added into them as backward makes it (the device keeps no
gradient, and in mixed precision its weights only in the compute dtype, the master
being the host's). Elsewhere the reduced gradients stay where the collective leaves
them on the device and are copied out at the step. After the host's step the updated
weights are copied back (in the dtype the device holds them in).

Parameter offload (ZeRO-3 under FSDP2's CPU offload policy, which implies optimizer
offload): the parameter shards and their gradients live on the host too; each unit's
all-gather copies its shard in, forward and backward, and each microbatch's reduced
gradient shard is copied out; the step runs on the host's shards, with nothing to copy
back.

Copies run at the link's rate each way (``host_to_device_bandwidth``,
``device_to_host_bandwidth``). What the runtime overlaps, and so what is priced hidden:

- the gradients streamed out in backward (one replica: the host buckets) go on a copy
  stream beside the layer's backward, and the host adds each into its bucket as it
  lands (:func:`accumulate_seconds`); a microbatch's layer pays what the longer of the
  two takes beyond its backward, ``max(0, max(copy, add) - backward)``
  (:func:`streamed_exposed`), as activation offload's copies
  (:mod:`partc.cost.offload_time`);
- the step is pipelined in chunks of ``bucket_elements`` (``HostOptimizer``): the
  gradients out (where not streamed), the host's step and the weights back run as a
  three-stage pipeline, so the step's tail pays the busiest stage for every parameter
  (:func:`host_seconds`) and, once per step, the other stages of one chunk (the
  pipeline's fill, :func:`host_fill_seconds`, in ``CostTable.tail_latency_ps``).

Both only where the device copies on a stream of its own (``dispatch_ahead``: a GPU);
on a CPU the host is the device and every copy and the step run one after another,
priced whole (the copy and the add). What is not hidden: the host's step itself never
overlaps backward (it needs the whole step's gradients, their norm for clipping and the
check for non-finite values first), parameter offload's copies are
FSDP2's (its shards in for each all-gather, its gradient shards out) and stay priced
exposed in the layer's forward and backward, and so do a tied weight's streamed
gradients (:func:`microbatch_seconds`). The host's step runs at ``host_adam_rate``
parameter updates per second for the whole node, whose ranks step at once: a rank's
share is the rate over the node's ranks.
"""

from __future__ import annotations

from typing import Iterable

from partc.cost.offload_time import host_per_node
from partc.cost.pipeline_config import PipelineConfig
from partc.problem import DeviceNumbers, PlanningProblem


def streams_gradients(config: PipelineConfig) -> bool:
    """Whether the rank's gradient buckets live on the host (optimizer offload under
    ZeRO-0 with one replica: no collective needs them on the device)."""
    return config.offload_optimizer and not config.offload_params and config.dp == 1


def stepped_share(config: PipelineConfig) -> float:
    """The share of a rank's parameters it steps: 1/dp under ZeRO-1/2/3."""
    return 1.0 / config.dp if config.effective_zero_stage >= 1 else 1.0


def device_state(problem: PlanningProblem, config: PipelineConfig, params: float,
                 state: dict[str, float], gathered: bool = False) -> dict[str, float]:
    """``state`` (the device's weights, gradients and optimizer state as
    :func:`partc.cost.state_bytes.state_bytes` counts them without offload) with what
    offload moves to the host taken out (the module's doc)."""
    if not config.offload_optimizer:
        return state
    precision = problem.train.precision
    state = dict(state, optimizer=0.0)
    if config.offload_params:
        # FSDP's root keeps weights it gathers (tied ones) on the device through the step.
        state.update(params=params * precision.compute_bytes if gathered else 0.0,
                     grads=0.0)
    elif streams_gradients(config):
        state.update(params=params * precision.compute_bytes, grads=0.0)
    return state


def host_bytes_per_param(problem: PlanningProblem, config: PipelineConfig) -> float:
    """Host bytes per parameter a rank holds: for the share it steps, the fp32 master,
    the fp32 gradient and the optimizer state (0 without offload)."""
    if not config.offload_optimizer:
        return 0.0
    precision = problem.train.precision
    per_param = 2 * precision.master_bytes + precision.optimizer_state_bytes
    return stepped_share(config) * per_param


def host_checkpoint_bytes(problem: PlanningProblem, config: PipelineConfig,
                          params: float) -> int:
    """What a checkpoint writes of the host's part of ``params`` parameters (a rank's):
    for the share it steps, the fp32 master (the weight at its full precision) and the
    optimizer state, not the gradient (0 without offload)."""
    if not config.offload_optimizer:
        return 0
    precision = problem.train.precision
    per_param = precision.master_bytes + precision.optimizer_state_bytes
    return int(round(params * stepped_share(config) * per_param))


def host_bytes(problem: PlanningProblem, config: PipelineConfig, params: float) -> int:
    """Host bytes a rank's ``params`` parameters take (:func:`host_bytes_per_param`)."""
    return int(round(params * host_bytes_per_param(problem, config)))


def host_traffic(problem: PlanningProblem, config: PipelineConfig,
                 params: float) -> tuple[float, float]:
    """Bytes per step a rank moves for ``params`` parameters: (device to host, host to
    device)."""
    if not config.offload_optimizer:
        return 0.0, 0.0
    precision = problem.train.precision
    compute, master, m = precision.compute_bytes, precision.master_bytes, config.num_microbatches
    stepped = params * stepped_share(config)
    if config.offload_params:
        # Each microbatch: the shard in for forward's gather and backward's, its reduced
        # gradient shard out.
        return m * stepped * master, 2 * m * stepped * master
    if streams_gradients(config):
        # Each microbatch's gradients out as backward makes them; the weights back in the
        # compute dtype (the device's only copy).
        return m * params * compute, params * compute
    # The reduced fp32 gradients out at the step; back, the weights as the device holds
    # them (fp32, or ZeRO-1's device masters).
    return stepped * master, stepped * master


def _rates(problem: PlanningProblem) -> tuple[float, float]:
    """The link's rates: (device to host, host to device)."""
    devices = problem.devices
    return (devices.device_to_host_bandwidth or devices.host_to_device_bandwidth,
            devices.host_to_device_bandwidth)


def microbatch_seconds(problem: PlanningProblem, config: PipelineConfig,
                       params: float, backward_s: float | None = None) -> tuple[float, float]:
    """Seconds the copies of one microbatch add to the forward and the backward of a
    layer of ``params`` parameters (the module's doc): (forward, backward). The
    gradients streamed out during a ``backward_s`` backward pay only what they take
    beyond it (:func:`streamed_exposed`; without ``backward_s``, whole)."""
    if not config.offload_optimizer:
        return 0.0, 0.0
    out, back = _rates(problem)
    precision = problem.train.precision
    if config.offload_params:
        shard = params * stepped_share(config) * precision.master_bytes
        return shard / back, shard / back + shard / out
    if streams_gradients(config):
        copy = params * precision.compute_bytes / out
        return 0.0, streamed_exposed(problem, copy, accumulate_seconds(problem, params),
                                     backward_s)
    return 0.0, 0.0


# Bytes per parameter the host's fused AdamW step moves (fp32 parameter, its two
# moments read and written, the gradient read) against an add of a gradient into an
# fp32 bucket slot (the bucket read and written, the gradient read in the compute
# dtype): both bound by the host's memory, the add runs that much faster than the step
# ``host_adam_rate`` measures.
ADAM_BYTES = 28


def accumulate_seconds(problem: PlanningProblem, params: float) -> float:
    """The host's adds of one microbatch's gradients of ``params`` parameters into the
    host buckets, at the rank's share of the node's host rate (:data:`ADAM_BYTES`)."""
    devices = problem.devices
    added = 8 + problem.train.precision.compute_bytes
    rate = devices.host_adam_rate * ADAM_BYTES / added / ranks_per_node(problem)
    return params / rate


def streamed_exposed(problem: PlanningProblem, copy_s: float, add_s: float,
                     backward_s: float | None) -> float:
    """What gradients streamed beside a ``backward_s`` backward leave exposed, their
    copy taking ``copy_s`` and the host's adds ``add_s``: the longer one's excess on a
    device with a copy stream (the host adds while the device runs ahead), else both."""
    if backward_s is None or not problem.devices.dispatch_ahead:
        return copy_s + add_s
    return max(0.0, max(copy_s, add_s) - backward_s)


def ranks_per_node(problem: PlanningProblem) -> int:
    devices = problem.devices
    return min(devices.devices_per_node, devices.num_devices)


def host_stages(problem: PlanningProblem, config: PipelineConfig,
                params: float) -> tuple[float, float, float]:
    """The step's host work for a rank's ``params`` parameters, in seconds: the
    gradients out (none where they were streamed in backward, or with the parameters
    offloaded), its share of the node's host step, the weights back (none with the
    parameters offloaded: the step updates the host's shards)."""
    out_rate, back_rate = _rates(problem)
    precision = problem.train.precision
    stepped = params * stepped_share(config)
    step = stepped * ranks_per_node(problem) / problem.devices.host_adam_rate
    if config.offload_params:
        return 0.0, step, 0.0
    if streams_gradients(config):   # the weights back in the compute dtype
        return 0.0, step, params * precision.compute_bytes / back_rate
    return stepped * precision.master_bytes / out_rate, step, \
        stepped * precision.master_bytes / back_rate


def host_seconds(problem: PlanningProblem, config: PipelineConfig, params: float) -> float:
    """Seconds per step the offload of a rank's ``params`` parameters adds in the tail
    (the module's doc): the busiest of :func:`host_stages` where the device pipelines
    them (its fill is :func:`host_fill_seconds`, once per step), else their sum. 0
    without offload (the copies of each microbatch are :func:`microbatch_seconds`)."""
    if not config.offload_optimizer:
        return 0.0
    stages = host_stages(problem, config, params)
    return max(stages) if problem.devices.dispatch_ahead else sum(stages)


def host_fill_seconds(problem: PlanningProblem, config: PipelineConfig) -> float:
    """The pipelined step's fill, once per step: the stages other than the busiest of
    one chunk (``bucket_elements`` stepped parameters, or all a rank steps of the
    whole model where fewer). 0 where nothing is pipelined."""
    if not config.offload_optimizer or not problem.devices.dispatch_ahead:
        return 0.0
    share = stepped_share(config)
    whole = sum(layer.param_count for layer in problem.layers) * share
    chunk = min(float(problem.train.bucket_elements), whole) / share
    stages = host_stages(problem, config, chunk)
    return sum(stages) - max(stages)


def host_bytes_per_node(problem: PlanningProblem, config: PipelineConfig,
                        stage_params: Iterable[float]) -> int:
    """Host bytes a node's ranks take for optimizer and parameter offload, its busiest
    stage's rank's (``stage_params``: the parameters a rank of each stage holds) times
    the ranks of a node: every rank of a node may hold that stage (an upper bound where
    a node spans stages)."""
    worst = max((host_bytes(problem, config, params) for params in stage_params), default=0)
    return worst * ranks_per_node(problem)


def node_host_bytes(problem: PlanningProblem, config: PipelineConfig,
                    stage_params: Iterable[float], stage_activations: list[int]) -> int:
    """All a node's host holds, the plan's ``host_bytes_per_node``: optimizer and
    parameter offload's (:func:`host_bytes_per_node`) and the busiest node's offloaded
    activations (``stage_activations``: a rank's of each stage,
    :func:`partc.cost.offload_time.host_per_node`). The solve holds every node to the
    host's memory in the same terms (``partc/planner/stage_model.py``, constraint 10)."""
    return host_bytes_per_node(problem, config, stage_params) \
        + max(host_per_node(stage_activations, problem.devices), default=0)


def host_ready(devices: DeviceNumbers) -> str | None:
    """None where the budget knows the host figures offload needs, else what it lacks
    (the flags that give it)."""
    lacking = [flag for flag, value in (("--host-memory", devices.host_memory),
                                        ("--host-to-device-bandwidth",
                                         devices.host_to_device_bandwidth),
                                        ("--host-adam-rate", devices.host_adam_rate))
               if value is None]
    return None if not lacking else (
        f"offload needs the host's figures the budget lacks: {', '.join(lacking)} "
        f"(DeviceBudget fields host_memory, host_to_device_bandwidth, host_adam_rate)")
