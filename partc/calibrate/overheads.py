"""Fixed costs per op, whatever its size: eager dispatch, and a GPU's time per kernel.

- op overhead: a chain of tiny element-wise ops that autograd records, forward and
  forward + backward: eager dispatch per op (``op_overhead_s``,
  ``op_overhead_backward_s``; on CPU only: a GPU's launches run ahead of its kernels).
- kernel overhead (a GPU only): a GPU's own time per kernel whatever its size, its
  launch, ramp-up and tail (``kernel_overhead_s``): tiny kernels queued behind a long
  one run back to back, as a layer's do behind a host that dispatches ahead, timed over
  their span. A CPU's per-op time is the op overhead.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from partc.calibrate.calibration_options import Sizes
from partc.calibrate.stopwatch import median_seconds
from partc.units import format_seconds

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class OpOverhead:
    """Eager dispatch per op, whatever its size."""

    chain: int                     # ops in the chain timed
    forward_s: float               # seconds per op, forward
    backward_s: float              # seconds per forward op, its backward

    def to_dict(self) -> dict:
        return asdict(self)


def measure_op_overhead(device: torch.device, sizes: Sizes, chain: int = 64) -> OpOverhead:
    """Eager dispatch per op, forward and backward: a chain of ``chain`` element-wise ops
    on a 16-element tensor that needs a gradient (so autograd records each), timed
    forward alone and forward then backward; what one op costs whatever its size."""
    x = torch.ones(16, device=device, requires_grad=True)

    def forward() -> torch.Tensor:
        y = x
        for _ in range(chain):
            y = y * 1.0001
        return y

    def both() -> None:
        forward().sum().backward()

    forward_s = median_seconds(forward, device, sizes) / chain
    total_s = median_seconds(both, device, sizes) / chain
    result = OpOverhead(chain=chain, forward_s=forward_s,
                        backward_s=max(0.0, total_s - forward_s))
    log.info("op overhead: %s forward, %s backward per op",
             format_seconds(result.forward_s), format_seconds(result.backward_s))
    return result


@dataclass(frozen=True, kw_only=True)
class KernelOverhead:
    """A GPU's own time per kernel, from tiny kernels run back to back."""

    kernels: int                   # kernels queued
    per_kernel_s: float            # their span over their number, seconds
    queued_s: float                # the host's seconds to launch them all

    def to_dict(self) -> dict:
        return asdict(self)


def measure_kernel_overhead(device: torch.device, sizes: Sizes,
                            kernels: int = 256) -> KernelOverhead | None:
    """A GPU's own time per kernel whatever its size: ``kernels`` multiplies of a
    16-element tensor queued while a long kernel holds the GPU, so that they run back to
    back from a full queue (as a layer's kernels do behind a host that dispatches ahead)
    and not at the host's pace; their span over their number. ``queued_s``: the host's
    time to launch them, under the hold when the figure is the GPU's alone. None on a
    CPU, whose time per op is the op overhead."""
    if device.type != "cuda":
        return None
    x = torch.ones(16, device=device)
    hold = _hold_the_gpu(device, hold_s=0.05)

    def span() -> tuple[float, float]:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        hold()
        start.record()
        queued = time.perf_counter()
        for _ in range(kernels):
            x.mul_(1.0)
        queued = time.perf_counter() - queued
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / kernels, queued

    for _ in range(max(1, sizes.warmup)):
        span()
    spans = [span() for _ in range(max(3, sizes.repeats))]
    result = KernelOverhead(kernels=kernels,
                            per_kernel_s=statistics.median(s for s, _ in spans),
                            queued_s=statistics.median(q for _, q in spans))
    log.info("kernel overhead: %s per kernel (%d kernels, queued in %s)",
             format_seconds(result.per_kernel_s), kernels, format_seconds(result.queued_s))
    return result


def _hold_the_gpu(device: torch.device, hold_s: float):
    """A call that keeps the GPU busy for about ``hold_s``: ``torch.cuda._sleep`` where
    torch has it, else matmuls about as long."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        hertz = 1e3 * getattr(torch.cuda.get_device_properties(device), "clock_rate",
                              1.5e6)   # kHz
        cycles = int(hold_s * hertz)
        return lambda: sleep(cycles)
    a = torch.ones(4096, 4096, device=device, dtype=torch.bfloat16)

    def hold() -> None:
        for _ in range(32):
            torch.mm(a, a)
    return hold
