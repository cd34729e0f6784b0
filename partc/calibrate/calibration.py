"""Measure this machine's devices and build the device profile that DeviceBudget loads.

    partc calibrate --out profile.json                 # CUDA when torch sees a GPU, else CPU
    partc calibrate --device cpu --processes 2 --quick --out cpu.json

Every figure is the median of repeats after warm-up runs, each repeat long enough for the
clock (:mod:`partc.calibrate.stopwatch`). :func:`calibrate` runs the steps in order:

1. this machine (:mod:`partc.calibrate.machine`): cores, load, the threads a process gets;
2. one process's compute and memory: matmul, linear-layer and attention FLOP/s and the
   split backward (:mod:`partc.calibrate.matmuls`), copy and add bandwidth
   (:mod:`partc.calibrate.memory_rates`), dispatch per op and a GPU's time per kernel
   (:mod:`partc.calibrate.overheads`), the element-wise mix and the optimizer step
   (:mod:`partc.calibrate.memory_rates`);
3. with N processes, the ranks (:mod:`partc.calibrate.collective_ranks`): collectives
   under gloo or NCCL fitted to the ring form (:mod:`partc.calibrate.collective_fits`),
   their overlap with compute, the rates with every rank computing at once, and on CPU
   FSDP2's own work (:mod:`partc.calibrate.fsdp_overheads`);
4. the profile (:mod:`partc.calibrate.profile_writer`): the budget's numbers, where each
   came from, and everything measured; ``docs/calibrate.md`` describes the file, and
   :mod:`partc.calibrate.profile_summary` prints it as a table.

On CPU a device is one of the N processes: compute and memory bandwidth are measured with
cores / N threads, and a device's memory is the machine's RAM / N.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from partc.calibrate.calibration_options import CalibrationOptions
from partc.calibrate.collective_ranks import measure_collectives
from partc.calibrate.host_rates import measure_host_adam, measure_host_link
from partc.calibrate.machine import (Host, cores, device_name, load_average,
                                     threads_per_process)
from partc.calibrate.matmuls import (measure_attention, measure_linear, measure_matmul,
                                     measure_split_backward)
from partc.calibrate.memory_rates import measure_elementwise, measure_memory, measure_optimizer
from partc.calibrate.overheads import KernelOverhead, measure_kernel_overhead, measure_op_overhead
from partc.calibrate.profile_writer import Measurements, build_profile

log = logging.getLogger(__name__)


def calibrate(options: CalibrationOptions) -> dict:
    """Measure everything ``options`` asks for; return the profile (JSON-ready)."""
    device = torch.device("cuda", 0) if options.device == "cuda" else torch.device("cpu")
    threads = threads_per_process(options)
    host = Host(cores=cores(), load_average_before=load_average())
    if host.busy:
        log.warning("the machine is busy (load average %.1f on %d cores): figures will be "
                    "low and noisy", host.load_average_before, host.cores)
    measured = measure_one_process(device, options, threads)
    if options.processes > 1:
        measured = replace(measured, collectives=measure_collectives(options))
    else:
        log.info("collectives: skipped, one process")
    host = replace(host, load_average_after=load_average())
    return build_profile(options, measured, name=device_name(options.device),
                         threads=threads, host=host)


def measure_one_process(device: torch.device, options: CalibrationOptions,
                        threads: int) -> Measurements:
    """What one process measures alone, with ``threads`` threads, in this order."""
    sizes, dtypes = options.sizes, options.dtypes
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        matmul = measure_matmul(device, dtypes, sizes)
        linear = measure_linear(device, dtypes, sizes)
        split_backward = measure_split_backward(device, sizes)
        attention = measure_attention(device, dtypes, sizes)
        memory = measure_memory(device, sizes)
        op_overhead = measure_op_overhead(device, sizes)
        kernel_overhead = _kernel_overhead(device, options)
        return Measurements(matmul=matmul, linear=linear, split_backward=split_backward,
                            attention=attention, memory=memory, op_overhead=op_overhead,
                            kernel_overhead=kernel_overhead,
                            elementwise=measure_elementwise(device, sizes, op_overhead),
                            optimizer=measure_optimizer(device, sizes),
                            host_adam=measure_host_adam(sizes),
                            host_link=measure_host_link(device, sizes))
    finally:
        torch.set_num_threads(before)


def _kernel_overhead(device: torch.device, options: CalibrationOptions) -> KernelOverhead | None:
    try:
        return measure_kernel_overhead(device, options.sizes)
    except (RuntimeError, AttributeError) as error:   # the profile keeps the preset's
        log.warning("kernel overhead not measured: %s", error)
        return None
