"""The two parts of a layer's row in the cost tables (:mod:`partc.cost.tables`), each
priced once for every configuration that shares it: its compute with its tensor- and
context-parallel traffic (:func:`compute_part`: the same whatever dp, pp, ZeRO stage or
offload), and its parameters' state and collectives (:func:`param_part`: the same for
every layer of equal parameter counts under one layout of the replicas, whatever the
schedule). A search over thousands of configurations of an 80-block model builds rows for
every (micro-batch size, tp, dp, ZeRO stage, schedule kind, cp, offload) family; their
parts repeat across families. The caller owns the dict they are kept in (a
:class:`~partc.cost.tables.TableCache`'s)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from partc.cost.communication import (gather_ps, keeps_buckets, sync_ps, tail_ps,
                                      tp_comm_seconds, zero_comm_seconds,
                                      zero_overhead_seconds)
from partc.cost.cp_attention import cp_seconds, cp_transient_bytes
from partc.cost.fp8_pricing import fp8_workspace_bytes, pricing
from partc.cost.layer_compute import layer_work, run_layer
from partc.cost.pipeline_config import PipelineConfig, grad_config, split_factor, to_ps
from partc.cost.schedules import runs_compiled, schedule as schedule_info
from partc.cost.state_bytes import state_bytes, step_bytes, zero_transient
from partc.problem import PlanningProblem


def moved_bytes(layer, samples: float, saved: dict[str, int]) -> int:
    """What offloading ``layer`` moves per microbatch of ``samples`` (scaled) samples:
    its ops' saved storages as measured, else its saved bytes."""
    if layer.offload_bytes is None:
        return saved["none"]
    return int(round(samples * layer.offload_bytes))



@dataclass(frozen=True, kw_only=True)
class ComputePart:
    """What a layer's row takes from its compute and its tensor-parallel and
    context-parallel traffic: the same for every dp, pp, ZeRO stage and offload."""

    layer: Any
    forward_s: float         # compute and tp collectives, before ZeRO and cp's
    backward_s: float
    context: dict[str, float]   # cp_seconds
    recompute_ps: dict[str, int]
    saved: dict[str, int]
    workspace: int
    moved: int


@dataclass(frozen=True, kw_only=True)
class ParamPart:
    """What a layer's row takes from its parameters: the same for every layer of equal
    parameter counts under one layout of the replicas (dp, pp, ZeRO stage, offload,
    microbatches), whatever the schedule or the layer's compute."""

    zero: dict[str, float]   # zero_comm_seconds
    own: dict[str, float]    # zero_overhead_seconds
    transient: tuple[int, int]    # zero_transient
    state_bytes: dict[str, int]
    tail_ps: int
    sync_ps: int
    gather_ps: int
    step_bytes: int


def compute_part(problem: PlanningProblem, config: PipelineConfig, index: int,
                  parts: dict) -> ComputePart:
    """Layer ``index``'s :class:`ComputePart`, kept in ``parts`` under every field of
    ``config`` it reads (micro-batch size, tp, cp and its kind, whether the schedule
    splits backward) and the tensor-parallel variant (``problem.model``)."""
    split = schedule_info(config.schedule).split_backward
    key = ("compute", id(problem.model), index, config.micro_batch_size, config.tp,
           config.cp, config.cp_kind, split)
    known = parts.get(key)
    if known is not None and known[0] is problem.model:
        return known[1]
    layer = run_layer(problem, index, config.micro_batch_size)
    devices, train = problem.devices, problem.train
    # A context-parallel rank runs its share of each sequence: per-token work and
    # activations scale with it (partc.cost.cp_attention); the parameters are the
    # dp x cp group's (grad_config).
    b, scale = config.micro_batch_size * config.tokens_share, train.measured_scale
    fp8 = pricing(problem, config.tp)
    work = layer_work(layer, devices, b, scale, runs_compiled(config.schedule, train.compiled),
                      fp8)
    saved = {m: int(round(b * scale * v)) for m, v in layer.saved_bytes.items()}
    # FP8 linears hold their operands' FP8 copies and scales while they run.
    workspace = int(round(2 * b * scale * layer.workspace_bytes
                          + fp8_workspace_bytes(layer, fp8, devices, b, scale))) \
        + cp_transient_bytes(problem, config, layer)
    comm = tp_comm_seconds(problem, config, layer)
    context = cp_seconds(problem, config, layer)
    # Full recompute replays the layer's forward, collectives included; selective
    # replays the attention cores, which hold no tensor-parallel one (heads are split
    # over the group) but, under context parallelism, their exchange of the sequence.
    # ZeRO-3 gathers the layer once for its backward, recompute included.
    rerun = {m: (comm["forward"] if m == "full" else 0.0)
             + (context["forward"] if m != "none" else 0.0) for m in layer.modes}
    part = ComputePart(
        layer=layer,
        # layer_phases' sums, in its order, up to the ZeRO and cp terms.
        forward_s=sum(work["forward"]) + comm["forward"],
        backward_s=split_factor(problem, config) * sum(work["backward"]) + comm["backward"],
        context=context,
        recompute_ps={m: to_ps(sum(work["recompute"][m]) + rerun[m]) for m in layer.modes},
        saved=saved, workspace=workspace, moved=moved_bytes(layer, b * scale, saved))
    parts[key] = (problem.model, part)
    return part


def param_part(problem: PlanningProblem, config: PipelineConfig, layer: Any,
                parts: dict) -> ParamPart:
    """The :class:`ParamPart` of ``layer``'s parameters, kept in ``parts`` under every
    field of ``config`` it reads, as the parameters see it (:func:`grad_config`: over
    dp x cp replicas) and as the microbatches' copies do, the layer's parameter counts
    and the tensor-parallel variant (whose parameters FSDP's units are sized against)."""
    count, tensors = layer.param_count, layer.param_tensors
    params = grad_config(config)   # the parameters' replicas: dp x cp
    # The microbatches count by number only where the host copies each one, or autograd
    # accumulates into .grad; elsewhere as one or several (keeps_buckets, reduces_once).
    microbatches = config.num_microbatches
    if not config.offload_optimizer and keeps_buckets(problem, params):
        microbatches = min(microbatches, 2)
    key = ("params", id(problem.model), params.dp, config.dp, config.tp, config.pp,
           config.ep, microbatches, config.zero_stage, config.zero2_grad_sync,
           config.offload_optimizer, config.offload_params, count, tensors,
           layer.largest_param)
    known = parts.get(key)
    if known is not None and known[0] is problem.model:
        return known[1]
    part = ParamPart(
        zero=zero_comm_seconds(problem, params, count),
        own=zero_overhead_seconds(problem, params, count, tensors),
        transient=zero_transient(problem, params, count),
        state_bytes=state_bytes(problem, params, count),
        tail_ps=tail_ps(problem, params, count, max(1, tensors)),
        sync_ps=sync_ps(problem, params, count),
        gather_ps=gather_ps(problem, params, count),
        step_bytes=step_bytes(problem, params, count, layer.largest_param))
    parts[key] = (problem.model, part)
    return part
