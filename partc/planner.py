"""The planner: stages, recompute, microbatches and schedule, by CP-SAT.

Outer enumeration (cheap, exact): every pipeline configuration ``c = (tp, pp, dp, b, m,
schedule, ZeRO stage, chunks v)`` with ``tp * pp * dp = N`` devices and ``dp * b * m = B``
global batch, respecting pins (``v > 1`` only for a pinned interleaved 1F1B). Configurations are visited in order of a lower bound on their step
time; one whose bound is no better than the best plan found so far is pruned. What the
search learnt about each mesh factorisation ``(pp, dp, tp)`` is kept for the report
(:class:`MeshResult`).

Inner model, for one configuration (all costs from :mod:`partc.costs`, integers):

Sets
    layers ``l = 0..L-1`` in topological order; runs ``j = 0..pv-1`` (contiguous groups
    of layers; run ``j`` is on stage ``j mod p``, so with ``v = 1`` runs are stages);
    stages ``s = 0..p-1``; segments ``k = 0..K-1``: maximal runs of consecutive layers
    ``a_k..b_k`` (``n_k`` of them) with one cost row, one set of allowed recompute modes
    ``r``, one set of shared (tied) parameter groups ``g`` using them, one pinned stage
    and one cut row on the cuts between them: interchangeable layers, so the model
    counts them instead of placing each (80 equal blocks are one segment). Below,
    ``j ~ s`` reads "run ``j`` is on stage ``s``".
Parameters
    per segment, as for each of its layers: ``C[k,r]`` compute per microbatch (forward +
    backward + recompute); ``T_k`` tail time (optimizer step, ZeRO-1's gather); ``D_k``
    dp gradient all-reduce; ``B_k`` backward per microbatch; ``W_k`` parameter +
    gradient + optimizer bytes; ``A[k,r]`` saved bytes per microbatch; ``X[k,r]``
    transient bytes. ``I_k[j]`` / ``E_k[j]`` send/recv time when the boundary between run
    ``j`` and ``j+1`` falls inside segment ``k`` / right after it; ``T_g``, ``D_g``,
    ``W_g`` likewise per shared group; ``f_s`` microbatches in flight on stage ``s``
    (interleaved: runs of one microbatch, each holding ``1/v`` of the stage's
    activations); ``M_s`` memory limit; ``S_g`` tied-gradient sync.
Variables
    ``P[k,j]`` in ``0..n_k``: layers of segment ``k`` in runs ``<= j`` (so ``c[k,j] =
    P[k,j] - P[k,j-1]`` sit in run ``j`` and ``N[k,s] = sum_{j ~ s} c[k,j]`` on stage
    ``s``); booleans ``started[k,j] = [P[k,j] >= 1]``, ``finished[k,j] = [P[k,j] =
    n_k]``; ``n[k,s,r]`` layers of ``k`` on ``s`` in mode ``r``, ``u[k,s,r]`` mode ``r``
    used there; ``h[g,s]`` stage ``s`` holds group ``g``; ``peak_busy``; ``tail``;
    ``transient[s]``. (A segment of one layer: ``P = started = finished`` is the
    boolean "the layer sits in a run ``<= j``" and ``n = u``.)
Objective
    minimise ``v m peak_busy + (sum_s busy_s - peak_busy) + v (tail + sum_g S_g (sum_s
    h[g,s] - 1))``, ``v`` times the step time (``v = 1``: ``(m - 1) peak_busy + sum_s
    busy_s + ...``), where ``busy_s = sum_{k,r} C[k,r] n[k,s,r] + sum_{j ~ s, j < pv-1}
    sum_k (I_k[j] (started[k,j] - finished[k,j]) + E_k[j] (finished[k,j] -
    started[k+1,j]))``.
Constraints
    (1) every layer has exactly one mode: ``sum_r n[k,s,r] = N[k,s]``, ``n[k,s,r] <= n_k
        u[k,s,r]``;
    (2) contiguity: ``P[k,j] <= P[k,j+1]``, ``P[k,pv-1] = n_k``, ``started`` and
        ``finished`` linked to ``P`` (``started <= P <= n_k started``, ``n_k finished <=
        P <= n_k - 1 + finished``), a segment starts only after the previous one
        finished: ``started[k+1,j] <= finished[k,j]``, and every run holds a layer:
        ``sum_k c[k,j] >= 1``; layer ``l`` can only sit in runs ``pv-1-(L-1-l)..l``,
        which bounds ``P``;
    (3) with (2), the boundary ``j -> j+1`` falls inside segment ``k`` exactly when
        ``started[k,j] - finished[k,j] = 1`` and right after it exactly when
        ``finished[k,j] - started[k+1,j] = 1``: one of these terms is 1 for each ``j``;
    (4) ``peak_busy >= busy_s``;
    (5) ``n_k h[g,s] >= N[k,s]`` for segments ``k`` using ``g``;
    (6) ``tail >= sum_k T_k N[k,s] + sum_g T_g h[g,s] + exposed[s]`` with
        ``exposed[s] >= sum_k D_k N[k,s] + sum_g D_g h[g,s] - sum_k B_k N[k,s]``,
        ``exposed[s] >= 0``: the dp all-reduce ``D`` (ZeRO 0/1) overlaps the last
        microbatch's backward ``B`` of the stage;
    (7) ``transient[s] >= X[k,r] u[k,s,r]``;
    (8) memory: ``v (sum_k W_k N[k,s] + sum_g W_g h[g,s] + transient[s]) + f_s sum_{k,r}
        A[k,r] n[k,s,r] <= v M_s``;
    (9) pins: pinned stages fix ``P``, pinned recompute leaves one mode (segments never
        straddle a change of either).

The plan names each layer again: a segment's layers fill its runs in order, and on each
stage take their modes heaviest first (full, selective, none). Every layer of a segment
costs the same in any mode and any position, and the cuts inside it cost alike, so the
model is exact: its optimum is the optimum over per-layer assignments.

CP-SAT starts from a hint (:func:`incumbent`): the fastest modes split evenly into runs,
then on each stage over its limit the cheapest recompute per byte saved until it fits,
so it holds a plan at once; if CP-SAT finds nothing better in time, that is the plan.
"""

from __future__ import annotations

import bisect
import functools
import math
import time
from collections import Counter, OrderedDict
import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from ortools.sat.python import cp_model

from .costs import (CostTable, Evaluation, PipelineConfig, TableCache, build_cost_table,
                    evaluate)
from .errors import PlanInfeasibleError
from .options import PlannerOptions
from .problem import RECOMPUTE_MODES, PlanningProblem
from .spec import AUTO_SCHEDULES, INTERLEAVED


@dataclass(frozen=True, kw_only=True)
class Assignment:
    stage_of: tuple[int, ...]
    modes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ConfigResult:
    table: CostTable
    assignment: Assignment
    evaluation: Evaluation
    status: str
    bound: int
    solve_time_s: float


MESH_OUTCOMES = ("solved", "time limit", "pruned", "infeasible")
# The report lists meshes in this order; unsettled ones together, by their bound.
_MESH_ORDER = {"solved": 0, "time limit": 1, "pruned": 1, "infeasible": 2}


@dataclass(frozen=True, kw_only=True)
class MeshResult:
    """What the search learnt about one ``(pp, dp, tp)`` factorisation of the devices.

    ``outcome`` is one of :data:`MESH_OUTCOMES`: "solved" (``config`` is its fastest plan
    found, ``step_ps`` its step time), "time limit" (the search stopped before solving any
    of its configurations), "pruned" (each configuration's lower bound was no better than
    the chosen plan) or "infeasible" (no configuration fits memory; ``need_bytes`` against
    ``limit_bytes`` on the stage of the tightest split, when known). ``bound_ps`` is a step
    time no configuration of this factorisation can beat (None when infeasible).
    """

    pp: int
    dp: int
    tp: int
    outcome: str
    bound_ps: int | None = None
    config: PipelineConfig | None = None
    step_ps: int | None = None
    status: str | None = None            # CP-SAT's status for ``config``
    need_bytes: int | None = None
    limit_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class PlannerResult:
    best: ConfigResult
    status: str
    bound: int
    solve_time_s: float
    configs_total: int
    configs_solved: int
    configs_pruned: int
    meshes: tuple[MeshResult, ...] = ()     # best first; the chosen mesh leads

    @property
    def gap(self) -> float:
        step = self.best.evaluation.step_ps
        return max(0.0, (step - self.bound) / step) if step else 0.0


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
    """Every (tp, pp, dp, b, m, schedule, ZeRO stage) the pins and the batch allow
    (ZeRO stages 1-3 only where there is more than one replica)."""
    pins = problem.pins
    schedules = [pins.schedule] if pins.schedule else list(AUTO_SCHEDULES)
    configs = []
    for tp, sp, objective in tp_choices(problem):
        devices = problem.devices.num_devices // tp
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
                    [0, 1, 2, 3] if dp > 1 else [0])
                configs.extend(PipelineConfig(pp=pp, dp=dp, micro_batch_size=b,
                                              num_microbatches=m, schedule=schedule, tp=tp,
                                              sequence_parallel=sp, tp_objective=objective,
                                              zero_stage=zero, chunks=chunks)
                               for schedule in schedules for zero in zero_stages
                               if not _same_as_1f1b(schedule, pp, m, pins.schedule)
                               for chunks in _chunk_counts(problem, schedule, pp, m))
    return configs


def _same_as_1f1b(schedule: str, pp: int, m: int, pinned: str | None) -> bool:
    """GPipe with one stage or one microbatch costs what 1F1B does or more (the same
    time; with one stage it keeps every microbatch's activations, 1F1B one): left out
    unless pinned."""
    return schedule == "gpipe" and pinned != "gpipe" and (pp == 1 or m == 1)


MAX_CHUNKS = 8


def _chunk_counts(problem: PlanningProblem, schedule: str, pp: int, m: int) -> list[int]:
    """Chunks per rank: 1, or for interleaved 1F1B every ``v`` from 2 to ``MAX_CHUNKS``
    with a layer for each of the ``pp * v`` runs, when the microbatches are a multiple
    of ``pp`` (Megatron's condition) and the stages are not pinned."""
    if schedule != INTERLEAVED:
        return [1]
    if pp == 1 or m % pp or problem.pins.stages is not None:
        return []
    return [v for v in range(2, MAX_CHUNKS + 1) if pp * v <= problem.num_layers]


def lower_bound(table: CostTable, cache: TableCache | None = None) -> float:
    """A step time no assignment of this configuration can beat; inf if nothing fits.

    Besides compute spread evenly over stages, it charges the least recompute that
    could bring the saved activations under the memory left after parameter state
    (stage ``s`` keeps ``f_s`` microbatches in flight, so all stages together keep at most
    ``sum_s M_s / f_s - state / max_s f_s`` bytes saved per microbatch), and a layer's
    memory saved per extra picosecond is at best its best mode's ratio (the LP
    relaxation of the recompute knapsack).
    """
    pp, m = table.config.pp, table.config.num_microbatches
    if cache is None:
        distinct, knapsack = _row_summary(table)
    else:   # tables of one family share their rows tuple
        known = cache.distinct.get(id(table.layers))
        if known is None:
            known = cache.distinct[id(table.layers)] = _row_summary(table)
        distinct, knapsack = known
    fastest = {key: min(row.compute_ps(r) for r in row.recompute_ps)
               for key, (row, _) in distinct.items()}
    recompute = _recompute_floor(table, knapsack)
    if recompute == math.inf:
        return math.inf
    total = sum(fastest[key] * count for key, (_, count) in distinct.items()) + recompute
    # Whole layers cannot split evenly: the best contiguous split of their fastest
    # compute into pp stages bounds the bottleneck stage from below too.
    best_compute = tuple(fastest[id(row)] for row in table.layers)
    if table.config.chunks == 1:
        peak_busy = max(-(-total // pp), _min_max_split(best_compute, pp))
    else:  # a rank's layers are not contiguous: only the even spread and one layer bound
        peak_busy = max(-(-total // pp), max(best_compute))
    tails = [row.tail_ps * count for row, count in distinct.values()]
    tails += [g.tail_ps for g in table.shared]
    tail = max(-(-sum(tails) // pp), *(row.tail_ps for row, _ in distinct.values()),
               *(g.tail_ps for g in table.shared))
    pipeline = m * peak_busy + (total - peak_busy) // table.config.chunks  # pipeline_ps
    return pipeline + tail + table.tail_latency_ps


def _row_summary(table: CostTable) -> tuple[dict[int, tuple[Any, int]], tuple]:
    """The table's rows, each once, with how many layers share it (tables built with a
    ``TableCache`` give equal layers one row object), and their :func:`_knapsack`."""
    distinct: dict[int, tuple[Any, int]] = {}
    for row in table.layers:
        known = distinct.get(id(row))
        distinct[id(row)] = (row, known[1] + 1 if known else 1)
    return distinct, _knapsack(distinct)


@functools.lru_cache(maxsize=4096)
def _min_max_split(costs: tuple[int, ...], parts: int) -> int:
    """The least possible largest sum when ``costs`` are cut into at most ``parts``
    contiguous runs (binary search on the answer, a greedy check per guess that takes
    each stretch of equal costs at once: 128 equal blocks are one step, not 128)."""
    stretches: list[list[int]] = []    # [cost, how many in a row]
    for cost in costs:
        if stretches and stretches[-1][0] == cost:
            stretches[-1][1] += 1
        else:
            stretches.append([cost, 1])

    def fits(limit: int) -> bool:
        runs, current = 1, 0
        for cost, count in stretches:
            if cost == 0:
                continue
            taken = min(count, (limit - current) // cost)   # what the open run still holds
            current += taken * cost
            left = count - taken
            if left:   # then fresh runs of limit // cost each (limit >= cost)
                per_run = limit // cost
                runs += -(-left // per_run)
                current = (left - (-(-left // per_run) - 1) * per_run) * cost
                if runs > parts:
                    return False
        return runs <= parts

    low, high = max(costs), sum(costs)
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return low


def _recompute_floor(table: CostTable, knapsack: tuple[int, int, list]) -> float:
    config = table.config
    # Stage s holds f_s microbatches of its saved bytes A_s beside its state W_s:
    # A_s <= (M_s - W_s) / f_s, so sum_s A_s <= sum_s M_s / f_s - sum_s W_s / max f.
    inflight = [config.inflight(stage) / config.chunks for stage in range(config.pp)]
    state, saved, ratios = knapsack
    state += sum(g.state_total for g in table.shared)
    budget = sum(limit / f for limit, f in zip(table.limits, inflight)) - state / max(inflight)
    if budget < 0 or state > sum(table.limits):
        return math.inf
    excess = saved - budget
    floor = 0.0
    for ratio, room in ratios:
        if excess <= 0:
            break
        used = min(room, excess)
        floor += ratio * used
        excess -= used
    return math.inf if excess > 0 else math.floor(floor)


def _knapsack(distinct: dict[int, tuple[Any, int]]) -> tuple[int, int, list]:
    """What the recompute bound needs of the rows, whatever the memory: their state, the
    bytes their fastest modes save, and per row its best picoseconds per byte freed and
    how many bytes, cheapest first."""
    state = sum(row.state_total * count for row, count in distinct.values())
    saved, ratios = 0, []
    for row, count in distinct.values():
        fastest = min(row.recompute_ps, key=lambda r: (row.compute_ps(r), r))
        saved += row.saved_bytes[fastest] * count
        options = [(row.compute_ps(r) - row.compute_ps(fastest),
                    row.saved_bytes[fastest] - row.saved_bytes[r])
                   for r in row.recompute_ps if row.saved_bytes[r] < row.saved_bytes[fastest]]
        if options:
            ratios.append((min(t / b for t, b in options),
                           max(b for _, b in options) * count))
    return state, saved, sorted(ratios)


def _pinned_stages(problem: PlanningProblem) -> list[int] | None:
    stages = problem.pins.stages
    if stages is None:
        return None
    names = [layer.name for layer in problem.layers]
    flat = [name for stage in stages for name in stage]
    if flat != names:
        raise ValueError(
            "Constraints.stages must list every layer once, in order; "
            f"layers are {names}, pinned {flat}")
    return [s for s, stage in enumerate(stages) for _ in stage]


@dataclass(frozen=True, kw_only=True)
class _Segment:
    """Layers ``first..last`` (inclusive): one row, one set of allowed modes, one set of
    shared groups using them, one pinned stage, and one cut row on every cut between
    them. Its layers are interchangeable, so the model only counts them."""

    first: int
    last: int
    modes: tuple[str, ...]
    groups: frozenset[int]

    @property
    def size(self) -> int:
        return self.last - self.first + 1


def segments(problem: PlanningProblem, table: CostTable,
             pinned: list[int] | None) -> list[_Segment]:
    """The layers cut into maximal segments of equal neighbours (see :class:`_Segment`)."""
    users = [frozenset(g for g, group in enumerate(table.shared) if l in group.layers)
             for l in range(table.num_layers)]

    def key(l: int) -> tuple:
        return (table.layers[l], problem.allowed_modes(l), users[l],
                pinned[l] if pinned is not None else None)

    found: list[_Segment] = []
    first, current = 0, key(0)
    for layer in range(1, table.num_layers + 1):
        following = key(layer) if layer < table.num_layers else None
        if following == current and (layer - 1 == first
                                      or table.cut_ps[layer - 1] == table.cut_ps[first]):
            continue
        found.append(_Segment(first=first, last=layer - 1, modes=tuple(current[1]),
                              groups=current[2]))
        first, current = layer, following
    return found


class _ConfigModel:
    """The CP-SAT model of one configuration; one method per constraint group.

    Run membership is encoded by prefix counts ``prefix[k][j]`` = "how many layers of
    segment ``k`` sit in runs ``<= j``", monotone in ``j``, with the booleans
    ``started[k][j]`` (some do) and ``finished[k][j]`` (all do). A segment of one layer
    is the interval encoding of a single layer (its prefix is the boolean "before").
    Counting interchangeable layers instead of naming them leaves CP-SAT one integer per
    segment and run where it had a boolean per layer, run and mode, and none of the
    equivalent orders of 128 equal blocks to search through.
    """

    def __init__(self, problem: PlanningProblem, table: CostTable,
                 pinned: list[int] | None) -> None:
        self.problem, self.table = problem, table
        self.model = cp_model.CpModel()
        self.segments = segments(problem, table, pinned)
        self.runs = range(table.config.virtual_stages)
        self.ranks = range(table.config.pp)
        self._add_runs(pinned)                       # (2), (9)
        self._add_modes()                            # (1), (9)
        busy = self._add_busy()                      # (3), (4)
        held = self._add_holders()                   # (5)
        tail = self._add_tail(held)                  # (6)
        self._add_memory(held)                       # (7), (8)
        tie = sum(g.tie_sync_ps * (sum(held[gi]) - 1) for gi, g in enumerate(table.shared))
        m, v = table.config.num_microbatches, table.config.chunks
        # v times the step time (see costs.pipeline_ps): the fill-and-drain term is
        # divided by v, the rest multiplied, so that the objective stays integral.
        self.model.minimize(v * m * self.peak_busy + sum(busy) - self.peak_busy
                            + v * (tail + tie + table.tail_latency_ps))

    def _variable(self, low: int, high: int, name: str, boolean: bool = False):
        """A constant when ``low == high``, else a new integer (or boolean) variable."""
        if low == high:
            return low
        if boolean:
            return self.model.new_bool_var(name)
        return self.model.new_int_var(low, high, name)

    def _require(self, constraint) -> None:
        """Add ``constraint``, unless both its sides are constants and it holds."""
        if constraint is not True:
            self.model.add(constraint)

    def _add_runs(self, pinned: list[int] | None) -> None:
        last, p = self.table.num_layers - 1, self.table.config.virtual_stages
        self.prefix, self.started, self.finished = [], [], []
        for k, seg in enumerate(self.segments):
            prefix, started, finished = [], [], []
            for run in self.runs:
                # Layer l sits in a run between p - 1 - (last - l) and l (every run
                # holds a layer); a pinned one in its stage.
                low = seg.size if run == p - 1 else max(0, min(seg.last, run) - seg.first + 1)
                high = max(0, min(seg.last, run + last - p + 1) - seg.first + 1)
                if pinned is not None:
                    low = high = seg.size if pinned[seg.first] <= run else 0
                count = self._variable(low, high, f"segment{k}_in_runs_to{run}",
                                       boolean=seg.size == 1)
                prefix.append(count)
                if seg.size == 1:
                    started.append(count)
                    finished.append(count)
                    continue
                started.append(self._variable(min(low, 1), min(high, 1),
                                              f"segment{k}_started_by_run{run}", True))
                finished.append(self._variable(int(low == seg.size), int(high == seg.size),
                                               f"segment{k}_finished_by_run{run}", True))
                self._require(count >= started[-1])
                self._require(count <= seg.size * started[-1])
                self._require(count >= seg.size * finished[-1])
                self._require(count <= seg.size - 1 + finished[-1])
            for run in self.runs[:-1]:
                self._require(prefix[run] <= prefix[run + 1])
            self.prefix.append(prefix)
            self.started.append(started)
            self.finished.append(finished)
        for k in range(len(self.segments) - 1):    # segment k + 1 starts after k ends
            for run in self.runs:
                self._require(self.started[k + 1][run] <= self.finished[k][run])
        for run in self.runs:                      # every run holds a layer
            self._require(sum(self.in_run(k, run) for k in range(len(self.segments))) >= 1)
        # N[k][s]: how many layers of segment k sit on rank s (in any of its runs)
        self.on_rank = [[sum(self.in_run(k, run) for run in self.runs[rank::len(self.ranks)])
                         for rank in self.ranks] for k in range(len(self.segments))]

    def in_run(self, k: int, run: int):
        """How many layers of segment ``k`` sit in ``run``."""
        return self.prefix[k][run] - (self.prefix[k][run - 1] if run else 0)

    def _add_modes(self) -> None:
        """(1) ``count[s][k, r]`` layers of segment ``k`` on rank ``s`` use mode ``r``;
        ``used[s][k, r]`` is 1 when any does (for the transient, (7))."""
        self.count: list[dict[tuple[int, str], Any]] = [{} for _ in self.ranks]
        self.used: list[dict[tuple[int, str], Any]] = [{} for _ in self.ranks]
        for k, seg in enumerate(self.segments):
            for rank in self.ranks:
                total, count = self.on_rank[k][rank], self.count[rank]
                if len(seg.modes) == 1 or isinstance(total, int) and total == 0:
                    count.update({(k, r): total if r == seg.modes[0] else 0
                                  for r in seg.modes})
                else:
                    split = [self.model.new_int_var(0, seg.size, f"segment{k}_rank{rank}_{r}")
                             for r in seg.modes]
                    self.model.add(sum(split) == total)
                    count.update({(k, r): c for r, c in zip(seg.modes, split)})
                for r in seg.modes:
                    if isinstance(count[k, r], int):
                        self.used[rank][k, r] = int(count[k, r] > 0)
                        continue
                    if seg.size == 1:
                        self.used[rank][k, r] = count[k, r]    # already 0 or 1
                        continue
                    used = self.model.new_bool_var(f"segment{k}_rank{rank}_uses_{r}")
                    self.model.add(count[k, r] <= seg.size * used)
                    self.used[rank][k, r] = used

    def boundary_ps(self, run: int):
        """(3) The send/recv time of the boundary ``run -> run + 1``: the segment's inner
        cut where the boundary falls inside one, its last cut where it falls after it
        (exactly one of the terms is 1 by (2))."""
        table, cost = self.table, 0
        for k, seg in enumerate(self.segments):
            if seg.size > 1:
                inside = self.started[k][run] - self.finished[k][run]
                cost += table.cut_ps[seg.first][run] * inside
            if k + 1 < len(self.segments):
                after = self.finished[k][run] - self.started[k + 1][run]
                cost += table.cut_ps[seg.last][run] * after
        return cost

    def _add_busy(self) -> list:
        table, busy = self.table, []
        horizon = sum(max(row.compute_ps(r) for r in row.recompute_ps) for row in table.layers)
        horizon += sum(max(row, default=0) for row in table.cut_ps)
        self.peak_busy = self.model.new_int_var(0, horizon, "peak_busy")
        last_run = table.config.virtual_stages - 1
        for rank in self.ranks:
            compute = sum(table.layers[self.segments[k].first].compute_ps(r) * count
                          for (k, r), count in self.count[rank].items())
            comm = sum(self.boundary_ps(run) for run in self.runs[rank::len(self.ranks)]
                       if run < last_run)
            busy.append(compute + comm)
            self.model.add(self.peak_busy >= compute + comm)
        return busy

    def _add_holders(self) -> list[list]:
        held = []
        for gi in range(len(self.table.shared)):
            row = []
            for rank in self.ranks:
                h = self.model.new_bool_var(f"shared{gi}_on_stage{rank}")
                for k, seg in enumerate(self.segments):
                    if gi in seg.groups:
                        self.model.add(self.on_rank[k][rank] <= seg.size * h)
                row.append(h)
            held.append(row)
        return held

    def _per_rank(self, rank: int, value) -> Any:
        """``sum_k value(row of k) N[k, rank]``: a per-layer number summed over the
        rank's layers."""
        return sum(value(self.table.layers[seg.first]) * self.on_rank[k][rank]
                   for k, seg in enumerate(self.segments))

    def _add_tail(self, held: list[list]):
        table = self.table
        rows = [*table.layers, *table.shared]
        sync_top = sum(r.sync_ps for r in rows)
        tail = self.model.new_int_var(0, sum(r.tail_ps for r in rows) + sync_top, "tail")
        for stage in self.ranks:
            own = self._per_rank(stage, lambda row: row.tail_ps)
            tied = sum(g.tail_ps * held[gi][stage] for gi, g in enumerate(table.shared))
            if not sync_top:
                self.model.add(tail >= own + tied)
                continue
            # (6') the dp all-reduce left after the last microbatch's backward
            exposed = self.model.new_int_var(0, sync_top, f"exposed_sync_stage{stage}")
            sync = self._per_rank(stage, lambda row: row.sync_ps)
            sync += sum(g.sync_ps * held[gi][stage] for gi, g in enumerate(table.shared))
            overlap = self._per_rank(stage, lambda row: row.backward_ps)
            self.model.add(exposed >= sync - overlap)
            self.model.add(tail >= own + tied + exposed)
        return tail

    def _add_memory(self, held: list[list]) -> None:
        """(7), (8) in units of ``_memory_unit`` bytes: sizes rounded up, limits down, so
        whatever fits here fits in bytes. (Byte-sized coefficients on GiB limits were
        seen to make CP-SAT 9.15's presolve return a wrong OPTIMAL.)"""
        table = self.table
        unit = _memory_unit(table)

        def units(nbytes: int) -> int:
            return -(-nbytes // unit)

        top = max(units(max(row.transient_bytes.values())) for row in table.layers)
        chunks = table.config.chunks   # activations are inflight * saved / chunks
        for stage in self.ranks:
            transient = self.model.new_int_var(0, top, f"transient_stage{stage}")
            saved = 0
            for (k, r), count in self.count[stage].items():
                row = table.layers[self.segments[k].first]
                saved += units(row.saved_bytes[r]) * count
                if row.transient_bytes[r]:
                    self.model.add(transient >= units(row.transient_bytes[r])
                                   * self.used[stage][k, r])
            state = self._per_rank(stage, lambda row: units(row.state_total))
            state += sum(units(g.state_total) * held[gi][stage]
                         for gi, g in enumerate(table.shared))
            inflight = table.config.inflight(stage)
            self.model.add(chunks * (state + transient) + inflight * saved
                           <= chunks * (table.limits[stage] // unit))

    def add_hint(self, hint: Assignment) -> None:
        """Start the search from ``hint`` (CP-SAT completes the auxiliary variables)."""
        pp = self.table.config.pp
        values: dict[int, tuple[Any, int]] = {}   # one hint per variable

        def put(variable, value: int) -> None:
            if isinstance(variable, cp_model.IntVar):   # not a constant or a sum
                values[variable.index] = (variable, value)

        for k, seg in enumerate(self.segments):
            layers = range(seg.first, seg.last + 1)
            per_run = Counter(hint.stage_of[l] for l in layers)
            inside = 0
            for run in self.runs:
                inside += per_run[run]
                put(self.prefix[k][run], inside)
                put(self.started[k][run], int(inside > 0))
                put(self.finished[k][run], int(inside == seg.size))
            per_mode = Counter((hint.stage_of[l] % pp, hint.modes[l]) for l in layers)
            for rank in self.ranks:
                for r in seg.modes:
                    put(self.count[rank][k, r], per_mode[rank, r])
                    put(self.used[rank][k, r], int(per_mode[rank, r] > 0))
        for variable, value in values.values():
            self.model.add_hint(variable, value)

    def assignment(self, solver: cp_model.CpSolver) -> Assignment:
        """Each segment's layers fill its runs in order; on each rank they take their
        modes heaviest first (full, selective, none), which is deterministic."""
        def value(v) -> int:
            return v if isinstance(v, int) else int(solver.value(v))

        pp = self.table.config.pp
        stage_of: list[int] = []
        modes: list[str] = []
        for k, seg in enumerate(self.segments):
            counts = [value(self.prefix[k][run]) for run in self.runs]
            stage_of += [sum(1 for c in counts if c <= i) for i in range(seg.size)]
            left = {(rank, r): value(self.count[rank][k, r])
                    for rank in self.ranks for r in seg.modes}
            for layer in range(seg.first, seg.last + 1):
                rank = stage_of[layer] % pp
                mode = next(r for r in reversed(RECOMPUTE_MODES)
                            if r in seg.modes and left[rank, r])
                left[rank, mode] -= 1
                modes.append(mode)
        return Assignment(stage_of=tuple(stage_of), modes=tuple(modes))


def _starting_point(problem: PlanningProblem, table: CostTable, pinned: list[int] | None,
                    previous: Assignment | None) -> tuple[Assignment, Evaluation] | None:
    """The plan a solve starts from, evaluated: the greedy incumbent, or ``previous``
    when it still fits and is faster."""
    candidates = [] if pinned is not None else [incumbent(problem, table), previous]
    evaluated = [(a, evaluate(table, a.stage_of, a.modes)) for a in candidates if a is not None]
    fitting = [(a, e) for a, e in evaluated if e.fits]
    return min(fitting, key=lambda pair: pair[1].step_ps) if fitting else None


def balanced_split(costs: Sequence[int], parts: int) -> list[int]:
    """Each layer's run when ``costs`` are cut into exactly ``parts`` non-empty
    contiguous runs whose largest sum is the least possible (:func:`_min_max_split`)."""
    limit = _min_max_split(tuple(costs), parts)
    run_of, run, current = [], 0, 0
    for index, cost in enumerate(costs):
        layers_left, runs_left = len(costs) - index, parts - run
        # Close the run when this layer would overflow it, or when every later run
        # needs one of the layers left.
        if run_of and run < parts - 1 and (current + cost > limit or layers_left < runs_left):
            run, current = run + 1, 0
        run_of.append(run)
        current += cost
    return run_of


def incumbent(problem: PlanningProblem, table: CostTable) -> Assignment | None:
    """A plan to start CP-SAT from: the fastest-mode compute split evenly into runs;
    then, on each stage over its limit, recompute where it costs least per byte saved
    (greedy); None when even that does not fit."""
    if table.num_layers < table.config.virtual_stages:
        return None
    fastest = [min(row.compute_ps(r) for r in row.recompute_ps) for row in table.layers]
    stage_of = balanced_split(fastest, table.config.virtual_stages)
    allowed = [problem.allowed_modes(layer) for layer in range(table.num_layers)]
    modes = [min(options, key=lambda r: (table.layers[l].compute_ps(r),
                                         RECOMPUTE_MODES.index(r)))   # ties: none first
             for l, options in enumerate(allowed)]
    pp = table.config.pp
    for stage in range(pp):
        members = [l for l in range(table.num_layers) if stage_of[l] % pp == stage]
        _recompute_until_it_fits(table, stage, members, allowed, modes)
    if not evaluate(table, stage_of, modes).fits:
        return None
    return Assignment(stage_of=tuple(stage_of), modes=tuple(modes))


def _recompute_until_it_fits(table: CostTable, stage: int, members: list[int],
                             allowed: list[list[str]], modes: list[str]) -> None:
    """Change ``modes`` of ``members`` (in place), one layer at a time, to the mode that
    frees the most activation memory per picosecond, until the stage's saved
    activations fit what its limit leaves (state and the largest transient aside)."""
    config = table.config
    rows = table.layers
    state = sum(rows[l].state_total for l in members)
    state += sum(g.state_total for g in table.shared if any(l in members for l in g.layers))
    saved = sum(rows[l].saved_bytes[modes[l]] for l in members)
    transient = max(rows[l].transient_bytes[modes[l]] for l in members)
    # Equal layers in equal modes offer the same change: each such group offers it once,
    # by its first layer (members are in order), so 128 equal blocks cost one look.
    groups: dict[tuple, list[int]] = {}
    for l in members:
        groups.setdefault((id(rows[l]), modes[l], tuple(allowed[l])), []).append(l)
    while state + config.activations(stage, saved) + transient > table.limits[stage]:
        best = None
        for (_, current, options), layers in groups.items():
            if not layers:
                continue
            l = layers[0]
            for mode in options:
                freed = rows[l].saved_bytes[current] - rows[l].saved_bytes[mode]
                if freed <= 0:
                    continue
                ratio = (rows[l].compute_ps(mode) - rows[l].compute_ps(current)) / freed
                if best is None or (ratio, l) < best[:2]:
                    best = (ratio, l, mode)
        if best is None:
            return
        _, layer, mode = best
        saved -= rows[layer].saved_bytes[modes[layer]] - rows[layer].saved_bytes[mode]
        transient = max(transient, rows[layer].transient_bytes[mode])
        options = tuple(allowed[layer])
        groups[id(rows[layer]), modes[layer], options].pop(0)
        bisect.insort(groups.setdefault((id(rows[layer]), mode, options), []), layer)
        modes[layer] = mode


def _memory_unit(table: CostTable) -> int:
    """Bytes per unit of the memory constraints: about 2^20 units in the largest limit
    (one byte below 1 MiB, 4 KiB at 4 GiB), so the rounding costs under a millionth of
    the limit per term."""
    return max(1, max(table.limits) >> 20)


_STATUS = {cp_model.OPTIMAL: "OPTIMAL", cp_model.FEASIBLE: "FEASIBLE",
           cp_model.INFEASIBLE: "INFEASIBLE", cp_model.MODEL_INVALID: "MODEL_INVALID",
           cp_model.UNKNOWN: "UNKNOWN"}


def solve_config(problem: PlanningProblem, table: CostTable, options: PlannerOptions,
                 time_limit_s: float, pinned: list[int] | None,
                 cutoff: int | None = None, previous: Assignment | None = None
                 ) -> tuple[ConfigResult | None, str, float]:
    """Solve one configuration: its result (None when there is none), CP-SAT's status
    ("BEATEN" when stopped by ``cutoff``) and the bound CP-SAT proved. ``previous`` (this
    configuration's plan under another memory limit) is the hint when it still fits and
    beats the greedy incumbent.

    ``cutoff`` (the best step time found elsewhere) is not a constraint: proving
    "nothing below the cutoff" was seen to take CP-SAT far longer than solving outright.
    Instead the search stops as soon as its proven bound reaches it, which is often long
    before the optimum of a losing configuration is proven.
    """
    start = time.perf_counter()
    problem = problem.variant(table.config.tp, table.config.sequence_parallel,
                              table.config.tp_objective)
    built = _ConfigModel(problem, table, pinned)
    start_from = _starting_point(problem, table, pinned, previous)
    if start_from is not None:
        built.add_hint(start_from[0])
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(time_limit_s, 0.01)
    solver.parameters.num_workers = options.num_workers
    solver.parameters.random_seed = options.seed
    solver.parameters.cp_model_presolve = options.presolve
    chunks = table.config.chunks   # the objective is chunks x the step time

    def step_floor(objective_bound: float) -> int:
        """The least step time an objective bound allows (pipeline_ps floors its
        fill-and-drain term divided by the chunks)."""
        return -(-(math.ceil(objective_bound - 1e-6) - chunks + 1) // chunks)

    if cutoff is not None:
        def stop_when_beaten(bound: float) -> None:
            if step_floor(bound) >= cutoff:
                solver.stop_search()
        solver.best_bound_callback = stop_when_beaten
    code = solver.solve(built.model)
    status = _STATUS.get(code, "UNKNOWN")
    proven = step_floor(solver.best_objective_bound)
    if status == "MODEL_INVALID":
        raise RuntimeError(f"internal error: invalid CP-SAT model for {table.config}: "
                           f"{built.model.validate()}")
    beaten = status == "UNKNOWN" and cutoff is not None and proven >= cutoff
    if status == "UNKNOWN" and start_from is not None and not beaten:
        status = "FEASIBLE"   # CP-SAT found nothing in time: the incumbent still is a plan
        assignment, evaluation = start_from
    elif status not in ("OPTIMAL", "FEASIBLE"):
        return None, "BEATEN" if beaten else status, proven
    else:
        assignment = built.assignment(solver)
        evaluation = evaluate(table, assignment.stage_of, assignment.modes)
        # The model over-approximates nothing at an optimum; a feasible incumbent may
        # carry slack in its auxiliary variables, so the evaluation can only be lower.
        if chunks * evaluation.step_ps > round(solver.objective_value) or not evaluation.fits:
            raise RuntimeError(f"internal error: CP-SAT objective {solver.objective_value} "
                               f"(x{chunks}) disagrees with the cost model "
                               f"({evaluation.step_ps}) for {table.config}")
        if status == "FEASIBLE" and start_from is not None \
                and start_from[1].step_ps < evaluation.step_ps:
            # Stopped by the time limit: never worse than the plan it started from
            # (CP-SAT may drop a hint it cannot complete in time).
            assignment, evaluation = start_from
    bound = min(proven, evaluation.step_ps) if status == "FEASIBLE" else evaluation.step_ps
    return ConfigResult(table=table, assignment=assignment, evaluation=evaluation,
                        status=status, bound=bound,
                        solve_time_s=time.perf_counter() - start), status, proven


def solve(problem: PlanningProblem, options: PlannerOptions = PlannerOptions()) -> PlannerResult:
    """The best plan over all configurations, or PlanInfeasibleError with a way out."""
    start = time.perf_counter()
    pinned = _pinned_stages(problem)
    configs = candidate_configs(problem)
    if not configs:
        raise PlanInfeasibleError(_no_config_message(problem), resource="configuration")
    cache = _table_cache(problem)
    tables = [build_cost_table(problem, c, cache) for c in configs]
    floors = [lower_bound(t, cache) for t in tables]
    # Re-planning (the cache saw a problem that differed only in memory): the previous
    # best configuration first, so its plan prunes the rest early.
    order = sorted(range(len(tables)),
                   key=lambda i: (tables[i].config != cache.best_config, floors[i], i))
    bound, solved, pruned, all_optimal = None, 0, 0, True
    # Per configuration: its ConfigResult, or why it has none (a MESH_OUTCOMES word).
    outcomes: list[ConfigResult | str] = ["infeasible"] * len(tables)
    best = None if pinned is not None else _seed(problem, tables, floors, order)
    if best is not None:   # solved first: CP-SAT improves the seed while its bound is fresh
        seed = tables.index(best.table)
        outcomes[seed] = best
        if tables[order[0]].config != cache.best_config:
            order.remove(seed)
            order.insert(0, seed)
    for i in order:
        table, floor = tables[i], floors[i]
        if floor == math.inf:
            pruned += 1
            continue
        seeded = isinstance(outcomes[i], ConfigResult)   # the greedy seed's configuration
        if best is not None and floor >= best.evaluation.step_ps:
            pruned += 1
            outcomes[i] = outcomes[i] if seeded else "pruned"
            bound = floor if bound is None else min(bound, floor)
            continue
        remaining = options.time_limit_s - (time.perf_counter() - start)
        if remaining <= 0 and best is not None:
            all_optimal = False
            outcomes[i] = outcomes[i] if seeded else "time limit"
            bound = floor if bound is None else min(bound, floor)
            continue
        cutoff = best.evaluation.step_ps if best is not None else None
        result, status, proven = solve_config(problem, table, options,
                                              min(remaining, options.per_config_s), pinned,
                                              cutoff, cache.solutions.get(table.config))
        solved += 1
        if result is None:
            if status == "BEATEN":  # proven no better than the best plan
                outcomes[i] = outcomes[i] if seeded else "pruned"
                floors[i] = max(floor, math.ceil(proven))
                bound = floors[i] if bound is None else min(bound, floors[i])
            elif status == "UNKNOWN":
                all_optimal = False
                outcomes[i] = outcomes[i] if seeded else "time limit"
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
    if best is None:
        from .explain import explain_infeasible
        raise explain_infeasible(problem, tables)
    cache.best_config = best.table.config
    return PlannerResult(
        best=best, status="OPTIMAL" if all_optimal else "FEASIBLE",
        bound=min(bound, best.evaluation.step_ps),
        solve_time_s=time.perf_counter() - start,
        configs_total=len(configs), configs_solved=solved, configs_pruned=pruned,
        meshes=mesh_results(problem, tables, floors, outcomes, best))


def _seed(problem: PlanningProblem, tables: list[CostTable], floors: list[float],
          order: list[int]) -> ConfigResult | None:
    """The best greedy incumbent over each mesh's most promising configuration: a plan
    in hand before any solve, whose step time prunes every configuration bounded above
    it (CP-SAT may then improve on it, configuration by configuration)."""
    firsts: dict[tuple, int] = {}
    for i in order:
        config = tables[i].config
        key = (config.pp, config.dp, config.tp, config.sequence_parallel, config.tp_objective)
        if floors[i] < math.inf:
            firsts.setdefault(key, i)
    best = None
    for i in firsts.values():
        table = tables[i]
        config = table.config
        hint = incumbent(problem.variant(config.tp, config.sequence_parallel,
                                         config.tp_objective), table)
        if hint is None:
            continue
        evaluation = evaluate(table, hint.stage_of, hint.modes)
        if best is None or evaluation.step_ps < best.evaluation.step_ps:
            best = ConfigResult(table=table, assignment=hint, evaluation=evaluation,
                                status="FEASIBLE", bound=int(floors[i]), solve_time_s=0.0)
    return best


_TABLE_CACHES: "OrderedDict[str, TableCache]" = OrderedDict()


def _table_cache(problem: PlanningProblem) -> TableCache:
    """The cost-table cache of this problem, shared with earlier problems that differed
    only in the devices' memory (the few latest are kept)."""
    from dataclasses import replace

    from .cache import problem_key

    key = problem_key(replace(problem, devices=replace(problem.devices, memory_bytes=(0,) *
                                                       problem.devices.num_devices)))
    cache = _TABLE_CACHES.pop(key, None) or TableCache()
    _TABLE_CACHES[key] = cache
    while len(_TABLE_CACHES) > 4:
        _TABLE_CACHES.popitem(last=False)
    return cache


def mesh_results(problem: PlanningProblem, tables: list[CostTable], floors: list[float],
                 outcomes: list[ConfigResult | str],
                 best: ConfigResult) -> tuple[MeshResult, ...]:
    """One MeshResult per (pp, dp, tp) among the configurations, best first: solved by
    step time (the chosen mesh first), then unsettled by bound, then infeasible."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i, table in enumerate(tables):
        config = table.config
        groups.setdefault((config.pp, config.dp, config.tp), []).append(i)
    meshes = [_mesh_result(problem, mesh, [tables[i] for i in members],
                           [floors[i] for i in members], [outcomes[i] for i in members], best)
              for mesh, members in groups.items()]
    chosen = best.table.config

    def rank(mesh: MeshResult) -> tuple:
        is_chosen = (mesh.pp, mesh.dp, mesh.tp) == (chosen.pp, chosen.dp, chosen.tp)
        value = mesh.step_ps if mesh.outcome == "solved" else mesh.bound_ps
        if mesh.outcome == "infeasible":
            value = mesh.need_bytes / mesh.limit_bytes if mesh.need_bytes else math.inf
        return (_MESH_ORDER[mesh.outcome], value, not is_chosen, mesh.pp, mesh.dp, mesh.tp)

    return tuple(sorted(meshes, key=rank))


def _mesh_result(problem: PlanningProblem, mesh: tuple[int, int, int],
                 tables: list[CostTable], floors: list[float],
                 outcomes: list[ConfigResult | str], best: ConfigResult) -> MeshResult:
    pp, dp, tp = mesh
    results = [o for o in outcomes if isinstance(o, ConfigResult)]
    # A solved configuration can do no better than CP-SAT's bound, an unsolved one than
    # its lower bound; infeasible ones do not count.
    bounds = [r.bound for r in results] + [
        floor for floor, o in zip(floors, outcomes) if o in ("pruned", "time limit")]
    bound = int(min(bounds)) if bounds else None
    if results:
        top = best if any(r is best for r in results) else min(
            results, key=lambda r: r.evaluation.step_ps)
        return MeshResult(pp=pp, dp=dp, tp=tp, outcome="solved", bound_ps=bound,
                          config=top.table.config, step_ps=top.evaluation.step_ps,
                          status=top.status)
    if bound is not None:
        outcome = "time limit" if "time limit" in outcomes else "pruned"
        return MeshResult(pp=pp, dp=dp, tp=tp, outcome=outcome, bound_ps=bound)
    need, limit = _memory_need(problem, tables)
    return MeshResult(pp=pp, dp=dp, tp=tp, outcome="infeasible", need_bytes=need,
                      limit_bytes=limit)


def _memory_need(problem: PlanningProblem,
                 tables: list[CostTable]) -> tuple[int | None, int | None]:
    """The memory the tightest split of any of ``tables`` needs on its worst stage, and
    that stage's limit; (None, None) when that split fits (then only the pins keep these
    configurations out)."""
    from .explain import tightest_split

    tables = [t for t in tables if t.config.chunks == 1] or tables
    tight = min((tightest_split(t, problem) for t in tables), key=lambda split: split.ratio)
    if tight.ratio <= 1:
        return None, None
    return tight.stage_need[tight.worst], tight.limits[tight.worst]


def _no_config_message(problem: PlanningProblem) -> str:
    pins, train = problem.pins, problem.train
    return (f"no pipeline configuration matches the pins and the batch: "
            f"{problem.devices.num_devices} devices, global batch {train.global_batch_size}, "
            f"micro-batch sizes {list(train.micro_batch_sizes)}, pins pp={pins.pp} "
            f"dp={pins.dp} microbatches={pins.num_microbatches} "
            f"micro_batch_size={pins.micro_batch_size}, {problem.num_layers} layers. "
            f"pp must divide the device count and be at most the number of layers, and "
            f"dp x micro-batch size x microbatches must equal the global batch.")
