"""The cost model's forward, backward and optimizer step of the sample GPT against the same
phases measured, on one CPU thread, by its CPU time: a check of the compute model that
other jobs on a shared machine do not disturb.

    python benchmarks/step_breakdown.py [--batches 1 2 4 8] [--wall]

The device numbers are measured first, by ``partc calibrate``'s own functions (its quick
sizes) under the same clock: best matmul rate and per-call overhead, linear layers'
forward and backward (the efficiency), copy and add (HBM bandwidth), per-op overhead,
the element-wise mix and AdamW's step (``elementwise_bandwidth``,
``optimizer_bandwidth``). Then, per micro-batch size b, the sample GPT of
``benchmarks/plan_choice.py`` is planned on one device with a batch of b (one
microbatch), and its plan's forward, backward and tail (the optimizer step) are printed
beside the eager model's forward (with the loss), backward and ``AdamW.step`` timed with
that clock, once priced with the element-wise and optimizer rates and once without them
(their bytes at HBM bandwidth, as the cost model priced them before the rates existed).

The clock is the thread's CPU time (``time.thread_time``): what the thread computed,
not the time slices other processes took from it; ``--wall`` times by wall clock.
Collectives and pipeline bubbles are outside it: ``plan_choice.py`` times whole steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import partc  # noqa: E402
from partc import calibrate  # noqa: E402
from benchmarks.plan_choice import batch, loss_fn, model  # noqa: E402

CPU = torch.device("cpu")


def device_numbers(sizes: calibrate.Sizes) -> dict:
    """DeviceBudget fields from calibrate's measurements under ``sizes.clock``."""
    matmul = calibrate.measure_matmul(CPU, ("float32",), sizes)["float32"]
    linear = calibrate.measure_linear(CPU, ("float32",), sizes)["float32"]["flops_per_s"]
    memory = calibrate.measure_memory(CPU, sizes)["best_bytes_per_s"]
    overhead = calibrate.measure_op_overhead(CPU, sizes)
    best = matmul["best_flops_per_s"]
    return dict(
        peak_flops={"float32": best}, flops_efficiency=min(1.0, linear / best),
        hbm_bandwidth=memory, op_overhead_s=overhead["forward_s"],
        op_overhead_backward_s=overhead["backward_s"], matmul_overhead_s=matmul["overhead_s"],
        elementwise_bandwidth=calibrate.measure_elementwise(CPU, sizes,
                                                           overhead)["bytes_per_s"],
        optimizer_bandwidth=calibrate.measure_optimizer(CPU, sizes)["bytes_per_s"])


def predicted(numbers: dict, b: int) -> tuple[float, float, float]:
    """(forward, backward, optimizer step) seconds of the plan for a batch of ``b``."""
    budget = partc.DeviceBudget(num_devices=1, device="CPU", **numbers)
    ids, _ = batch()
    program = partc.compile(model(), (ids[:b],), loss_fn=loss_fn, budget=budget,
                            train=partc.TrainSpec(global_batch_size=b),
                            constraints=partc.Constraints(num_microbatches=1,
                                                          recompute="none"))
    time_s = program.plan.stages[0].time_s
    return time_s.forward, time_s.backward, time_s.tail


def measured(b: int, sizes: calibrate.Sizes) -> tuple[float, float, float]:
    """(forward, backward, AdamW step) seconds of the eager model on a batch of ``b``."""
    gpt = model()
    ids, target = batch()
    ids, target = ids[:b], target[:b]
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-4)

    def forward() -> torch.Tensor:
        return loss_fn(gpt(ids), target)

    def both() -> None:
        forward().backward()

    forward_s = calibrate.median_seconds(forward, CPU, sizes)
    both_s = calibrate.median_seconds(both, CPU, sizes)
    return forward_s, both_s - forward_s, calibrate.median_seconds(optimizer.step, CPU, sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--wall", action="store_true", help="time by wall clock")
    args = parser.parse_args()
    torch.set_num_threads(1)
    clock = time.perf_counter if args.wall else time.thread_time
    sizes = dataclasses.replace(calibrate.SIZES["cpu", True], clock=clock)
    numbers = device_numbers(sizes)
    hbm = numbers | {"elementwise_bandwidth": None, "optimizer_bandwidth": None}
    print(f"clock: {'wall' if args.wall else 'thread CPU time'}; "
          + ", ".join(f"{k} {v:.3g}" for k, v in numbers.items() if k != "peak_flops")
          + f", peak {numbers['peak_flops']['float32']:.3g}")
    print(f"{'b':>2}  {'phase':<10}{'measured':>10}{'predicted':>11}{'ratio':>7}"
          f"{'HBM rates':>11}{'ratio':>7}")
    ratios: dict[str, list[float]] = {"rates": [], "hbm": []}
    for b in args.batches:
        rows = zip(("forward", "backward", "optimizer"), measured(b, sizes),
                   predicted(numbers, b), predicted(hbm, b))
        for phase, seconds, rated, before in rows:
            ratios["rates"].append(rated / seconds)
            ratios["hbm"].append(before / seconds)
            print(f"{b:>2}  {phase:<10}{seconds * 1e3:>8.1f}ms{rated * 1e3:>9.1f}ms"
                  f"{rated / seconds:>7.2f}{before * 1e3:>9.1f}ms{before / seconds:>7.2f}")
    for key, label in (("rates", "with the rates"), ("hbm", "at HBM bandwidth")):
        errors = [abs(r - 1) for r in ratios[key]]
        print(f"median |predicted/measured - 1| {label}: {statistics.median(errors):.2f}")


if __name__ == "__main__":
    main()
