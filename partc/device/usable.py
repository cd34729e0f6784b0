"""The memory a plan may fill on a device: what CUDA reports, less what runs beside it.

A device's ``memory`` figure is its total as CUDA reports it
(``torch.cuda.get_device_properties(i).total_memory``: 79.2 GiB on an H100 80GB). The
tensors the plan counts are not all a training process holds there:

1. the CUDA context and the libraries' workspaces (cuBLAS, cuDNN), once per device:
   ``context_memory``;
2. NCCL's buffers, for each communicator the rank joins: ``communicator_memory`` times
   :func:`communicators`, the distinct process groups of more than one rank it runs
   collectives on (the world, and each mesh dimension over more than one rank and fewer
   than all). A simple model: NCCL's memory grows with its channels and connections,
   which differ between collectives, algorithms and scale (beyond two nodes it stops
   growing); point-to-point connections and tied-weight groups are not counted apart;
3. the caching allocator's fragmentation: the share ``memory_fragmentation`` of what is
   left, lost between the blocks the plan's tensors take.

    usable = floor((memory - context - communicators x per_communicator) x (1 - fragmentation))

This is the one place the limit is computed: the planner's cost tables
(``partc.cost.tables``), and through them the validator and "no plan fits", read
:func:`usable_memory`; the report shows :func:`headroom`. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


# The figures of DeviceFigures this module takes from a device's memory.
RESERVE_FIGURES = ("context_memory", "communicator_memory", "memory_fragmentation")


class Reserves(Protocol):
    """What :func:`usable_memory` reads: DeviceFigures, DeviceNumbers and a plan's
    figures all have these (None: not known, read as 0)."""

    context_memory: int | None
    communicator_memory: int | None
    memory_fragmentation: float | None


def communicators(num_devices: int, pp: int, dp: int, tp: int, ep: int = 1) -> int:
    """NCCL communicators each rank of a (pp, dp, tp) mesh of ``num_devices`` joins: the
    world's, and one per mesh dimension over more than one rank and fewer than all (the
    expert-parallel and expert-data-parallel groups with ``ep`` > 1). Dimensions of one
    size that span the same ranks (the world) share it."""
    if num_devices <= 1:
        return 0
    groups = [pp, dp, tp]
    if ep > 1:
        groups += [ep, dp * tp // ep]
    return 1 + sum(1 for size in groups if 1 < size < num_devices)


def _reserve(figures: Reserves, groups: int) -> tuple[int, float]:
    context = figures.context_memory or 0
    nccl = (figures.communicator_memory or 0) * groups
    return context + nccl, figures.memory_fragmentation or 0.0


def usable_memory(total: int, figures: Reserves, groups: int) -> int:
    """Bytes a plan may fill on a device of ``total`` bytes (as CUDA reports it) whose
    rank joins ``groups`` communicators (:func:`communicators`); 0 when the reserve
    takes it all."""
    fixed, fragmentation = _reserve(figures, groups)
    return max(0, math.floor((total - fixed) * (1.0 - fragmentation)))


def device_memory_for(usable: int, figures: Reserves, groups: int) -> float:
    """The smallest device total (as CUDA reports it) that leaves ``usable`` bytes: the
    inverse of :func:`usable_memory`, for a fix a person can buy (infinite where
    fragmentation takes everything)."""
    fixed, fragmentation = _reserve(figures, groups)
    if fragmentation >= 1.0:
        return math.inf
    total = fixed + math.ceil(usable / (1.0 - fragmentation))
    while usable_memory(total, figures, groups) < usable:   # rounding
        total += 1
    return total


@dataclass(frozen=True, kw_only=True)
class Headroom:
    """A device's memory from the vendor's figure down to what the plan fills, in
    bytes: ``nominal`` (None where unknown) > ``reported`` (CUDA's total) > ``usable``
    (after the reserves) >= ``peak`` (the plan's largest stage)."""

    nominal: int | None
    reported: int
    context: int
    communicators: int
    per_communicator: int
    fragmentation: float
    usable: int
    peak: int

    @property
    def fragmentation_bytes(self) -> int:
        return self.reported - self.context - self.communicators * self.per_communicator \
            - self.usable

    @property
    def left(self) -> int:
        """What the plan's peak leaves of the usable memory."""
        return self.usable - self.peak


def headroom(*, reported: int, nominal: int | None, figures: Reserves, groups: int,
             peak: int) -> Headroom:
    """The steps from ``nominal`` to the plan's ``peak`` on a device of ``reported``
    bytes whose rank joins ``groups`` communicators."""
    return Headroom(nominal=nominal, reported=reported, context=figures.context_memory or 0,
                    communicators=groups, per_communicator=figures.communicator_memory or 0,
                    fragmentation=figures.memory_fragmentation or 0.0,
                    usable=usable_memory(reported, figures, groups), peak=peak)
