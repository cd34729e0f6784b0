"""The planner: stages, recompute, microbatches and schedule, by CP-SAT.

It takes a ``PlanningProblem`` (plain numbers) and returns a :class:`PlannerResult`
(data). Nothing it does depends on an earlier call, except through the ``TableCache``
a caller passes to :func:`solve`.

- ``search.py``: :func:`solve`, the outer search: the candidate configurations, their
  order and pruning by lower bound, the greedy seed, one CP-SAT solve per configuration
  (:func:`solve_config`) and its status handling.
- ``stage_model.py``: the CP-SAT model of one configuration (layers into runs and
  recompute modes); its docstring is the formulation: sets, parameters, variables,
  objective, numbered constraints.
- ``joint.py``: the second half of the search: every mesh priced with every schedule and
  virtual-stage count, played out, pruned by floors valid for every schedule.
- ``bounds.py``: what is known without the solver: the lower bound on a configuration's
  step time (min-max split, recompute knapsack), the floor of its step played out under
  any schedule, and the greedy plan CP-SAT starts from.
- ``expert_parallel.py``: the expert-parallel degree of mixture-of-experts layers: the degrees
  each configuration allows (:func:`~.expert_parallel.expand`), the ``ep`` pin's refusals, and
  the plan's expert section.
- ``meshes.py``: what the search learnt about each ``(pp, dp, tp)`` factorisation, for
  the report.
- ``results.py``: the outputs, frozen dataclasses.
"""

from partc.options import PlannerOptions
from partc.planner.bounds import balanced_split, incumbent, lower_bound
from partc.planner.meshes import mesh_results
from partc.planner.results import (MESH_OUTCOMES, Assignment, ConfigResult, MeshResult,
                                   PlannerResult, ScheduleTrial)
from partc.planner.joint import choose as choose_schedules
from partc.planner.search import (candidate_configs, divisors, schedule_candidates,
                                  schedule_options, solve, solve_config, tp_choices,
                                  virtual_stage_counts)
from partc.planner.stage_model import segments

__all__ = [
    "schedule_options", "MESH_OUTCOMES", "Assignment",
    "ConfigResult", "MeshResult", "PlannerOptions", "PlannerResult", "ScheduleTrial",
    "balanced_split", "candidate_configs", "choose_schedules", "divisors", "incumbent",
    "lower_bound", "mesh_results", "schedule_candidates", "segments", "solve",
    "solve_config", "tp_choices", "virtual_stage_counts",
]
