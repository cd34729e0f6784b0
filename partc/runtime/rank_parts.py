"""What one rank's program is made of: the typed, frozen result of building it.

:func:`partc.runtime.rank_build.build` makes one :class:`RankParts` per rank and hands it
to :class:`partc.runtime.module.DistributedModule`, whose concerns each read what they
need from it: the state (:mod:`.rank_state`), the gradients (:mod:`.gradients`), the
batch checks (:mod:`.batch_check`), the schedule's run (:mod:`.schedule_run`) and the
step's monitoring (:mod:`.step_monitor`). Nothing sets a field of it after ``build``.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from partc.plan import Plan
from partc.runtime.offload import HostTier
from partc.runtime.optimizer import GradBuckets
from partc.runtime.pipeline_stage import CountingStage
from partc.runtime.precision import ComputeCopies
from partc.runtime.topology import Topology
from partc.runtime.tp import TensorParallelGroup
from partc.runtime.watchdog import Watchdog


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankParts:
    """This rank's stages, with the parameters, groups and tables the step reads.

    ``module`` is the rank's stages as one module: the stage's own GraphModule, or with
    several virtual stages a :class:`partc.runtime.pipeline_schedule.RankStages` of
    them; its parameter names are the model's FQNs. ``stages`` are the same stages
    wrapped for ``torch.distributed.pipelining``, which ``schedule`` runs.
    """

    plan: Plan
    topology: Topology
    module: nn.Module
    stages: tuple[CountingStage, ...]
    schedule: Any
    # The tensor-parallel group the stages' collectives run over; its ``counts`` are the
    # collectives this rank has run.
    tp: TensorParallelGroup
    # ZeRO 0/1 (dp > 1, or mixed precision): the rank's gradients in fp32 buckets
    # (partc/runtime/optimizer.py), one set over all its virtual stages.
    buckets: GradBuckets | None
    # Mixed precision under ZeRO 0/1: compute-dtype parameters made once per step.
    copies: ComputeCopies | None
    # Tied weights held by stages of several ranks, each with the group summing them.
    tied: tuple[tuple[tuple[nn.Parameter, ...], dist.ProcessGroup], ...]
    # Replicated parameters feeding only sharded ops: a partial gradient on each tp rank.
    partial_grads: tuple[nn.Parameter, ...]
    # Weights two of this rank's virtual stages hold: their stages leave them unscaled.
    shared: tuple[nn.Parameter, ...]
    # This rank's slices of routed expert weights (expert parallelism; else none).
    expert_params: tuple[nn.Parameter, ...]
    # Each parameter's name in the stage → all of its FQNs in the model (tied weights).
    aliases: Mapping[str, tuple[str, ...]]
    # model.state_dict()'s keys: no non-persistent buffers.
    state_keys: frozenset[str]
    # Tied weights whose first holder is an earlier rank's stage: counted there in norms.
    tied_elsewhere: frozenset[str]
    # The whole model's state_dict() entries (shape, dtype): what a checkpoint holds.
    model_tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    # This rank's watchdog (partc/runtime/watchdog.py); None with one process.
    watchdog: Watchdog | None
    # Host RSS before build copied parameters: telemetry's memory zero.
    memory_baseline: int
    # Optimizer offload: the host beside the device and its counters
    # (partc/runtime/offload.py); None without offload.
    host: HostTier | None = None
    # The parameters the forward never reads (partc.runtime.parameters.unread_tensors),
    # by FQN, untrained host copies on the first pipeline stage's ranks (none elsewhere):
    # state dicts and checkpoints hold them.
    unread: Mapping[str, torch.Tensor] = dataclasses.field(
        default_factory=lambda: MappingProxyType({}))
    # The loss the schedule calls on the last stage's outputs (rank_build.PlannedLoss):
    # the step sets its weighing of a counted target (``plan.model.counted_target``).
    loss: Any = None

    @property
    def virtual_stages(self) -> tuple[int, ...]:
        """The virtual stages (runs of layers, ``plan.runs``) this rank holds: one, or
        ``plan.chunks``."""
        return tuple(stage.stage_index for stage in self.stages)

    @property
    def sharded_grads(self) -> bool:
        """ZeRO-1/2/3: each rank keeps (reduced) gradients of its dp shard of every
        parameter only: FSDP's under ZeRO-2/3, the buckets' under ZeRO-1."""
        return any(isinstance(stage.submod, FSDPModule) for stage in self.stages) or (
            self.buckets is not None and self.buckets.sharded)
