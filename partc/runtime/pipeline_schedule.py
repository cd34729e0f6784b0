"""A rank's virtual stages and the pipeline schedule over them.

A plan cuts the model into ``pp * v`` virtual stages (``plan.runs``); the schedule
(``partc.cost.schedules``) places ``v`` of them on each pipeline rank, looped or "V". Here:
whether the runtime can run a plan's schedule with parity to one process
(:func:`runtime_refusal`), the rank's stages as one module (:class:`RankStages`), a tied
weight two of them hold made one parameter (:func:`share_local_ties`), ties across ranks
summed over process groups (:func:`tied_groups`), and torch's schedule class over the
rank's stages (:func:`make_schedule`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining import schedules as torch_schedules

from partc.cost.schedules import feature_refusal, rank_of, refusal
from partc.cost.schedules import schedule as schedule_facts
from partc.errors import PartcError
from partc.names import Schedule
from partc.plan import Plan
from partc.runtime.pipeline_stage import CountingStage
from partc.runtime.topology import Topology, group_of


def runtime_refusal(plan: Plan) -> str | None:
    """Why the runtime cannot train ``plan`` with parity to one process; None if it can.

    torch's schedule refuses the stage or microbatch count (``partc.cost.schedules.refusal``);
    a split backward does not run under FSDP or compile
    (``partc.cost.schedules.feature_refusal``). (Recompute runs under a split backward: each
    pass, input and weight gradients, reruns a recomputed layer's forward.)"""
    why = refusal(plan.schedule, plan.pp, plan.chunks, plan.num_microbatches)
    if why is not None:
        return why
    return feature_refusal(plan.schedule, plan.effective_zero_stage, plan.train.compile)


class RankStages(nn.Module):
    """A rank's virtual stages as one module: their parameters and buffers under the
    model's own FQNs (a weight two of them share, listed once), ``train``/``eval`` and
    ``modules`` over all of them. Each stage stays its own module for the schedule."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(modules)

    def _named(self, kind: str, prefix: str, recurse: bool, remove_duplicate: bool
               ) -> Iterator[tuple[str, Any]]:
        seen: set[int] = set()
        for module in self.stages:
            for name, tensor in getattr(module, kind)(
                    prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate):
                if remove_duplicate and id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                yield name, tensor

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self._named("named_parameters", prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self._named("named_buffers", prefix, recurse, remove_duplicate)

    def forward(self, *args: Any) -> Any:
        raise PartcError("a rank's virtual stages run through the pipeline schedule "
                         "(DistributedModule.forward_backward), not as one module")


def share_local_ties(modules: Sequence[nn.Module], aliases: Mapping[str, tuple[str, ...]]
                      ) -> dict[str, int]:
    """Make a parameter that several of this rank's stages hold (under any of its FQNs:
    a tied embedding and head) one object, the first stage's; returns the FQNs of such
    parameters → ``id`` of that object."""
    first: dict[tuple[str, ...], nn.Parameter] = {}
    shared: dict[str, int] = {}
    for module in modules:
        for name, param in list(module.named_parameters(remove_duplicate=False)):
            kept = first.setdefault(aliases.get(name, (name,)), param)
            if kept is not param:
                owner_name, _, attr = name.rpartition(".")
                module.get_submodule(owner_name)._parameters[attr] = kept
                shared[name] = id(kept)
    return shared


def make_schedule(plan: Plan, stages: list[CountingStage], loss: Callable) -> Any:
    """The planned schedule over this rank's stages: torch's class that
    ``partc.cost.schedules`` names for it (single-stage GPipe or 1F1B with one stage per
    rank; the multi-stage classes, which place stages as ``rank_of`` does, otherwise)."""
    facts = schedule_facts(plan.schedule)
    if facts.virtual_stages == (1,):
        schedule_type = ScheduleGPipe
        if plan.schedule == Schedule.ONE_F_ONE_B and plan.num_microbatches >= plan.pp:
            schedule_type = Schedule1F1B  # with fewer microbatches than stages, 1F1B is GPipe
        return schedule_type(stages[0], plan.num_microbatches, loss_fn=loss,
                             scale_grads=True)
    schedule_type = getattr(torch_schedules, facts.torch_class)
    result = schedule_type(stages, plan.num_microbatches, loss_fn=loss, scale_grads=True)
    placed = {j: rank_of(plan.schedule, plan.pp, plan.chunks, j)
              for j in range(plan.pp * plan.chunks)}
    if dict(result.stage_index_to_group_rank) != placed:
        raise PartcError(f"torch's {facts.torch_class} places virtual stages as "
                         f"{dict(result.stage_index_to_group_rank)}, the plan as {placed}")
    return result


def tied_elsewhere(holders: Mapping[tuple[str, ...], tuple[int, ...]], module: nn.Module,
                    plan: Plan, pp_rank: int) -> set[str]:
    """This rank's parameter names whose first holder is a virtual stage of another rank
    (tied weights): that rank counts them in gradient norms."""
    first = {name: indices[0] for key, indices in holders.items() for name in key}
    return {name for name, _ in module.named_parameters()
            if name in first and _rank(plan, first[name]) != pp_rank}


def _rank(plan: Plan, virtual_stage: int) -> int:
    return rank_of(plan.schedule, plan.pp, plan.chunks, virtual_stage)


def tied_groups(holders: Mapping[tuple[str, ...], tuple[int, ...]], module: nn.Module,
                 topology: Topology, plan: Plan
                 ) -> list[tuple[list[nn.Parameter], dist.ProcessGroup]]:
    """Process groups over the pipeline ranks whose virtual stages hold the same (tied)
    parameter; a tie within one rank is one parameter already (``share_local_ties``).

    Every rank creates every group, in the same order, as ``new_group`` requires; a rank
    keeps the groups it is in.
    """
    own = dict(module.named_parameters(remove_duplicate=False))
    result = []
    for key, stage_indices in holders.items():
        pp_ranks = sorted({_rank(plan, j) for j in stage_indices})
        if len(pp_ranks) < 2:
            continue
        for dp_rank in range(topology.dp):
            for cp_rank in range(topology.cp):
                for tp_rank in range(topology.tp):
                    ranks = [topology.rank_of(s, dp_rank, tp_rank, cp_rank) for s in pp_ranks]
                    group = group_of(ranks)
                    if topology.rank in ranks:
                        params = [own[name] for name in key if name in own]
                        result.append((params[:1], group))
    return result
