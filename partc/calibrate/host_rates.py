"""The host's optimizer step and link, for offload: ``host_adam_rate`` (parameter updates
per second of the host's cores) and, beside a GPU, ``host_to_device_bandwidth`` and
``device_to_host_bandwidth`` (pinned copies each way).

The step is the one offload runs (``partc/runtime/offload.py``): torch's AdamW in its
fused CPU form over fp32 host tensors of a transformer block's shapes, with every thread
of the process (the host's cores step one rank's share at a time per node in the cost
model, so one process with all of them measures the node's rate). Its size is the
memory test's, so that the state does not sit in cache.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import torch

from partc.calibrate.calibration_options import Sizes
from partc.calibrate.memory_rates import block_shapes
from partc.calibrate.stopwatch import format_rate, median_seconds

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")


@dataclass(frozen=True, kw_only=True)
class HostAdamRate:
    """The host's AdamW step: ``params`` parameters in ``seconds``."""

    kernel: str            # "fused" (torch's CPU kernel), or "foreach" where torch lacks it
    threads: int
    params: int
    seconds: float

    @property
    def updates_per_s(self) -> float:
        return self.params / self.seconds

    def to_dict(self) -> dict:
        return asdict(self) | {"updates_per_s": self.updates_per_s}


def measure_host_adam(sizes: Sizes) -> HostAdamRate:
    """torch's fused AdamW on the host (:mod:`the module's doc <partc.calibrate.host_rates>`)
    over blocks' parameters of about ``sizes.memory_bytes`` in all."""
    width = max(64, int(math.sqrt(sizes.memory_bytes / 4 / 12)))
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in block_shapes(width)]
    for param in params:
        param.grad = torch.randn_like(param)
    try:
        optimizer, kernel = torch.optim.AdamW(params, lr=1e-4, fused=True), "fused"
        optimizer.step()
    except RuntimeError:   # a torch without the CPU kernel
        optimizer, kernel = torch.optim.AdamW(params, lr=1e-4, foreach=True), "foreach"
    seconds = median_seconds(optimizer.step, _CPU, sizes)
    result = HostAdamRate(kernel=kernel, threads=torch.get_num_threads(),
                          params=sum(p.numel() for p in params), seconds=seconds)
    log.info("host AdamW step (%s): %.3g parameters/s", kernel, result.updates_per_s)
    return result


@dataclass(frozen=True, kw_only=True)
class HostLink:
    """Pinned copies of ``nbytes`` between the host and GPU 0, each way."""

    nbytes: int
    to_device_s: float
    to_host_s: float

    @property
    def to_device_bytes_per_s(self) -> float:
        return self.nbytes / self.to_device_s

    @property
    def to_host_bytes_per_s(self) -> float:
        return self.nbytes / self.to_host_s

    def to_dict(self) -> dict:
        return asdict(self) | {"to_device_bytes_per_s": self.to_device_bytes_per_s,
                               "to_host_bytes_per_s": self.to_host_bytes_per_s}


def measure_host_link(device: torch.device, sizes: Sizes) -> HostLink | None:
    """The host link beside a GPU (None on a CPU, whose host is its memory)."""
    if device.type != "cuda":
        return None
    nbytes = max(sizes.memory_bytes, 64 * 2**20)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = HostLink(
        nbytes=nbytes,
        to_device_s=median_seconds(lambda: gpu.copy_(host, non_blocking=True), device, sizes),
        to_host_s=median_seconds(lambda: host.copy_(gpu, non_blocking=True), device, sizes))
    log.info("host link: %s to the device, %s to the host",
             format_rate(result.to_device_bytes_per_s), format_rate(result.to_host_bytes_per_s))
    return result
