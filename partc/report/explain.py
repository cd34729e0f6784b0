"""Turn "no plan fits" into an error that names the stage, the need, the limit and a fix.

The search here is a fast dynamic program, not the solver: for each pipeline degree it
finds the contiguous split that minimises the worst stage's memory relative to its limit,
choosing each layer's recompute mode by its own memory (saved activations times the
microbatches in flight, plus what recompute rematerialises) among the modes the user's
pins allow it, and each stage's receive buffers by its cuts. The split it finds is a real
plan, so the memory it needs is one at which the model does fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from partc.cost.pipeline_config import PipelineConfig
from partc.cost.state_bytes import step_total
from partc.cost.tables import CostTable, build_cost_table
from partc.device.usable import communicators, device_memory_for
from partc.errors import PlanInfeasibleError
from partc.names import Schedule
from partc.problem import PlanningProblem
from partc.units import format_bytes


@dataclass(frozen=True, kw_only=True)
class TightestSplit:
    config: PipelineConfig
    stage_layers: tuple[tuple[int, int], ...]   # first and last layer of each stage
    stage_need: tuple[int, ...]
    limits: tuple[int, ...]

    @property
    def ratio(self) -> float:
        return max(n / max(lim, 1) for n, lim in zip(self.stage_need, self.limits))

    @property
    def worst(self) -> int:
        return max(range(len(self.limits)),
                   key=lambda s: self.stage_need[s] / max(self.limits[s], 1))


def _layer_needs(table: CostTable, stage: int,
                 allowed: list[list[str]]) -> tuple[list[int], list[int]]:
    """Per layer on ``stage``: memory with its leanest allowed mode, and that mode's
    transient."""
    # The most microbatches any of its runs holds at once (1F1B: min(m, p - s)).
    inflight = max(max(peak) for peak in table.config.held(stage))
    needs, transients = [], []
    for row, modes in zip(table.layers, allowed):
        mode = min(modes,
                   key=lambda r: (inflight * row.saved_bytes[r] + row.transient_bytes[r], r))
        needs.append(row.state_total + inflight * row.saved_bytes[mode])
        transients.append(row.transient_bytes[mode])
    return needs, transients


def _shared_need(table: CostTable, first: int, last: int) -> tuple[int, list[int]]:
    """The state of the shared groups a stage holding ``first..last`` holds, and their
    optimizer step's temporaries."""
    groups = [g for g in table.shared if any(first <= layer <= last for layer in g.layers)]
    return sum(g.state_total for g in groups), [g.step_bytes for g in groups]


def _receive_need(table: CostTable, stage: int, first: int, last: int) -> int:
    """The receive buffers of stage ``stage`` holding layers ``first..last``
    (:func:`partc.cost.evaluate.receive_bytes`): the gradient crossing its last cut."""
    return table.cut_bytes[last] if stage < table.config.pp - 1 else 0


def tightest_split(table: CostTable, problem: PlanningProblem) -> TightestSplit:
    """The contiguous split minimising the worst stage's need / limit (DP over stages)."""
    layers, pp = table.num_layers, table.config.pp
    # The layers as the table's tensor-parallel rank has them: a shard may offer fewer
    # recompute modes than the whole layer (selective where it would keep no less).
    config = table.config
    problem = problem.variant(config.tp, config.sequence_parallel, config.tp_objective)
    allowed = [problem.allowed_modes(layer) for layer in range(layers)]
    inf = float("inf")
    # best[s][j]: (worst ratio, split) covering layers 0..j with stages 0..s.
    best = [[(inf, ())] * layers for _ in range(pp)]
    need_of: dict[tuple[int, int, int], int] = {}
    for stage in range(pp):
        needs, transients = _layer_needs(table, stage, allowed)
        prefix, state = [0], [0]   # and at the optimizer step: the state, its temporaries
        for n, row in zip(needs, table.layers):
            prefix.append(prefix[-1] + n)
            state.append(state[-1] + row.state_total
                         + (row.step_bytes if table.step_sums else 0))
        for j in range(stage, layers - (pp - 1 - stage)):
            transient, step, options = 0, 0, []
            for i in range(j, stage - 1, -1):
                transient = max(transient, transients[i])
                step = step if table.step_sums else max(step, table.layers[i].step_bytes)
                if stage == 0 and i > 0:
                    continue
                before, split = best[stage - 1][i - 1] if stage else (0.0, ())
                if before == inf:
                    continue
                shared, steps = _shared_need(table, i, j)
                at_step = step_total([step, *steps], table.step_sums)
                need = shared + max(prefix[j + 1] - prefix[i] + transient
                                    + _receive_need(table, stage, i, j),
                                    state[j + 1] - state[i] + at_step)
                need_of[stage, i, j] = need
                options.append((max(before, need / max(table.limits[stage], 1)), split + ((i, j),)))
            if options:
                best[stage][j] = min(options, key=lambda o: o[0])
    _, split = best[pp - 1][layers - 1]
    need = tuple(need_of[s, a, b] for s, (a, b) in enumerate(split))
    return TightestSplit(config=table.config, stage_layers=split, stage_need=need,
                         limits=table.limits)


def _fewest_stages_that_fit(problem: PlanningProblem, micro_batch_size: int,
                            start: int) -> int | None:
    """Smallest pp >= start at which the tightest split fits, one replica, 1F1B."""
    memory = min(problem.devices.memory_bytes)
    for pp in range(start, problem.num_layers + 1):
        devices = replace(problem.devices, num_devices=pp, memory_bytes=(memory,) * pp)
        config = PipelineConfig(
            pp=pp, dp=1, micro_batch_size=micro_batch_size, schedule=Schedule.ONE_F_ONE_B,
            num_microbatches=problem.train.global_batch_size // micro_batch_size)
        problem_pp = replace(problem, devices=devices)
        if tightest_split(build_cost_table(problem_pp, config), problem_pp).ratio <= 1:
            return pp
    return None


def explain_infeasible(problem: PlanningProblem, tables: list[CostTable]) -> PlanInfeasibleError:
    # Contiguous splits of one run per stage; interleaved tables only when pinned.
    tables = [t for t in tables if t.config.chunks == 1] or tables
    splits = [tightest_split(t, problem) for t in tables]
    tight = min(splits, key=lambda s: (s.ratio, -s.config.pp))
    names = [layer.name for layer in problem.layers]
    stage = tight.worst
    first, last = tight.stage_layers[stage]
    need, limit = tight.stage_need[stage], tight.limits[stage]
    config = tight.config
    if tight.ratio <= 1:
        return PlanInfeasibleError(
            f"the solver found no plan within its work limit, although one fits "
            f"(pp={config.pp}, micro-batch size {config.micro_batch_size}); raise "
            f"PlannerOptions.work_limit (deterministic seconds of CP-SAT work)",
            stage=stage, resource="solver work")
    devices = problem.devices
    groups = communicators(devices.num_devices, config.pp, config.dp, config.tp, config.ep)
    # A device total (as CUDA reports it) that leaves the need after the reserves.
    fixes = [f"{format_bytes(device_memory_for(max(tight.stage_need), devices, groups))} "
             f"per device"]
    fewest = _fewest_stages_that_fit(problem, config.micro_batch_size,
                                     max(c.pp for c in (s.config for s in splits)) + 1)
    if fewest is not None:
        fixes.append(f"{fewest} devices (pp={fewest}, one replica)")
    span = names[first] if first == last else f"{names[first]} .. {names[last]}"
    message = (
        f"no plan fits {problem.devices.num_devices} devices of "
        f"{format_bytes(min(problem.devices.memory_bytes))}: even the tightest split "
        f"(pp={config.pp}{f' x cp={config.cp} ({config.cp_kind})' if config.cp > 1 else ''}"
        f"{f' x tp={config.tp}' if config.tp > 1 else ''}, micro-batch size "
        f"{config.micro_batch_size}, {config.schedule}, recompute where it saves memory) "
        f"needs {format_bytes(need)} of memory on stage {stage} ({span}) against a limit of "
        f"{format_bytes(limit)}{_reserved(min(devices.memory_bytes), limit)}. It would fit with "
        + " or with ".join(fixes) + ".")
    return PlanInfeasibleError(message, stage=stage, resource="memory", need_bytes=need,
                               limit_bytes=limit, suggestion="; ".join(fixes))


def _reserved(total: int, limit: int) -> str:
    """What the limit leaves out of the device's memory, where anything."""
    if total <= limit:
        return ""
    return (f" (what a device of {format_bytes(total)} leaves beside the CUDA context, "
            f"NCCL's buffers and fragmentation: partc.device.usable)")
