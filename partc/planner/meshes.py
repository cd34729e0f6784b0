"""What the search learnt about each ``(pp, dp, cp, tp)`` factorisation of the devices, for
the report: its fastest plan, or why it has none (:data:`~.results.MESH_OUTCOMES`), best
first with the chosen mesh leading."""

from __future__ import annotations

import math

from partc.cost.tables import CostTable
from partc.names import Outcome
from partc.planner.results import ConfigResult, MeshResult
from partc.problem import PlanningProblem
from partc.report.explain import tightest_split

# The report lists meshes in this order; unsettled ones together, by their bound.
_MESH_ORDER = {Outcome.SOLVED: 0, Outcome.WORK_LIMIT: 1, Outcome.PRUNED: 1,
               Outcome.INFEASIBLE: 2}


def mesh_results(problem: PlanningProblem, tables: list[CostTable], floors: list[float],
                 outcomes: list[ConfigResult | Outcome],
                 best: ConfigResult) -> tuple[MeshResult, ...]:
    """One MeshResult per (pp, dp, tp) among the configurations, best first: solved by
    step time (the chosen mesh first), then unsettled by bound, then infeasible.
    ``outcomes`` holds per configuration its ConfigResult or why it has none."""
    groups: dict[tuple, list[int]] = {}
    for i, table in enumerate(tables):
        config = table.config
        groups.setdefault((config.pp, config.dp, config.tp, config.cp, config.cp_kind),
                          []).append(i)
    meshes = [_mesh_result(problem, mesh, [tables[i] for i in members],
                           [floors[i] for i in members], [outcomes[i] for i in members], best)
              for mesh, members in groups.items()]
    chosen = best.table.config

    def rank(mesh: MeshResult) -> tuple:
        is_chosen = (mesh.pp, mesh.dp, mesh.tp, mesh.cp, mesh.cp_kind) == (
            chosen.pp, chosen.dp, chosen.tp, chosen.cp, chosen.cp_kind)
        value = mesh.step_ps if mesh.outcome == Outcome.SOLVED else mesh.bound_ps
        if mesh.outcome == Outcome.INFEASIBLE:
            value = mesh.need_bytes / max(mesh.limit_bytes, 1) if mesh.need_bytes else math.inf
        return (_MESH_ORDER[mesh.outcome], value, not is_chosen, mesh.pp, mesh.dp, mesh.tp,
                mesh.cp, mesh.cp_kind or "")

    return tuple(sorted(meshes, key=rank))


def _mesh_result(problem: PlanningProblem, mesh: tuple,
                 tables: list[CostTable], floors: list[float],
                 outcomes: list[ConfigResult | Outcome], best: ConfigResult) -> MeshResult:
    pp, dp, tp, cp, cp_kind = mesh
    axes = dict(pp=pp, dp=dp, tp=tp, cp=cp, cp_kind=cp_kind)
    results = [o for o in outcomes if isinstance(o, ConfigResult)]
    # A solved configuration can do no better than CP-SAT's bound, an unsolved one than
    # its lower bound; infeasible ones do not count.
    bounds = [r.bound for r in results] + [
        floor for floor, o in zip(floors, outcomes) if o in (Outcome.PRUNED, Outcome.WORK_LIMIT)]
    bound = int(min(bounds)) if bounds else None
    if results:
        top = best if any(r is best for r in results) else min(
            results, key=lambda r: r.evaluation.step_ps)
        return MeshResult(**axes, outcome=Outcome.SOLVED, bound_ps=bound,
                          config=top.table.config, step_ps=top.evaluation.step_ps,
                          status=top.status)
    if bound is not None:
        outcome = Outcome.WORK_LIMIT if Outcome.WORK_LIMIT in outcomes else Outcome.PRUNED
        return MeshResult(**axes, outcome=outcome, bound_ps=bound)
    need, limit = _memory_need(problem, tables)
    return MeshResult(**axes, outcome=Outcome.INFEASIBLE, need_bytes=need,
                      limit_bytes=limit)


def _memory_need(problem: PlanningProblem,
                 tables: list[CostTable]) -> tuple[int | None, int | None]:
    """The memory the tightest split of any of ``tables`` needs on its worst stage, and
    that stage's limit; (None, None) when that split fits (then only the pins keep these
    configurations out)."""
    tables = [t for t in tables if t.config.chunks == 1] or tables
    tight = min((tightest_split(t, problem) for t in tables), key=lambda split: split.ratio)
    if tight.ratio <= 1:
        return None, None
    return tight.stage_need[tight.worst], tight.limits[tight.worst]
