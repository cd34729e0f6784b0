"""What a rank holds of its parameters, in bytes: weights, gradients and optimizer state
under ZeRO's sharding and in mixed precision, as the runtime keeps them
(:func:`state_bytes`, :func:`zero_state_bytes`), the optimizer step's temporaries
(:func:`step_bytes`), and what a ZeRO-2/3 unit holds beyond its shards while its backward
runs (:func:`zero_transient`)."""

from __future__ import annotations

from typing import Sequence

from partc.cost.host_offload import device_state
from partc.cost.pipeline_config import PipelineConfig
from partc.problem import ZERO_STAGES, PlanningProblem


def zero_state_bytes(params: float, weight_bytes: float, grad_bytes: float,
                     optimizer_bytes: float, dp: int, stage: int) -> dict[str, float]:
    """Per-device bytes of weights, gradients and optimizer state for ``params``
    parameters over ``dp`` data-parallel ranks under ZeRO ``stage``: 0 replicates all
    three, 1 shards the optimizer state, 2 the gradients too, 3 the weights too (ZeRO's
    (2 + 2 + K)·Ψ, 2Ψ + 2Ψ + KΨ/N, 2Ψ + (2 + K)Ψ/N and (2 + 2 + K)Ψ/N for fp16 Adam)."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {stage!r}")
    if dp < 1:
        raise ValueError(f"dp must be positive, got {dp}")
    return {
        "params": params * weight_bytes / (dp if stage >= 3 else 1),
        "grads": params * grad_bytes / (dp if stage >= 2 else 1),
        "optimizer": params * optimizer_bytes / (dp if stage >= 1 else 1),
    }


def state_bytes(problem: PlanningProblem, config: PipelineConfig, params: int,
                gathered: bool = False) -> dict[str, int]:
    """What the runtime holds (see :class:`partc.problem.Precision`): ZeRO's sharding,
    except that under ZeRO-2 FSDP keeps each rank's fp32 shard beside the gathered
    weights (``gathered``: weights the root unit keeps gathered through the step, such as
    tied ones, likewise under ZeRO-3), and in mixed precision the compute-dtype weights
    beside the fp32 master: under ZeRO-0 a copy made once per step beside the whole
    master, under ZeRO-1 the weights kept in the compute dtype and 1/dp of the master
    (Megatron's distributed optimizer). ZeRO-2 reducing once per step
    (:attr:`PipelineConfig.reduces_once`) holds the whole fp32 gradient the microbatches
    accumulate into until the last one's reduce-scatter; its sharded output replaces the
    whole gradient unit by unit. Offload takes what lives on the host out
    (:func:`partc.cost.host_offload.device_state`)."""
    precision = problem.train.precision
    master = precision.master_bytes
    zero = config.effective_zero_stage
    state = zero_state_bytes(params, master, master, precision.optimizer_state_bytes,
                             dp=config.dp, stage=zero)
    if zero == 2 or zero == 3 and gathered:
        state["params"] = params * (precision.compute_bytes + master / config.dp)
    elif zero == 1 and precision.mixed:
        state["params"] = params * (precision.compute_bytes + master / config.dp)
    elif zero == 0 and precision.mixed:
        state["params"] = params * (master + precision.compute_bytes)
    if config.reduces_once:
        state["grads"] = params * master
    state = device_state(problem, config, params, state, gathered)
    return {kind: int(round(nbytes)) for kind, nbytes in state.items()}


def steps_whole_list(problem: PlanningProblem, config: PipelineConfig) -> bool:
    """Whether torch's optimizer step (as the runtime builds it, with torch's defaults)
    makes its temporaries for all of a rank's weights at once: its foreach form, torch's
    default for weights on a GPU; on a CPU it steps one tensor at a time, except that
    ZeRO-1's distributed optimizer (``partc/runtime/optimizer.py``) steps flat shards of
    its buckets, each up to the rank's whole shard, counted whole here."""
    return problem.devices.dispatch_ahead or config.effective_zero_stage == 1


def step_total(steps: Sequence[int], sums: bool) -> int:
    """The optimizer step's temporaries of a rank whose rows make ``steps`` each: their
    sum, or with ``sums`` false (one tensor at a time) the largest."""
    return sum(steps) if sums else max(steps, default=0)


def step_bytes(problem: PlanningProblem, config: PipelineConfig, params: int,
               largest: int) -> int:
    """The fp32 temporaries the optimizer step makes beside the state, for ``params``
    parameters whose largest tensor has ``largest`` elements: ``step_copies`` copies of
    what it steps over the whole list in torch's foreach form (:func:`steps_whole_list`:
    a rank's rows add up), twice as many of its largest tensor one at a time (the rank's
    largest row counts). It steps the fp32 masters, sharded over dp under ZeRO-1/2/3.
    The activations are gone by then, so this meets only the state at the step's peak:
    a plan of small activations (full recompute, microbatches of one) beside many
    weights peaks in the step (a tied 16384 x 128 embedding on CPU: 16.8 MB)."""
    precision = problem.train.precision
    if not precision.step_copies or config.offload_optimizer:   # offload: the host's
        return 0
    shard = config.dp if config.effective_zero_stage >= 1 else 1
    if steps_whole_list(problem, config):
        elements, copies = params / shard, precision.step_copies
    else:
        elements, copies = largest / shard, 2 * precision.step_copies
    return int(round(copies * precision.master_bytes * elements))


def zero_transient(problem: PlanningProblem, config: PipelineConfig,
                   params: int) -> tuple[int, int]:
    """Bytes a ZeRO-2/3 unit of ``params`` parameters holds beyond its shards in its
    backward, as FSDP2 runs it: (held throughout, held as the backward ends).

    Throughout, under ZeRO-3, its gathered parameters and the next unit's, whose
    all-gather FSDP issues ahead (taken as the same size); ZeRO-2 gathered every weight
    for the step (state). As it ends, its whole gradient (compute dtype) and the fp32
    reduce-scatter input FSDP copies it into before freeing it."""
    zero = config.effective_zero_stage
    if zero < 2:
        return 0, 0
    precision = problem.train.precision
    compute, master = precision.compute_bytes, precision.master_bytes
    gathered = 2 * params * compute if zero == 3 else 0
    return int(round(gathered)), int(round(params * (compute + master)))
