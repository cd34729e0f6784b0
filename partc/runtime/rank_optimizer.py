"""The optimizer over this rank's parameters, holding its state as the plan does.

With ZeRO-1 (``plan.effective_zero_stage == 1``) each data-parallel rank keeps the state
of its dp shard (rows ``chunk(dp)[rank]`` of each parameter), steps it with the
reduce-scattered gradients and all-gathers the updated shards, bucket by bucket
(:class:`partc.runtime.optimizer.DistributedOptimizer`); otherwise it is the user's
optimizer class over the rank's parameters.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import nn

from partc.runtime.optimizer import DistributedOptimizer
from partc.runtime.rank_parts import RankParts
from partc.runtime.rank_state import RankState

log = logging.getLogger("partc.runtime")


def make_optimizer(parts: RankParts, state: RankState,
                   optimizer_class: type[torch.optim.Optimizer], defaults: Mapping[str, Any]
                   ) -> torch.optim.Optimizer:
    """``optimizer_class(parameters, **defaults)`` as the plan holds its state.

    A stage may hold no parameters (the planner may put the loss alone on the last
    stage when that is fastest). torch optimizers refuse an empty parameter list, so
    such a rank gets ``optimizer_class`` over one empty placeholder parameter that never
    has a gradient: ``step`` and ``zero_grad`` do nothing, and learning-rate schedulers,
    ``state_dict`` and the README's loop work unchanged on every rank."""
    check_step_temporaries(parts, state, defaults)
    buckets, copies = parts.buckets, parts.copies
    if not any(True for _ in state.parameters()):
        placeholder = nn.Parameter(torch.empty(0, device=parts.topology.device))
        return optimizer_class([placeholder], **defaults)
    if buckets is not None and buckets.sharded:
        return DistributedOptimizer(
            buckets, optimizer_class,
            compute_dtype=copies.dtype if copies is not None else None, **defaults)
    return optimizer_class(state.parameters(), **defaults)


def check_step_temporaries(parts: RankParts, state: RankState,
                           defaults: Mapping[str, Any]) -> None:
    """Warn where ``foreach=True`` makes the optimizer step's fp32 temporaries for all
    of the rank's weights at once although the plan priced torch's default for them,
    one tensor at a time (CPU weights; :func:`partc.cost.state_bytes.step_bytes`): the step then
    needs more than the plan's peak says. ``fused=True`` and ``foreach=False`` need
    less, and ZeRO-1's sharded step was priced whole."""
    plan, topo = parts.plan, parts.topology
    stage = plan.stages[topo.pp_rank]
    precision = plan.train.precision
    if not defaults.get("foreach") or not precision.step_copies \
            or topo.device.type != "cpu" \
            or (parts.buckets is not None and parts.buckets.sharded):
        return
    weights = sum(p.numel() for p in state.parameters())
    whole = int(precision.step_copies * precision.master_bytes * weights)
    priced = stage.memory_bytes.step
    if whole > priced:
        log.warning("rank %d: optimizer foreach=True steps all %s weights at once: its "
                    "temporaries take %.1f MiB where the plan priced %.1f MiB (torch's "
                    "default for CPU weights, one tensor at a time); the stage's peak "
                    "may exceed its planned %.1f MiB. Leave foreach to torch, or plan "
                    "with more memory headroom", topo.rank, f"{weights:,}",
                    whole / 2**20, priced / 2**20, stage.memory_bytes.peak / 2**20)
