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

Every copy is priced exposed at the link's rate each way (``host_to_device_bandwidth``,
``device_to_host_bandwidth``): the runtime does not overlap them with compute. Those
made every microbatch (gradients streamed out in backward; parameter shards in for
forward and backward, gradient shards out) add to the layer's forward and backward
(:func:`microbatch_seconds`); those made once per step (the reduced gradients out, the
weights back) and the host's step are the step's tail (:func:`host_seconds`). The host's step runs at ``host_adam_rate`` parameter updates
per second for the whole node, whose ranks step at once: a rank's share is the rate over
the node's ranks.
"""

from __future__ import annotations

from typing import Iterable

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


def host_bytes(problem: PlanningProblem, config: PipelineConfig, params: float) -> int:
    """Host bytes a rank's ``params`` parameters take: for those it steps, the fp32
    master, the fp32 gradient and the optimizer state (0 without offload)."""
    if not config.offload_optimizer:
        return 0
    precision = problem.train.precision
    per_param = 2 * precision.master_bytes + precision.optimizer_state_bytes
    return int(round(params * stepped_share(config) * per_param))


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
                       params: float) -> tuple[float, float]:
    """Seconds the copies of one microbatch add to the forward and the backward of a
    layer of ``params`` parameters (the module's doc): (forward, backward)."""
    if not config.offload_optimizer:
        return 0.0, 0.0
    out, back = _rates(problem)
    precision = problem.train.precision
    if config.offload_params:
        shard = params * stepped_share(config) * precision.master_bytes
        return shard / back, shard / back + shard / out
    if streams_gradients(config):
        return 0.0, params * precision.compute_bytes / out
    return 0.0, 0.0


def ranks_per_node(problem: PlanningProblem) -> int:
    devices = problem.devices
    return min(devices.devices_per_node, devices.num_devices)


def host_seconds(problem: PlanningProblem, config: PipelineConfig, params: float) -> float:
    """Seconds per step the offload of a rank's ``params`` parameters adds in the tail:
    the copies made once per step, each way at the link's rate, and its share of the
    node's host step (the module's doc; the copies of each microbatch are
    :func:`microbatch_seconds`). 0 without offload."""
    if not config.offload_optimizer:
        return 0.0
    out_rate, back_rate = _rates(problem)
    precision = problem.train.precision
    stepped = params * stepped_share(config)
    if config.offload_params:
        per_step = 0.0   # every copy is a microbatch's
    elif streams_gradients(config):
        per_step = params * precision.compute_bytes / back_rate   # the weights back
    else:
        per_step = stepped * precision.master_bytes * (1 / out_rate + 1 / back_rate)
    step = stepped * ranks_per_node(problem) / problem.devices.host_adam_rate
    return per_step + step


def host_bytes_per_node(problem: PlanningProblem, config: PipelineConfig,
                        stage_params: Iterable[float]) -> int:
    """Host bytes a node's ranks take, its busiest stage's rank's (``stage_params``: the
    parameters a rank of each stage holds) times the ranks of a node: every rank of a
    node may hold that stage (an upper bound where a node spans stages)."""
    worst = max((host_bytes(problem, config, params) for params in stage_params), default=0)
    return worst * ranks_per_node(problem)


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
