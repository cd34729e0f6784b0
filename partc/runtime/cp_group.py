"""Context parallelism as a stage runs it: the group its attention and positions read.

Lowering (``passes/context_parallel.py``) traces the model at one rank's share of the
sequence and puts, in place of each attention core, a call of :func:`attention` (the
ring of :mod:`.ring_attention` or the all-to-all of :mod:`.ulysses`, as the plan's
``cp_kind`` says) and, in place of each ``arange`` of the sequence's positions, a call of
:func:`positions` (this rank's tokens' places in the whole sequence, :mod:`.cp_layout`).
Both read the stage's submodule ``cp``, a :class:`ContextParallelGroup`: a stand-in of
rank 0 that moves no data until the runtime binds the real group (:func:`bind_group`),
as the tensor-parallel group does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from partc.runtime import cp_layout
from partc.runtime.ring_attention import AttentionMask, Ring, ring_attention
from partc.runtime.ulysses import all_to_all_attention

RING, ALL_TO_ALL = "ring", "all-to-all"


class ContextParallelGroup(nn.Module):
    """``size`` ranks that hold one sequence between them, this process being ``rank``
    of them, over ``process_group``; without one, a stand-in (rank 0, no data moved:
    attention over its own tokens only, which has the right shapes). An ``nn.Module`` so
    that it lives in the stage's GraphModule (as ``cp``); it holds no tensors."""

    def __init__(self, size: int, kind: str = RING,
                 process_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if kind not in (RING, ALL_TO_ALL):
            raise ValueError(f"unknown context-parallel kind {kind!r}")
        if process_group is not None and dist.get_world_size(process_group) != size:
            raise ValueError(f"a context-parallel group of {size} ranks cannot run over a "
                             f"process group of {dist.get_world_size(process_group)}")
        self.size, self.kind, self.process_group = size, kind, process_group
        self.rank = dist.get_rank(process_group) if process_group is not None else 0

    @property
    def simulated(self) -> bool:
        return self.process_group is None

    def ring(self) -> Ring:
        if self.simulated:
            return Ring(size=1, rank=0)
        group = self.process_group
        return Ring(size=self.size, rank=self.rank, group=group,
                    next=dist.get_global_rank(group, (self.rank + 1) % self.size),
                    previous=dist.get_global_rank(group, (self.rank - 1) % self.size))

    def extra_repr(self) -> str:
        return f"size={self.size}, kind={self.kind!r}"


def attention(cp: ContextParallelGroup, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, *, scale: float | None = None, mask: str = "causal",
              window: int | None = None) -> torch.Tensor:
    """The attention core over the whole sequence for this rank's queries: q (B, H, s, D)
    and k, v (B, G, s, D) with ``s`` this rank's tokens; ``mask`` and ``window`` as
    :class:`partc.runtime.ring_attention.AttentionMask` reads them (whole-sequence
    positions)."""
    spec = AttentionMask(mask, window)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if cp.kind == ALL_TO_ALL:
        size = 1 if cp.simulated else cp.size
        return all_to_all_attention(query, key, value, scale=scale, mask=spec, cp=size,
                                    group=cp.process_group)
    return ring_attention(query, key, value, scale=scale, mask=spec, ring=cp.ring())


def positions(cp: ContextParallelGroup, local: int, device: torch.device | str | None = None
              ) -> torch.Tensor:
    """The whole-sequence positions of this rank's ``local`` tokens (int64), where the
    model wrote ``arange(local)``."""
    return cp_layout.positions(local * cp.size, cp.size, cp.rank, device)


def bind_group(module: nn.Module, group: ContextParallelGroup) -> None:
    """Make ``group`` the group of every context-parallel call in ``module`` (each
    stand-in :class:`ContextParallelGroup` inside it is replaced)."""
    for owner in list(module.modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, ContextParallelGroup) and child is not group:
                if child.size != group.size or child.kind != group.kind:
                    raise ValueError(f"{name}: the stage was lowered for {child.kind} context "
                                     f"parallelism over {child.size} ranks, not "
                                     f"{group.kind} over {group.size}")
                setattr(owner, name, group)
