"""validate_plan: check a plan against its problem without the solver.

Recomputes the cost tables from the problem and re-evaluates the plan's assignment, then
checks structure (every layer once, in order, contiguous non-empty stages), batch
arithmetic, recompute modes, pins, memory against every stage's limit, and that the
plan's recorded memory and predicted step time are what the cost model says.
"""

from __future__ import annotations

import math

from partc.cost.cp_attention import all_to_all_refusal, context_parallel_refusal
from partc.cost.evaluate import Evaluation, evaluate, simulated_step_ps
from partc.cost.host_offload import node_host_bytes
from partc.cost.offload_time import host_per_node
from partc.cost.pipeline_config import PS_PER_S, PipelineConfig
from partc.cost.schedules import feature_refusal, refusal
from partc.cost.tables import build_cost_table
from partc.errors import PlanValidationError
from partc.names import CpKind, Offload
from partc.plan import Plan
from partc.planner.assemble import fp8_section
from partc.planner.data_parallel import data_parallel_section
from partc.planner.expert_parallel import expert_parallel_section
from partc.problem import ZERO2_GRAD_SYNCS, PlanningProblem, effective_zero_stage
from partc.spec import SCHEDULES
from partc.units import format_bytes


def _structure(problem: PlanningProblem, plan: Plan, errors: list[str]) -> None:
    mesh, tp = plan.mesh, plan.tp
    section = plan.tensor_parallel
    degree = section.degree if section is not None else 1
    if degree != tp:
        errors.append(f"tp={tp} but the plan's tensor_parallel has degree {degree}")
    elif tp != 1:
        option = problem.tp_option(tp, section.sequence_parallel, section.objective)
        if option is None:
            errors.append(f"tp={tp} was not measured for this problem")
        elif problem.devices.devices_per_node % tp:
            errors.append(f"tp={tp} does not divide the {problem.devices.devices_per_node} "
                          "devices of a node")
        elif dict(option.placements) != section.params:
            errors.append("parameter placements differ from the measured sharding")
    if mesh.size != problem.devices.num_devices:
        errors.append(f"mesh {mesh} does not use {problem.devices.num_devices} devices")
    _context_parallel(problem, plan, errors)
    if len(plan.stages) != mesh.pp:
        errors.append(f"{len(plan.stages)} stages for pp={mesh.pp}")
    if [s.index for s in plan.stages] != list(range(len(plan.stages))):
        errors.append("stage indices are not 0..pp-1 in order")
    if any(not run for run in plan.runs):
        errors.append("a stage has no layers")
    names = [layer.name for layer in problem.layers]
    if list(plan.layer_names) != names:
        errors.append(f"stages do not cover the layers once in order: {list(plan.layer_names)}")
    if plan.global_batch_size != problem.train.global_batch_size:
        errors.append(f"dp x micro-batch size x microbatches = {plan.global_batch_size}, "
                      f"global batch is {problem.train.global_batch_size}")
    if plan.zero2_grad_sync not in ZERO2_GRAD_SYNCS:
        errors.append(f"unknown zero2_grad_sync {plan.zero2_grad_sync!r} (one of "
                      f"{ZERO2_GRAD_SYNCS})")
    if plan.schedule not in SCHEDULES:
        errors.append(f"unknown schedule {plan.schedule!r}")
    else:
        _placement(plan, errors)


def _context_parallel(problem: PlanningProblem, plan: Plan, errors: list[str]) -> None:
    """Context parallelism runs on this model: its sequence splits into 2 x cp chunks,
    nothing outside attention reads along it, and all-to-all's heads divide by cp."""
    if plan.cp == 1:
        return
    why = context_parallel_refusal(problem, plan.cp)
    if why is not None:
        errors.append(f"cp={plan.cp}: {why}")
    if plan.mesh.ep > 1:
        errors.append(f"cp={plan.cp} beside ep={plan.mesh.ep}: the runtime does not run "
                      f"context parallelism beside expert parallelism")
    if plan.cp_kind == CpKind.ALL_TO_ALL:
        local = problem.variant(plan.tp, plan.sequence_parallel, plan.tp_objective)
        why = all_to_all_refusal(local.layers, plan.cp, plan.tp)
        if why is not None:
            errors.append(f"cp={plan.cp}: {why}")


def _placement(plan: Plan, errors: list[str]) -> None:
    """Torch runs the schedule with these ranks, virtual stages and microbatches, each
    rank holding ``v`` runs (:mod:`partc.cost.schedules`)."""
    pp, v = len(plan.stages), plan.chunks
    refused = (refusal(plan.schedule, pp, v, plan.num_microbatches)
               or feature_refusal(plan.schedule, plan.effective_zero_stage,
                                  plan.train.compile))
    if refused:
        errors.append(f"schedule refused: {refused}")
        return
    if v > 1 and any(len(s.runs) != v for s in plan.stages):
        errors.append(f"runs of layers per stage are uneven: "
                      f"{[len(s.runs) for s in plan.stages]} (want {v} each)")
        return
    # The layers read in the placement's order (plan.runs) must be the model's: checked
    # with the stages' cover above.


def _modes(problem: PlanningProblem, plan: Plan, errors: list[str]) -> None:
    recompute = plan.recompute
    key = (plan.tp, plan.sequence_parallel, plan.tp_objective)
    if plan.tp > 1 and problem.tp_option(*key) is None:
        return   # _structure says so
    local = problem.variant(*key)
    for index, layer in enumerate(local.layers):   # a sharded layer may allow modes the
        mode = recompute.get(layer.name)             # whole one does not
        pinned = problem.pins.recompute.get(layer.name)
        modes = local.layer_modes(index)
        if mode not in modes and not (mode == pinned == "offload"):
            errors.append(f"layer {layer.name}: recompute {mode!r} not among {modes}")
        if pinned is not None and mode != pinned and not (
                pinned == "selective" and "selective" not in layer.modes and mode == "none"):
            errors.append(f"layer {layer.name}: recompute pinned to {pinned}, plan has {mode}")


def _pins(problem: PlanningProblem, plan: Plan, errors: list[str]) -> None:
    pins = problem.pins
    checks = {"pp": (pins.pp, plan.pp), "dp": (pins.dp, plan.dp), "tp": (pins.tp, plan.tp),
              "cp": (pins.cp, plan.cp), "cp_kind": (pins.cp_kind, plan.cp_kind),
              "num_microbatches": (pins.num_microbatches, plan.num_microbatches),
              "micro_batch_size": (pins.micro_batch_size, plan.micro_batch_size),
              "schedule": (pins.schedule, plan.schedule),
              "virtual_stages": (pins.virtual_stages, plan.chunks),
              # A pinned ZeRO stage is what runs where there are replicas to shard
              # over; a pinned gradient sync where ZeRO-2 runs (the plan records both so).
              "zero_stage": (None if pins.zero_stage is None
                             else effective_zero_stage(pins.zero_stage, plan.grad_dp),
                             plan.zero_stage),
              "zero2_grad_sync": (pins.zero2_grad_sync if plan.effective_zero_stage == 2
                                  else None, plan.zero2_grad_sync)}
    for name, (pinned, actual) in checks.items():
        if pinned is not None and pinned != actual:
            errors.append(f"{name} pinned to {pinned}, plan has {actual}")
    if pins.stages is not None and [tuple(s.layers) for s in plan.stages] != list(pins.stages):
        errors.append("stage boundaries differ from the pinned stages")


def plan_config(plan: Plan) -> PipelineConfig:
    """The configuration a plan's decisions make, as the cost tables take it."""
    return PipelineConfig(pp=plan.pp, dp=plan.dp, micro_batch_size=plan.micro_batch_size,
                          num_microbatches=plan.num_microbatches, schedule=plan.schedule,
                          tp=plan.tp, sequence_parallel=plan.sequence_parallel,
                          tp_objective=plan.tp_objective, zero_stage=plan.zero_stage,
                          chunks=plan.chunks, ep=plan.mesh.ep,
                          zero2_grad_sync=plan.zero2_grad_sync, cp=plan.cp,
                          cp_kind=plan.cp_kind, offload_optimizer=plan.offload_optimizer,
                          offload_params=plan.offload_params)


def _costs(problem: PlanningProblem, plan: Plan, errors: list[str]) -> Evaluation | None:
    config = plan_config(plan)
    stage_of = [j for j, run in enumerate(plan.runs) for _ in run]
    modes = [plan.recompute[layer.name] for layer in problem.layers]
    evaluation = evaluate(build_cost_table(problem, config), stage_of, modes)
    for stage, cost in zip(plan.stages, evaluation.stages):
        if cost.memory.peak > cost.limit:
            errors.append(f"stage {stage.index} needs {cost.memory.peak} bytes, "
                          f"limit {cost.limit}")
        if stage.memory_bytes != cost.memory:
            errors.append(f"stage {stage.index} records memory {stage.memory_bytes}, "
                          f"the cost model gives {cost.memory}")
        if stage.limit_bytes != cost.limit:
            errors.append(f"stage {stage.index} records limit {stage.limit_bytes}, "
                          f"devices give {cost.limit}")
    _offloaded_activations(problem, plan, evaluation, errors)
    if plan.mesh.ep > 1:

        modes_t = tuple(modes)
        if expert_parallel_section(problem, config, evaluation, modes_t) \
                != plan.expert_parallel:
            errors.append("the plan's expert_parallel section differs from the cost model's")
    if plan.data_parallel is not None and \
            data_parallel_section(problem, config, evaluation) != plan.data_parallel:
        errors.append("the plan's data_parallel section differs from the cost model's")
    local = problem.variant(plan.tp, plan.sequence_parallel, plan.tp_objective)
    # Optimizer and parameter offload's bytes per node, and the busiest node's offloaded
    # activations.
    host = node_host_bytes(local, config, [s.param_count for s in evaluation.stages],
                           [s.memory.host for s in evaluation.stages])
    if host != plan.host_bytes_per_node:
        errors.append(f"the plan records {plan.host_bytes_per_node} host bytes per node, "
                      f"the cost model gives {host}")
    step = simulated_step_ps(config, evaluation)[0] / PS_PER_S
    recorded = plan.predicted.step_time_s
    if not math.isclose(recorded, step, rel_tol=1e-9, abs_tol=1e-15):
        errors.append(f"predicted step time {recorded} s, the cost model gives {step} s")
    return evaluation


def _offloaded_activations(problem: PlanningProblem, plan: Plan, evaluation: Evaluation,
                           errors: list[str]) -> None:
    """Offloaded activations: each stage's host bytes and traffic as recorded, and each
    node's host holding its ranks' within the host memory (where it is known)."""
    for stage, cost in zip(plan.stages, evaluation.stages):
        traffic = cost.offload_bytes * plan.num_microbatches
        if stage.host_traffic_bytes != traffic:
            errors.append(f"stage {stage.index} records {stage.host_traffic_bytes} bytes "
                          f"to the host per step, the cost model gives {traffic}")
    limit = problem.devices.host_memory
    nodes = host_per_node([cost.memory.host for cost in evaluation.stages], problem.devices)
    if limit is not None:
        for node, used in enumerate(nodes):
            if used > limit:
                errors.append(f"node {node}: offloaded activations take {used} bytes of "
                              f"host memory, limit {limit}")


def _experts(problem: PlanningProblem, plan: Plan, errors: list[str]) -> None:
    """Expert parallelism: the degree divides each stage's dp x tp ranks and every
    mixture-of-experts layer's experts (with tp > 1, under sequence parallelism); the
    plan's expert section says so, and its per-layer placement, parameters and
    all-to-alls are what the layers' MoE figures give, by plain arithmetic."""
    ep, section = plan.mesh.ep, plan.expert_parallel
    moe = [(layer.name, layer.moe) for layer in problem.layers if layer.moe is not None]
    if problem.pins.ep is not None and problem.pins.ep != ep:
        errors.append(f"ep pinned to {problem.pins.ep}, plan has {ep}")
    listed = tuple(name for name, cost in moe if cost.expert_form == "module-list")
    if plan.module_list_experts != listed:
        errors.append(f"the plan names {list(plan.module_list_experts)} as layers whose "
                      f"experts are a module list, the model's are {list(listed)}")
    if ep > 1 and listed:
        errors.append(f"ep={ep} but the experts of layers {list(listed)} are a module "
                      f"list, which the runtime does not split")
    if ep == 1:
        if section is not None:
            errors.append("the plan has an expert_parallel section but ep=1")
        return
    if not moe:
        errors.append(f"ep={ep} but the model has no mixture-of-experts layer")
        return
    if (plan.dp * plan.tp) % ep:
        errors.append(f"ep={ep} does not divide dp x tp = {plan.dp * plan.tp}")
    if plan.tp > 1 and not plan.sequence_parallel:
        errors.append(f"ep={ep} with tp={plan.tp} needs sequence parallelism")
    for name, cost in moe:
        if cost.num_experts % ep:
            errors.append(f"layer {name}: ep={ep} does not divide its {cost.num_experts} "
                          f"experts")
    if section is None:
        errors.append(f"ep={ep} but the plan has no expert_parallel section")
        return
    if section.ep != ep or section.expert_dp * ep != plan.dp * plan.tp:
        errors.append(f"expert_parallel says ep={section.ep}, expert_dp={section.expert_dp} "
                      f"for mesh {plan.mesh}")
    recorded = {layer.name: layer for layer in section.layers}
    if set(recorded) != {name for name, _ in moe}:
        errors.append(f"expert_parallel lists layers {sorted(recorded)}, the model's "
                      f"mixture-of-experts layers are {[name for name, _ in moe]}")
        return
    m, b = plan.num_microbatches, plan.micro_batch_size
    key = (plan.tp, plan.sequence_parallel, plan.tp_objective)
    local = {layer.name: layer.moe for layer in problem.variant(*key).layers} \
        if plan.tp > 1 and problem.tp_option(*key) is not None else {}
    for name, cost in moe:
        layer = recorded[name]
        # A rank dispatches its own tokens: all of them, or with tensor parallelism its
        # share (sequence parallelism: 1/tp, unless the variant's figures say otherwise).
        rank = local.get(name)
        tokens_share = 1.0 if plan.tp == 1 else (
            rank.tokens_per_sample / cost.tokens_per_sample if rank is not None
            else 1 / plan.tp)
        calls = m * (4 + (2 if plan.recompute[name] != "none" else 0))
        nbytes = calls * b * cost.dispatch_bytes * tokens_share * problem.train.measured_scale
        if layer.local_experts * ep != cost.num_experts \
                or layer.expert_params != cost.expert_param_count // ep:
            errors.append(f"layer {name}: {layer.local_experts} experts of "
                          f"{layer.expert_params} parameters per rank, not "
                          f"{cost.num_experts} / ep={ep}")
        if layer.all_to_alls != calls or abs(layer.all_to_all_bytes - nbytes) > 1 + 1e-9 * nbytes:
            errors.append(f"layer {name}: {layer.all_to_alls} all-to-alls of "
                          f"{layer.all_to_all_bytes} bytes per step recorded, its figures "
                          f"give {calls} of {nbytes:.0f}")
        bound = section.imbalance if section.capacity_factor is None \
            else min(section.imbalance, section.capacity_factor)
        if layer.worst_factor > bound + 1e-12:
            errors.append(f"layer {name}: memory budgeted at {layer.worst_factor}x the "
                          f"balanced routing, above the {bound}x assumed")


def _host(problem: PlanningProblem, plan: Plan, errors: list[str]) -> None:
    """Offload: as pinned (the kinds a plan decides here: optimizer and params), and the
    host memory a node's ranks take within the budget's host memory."""
    pinned = problem.pins.offload
    if pinned is not None:
        for kind, on in ((Offload.OPTIMIZER, plan.offload_optimizer),
                         (Offload.PARAMS, plan.offload_params)):
            if (kind in pinned) != on:
                errors.append(f"offload of {kind} pinned {'on' if kind in pinned else 'off'}"
                              f", the plan has it {'on' if on else 'off'}")
    limit = problem.devices.host_memory
    if plan.host_bytes_per_node and limit is None:
        errors.append(f"the plan puts {format_bytes(plan.host_bytes_per_node)} per node on "
                      f"the host, but the budget gives no host memory (host_memory)")
    elif limit is not None and plan.host_bytes_per_node > limit:
        errors.append(f"the plan puts {format_bytes(plan.host_bytes_per_node)} per node on "
                      f"the host, the budget's host memory is {format_bytes(limit)}")


def field_conflicts(plan: Plan) -> list[tuple[str, str]]:
    """The plan's fields that contradict each other, as (field, what is wrong): what a
    plan says twice must agree, whatever the model. Needs no problem, so that
    ``partc.load`` refuses an edited plan.json naming the field before it measures the
    model (:func:`partc.program.read_plan_file`)."""
    found: list[tuple[str, str]] = []
    mesh = plan.mesh
    for axis in ("pp", "dp", "cp", "tp", "ep"):
        if getattr(mesh, axis) < 1:
            found.append((f"mesh.{axis}", f"{getattr(mesh, axis)}: a mesh axis is at least 1"))
    if mesh.size != plan.budget.num_devices:
        found.append(("mesh", f"{mesh} uses {mesh.size} devices, the budget has "
                              f"{plan.budget.num_devices}"))
    if plan.zero_stage not in (0, 1, 2, 3):
        found.append(("zero_stage", f"{plan.zero_stage}: one of 0, 1, 2, 3"))
    elif plan.zero_stage and plan.grad_dp == 1:
        found.append(("zero_stage", f"ZeRO-{plan.zero_stage} with mesh.dp x mesh.cp = 1: "
                                    "there is no other rank holding the parameters to shard "
                                    "over (0 runs)"))
    if plan.zero2_grad_sync == "step" and plan.effective_zero_stage != 2:
        found.append(("zero2_grad_sync", f"'step' is ZeRO-2's, the plan runs "
                                         f"ZeRO-{plan.effective_zero_stage}"))
    if plan.offload_params and not plan.offload_optimizer:
        found.append(("offload_params", "parameter offload steps the optimizer on the "
                                        "host: offload_optimizer must be on too"))
    if plan.offload_params and plan.effective_zero_stage != 3:
        found.append(("offload_params", f"parameter offload runs under ZeRO-3, the plan "
                                        f"runs ZeRO-{plan.effective_zero_stage}"))
    if plan.host_bytes_per_node < 0:
        found.append(("host_bytes_per_node", f"{plan.host_bytes_per_node}: not negative"))
    if plan.num_microbatches < 1 or plan.micro_batch_size < 1:
        found.append(("num_microbatches" if plan.num_microbatches < 1 else "micro_batch_size",
                      "at least 1"))
    elif plan.train.global_batch_size != plan.global_batch_size:
        found.append(("train.global_batch_size",
                      f"{plan.train.global_batch_size}, but dp x micro_batch_size x "
                      f"num_microbatches = {plan.global_batch_size}"))
    found += _stage_conflicts(plan)
    found += cp_conflicts(plan)
    section = plan.tensor_parallel
    if (section.degree if section is not None else 1) != mesh.tp:
        found.append(("tensor_parallel", f"degree {section.degree if section else 1} "
                                         f"(none written: 1), mesh.tp={mesh.tp}"))
    experts = plan.expert_parallel
    if (experts.ep if experts is not None else 1) != mesh.ep:
        found.append(("expert_parallel", f"ep {experts.ep if experts else 1} (none "
                                         f"written: 1), mesh.ep={mesh.ep}"))
    return found


def cp_conflicts(plan: Plan) -> list[tuple[str, str]]:
    """Context parallelism's fields against each other and the model's sequence: a kind
    exactly when cp > 1, and a sequence that splits into ``2 * cp`` equal chunks (the
    load-balanced causal split gives rank ``i`` chunks ``i`` and ``2cp-1-i``)."""
    mesh = plan.mesh
    if mesh.cp > 1 and mesh.cp_kind is None:
        return [("mesh.cp_kind", f"none with mesh.cp={mesh.cp}: one of "
                                 f"{[kind.value for kind in CpKind]}")]
    if mesh.cp == 1 and mesh.cp_kind is not None:
        return [("mesh.cp_kind", f"{mesh.cp_kind} with mesh.cp=1: no context parallelism "
                                 "to run (write none)")]
    sequence = plan.model.sequence_length
    if mesh.cp > 1 and sequence is not None and sequence % (2 * mesh.cp):
        return [("mesh.cp", f"{mesh.cp}: the sequence of {sequence} tokens does not split "
                            f"into 2 x cp = {2 * mesh.cp} equal chunks")]
    return []


def _stage_conflicts(plan: Plan) -> list[tuple[str, str]]:
    """Each stage's index, layers, recompute modes and runs against each other."""
    found: list[tuple[str, str]] = []
    if len(plan.stages) != plan.mesh.pp:
        found.append(("stages", f"{len(plan.stages)} stages, mesh.pp={plan.mesh.pp}"))
    chunks = {len(stage.runs) for stage in plan.stages}
    if len(chunks) > 1:
        found.append(("stages", f"runs per stage differ: {[len(s.runs) for s in plan.stages]}"))
    for k, stage in enumerate(plan.stages):
        where = f"stages[{k}]"
        if stage.index != k:
            found.append((f"{where}.index", f"{stage.index}, at position {k}"))
        if stage.runs and tuple(n for run in stage.runs for n in run) != stage.layers:
            found.append((f"{where}.layers", f"{list(stage.layers)}, its runs hold "
                                             f"{[list(run) for run in stage.runs]}"))
        if set(stage.recompute) != set(stage.layers):
            found.append((f"{where}.recompute", f"modes for {sorted(stage.recompute)}, "
                                                f"the stage's layers are {list(stage.layers)}"))
    names = [name for stage in plan.stages for name in stage.layers]   # not plan.runs,
    # which reads the stages' indices
    if len(set(names)) != len(names):
        found.append(("stages", "a layer is in more than one stage or run"))
    if plan.model.num_layers != len(names):
        found.append(("model.num_layers", f"{plan.model.num_layers}, the stages hold "
                                          f"{len(names)} layers"))
    return found


def _fp8(problem: PlanningProblem, plan: Plan, errors: list[str]) -> None:
    """FP8 linears only with ``TrainSpec.fp8``, on a device with FP8 matmuls (or the
    CPU's emulation), without tensor parallelism, and exactly the linears the cost
    tables priced in FP8 for the plan's configuration (:func:`fp8_section`)."""
    section, recipe = plan.fp8, problem.train.fp8
    if section is None:
        if recipe is not None:
            errors.append("TrainSpec.fp8 is on but the plan has no fp8 section")
        return
    if recipe is None:
        errors.append("the plan runs FP8 linears but TrainSpec.fp8 is off")
        return
    if section.recipe != recipe:
        errors.append(f"fp8 recipe {section.recipe!r}, the training's is {recipe!r}")
    emulated = not problem.devices.fp8_peak_flops
    # The CPU, the one device that runs ops as it dispatches them, emulates FP8.
    if section.linears and emulated and problem.devices.dispatch_ahead:
        errors.append(f"FP8 linears on {plan.budget.device}, which has no FP8 matmuls "
                      "(no fp8_peak_flops); only the CPU emulates them")
    if section.emulated != emulated:
        errors.append(f"fp8 emulated={section.emulated}, but the device "
                      f"{'has no' if emulated else 'has'} FP8 matmuls")
    if section.linears and plan.tp > 1:
        errors.append(f"FP8 linears with tp={plan.tp}: not run under tensor parallelism")
    expected = fp8_section(problem, plan_config(plan))
    if expected is not None and expected.linears != section.linears:
        extra = sorted(set(section.linears) - set(expected.linears))
        missing = sorted(set(expected.linears) - set(section.linears))
        errors.append(f"fp8 linears differ from what the cost tables price in FP8: "
                      f"{extra[:3]} not priced so, {missing[:3]} missing")


def validate_plan(problem: PlanningProblem, plan: Plan) -> Evaluation:
    """Raise PlanValidationError listing every violation; return the re-evaluation."""
    errors: list[str] = [f"{field}: {what}" for field, what in field_conflicts(plan)]
    _structure(problem, plan, errors)
    _modes(problem, plan, errors)
    _pins(problem, plan, errors)
    _experts(problem, plan, errors)
    _host(problem, plan, errors)
    _fp8(problem, plan, errors)
    evaluation = None
    if not errors:
        evaluation = _costs(problem, plan, errors)
    if errors:
        raise PlanValidationError("invalid plan:\n  " + "\n  ".join(errors))
    return evaluation
