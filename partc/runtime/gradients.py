"""This rank's gradients after the schedule: what is summed across ranks, their norm,
and clipping.

Over dp the gradients are averaged already, during the step's last backward: by the
buckets' all-reduce or reduce-scatter (ZeRO 0/1, ``partc/runtime/optimizer.py``) or
FSDP's (ZeRO-2/3). :meth:`GradientSync.sync` does what is left after the schedule:

1. a weight two of this rank's virtual stages share is divided by the microbatches once
   (the buckets do it otherwise, in ``finish``);
2. replicated parameters that feed only sharded ops hold a partial gradient on each
   tensor-parallel rank: summed over the tp group (one flat all-reduce per step);
3. tied weights that stages of several ranks hold are summed over those ranks.

Under ZeRO-1/2/3 each rank holds its dp shard of every gradient: the sums run on those
shards, which the ranks they span cut alike.

The gradient norm counts each parameter once, as ``torch.nn.utils.clip_grad_norm_`` on
one device: a tensor-parallel shard on every rank of its group, a replicated tensor on
one of them, a tied weight on the first stage holding it, one data-parallel replica, and
a routed expert once over the ranks holding it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from partc.runtime.parameters import local_part
from partc.runtime.rank_parts import RankParts
from partc.runtime.rank_state import RankState


class GradientSync:
    """This rank's gradients: synced after the schedule, measured, clipped, zeroed."""

    def __init__(self, parts: RankParts, state: RankState) -> None:
        self._parts = parts
        self._state = state  # placements: which tensors are tensor-parallel shards

    def grad_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """This rank's gradient of ``param``: its ``.grad`` (FSDP's local shard under
        ZeRO-2/3), or under ZeRO-1 the reduced gradient of its dp shard in the buckets."""
        buckets = self._parts.buckets
        if buckets is not None and buckets.holds_grads:
            return buckets.grad_of(param)
        return None if param.grad is None else local_part(param.grad)

    def sync(self) -> None:
        """Steps 1-3 of the module's doc, after the schedule (collective)."""
        parts = self._parts
        if parts.buckets is None:
            for param in parts.shared:
                if param.grad is not None:
                    param.grad.div_(parts.plan.num_microbatches)
        self._sum_partial()
        for params, group in parts.tied:
            for param in params:
                if parts.buckets is not None and parts.buckets.holds_grads:
                    dist.all_reduce(parts.buckets.grad_of(param), group=group)
                    continue
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                dist.all_reduce(local_part(grad), group=group)
                param.grad = grad

    def _sum_partial(self) -> None:
        partial = [g for p in self._parts.partial_grads if (g := self.grad_of(p)) is not None]
        if not partial:
            return
        flat = self._parts.tp.all_reduce(torch.cat([g.reshape(-1) for g in partial]))
        offset = 0
        for grad in partial:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The whole model's gradient norm, each parameter counted once (the module's
        doc); the same on every rank. Collective."""
        if norm_type == float("inf"):
            grads = self._counted() + self._expert_grads()
            local = max((g.detach().abs().max() for g in grads),
                        default=torch.zeros((), device=self._parts.topology.device)
                        ).to(torch.float32)
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
            return local
        total = self.local_power(norm_type)
        dist.all_reduce(total)  # dp replicas add the same sum; dp shards, parts of it
        return self.norm_of(total, norm_type)

    def local_power(self, norm_type: float = 2.0) -> torch.Tensor:
        """This rank's part of the norm's ``norm_type``-th power (fp32, 0-dim): summed
        over every rank, :meth:`norm_of` makes it the norm. inf or NaN in any gradient
        counted makes it non-finite. Local: no collective."""
        topo = self._parts.topology
        zero = torch.zeros((), device=topo.device)
        local = sum((_power(g, norm_type) for g in self._counted()), zero)
        # Each expert once overall: a shard on each rank of its expert-data-parallel
        # group under ZeRO; else whole on each, dp x tp / ep times, divided by dp in
        # norm_of.
        weight = 1.0 if self._parts.sharded_grads else topo.ep / topo.tp
        return local + weight * sum((_power(g, norm_type) for g in self._expert_grads()),
                                    zero)

    def norm_of(self, total: torch.Tensor, norm_type: float = 2.0) -> torch.Tensor:
        """The norm from every rank's :meth:`local_power` summed."""
        # Reduced gradients are alike on every dp x cp rank (or each holds a shard).
        dp = 1 if self._parts.sharded_grads else self._parts.topology.grad_replicas
        return (total / dp) ** (1.0 / norm_type)

    def _counted(self) -> list[torch.Tensor]:
        parts, buckets = self._parts, self._parts.buckets
        return [g for name, p in parts.module.named_parameters()
                if not self._state.is_expert(p) and (g := self.grad_of(p)) is not None
                and self._counts_norm(name)
                and (buckets is None or buckets.counted_once(p))]

    def _expert_grads(self) -> list[torch.Tensor]:
        # This rank's routed experts: held by dp x tp / ep ranks of the stage, any tp
        # rank (under ZeRO each of them a shard).
        return [g for p in self._parts.expert_params if (g := self.grad_of(p)) is not None]

    def nonfinite_parameters(self) -> list[str]:
        """The FQNs of this rank's parameters whose gradient holds inf or NaN (what a
        non-finite step names; one pass over the gradients)."""
        return [name for name, p in self._parts.module.named_parameters()
                if (g := self.grad_of(p)) is not None
                and not bool(torch.isfinite(g.detach()).all())]

    def _counts_norm(self, name: str) -> bool:
        if name in self._parts.tied_elsewhere:
            return False
        return self._parts.topology.tp_rank == 0 or self._state.placement(name).kind == "S"

    def clip(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every rank's gradients so that the whole model's norm is at most
        ``max_norm``; returns that norm (the same on every rank). Collective."""
        total = self.norm(norm_type)
        self.scale_to(max_norm, total)
        return total

    def scale_to(self, max_norm: float, total: torch.Tensor) -> None:
        """Scale every rank's gradients by ``max_norm / total`` where that is below 1
        (``total``: the whole model's norm, the same on every rank). Local."""
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in {id(p): p for p in self._parts.module.parameters()}.values():
            grad = self.grad_of(p)
            if grad is not None:
                grad.mul_(coef.to(grad.dtype))

    def zero(self, set_to_none: bool = True) -> None:
        self._parts.module.zero_grad(set_to_none=set_to_none)
        if self._parts.buckets is not None:
            self._parts.buckets.zero_()


def _power(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    return grad.detach().to(torch.float32).norm(norm_type) ** norm_type
