"""Options of partc's two CP-SAT searches, in one place: the stage planner's
(``partc.planner``) and the tensor-parallel sharding chooser's.

Every limit is work, never wall-clock time: CP-SAT's deterministic time
(:mod:`partc.cp_sat`), in deterministic seconds. With the seed and the worker count
fixed, a plan is then a function of its inputs: every rank, and the same command on a
busier machine, gets the same plan, and a search stopped by its limit stops at the same
point everywhere (and says FEASIBLE, not OPTIMAL).
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_limits(owner: str, work_limit: float, num_workers: int) -> None:
    if not work_limit > 0:
        raise ValueError(f"{owner}.work_limit must be positive (deterministic seconds of "
                         f"CP-SAT work), got {work_limit}")
    if num_workers < 1:
        raise ValueError(f"{owner}.num_workers must be at least 1, got {num_workers}")


@dataclass(frozen=True, kw_only=True)
class ShardingOptions:
    """The per-layer sharding chooser's CP-SAT limits."""

    # Deterministic seconds for each of a layer's solves (one per goal: time then memory,
    # or memory then time). CP-SAT does about 0.45 of them per CPU second on these
    # models: 10 is about the 20 s wall-clock limit this replaced, on an idle core. Most
    # layers take under 0.05; the tiny DeepSeek-V2's latent-attention and MoE layers
    # at tp=2 take several (and were cut short under load by the clock).
    work_limit: float = 10.0
    num_workers: int = 1          # one worker searches in order: deterministic
    # CP-SAT's own default. Where two picks of a layer cost the same, the seed decides
    # which one is returned; the shardings have always been chosen with this one.
    seed: int = 1

    def __post_init__(self) -> None:
        _check_limits("ShardingOptions", self.work_limit, self.num_workers)


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """How the stage planner's CP-SAT search runs, and the sharding chooser's with it."""

    # Deterministic seconds of CP-SAT work for the whole search (every configuration
    # and schedule solved). Only the solver's work counts: the Python around it (cost
    # tables, bounds, the schedules played out) is bounded by the configurations, the
    # same on every machine. CP-SAT does 0.1 to 0.6 of them per CPU second on stage
    # models: 16 (2 per configuration) is about the 30 s (3.75 s per configuration)
    # wall-clock limit this replaced, on an idle core. The hardest solve of the test
    # suite's default limits, the 4-layer GPT-2 at pp=2, takes 1.2.
    work_limit: float = 16.0
    num_workers: int = 1          # one worker searches in order: deterministic
    seed: int = 0
    # CP-SAT's presolve took most of each solve on the segment model (most
    # configurations are settled by the root LP bound against the cutoff): off, the 1T
    # GPT's search solved its 35 configurations in a third of the time.
    presolve: bool = False
    # One configuration's share of ``work_limit`` (None: an eighth, at least
    # ``MIN_CONFIG_WORK``), so that one hard configuration cannot starve the rest;
    # stopped early, it keeps its incumbent.
    config_work_limit: float | None = None
    # How much the joint search (partc.planner.joint) may play out of the greedy splits
    # of meshes other than the closed-form search's choice, counted in operations (a
    # microbatch's forward or backward through one virtual stage, 2 m pp v a schedule,
    # and 100 per layer for the split itself). Llama-3-70B on 1,024 H100 plays about 1.6
    # million, all it has: its plan is OPTIMAL. Every schedule of the chosen mesh is
    # played; those beyond are "not reached", and the plan FEASIBLE. A count, not a time,
    # so the plan is a function of its inputs. (Since a send costs neither end beside
    # NCCL, fewer trials fall to their floors: Megatron's 145.6B GPT on 1,536 A100 plays
    # 4.2 million, all it needs, in the same 25 s.)
    schedule_trial_ops: int = 8_000_000
    sharding: ShardingOptions = ShardingOptions()

    def __post_init__(self) -> None:
        _check_limits("PlannerOptions", self.work_limit, self.num_workers)
        if self.config_work_limit is not None and not self.config_work_limit > 0:
            raise ValueError(f"PlannerOptions.config_work_limit must be positive "
                             f"(deterministic seconds), got {self.config_work_limit}")

    @property
    def per_config_work(self) -> float:
        if self.config_work_limit is not None:
            return self.config_work_limit
        return max(MIN_CONFIG_WORK, self.work_limit / 8)


MIN_CONFIG_WORK = 1.0   # a configuration's share when the limit is small
