"""Options of partc's two CP-SAT searches, in one place: the stage planner's
(``partc.planner``) and the tensor-parallel sharding chooser's. Both are deterministic
for a fixed seed and worker count."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ShardingOptions:
    """The per-layer sharding chooser's CP-SAT limits."""

    time_limit_s: float = 20.0
    num_workers: int = 1          # one worker keeps CP-SAT deterministic
    # CP-SAT's own default. Where two picks of a layer cost the same, the seed decides
    # which one is returned; the shardings have always been chosen with this one.
    seed: int = 1


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """How the stage planner's CP-SAT search runs, and the sharding chooser's with it."""

    time_limit_s: float = 30.0
    num_workers: int = 1          # one worker keeps CP-SAT deterministic
    seed: int = 0
    # CP-SAT's presolve took most of each solve on the segment model (most
    # configurations are settled by the root LP bound against the cutoff): off, the 1T
    # GPT's search solved its 35 configurations in a third of the time.
    presolve: bool = False
    # One configuration's share of the limit (None: an eighth, at least 2 s), so that one
    # hard configuration cannot starve the rest; stopped early, it keeps its incumbent.
    config_time_limit_s: float | None = None
    sharding: ShardingOptions = ShardingOptions()

    @property
    def per_config_s(self) -> float:
        if self.config_time_limit_s is not None:
            return self.config_time_limit_s
        return max(2.0, self.time_limit_s / 8)
