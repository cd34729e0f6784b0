"""The search over pipeline configurations: ``solve``, the planner's entry point.

Outer enumeration (cheap, exact): every pipeline configuration ``c = (tp, pp, dp, b, m,
schedule, ZeRO stage, ZeRO-2 gradient sync, chunks v)`` with ``tp * pp * dp = N`` devices
and ``dp * b * m = B`` global batch, respecting pins (``v`` virtual stages per rank for
the schedules that run several, where torch's schedule takes the ranks and microbatches;
both gradient syncs only where they differ: ZeRO-2 with dp > 1 and m > 1).
Configurations are visited in order of a lower bound on their step time
(:func:`~.bounds.lower_bound`); one whose bound is no better than the best plan found so
far is pruned. Before any solve, the best plan is seeded with the greedy plan
(:func:`~.bounds.incumbent`) of each mesh's most promising configuration, and its
configuration is solved first. Every configuration not pruned is solved by CP-SAT on its
stage model (:mod:`.stage_model`, :func:`solve_config`), which stops as soon as its proven
bound reaches the best plan's step time. What the search learnt about each mesh
factorisation ``(pp, dp, tp)`` is kept for the report (:mod:`.meshes`).

Every limit is work, never wall-clock time (:mod:`partc.cp_sat`): each solve gets a
share of ``PlannerOptions.work_limit`` (``per_config_work``) in CP-SAT's deterministic
seconds, and the search stops solving when the deterministic seconds its solves spent
reach the limit (configurations not reached are "work limit" in the report, and the plan
FEASIBLE). The Python around the solves is not counted: it is bounded by the
configurations. So a plan is a function of its inputs, the same on every rank and on a
busier machine.

Nothing is kept between calls but what the caller passes: ``solve(..., table_cache=...)``
builds the cost tables with the caller's ``TableCache`` and records there the plan of
each configuration it solved and the best configuration; a later solve of the same problem
(the devices' memory aside) with that cache visits that configuration first and starts
each solve from its earlier plan. ``partc.PlanCache`` keeps one per problem.

With the schedule left to the planner ("auto"), the search above weighs 1F1B by the
closed form (GPipe, which it prices as 1F1B holding every microbatch, only where
pinned: :func:`candidate_configs`), which picks each mesh's batch split, ZeRO stage and plan. (A
pinned schedule's virtual-stage counts are weighed so too.) Then every mesh is priced
with every other schedule torch runs on its configuration (:func:`schedule_candidates`:
interleaved 1F1B, looped BFS and interleaved zero-bubble with 2 virtual stages per rank
up to a layer per run, ZBV and DualPipeV with 2), each played out
(:func:`~partc.cost.evaluate.simulated_step_ps`, the per-rank event simulation), and
the plan that plays out fastest is kept (:func:`partc.planner.joint.choose`). The closed
form is no lower bound on the simulation, so those are pruned by a floor that is
(:func:`~.bounds.played_floor`). Nor does the closed form see how unequal a rank's runs
are, which the interleaved schedules pay for every round: each interleaved plan is also
played re-cut into runs of balanced compute, the same modes, and kept so where that fits
and is faster (:func:`balanced_runs`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections import Counter
from typing import Callable, NamedTuple

from ortools.sat.python import cp_model

from partc import progress
from partc.cost.cp_attention import (all_to_all_fits, all_to_all_refusal,
                                     context_parallel_refusal, sequence_tokens)
from partc.cost.evaluate import Evaluation, evaluate, simulated_step_ps
from partc.cost.host_offload import host_bytes_per_node, host_ready, node_host_bytes
from partc.cost.pipeline_config import PS_PER_S, PipelineConfig
from partc.cost.schedules import feature_refusal, refusal
from partc.cost.schedules import schedule as schedule_info
from partc.cost.tables import CostTable, TableCache, build_cost_table
from partc.cp_sat import deterministic_solver, set_work, work_done
from partc.errors import PlanInfeasibleError
from partc.heap import young_collections_only
from partc.names import CpKind, Outcome, Schedule
from partc.options import PlannerOptions
from partc.plan import ScheduleOption
from partc.planner import joint
from partc.planner.bounds import greedy_result, incumbent, lower_bound, starting_point
from partc.planner.expert_parallel import expand as expand_ep
from partc.planner.meshes import mesh_results
from partc.planner.pins import check_pins
from partc.planner.results import Assignment, ConfigResult, PlannerResult, ScheduleTrial
from partc.planner.stage_model import StageModel
from partc.problem import ZERO2_GRAD_SYNCS, PlanningProblem, effective_zero_stage
from partc.report.explain import explain_infeasible
from partc.spec import AUTO_SCHEDULES


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_choices(problem: PlanningProblem) -> list[tuple[int, bool, str]]:
    """(tp, sequence parallel, objective) the pins allow: tp = 1 and every measured variant."""
    pins = problem.pins
    options = [(1, False, "time", None)] + [(o.tp, o.sequence_parallel, o.objective,
                                             o.choices) for o in problem.model.tensor_parallel]
    allowed, seen = [], set()
    for tp, sp, objective, layer_choices in options:
        if (pins.tp is None or pins.tp == tp) \
                and (pins.sequence_parallel is None or tp == 1 and not pins.sequence_parallel
                     or tp > 1 and pins.sequence_parallel == sp) \
                and (pins.tp_objective is None or tp == 1 or pins.tp_objective == objective) \
                and (tp, sp, layer_choices) not in seen:  # both objectives chose alike
            seen.add((tp, sp, layer_choices))
            allowed.append((tp, sp, objective))
    return allowed


def candidate_configs(problem: PlanningProblem) -> list[PipelineConfig]:
    """Every (tp, cp, cp kind, pp, dp, b, m, schedule, ZeRO stage) the pins and the batch
    allow (ZeRO stages 1-3 only where there is more than one replica)."""
    pins = problem.pins
    # Unpinned, 1F1B alone of the AUTO_SCHEDULES: the closed form gives GPipe the same time
    # from the same rows, and GPipe keeps every microbatch's activations on every rank
    # where 1F1B keeps ``min(m, pp - s)`` on rank ``s``, so whatever fits under GPipe
    # fits under 1F1B as fast. GPipe was 45% of the configurations of Llama-3-70B on
    # 1,024 H100, each with its cost table and bound, none ever chosen.
    schedules = [pins.schedule] if pins.schedule else [Schedule.ONE_F_ONE_B]
    configs = []
    for tp, sp, objective, cp, cp_kind in (
            (tp, sp, objective, cp, kind) for tp, sp, objective in tp_choices(problem)
            for cp, kind in cp_choices(problem, tp, sp, objective)):
        devices = problem.devices.num_devices // (tp * cp)
        pp_options = [pins.pp] if pins.pp else [
            p for p in divisors(devices) if p <= problem.num_layers]
        for pp in pp_options:
            if devices % pp:
                continue
            dp = devices // pp
            if pins.dp is not None and pins.dp != dp:
                continue
            if problem.train.global_batch_size % dp:
                continue
            per_replica = problem.train.global_batch_size // dp
            for b in problem.train.micro_batch_sizes:
                if per_replica % b:
                    continue
                m = per_replica // b
                if pins.num_microbatches is not None and m != pins.num_microbatches:
                    continue
                if pins.micro_batch_size is not None and b != pins.micro_batch_size:
                    continue
                zero_stages = [pins.zero_stage] if pins.zero_stage is not None else (
                    [0, 1, 2, 3] if dp * cp > 1 else [0])
                configs.extend(PipelineConfig(pp=pp, dp=dp, micro_batch_size=b,
                                              num_microbatches=m, schedule=schedule, tp=tp,
                                              sequence_parallel=sp, tp_objective=objective,
                                              zero_stage=zero, chunks=chunks,
                                              zero2_grad_sync=sync, cp=cp, cp_kind=cp_kind,
                                              offload_optimizer=offload[0],
                                              offload_params=offload[1])
                               for schedule in schedules for zero in zero_stages
                               for sync in zero2_grad_syncs(problem, zero, dp * cp, m)
                               for offload in offload_choices(problem, zero, pp, dp * cp, tp,
                                                              m)
                               if feature_refusal(schedule, effective_zero_stage(zero, dp * cp),
                                                   problem.train.compile_pinned) is None
                               for chunks in _chunk_counts(problem, schedule, pp, m))
    return expand_ep(problem, configs)   # the expert-parallel degree (mixture-of-experts)


# A context-parallel degree the search tries unpinned leaves each of a rank's two
# load-balanced chunks at least this many tokens: below it, the ring's per-step latency
# and small attention kernels, which the cost model prices coarsely, would dominate
# (Megatron-Core and torchtitan use cp for sequences of thousands of tokens per rank;
# the Llama 3 405B long-context stage ran 8,192 per rank). A pinned cp is planned at
# any length.
MIN_CP_CHUNK_TOKENS = 1024


def cp_choices(problem: PlanningProblem, tp: int, sequence_parallel: bool = False,
               objective: str = "time") -> list[tuple[int, str | None]]:
    """(cp, kind) the pins and the model allow beside tensor parallelism ``tp``: cp = 1
    (kind None; not when a kind is pinned, nor a ZeRO stage beside dp=1), and each cp > 1 dividing the devices over tp whose ``2 cp`` chunks split
    the sequence evenly (each at least :data:`MIN_CP_CHUNK_TOKENS` tokens unless cp is
    pinned), for a model with attention cores and nothing else reading along the
    sequence (:func:`check_context_parallel` refuses a pinned cp otherwise), as a ring
    and, where every layer's heads and key/value heads divide by cp, as all-to-all."""
    pins = problem.pins
    tokens = sequence_tokens(problem)
    devices = problem.devices.num_devices // tp
    wanted = [pins.cp] if pins.cp is not None else divisors(devices)
    layers = problem.variant(tp, sequence_parallel, objective).layers if tp > 1 \
        else problem.layers
    found: list[tuple[int, str | None]] = []
    for cp in wanted:
        if cp == 1:
            # A pinned kind asks for cp > 1; so does a ZeRO stage pinned beside dp=1 (it
            # shards over the cp ranks, which hold the same parameters).
            if pins.cp_kind is None and not (pins.zero_stage and pins.dp == 1):
                found.append((1, None))
            continue
        if devices % cp or context_parallel_refusal(problem, cp) or (
                pins.cp is None and tokens // (2 * cp) < MIN_CP_CHUNK_TOKENS):
            continue
        kinds = [CpKind.RING]
        if all(all_to_all_fits(layer.attention, cp) for layer in layers
               if layer.attention is not None):
            kinds.append(CpKind.ALL_TO_ALL)
        found += [(cp, kind) for kind in kinds if pins.cp_kind in (None, kind)]
    return found


def check_context_parallel(problem: PlanningProblem) -> None:
    """A PlanInfeasibleError naming the pin, and the op or the heads to blame, when the
    pinned cp (or kind) cannot run on this model: all-to-all pinned where no
    tensor-parallel degree the pins allow leaves each rank heads and key/value heads
    that divide by cp."""
    pins = problem.pins
    if pins.cp is None or pins.cp == 1:
        return
    why = context_parallel_refusal(problem, pins.cp)
    if why is None and pins.cp_kind == CpKind.ALL_TO_ALL:
        why = _all_to_all_why(problem, [pins.cp])
    if why is not None:
        raise PlanInfeasibleError(f"cannot hold the pin cp={pins.cp}: {why}",
                                  resource="pin", pin="cp",
                                  suggestion="drop the cp pin, or pin cp=1")


def _all_to_all_why(problem: PlanningProblem, cps: list[int]) -> str | None:
    """Why all-to-all fits none of ``cps`` beside any tensor-parallel degree the pins
    allow (the first refusal, at the smallest such tp), or None where one fits."""
    refusals = [all_to_all_refusal(problem.variant(tp, sp, objective).layers, cp, tp)
                for tp, sp, objective in tp_choices(problem) for cp in cps
                if (problem.devices.num_devices // tp) % cp == 0]
    return refusals[0] if refusals and all(refusals) else None


def offload_choices(problem: PlanningProblem, zero_stage: int, pp: int, replicas: int,
                    tp: int, num_microbatches: int) -> list[tuple[bool, bool]]:
    """(optimizer offload, parameter offload) a configuration may take: as pinned, else
    none, and where the budget knows its host, the optimizer's and under ZeRO-3 the
    parameters' too; none whose host bytes per node exceed the host's memory even with
    the rank's parameters split evenly over the stages (a lower bound; the solved plan is
    held to it exactly, :func:`host_fits`). ``replicas``: the gradient group's ranks
    (dp x cp), over which ZeRO shards the state."""
    pinned, zero3 = problem.pins.offload, effective_zero_stage(zero_stage, replicas) == 3
    if pinned is not None:
        kinds = ("optimizer" in pinned, "params" in pinned)
        choices = [kinds] if zero3 or not kinds[1] else []
    elif host_ready(problem.devices) is not None:
        return [(False, False)]
    else:
        choices = [(False, False), (True, False)] + ([(True, True)] if zero3 else [])
    even = sum(layer.param_count for layer in problem.layers) / (pp * tp)
    found = []
    for optimizer, params in choices:
        config = PipelineConfig(pp=pp, dp=replicas, tp=tp, micro_batch_size=1,
                                num_microbatches=num_microbatches, schedule="1f1b",
                                zero_stage=zero_stage, offload_optimizer=optimizer,
                                offload_params=params)
        if optimizer and host_bytes_per_node(problem, config, [even]) \
                > problem.devices.host_memory:
            continue
        found.append((optimizer, params))
    return found


def host_fits(problem: PlanningProblem, result: "ConfigResult | None") -> bool:
    """Whether a solved configuration's offloaded state and activations fit the host's
    memory per node (:func:`partc.cost.host_offload.node_host_bytes`)."""
    if result is None or problem.devices.host_memory is None:
        return True
    local = problem.variant(result.table.config.tp, result.table.config.sequence_parallel,
                            result.table.config.tp_objective)
    stages = result.evaluation.stages
    need = node_host_bytes(local, result.table.config, [s.param_count for s in stages],
                           [s.memory.host for s in stages])
    return need <= problem.devices.host_memory


def zero2_grad_syncs(problem: PlanningProblem, zero_stage: int, replicas: int,
                     num_microbatches: int) -> list[str]:
    """The ZeRO-2 gradient syncs a configuration may take: the pinned one, else both
    where they differ (ZeRO-2 over several replicas, several microbatches), else the
    default."""
    pinned = problem.pins.zero2_grad_sync
    if pinned is not None:
        return [pinned]
    if effective_zero_stage(zero_stage, replicas) == 2 and num_microbatches > 1:
        return list(ZERO2_GRAD_SYNCS)
    return [ZERO2_GRAD_SYNCS[0]]


def virtual_stage_counts(problem: PlanningProblem, pp: int) -> range:
    """Virtual stages per rank the search tries where a schedule takes any number (a
    pinned ``virtual_stages`` replaces them): 2 up to the layers per rank, so that every
    run holds a layer; Megatron's interleavings go as far as one block per run."""
    return range(2, problem.num_layers // pp + 1)


def schedule_candidates(problem: PlanningProblem, config: PipelineConfig
                        ) -> list[PipelineConfig]:
    """The configurations the joint search (:func:`partc.planner.joint.choose`) prices
    besides ``config``: ``config``
    under every schedule (:class:`~partc.names.Schedule`) the closed-form search does
    not weigh, with each virtual-stage count the schedule allows
    (:func:`virtual_stage_counts` for those that take any, or the pinned one), where torch runs it on ``config``'s ranks
    and microbatches (:func:`partc.cost.schedules.refusal`) and every run holds a layer;
    with ``config``'s ZeRO stage, or where the runtime refuses the schedule with it
    (``feature_refusal``: a split backward under FSDP) with the highest one it runs
    and the pins allow. With the schedule pinned, it with each other virtual-stage
    count the closed-form search weighed (:func:`_chunk_counts`): the closed form ranks
    those by a fill and drain divided by ``v``, which the schedule played out need not
    follow. None when the stages are pinned, or with one stage."""
    pins = problem.pins
    if pins.stages is not None or config.pp == 1:
        return []
    if pins.schedule is not None:
        return [dataclasses.replace(config, chunks=v) for v in _chunk_counts(
                    problem, config.schedule, config.pp, config.num_microbatches)
                if v != config.chunks]
    found = []
    for name in Schedule:
        zero = _runnable_zero(problem, config, name)
        if name in AUTO_SCHEDULES or zero is None:
            continue
        info = schedule_info(name)
        counts = ([pins.virtual_stages] if pins.virtual_stages is not None
                  else list(info.virtual_stages)
                  or list(virtual_stage_counts(problem, config.pp)))
        # A lower ZeRO stage takes its own gradient sync (the pinned one, or the default).
        sync = config.zero2_grad_sync if zero == config.zero_stage else zero2_grad_syncs(
            problem, zero, config.grad_dp, config.num_microbatches)[0]
        found += [dataclasses.replace(config, schedule=name, chunks=v, zero_stage=zero,
                                      zero2_grad_sync=sync)
                  for v in counts
                  if info.allows_virtual_stages(v) and config.pp * v <= problem.num_layers
                  and refusal(name, config.pp, v, config.num_microbatches) is None]
    return found


def _runnable_zero(problem: PlanningProblem, config: PipelineConfig, name: str) -> int | None:
    """``config``'s ZeRO stage if the runtime runs ``name`` with it, else the highest
    lower one it runs (and the pins allow), else None."""
    compiled = problem.train.compile_pinned
    if config.dp == 1:
        return config.zero_stage if feature_refusal(name, 0, compiled) is None else None
    pinned = problem.pins.zero_stage
    for zero in range(config.zero_stage, -1, -1):
        if feature_refusal(name, zero, compiled) is None and pinned in (None, zero):
            return zero
    return None


def balanced_runs(problem: PlanningProblem, result: ConfigResult, even: bool = False,
                  greedy: bool = False, cutoff: float = math.inf
                  ) -> tuple[ConfigResult | None, int]:
    """``result``, or where its configuration interleaves (several runs per rank) and no
    stages are pinned, the same layers and recompute modes cut into runs of balanced
    compute (:func:`balanced_cut`) where that fits and plays out faster, or else the
    greedy split (:func:`~.bounds.incumbent`: the fastest modes cut evenly, then
    recompute where a rank is over its memory) where that plays out faster still; with
    its simulated step time. With ``even``, also cut into runs of equal counts of the
    repeated block (the layers that share the most common row), the layers before the
    first block with the first run and those after the last with the last
    (Megatron-Core's even split of the blocks: the embeddings, final norm, head and loss
    with the blocks beside them), where that plays out faster still. ``greedy``:
    ``result`` is the greedy split already (the joint search's trials mostly are).

    The closed form CP-SAT minimises charges a rank its runs' sum, however unequal they
    are, but the interleaved schedules run a rank's runs in turn: a run much longer
    than the others keeps the next ranks waiting every round (seen: Megatron's 76B
    SC'21 run, its interleaved 1F1B pinned, split as 1, 14 and 1 blocks per run on a
    rank, played out 1.5x the step of the even split, which the closed form prices the
    same). Where memory is tight CP-SAT goes further: it gives the runs that hold the
    most microbatches in flight the fewest layers, to save recompute, and the balanced
    cut of its modes does not fit (seen: Llama-3-70B on 1,024 H100 at 40 GiB, pp=4 with
    interleaved 1F1B over 3 chunks pinned: runs of 1 to 19 layers, 0.9% faster by the
    closed form and 37% slower played out than the greedy split).

    ``cutoff``: a search that keeps only plans faster than it. A play stops once it is
    sure to reach it (:func:`~partc.cost.evaluate.simulated_step_ps`), and where every
    split does, None and the least of their lower bounds come back instead."""
    config = result.table.config
    step, bubble = simulated_step_ps(config, result.evaluation, cutoff)
    best = (result if bubble is not None else None, step)
    if config.chunks == 1 or problem.pins.stages is not None:
        return best
    table, modes = result.table, result.assignment.modes
    work = [table.layers[l].compute_ps(mode) for l, mode in enumerate(modes)]
    cuts = [balanced_cut(work, config.virtual_stages)]
    if even:
        shared = Counter(id(row) for row in table.layers)
        block, count = shared.most_common(1)[0]
        if count > 1:
            cuts.append(balanced_cut([int(id(row) == block) for row in table.layers],
                                     config.virtual_stages))
    splits = [Assignment(stage_of=cut, modes=modes) for cut in cuts if cut is not None]
    if not greedy:
        splits.append(incumbent(problem.variant(config.tp, config.sequence_parallel,
                                                config.tp_objective), table))
    tried = {result.assignment}
    for assignment in splits:
        if assignment is None or assignment in tried:   # None: no greedy split fits
            continue
        tried.add(assignment)
        evaluation = evaluate(table, assignment.stage_of, assignment.modes)
        if not evaluation.fits:
            continue
        played, bubble = simulated_step_ps(
            config, evaluation, cutoff if best[0] is None else min(cutoff, best[1]))
        if bubble is None:   # played past the cutoff, or past the best split so far
            if best[0] is None:
                best = (None, min(best[1], played))
        elif best[0] is None or played < best[1]:
            best = (dataclasses.replace(result, evaluation=evaluation, assignment=assignment),
                    played)
    return best


def balanced_cut(work: list[int], runs: int) -> tuple[int, ...] | None:
    """The run of each of the consecutive items of ``work`` cut into ``runs`` non-empty
    runs whose largest sum is least (None when there are fewer items than runs): the
    least bound a greedy packing meets in that many runs or fewer, by bisection, then
    runs split off until there are ``runs``."""
    if len(work) < runs:
        return None

    def pack(bound: int) -> list[int] | None:
        """Run sizes of the greedy packing under ``bound``, or None past ``runs``."""
        sizes, total = [0], 0
        for item in work:
            if sizes[-1] and total + item > bound:
                sizes.append(0)
                total = 0
                if len(sizes) > runs:
                    return None
            sizes[-1] += 1
            total += item
        return sizes

    low, high = max(work), sum(work)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if pack(middle) is not None else (middle + 1, high)
    sizes = pack(low)
    while len(sizes) < runs:   # split the last run of several items; no sum grows
        at = max(i for i, size in enumerate(sizes) if size > 1)
        sizes[at:at + 1] = [sizes[at] - 1, 1]
    return tuple(j for j, size in enumerate(sizes) for _ in range(size))


def _chunk_counts(problem: PlanningProblem, schedule: str, pp: int, m: int) -> list[int]:
    """Virtual stages per rank the schedule runs (:mod:`partc.cost.schedules`): 1 for GPipe
    and 1F1B; for the others every ``v`` of :func:`virtual_stage_counts` the schedule
    allows (or the pinned one) with a layer for each of the ``pp * v`` runs, where torch's schedule takes
    ``pp`` ranks and ``m`` microbatches (:func:`partc.cost.schedules.refusal`), pp > 1 and
    the stages are not pinned."""
    info = schedule_info(schedule)
    pinned = problem.pins.virtual_stages
    counts = [pinned] if pinned is not None else (
        list(info.virtual_stages) or list(virtual_stage_counts(problem, pp)))
    if counts != [1] and (pp == 1 or problem.pins.stages is not None):
        return []
    return [v for v in counts if pp * v <= problem.num_layers
            and refusal(schedule, pp, v, m) is None]


def pinned_stages(problem: PlanningProblem) -> list[int] | None:
    """The pinned stage of each layer (``check_pins`` has checked the names)."""
    stages = problem.pins.stages
    if stages is None:
        return None
    return [s for s, stage in enumerate(stages) for _ in stage]


def _no_config_message(problem: PlanningProblem) -> str:
    pins, train = problem.pins, problem.train
    return (f"no pipeline configuration matches the pins and the batch: "
            f"{problem.devices.num_devices} devices, global batch {train.global_batch_size}, "
            f"micro-batch sizes {list(train.micro_batch_sizes)}, pins pp={pins.pp} "
            f"dp={pins.dp} microbatches={pins.num_microbatches} "
            f"micro_batch_size={pins.micro_batch_size} cp={pins.cp} "
            f"cp_kind={pins.cp_kind}, {problem.num_layers} layers. "
            + (" ".join(_why_no_config(problem)) or
               "pp must divide the device count and be at most the number of layers, and "
               "dp x micro-batch size x microbatches must equal the global batch."))


def _why_no_config(problem: PlanningProblem) -> list[str]:
    """What rules every configuration out, where it is a pin other than the mesh's and
    the batch's: a tensor-parallel layout no measured variant has, or a schedule that
    cannot run any mesh and batch split the other pins leave."""
    pins = problem.pins
    if not tp_choices(problem):
        measured = ", ".join(sorted({
            f"tp={o.tp} {'with' if o.sequence_parallel else 'without'} sequence parallelism"
            for o in problem.model.tensor_parallel})) or "none"
        return [f"No measured tensor-parallel layout matches the pins tp={pins.tp}, "
                f"sequence_parallel={pins.sequence_parallel}, tp_objective="
                f"{pins.tp_objective} (measured for this model: {measured})."]
    if pins.cp_kind == CpKind.ALL_TO_ALL and pins.cp is None:
        tokens, whole = sequence_tokens(problem), problem.devices.num_devices
        why = _all_to_all_why(problem, [cp for cp in divisors(whole)[1:]
                                        if tokens % (2 * cp) == 0])
        if why is not None:
            return [f"The pinned cp_kind='all-to-all' fits no cp: {why}."]
    if pins.zero_stage and pins.dp == 1 and pins.cp is None:
        return [f"zero_stage={pins.zero_stage} with dp=1 pinned shards over the context-"
                f"parallel ranks (dp x cp), and no cp > 1 fits this model and budget: pin "
                f"zero_stage=0, or dp > 1."]
    if pins.schedule is None:
        return []
    free = candidate_configs(dataclasses.replace(
        problem, pins=dataclasses.replace(pins, schedule=None)))
    reasons: set[str] = set()
    for config in free:
        zero = effective_zero_stage(config.zero_stage, config.grad_dp)
        feature = feature_refusal(pins.schedule, zero, problem.train.compile_pinned)
        if feature is not None:
            reasons.add(feature)
            continue
        counts = (schedule_info(pins.schedule).virtual_stages
                  or virtual_stage_counts(problem, config.pp))
        if tuple(counts) != (1,) and (config.pp == 1 or pins.stages is not None):
            reasons.add(f"{pins.schedule} runs several virtual stages per rank: it needs "
                        f"more than one pipeline stage and the stages not pinned")
            continue
        for v in counts:
            refused = refusal(pins.schedule, config.pp, v, config.num_microbatches)
            if refused is None and config.pp * v > problem.num_layers:
                refused = (f"{pins.schedule} with {v} virtual stages per rank over "
                           f"pp={config.pp} needs {config.pp * v} layers or more")
            if refused is not None:
                reasons.add(refused)
    if not reasons:
        return []
    shown = sorted(reasons)
    return [f"The pinned schedule runs on none of the meshes and batch splits the other "
            f"pins leave: {'; '.join(shown[:3])}" + (" ..." if len(shown) > 3 else "") + "."]


_STATUS = {cp_model.OPTIMAL: "OPTIMAL", cp_model.FEASIBLE: "FEASIBLE",
           cp_model.INFEASIBLE: "INFEASIBLE", cp_model.MODEL_INVALID: "MODEL_INVALID",
           cp_model.UNKNOWN: "UNKNOWN"}


class ConfigSolve(NamedTuple):
    """What :func:`solve_config` found for one configuration."""
    result: ConfigResult | None   # None when there is none
    status: str                   # CP-SAT's, or "BEATEN" when stopped by the cutoff
    proven: float                 # the step time CP-SAT's bound proves
    work: float                   # CP-SAT's deterministic seconds spent


def solve_config(problem: PlanningProblem, table: CostTable, options: PlannerOptions,
                 work: float, pinned: list[int] | None,
                 cutoff: int | None = None, previous: Assignment | None = None,
                 table_cache: TableCache | None = None) -> ConfigSolve:
    """Solve one configuration within ``work`` deterministic seconds of CP-SAT.
    ``previous`` (this configuration's plan under another memory limit) is the hint when
    it still fits and beats the greedy incumbent. ``table_cache`` is the one ``table``
    was built with.

    ``cutoff`` (the best step time found elsewhere) is not a constraint: proving
    "nothing below the cutoff" was seen to take CP-SAT far longer than solving outright.
    Instead the search stops as soon as its proven bound reaches it, which is often long
    before the optimum of a losing configuration is proven.
    """
    start, spent = time.perf_counter(), 0.0
    problem = problem.variant(table.config.tp, table.config.sequence_parallel,
                              table.config.tp_objective)
    start_from = starting_point(problem, table, pinned, previous, table_cache)
    chunks = table.config.fill_divisor   # the objective is this x the step time
    # The memory at the optimizer step rarely binds (the activations outweigh the step's
    # temporaries), and its constraints were seen to slow CP-SAT's search (Llama-3-70B
    # at 40 GiB: a 2.5% slower plan in the same time). The model without them is solved
    # first; only a plan that does not fit at its step is solved again with them.
    for with_step in (False, True):
        built = StageModel(problem, table, pinned, step=with_step)
        if start_from is not None:
            built.add_hint(start_from[0])
        solver = _solver(options)
        status, proven, used = _run_solver(solver, built, cutoff, chunks, work - spent)
        spent += used
        if with_step or status not in ("OPTIMAL", "FEASIBLE"):
            break
        assignment = built.assignment(solver)
        if evaluate(table, assignment.stage_of, assignment.modes).fits:
            break
    result, status, proven = _result(built, solver, status, proven, table, start_from, cutoff,
                                     chunks, start)
    return ConfigSolve(result, status, proven, spent)


def _solver(options: PlannerOptions) -> cp_model.CpSolver:
    solver = deterministic_solver(0.0, options.num_workers, options.seed)
    solver.parameters.cp_model_presolve = options.presolve
    return solver


def _run_solver(solver: cp_model.CpSolver, built: StageModel, cutoff: int | None,
                chunks: int, work: float) -> tuple[str, int, float]:
    """Solve ``built`` within ``work`` deterministic seconds: CP-SAT's status by name,
    the step time its bound proves and the work spent. ``cutoff``: stop once the bound
    reaches it (the callback runs on the one worker's thread, at a point of the search
    that does not depend on the clock)."""

    def step_floor(objective_bound: float) -> int:
        """The least step time an objective bound allows (pipeline_ps floors its
        fill-and-drain term divided by the chunks)."""
        return -(-(built.step_ps(objective_bound, bound=True) - chunks + 1) // chunks)

    if cutoff is not None:
        def stop_when_beaten(bound: float) -> None:
            if step_floor(bound) >= cutoff:
                solver.stop_search()
        solver.best_bound_callback = stop_when_beaten
    code, spent = _solve(solver, built, work,
                         lambda: cutoff is not None
                         and step_floor(solver.best_objective_bound) >= cutoff)
    return _STATUS.get(code, "UNKNOWN"), step_floor(solver.best_objective_bound), spent


def _result(built: StageModel, solver: cp_model.CpSolver, status: str, proven: int,
            table: CostTable, start_from: tuple[Assignment, Evaluation] | None,
            cutoff: int | None, chunks: int,
            start: float) -> tuple[ConfigResult | None, str, float]:
    """:func:`solve_config`'s answer from the last solve."""
    if status == "MODEL_INVALID":
        raise RuntimeError(f"internal error: invalid CP-SAT model for {table.config}: "
                           f"{built.model.validate()}")
    beaten = status == "UNKNOWN" and cutoff is not None and proven >= cutoff
    if status == "UNKNOWN" and start_from is not None and not beaten:
        status = "FEASIBLE"   # CP-SAT found nothing in its work: the incumbent still is a plan
        assignment, evaluation = start_from
    elif status not in ("OPTIMAL", "FEASIBLE"):
        return None, "BEATEN" if beaten else status, proven
    else:
        assignment = built.assignment(solver)
        evaluation = evaluate(table, assignment.stage_of, assignment.modes)
        # The model over-approximates nothing at an optimum; a feasible incumbent may
        # carry slack in its auxiliary variables, so the evaluation can only be lower.
        if chunks * evaluation.step_ps > built.step_ps(solver.objective_value) \
                or not evaluation.fits:
            raise RuntimeError(f"internal error: CP-SAT objective {solver.objective_value} "
                               f"(x{chunks}) disagrees with the cost model "
                               f"({evaluation.step_ps}) for {table.config}")
        if status == "FEASIBLE" and start_from is not None \
                and start_from[1].step_ps < evaluation.step_ps:
            # Stopped by the work limit: never worse than the plan it started from
            # (CP-SAT may drop a hint it cannot complete within it).
            assignment, evaluation = start_from
    bound = min(proven, evaluation.step_ps) if status == "FEASIBLE" else evaluation.step_ps
    return ConfigResult(table=table, assignment=assignment, evaluation=evaluation,
                        status=status, bound=bound,
                        solve_time_s=time.perf_counter() - start), status, proven


_FULLER_LP_WORK = 1.0


def _solve(solver: cp_model.CpSolver, built: StageModel, work: float,
           settled: Callable[[], bool]) -> tuple[int, float]:
    """CP-SAT's status code on ``built`` within ``work`` deterministic seconds, and the
    work spent. Where memory is weighed per run (``StageModel.splits_runs``) neither of
    CP-SAT's linearizations proves every model quickly on one worker: the default one
    leaves the bound of the 124M GPT's interleaved 1F1B at 1.5 GiB 17% below its optimum
    (20 s), where the fuller one proves it in 0.7 s and fails on interleaved
    zero-bubble, which the default proves in 1.7 s. So the fuller one runs first, for a
    quarter of the work or ``_FULLER_LP_WORK`` (it proves the first in 0.3), and unless
    it settles the model (``settled``: its bound reached the cutoff) the default one
    runs the rest, from the same hint (the fuller one's plans, where it fails, are
    poor)."""
    if not built.splits_runs:
        set_work(solver, work)
        return solver.solve(built.model), work_done(solver)
    solver.parameters.linearization_level = 2
    set_work(solver, min(work / 4, _FULLER_LP_WORK))
    code = solver.solve(built.model)
    spent = work_done(solver)
    if code in (cp_model.OPTIMAL, cp_model.INFEASIBLE, cp_model.MODEL_INVALID) \
            or spent >= work or settled():
        return code, spent
    solver.parameters.linearization_level = 1
    set_work(solver, work - spent)
    code = solver.solve(built.model)
    return code, spent + work_done(solver)


@young_collections_only()
def solve(problem: PlanningProblem, options: PlannerOptions = PlannerOptions(),
          table_cache: TableCache | None = None) -> PlannerResult:
    """The best plan over all configurations, or PlanInfeasibleError with a way out.

    ``table_cache`` (None: a fresh one) builds the cost tables and keeps what this solve
    learns for the next: it must come from this problem or one that differed only in the
    devices' memory (``PlanCache.table_cache`` keys them so), since its rows are keyed by the
    layers' numbers, not by the devices and training numbers they were computed with.
    """
    start = time.perf_counter()
    check_pins(problem.pins, problem.devices, problem.train.global_batch_size,
               tuple(layer.name for layer in problem.layers))
    check_context_parallel(problem)
    pinned = pinned_stages(problem)
    configs = candidate_configs(problem)
    if not configs:
        raise PlanInfeasibleError(_no_config_message(problem), resource="configuration")
    cache = table_cache if table_cache is not None else TableCache()
    cache.greedy.clear()   # the previous solve's tables are not this one's
    tables = [build_cost_table(problem, c, cache) for c in configs]
    floors = [lower_bound(t, cache) for t in tables]
    # Re-planning (the cache saw a problem that differed only in memory): the previous
    # best configuration first, so its plan prunes the rest early.
    order = sorted(range(len(tables)),
                   key=lambda i: (tables[i].config != cache.best_config, floors[i], i))
    bound, solved, pruned, all_optimal = None, 0, 0, True
    spent = 0.0   # CP-SAT's deterministic seconds: the search's budget is work, not time
    # Per configuration: its ConfigResult, or why it has none.
    outcomes: list[ConfigResult | Outcome] = [Outcome.INFEASIBLE] * len(tables)
    best = None if pinned is not None else _seed(problem, tables, floors, order, cache)
    if not host_fits(problem, best):
        best = None
    if best is not None:   # solved first: CP-SAT improves the seed while its bound is fresh
        seed = tables.index(best.table)
        outcomes[seed] = best
        if tables[order[0]].config != cache.best_config:
            order.remove(seed)
            order.insert(0, seed)
    # The least lower bound of the configurations from the k-th on, for the progress.
    ahead = list(itertools.accumulate(reversed([floors[i] for i in order]), min,
                                      initial=math.inf))[::-1]
    for done, i in enumerate(order):
        _report(tables, order, ahead, done, bound, best)
        table, floor = tables[i], floors[i]
        if floor == math.inf:
            pruned += 1
            continue
        seeded = isinstance(outcomes[i], ConfigResult)   # the greedy seed's configuration
        if best is not None and floor >= best.evaluation.step_ps:
            pruned += 1
            outcomes[i] = outcomes[i] if seeded else Outcome.PRUNED
            bound = floor if bound is None else min(bound, floor)
            continue
        remaining = options.work_limit - spent
        if remaining <= 0 and best is not None:
            all_optimal = False
            outcomes[i] = outcomes[i] if seeded else Outcome.WORK_LIMIT
            bound = floor if bound is None else min(bound, floor)
            continue
        cutoff = best.evaluation.step_ps if best is not None else None
        result, status, proven, used = solve_config(
            problem, table, options, min(remaining, options.per_config_work), pinned, cutoff,
            cache.solutions.get(table.config), cache)
        spent += used
        solved += 1
        if not host_fits(problem, result):   # rare: the lower bound let it through
            outcomes[i] = Outcome.INFEASIBLE
            continue
        if result is None:
            if status == "BEATEN":  # proven no better than the best plan
                outcomes[i] = outcomes[i] if seeded else Outcome.PRUNED
                floors[i] = max(floor, math.ceil(proven))
                bound = floors[i] if bound is None else min(bound, floors[i])
            elif status == "UNKNOWN":
                all_optimal = False
                outcomes[i] = outcomes[i] if seeded else Outcome.WORK_LIMIT
                bound = floor if bound is None else min(bound, floor)
            continue
        if result.bound < floor:   # CP-SAT proved less than the lower bound knows
            result = dataclasses.replace(result, bound=int(floor))
        outcomes[i] = result
        cache.solutions[table.config] = result.assignment
        all_optimal &= result.status == "OPTIMAL" or (
            cutoff is not None and result.bound >= cutoff)
        bound = result.bound if bound is None else min(bound, result.bound)
        if best is None or result.evaluation.step_ps < best.evaluation.step_ps:
            best = result
    _report(tables, order, ahead, len(order), bound, best)
    if best is None:
        raise explain_infeasible(problem, tables)
    cache.best_config = best.table.config
    bound = min(bound, best.evaluation.step_ps)
    chosen = joint.choose(problem, tables, outcomes, best, options, cache,
                          options.work_limit - spent, floors)
    meshes = joint.priced_meshes(mesh_results(problem, tables, floors, outcomes, best),
                                 chosen)
    trials = chosen.trials
    return PlannerResult(
        best=chosen.result, status="OPTIMAL" if all_optimal and chosen.finished
        else "FEASIBLE", bound=bound,
        solve_time_s=time.perf_counter() - start,
        configs_total=len(configs) + len(trials) - 1,
        configs_solved=solved + sum(t.result is not None and not t.greedy
                                    for t in trials[1:]),
        configs_pruned=pruned + sum(t.why in (joint.PRUNED, joint.PLAYED_PAST) for t in trials),
        configs_played=sum(t.result is not None and t.greedy or t.why == joint.NO_SPLIT
                           for t in trials[1:]),
        meshes=meshes, schedule_trials=trials)


def _report(tables: list[CostTable], order: list[int], ahead: list[float], done: int,
            bound: float | None, best: ConfigResult | None) -> None:
    """The search's progress: configurations done, the incumbent's step time and the
    least step time still possible: the least of what was proven for the configurations
    done (``bound``) and of the lower bounds of those to do (``ahead[done]``)."""
    incumbent = best.evaluation.step_ps if best is not None else None
    lowest = min(x for x in (ahead[done], bound, incumbent) if x is not None)
    detail = ""
    if done < len(order):
        config = tables[order[done]].config
        detail = (f"pp={config.pp} dp={config.dp} cp={config.cp} tp={config.tp}, "
                  f"{config.micro_batch_size} x {config.num_microbatches}, {config.schedule}")
    progress.update("search", done, len(order), detail,
                    incumbent_s=None if incumbent is None else incumbent / 1e12,
                    bound_s=None if lowest == math.inf else lowest / 1e12)


def _seed(problem: PlanningProblem, tables: list[CostTable], floors: list[float],
          order: list[int], cache: TableCache) -> ConfigResult | None:
    """The best greedy incumbent over each mesh's most promising configuration: a plan
    in hand before any solve, whose step time prunes every configuration bounded above
    it (CP-SAT may then improve on it, configuration by configuration)."""
    firsts: dict[tuple, int] = {}
    for i in order:
        config = tables[i].config
        key = (config.pp, config.dp, config.cp, config.cp_kind, config.tp,
               config.sequence_parallel, config.tp_objective)
        if floors[i] < math.inf:
            firsts.setdefault(key, i)
    best = None
    for i in firsts.values():
        result = greedy_result(problem, tables[i], cache, int(floors[i]))
        if result is not None and (best is None
                                   or result.evaluation.step_ps < best.evaluation.step_ps):
            best = result
    return best


def schedule_options(problem: PlanningProblem, chosen: ConfigResult,
                     cache: TableCache | None = None,
                     trials: tuple[ScheduleTrial, ...] = ()) -> list[ScheduleOption]:
    """Every schedule priced on the chosen configuration's mesh, microbatches and ZeRO
    stage: the chosen plan itself, then each other schedule and virtual-stage count
    (the schedule's own, or :func:`virtual_stage_counts`): the fastest split the joint
    search played for it (``trials``, :func:`partc.planner.joint.choose`: CP-SAT's or
    the greedy one), else the greedy split of its runs (:func:`~.bounds.incumbent`),
    played out by the simulation (so too where the joint search stopped a play once it
    was past the fastest plan, :data:`~partc.planner.joint.PLAYED_PAST`); fastest
    first."""
    config = chosen.table.config
    solved = _trials_of(config, trials)
    step, bubble = simulated_step_ps(config, chosen.evaluation)
    options = [ScheduleOption(schedule=Schedule(config.schedule), virtual_stages=config.chunks,
                              how="chosen", step_time_s=step / PS_PER_S,
                              bubble_fraction=bubble,
                              peak_memory_bytes=max(s.memory.peak
                                                    for s in chosen.evaluation.stages))]
    others = []
    local = problem.variant(config.tp, config.sequence_parallel, config.tp_objective)
    for name in Schedule:
        counts = schedule_info(name).virtual_stages or virtual_stage_counts(problem, config.pp)
        for v in counts:
            if (name, v) == (config.schedule, config.chunks):
                continue
            trial = solved.get((name, v))
            if trial is not None and trial.result is None:
                others.append(ScheduleOption(schedule=name, virtual_stages=v, how=trial.why))
                continue
            if trial is not None:
                evaluation = trial.result.evaluation
                zero = trial.config.effective_zero_stage
                others.append(ScheduleOption(
                    schedule=name, virtual_stages=v,
                    how=("greedy split" if trial.greedy else "solved split") + (f" (ZeRO-{zero})"
                                          if zero != config.effective_zero_stage else ""),
                    step_time_s=trial.step_ps / PS_PER_S,
                    bubble_fraction=simulated_step_ps(trial.config, evaluation)[1],
                    peak_memory_bytes=max(s.memory.peak for s in evaluation.stages)))
                continue
            if v > 1 and (config.pp == 1 or problem.pins.stages is not None
                          or config.pp * v > problem.num_layers):
                continue
            refused = refusal(name, config.pp, v, config.num_microbatches) or (
                feature_refusal(name, config.effective_zero_stage, problem.train.compile_pinned))
            if refused:
                others.append(ScheduleOption(schedule=name, virtual_stages=v, how=refused))
                continue
            other = dataclasses.replace(config, schedule=name, chunks=v)
            table = build_cost_table(problem, other, cache)
            hint = incumbent(local, table, cache)
            if hint is None:
                others.append(ScheduleOption(schedule=name, virtual_stages=v,
                                             how="no split fits"))
                continue
            evaluation = evaluate(table, hint.stage_of, hint.modes)
            step, bubble = simulated_step_ps(other, evaluation)
            others.append(ScheduleOption(
                schedule=name, virtual_stages=v, how="greedy split",
                step_time_s=step / PS_PER_S, bubble_fraction=bubble,
                peak_memory_bytes=max(s.memory.peak for s in evaluation.stages)))
    others.sort(key=lambda o: (o.step_time_s is None, o.step_time_s or 0.0))
    return options + others


def _trials_of(config: PipelineConfig, trials: tuple[ScheduleTrial, ...]) -> dict:
    """Per (schedule, v), the joint search's fastest trial on ``config``'s mesh and
    batch split (any ZeRO stage), else one that says why it has no plan. A trial whose
    play stopped past the fastest plan (``joint.PLAYED_PAST``) has no figure to show:
    left out, its split is played in full instead."""
    found: dict[tuple, ScheduleTrial] = {}
    for trial in trials:
        other = trial.config
        if trial.why == joint.PLAYED_PAST or (
                joint.mesh_key(other), other.micro_batch_size, other.num_microbatches) != (
                joint.mesh_key(config), config.micro_batch_size, config.num_microbatches):
            continue
        key = (other.schedule, other.chunks)
        known = found.get(key)
        if known is None or known.result is None or trial.result is not None and (
                (trial.step_ps, trial.greedy) < (known.step_ps, known.greedy)):
            found[key] = trial if known is None or trial.result is not None else known
    return found
