"""The schedules of every mesh: the second half of :func:`partc.planner.search.solve`.

The closed-form search weighs 1F1B and GPipe (and a pinned schedule's virtual-stage
counts) and picks, per mesh ``(pp, dp, tp, sequence parallelism, tensor-parallel
objective, ep)``, its best configuration: batch split and ZeRO stage. A schedule played
out (:func:`~partc.cost.evaluate.simulated_step_ps`, what a plan reports) may beat the
closed form's fill and drain, so every mesh is then priced with every schedule and
virtual-stage count its layers allow (:func:`~partc.planner.search.schedule_candidates`),
and the plan that plays out fastest over all of them is kept (:func:`choose`):

1. Each mesh gets a step time none of its plans plays out below, under any schedule
   (:func:`~.bounds.played_floor` with ``any_schedule``: the least over its
   configurations). Meshes are visited by that floor; once it reaches the fastest plan
   played so far, no later mesh can win and the search stops.
2. A mesh's configuration is the closed-form search's plan for it, or where that search
   pruned the mesh (by the closed form, which is no bound here) the greedy plan
   (:func:`~.bounds.incumbent`) of its configuration with the least floor (CP-SAT's,
   where no greedy plan fits, on its configurations by floor while that floor is below
   the fastest plan played: a 1T GPT's tensor-unsharded meshes, none of which fits,
   built hundreds of CP-SAT models to prove it). The closed-form search solves a
   configuration while its bound is below the best plan it has so far, so a mesh's plan
   there may be one solved early, slower by the closed form than a sibling's bound that
   was pruned later; then the sibling of least bound is taken where its greedy plan is
   faster by the closed form (:func:`_closest`). The mesh's other batch splits and ZeRO
   stages are weighed by the closed form only.
3. Each schedule and count of that configuration gets its own floor
   (:func:`~.bounds.played_floor`: its recompute, its crossing sends) and is left out
   where the floor reaches the fastest plan; else its greedy split is played out
   (:func:`~partc.planner.search.balanced_runs`: re-cut into runs of balanced compute,
   and on the mesh priced first into Megatron's even runs, where faster; on
   meshes other than the chosen one, within ``PlannerOptions.schedule_trial_ops``
   operations played: the rest are not reached, and the plan FEASIBLE). A schedule's
   trial on a mesh after the first stops playing once a rank's clock and the work it
   has left pass both the fastest plan by :data:`NEAR` and its mesh's fastest so far
   (:func:`~partc.cost.timeline.played_span`'s cutoff): a trial without a plan, bounded
   there (:data:`PLAYED_PAST`), which changes neither the plan, nor what CP-SAT is
   handed, nor any mesh's fastest plan played (each mesh's configuration is played in
   full: its step orders the waiting schedules). A schedule of
   a mesh after the first whose guess (:func:`_estimate`: the mesh's plan played under
   1F1B, less the fill and drain its virtual stages save) is above the fastest plan
   played waits until every mesh is visited, and the waiting ones are then priced by
   that guess, so that the trials limit falls on those least likely to win.
4. CP-SAT then solves the schedules still in the running whose greedy split played out
   within :data:`NEAR` of the fastest plan (or that have none), fastest greedy split
   first (the chosen mesh's before the others', which share a quarter of one
   configuration's work, :data:`LATER_SHARE`; the chosen mesh's with a greedy split
   share one configuration's, :data:`FIRST_SHARE`), each from its greedy split and
   kept where it plays out faster, while the work limit lasts; a trial whose floor
   reaches the fastest plan by then is not solved.

Every bound used is a lower bound on the step played out, so a plan left out is never
faster than the one kept. In what sense the plan is OPTIMAL: the closed-form search
proved its configuration optimal (of the closed form), and every schedule and count of
every mesh was either proven no faster than the plan by its floor or played out with a
split (CP-SAT's where its work reached it, else the greedy one); none was left for want
of work or of operations to play. The splits of the schedules played are not proven
optimal for the step played out (CP-SAT minimises the closed form), so OPTIMAL is
exact over meshes and schedules, not over every split of each. The floors are a
schedule's own (its recompute, sends) or, before its order is played, one that holds
for one microbatch in flight (:func:`~.bounds.played_floor`'s ``one_in_flight``); a
mesh's floor under any schedule counts its least recompute with one microbatch in
flight too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from partc import progress
from partc.cost.pipeline_config import PS_PER_S, PipelineConfig
from partc.cost.tables import CostTable, TableCache, build_cost_table
from partc.names import Outcome
from partc.options import PlannerOptions
from partc.planner.bounds import greedy_result, played_floor
from partc.planner.results import ConfigResult, MeshResult, ScheduleTrial
from partc.problem import PlanningProblem

# Why a trial has no plan: its floor reached the fastest plan played (before its greedy
# split or before CP-SAT), or the work limit came first.
PRUNED = "pruned (its bound)"
NOT_REACHED = "not reached (work limit)"
TRIAL_LIMIT = "not reached (schedule trials limit)"
NO_SPLIT = "no split fits"
# A trial of a mesh after the first whose play stopped once it was sure to be slower
# than both the fastest plan (by NEAR) and its own mesh's fastest so far.
PLAYED_PAST = "played past the fastest plan"

# How far above the fastest plan played a greedy split may play out and still be
# handed to CP-SAT (a heuristic: CP-SAT's
# objective is the closed form, so its split is no bound on the step played out either;
# a greedy split further above is settled as played, and the plan stays OPTIMAL).
NEAR = 0.02
# The share of one configuration's CP-SAT work that the schedules of meshes after the
# first get between them. A whole one (2 deterministic s by default) cost Llama-3-70B's
# cold plan on 1,024 H100 4.2 of its 15.4 CPU-s of planning, on two trials whose
# greedy splits CP-SAT did not beat; at a quarter, that plan, the Megatron-Core rows'
# and Llama 3 405B's pinned-against-unpinned checks are unchanged.
LATER_SHARE = 0.25
# The share of one configuration's CP-SAT work that the chosen mesh's schedules whose
# greedy split is played already (so settled) get between them, to improve on it.
# Unbounded, a re-plan of that 70B model at 60 GiB spent 34 of its 46 CPU-s on 27 such
# solves (every one of the work left): none beat the plan, two improved their own greedy
# split by 0.02% and 0.6%. Trials without a split are solved with the work left.
FIRST_SHARE = 1.0


def mesh_key(config: PipelineConfig) -> tuple:
    """What a mesh is: the devices' factorisation (:func:`mesh_axes` first) and the
    tensor-parallel variant."""
    return mesh_axes(config) + (config.sequence_parallel, config.tp_objective, config.ep)


def mesh_axes(config: PipelineConfig | MeshResult) -> tuple:
    """A mesh as the report lists it: ``(pp, dp, tp, cp, cp kind)``."""
    return (config.pp, config.dp, config.tp, config.cp, config.cp_kind)


class Chosen(NamedTuple):
    """What :func:`choose` found: the plan, every trial in order (the closed-form
    search's plan first), whether every trial in the running was settled, per mesh
    (:func:`mesh_key`) its fastest plan played, with its step time, and its floor under
    any schedule."""

    result: ConfigResult
    trials: tuple[ScheduleTrial, ...]
    finished: bool
    per_mesh: dict[tuple, tuple[ConfigResult, int]]
    floors: dict[tuple, float]


def choose(problem: PlanningProblem, tables: list[CostTable],
           outcomes: list, best: ConfigResult, options: PlannerOptions,
           cache: TableCache, work: float, closed: list[float]) -> Chosen:
    """The plan that plays out fastest over every mesh and schedule (the module
    docstring); ``tables`` and ``outcomes`` are the closed-form search's, ``best`` its
    plan, ``closed`` their closed form's lower bounds (:func:`~.bounds.lower_bound`, or
    what CP-SAT proved), ``work`` the deterministic seconds left for CP-SAT. The chosen
    mesh is priced first, then the others by floor."""
    from partc.planner.search import schedule_candidates

    search = _Search(problem, cache, work, options.schedule_trial_ops)
    # A configuration solved is known by its plan's closed form, not its bound.
    closed = [o.evaluation.step_ps if isinstance(o, ConfigResult) else bound
              for o, bound in zip(outcomes, closed)]
    first_trial = search.add(mesh_key(best.table.config), best, first=True)
    queued: list[tuple[float, int, tuple, PipelineConfig]] = []
    scale = min(1.0, problem.devices.split_backward_factor or 1.0)
    meshes = _meshes(tables, outcomes, cache, scale, mesh_key(best.table.config))
    floors = {key: floor for floor, key, _, _, _ in meshes}
    for done, (floor, key, members, member_floors, result) in enumerate(meshes):
        progress.update("schedules", done, len(meshes), f"pp={key[0]} dp={key[1]} "
                        f"tp={key[2]} cp={key[3]}", incumbent_s=search.step / PS_PER_S)
        if floor >= search.step and done:   # the chosen mesh's trials are all listed
            break
        if key == mesh_key(best.table.config):
            result = best   # not an equal plan CP-SAT found after the greedy seed
        else:
            result = _closest(problem, tables, members, closed, result, cache)
        if result is None:
            result = _greedy_result(problem, [tables[i] for i in members], cache)
        if result is None:   # greedy fits none: CP-SAT may (its work counted)
            result, floors[key] = search.solved_rep(options, [tables[i] for i in members],
                                                    member_floors)
            if result is None:
                continue
        trial = first_trial if result is best else search.add(key, result, first=not done,
                                                              whole=True)
        for config in schedule_candidates(problem, result.table.config):
            guess = _estimate(trial.step_ps, config)
            if done and guess > search.step:
                queued.append((guess, len(queued), key, config))
            else:
                search.price(key, config, first=not done)
    for _, _, key, config in sorted(queued):
        search.price(key, config, first=False)
    progress.update("schedules", len(meshes), len(meshes),
                    incumbent_s=search.step / PS_PER_S)
    finished = search.solve_pending(options) and not search.unsettled
    # Ties keep CP-SAT's plan over a greedy one, then the earlier.
    fastest = min((t for t in search.trials if t.result is not None),
                  key=lambda t: (t.step_ps, t.greedy))
    return Chosen(fastest.result, tuple(search.trials), finished, search.per_mesh, floors)


class _Search:
    """The trials so far, the fastest step played and each mesh's fastest plan, and
    the trials CP-SAT may still improve (``pending``: whether of a mesh priced after
    the first, greedy step, the trial, its floor)."""

    def __init__(self, problem: PlanningProblem, cache: TableCache, work: float,
                 limit: int) -> None:
        self.problem, self.cache = problem, cache
        self.work, self.limit = work, limit   # CP-SAT's work left, operations to play left
        self.unsettled = False   # a mesh or trial left without a plan for want of either
        self.trials: list[ScheduleTrial] = []
        self.step = math.inf
        self.per_mesh: dict[tuple, tuple[ConfigResult, int]] = {}
        self.pending: list[tuple[bool, float, ScheduleTrial, float]] = []

    def add(self, key: tuple, result: ConfigResult, first: bool = False,
            greedy: bool = False, whole: bool = False) -> ScheduleTrial:
        """``result`` played out, as a trial of mesh ``key`` (``first``: of the mesh
        priced first, whose trials are also played cut evenly, Megatron's way, and in
        full; ``greedy``: ``result`` is the greedy split; ``whole``: played in full, a
        mesh's configuration, whose step orders its schedules' trials, :func:`_estimate`).
        Else, of another mesh, the play stops once it is sure to be slower than both
        the fastest plan by :data:`NEAR` (so what CP-SAT is handed is unchanged) and
        the mesh's fastest so far (so each mesh's fastest plan played is too): then a
        trial without a plan, bounded."""
        known = self.per_mesh.get(key)
        cutoff = math.inf if first or whole else max(self.step * (1 + NEAR),
                                                     known[1] if known else 0)
        trial = _played(self.problem, result, first, greedy, cutoff)
        self.trials.append(trial)
        if trial.result is None:
            return trial
        if known is None or trial.step_ps < known[1]:
            self.per_mesh[key] = (trial.result, trial.step_ps)
        self.step = min(self.step, trial.step_ps)
        return trial

    def price(self, key: tuple, config: PipelineConfig, first: bool) -> None:
        """``config`` (a schedule of mesh ``key``): pruned by its floor, or its greedy
        split played out and left for CP-SAT."""
        table = build_cost_table(self.problem, config, self.cache)
        # The floor without the schedule's order first: playing torch's order for the
        # memory it holds is most of a trial's cost, and most trials are pruned without.
        bound = played_floor(table, self.cache, one_in_flight=True)
        if bound < self.step:
            bound = played_floor(table, self.cache)
        if bound >= self.step:
            self.trials.append(ScheduleTrial(config=config, why=PRUNED))
            return
        # Its operations, and the greedy split's own work, about 100 per layer.
        ops = 2 * config.num_microbatches * config.virtual_stages + 100 * table.num_layers
        if not first and self.limit < ops:
            self.unsettled = True
            self.trials.append(ScheduleTrial(config=config, why=TRIAL_LIMIT))
            return
        self.limit -= 0 if first else ops
        greedy = _greedy_result(self.problem, [table], self.cache)
        if greedy is None:
            self.pending.append((not first, math.inf, ScheduleTrial(config=config,
                                                                    why=NO_SPLIT), bound))
            return
        trial = dataclasses.replace(self.add(key, greedy, first, greedy=True), greedy=True)
        self.trials[-1] = trial
        if trial.result is not None:   # else slower than NEAR allows: settled
            self.pending.append((not first, trial.step_ps, trial, bound))

    def solved_rep(self, options: PlannerOptions, tables: list[CostTable],
                   floors: list[float]) -> tuple[ConfigResult | None, float]:
        """CP-SAT's plan of the first of ``tables`` (a mesh's, by their ``floors``
        under any schedule, ascending) that has one, while the work lasts and its floor
        is below the fastest plan played (the later ones' too: none of their plans can
        win); and the mesh's floor without the configurations CP-SAT proved have none."""
        from partc.planner.search import solve_config

        left = math.inf   # the least floor of the configurations not proven planless
        for table, floor in zip(tables, floors):
            if floor >= self.step:
                return None, min(left, floor)
            if self.work <= 0:
                self.unsettled = True
                return None, min(left, floor)
            result, status, _, spent = solve_config(
                self.problem, table, options, min(self.work, options.per_config_work), None,
                None, self.cache.solutions.get(table.config), self.cache)
            self.work -= spent
            self.unsettled |= result is None and status == "UNKNOWN"
            if result is not None:
                return result, min(left, floor)
            if status != "INFEASIBLE":
                left = min(left, floor)
        return None, left

    def solve_pending(self, options: PlannerOptions) -> bool:
        """CP-SAT on each pending trial, the first mesh's first, then by greedy step,
        from its greedy split, while ``work`` lasts and its floor is below the fastest
        plan played; whether every one was settled: played out with a split (greedy or
        CP-SAT's) or proven to have none. A trial CP-SAT does not reach keeps its greedy
        split: CP-SAT minimises the closed form, not the step played out, so even its
        optimum proves nothing of the played step that the greedy split's does not."""
        from partc.planner.search import solve_config

        finished = True
        # Only schedules whose greedy split played out within NEAR of the fastest plan
        # are solved (their greedy splits are played already, so settled), and other
        # meshes' get LATER_SHARE of one configuration's work between them: CP-SAT's work
        # on each is what a cold plan of a 70B model was seen to spend most of its time
        # on, and re-plans of it at 60 and 40 GiB most of theirs (41 and 72 CPU-s, on
        # the interleaved 1F1B trials of the pp=4 mesh they chose). Of those 21 CP-SAT
        # splits, 12 played out as their greedy ones, 8 played 25-71% slower (the
        # closed form does not see that runs of 1 and 19 layers on one rank keep the
        # next ranks waiting; balanced_runs' re-cut did not fit their memory), and one
        # 2% faster, still 10% above the plan.
        others = options.per_config_work * LATER_SHARE
        improve = options.per_config_work * FIRST_SHARE
        for later, _, trial, bound in sorted(self.pending, key=lambda p: (p[0], p[1])):
            config = trial.config
            improving = trial.result is not None and not later   # the chosen mesh's
            if bound >= self.step:
                if trial.result is None:
                    self.trials.append(dataclasses.replace(trial, why=PRUNED))
                continue
            if trial.result is not None and trial.step_ps > self.step * (1 + NEAR):
                continue
            if improving and improve <= 0:
                continue   # settled by its greedy split
            if self.work <= 0 or later and others <= 0:
                if trial.result is None:
                    finished = False
                    self.trials.append(dataclasses.replace(trial, why=NOT_REACHED))
                continue
            table = build_cost_table(self.problem, config, self.cache)
            previous = self.cache.solutions.get(config)
            share = min(self.work, options.per_config_work, others if later else
                        improve if improving else math.inf)
            result, status, _, spent = solve_config(self.problem, table, options, share, None,
                                                    None, previous, self.cache)
            self.work -= spent
            others -= spent if later else 0
            improve -= spent if improving else 0
            if result is None:
                if trial.result is None:
                    finished &= status != "UNKNOWN"
                    self.trials.append(ScheduleTrial(
                        config=config, why=NO_SPLIT if status == "INFEASIBLE" else
                        "work limit"))
                continue
            solved = self.add(mesh_key(config), result, not later)
            if solved.result is not None:
                self.cache.solutions[config] = solved.result.assignment
        return finished


def _meshes(tables: list[CostTable], outcomes: list, cache: TableCache, scale: float,
            chosen: tuple) -> list[tuple[float, tuple, list[int], list[float],
                                         ConfigResult | None]]:
    """Per mesh with a configuration that may fit: its floor under any schedule, its
    key, its configurations (by floor) and their floors, and the closed-form search's
    plan for it (or None); the ``chosen`` mesh first, then by floor."""
    groups: dict[tuple, list[int]] = {}
    solved: dict[tuple, list[ConfigResult]] = {}   # per mesh, its results in order
    for i, table in enumerate(tables):
        groups.setdefault(mesh_key(table.config), []).append(i)
    for o in outcomes:
        if isinstance(o, ConfigResult):
            solved.setdefault(mesh_key(o.table.config), []).append(o)
    meshes = []
    for key, members in groups.items():
        floors = {i: played_floor(tables[i], cache, any_schedule=True, backward_scale=scale)
                  for i in members}
        members = sorted((i for i in members if floors[i] < math.inf and
                          outcomes[i] != Outcome.INFEASIBLE), key=lambda i: (floors[i], i))
        if not members:
            continue
        results = solved.get(key, [])
        result = min(results, key=lambda r: r.evaluation.step_ps) if results else None
        meshes.append((floors[members[0]], key, members, [floors[i] for i in members],
                       result))
    meshes.sort(key=lambda mesh: (mesh[1] != chosen, mesh[0], mesh[1]))
    return meshes


def _estimate(step_ps: float, config: PipelineConfig) -> float:
    """A guess at ``config``'s step (a schedule of a mesh whose plan played out in
    ``step_ps``, under 1F1B unless a schedule is pinned), the order in which the other
    meshes' schedules are priced: 1F1B's fill and drain, ``(pp - 1) / (m + pp - 1)`` of its step, divided by
    the virtual stages per rank. Only an order: the trials limit then falls on the
    schedules least likely to win, never on a bound."""
    pp, m = config.pp, config.num_microbatches
    fill = (pp - 1) / (m + pp - 1)
    return step_ps * (1 - fill + fill / config.chunks)


def _closest(problem: PlanningProblem, tables: list[CostTable], members: list[int],
             closed: list[float], result: ConfigResult | None,
             cache: TableCache) -> ConfigResult | None:
    """A mesh's configuration by the closed form: ``result`` (the closed-form search's
    plan, or None), or the greedy plan of the configuration of ``members`` with the
    least closed-form bound where that plan is faster by the closed form. The search
    solves configurations while their bound is below its best plan, so a mesh's plan may
    be one solved early, far above a sibling pruned later (462B's pp = 16: 4 sequences a
    microbatch at 27.5 s solved, one a microbatch, whose 1F1B fill is a quarter as long,
    pruned at 17.2 s)."""
    lead = min(members, key=lambda i: (closed[i], i))
    if result is not None and closed[lead] >= result.evaluation.step_ps:
        return result
    greedy = greedy_result(problem, tables[lead], cache)
    if greedy is None or (result is not None
                          and greedy.evaluation.step_ps >= result.evaluation.step_ps):
        return result
    return greedy


def _greedy_result(problem: PlanningProblem, tables: list[CostTable],
                   cache: TableCache) -> ConfigResult | None:
    """The greedy plan (:func:`~.bounds.incumbent`) of the first of ``tables`` that has
    one that fits, as a FEASIBLE result."""
    return next((result for table in tables
                 if (result := greedy_result(problem, table, cache)) is not None), None)


def _played(problem: PlanningProblem, result: ConfigResult, even: bool = False,
            greedy: bool = False, cutoff: float = math.inf) -> ScheduleTrial:
    from partc.planner.search import balanced_runs

    played, step = balanced_runs(problem, result, even, greedy, cutoff)
    if played is None:
        return ScheduleTrial(config=result.table.config, why=PLAYED_PAST, bound_ps=step)
    return ScheduleTrial(config=result.table.config, result=played, step_ps=step,
                         solved=result if played is not result else None)


def priced_meshes(meshes: tuple[MeshResult, ...], chosen: Chosen) -> tuple[MeshResult, ...]:
    """The report's meshes (:func:`~.meshes.mesh_results`) each priced with its fastest
    plan played out over every schedule the joint search tried (``chosen.per_mesh``),
    and bounded by its floor under any schedule (a mesh the joint search did not price
    is pruned by it); the chosen mesh first, then the solved ones by that step time."""
    fastest: dict[tuple, tuple[ConfigResult, int]] = {}
    for key, (result, step) in chosen.per_mesh.items():
        known = fastest.get(key[:5])
        if known is None or step < known[1]:
            fastest[key[:5]] = (result, step)
    floors: dict[tuple, float] = {}
    for key, floor in chosen.floors.items():
        floors[key[:5]] = min(floors.get(key[:5], math.inf), floor)
    picked = mesh_axes(chosen.result.table.config)
    chosen_step = min(step for _, step in chosen.per_mesh.values())
    priced = []
    for mesh in meshes:
        found = fastest.get(mesh_axes(mesh))
        floor = floors.get(mesh_axes(mesh), mesh.bound_ps)
        if mesh.outcome != Outcome.INFEASIBLE and floor == math.inf:   # CP-SAT proved
            mesh = dataclasses.replace(mesh, outcome=Outcome.INFEASIBLE,   # none fits
                                       bound_ps=None, config=None, step_ps=None,
                                       status=None)
        elif mesh.outcome != Outcome.INFEASIBLE:   # a bound on the step played, not the
            mesh = dataclasses.replace(mesh, bound_ps=int(floor))   # closed form
        if found is not None:
            result, step = found
            mesh = dataclasses.replace(mesh, outcome=Outcome.SOLVED, config=result.table.config,
                                       step_ps=step, status=result.status)
        elif mesh.outcome != Outcome.INFEASIBLE:   # no plan played: pruned by its floor,
            step = chosen_step                   # or else not settled
            mesh = dataclasses.replace(
                mesh, outcome=Outcome.PRUNED if mesh.bound_ps >= step else Outcome.WORK_LIMIT,
                config=None, step_ps=None, status=None)
        priced.append(mesh)
    order = {Outcome.SOLVED: 0, Outcome.WORK_LIMIT: 1, Outcome.PRUNED: 1, Outcome.INFEASIBLE: 2}
    return tuple(sorted(priced, key=lambda m: (
        mesh_axes(m) != picked, order[m.outcome],
        m.step_ps if m.outcome == Outcome.SOLVED else 0, m.pp, m.dp, m.tp, m.cp,
        m.cp_kind or "")))
