"""The pipeline schedules partc plans and runs, and what each asks of a plan.

One table, read by the planner (which schedules and virtual-stage counts to try), the
runtime (which torch schedule to build, which virtual stages a rank holds), the cost
model's event simulation and the report. Torch-free: the command line reads it before
it imports torch.

Words: the model is cut into ``pp * v`` contiguous **virtual stages** (runs of layers),
numbered in model order; each of the ``pp`` pipeline ranks holds ``v`` of them.
``"loop"`` placement gives rank ``r`` the virtual stages ``r, r + pp, r + 2 pp, ...``
(Megatron's interleaving, torch's looped schedules); ``"v"`` placement gives rank ``r``
the virtual stages ``r`` and ``2 pp - 1 - r``, so the first and the last live on rank 0
(torch's ZBV and DualPipeV).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from partc.names import Schedule


@dataclass(frozen=True)
class ScheduleInfo:
    """One schedule: its name, torch's class, and what it needs of a plan."""

    name: Schedule
    torch_class: str                 # in torch.distributed.pipelining.schedules
    placement: str                   # "loop" or "v"
    virtual_stages: tuple[int, ...]  # allowed v; () means any v >= 2
    split_backward: bool             # runs backward as input-gradient + weight-gradient
    rounds_divide: bool = False      # microbatches a multiple of torch's rounds (m // pp)
    min_microbatches_per_stage: int = 0   # m >= this x (pp x v)

    def allows_virtual_stages(self, v: int) -> bool:
        return v in self.virtual_stages if self.virtual_stages else v >= 2


SCHEDULE_TABLE: dict[Schedule, ScheduleInfo] = {s.name: s for s in (
    ScheduleInfo(Schedule.GPIPE, "ScheduleGPipe", "loop", (1,), False),
    ScheduleInfo(Schedule.ONE_F_ONE_B, "Schedule1F1B", "loop", (1,), False),
    ScheduleInfo(Schedule.INTERLEAVED_1F1B, "ScheduleInterleaved1F1B", "loop", (), False,
                 rounds_divide=True),
    ScheduleInfo(Schedule.LOOPED_BFS, "ScheduleLoopedBFS", "loop", (), False),
    ScheduleInfo(Schedule.INTERLEAVED_ZERO_BUBBLE, "ScheduleInterleavedZeroBubble", "loop",
                 (), True, rounds_divide=True),
    ScheduleInfo(Schedule.ZBV_ZERO_BUBBLE, "ScheduleZBVZeroBubble", "v", (2,), True),
    ScheduleInfo(Schedule.DUALPIPEV, "ScheduleDualPipeV", "v", (2,), True,
                 min_microbatches_per_stage=1),
)}


def schedule(name: str) -> ScheduleInfo:
    try:
        return SCHEDULE_TABLE[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; partc runs "
                         f"{', '.join(SCHEDULE_TABLE)}") from None


def rank_of(name: str, pp: int, v: int, virtual_stage: int) -> int:
    """The pipeline rank that holds ``virtual_stage`` (0 .. pp * v - 1)."""
    if not 0 <= virtual_stage < pp * v:
        raise ValueError(f"virtual stage {virtual_stage} out of range for pp={pp}, v={v}")
    if schedule(name).placement == "v":
        return virtual_stage if virtual_stage < pp else 2 * pp - 1 - virtual_stage
    return virtual_stage % pp


@lru_cache(maxsize=4096)
def stages_of_rank(name: str, pp: int, v: int, rank: int) -> tuple[int, ...]:
    """The virtual stages rank ``rank`` holds, in model order (those :func:`rank_of`
    places on it, found without asking it of every virtual stage: the search asks this
    of every rank of every configuration it prices)."""
    if not 0 <= rank < pp:
        return ()
    if schedule(name).placement == "v":   # down the ranks, then back up
        return tuple(j for j in (rank, 2 * pp - 1 - rank) if j < pp * v)
    return tuple(range(rank, pp * v, pp))


@lru_cache(maxsize=4096)
def crossing_runs(name: str, pp: int, v: int) -> tuple[int, ...]:
    """The virtual stages ``j`` whose successor ``j + 1`` is on another rank: the
    boundaries a microbatch's activation is sent across."""
    return tuple(j for j in range(pp * v - 1)
                 if rank_of(name, pp, v, j) != rank_of(name, pp, v, j + 1))


def refusal(name: str, pp: int, v: int, num_microbatches: int) -> str | None:
    """Why torch's schedule ``name`` cannot run ``pp`` ranks of ``v`` virtual stages
    each over ``num_microbatches`` microbatches; None when it can."""
    s = schedule(name)
    if not s.allows_virtual_stages(v):
        wanted = (" or ".join(map(str, s.virtual_stages)) if s.virtual_stages
                  else "2 or more")
        return f"{name} runs {wanted} virtual stage(s) per rank, not {v}"
    if s.rounds_divide:
        rounds = max(1, num_microbatches // pp)
        if num_microbatches % rounds:
            return (f"{name} needs the microbatches ({num_microbatches}) to be a multiple "
                    f"of its rounds ({rounds} = microbatches // pp)")
    if num_microbatches < s.min_microbatches_per_stage * pp * v:
        return (f"{name} needs at least {s.min_microbatches_per_stage * pp * v} "
                f"microbatches (one per virtual stage), not {num_microbatches}")
    return None


def runs_compiled(name: str, compiled: bool) -> bool:
    """Whether the stages run under ``torch.compile`` with schedule ``name`` where the
    planner may compile them (``compiled``, :attr:`partc.problem.TrainNumbers.compiled`):
    wherever the schedule runs a whole backward (a compiled region's backward is one
    autograd node, which a split backward cannot split)."""
    return compiled and not schedule(name).split_backward


def feature_refusal(name: str, zero_stage: int, compiled: bool) -> str | None:
    """Why partc's runtime cannot run schedule ``name`` with the other decisions alike to
    one process (None if it can): a split backward computes weight gradients with
    ``torch.autograd.grad`` outside FSDP's hooks, so ZeRO-2/3 (``zero_stage``, the
    effective one) would reduce-scatter nothing; and a compiled region's backward is
    one autograd node, which cannot be split (``compiled``: compile pinned on)."""
    if not schedule(name).split_backward:
        return None
    if zero_stage >= 2:
        return (f"{name} splits backward into input- and weight-gradient parts, which "
                f"FSDP (ZeRO-{zero_stage}) does not reduce: plan ZeRO-0/1 or a schedule "
                "with a whole backward")
    if compiled:
        return (f"{name} splits backward into input- and weight-gradient parts, but a "
                "compiled region's backward (TrainSpec(compile=True)) is one autograd "
                "node: train without compile, or with a schedule that has a whole backward")
    return None
