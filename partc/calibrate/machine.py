"""This machine: its name, the preset it matches, its cores, load and memory.

On CPU a device is one of the N processes calibrated: compute and memory bandwidth are
measured with cores / N threads, and a device's memory is the machine's RAM / N.
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from partc.calibrate.calibration_options import CalibrationOptions


@dataclass(frozen=True, kw_only=True)
class Host:
    """The machine's cores and how busy other work kept them."""

    cores: int                               # this process may run on
    load_average_before: float | None        # runnable processes, last minute (Unix)
    load_average_after: float | None = None  # the calibration's own count too

    @property
    def busy(self) -> bool:
        """Other work holds half the cores or more: timings will be low and noisy."""
        load = self.load_average_before
        return load is not None and load >= self.cores / 2

    def to_dict(self) -> dict:
        return asdict(self)


def cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def load_average() -> float | None:
    """Runnable processes over the last minute (Unix); the calibration's own count too."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def threads_per_process(options: CalibrationOptions) -> int:
    if options.device == "cuda":
        return torch.get_num_threads()
    return max(1, cores() // options.processes)


def device_memory(options: CalibrationOptions) -> int | None:
    """Bytes of one device: GPU 0's, or on a CPU the RAM's share of one process."""
    if options.device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // options.processes
    except (AttributeError, ValueError, OSError):
        return None


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def known_preset(device: str, name: str) -> str | None:
    """The preset for this device: the GPU's own (vendor figures), or the generic "CPU"."""
    if device == "cpu":
        return "CPU"
    upper = name.upper()
    if "H200" in upper:
        return "H200"
    if "H100" in upper:
        return "H100-80GB"
    if "A100" in upper:
        return "A100-40GB" if "40GB" in upper else "A100-80GB"
    return None
