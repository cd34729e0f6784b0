"""From an evaluated assignment to a Plan: stage summaries and predicted figures."""

from __future__ import annotations

from typing import TYPE_CHECKING

from partc.codec import dtype_named
from partc.cost.communication import tp_collective_times
from partc.cost.evaluate import Evaluation, simulated_step_ps
from partc.cost.fp8_pricing import fp8_names, pricing
from partc.cost.host_offload import host_checkpoint_bytes, node_host_bytes
from partc.cost.layer_compute import run_layer
from partc.cost.pipeline_config import PS_PER_S, PipelineConfig
from partc.names import CpKind, Phase, Recompute, Schedule
from partc.plan import (Alternative, BudgetInfo, Fp8Plan, InputSpec, Mesh, MeshOutcome, ModelInfo,
                        P2PMessages, Plan, Predicted, RunTime, SolverStats, StagePlan, StageTime,
                        TensorParallelPlan, TPCollective)
from partc.planner.data_parallel import data_parallel_section
from partc.planner.expert_parallel import expert_parallel_section
from partc.problem import ZERO2_GRAD_SYNCS, PlanningProblem, effective_zero_stage
from partc.spec import TrainSpec

if TYPE_CHECKING:     # the planner needs OR-Tools; assembling a plan does not
    from partc.planner import MeshResult


def model_flops_per_step(problem: PlanningProblem) -> float:
    """Forward + backward FLOPs of one step without recompute (what MFU counts), a
    fused attention kernel's recompute in backward left out too."""
    per_sample = sum(layer.fwd_flops + layer.bwd_flops - layer.bwd_extra_flops
                     for layer in problem.layers)
    return per_sample * problem.train.global_batch_size


def unread_params(problem: PlanningProblem) -> int:
    """The model's parameters that no layer holds: its count less its layers' own and
    the tied groups' (each once); the forward never reads them on the traced inputs."""
    model = problem.model
    held = sum(layer.param_count for layer in model.layers) + sum(
        group.param_count for group in model.shared)
    return max(0, model.summary.num_params - held)


def predicted(problem: PlanningProblem, config: PipelineConfig,
              evaluation: Evaluation) -> Predicted:
    # The schedule played out (partc.cost.evaluate.simulated_step_ps), not the planner's
    # closed form.
    step_ps, bubble = simulated_step_ps(config, evaluation)
    step = step_ps / PS_PER_S
    pipeline_ps = step_ps - evaluation.tail_ps - evaluation.tie_ps
    batch = problem.train.global_batch_size
    devices = problem.devices
    samples_per_s = batch / step if step else 0.0
    tokens = problem.model.summary.tokens_per_sample
    return Predicted(
        step_time_s=step,
        samples_per_s=samples_per_s,
        mfu=model_flops_per_step(problem) / (step * devices.num_devices * devices.peak_flops)
        if step else 0.0,
        bubble_fraction=bubble,
        peak_memory_bytes=max(s.memory.peak for s in evaluation.stages),
        pipeline_time_s=pipeline_ps / PS_PER_S,
        closed_form_step_s=evaluation.step_ps / PS_PER_S,
        bottleneck_s=max(s.busy_ps for s in evaluation.stages) / PS_PER_S,
        tail_time_s=(evaluation.tail_ps + evaluation.tie_ps) / PS_PER_S,
        tokens_per_s=samples_per_s * tokens if tokens else None,
    )


def stage_plans(problem: PlanningProblem, config: PipelineConfig, evaluation: Evaluation,
                modes: tuple[str, ...]) -> tuple[StagePlan, ...]:
    m = config.num_microbatches
    names = [layer.name for layer in problem.layers]
    return tuple(
        StagePlan(
            index=index,
            layers=tuple(names[l] for l in stage.layers),
            recompute={names[l]: Recompute(modes[l]) for l in stage.layers},
            param_count=stage.param_count,
            memory_bytes=stage.memory,
            limit_bytes=stage.limit,
            time_s=StageTime(forward=m * stage.forward_ps / PS_PER_S,
                             backward=m * stage.backward_ps / PS_PER_S,
                             recompute=m * stage.recompute_ps / PS_PER_S,
                             comm=m * stage.comm_ps / PS_PER_S,
                             tail=stage.tail_ps / PS_PER_S),
            p2p=p2p_messages(problem, evaluation, index, m, config),
            runs=tuple(tuple(names[l] for l in run) for run in stage.runs),
            # evaluate.simulate plays each run's send and receive as half of the cut's
            # two-way figure.
            run_times=tuple(RunTime(forward=f / PS_PER_S, backward=b / PS_PER_S,
                                    recompute=r / PS_PER_S, send=cut / 2 / PS_PER_S,
                                    receive=into / 2 / PS_PER_S,
                                    send_delay=(whole_out - cut) / 2 / PS_PER_S,
                                    receive_delay=(whole_in - into) / 2 / PS_PER_S)
                            for (f, b, r, cut, into), (whole_out, whole_in)
                            in zip(stage.run_ps, stage.run_cut_ps)),
            host_traffic_bytes=m * stage.offload_bytes,
            host_checkpoint_bytes=host_checkpoint_bytes(problem, config, stage.param_count),
            run_host_s=tuple(h / PS_PER_S for h in stage.run_host_ps)
            if any(stage.run_host_ps) else (),
        )
        for index, stage in enumerate(evaluation.stages)
    )


def p2p_messages(problem: PlanningProblem, evaluation: Evaluation, index: int,
                 num_microbatches: int, config: PipelineConfig) -> P2PMessages | None:
    """Sends and receives per step on stage ``index``: each tensor crossing a boundary is
    one message forward and, when it depends on a parameter, one gradient message back;
    under cp, attention masks made from shapes are not sent (the lowering erases them:
    each rank's attention makes its own mask from its positions)."""
    counts = problem.model.cut_tensors
    if not counts:
        return None
    stages, pp = evaluation.stages, len(evaluation.stages)
    chunks = len(stages[0].runs) or 1
    runs = [stages[config.rank_of(j)].runs[config.runs_of(config.rank_of(j)).index(j)]
            if chunks > 1 else stages[j].layers for j in range(pp * chunks)]

    def boundary(after_run: int) -> tuple[int, int]:
        if after_run < 0 or after_run >= len(runs) - 1:
            return (0, 0)
        tensors, with_grad, masks = counts[runs[after_run][-1]]
        return (tensors - masks if config.cp > 1 else tensors, with_grad)

    sends = recvs = 0
    for run in config.runs_of(index):   # each of the stage's runs
        incoming, outgoing = boundary(run - 1), boundary(run)
        sends += outgoing[0] + incoming[1]
        recvs += incoming[0] + outgoing[1]
    return P2PMessages(sends=num_microbatches * sends, recvs=num_microbatches * recvs)


def make_plan(problem: PlanningProblem, config: PipelineConfig, evaluation: Evaluation,
              modes: tuple[str, ...], solver: SolverStats, *, budget: BudgetInfo,
              train: TrainSpec, alternatives: tuple[Alternative, ...] = (),
              meshes: tuple[MeshResult, ...] = ()) -> Plan:
    summary = problem.model.summary
    local = problem.variant(config.tp, config.sequence_parallel, config.tp_objective)
    return Plan(
        mesh=Mesh(pp=config.pp, dp=config.dp, tp=config.tp, ep=config.ep, cp=config.cp,
                  cp_kind=None if config.cp_kind is None else CpKind(config.cp_kind)),
        schedule=Schedule(config.schedule),
        num_microbatches=config.num_microbatches,
        micro_batch_size=config.micro_batch_size,
        # What runs: no ZeRO without replicas to shard over, no once-per-step sync but
        # ZeRO-2's (a pin of either holds for every mesh the search tries).
        zero_stage=effective_zero_stage(config.zero_stage, config.grad_dp),
        zero2_grad_sync=(config.zero2_grad_sync
                         if effective_zero_stage(config.zero_stage, config.grad_dp) == 2
                         else ZERO2_GRAD_SYNCS[0]),
        stages=stage_plans(local, config, evaluation, modes),
        predicted=predicted(problem, config, evaluation),
        solver=solver,
        budget=budget,
        train=train,
        model=ModelInfo(name=summary.name, num_params=summary.num_params, hash=summary.hash,
                        tracer=summary.tracer, num_layers=problem.num_layers,
                        traced_batch_size=summary.traced_batch_size,
                        inputs=tuple(InputSpec(name=name, shape=tuple(shape),
                                               dtype=dtype_named(dtype),
                                               keyword=name in summary.keywords)
                                     for name, shape, dtype in summary.inputs),
                        own_loss=summary.own_loss or None,
                        shift_labels=summary.shift_labels,
                        left_out=summary.left_out,
                        pads_at_end=summary.pads_at_end,
                        counted_target=summary.counted_target,
                        unread_params=unread_params(problem)),
        tensor_parallel=tensor_parallel_section(problem, config),
        alternatives=alternatives,
        meshes=tuple(mesh_summary(mesh) for mesh in meshes),
        expert_parallel=_expert_parallel(problem, config, evaluation, modes),
        module_list_experts=problem.module_list_experts,
        data_parallel=data_parallel_section(problem, config, evaluation),
        offload_optimizer=config.offload_optimizer,
        offload_params=config.offload_params,
        host_bytes_per_node=node_host_bytes(
            local, config, [stage.param_count for stage in evaluation.stages],
            [stage.memory.host for stage in evaluation.stages]),
        fp8=fp8_section(problem, config),
    )


def fp8_section(problem: PlanningProblem, config: PipelineConfig) -> Fp8Plan | None:
    """The plan's ``fp8``: the linears the configuration's cost tables priced in FP8
    (:mod:`partc.cost.fp8_pricing`), in model order; None with ``TrainSpec.fp8`` off."""
    if problem.train.fp8 is None:
        return None
    local = problem.variant(config.tp, config.sequence_parallel, config.tp_objective)
    price = pricing(local, config.tp)
    b, scale = config.micro_batch_size, local.train.measured_scale
    linears = tuple(name for index, layer in enumerate(local.layers)
                    # Mixture-of-experts layers under expert parallelism are priced
                    # without FP8 (partc.cost.tables.moe_layer_table).
                    if layer.moe is None or config.ep == 1
                    for name in fp8_names(run_layer(local, index, b), price,
                                          local.devices, b, scale))
    return Fp8Plan(recipe=problem.train.fp8, emulated=not problem.devices.fp8_peak_flops,
                   linears=linears)


def _expert_parallel(problem: PlanningProblem, config: PipelineConfig,
                     evaluation: Evaluation, modes: tuple[str, ...]):
    """The plan's ``expert_parallel`` (:mod:`partc.planner.expert_parallel`), None without it."""
    if config.ep == 1:
        return None

    return expert_parallel_section(problem, config, evaluation, tuple(modes))


def mesh_summary(mesh: MeshResult) -> MeshOutcome:
    """One factorisation as the plan records it: what the outcome knows, times in
    seconds."""
    summary: dict = {}
    if mesh.config is not None:
        config = mesh.config
        summary.update(step_time_s=mesh.step_ps / PS_PER_S, solver_status=mesh.status,
                       micro_batch_size=config.micro_batch_size,
                       num_microbatches=config.num_microbatches,
                       schedule=Schedule(config.schedule),
                       zero_stage=config.zero_stage,
                       sequence_parallel=config.sequence_parallel,
                       **({"ep": config.ep} if config.ep != 1 else {}),
                       **({"zero2_grad_sync": "step"} if config.reduces_once else {}))
    if mesh.bound_ps is not None:
        summary["bound_s"] = mesh.bound_ps / PS_PER_S
    if mesh.need_bytes is not None:
        summary.update(need_bytes=mesh.need_bytes, limit_bytes=mesh.limit_bytes)
    if mesh.cp != 1:
        summary.update(cp=mesh.cp, cp_kind=CpKind(mesh.cp_kind))
    return MeshOutcome(pp=mesh.pp, dp=mesh.dp, tp=mesh.tp, outcome=mesh.outcome, **summary)


def tensor_parallel_section(problem: PlanningProblem,
                            config: PipelineConfig) -> TensorParallelPlan | None:
    """The plan's ``tensor_parallel``: what the runtime rebuilds the sharding from, and
    per layer the collectives of one microbatch (kind, phase, bytes of the whole tensor)."""
    option = problem.tp_option(config.tp, config.sequence_parallel, config.tp_objective)
    if config.tp == 1 or option is None:
        return None
    # A rank's tokens (under context parallelism its share of each sequence), as the
    # collectives are priced.
    scale = config.micro_batch_size * config.tokens_share * problem.train.measured_scale
    moving = [layer for layer in option.model.layers if layer.tp_comm]
    times = {layer.name: tp_collective_times(problem, config, layer) for layer in moving}
    return TensorParallelPlan(
        degree=config.tp,
        sequence_parallel=config.sequence_parallel,
        objective=config.tp_objective,
        params=dict(option.placements),
        partial_grad_params=tuple(option.partial_grad_params),
        choices={name: tuple(c) for name, c in option.choices},
        collectives={layer.name: tuple(TPCollective(kind=kind, phase=Phase(phase),
                                                    nbytes=int(round(nbytes * scale)))
                                       for kind, phase, nbytes in layer.tp_comm)
                     for layer in moving},
        collective_seconds={layer.name: sum(exposed for _, _, exposed in times[layer.name])
                            for layer in moving},
        notes=dict(option.notes),
        collective_total_seconds={layer.name: sum(own for _, own, _ in times[layer.name])
                                  for layer in moving},
    )


def alternative(problem: PlanningProblem, name: str, description: str, recompute: str,
                stage_of: tuple[int, ...], evaluation: Evaluation,
                config: PipelineConfig) -> Alternative:
    """An alternative plan's summary, as the report shows it: its step played out as the
    plan's own is (:func:`simulated_step_ps` on the plan's configuration), so that the two
    compare like for like."""
    names = [layer.name for layer in problem.layers]
    worst = evaluation.worst_stage
    return Alternative(
        name=name,
        description=description,
        recompute=Recompute(recompute),
        stages=tuple(tuple(names[l] for l in s.layers) for s in evaluation.stages),
        step_time_s=simulated_step_ps(config, evaluation)[0] / PS_PER_S,
        fits=evaluation.fits,
        peak_memory_bytes=max(s.memory.peak for s in evaluation.stages),
        worst_stage=evaluation.stages.index(worst),
        worst_need_bytes=worst.memory.peak,
        worst_limit_bytes=worst.limit,
        bottleneck_s=max(s.busy_ps for s in evaluation.stages) / PS_PER_S,
    )
