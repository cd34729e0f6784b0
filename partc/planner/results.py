"""What the planner returns, as frozen dataclasses: one configuration's plan
(:class:`Assignment`, :class:`ConfigResult`), what the search learnt about each mesh
factorisation (:class:`MeshResult`), and the whole search's answer (:class:`PlannerResult`)."""

from __future__ import annotations

from dataclasses import dataclass

from partc.cost.evaluate import Evaluation
from partc.cost.pipeline_config import PipelineConfig
from partc.cost.tables import CostTable
from partc.names import Outcome


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """Per layer: the run it sits in (its stage when there is one run per stage) and its
    recompute mode."""

    stage_of: tuple[int, ...]
    modes: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ConfigResult:
    """The plan found for one configuration: ``status`` is CP-SAT's ("FEASIBLE" also for
    a greedy plan CP-SAT did not improve on), ``bound`` a step time no plan of this
    configuration beats."""

    table: CostTable
    assignment: Assignment
    evaluation: Evaluation
    status: str
    bound: int
    solve_time_s: float


MESH_OUTCOMES: tuple[Outcome, ...] = tuple(Outcome)


@dataclass(frozen=True, kw_only=True)
class MeshResult:
    """What the search learnt about one ``(pp, dp, cp, tp)`` factorisation of the devices
    (with its context-parallel kind).

    ``outcome`` is one of :data:`MESH_OUTCOMES`: "solved" (``config`` is its fastest plan
    found, ``step_ps`` its step time), "work limit" (the search's work ran out before it solved any
    of its configurations), "pruned" (each configuration's lower bound was no better than
    the chosen plan) or "infeasible" (no configuration fits memory; ``need_bytes`` against
    ``limit_bytes`` on the stage of the tightest split, when known). ``bound_ps`` is a step
    time no configuration of this factorisation can beat (None when infeasible).
    """

    pp: int
    dp: int
    tp: int
    outcome: Outcome
    cp: int = 1
    cp_kind: str | None = None
    bound_ps: int | None = None
    config: PipelineConfig | None = None
    step_ps: int | None = None
    status: str | None = None            # CP-SAT's status for ``config``
    need_bytes: int | None = None
    limit_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class ScheduleTrial:
    """One schedule weighed on a mesh's configuration by the joint search
    (``partc.planner.joint``): its plan and simulated step time, or why it has none
    (``why``)."""

    config: PipelineConfig
    result: ConfigResult | None = None
    step_ps: int | None = None
    why: str | None = None
    # The split CP-SAT found by the closed form where ``result`` is another that plays
    # out faster: its layers re-cut into balanced runs, or the greedy split
    # (``partc.planner.search.balanced_runs``).
    solved: ConfigResult | None = None
    # ``result`` is the greedy split (``partc.planner.bounds.incumbent``), not CP-SAT's.
    greedy: bool = False
    # Played past the fastest plan (partc.planner.joint.PLAYED_PAST): a step its split
    # does not play out below, where its play stopped.
    bound_ps: float | None = None


@dataclass(frozen=True, kw_only=True)
class PlannerResult:
    best: ConfigResult
    status: str
    bound: int
    solve_time_s: float
    configs_total: int
    configs_solved: int
    configs_pruned: int
    # Schedule trials played out with their greedy split alone, or with no split that fits.
    configs_played: int = 0
    meshes: tuple[MeshResult, ...] = ()     # best first; the chosen mesh leads
    # The automatic schedule choice's trials (the closed-form search's plan first); one
    # when the schedule was pinned or there is one stage.
    schedule_trials: tuple[ScheduleTrial, ...] = ()

    @property
    def searched(self) -> ConfigResult:
        """The closed-form search's plan, whose objective ``bound`` and ``gap`` are of
        (``best`` unless the automatic schedule choice found a faster schedule)."""
        if not self.schedule_trials:
            return self.best
        first = self.schedule_trials[0]
        return first.solved or first.result

    @property
    def gap(self) -> float:
        step = self.searched.evaluation.step_ps
        return max(0.0, (step - self.bound) / step) if step else 0.0
