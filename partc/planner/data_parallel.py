"""What the plan records of its data-parallel traffic: per stage, each kind of collective a
rank runs over its gradient group (the dp x cp ranks holding the same parameters) in one step, its bytes and time, and how much of that time the
cost model assumes hidden behind compute (:class:`partc.plan.DataParallelPlan`).

The figures are the cost model's own (:mod:`partc.cost.communication`), split out of the
stage times that hold them, so that the report can show what a step's time and its MFU
assume:

- ZeRO-2/3: each layer's collectives run beside its forward or backward, every
  microbatch; what the layer's phase does not hide of them
  (:func:`partc.cost.pipeline_config.overlapped`) is in the stage's forward and backward.
  ZeRO-2's gather of the stepped weights (and a tied weight's collectives) is in the tail,
  exposed whole; ZeRO-2 reducing once per step reduce-scatters beside the last backward;
- ZeRO-0/1: the gradient buckets' reduction beside each virtual stage's last backward and
  the rank's backwards after it, the last bucket's after them
  (:func:`partc.cost.evaluate.exposed_sync_ps`); ZeRO-1's gather of the stepped weights
  beside the next forwards (:func:`partc.cost.evaluate.exposed_gather_ps`) or after the
  optimizer step.
"""

from __future__ import annotations

from dataclasses import replace

from partc.cost.communication import (bucket_latency_seconds, first_gather_ps, gather_ps,
                                      last_sync_ps, stepped_gather_seconds, sync_ps,
                                      zero_comm_seconds)
from partc.cost.evaluate import Evaluation, exposed_gather_ps, exposed_sync_ps, stage_windows
from partc.cost.experts_cost import expert_dp_config, moe_layer_figures
from partc.cost.pipeline_config import (PS_PER_S, PipelineConfig, grad_config, overlapped,
                                        permille)
from partc.cost.tables import layer_phases, moe_layer_phases
from partc.cost.timeline import Windows
from partc.plan import DataParallelPlan, DPCollective
from partc.problem import PlanningProblem


def data_parallel_section(problem: PlanningProblem, config: PipelineConfig,
                          evaluation: Evaluation) -> DataParallelPlan | None:
    """The plan's ``data_parallel`` for ``config`` and its evaluation; None with one
    replica."""
    if config.grad_dp == 1:
        return None
    local = problem.variant(config.tp, config.sequence_parallel, config.tp_objective)
    # The collectives run over the dp x cp ranks holding the same parameters (grad_config);
    # the layers' phases they hide behind are the configuration's own.
    grads = replace(grad_config(config), zero_stage=config.effective_zero_stage)
    stages = tuple(_stage(problem, local, grads, stage, config, stage_windows(config, index))
                   for index, stage in enumerate(evaluation.stages))
    return DataParallelPlan(dp=config.dp, cp=config.cp,
                            zero_stage=config.effective_zero_stage,
                            overlap=local.devices.comm_overlap, stages=stages)


def _stage(whole: PlanningProblem, local: PlanningProblem, config: PipelineConfig,
           stage, as_run: PipelineConfig, windows: Windows) -> tuple[DPCollective, ...]:
    """Stage ``stage``'s rows: ``config`` the gradients' (dp x cp replicas), ``as_run``
    the plan's configuration."""
    layers = set(stage.layers)
    params = [_params(whole, local, config, l) for l in stage.layers]
    groups = [g for g in local.model.shared if layers & set(g.layers)]
    if as_run.effective_zero_stage >= 2:
        rows = _sharded(whole, local, config, stage, groups, as_run, windows)
    else:
        rows = _replicated(whole, local, config, stage, params, groups, windows)
    return tuple(row for row in rows if row.seconds > 0 or row.nbytes > 0)


def _params(whole: PlanningProblem, local: PlanningProblem, config: PipelineConfig,
            index: int) -> int:
    """The parameters of layer ``index`` a rank holds (its experts' share under ep)."""
    moe = whole.layers[index].moe
    if config.ep > 1 and moe is not None:
        figures = moe_layer_figures(moe, local.layers[index], local, config)
        return figures.dense_params + figures.expert_params
    return local.layers[index].param_count


def _split(whole: PlanningProblem, local: PlanningProblem, config: PipelineConfig,
           index: int) -> list[tuple[PipelineConfig, int]]:
    """Layer ``index``'s parameters by the group they are reduced over: the dense ones
    over dp, a mixture-of-experts layer's routed experts under ep over their
    expert-data-parallel group (as :func:`partc.cost.tables.moe_layer_table` prices them)."""
    moe = whole.layers[index].moe
    if config.ep > 1 and moe is not None:
        figures = moe_layer_figures(moe, local.layers[index], local, config)
        return [(config, figures.dense_params),
                (expert_dp_config(config), figures.expert_params)]
    return [(config, local.layers[index].param_count)]


def _sync_ps(whole: PlanningProblem, local: PlanningProblem, config: PipelineConfig,
             index: int) -> int:
    return sum(sync_ps(local, c, p) for c, p in _split(whole, local, config, index))


def _gather_ps(whole: PlanningProblem, local: PlanningProblem, config: PipelineConfig,
               index: int) -> int:
    return sum(gather_ps(local, c, p) for c, p in _split(whole, local, config, index))


def _row(kind: str, when: str, nbytes: float, seconds: float, exposed: float) -> DPCollective:
    return DPCollective(kind=kind, when=when, nbytes=int(round(nbytes)), seconds=seconds,
                        exposed_s=min(seconds, max(0.0, exposed)))


def _sharded(whole: PlanningProblem, local: PlanningProblem, config: PipelineConfig,
             stage, groups, as_run: PipelineConfig, windows: Windows) -> list[DPCollective]:
    """ZeRO-2/3: per layer and microbatch, the phases' collectives and what the phase
    leaves exposed of them; ZeRO-2's weight gather once per step; tied weights' whole."""
    precision, m = local.train.precision, config.num_microbatches
    overlap = local.devices.comm_overlap
    zero3 = config.effective_zero_stage == 3
    totals = {key: [0.0, 0.0, 0.0] for key in ("gather forward", "gather backward",
                                               "scatter backward", "scatter sync",
                                               "gather step")}

    def add(key: str, nbytes: float, seconds: float, exposed: float) -> None:
        totals[key][0] += nbytes
        totals[key][1] += seconds
        totals[key][2] += exposed

    for index in stage.layers:
        moe = whole.layers[index].moe
        phases = (moe_layer_phases(moe, local, as_run, index)
                  if config.ep > 1 and moe is not None else layer_phases(local, as_run, index))
        zero = phases.zero
        params = _params(whole, local, config, index)
        gathered, scattered = params * precision.compute_bytes, params * precision.master_bytes
        exposed = {phase: overlapped(seconds, zero[phase], overlap) - seconds
                   for phase, seconds in (("forward", phases.forward_s),
                                          ("backward", phases.backward_s))}
        if zero3:
            gather = zero["forward"]
            share = gather / zero["backward"] if zero["backward"] else 0.0
            add("gather forward", m * gathered, m * gather, m * exposed["forward"])
            add("gather backward", m * gathered, m * gather, m * share * exposed["backward"])
            add("scatter backward", m * scattered, m * (zero["backward"] - gather),
                m * (1 - share) * exposed["backward"])
        elif config.reduces_once:
            add("scatter sync", scattered, zero["sync"], 0.0)
            add("gather step", gathered, zero["step"], zero["step"])
        else:
            add("scatter backward", m * scattered, m * zero["backward"],
                m * exposed["backward"])
            add("gather step", gathered, zero["step"], zero["step"])
    if config.reduces_once:
        # Beside the last backward, as the stage's tail prices it.
        synced = sum(_sync_ps(whole, local, config, l) for l in stage.layers)
        totals["scatter sync"][2] = exposed_sync_ps(
            synced, stage.backward_ps, permille(overlap), windows=windows.sync) / PS_PER_S
    for group in groups:   # the root unit's: every microbatch's, exposed (shared_tail_ps)
        zero = zero_comm_seconds(local, config, group.param_count)
        gathered = group.param_count * precision.compute_bytes
        scattered = group.param_count * precision.master_bytes
        each = m * (zero["forward"] + zero["backward"]) + zero["sync"]
        if zero3:
            gather = m * zero["forward"]
            add("gather forward", m * gathered, gather, gather)
            add("gather backward", m * gathered, gather, gather)
            add("scatter backward", m * scattered, each - 2 * gather, each - 2 * gather)
        else:
            add("scatter sync" if config.reduces_once else "scatter backward",
                scattered if config.reduces_once else m * scattered, each, each)
            add("gather step", gathered, zero["step"], zero["step"])
    names = {"gather forward": ("all_gather", "forward"),
             "gather backward": ("all_gather", "backward"),
             "scatter backward": ("reduce_scatter", "backward"),
             "scatter sync": ("reduce_scatter", "last backward"),
             "gather step": ("all_gather", "step")}
    return [_row(*names[key], *totals[key]) for key in names]


def _replicated(whole: PlanningProblem, local: PlanningProblem, config: PipelineConfig,
                stage, params: list[int], groups, windows: Windows) -> list[DPCollective]:
    """ZeRO-0/1: the gradient buckets' reduction and ZeRO-1's gather of the stepped
    weights, exposed as the stage's tail and the step's latencies price them."""
    precision = local.train.precision
    overlap = permille(local.devices.comm_overlap)
    everything = params + [g.param_count for g in groups]
    total = sum(everything)
    synced = sum(_sync_ps(whole, local, config, l) for l in stage.layers) + sum(
        sync_ps(local, config, g.param_count) for g in groups)
    last = last_sync_ps(whole, local, config)
    kind = "reduce_scatter" if config.effective_zero_stage == 1 else "all_reduce"
    rows = [_row(kind, "last backward", total * precision.master_bytes, synced / PS_PER_S,
                 (exposed_sync_ps(synced, stage.backward_ps, overlap, last, windows.sync)
                  + last)
                 / PS_PER_S)]
    if config.effective_zero_stage != 1:
        return rows
    gathered = total * precision.compute_bytes
    overlapping = sum(_gather_ps(whole, local, config, l) for l in stage.layers) + sum(
        gather_ps(local, config, g.param_count) for g in groups)
    if overlapping:
        first = first_gather_ps(local, config)
        exposed = exposed_gather_ps(overlapping, stage.forward_ps, first, overlap,
                                    windows.gather) + first
        rows.append(_row("all_gather", "next forward", gathered, overlapping / PS_PER_S,
                         exposed / PS_PER_S))
    else:
        seconds = (sum(stepped_gather_seconds(local, config, p) for p in everything)
                   + bucket_latency_seconds(local, config))
        rows.append(_row("all_gather", "step", gathered, seconds, seconds))
    return rows
