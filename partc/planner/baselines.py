"""The obvious alternatives a plan is compared with, under the same cost model.

- *uniform*: the same number of layers per stage (DeepSpeed's ``partition_method="uniform"``);
- *parameters*: stages balanced by parameter count (DeepSpeed's default,
  ``"parameters"``), found exactly by a min-max dynamic program.

Each keeps the plan's mesh, microbatching and schedule, and takes the first uniform
recompute policy that fits: none, then selective, then full — what a person tuning by hand
would try.
"""

from __future__ import annotations

from dataclasses import dataclass

from partc.cost.evaluate import Evaluation, evaluate
from partc.cost.tables import CostTable
from partc.problem import PlanningProblem


@dataclass(frozen=True, kw_only=True)
class Baseline:
    name: str
    description: str
    stage_of: tuple[int, ...]
    recompute: str
    evaluation: Evaluation


def uniform_split(num_layers: int, pp: int) -> list[int]:
    return [layer * pp // num_layers for layer in range(num_layers)]


def parameter_balanced_split(counts: list[int], pp: int) -> list[int]:
    """Contiguous split minimising the largest stage's parameter count (ties: earlier cuts)."""
    n = len(counts)
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[(inf, ())] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = (0, ())
    for stage in range(1, pp + 1):
        for end in range(stage, n + 1):
            for start in range(stage - 1, end):
                before, starts = best[stage - 1][start]
                worst = max(before, prefix[end] - prefix[start])
                if worst < best[stage][end][0]:
                    best[stage][end] = (worst, starts + (start,))
    starts = best[pp][n][1][1:]
    return [sum(1 for s in starts if s <= layer) for layer in range(n)]


def _layer_params(problem: PlanningProblem) -> list[int]:
    counts = [layer.param_count for layer in problem.layers]
    for group in problem.model.shared:
        for layer in group.layers:
            counts[layer] += group.param_count
    return counts


def _with_policy(table: CostTable, problem: PlanningProblem,
                 stage_of: list[int]) -> tuple[str, Evaluation]:
    evaluation = None
    for policy in ("none", "selective", "full"):
        modes = [policy if policy in layer.modes else "none" for layer in problem.layers]
        evaluation = evaluate(table, stage_of, modes)
        if evaluation.fits:
            return policy, evaluation
    return "full", evaluation


def baselines(problem: PlanningProblem, table: CostTable) -> list[Baseline]:
    problem = problem.variant(table.config.tp, table.config.sequence_parallel,
                              table.config.tp_objective)
    pp, n = table.config.virtual_stages, problem.num_layers   # runs of layers
    splits = [
        ("uniform", "same number of layers per stage", uniform_split(n, pp)),
        ("parameters", "stages balanced by parameter count (DeepSpeed's default)",
         parameter_balanced_split(_layer_params(problem), pp)),
    ]
    result = []
    for name, description, stage_of in splits:
        policy, evaluation = _with_policy(table, problem, stage_of)
        result.append(Baseline(name=name, description=description, stage_of=tuple(stage_of),
                               recompute=policy, evaluation=evaluation))
    return result
