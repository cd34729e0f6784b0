"""FSDP2's own work beside its collectives, per unit and microbatch, on a CPU's ranks.

With the ranks the collectives spawn, FSDP2 (ZeRO-2/3) is timed against the same modules
without it: forward and backward hooks (``fsdp_unit_overhead_s``,
``fsdp_unit_overhead_backward_s``), per all-gather and reduce-scatter
(``fsdp_gather_overhead_s``, ``fsdp_scatter_overhead_s``), the optimizer step over
sharded parameters (``fsdp_step_overhead_s``) and the copies' rate
(``fsdp_copy_bandwidth``). On CPU only: a GPU's host runs this work ahead of the kernels.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from partc.calibrate.calibration_options import Sizes
from partc.calibrate.memory_rates import block_shapes
from partc.calibrate.stopwatch import format_rate, slowest_rank_seconds
from partc.units import format_seconds

log = logging.getLogger(__name__)

# FSDP units timed by measure_fsdp: enough that the root unit's hooks are a small share.
FSDP_UNITS = 8
# The budget's FSDP numbers (DeviceNumbers) and the FsdpOverheads figures they are.
FSDP_FIGURES = {"fsdp_unit_overhead_s": "unit_forward_s",
                "fsdp_unit_overhead_backward_s": "unit_backward_s",
                "fsdp_gather_overhead_s": "gather_s",
                "fsdp_scatter_overhead_s": "scatter_s",
                "fsdp_step_overhead_s": "step_s", "fsdp_copy_bandwidth": "copy_bytes_per_s"}
# The tiny units' width: their copies cost next to nothing.
FSDP_TINY_WIDTH = 8


class _Block(torch.nn.Module):
    """A unit holding a transformer block's parameters; its forward uses each once."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(shape) / width)
                                              for shape in block_shapes(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(weight.sum() for weight in self.weights)


# (forward, backward, optimizer step) seconds of the rank thread's CPU time, the
# slowest rank's median.
Phases = tuple[float, float, float]


@dataclass(frozen=True, kw_only=True)
class FsdpTimings:
    """``units`` blocks of ``width`` timed four ways, and the figures per unit they give."""

    width: int
    units: int
    plain_s: Phases                # without FSDP
    zero2_accumulate_s: Phases     # ZeRO-2, no gradient sync: its hooks
    zero2_reduce_s: Phases         # ZeRO-2 reducing every microbatch
    zero3_s: Phases                # ZeRO-3: gathered again in forward and backward

    @property
    def step_s(self) -> float:           # per parameter tensor and step
        return max(0.0, (self.zero3_s[2] - self.plain_s[2]) / self.units
                   / len(block_shapes(self.width)))

    @property
    def unit_forward_s(self) -> float:   # the hooks' forward, per unit
        return max(0.0, (self.zero2_accumulate_s[0] - self.plain_s[0]) / self.units)

    @property
    def unit_backward_s(self) -> float:  # the hooks' backward, per unit
        return max(0.0, (self.zero2_accumulate_s[1] - self.plain_s[1]) / self.units)

    @property
    def scatter_s(self) -> float:        # per reduce-scatter
        return max(0.0, (self.zero2_reduce_s[1] - self.zero2_accumulate_s[1]) / self.units)

    @property
    def gather_s(self) -> float:         # per all-gather
        return max(0.0, (self.zero3_s[0] - self.zero2_accumulate_s[0]) / self.units)

    def to_dict(self) -> dict:
        return {"width": self.width, "plain_s": list(self.plain_s),
                "zero2_accumulate_s": list(self.zero2_accumulate_s),
                "zero2_reduce_s": list(self.zero2_reduce_s), "zero3_s": list(self.zero3_s),
                "step_s": self.step_s, "unit_forward_s": self.unit_forward_s,
                "unit_backward_s": self.unit_backward_s, "scatter_s": self.scatter_s,
                "gather_s": self.gather_s}


@dataclass(frozen=True, kw_only=True)
class FsdpOverheads:
    """FSDP2's work per unit and microbatch: the tiny blocks' figures, and the copies'
    rate from the wide blocks' all-gather and reduce-scatter over the tiny ones'."""

    ranks: int
    tiny: FsdpTimings
    wide: FsdpTimings

    @property
    def params_per_unit(self) -> dict[int, int]:   # width -> parameters of one block
        return {width: sum(math.prod(shape) for shape in block_shapes(width))
                for width in (self.tiny.width, self.wide.width)}

    @property
    def copied_bytes(self) -> float:   # the wide blocks' extra, gather and scatter
        params = self.params_per_unit
        added = params[self.wide.width] - params[self.tiny.width]
        # Read and written, the whole unit and the rank's shard: 2 (1 + 1/n) per byte.
        return 2 * (2 * (1 + 1 / self.ranks) * 4 * added)

    @property
    def copy_s(self) -> float:         # seconds the wide blocks' copies took
        return ((self.wide.gather_s - self.tiny.gather_s)
                + (self.wide.scatter_s - self.tiny.scatter_s))

    @property
    def copy_bytes_per_s(self) -> float | None:   # None where noise hid the copies
        return self.copied_bytes / self.copy_s if self.copy_s > 0 else None

    # The budget's figures (FSDP_FIGURES): the tiny blocks', the fixed work.
    @property
    def unit_forward_s(self) -> float:
        return self.tiny.unit_forward_s

    @property
    def unit_backward_s(self) -> float:
        return self.tiny.unit_backward_s

    @property
    def gather_s(self) -> float:
        return self.tiny.gather_s

    @property
    def scatter_s(self) -> float:
        return self.tiny.scatter_s

    @property
    def step_s(self) -> float:
        return self.tiny.step_s

    def to_dict(self) -> dict:
        return {"units": self.tiny.units, "clock": "thread CPU time",
                "tiny": self.tiny.to_dict(), "wide": self.wide.to_dict(),
                "params_per_unit": self.params_per_unit, "copied_bytes": self.copied_bytes,
                "copy_s": self.copy_s, "copy_bytes_per_s": self.copy_bytes_per_s,
                **{key: getattr(self, key) for key in (
                    "unit_forward_s", "unit_backward_s", "gather_s", "scatter_s", "step_s")}}


def measure_fsdp(device: torch.device, sizes: Sizes, units: int = FSDP_UNITS) -> FsdpOverheads:
    """FSDP2's own work per unit and microbatch over the ranks' process group, as
    ``partc.runtime`` runs ZeRO-2/3, beside the collectives: ``units`` units of a
    transformer block's 12 parameter tensors (:func:`block_shapes`) under a root, timed
    forward and forward + backward against the same modules without FSDP, by the rank
    thread's CPU time (``time.thread_time``): the collectives run on gloo's threads while
    it waits, and the cost model prices them apart. Per unit, the root's share included,
    at a tiny width (``FSDP_TINY_WIDTH``: the fixed work):

    - ZeRO-2 accumulating (no gradient sync): its forward and backward hooks
      (``unit_forward_s``, ``unit_backward_s``);
    - ZeRO-2 reducing every microbatch: ``scatter_s``, its backward's excess over that;
    - ZeRO-3 (gathered again in forward and backward, freed after each): ``gather_s``,
      its forward's excess over ZeRO-2's;
    - ``torch.optim.AdamW``'s step over the sharded parameters (DTensors, dispatched per
      tensor and op) over its step over the plain ones: ``step_s``, per parameter tensor
      and step;

    and the same at the width of ``sizes.linear``'s first input, whose all-gather's and
    reduce-scatter's excess over the tiny ones' is their copies: ``copy_bytes_per_s`` is
    the bytes the cost model counts for them (read and written, the whole unit and the
    rank's shard: 2 (1 + 1/n) per byte of weights or gradients) over that time."""
    result = FsdpOverheads(ranks=dist.get_world_size(),
                           tiny=_fsdp_timings(device, sizes, units, FSDP_TINY_WIDTH),
                           wide=_fsdp_timings(device, sizes, units, sizes.linear[0][1]))
    log.info("FSDP per unit and microbatch: hooks %s forward, %s backward; %s per "
             "all-gather, %s per reduce-scatter, %s per tensor's optimizer step, copies "
             "at %s",
             *(format_seconds(getattr(result, key)) for key in (
                 "unit_forward_s", "unit_backward_s", "gather_s", "scatter_s", "step_s")),
             format_rate(result.copy_bytes_per_s) if result.copy_bytes_per_s else "-")
    return result


def _fsdp_timings(device: torch.device, sizes: Sizes, units: int, width: int) -> FsdpTimings:
    """:func:`measure_fsdp`'s four timings of ``units`` blocks of ``width``."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    x = torch.randn(4, width, device=device)
    fixed = replace(sizes, clock=time.thread_time)

    def blocks(zero: int, sync: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(_Block(width) for _ in range(units))).to(device)
        if zero:
            for block in model:
                fully_shard(block, mesh=mesh, reshard_after_forward=zero >= 3)
            fully_shard(model, mesh=mesh, reshard_after_forward=zero >= 3)
            model.set_requires_gradient_sync(sync)
            model.set_reshard_after_backward(zero >= 3)
        return model

    def phases(model: torch.nn.Module) -> Phases:
        def backward() -> None:
            model(x).sum().backward()
        forward_s = slowest_rank_seconds(lambda: model(x).sum(), device, fixed)
        both_s = slowest_rank_seconds(backward, device, fixed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        step_s = slowest_rank_seconds(optimizer.step, device, fixed)
        return forward_s, both_s - forward_s, step_s

    plain = phases(blocks(0, True))
    hooks, reduced, gathered = (phases(blocks(zero, sync))
                                for zero, sync in ((2, False), (2, True), (3, True)))
    return FsdpTimings(width=width, units=units, plain_s=plain, zero2_accumulate_s=hooks,
                       zero2_reduce_s=reduced, zero3_s=gathered)
