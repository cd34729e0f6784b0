"""What a calibration run measures: the device, the ranks, and the sizes and repeats.

``CalibrationOptions`` is what the command line gives (``partc calibrate --device cpu
--processes 2 --quick``); ``SIZES`` holds, per device and run length, the shapes, bytes
and repeats every measurement reads. A quick run takes seconds and is for tests; a full
one about a minute on a CPU and a few on a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from partc.errors import PartcError


class CalibrationError(PartcError):
    """A measurement could not be taken or made no sense; the message says which."""


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """What to run: shapes, bytes and how often."""

    matmul: tuple[tuple[int, int, int], ...]   # (m, k, n)
    linear: tuple[tuple[int, int, int], ...]   # (tokens, in, out) of a trained linear layer
    attention: tuple[int, int, int, int]       # (batch, heads, seq, head_dim)
    memory_bytes: int                          # of each tensor in the copy and add
    message_bytes: tuple[int, ...]             # collective sizes
    repeats: int
    warmup: int
    min_sample_s: float                        # calls per sample are batched up to this
    # A CPU's clock: wall time, or ``time.thread_time`` (the calling thread's CPU time:
    # what a one-thread process computes, whatever else the machine runs).
    clock: Callable[[], float] = time.perf_counter


def _powers_of_4(low: int, high: int) -> tuple[int, ...]:
    return tuple(2**e for e in range(low, high + 1, 2))


SIZES = {
    ("cpu", True): Sizes(matmul=((64, 64, 64), (128, 128, 128), (256, 256, 256)),
                         linear=((256, 128, 384), (256, 384, 128)),
                         attention=(1, 4, 128, 32),
                         memory_bytes=16 * 2**20, message_bytes=_powers_of_4(10, 22),
                         repeats=5, warmup=1, min_sample_s=2e-3),
    ("cpu", False): Sizes(matmul=((128, 128, 128), (256, 256, 256), (512, 512, 512),
                                  (1024, 1024, 1024), (2048, 2048, 2048), (2048, 4096, 2048)),
                          linear=((512, 256, 768), (512, 768, 256), (2048, 1024, 4096),
                                  (2048, 4096, 1024)),
                          attention=(2, 8, 1024, 64),
                          memory_bytes=256 * 2**20, message_bytes=_powers_of_4(10, 26),
                          repeats=7, warmup=3, min_sample_s=0.02),
    ("cuda", True): Sizes(matmul=((1024, 1024, 1024), (2048, 2048, 2048)),
                          linear=((4096, 2048, 6144), (4096, 6144, 2048)),
                          attention=(2, 8, 1024, 64), memory_bytes=64 * 2**20,
                          message_bytes=_powers_of_4(10, 24), repeats=3, warmup=2,
                          min_sample_s=1e-3),
    ("cuda", False): Sizes(matmul=((512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048),
                                   (4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 8192)),
                           linear=((8192, 4096, 12288), (8192, 4096, 14336),
                                   (8192, 14336, 4096), (8192, 8192, 28672)),
                           attention=(4, 32, 4096, 128),
                           memory_bytes=2**30, message_bytes=_powers_of_4(10, 30),
                           repeats=10, warmup=5, min_sample_s=0.02),
}


@dataclass(frozen=True, kw_only=True)
class CalibrationOptions:
    device: str = "cpu"          # "cpu" or "cuda"
    processes: int = 2           # ranks for the collectives; on CPU, devices per node
    quick: bool = False          # small sizes, few repeats: seconds, for tests

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.processes < 1:
            raise ValueError(f"processes must be at least 1, got {self.processes}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise CalibrationError("--device cuda, but torch sees no GPU here")
        if self.device == "cuda" and self.processes > torch.cuda.device_count():
            raise ValueError(f"{self.processes} processes asked for, but only "
                             f"{torch.cuda.device_count()} GPUs: one process per GPU")

    @property
    def sizes(self) -> Sizes:
        return SIZES[self.device, self.quick]

    @property
    def dtypes(self) -> tuple[str, ...]:
        if self.device == "cuda":
            return ("float32", "tf32", "bfloat16", "float16")
        return ("float32", "bfloat16")
