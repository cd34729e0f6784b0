"""Bounds and starting points of one configuration, without the solver.

- :func:`lower_bound`: a step time no assignment of a configuration can beat (compute
  spread evenly or split at best into contiguous stages, :func:`min_max_split`, plus the
  least recompute that brings the saved activations under memory, the LP relaxation of
  the recompute knapsack). The search visits configurations in its order and prunes
  those whose bound is no better than the best plan found.
- :func:`played_floor`: a step time no plan of a configuration plays out below
  (:func:`~partc.cost.evaluate.simulated_step_ps`, what a plan reports), whatever its
  schedule: the busiest rank's work, the first microbatch's way to each rank (and
  through every layer and back) and the tails. Under memory pressure the busiest
  rank's work is a linear program's (GLOP): the layers placed fractionally on the
  ranks, each holding its microbatches' activations within its limit
  (:func:`_busiest_rank_floor`). The closed form's :func:`lower_bound` is none: its
  fill and drain is the closed form's, which a schedule played out may beat. The joint
  search over schedules (:mod:`.joint`) prunes by it.
- :func:`incumbent`: the greedy plan CP-SAT starts from: the fastest modes split evenly
  into runs (:func:`balanced_split`), then on each stage over its limit the cheapest
  recompute per byte saved until it fits, so a plan is in hand at once; if CP-SAT finds
  nothing better in time, that is the plan.
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Any, Sequence

from ortools.linear_solver import pywraplp

from partc.cost.evaluate import Evaluation, end_share_ps, evaluate, receive_bytes
from partc.cost.schedules import schedule as schedule_info
from partc.cost.timeline import WEIGHT_SHARE
from partc.cost.tables import CostTable, TableCache
from partc.planner.results import Assignment, ConfigResult
from partc.problem import RECOMPUTE_MODES, PlanningProblem


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
    distinct, knapsack = _distinct(table, cache)   # tables of one family share their rows
    recompute = _recompute_floor(table, knapsack)
    if recompute == math.inf:
        return math.inf
    best_compute, fastest_total = _fastest(table, cache)
    total = fastest_total + recompute
    # Whole layers cannot split evenly: the best contiguous split of their fastest
    # compute into pp stages bounds the bottleneck stage from below too.
    if table.config.chunks == 1:
        peak_busy = max(-(-total // pp), _least_largest_stage(table, best_compute, cache))
    else:  # a rank's layers are not contiguous: only the even spread and one layer bound
        peak_busy = max(-(-total // pp), max(best_compute))
    pipeline = m * peak_busy + (total - peak_busy) // table.config.fill_divisor  # pipeline_ps
    return pipeline + _tail_floor(table, distinct)


def _fastest(table: CostTable, cache: TableCache | None) -> tuple[tuple[int, ...], int]:
    """Each layer's compute in its fastest mode, and their sum; kept in ``cache`` per rows
    tuple (the tables of one family share it)."""
    key = ("fastest", id(table.layers))
    known = cache.distinct.get(key) if cache is not None else None
    if known is None:
        distinct, _ = _distinct(table, cache)
        fastest = {key: min(row.compute_ps(r) for r in row.recompute_ps)
                   for key, (row, _) in distinct.items()}
        best_compute = tuple(fastest[id(row)] for row in table.layers)
        known = (best_compute, sum(fastest[key] * count for key, (_, count) in distinct.items()))
        if cache is not None:
            cache.distinct[key] = known
    return known


def _least_largest_stage(table: CostTable, best_compute: tuple[int, ...],
                         cache: TableCache | None) -> int:
    """:func:`min_max_split` of ``best_compute`` (``table``'s layers' fastest compute) into
    its pp stages, kept in ``cache`` per rows tuple and pp too: the tuple is not hashed
    again for every table of a family."""
    if cache is None:
        return min_max_split(best_compute, table.config.pp)
    key = ("rows", id(table.layers), table.config.pp)
    known = cache.splits.get(key)
    if known is None:
        known = cache.splits[key] = min_max_split(best_compute, table.config.pp, cache.splits)
    return known


def _tail_floor(table: CostTable, distinct: dict[int, tuple[Any, int]]) -> int:
    """The least tail (:attr:`~partc.cost.evaluate.Evaluation.tail_ps`) of any split: the
    slowest rank's is at least an even share of the layers' own tails, and the largest
    one layer's or shared group's; then the step's shared latency."""
    pp = table.config.pp
    tails = [row.tail_ps * count for row, count in distinct.values()]
    tails += [g.tail_ps for g in table.shared]
    tail = max(-(-sum(tails) // pp), *(row.tail_ps for row, _ in distinct.values()),
               *(g.tail_ps for g in table.shared))
    return tail + table.tail_latency_ps


def _distinct(table: CostTable, cache: TableCache | None) -> tuple[dict, tuple]:
    """:func:`_row_summary` of ``table``, kept in ``cache`` per rows tuple."""
    if cache is None:
        return _row_summary(table)
    known = cache.distinct.get(id(table.layers))
    if known is None:
        known = cache.distinct[id(table.layers)] = _row_summary(table)
    return known


def played_floor(table: CostTable, cache: TableCache | None = None, *,
                 any_schedule: bool = False, backward_scale: float = 1.0,
                 one_in_flight: bool = False) -> float:
    """A step time no plan of ``table``'s configuration plays out below
    (:func:`~partc.cost.evaluate.simulated_step_ps`); inf if nothing fits. With
    ``any_schedule``, one no plan of its mesh, batch split and ZeRO stage plays out below
    under any schedule and count of virtual stages (``backward_scale``: the least factor a
    schedule's backward takes, :func:`~partc.cost.pipeline_config.split_factor`, at most 1).

    The simulation runs each rank's operations one at a time, every microbatch through
    each of its runs once, so a rank is busy ``m`` times its runs' compute and the sends
    of the cuts after them that cross to another rank; and rank ``r`` starts when the
    first microbatch's forward has passed the runs before its first, ``r`` of them (one
    rank each, under every placement: :mod:`partc.cost.schedules`), a layer at least
    each. The busiest rank is at least their average, and busier than the heaviest
    layer's ``m`` runs. For its own schedule (not ``any_schedule``) the compute counts the
    least recompute that fits (:func:`_recompute_floor`) and the sends the cheapest cuts,
    one per boundary between runs on two ranks (:func:`_cheapest_sends`). With
    ``any_schedule`` or ``one_in_flight`` the recompute is the least that fits with one
    microbatch of every run in flight on each rank, which every schedule holds at once
    (when a rank starts the first microbatch's backward, its forward has passed every
    run of the rank and none of their activations is freed yet): a weaker floor that
    needs no schedule's order (``one_in_flight`` prices a schedule's own floor cheaply,
    before its order is played). For its own schedule the span is also at least the
    first microbatch's way through every layer and back (:func:`_first_microbatch`)
    with that recompute, which binds where microbatches are few against the ranks.
    Then the least tail (:func:`_tail_floor`)."""
    config = table.config
    pp, m = config.pp, config.num_microbatches
    distinct, knapsack = _distinct(table, cache)
    scale = min(1.0, backward_scale) if any_schedule else 1.0
    fastest = {key: row.forward_ps + math.floor(scale * row.backward_ps)
               + min(row.recompute_ps.values()) for key, (row, _) in distinct.items()}
    total = sum(fastest[key] * count for key, (_, count) in distinct.items())
    recompute = _recompute_floor(table, knapsack, any_schedule or one_in_flight)
    if recompute == math.inf:
        return math.inf
    total += recompute
    comm = 0 if any_schedule else _cheapest_sends(table)
    starts = sum(itertools.accumulate(table.layers[l].forward_ps
                                      for l in range(min(pp, table.num_layers) - 1)))
    busy = max(m * max(fastest.values()), -(-(m * (total + comm) + starts) // pp),
               0 if any_schedule else _first_microbatch(table, distinct) + recompute)
    if not (any_schedule or one_in_flight):
        busiest = _kept_busiest_rank_floor(table, distinct, knapsack, cache)
        if busiest == math.inf:
            return math.inf
        busy = max(busy, m * busiest)
    return busy + _tail_floor(table, distinct)


def _kept_busiest_rank_floor(table: CostTable, distinct: dict[int, tuple[Any, int]],
                             knapsack: tuple[int, int, list],
                             cache: TableCache | None) -> float:
    """:func:`_busiest_rank_floor`, kept in ``cache`` per rows tuple, held microbatches and
    limits: the schedules and batch splits of one mesh ask again with the same (a
    145.6B GPT's joint search asked 2,769 times for 300)."""
    if cache is None:
        return _busiest_rank_floor(table, distinct, knapsack)
    key = ("busiest", id(table.layers), table.config.least_held(), table.limits)
    known = cache.distinct.get(key)
    if known is None:
        known = cache.distinct[key] = _busiest_rank_floor(table, distinct, knapsack)
    return known


def _busiest_rank_floor(table: CostTable, distinct: dict[int, tuple[Any, int]],
                        knapsack: tuple[int, int, list]) -> float:
    """The least compute per microbatch of the busiest rank, over every placement of the
    layers on the ranks and every mode, where rank ``s`` holds its layers' state and
    ``least_held()[s]`` microbatches of their saved activations within its limit: the
    linear relaxation (layers split fractionally between ranks and modes, GLOP), whose
    optimum no plan beats; inf where even it fits nothing. The ranks that hold more
    microbatches (1F1B's first) must recompute more or hold fewer layers, which the
    knapsack floor, pooling every rank's memory, cannot see.

    Skipped (0) where an even share of every layer in its fastest mode (the state and
    saved bytes of :func:`_knapsack`) fits every rank: then the relaxation's optimum is
    the even share of the compute, already in the floor."""
    config = table.config
    if config.pp == 1:
        return 0.0
    held = config.least_held()
    state, saved, _ = knapsack
    if all(state + f * saved <= config.pp * limit for f, limit in zip(held, table.limits)):
        return 0.0
    solver = pywraplp.Solver.CreateSolver("GLOP")
    busiest = solver.NumVar(0.0, solver.infinity(), "busiest")
    # Per rank: its compute less the busiest's <= 0, and its bytes <= its limit (a hair
    # above: a rounding in GLOP never rules out a plan that fits). Picoseconds in
    # microseconds and bytes in MiB keep the coefficients near 1.
    computes, memories = [], []
    for f, limit in zip(held, table.limits):
        compute = solver.Constraint(-solver.infinity(), 0.0)
        compute.SetCoefficient(busiest, -1.0)
        computes.append(compute)
        memories.append(solver.Constraint(-solver.infinity(), limit / 2**20 * (1 + 1e-6)))
    for row, count in distinct.values():
        placed = solver.Constraint(count, count)   # every layer somewhere, in some mode
        for mode in row.recompute_ps:
            for f, compute, memory in zip(held, computes, memories):
                share = solver.NumVar(0.0, count, "")
                placed.SetCoefficient(share, 1.0)
                compute.SetCoefficient(share, row.compute_ps(mode) / 1e6)
                memory.SetCoefficient(share, (row.state_total + f * row.saved_bytes[mode])
                                      / 2**20)
    solver.Minimize(busiest)
    status = solver.Solve()
    if status == pywraplp.Solver.INFEASIBLE:
        return math.inf
    if status != pywraplp.Solver.OPTIMAL:
        return 0.0
    # A hair below GLOP's optimum, for the same reason.
    return math.floor(busiest.solution_value() * 1e6 * (1 - 1e-6))


def _first_microbatch(table: CostTable, distinct: dict[int, tuple[Any, int]]) -> int:
    """The least time the first microbatch takes through every layer and back, its
    least recompute aside: each layer's forward waits for the one before's, and its
    backward (under a split backward its input gradient, the part the layer before
    waits for: :data:`~partc.cost.timeline.WEIGHT_SHARE` of it is the weight's) for the
    one after's, whatever the ranks. Beyond the busiest rank's work where microbatches
    are few against the ranks (one microbatch through four ranks takes all four's time).

    Not in the floor under any schedule: that floor orders the joint search's meshes,
    and with this term in it Llama-3-70B's cold plan (1,024 H100) moved meshes of few
    microbatches ahead and played 66 more trials (414 against 348) for the same plan,
    two of its trials then left for want of CP-SAT work."""
    split = schedule_info(table.config.schedule).split_backward
    share = 1 - WEIGHT_SHARE if split else 1.0
    return sum((row.forward_ps + math.floor(share * row.backward_ps)
                + min(row.recompute_ps.values())) * count
               for row, count in distinct.values())


def _cheapest_sends(table: CostTable) -> int:
    """The least the sends of ``table``'s configuration cost their senders per
    microbatch, all ranks together: its crossing boundaries, each at a different cut,
    each at the cheapest any boundary pays there (the sending end's share,
    :func:`~partc.cost.evaluate.end_share_ps`)."""
    config = table.config
    boundaries = config.crossings()
    if not boundaries:
        return 0
    every = len(boundaries) == config.virtual_stages - 1   # every boundary crosses
    least: dict[int, int] = {}   # per row: equal cuts (between blocks) share one
    for row in table.cut_ps[:table.num_layers - 1]:
        if id(row) not in least:   # the sending end's share (end_share_ps), monotone
            least[id(row)] = end_share_ps(table, min(row[:len(boundaries)]) if every else min(
                row[j] for j in boundaries))
    cheapest = sorted(least[id(row)] for row in table.cut_ps[:table.num_layers - 1])
    return sum(cheapest[:len(boundaries)])


def _row_summary(table: CostTable) -> tuple[dict[int, tuple[Any, int]], tuple]:
    """The table's rows, each once, with how many layers share it (tables built with a
    ``TableCache`` give equal layers one row object), and their :func:`_knapsack`."""
    distinct: dict[int, tuple[Any, int]] = {}
    for row in table.layers:
        known = distinct.get(id(row))
        distinct[id(row)] = (row, known[1] + 1 if known else 1)
    return distinct, _knapsack(distinct)


def min_max_split(costs: tuple[int, ...], parts: int,
                  memo: dict[tuple, int] | None = None) -> int:
    """The least possible largest sum when ``costs`` are cut into at most ``parts``
    contiguous runs. ``memo`` (a ``TableCache``'s ``splits``) keeps the answers: the
    configurations of a search ask again for the same layers' costs."""
    if memo is None:
        return _least_largest_sum(costs, parts)
    if (costs, parts) not in memo:
        memo[costs, parts] = _least_largest_sum(costs, parts)
    return memo[costs, parts]


def _least_largest_sum(costs: tuple[int, ...], parts: int) -> int:
    """:func:`min_max_split` by binary search on the answer, with a greedy check per
    guess that takes each stretch of equal costs at once: 128 equal blocks are one step,
    not 128."""
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


def _recompute_floor(table: CostTable, knapsack: tuple[int, int, list],
                     one_in_flight: bool = False) -> float:
    config = table.config
    # Stage s holds at least f_s microbatches of its saved bytes A_s beside its state
    # W_s: A_s <= (M_s - W_s) / f_s, so sum_s A_s <= sum_s M_s / f_s - sum_s W_s / max f.
    # With f_s = 1, which every schedule holds: sum_s A_s <= sum_s M_s - W. Neither
    # bound implies the other (the second divides the state by max f), so both count.
    inflight = [1] * config.pp if one_in_flight else config.least_held()
    if not one_in_flight and any(f > 1 for f in inflight):
        return max(_recompute_floor(table, knapsack, True),
                   _knapsack_floor(table, knapsack, inflight))
    return _knapsack_floor(table, knapsack, inflight)


def _knapsack_floor(table: CostTable, knapsack: tuple[int, int, list],
                    inflight: list[int]) -> float:
    """The least recompute (LP relaxation) that brings the saved bytes under what the
    limits leave with ``inflight`` microbatches held per stage."""
    if not all(inflight):
        return 0.0
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


def balanced_split(costs: Sequence[int], parts: int,
                   memo: dict[tuple, int] | None = None) -> list[int]:
    """Each layer's run when ``costs`` are cut into exactly ``parts`` non-empty
    contiguous runs whose largest sum is the least possible (:func:`min_max_split`,
    with ``memo``)."""
    limit = min_max_split(tuple(costs), parts, memo)
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


def greedy_result(problem: PlanningProblem, table: CostTable, cache: TableCache,
                  bound: int = 0) -> ConfigResult | None:
    """The greedy plan (:func:`incumbent`) of ``table``'s configuration, on the layers
    of its tensor-parallel variant, as a FEASIBLE result; None when it does not fit."""
    config = table.config
    found = greedy_plan(problem.variant(config.tp, config.sequence_parallel,
                                        config.tp_objective), table, cache)
    if found is None:
        return None
    return ConfigResult(table=table, assignment=found[0], evaluation=found[1],
                        status="FEASIBLE", bound=bound, solve_time_s=0.0)


def incumbent(problem: PlanningProblem, table: CostTable,
              cache: TableCache | None = None) -> Assignment | None:
    """A plan to start CP-SAT from: the fastest-mode compute split evenly into runs;
    then, on each stage over its limit, recompute where it costs least per byte saved
    (greedy); None when even that does not fit. ``cache`` (the table's) keeps the
    splits, and the plan (:func:`greedy_plan`)."""
    found = greedy_plan(problem, table, cache)
    return found[0] if found is not None else None


def greedy_plan(problem: PlanningProblem, table: CostTable, cache: TableCache | None = None
                ) -> tuple[Assignment, Evaluation] | None:
    """:func:`incumbent`'s plan and its evaluation, kept in ``cache`` per table and
    problem: a search asks for one configuration's greedy plan from its seed, its
    solve's start and the joint search (685 evaluations of 260 plans, Llama-3-70B)."""
    if cache is None:
        return _greedy_plan(problem, table, None)
    key = (id(table), id(problem))
    if key not in cache.greedy:   # kept beside them: no other object takes those ids
        cache.greedy[key] = (table, problem, _greedy_plan(problem, table, cache))
    return cache.greedy[key][2]


def _greedy_plan(problem: PlanningProblem, table: CostTable, cache: TableCache | None
                 ) -> tuple[Assignment, Evaluation] | None:
    if table.num_layers < table.config.virtual_stages:
        return None
    fastest = [min(row.compute_ps(r) for r in row.recompute_ps) for row in table.layers]
    stage_of = balanced_split(fastest, table.config.virtual_stages,
                              cache.splits if cache is not None else None)
    allowed = [problem.allowed_modes(layer) for layer in range(table.num_layers)]
    modes = [min(options, key=lambda r: (table.layers[l].compute_ps(r),
                                         RECOMPUTE_MODES.index(r)))   # ties: none first
             for l, options in enumerate(allowed)]
    pp = table.config.pp
    for stage in range(pp):
        numbers = table.config.runs_of(stage)
        runs = [[l for l in range(table.num_layers) if stage_of[l] == j] for j in numbers]
        receive = receive_bytes(table, runs, numbers)
        _recompute_until_it_fits(table, stage, runs, allowed, modes, receive)
    evaluation = evaluate(table, stage_of, modes)
    if not evaluation.fits:
        return None
    return Assignment(stage_of=tuple(stage_of), modes=tuple(modes)), evaluation


def _recompute_until_it_fits(table: CostTable, stage: int, runs: list[list[int]],
                             allowed: list[list[str]], modes: list[str],
                             receive: int) -> None:
    """Change ``modes`` of the layers of ``runs`` (rank ``stage``'s, in place), one
    layer at a time, to the mode that frees the most activation memory at the rank's
    peak per picosecond, until its saved activations fit what its limit leaves (state,
    the largest transient and the ``receive`` buffers aside)."""
    config = table.config
    rows = table.layers
    members = [l for run in runs for l in run]
    state = sum(rows[l].state_total for l in members)
    state += sum(g.state_total for g in table.shared if any(l in members for l in g.layers))
    saved = [sum(rows[l].saved_bytes[modes[l]] for l in run) for run in runs]
    transient = max(rows[l].transient_bytes[modes[l]] for l in members)
    # Equal layers of a run in equal modes offer the same change: each such group offers
    # it once, by its first layer (runs are in order), so 128 equal blocks cost one look.
    groups: dict[tuple, list[int]] = {}
    for i, run in enumerate(runs):
        for l in run:
            groups.setdefault((i, id(rows[l]), modes[l], tuple(allowed[l])), []).append(l)
    held = config.held(stage)
    # Each peak's saved bytes (config.activations is the largest), kept as modes change.
    at_peak = [sum(n * a for n, a in zip(h, saved)) for h in held]
    changes: dict[tuple, list[tuple[str, int, int]]] = {}   # per group: its modes' changes
    while True:
        top = max(range(len(held)), key=at_peak.__getitem__)   # the first of the largest
        peak = held[top]
        if state + at_peak[top] + transient + receive <= table.limits[stage]:
            return
        best = None
        for key, layers in groups.items():
            i = key[0]
            if not layers or not peak[i]:
                continue
            l = layers[0]
            if key not in changes:
                row, current = rows[l], key[2]
                changes[key] = [(mode, row.compute_ps(mode) - row.compute_ps(current),
                                 row.saved_bytes[current] - row.saved_bytes[mode])
                                for mode in key[3]]
            for mode, slower, freed in changes[key]:
                if freed <= 0:
                    continue
                ratio = slower / (freed * peak[i])
                if best is None or (ratio, l) < best[:2]:
                    best = (ratio, l, mode, i)
        if best is None:
            return
        _, layer, mode, i = best
        freed = rows[layer].saved_bytes[modes[layer]] - rows[layer].saved_bytes[mode]
        saved[i] -= freed
        for k, h in enumerate(held):
            at_peak[k] -= h[i] * freed
        transient = max(transient, rows[layer].transient_bytes[mode])
        options = tuple(allowed[layer])
        groups[i, id(rows[layer]), modes[layer], options].pop(0)
        bisect.insort(groups.setdefault((i, id(rows[layer]), mode, options), []), layer)
        modes[layer] = mode


def starting_point(problem: PlanningProblem, table: CostTable, pinned: list[int] | None,
                   previous: Assignment | None, cache: TableCache | None = None
                   ) -> tuple[Assignment, Evaluation] | None:
    """The plan a solve starts from, evaluated: the greedy incumbent, or ``previous``
    when it still fits and is faster."""
    if pinned is not None:
        return None
    evaluated = [greedy_plan(problem, table, cache)]
    if previous is not None:
        evaluated.append((previous, evaluate(table, previous.stage_of, previous.modes)))
    fitting = [pair for pair in evaluated if pair is not None and pair[1].fits]
    return min(fitting, key=lambda pair: pair[1].step_ps) if fitting else None
