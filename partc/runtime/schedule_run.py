"""The planned pipeline schedule over one global batch, on this rank.

Stage 0's ranks read the inputs and the last stage's ranks the target, each
data-parallel replica its own rows (:class:`partc.runtime.batch_check.BatchCheck`); the
schedule (``torch.distributed.pipelining``, :mod:`.pipeline_schedule`) runs every
microbatch's forward and backward, or forward only for an evaluation; the last stage
collects each microbatch's loss, and the mean over the global batch is all-reduced so
that every rank returns it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from partc.runtime import cp_layout
from partc.runtime.batch_check import BatchCheck
from partc.runtime.label_weights import (IGNORED, CountWeights, count_scale, label_counts,
                                         sample_weights, uneven_ignored)
from partc.runtime.rank_parts import RankParts
from partc.runtime.value_checks import ValueCheckError

log = logging.getLogger("partc")

# Newer torch schedules can drop the last stage's outputs instead of returning them.
_STEP_TAKES_RETURN_OUTPUTS = "return_outputs" in inspect.signature(
    PipelineScheduleSingle.step).parameters


class ScheduleRun:
    """Runs this rank's stages under the planned schedule, a global batch at a time."""

    def __init__(self, parts: RankParts, batches: BatchCheck) -> None:
        self._parts = parts
        self._batches = batches
        self._warned = False   # that loss_fn's target counts unevenly (said once)

    def arguments(self, inputs: tuple, named: Mapping[str, Any], target: Any,
                  losses: list[torch.Tensor]) -> tuple[tuple, dict[str, Any]]:
        """The schedule's arguments on this rank: its dp replica's rows of the inputs
        (given by position and by name; first stage) and of the target (last stage; for
        the model's own loss, the samples' weights made from its labels), after checking
        the batch; the last stage appends each microbatch's loss to ``losses``."""
        batches = self._batches
        inputs = batches.ordered(inputs, named, target)
        rows = batches.rows(inputs, target)
        if batches.own_loss:
            target = self._label_weights(inputs, rows)  # the rows given, as the inputs
        elif self._parts.plan.model.counted_target:
            scale = self._count_scale(target, rows)   # every rank: collective over dp
        elif self._parts.plan.model.counted_target is None and not self._warned:
            self._say_uneven_ignored(target, rows)
        device = self._parts.topology.device
        stages = self._parts.stages
        args = tuple(self._mine(t, rows) for t in inputs) \
            if any(s.is_first for s in stages) else ()
        kwargs: dict[str, Any] = {}
        if any(s.is_last for s in stages):
            kwargs = {"target": pytree.tree_map_only(
                torch.Tensor, lambda t: self._mine(t, rows), target), "losses": losses}
            if self._parts.plan.model.counted_target:
                self._parts.loss.weights = self._counted_weights(target, rows,
                                                                 kwargs["target"], scale)
        if _STEP_TAKES_RETURN_OUTPUTS:
            # The outputs are the loss's inputs (the logits): returned, torch keeps every
            # microbatch's until the step ends; partc only needs the losses.
            kwargs["return_outputs"] = False
        return args, kwargs

    def _mine(self, tensor: torch.Tensor, rows: slice) -> torch.Tensor:
        """This rank's part of a batch tensor: its replica's rows and, with context
        parallelism, its tokens of each (dim 1, the load-balanced layout of
        :mod:`.cp_layout`), on its device."""
        topo = self._parts.topology
        tensor = tensor[rows]
        if topo.cp > 1 and tensor.dim() >= 2:
            tensor = cp_layout.shard(tensor, 1, topo.cp, topo.cp_rank)
        return tensor.to(topo.device)

    def _say_uneven_ignored(self, target: Any, rows: slice) -> None:
        """Warn once, on rank 0, where loss_fn's ``target`` (the rows given) counts its
        -100s unevenly over the parts loss_fn is taken on (:func:`uneven_ignored`)."""
        topo, plan = self._parts.topology, self._parts.plan
        if topo.rank != 0 or plan.num_microbatches * topo.dp * topo.cp == 1:
            return
        why = uneven_ignored(target, microbatches=plan.num_microbatches,
                             replicas=self._replicas(rows), cp=topo.cp)
        if why:
            self._warned = True
            log.warning(why)

    def _count_scale(self, target: torch.Tensor, rows: slice) -> float:
        """A loss_fn's mean over its target's entries not -100: what each microbatch's
        count of them is multiplied by (:func:`count_scale`; collective over dp when
        only this replica's rows are given)."""
        counts, shards, replicas = self._counted(target, "tokens", rows)
        return count_scale(counts, microbatches=self._parts.plan.num_microbatches,
                           dp=self._parts.topology.dp, replicas=replicas,
                           device=self._parts.topology.device,
                           dp_group=self._dp_group(replicas), shards=shards)

    def _counted_weights(self, target: torch.Tensor, rows: slice, mine: torch.Tensor,
                         scale: float) -> CountWeights:
        """The :class:`CountWeights` of this rank's ``mine`` (its part of ``target``, as
        the schedule cuts it into microbatches)."""
        topo, microbatches = self._parts.topology, self._parts.plan.num_microbatches
        host = target[rows].cpu()
        if topo.cp > 1 and host.dim() >= 2:
            host = cp_layout.shard(host, 1, topo.cp, topo.cp_rank)
        return CountWeights(scale=scale, by_offset={
            chunk.storage_offset(): float((part != IGNORED).sum()) * scale
            for part, chunk in zip(torch.tensor_split(host, microbatches),
                                   torch.tensor_split(mine, microbatches))})

    def _label_weights(self, inputs: tuple, rows: slice) -> torch.Tensor:
        """The model's own loss: each sample's weight, of the batch given (the global
        batch, or this replica's rows: collective over dp)."""
        counts, shards, replicas = self._counted(self._batches.labels(inputs),
                                                 self._batches.own_loss, rows)
        topo = self._parts.topology
        return sample_weights(counts, microbatches=self._parts.plan.num_microbatches,
                              dp=topo.dp, replicas=replicas, device=topo.device,
                              dp_group=self._dp_group(replicas), shards=shards,
                              cp_rank=topo.cp_rank)

    def _counted(self, labels: torch.Tensor, counted: str, rows: slice
                 ) -> tuple[torch.Tensor, list[torch.Tensor], int]:
        """Per sample of the batch given, the labels ``counted`` (:func:`label_counts`);
        under context parallelism, per cp rank the counts of its tokens of each (every
        rank counts all, to refuse alike), a rank's loss being the mean over its own;
        and how many replicas' rows the batch holds (:meth:`_replicas`)."""
        topo = self._parts.topology
        labels = labels.cpu()
        shards = [label_counts(cp_layout.shard(labels, 1, topo.cp, rank), counted)
                  for rank in range(topo.cp)] if topo.cp > 1 and labels.dim() >= 2 else []
        return label_counts(labels, counted), shards, self._replicas(rows)

    def _replicas(self, rows: slice) -> int:
        """How many replicas' rows the batch given holds: all when it is the global batch
        (``rows`` then this replica's slice of it), or when there is one replica."""
        dp = self._parts.topology.dp
        return dp if rows != slice(None) or dp == 1 else 1

    def _dp_group(self, replicas: int):
        """The group a batch of ``replicas`` replicas' rows totals its count over."""
        topo = self._parts.topology
        return topo.dp_group if replicas < topo.dp else None

    def train(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, int]:
        """Every microbatch's forward and backward; returns the point-to-point messages
        this rank's stages posted (``sends``, ``recvs``)."""
        parts = self._parts
        for stage in parts.stages:
            stage.messages.clear()
        copies = parts.copies
        with copies.step() if copies is not None else contextlib.nullcontext(), \
                model_errors():
            parts.schedule.step(*args, **kwargs)
            if parts.buckets is not None:
                # Reduce what the last backward left (split backwards' weight gradients,
                # weights two virtual stages share) while the compute copies still hold
                # their gradients; the mean over dp and the microbatches.
                parts.buckets.finish(parts.plan.num_microbatches)
        return {kind: sum(s.messages[kind] for s in parts.stages)
                for kind in ("sends", "recvs")}

    def evaluate(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Every microbatch's forward, without gradients and in eval mode (dropout off,
        normalisation statistics read, not updated)."""
        module = self._parts.module
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), model_errors():
                self._parts.schedule.eval(*args, **kwargs)
        finally:
            module.train(was_training)

    def mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The global batch's mean loss from the last stage's microbatch losses, on
        every rank (collective)."""
        topo = self._parts.topology
        total = torch.zeros((), device=topo.device)
        if losses:
            total = torch.stack(losses).sum().detach().to(torch.float32)
        dist.all_reduce(total)  # only the last stage's ranks contribute, tp copies alike
        return total / (self._parts.plan.num_microbatches * topo.dp * topo.cp * topo.tp)


@contextlib.contextmanager
def model_errors():
    """Within: a :class:`~partc.runtime.value_checks.ValueCheckError` the model's code
    raised in a stage is raised as itself, not as the pipelining stage's "failed to run
    forward" that torch wraps it in (kept as its cause)."""
    try:
        yield
    except Exception as error:
        cause, seen = error.__cause__ or error.__context__, {id(error)}
        while cause is not None and not isinstance(cause, ValueCheckError) \
                and id(cause) not in seen:
            seen.add(id(cause))
            cause = cause.__cause__ or cause.__context__
        if not isinstance(cause, ValueCheckError):
            raise
        raise cause from error
