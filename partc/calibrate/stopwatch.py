"""Timing a call as calibration does, and the progress lines' forms of a rate.

Every figure is the median of ``Sizes.repeats`` samples after ``Sizes.warmup`` calls, each
sample batching enough back-to-back calls to last ``Sizes.min_sample_s`` so that the clock
resolves it: CUDA events on a GPU, ``Sizes.clock`` (``time.perf_counter`` unless a
caller asks for the thread's CPU time) on a CPU. What ranks time together is a sample
of the slowest rank's, every rank running the same number of calls.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from partc.calibrate.calibration_options import Sizes

# What the ranks time together, every one computing at once as in training, is batched
# into samples at least this long: a training step's phases run for tens of milliseconds,
# and on a shared machine a shorter sample sees one time slice of a core (all of it, or
# none) instead of the share the step gets.
BUSY_SAMPLE_S = 0.05


def elapsed(fn: Callable[[], object], device: torch.device, calls: int,
            clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds for ``calls`` back-to-back calls, all finished (on a CPU by ``clock``)."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start_s = clock()
    for _ in range(calls):
        fn()
    return clock() - start_s


def calls_per_sample(one_call_s: float, sizes: Sizes) -> int:
    return max(1, math.ceil(sizes.min_sample_s / max(one_call_s, 1e-9)))


def median_seconds(fn: Callable[[], object], device: torch.device, sizes: Sizes) -> float:
    """Median seconds per call of ``fn`` after warm-up."""
    for _ in range(sizes.warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    calls = calls_per_sample(elapsed(fn, device, 1, sizes.clock), sizes)
    return statistics.median(elapsed(fn, device, calls, sizes.clock) / calls
                             for _ in range(sizes.repeats))


def slowest_rank_seconds(op: Callable[[], object], device: torch.device,
                         sizes: Sizes) -> float:
    """Median seconds per call over the process group; every rank runs the same number
    of calls per sample and a sample is the slowest rank's time (on a CPU by
    ``sizes.clock``)."""
    clock = sizes.clock
    for _ in range(sizes.warmup):
        op()
    one = slowest(elapsed(op, device, 1, clock), device)
    calls = calls_per_sample(one, sizes)
    samples = []
    for _ in range(sizes.repeats):
        dist.barrier()
        samples.append(slowest(elapsed(op, device, calls, clock) / calls, device))
    return statistics.median(samples)


def slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's ``seconds``."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def format_flops(value: float) -> str:
    return f"{value / 1e12:.1f} TFLOP/s" if value >= 1e12 else f"{value / 1e9:.1f} GFLOP/s"


def format_rate(value: float) -> str:
    return f"{value / 1e9:.2f} GB/s" if value >= 1e9 else f"{value / 1e6:.1f} MB/s"
