"""partc.compile: model + example inputs + budget + training setup → Program.

The steps, in order:

1. analyse the model (``partc.passes.pipeline.analyze``: trace, shapes, costs, layers);
2. build the PlanningProblem: plain numbers from the analysis, budget, spec and pins;
3. solve it (``partc.planner``) — or raise PlanInfeasibleError with a way out;
4. turn the best assignment into a Plan, with the baselines beside it;
5. check the Plan with ``validate_plan``, which does not use the solver.

``partc.load`` is here too: a saved plan read back for a model is measured again as
``compile`` measures it and validated, without the solver (:func:`load`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from os import PathLike
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from partc.batch_coupling import couples_samples, restrict
from partc.cache import DEFAULT as DEFAULT_CACHE
from partc.cache import PlanCache, model_key, problem_key
from partc.codec import dtype_name
from partc.cost.collectives import Group
from partc.cost.compile_time import rank_compile_seconds
from partc.cost.fp8_pricing import output_linears
from partc.cost.schedules import runs_compiled
from partc.cost.tables import TableCache
from partc.device.budget import DeviceBudget, preset
from partc.device.figures import FIGURE_NAMES, DeviceFigures
from partc.device.usable import RESERVE_FIGURES
from partc.errors import (PartcError, PlanFileError, PlanInfeasibleError, PlanMismatchError,
                          PlanValidationError, TraceError, check_argument)
from partc.heap import young_collections_only
from partc.identity import behaviour_digest, model_hash
from partc.passes.pipeline import analyze, tensor_parallel_options
from partc.passes.tp.chooser import Link
from partc.plan import BudgetInfo, Plan, SolverStats
from partc.planner import PlannerOptions, PlannerResult, divisors, schedule_options, solve
from partc.planner.assemble import alternative, make_plan
from partc.planner.baselines import baselines
from partc.planner.pins import check_pins
from partc.planner.validate import validate_plan
from partc.problem import DeviceNumbers, ModelAnalysis, Pins, PlanningProblem, TrainNumbers
from partc.program import Program, read_plan_file
from partc.runtime.padding import (PADDING_MASK, mask_left_out, plain_positions,
                                   takes_end_padding)
from partc.spec import Constraints, TrainSpec, dtype_bytes

log = logging.getLogger("partc")


def device_numbers(budget: DeviceBudget, dtype: torch.dtype) -> DeviceNumbers:
    """The cost model's numbers: the budget's figures for ``dtype``, each under its name."""
    figures = budget.figures_for(dtype)
    known = {spec.name for spec in dataclasses.fields(DeviceNumbers)} & FIGURE_NAMES
    return DeviceNumbers(num_devices=budget.num_devices, memory_bytes=budget.memory_bytes,
                         intra_node_links=figures.collective_links or (),
                         dispatch_ahead=budget.device_type != "cpu",
                         **{name: getattr(figures, name) for name in known})


def tp_degrees(devices: DeviceNumbers, constraints: Constraints) -> list[int]:
    """Tensor-parallel degrees worth measuring: inside one node, dividing the devices
    that pinned pipeline and data-parallel degrees leave (pp=2 on two devices leaves
    none to split, so no sharding is searched)."""
    if constraints.tp is not None:
        return [constraints.tp] if constraints.tp > 1 else []
    pinned = (constraints.effective_pp or 1) * (constraints.dp or 1)
    return [t for t in divisors(devices.devices_per_node)
            if 1 < t <= devices.num_devices and devices.num_devices % (t * pinned) == 0]


def tensor_parallel_links(devices: DeviceNumbers, degrees: list[int]) -> list:
    # A tensor-parallel group of t spans t consecutive ranks, as partc.cost prices it.
    return [Link(group=Group.over(devices, t, t),
                 flops=devices.peak_flops * devices.flops_efficiency,
                 hbm_bandwidth=devices.hbm_bandwidth) for t in degrees]


def pins_for(constraints: Constraints, train: TrainSpec,
             layer_names: tuple[str, ...] | None = None) -> Pins:
    """The pins as the planner reads them; without ``layer_names`` the recompute pins are
    as given (a mode for every layer is then left out), for checks that need no model."""
    micro_batch_size = constraints.micro_batch_size or (
        train.micro_batch_size if isinstance(train.micro_batch_size, int) else None)
    recompute = dict(constraints._recompute_map) if layer_names is None \
        else constraints.recompute_for(layer_names)
    return Pins(pp=constraints.effective_pp, dp=constraints.dp, tp=constraints.tp,
                sequence_parallel=constraints.sequence_parallel,
                tp_objective=constraints.tp_objective, stages=constraints.stages,
                recompute=recompute, num_microbatches=constraints.num_microbatches,
                micro_batch_size=micro_batch_size,
                schedule=constraints.schedule or (
                    None if train.schedule == "auto" else train.schedule),
                virtual_stages=constraints.virtual_stages,
                zero_stage=constraints.zero_stage,
                zero2_grad_sync=constraints.zero2_grad_sync, ep=constraints.ep,
                cp=constraints.cp, cp_kind=constraints.cp_kind,
                offload=constraints.offload,
                fp8_linears=constraints.fp8_linears)


def build_problem(analysis: ModelAnalysis, budget: DeviceBudget, train: TrainSpec,
                  constraints: Constraints, graph: Any = None,
                  options: PlannerOptions = PlannerOptions()) -> PlanningProblem:
    """The planning problem; with ``graph`` (``analyze``'s), tensor-parallel variants are
    measured for each degree a node allows (or the pinned one), the sharding chooser
    running under ``options.sharding``."""
    names = tuple(layer.name for layer in analysis.layers)
    devices = device_numbers(budget, train.dtype)
    train = train.for_device(budget.device_type)
    check_fp8(budget, devices, train, constraints)
    # Before measuring tensor parallelism: a pin that cannot hold fails at once.
    check_pins(pins_for(constraints, train), devices, train.global_batch_size, names)
    pins = pins_for(constraints, train, names)
    # A mode for every layer means "selective where there is an attention core"; a layer
    # named on its own is told.
    named = {} if constraints.recompute is None or isinstance(constraints.recompute, str) \
        else dict(constraints.recompute)
    for layer in analysis.layers:
        if named.get(layer.name) == "selective" and "selective" not in layer.modes:
            log.warning("recompute pinned 'selective' on %s: the layer has no attention core "
                        "whose tensors only it keeps, so selective recompute reruns nothing "
                        "there; it is planned as 'none'", layer.name)
    sizes = (pins.micro_batch_size,) if pins.micro_batch_size \
        else tuple(divisors(train.global_batch_size))
    degrees = tp_degrees(devices, constraints)
    if graph is not None and degrees:
        sp = (constraints.sequence_parallel,) if constraints.sequence_parallel is not None \
            else (False, True)
        start = time.perf_counter()
        objectives = (constraints.tp_objective,) if constraints.tp_objective else ("time", "memory")
        variants = tensor_parallel_options(graph, tensor_parallel_links(devices, degrees), sp,
                                           objectives, options.sharding)
        log.info("tensor parallelism measured for tp in %s in %.2f s", degrees,
                 time.perf_counter() - start)
        analysis = dataclasses.replace(analysis, tensor_parallel=variants)
    return PlanningProblem(
        model=analysis,
        devices=devices,
        train=TrainNumbers(
            global_batch_size=train.global_batch_size,
            micro_batch_sizes=sizes,
            activation_scale=dtype_bytes(train.dtype) / analysis.summary.traced_dtype_bytes,
            precision=train.precision,
            measured_scale=dtype_bytes(train.dtype) / _measured_dtype_bytes(analysis),
            moe_imbalance=train.moe_imbalance, moe_capacity_factor=train.moe_capacity_factor,
            compiled=train.compile is not False, compile_pinned=train.compile is True,
            fused_optimizer=bool(train.fused_optimizer), tp_overlap=train.tp_overlap,
            param_gather_overlap=train.overlap_param_gather,
            bucket_elements=train.bucket_elements,
            fp8=train.fp8_recipe if train.fp8 else None,
            fp8_kept=output_linears(analysis.layers) if train.fp8 else ()),
        pins=pins,
    )


def check_fp8(budget: DeviceBudget, devices: DeviceNumbers, train: TrainSpec,
              constraints: Constraints) -> None:
    """FP8 linears need a device with FP8 matmuls (an ``fp8_peak_flops``; the CPU
    emulates them), ``TrainSpec.fp8`` to pin any, and no tensor parallelism to run in."""
    pinned = constraints.fp8_linears not in (None, "none")
    if pinned and not train.fp8:
        raise ValueError(f"Constraints.fp8_linears={constraints.fp8_linears!r} pins FP8 "
                         "linears, but TrainSpec.fp8 is off: pass TrainSpec(fp8=True)")
    if not train.fp8:
        return
    if devices.fp8_peak_flops is None and budget.device_type != "cpu":
        raise PlanInfeasibleError(
            f"TrainSpec(fp8=True): {budget.name} has no FP8 matmuls (no fp8_peak_flops): "
            "FP8 linears need a Hopper GPU (H100, H200) or newer; train without fp8, or "
            "give the device's FP8 peak (DeviceBudget(fp8_peak_flops=...), "
            "--fp8-peak-tflops)", resource="device")
    if pinned and (constraints.tp or 1) > 1:
        raise PlanInfeasibleError(
            f"Constraints.fp8_linears={constraints.fp8_linears!r} with tp={constraints.tp}: "
            "FP8 linears do not run under partc's tensor parallelism (its rewrite calls "
            "its own collectives around plain linears); pin tp=1, or leave fp8_linears to "
            "the planner, which prices tensor-parallel meshes without FP8",
            resource="pin", pin="fp8_linears")


def problem_for_plan(plan: Plan, model: torch.nn.Module, *, loss_fn: Callable | None = None,
                     options: PlannerOptions = PlannerOptions()) -> PlanningProblem:
    """The problem ``plan`` answers, measured again as ``compile`` measures it: the model
    traced at the batch it was measured at (else the global batch) on meta tensors of
    the recorded input shapes, under the plan's training setup, on the plan's budget,
    with the plan's tensor-parallel degree (and sequence parallelism, objective)
    measured. No pins but the FP8 linears (a plan may have had them pinned, and which
    run FP8 is the plan's to say, as its stages are): ``validate_plan`` then checks the
    plan's own decisions."""
    # A plan written before the optimizer step was a kernel choice priced torch's
    # unfused step, and its program runs that.
    train = dataclasses.replace(plan.train, fused_optimizer=plan.train.fused_optimizer is True)
    budget = budget_from_info(plan.budget)
    batch = plan.model.traced_batch_size or train.global_batch_size
    args, kwargs, target = plan.model.meta_batch(batch)
    graph, analysis = analyze(model, args, kwargs=kwargs, loss_fn=loss_fn,
                              example_target=target, name=plan.model.name,
                              attention=train.attention, autocast=autocast_dtype(train),
                              autocast_device=budget.device_type)
    analysis = dataclasses.replace(analysis, summary=dataclasses.replace(
        analysis.summary, left_out=plan.model.left_out,
        pads_at_end=plan.model.pads_at_end))
    constraints = Constraints(tp=plan.tp) if plan.tp == 1 else Constraints(
        tp=plan.tp, sequence_parallel=plan.sequence_parallel, tp_objective=plan.tp_objective)
    if plan.fp8 is not None:
        constraints = dataclasses.replace(constraints,
                                          fp8_linears=plan.fp8.linears or "none")
    return build_problem(analysis, budget, train, constraints, graph, options)


def budget_from_info(info: BudgetInfo) -> DeviceBudget:
    """A DeviceBudget with the figures a plan recorded (its preset for the device type,
    and for what an older plan did not record, when it names one)."""
    def preset_named(name: str | None) -> str | None:
        try:
            return preset(name).name if name else None
        except ValueError:   # a profile's own device name, or "custom"
            return None

    device = preset_named(info.preset) or preset_named(info.device)
    figures = info.figures.to_dict()
    if not set(RESERVE_FIGURES) & figures.keys():
        # Written before partc kept memory back for the context, NCCL and fragmentation
        # (partc.device.usable): planned against the whole memory it records.
        figures.update(context_memory=0, communicator_memory=0, memory_fragmentation=0.0)
    return DeviceBudget(num_devices=info.num_devices, device=device, **figures,
                        memory=tuple(info.memory_bytes))


def autocast_dtype(train: TrainSpec) -> torch.dtype | None:
    """The dtype the runtime's autocast computes in (mixed precision), None without it."""
    return train.dtype if train.dtype != torch.float32 else None


def _measured_dtype_bytes(analysis: ModelAnalysis) -> int:
    """Bytes of the dtype the layers' activations were measured in."""
    autocast = analysis.summary.autocast
    return dtype_bytes(getattr(torch, autocast)) if autocast \
        else analysis.summary.traced_dtype_bytes


@young_collections_only()
def plan_problem(problem: PlanningProblem, *, budget: BudgetInfo | None = None,
                 train: TrainSpec | None = None,
                 options: PlannerOptions = PlannerOptions(),
                 table_cache: TableCache | None = None) -> Plan:
    """Solve (with ``table_cache``, see ``partc.planner.solve``), assemble the Plan with
    its baselines, validate it."""
    return plan_of(problem, solve(problem, options, table_cache), budget=budget,
                   train=train, table_cache=table_cache)


def plan_of(problem: PlanningProblem, result: PlannerResult, *,
            budget: BudgetInfo | None = None, train: TrainSpec | None = None,
            table_cache: TableCache | None = None) -> Plan:
    """The validated Plan of the planner's ``result`` for ``problem``."""
    best = result.best
    stats = SolverStats(
        status=result.status, objective=result.searched.evaluation.step_ps / 1e12,
        bound=result.bound / 1e12, gap=result.gap, solve_time_s=result.solve_time_s,
        configs_total=result.configs_total, configs_solved=result.configs_solved,
        configs_pruned=result.configs_pruned, configs_played=result.configs_played)
    alternatives = tuple(
        alternative(problem, b.name, b.description, b.recompute, b.stage_of, b.evaluation,
                    best.table.config)
        for b in baselines(problem, best.table))
    plan = make_plan(problem, best.table.config, best.evaluation, best.assignment.modes,
                     stats, budget=budget or _budget_info(problem.devices),
                     train=chosen_kernels(train or _train_spec(problem.train), problem,
                                          best.table.config.schedule),
                     alternatives=alternatives, meshes=result.meshes)
    plan = dataclasses.replace(plan, schedules=tuple(
        schedule_options(problem, best, table_cache, result.schedule_trials)),
        predicted=dataclasses.replace(plan.predicted,
                                      compile_time_s=compile_seconds(problem, plan)))
    validate_plan(problem, plan)
    return plan


def compile_seconds(problem: PlanningProblem, plan: Plan) -> float | None:
    """The first step's compile on the slowest pipeline rank (None: not compiled)."""
    if not plan.train.compile:
        return None
    layers = {layer.name: layer for layer in problem.model.layers}
    fp8 = frozenset(plan.fp8.linears) if plan.fp8 is not None else frozenset()
    # dispatch_ahead: the device is a GPU (its host queues kernels ahead).
    return max(rank_compile_seconds((layers[name] for name in stage.layers),
                                    gpu=problem.devices.dispatch_ahead, fp8_linears=fp8)
               for stage in plan.stages)


def chosen_kernels(train: TrainSpec, problem: PlanningProblem, schedule: str) -> TrainSpec:
    """``train`` as the plan records it: the kernel choices ``problem`` priced made
    (compile wherever the planner may compile and ``schedule`` runs a whole backward;
    the optimizer step fused or not; the attention was measured as ``train`` says)."""
    return dataclasses.replace(train, compile=runs_compiled(schedule, problem.train.compiled),
                               fused_optimizer=problem.train.fused_optimizer)


def _budget_info(devices: DeviceNumbers) -> BudgetInfo:
    """The budget as the plan records it, when only the numbers are known."""
    return BudgetInfo(device="custom", num_devices=devices.num_devices,
                      memory_bytes=devices.memory_bytes,
                      figures=DeviceFigures(peak_flops=devices.peak_flops,
                                            fp8_peak_flops=devices.fp8_peak_flops,
                                            devices_per_node=devices.devices_per_node))


def _train_spec(train: TrainNumbers) -> TrainSpec:
    """The training setup as the plan records it, when only the numbers are known: fp32,
    or bf16 for 2-byte weights; the optimizer as its bytes of state per parameter; the
    overlaps and gradient buckets the numbers were priced with."""
    precision = train.precision
    return TrainSpec(global_batch_size=train.global_batch_size,
                     dtype=torch.bfloat16 if precision.mixed else torch.float32,
                     optimizer=precision.optimizer_state_bytes,
                     moe_imbalance=train.moe_imbalance,
                     moe_capacity_factor=train.moe_capacity_factor, attention="as_written",
                     compile=True if train.compile_pinned else None if train.compiled
                     else False, fused_optimizer=train.fused_optimizer,
                     fp8=train.fp8 is not None, fp8_recipe=train.fp8 or "tensorwise",
                     tp_overlap=train.tp_overlap,
                     overlap_param_gather=train.param_gather_overlap,
                     bucket_elements=train.bucket_elements)


def _compact(value: Any) -> Any:
    """``value`` as a contiguous tensor of its own storage; other values as they are."""
    if isinstance(value, torch.Tensor) and (
            not value.is_contiguous() or value.untyped_storage().nbytes() != value.nbytes):
        return value.clone(memory_format=torch.contiguous_format)
    return value


def model_inputs(example_inputs: Any) -> tuple[tuple, dict[str, torch.Tensor]]:
    """``example_inputs`` as (positional tensors, keyword tensors): a tensor, a tuple of
    tensors, or a mapping of names to tensors (a batch the model is called with as
    ``model(**batch)``, a tokenizer's ``BatchEncoding``); anything else is refused."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping):
        args, kwargs = (), {str(k): v for k, v in example_inputs.items() if v is not None}
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        raise TraceError(f"example_inputs is a {type(example_inputs).__name__}: give a "
                         "tensor, a tuple of tensors (the forward's positional inputs) or a "
                         "dict of tensors by name (the model called as model(**batch))")
    named = [(f"example_inputs[{i}]", v) for i, v in enumerate(args)]
    named += [(f"example_inputs[{k!r}]", v) for k, v in kwargs.items()]
    for where, value in named:
        if not isinstance(value, torch.Tensor):
            raise TraceError(
                f"{where} is a {type(value).__name__}, not a tensor: partc takes the "
                "model's inputs as tensors, by position (a tuple) or by name (a dict: "
                "example_inputs={'input_ids': ids, ...}, the model called as "
                "model(**batch)); pass a dict's tensors by name, and settings such as "
                "use_cache=False in the model's config")
    if not named:
        raise TraceError("example_inputs is empty: give the tensors of one batch")
    return args, kwargs


@young_collections_only()
def compile(model: torch.nn.Module,
            example_inputs: tuple | torch.Tensor | Mapping[str, torch.Tensor], *,
            budget: DeviceBudget, train: TrainSpec | None = None,
            loss_fn: Callable | None = None, example_target: Any = None,
            constraints: Constraints | None = None,
            options: PlannerOptions | None = None, name: str | None = None,
            cache: PlanCache | None = DEFAULT_CACHE) -> Program:
    """Plan how to train ``model`` on ``budget``; see docs/architecture.md and docs/guide.md
    for the contract.

    ``cache`` (by default one in memory, persisted under ``PARTC_CACHE_DIR`` when set;
    ``None``: none) keeps measured models and plans: compiling the same model again
    with another budget or batch skips tracing and measuring, and an unchanged problem
    returns its plan at once (validated again)."""
    _check_compile_arguments(model, budget, train, loss_fn, constraints, options, name, cache)
    example_inputs, kwargs = model_inputs(example_inputs)
    # A view (``ids[:, :-1]``) would be measured with its whole storage, which the plan
    # file's inputs (described by shape and dtype only) do not have: measure compact
    # copies, the same values.
    example_inputs = tuple(_compact(t) for t in example_inputs)
    kwargs = {key: _compact(t) for key, t in kwargs.items()}
    example_target = _compact(example_target)
    if train is None:
        first = next(iter((*example_inputs, *kwargs.values())))
        train = TrainSpec(global_batch_size=int(first.shape[0]))
    train = train.for_device(budget.device_type)   # the kernel choices the device makes
    constraints = _one_replica_for_running_stats(model, constraints or Constraints())
    options = options or PlannerOptions()
    devices = device_numbers(budget, train.dtype)
    check_pins(pins_for(constraints, train), devices, train.global_batch_size)  # before tracing
    measured_for = _measured_for(budget, devices, constraints, train, options)
    # A padding mask is left out where it changes no counted output: the model is traced
    # as called without it (partc.runtime.padding). Of rows padded at their end, only once
    # the trace shows the model causal throughout; else it is traced again with the mask.
    left_out, padded = (), False
    if len(kwargs) + len(example_inputs) > 1:
        labels = kwargs.get("labels") if loss_fn is None else example_target
        left_out, padded = mask_left_out(model, kwargs, labels)
        left_out += plain_positions(model, kwargs, left_out)
    # The structure and the behaviour: models of one shape but other forwards (another
    # activation, an untied weight) are traced and measured apart.
    identity = f"{model_hash(model)}-{behaviour_digest(model)}"

    def measured(left_out: tuple[str, ...]) -> tuple[str | None, Any, Any]:
        """The analysis key, graph (None when cached) and analysis of the model
        traced without the padding masks ``left_out`` (the key tells that from a model
        given no mask)."""
        given = {key: value for key, value in kwargs.items() if key not in left_out}
        key = model_key(identity, (example_inputs, given) if given else example_inputs,
                        example_target, loss_fn, name,
                        (measured_for, ("left out", left_out)) if left_out else measured_for
                        ) if cache is not None else None
        if cache is not None:
            held.enter_context(cache.computing("analysis", key))
            analysis = cache.analysis(key)
            if analysis is not None:
                return key, None, analysis
        start = time.perf_counter()
        graph, analysis = analyze(model, example_inputs, kwargs=given, loss_fn=loss_fn,
                                  example_target=example_target, name=name,
                                  attention=train.attention, autocast=autocast_dtype(train),
                                  autocast_device=budget.device_type, shift_labels=True)
        log.info("analysed %s: %d layers in %.2f s", analysis.summary.name,
                 len(analysis.layers), time.perf_counter() - start)
        return key, graph, analysis

    with contextlib.ExitStack() as held:
        key, graph, analysis = measured(left_out)
        end_padding = PADDING_MASK in left_out and takes_end_padding(analysis.summary)
        if padded and not end_padding:   # not causal throughout: its padding mask stays,
            # and so do any position ids (counted from the mask by some models)
            left_out = ()
            key, graph, analysis = measured(left_out)
        analysis = dataclasses.replace(analysis, summary=dataclasses.replace(
            analysis.summary, left_out=left_out, pads_at_end=end_padding))
        constraints = _whole_batch_loss(model, example_inputs, loss_fn, example_target,
                                        analysis, constraints, train)
        problem = build_problem(analysis, budget, train, constraints, graph, options)
        if cache is not None and graph is not None:
            cache.put_analysis(key, problem.model)
    start = time.perf_counter()
    recorded = BudgetInfo.from_dict(budget.to_dict(train.dtype))
    with (cache.computing("plan", problem_key(problem)) if cache is not None
          else contextlib.nullcontext()):
        plan = cache.plan(problem) if cache is not None else None
        if plan is not None:
            # The cache keys on what the planner reads; the rest of the setup (the
            # runtime's max_grad_norm, the budget's name) is this compile's, not the
            # stored plan's.
            plan = dataclasses.replace(plan, budget=recorded,
                                       train=chosen_kernels(train, problem, plan.schedule))
            validate_plan(problem, plan)
        else:
            plan = plan_problem(problem, budget=recorded, train=train, options=options,
                                table_cache=(cache.table_cache(problem) if cache is not None
                                             else None))
            if cache is not None:
                cache.put_plan(problem, plan)
    log.info("planned in %.2f s: %s", time.perf_counter() - start, plan.solver.status)
    _say_batch_norm_per_microbatch(model, plan)
    return Program(plan=plan, problem=problem, graph=graph, model=model, loss_fn=loss_fn)


def _check_compile_arguments(model: Any, budget: Any, train: Any, loss_fn: Any,
                             constraints: Any, options: Any, name: Any, cache: Any) -> None:
    """Each of ``compile``'s arguments of the type it takes, or an ArgumentTypeError
    naming it (``example_inputs`` is checked where it is read)."""
    where, none = "partc.compile", type(None)
    check_argument(where, "model", model, (nn.Module,), "a torch.nn.Module")
    check_argument(where, "budget", budget, (DeviceBudget,), "a partc.DeviceBudget",
                   _keywords_hint("DeviceBudget", budget)
                   or "e.g. partc.DeviceBudget(num_devices=8, device='H100-80GB')")
    check_argument(where, "train", train, (TrainSpec, none), "a partc.TrainSpec or None",
                   _keywords_hint("TrainSpec", train))
    check_argument(where, "constraints", constraints, (Constraints, none),
                   "a partc.Constraints or None", _keywords_hint("Constraints", constraints))
    check_argument(where, "options", options, (PlannerOptions, none),
                   "a partc.PlannerOptions or None", _keywords_hint("PlannerOptions", options))
    check_argument(where, "name", name, (str, none), "a str or None")
    check_argument(where, "cache", cache, (PlanCache, none), "a partc.PlanCache or None")
    if loss_fn is not None and not callable(loss_fn):
        check_argument(where, "loss_fn", loss_fn, (none,),
                       "a callable loss_fn(output, target) or None")


def _keywords_hint(cls: str, value: Any) -> str:
    """For a dict given where a spec class is wanted: how to make one of it."""
    return f"pass partc.{cls}(**that_dict)" if isinstance(value, dict) else ""


def _whole_batch_loss(model: torch.nn.Module, example_inputs: tuple, loss_fn: Callable | None,
                      example_target: Any, analysis: Any, constraints: Constraints,
                      train: TrainSpec) -> Constraints:
    """A model whose mixture-of-experts router feeds a load-balancing loss that couples
    the batch's samples plans one replica and one microbatch, unless the training setup
    declares each microbatch's loss its own (:mod:`partc.batch_coupling`)."""
    if train.loss_per_microbatch or not any(
            layer.moe is not None and layer.moe.aux_loss for layer in analysis.layers):
        return constraints
    if not couples_samples(model, example_inputs, loss_fn, example_target):
        return constraints
    return restrict(constraints, train, "a mixture-of-experts router's load-balancing loss "
                                        "over the whole batch")


def _say_batch_norm_per_microbatch(model: torch.nn.Module, plan: Plan) -> None:
    """A model with BatchNorm in training mode, planned in several microbatches,
    normalises each microbatch over its own samples, as gradient accumulation on one
    device does (the runtime's running statistics see the microbatches in order), not
    over the global batch: said once, so that a loss that differs from one device's
    whole-batch step is not a surprise."""
    norm = next((name for name, module in model.named_modules()
                 if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
                 and module.training), None)
    if norm is None or plan.num_microbatches * plan.dp == 1:
        return
    log.warning("%s (BatchNorm, training mode) normalises each microbatch of %d samples "
                "over its own samples, as gradient accumulation on one device does, not "
                "the global batch of %d: pin num_microbatches=1 for whole-batch statistics",
                norm, plan.micro_batch_size, plan.global_batch_size)


def _one_replica_for_running_stats(model: torch.nn.Module,
                                   constraints: Constraints) -> Constraints:
    """A model whose forward updates running statistics (BatchNorm in training mode)
    plans one replica: dp replicas would each update theirs from their own data and
    drift apart, where one device sees every microbatch in order. A pinned dp > 1 is
    refused."""
    tracking = [(name, module) for name, module in model.named_modules()
                if isinstance(module, torch.nn.modules.batchnorm._NormBase)
                and module.track_running_stats and module.training]
    if not tracking:
        return constraints
    name, module = tracking[0]
    if constraints.dp is not None and constraints.dp > 1:
        raise PartcError(
            f"{name} ({type(module).__name__}) updates its running statistics in forward: "
            f"under dp={constraints.dp} each replica would update its own from its own data "
            "and they would drift apart. Leave dp to the planner or pin dp=1, or normalise "
            "without running statistics (track_running_stats=False, LayerNorm, GroupNorm)")
    return dataclasses.replace(constraints, dp=1)


def _measured_for(budget: DeviceBudget, devices: DeviceNumbers, constraints: Constraints,
                  train: TrainSpec, options: PlannerOptions) -> tuple:
    """What a model's measurement and tensor-parallel variants depend on besides the
    model: the attention it runs, the autocast dtype its layers are measured in and the
    device type they run on (its dropout and attention kernels; none without autocast),
    the degrees and links measured, the sharding chooser's options."""
    degrees = tp_degrees(devices, constraints)
    autocast = autocast_dtype(train)
    return (train.attention, str(autocast), budget.device_type if autocast else None,
            tuple(tensor_parallel_links(devices, degrees)),
            constraints.sequence_parallel, constraints.tp_objective, options.sharding)


@young_collections_only()
def load(directory: str | Path, model: nn.Module, *, loss_fn: Callable | None = None) -> Program:
    """The program saved in ``directory`` for ``model``, without planning again.

    plan.json is data, checked in full before anything runs: its schema (JSON, every key
    known and present, every value of its type: else :class:`PlanFileError` naming the
    field), that it was made for ``model`` (else :class:`PlanMismatchError`), then its
    values against the model measured again as ``compile`` measures it, under the plan's
    budget and training setup (``validate_plan``, no solver: else
    :class:`PlanValidationError` listing every violation)."""
    check_argument("partc.load", "directory", directory, (str, PathLike),
                   "a directory path (str or os.PathLike)")
    check_argument("partc.load", "model", model, (nn.Module,), "a torch.nn.Module")
    if loss_fn is not None and not callable(loss_fn):
        check_argument("partc.load", "loss_fn", loss_fn, (type(None),),
                       "a callable loss_fn(output, target) or None")
    path = Path(directory) / "plan.json"
    if not path.exists():
        raise FileNotFoundError(f"no plan.json in {directory}: save a program there first "
                                "(program.save(directory) or `partc plan ... --out`)")
    plan = read_plan_file(path)
    if plan.model.hash != model_hash(model):
        raise PlanMismatchError(f"{path}: the model (hash {model_hash(model)}) is not the "
                                f"one the plan was made for (hash {plan.model.hash}); "
                                "compile this model")
    if not plan.model.inputs:
        raise PlanFileError(f"{path}: model.inputs is empty (a plan saved before partc "
                            "recorded its inputs): compile the model again",
                            path=str(path), field="model.inputs")
    if loss_fn is None and "loss" in plan.layer_names and plan.model.own_loss is None:
        raise PartcError(f"{path}: the plan trains with a loss (its last layer, 'loss'): "
                         "pass the same loss_fn to partc.load as to partc.compile")
    try:
        budget_from_info(plan.budget)
    except ValueError as error:
        raise PlanFileError(f"{path}: budget: {error}", path=str(path), field="budget") from None
    problem = problem_for_plan(plan, model, loss_fn=loss_fn)
    _validate_file(path, problem, plan)
    return Program(plan=plan, problem=problem, model=model, loss_fn=loss_fn)


def _validate_file(path: Path, problem: PlanningProblem, plan: Plan) -> None:
    """``validate_plan``, its error saying which of the file's sections the problem was
    measured again from (an edited dtype or budget shows as numbers that differ)."""
    try:
        validate_plan(problem, plan)
    except PlanValidationError as error:
        train = plan.train
        raise PlanValidationError(
            f"{path} does not hold for this model, measured again with the plan's train "
            f"(dtype {dtype_name(train.dtype)}, optimizer {train.optimizer}, attention "
            f"{train.attention}) and budget ({plan.budget.device}, memory_bytes "
            f"{list(plan.budget.memory_bytes)}); was it edited? Compile again rather than "
            f"edit a plan.\n{error}") from None
