"""The outer decisions the planner enumerates, as the cost tables read them:
:class:`PipelineConfig` (pp, dp, tp, microbatches and their size, schedule, ZeRO stage,
chunks, ep) and what follows from it: the rank of each run, the microbatches each rank
holds at its schedule's peaks, the closed form's fill-and-drain divisor, a stage's ranks
(:func:`stage_ranks`). And what every table shares: its units, picoseconds (:func:`to_ps`)
and thousandths (:func:`permille`), and the rule for a collective beside compute
(:func:`overlapped`). :func:`grad_config` is the configuration a stage's parameters see
under context parallelism."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Sequence

from partc.cost.schedules import (SCHEDULE_TABLE, crossing_runs, rank_of,
                                  schedule as schedule_info, stages_of_rank)
from partc.cost.timeline import held_per_run
from partc.device.usable import communicators, usable_memory
from partc.problem import PlanningProblem, effective_zero_stage, reduces_once_per_step


PS_PER_S = 10**12


def to_ps(seconds: float) -> int:
    return int(round(seconds * PS_PER_S))


def overlapped(compute_s: float, comm_s: float, overlap: float) -> float:
    """Compute and a collective running beside it: the share ``overlap``
    (:attr:`DeviceNumbers.comm_overlap`) of the shorter one hides behind the longer:
    ``max`` of the two at 1, their sum at 0."""
    return compute_s + exposed_seconds(comm_s, compute_s, overlap)


def exposed_seconds(comm_s: float, compute_s: float, overlap: float) -> float:
    """What a collective of ``comm_s`` adds to compute of ``compute_s`` running beside
    it: all but the share ``overlap`` of the shorter of the two (the rule of
    :func:`overlapped` and, in picoseconds, :func:`partc.cost.evaluate.exposed_sync_ps`)."""
    return comm_s - overlap * min(compute_s, comm_s)


def split_factor(problem: PlanningProblem, config: "PipelineConfig") -> float:
    """What a layer's backward compute costs under ``config``'s schedule over one pass:
    :attr:`DeviceNumbers.split_backward_factor` where the schedule runs it as an input-
    then a weight-gradient pass (the zero-bubble schedules), else 1."""
    if schedule_info(config.schedule).split_backward:
        return problem.devices.split_backward_factor
    return 1.0


def permille(share: float) -> int:
    """A share in [0, 1] in thousandths: the integer the CP-SAT model and the
    evaluation both weigh an overlap by."""
    return int(round(1000 * share))


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """The outer decisions, enumerated by the planner around each CP-SAT solve."""

    pp: int
    dp: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    tp: int = 1
    sequence_parallel: bool = False
    tp_objective: str = "time"
    zero_stage: int = 0  # 1: optimizer state sharded over dp, 2: gradients too, 3: weights too
    chunks: int = 1      # interleaved-1f1b: model chunks (virtual stages) per pipeline rank
    ep: int = 1          # expert-parallel degree of mixture-of-experts layers (moe_layer_table)
    # ZeRO-2: reduce-scatter gradients after every microbatch, or once per "step"
    # (partc.problem.ZERO2_GRAD_SYNCS)
    zero2_grad_sync: str = "microbatch"
    # Context parallelism: each sequence split over ``cp`` ranks (between dp and tp in
    # rank order, partc.rank_grid), their attention run as ``cp_kind`` (partc.names.CpKind;
    # None when cp = 1). Priced by partc.cost.cp_attention.
    cp: int = 1
    cp_kind: str | None = None

    @property
    def tokens_share(self) -> float:
        """The share of each sequence a rank holds: its per-token work and activations
        are the whole microbatch's times this (1 / cp)."""
        return 1.0 / self.cp

    @property
    def grad_dp(self) -> int:
        """Ranks that hold the same parameters in a stage and reduce their gradients
        (and shard ZeRO state) together: dp x cp."""
        return self.dp * self.cp
    # Offload (partc.cost.host_offload): the optimizer's state, masters and step on the
    # host; under ZeRO-3 the parameter shards too (which implies the first).
    offload_optimizer: bool = False
    offload_params: bool = False

    @property
    def effective_zero_stage(self) -> int:
        """The ZeRO stage that runs (0 with one replica): :func:`effective_zero_stage`."""
        return effective_zero_stage(self.zero_stage, self.grad_dp)

    @property
    def reduces_once(self) -> bool:
        """ZeRO-2 reduce-scatters the step's accumulated gradients once
        (:func:`partc.problem.reduces_once_per_step`)."""
        return reduces_once_per_step(self.zero_stage, self.grad_dp, self.zero2_grad_sync,
                                     self.num_microbatches)

    @property
    def virtual_stages(self) -> int:
        """Contiguous runs of layers: ``pp`` ranks of ``chunks`` each; run ``j`` is on the
        rank :meth:`rank_of` says (the schedule's placement, :mod:`partc.cost.schedules`)."""
        return self.pp * self.chunks

    def rank_of(self, run: int) -> int:
        """The rank of run (virtual stage) ``run``: ``run % pp`` for the looped
        schedules, the "V" for ZBV and DualPipeV."""
        if self.chunks == 1:
            return run
        return rank_of(self.schedule, self.pp, self.chunks, run)

    def runs_of(self, stage: int) -> tuple[int, ...]:
        """The runs rank ``stage`` holds, in model order."""
        if self.chunks == 1:
            return (stage,)
        return stages_of_rank(self.schedule, self.pp, self.chunks, stage)

    def crossings(self) -> tuple[int, ...]:
        """The runs whose cut to the next run crosses to another rank (:meth:`rank_of`)."""
        return crossing_runs(self.schedule, self.pp, self.chunks)

    @property
    def fill_divisor(self) -> int:
        """What the closed form :func:`partc.cost.evaluate.pipeline_ps` divides the
        fill-and-drain by: the chunks (Megatron's ``(p - 1) / v``), and 3 more under a
        split backward (the zero-bubble schedules' fill of ``(p - 1)(F + I - W)`` against
        1F1B's ``(p - 1)(F + B)``, with backward twice forward and its weight gradient half
        of it). The simulation (:func:`partc.cost.evaluate.simulated_step_ps`) is what the
        plan reports."""
        split = self.schedule in SCHEDULE_TABLE and SCHEDULE_TABLE[self.schedule].split_backward
        return self.chunks * (3 if split else 1)

    def inflight(self, stage: int) -> int:
        """(Microbatch, run) activations rank ``stage`` holds at its peak, all runs
        together (:meth:`held`)."""
        return max(sum(peak) for peak in self.held(stage))

    def held(self, stage: int) -> tuple[tuple[int, ...], ...]:
        """Microbatches rank ``stage`` holds activations of, per run (:meth:`runs_of`'s
        order), at each of its schedule's peaks (:func:`partc.cost.timeline.held_per_run`):
        the runs of an interleaved rank are held unequally (the first run's warm-up
        forwards run before the later runs'). GPipe and looped BFS hold every one, 1F1B
        ``min(m, p - s)``."""
        m = self.num_microbatches
        if self.schedule in ("gpipe", "looped-bfs"):
            return ((m,) * self.chunks,)
        if self.chunks == 1 and self.schedule not in _SPLIT:
            return ((min(m, self.pp - stage),),)
        return held_per_run(self.schedule, self.pp, self.chunks, min(m, 4 * self.pp))[stage]

    def held_at_least(self, stage: int) -> int:
        """A count of microbatches rank ``stage`` holds of every run at once (at one
        of :meth:`held`'s peaks): its activations are at least that many times all its
        runs' saved bytes, whatever their split, a bound for relaxations."""
        return self.least_held()[stage]

    def least_held(self) -> tuple[int, ...]:
        """:meth:`held_at_least` of every rank, in rank order (:func:`least_held`)."""
        return least_held(self.schedule, self.pp, self.chunks, self.num_microbatches)

    def activations(self, stage: int, saved: Sequence[int]) -> int:
        """Bytes of saved activations on rank ``stage`` whose runs (:meth:`runs_of`'s
        order) save ``saved[i]`` bytes per microbatch: the largest of :meth:`held`'s
        peaks."""
        return max(sum(h * a for h, a in zip(peak, saved, strict=True))
                   for peak in self.held(stage))


@lru_cache(maxsize=4096)
def least_held(schedule: str, pp: int, chunks: int, m: int) -> tuple[int, ...]:
    """Per rank, the microbatches it holds of every run at once at one of its peaks
    (:meth:`PipelineConfig.held_at_least`): a pure function of the schedule's shape,
    asked for by the bounds of every configuration the search weighs (thousands share
    one)."""
    config = PipelineConfig(pp=pp, dp=1, micro_batch_size=1, num_microbatches=m,
                            schedule=schedule, chunks=chunks)
    return tuple(max(min(h) for h in config.held(stage)) for stage in range(pp))


def grad_config(config: PipelineConfig) -> PipelineConfig:
    """The configuration the parameters see: their gradients are reduced, and their ZeRO
    state sharded, over the dp x cp ranks that hold them (Megatron-Core's data-parallel
    group with context parallelism), as over ``dp x cp`` replicas; ``config`` itself
    without context parallelism."""
    if config.cp == 1:
        return config
    return replace(config, dp=config.grad_dp, cp=1, cp_kind=None)


_SPLIT = ("interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev")


def stage_ranks(problem: PlanningProblem, config: PipelineConfig, stage: int) -> range:
    return ranks_of_stage(problem.devices.num_devices, config.pp, stage)


def ranks_of_stage(num_devices: int, pp: int, stage: int) -> range:
    """The ranks (the budget's devices) holding pipeline stage ``stage`` of ``pp``: ranks
    are ordered (pp, dp, tp), so each stage's are one contiguous block."""
    width = num_devices // pp
    return range(stage * width, (stage + 1) * width)


def stage_limits(problem: PlanningProblem, config: PipelineConfig) -> tuple[int, ...]:
    """Each stage's memory limit: the least that a device of its ranks leaves the plan
    beside the CUDA context, the NCCL communicators of ``config``'s mesh and the
    allocator's fragmentation (:func:`partc.device.usable.usable_memory`, the one
    place the limit is computed)."""
    devices = problem.devices
    groups = communicators(devices.num_devices, config.pp, config.dp, config.tp, config.ep)
    return tuple(min(usable_memory(devices.memory_bytes[r], devices, groups)
                     for r in stage_ranks(problem, config, s)) for s in range(config.pp))
