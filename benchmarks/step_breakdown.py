"""The cost model's forward, backward and optimizer step of the sample GPT against the same
phases measured, on one CPU thread, by its CPU time: a check of the compute model that
other jobs on a shared machine do not disturb.

    python benchmarks/step_breakdown.py [--batches 1 2 4 8] [--wall]
    python benchmarks/step_breakdown.py --zero 2 3 [--batches 2 8]   # FSDP, 2 gloo ranks
    python benchmarks/step_breakdown.py --steps dp0 dp1 tp [--batches 2 8]

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

``--zero`` checks ZeRO-2/3 instead: two gloo processes first measure FSDP's own work
(``partc.calibrate.fsdp_overheads.measure_fsdp``), then the parent plans the sample GPT
on dp=2 at each ZeRO stage (one microbatch, no recompute; the links made free, so that
the prediction holds what the rank's thread computes and no collective), once with
FSDP's figures and once without (as the cost model priced ZeRO-2/3 before them), and the
two processes build it with ``partc.load`` and time, by their thread's CPU time, the
stage module's forward with the loss, its backward (FSDP's hooks, copies and
reduce-scatters included, the waits for the collectives not) and the tail:
``AdamW.step`` over the rank's shards, and under ZeRO-2 the all-gather of the stepped
weights before the next forward.

``--steps`` does the same for whole steps as the runtime runs them
(``forward_backward`` with its schedule, buckets and collectives, then ``AdamW.step``)
of the plans named: ``dp0``, ``dp1``, ``dp2``, ``dp3`` (dp=2 at that ZeRO stage) and
``tp`` (tp=2; ``tp-sp``, ``tp-nosp`` with sequence parallelism pinned on or off), by the
thread's CPU time against the plan's forward + backward and tail with free links.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import partc  # noqa: E402
from partc.calibrate.calibration_options import SIZES, Sizes  # noqa: E402
from partc.calibrate.fsdp_overheads import FSDP_FIGURES, measure_fsdp  # noqa: E402
from partc.calibrate.matmuls import measure_linear, measure_matmul  # noqa: E402
from partc.calibrate.memory_rates import (measure_elementwise, measure_memory,  # noqa: E402
                                          measure_optimizer)
from partc.calibrate.overheads import measure_op_overhead  # noqa: E402
from partc.calibrate.stopwatch import median_seconds, slowest_rank_seconds  # noqa: E402
from partc.runtime import topology  # noqa: E402
from benchmarks.plan_choice import batch, loss_fn, model  # noqa: E402

CPU = torch.device("cpu")


def device_numbers(sizes: Sizes) -> dict:
    """DeviceBudget fields from calibrate's measurements under ``sizes.clock``."""
    matmul = measure_matmul(CPU, ("float32",), sizes)["float32"]
    linear = measure_linear(CPU, ("float32",), sizes)["float32"].flops_per_s
    memory = measure_memory(CPU, sizes).best_bytes_per_s
    overhead = measure_op_overhead(CPU, sizes)
    best = matmul.best_flops_per_s
    return dict(
        peak_flops={"float32": best}, flops_efficiency=min(1.0, linear / best),
        hbm_bandwidth=memory, op_overhead_s=overhead.forward_s,
        op_overhead_backward_s=overhead.backward_s, matmul_overhead_s=matmul.overhead_s,
        elementwise_bandwidth=measure_elementwise(CPU, sizes, overhead).bytes_per_s,
        optimizer_bandwidth=measure_optimizer(CPU, sizes).bytes_per_s)


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


def measured(b: int, sizes: Sizes) -> tuple[float, float, float]:
    """(forward, backward, AdamW step) seconds of the eager model on a batch of ``b``."""
    gpt = model()
    ids, target = batch()
    ids, target = ids[:b], target[:b]
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-4)

    def forward() -> torch.Tensor:
        return loss_fn(gpt(ids), target)

    def both() -> None:
        forward().backward()

    forward_s = median_seconds(forward, CPU, sizes)
    both_s = median_seconds(both, CPU, sizes)
    return forward_s, both_s - forward_s, median_seconds(optimizer.step, CPU, sizes)


RANKS = 2
# Links that cost nothing: the ZeRO predictions then hold the rank thread's own work.
FREE_LINKS = dict(intra_node_bandwidth=1e15, intra_node_latency_s=1e-12)


# --steps: the plans by name, pinned on the two ranks.
STEP_PLANS = {"dp0": dict(dp=2, tp=1, zero_stage=0), "dp1": dict(dp=2, tp=1, zero_stage=1),
              "dp2": dict(dp=2, tp=1, zero_stage=2), "dp3": dict(dp=2, tp=1, zero_stage=3),
              "tp": dict(dp=1, tp=2), "tp-nosp": dict(dp=1, tp=2, sequence_parallel=False),
              "tp-sp": dict(dp=1, tp=2, sequence_parallel=True)}


def _rank_worker(rank: int, store: str, job: dict) -> None:
    """One of the two gloo ranks: measure FSDP's figures (``job["measure"]``) or time
    each saved program's phases, written by rank 0 to ``job["out"]``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, RANKS), rank=rank,
                            world_size=RANKS, timeout=timedelta(minutes=10))
    # By the thread's CPU time: what the rank computes, not gloo's threads' waits.
    sizes = dataclasses.replace(SIZES["cpu", True], clock=time.thread_time)
    try:
        if job["measure"]:
            result = measure_fsdp(CPU, sizes).to_dict()
        elif job.get("whole"):
            result = {folder: _step_phases(folder, sizes) for folder in job["programs"]}
        else:
            result = {folder: _zero_phases(folder, sizes) for folder in job["programs"]}
        if rank == 0:
            Path(job["out"]).write_text(json.dumps(result))
        dist.barrier()
    finally:
        topology.leave()


def _zero_phases(folder: str, sizes: Sizes) -> tuple[float, float, float]:
    """(forward, backward, tail) thread CPU seconds of the program saved in ``folder``,
    each phase the slowest rank's median, as the runtime runs one microbatch."""
    from torch.distributed.fsdp import FSDPModule

    module = partc.load(folder, model(), loss_fn=loss_fn).build()
    stage = module.parts.stages[0].submod
    units = [m for m in stage.modules() if isinstance(m, FSDPModule)]
    zero = module.plan.zero_stage
    stage.set_requires_gradient_sync(True)
    stage.set_reshard_after_backward(zero >= 3)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    ids, target = batch()
    ids, target = ids[:module.plan.micro_batch_size], target[:module.plan.micro_batch_size]

    def forward() -> torch.Tensor:
        output = stage(ids)   # the stage's outputs: a tuple of the model's one
        return loss_fn(output[0] if isinstance(output, tuple) else output, target)

    def both() -> None:
        forward().backward()

    def tail() -> None:
        optimizer.step()
        if zero == 2:   # the stepped shards gathered again for the next forward
            for unit in units:
                unit.reshard()
            for unit in units:
                unit.unshard()

    timed = [slowest_rank_seconds(fn, CPU, sizes)
             for fn in (forward, both, tail)]
    return timed[0], timed[1] - timed[0], timed[2]


def _step_phases(folder: str, sizes: Sizes) -> tuple[float, float]:
    """(forward + backward, tail) thread CPU seconds of the program saved in ``folder``
    as the runtime runs a step, each the slowest rank's median."""
    module = partc.load(folder, model(), loss_fn=loss_fn).build()
    # As the plan holds its state: under ZeRO-1 (plan dp1) a plain AdamW is refused.
    optimizer = module.optimizer(torch.optim.AdamW, lr=1e-4)
    ids, target = batch()
    size = module.plan.global_batch_size
    ids, target = ids[:size], target[:size]

    # The step over the gradients the last step's backward left (zeroed, the step
    # would skip every parameter).
    def step() -> None:
        module.forward_backward(ids, target=target)

    work = slowest_rank_seconds(step, CPU, sizes)
    return work, slowest_rank_seconds(optimizer.step, CPU, sizes)


def steps_main(names: list[str], batches: list[int]) -> None:
    """Whole steps of the named plans against their predictions (free links)."""
    sizes = dataclasses.replace(SIZES["cpu", True], clock=time.thread_time)
    numbers = device_numbers(sizes) | FREE_LINKS
    fsdp = _spawn({"measure": True})
    numbers |= {name: fsdp[key] for name, key in FSDP_FIGURES.items()}
    ids, _ = batch()
    rows = []
    with tempfile.TemporaryDirectory(prefix="step-breakdown-plans-") as folder:
        for name in names:
            for b in batches:
                replicas = STEP_PLANS[name]["dp"]
                program = partc.compile(
                    model(), (ids[:b],), loss_fn=loss_fn,
                    budget=partc.DeviceBudget(num_devices=RANKS, device="CPU", **numbers),
                    train=partc.TrainSpec(global_batch_size=replicas * b),
                    constraints=partc.Constraints(pp=1, num_microbatches=1,
                                                  recompute="none", **STEP_PLANS[name]))
                time_s = program.plan.stages[0].time_s
                path = str(Path(folder) / f"{name}-b{b}")
                program.save(path)
                rows.append((f"{name} b{b}", path, time_s.forward + time_s.backward,
                             time_s.tail))
                print(f"{name} b{b}: sequence parallel {program.plan.sequence_parallel}, "
                      f"ZeRO {program.plan.zero_stage}")
        measured_phases = _spawn({"measure": False, "whole": True,
                                  "programs": [row[1] for row in rows]})
    print(f"{'plan':<12}{'phase':<10}{'measured':>10}{'predicted':>11}{'ratio':>7}")
    for name, path, work, tail in rows:
        for phase, seconds, predicted in zip(("fwd+bwd", "tail"), measured_phases[path],
                                             (work, tail)):
            print(f"{name:<12}{phase:<10}{seconds * 1e3:>8.1f}ms{predicted * 1e3:>9.1f}ms"
                  f"{predicted / seconds:>7.2f}")


def _spawn(job: dict) -> object:
    with tempfile.TemporaryDirectory(prefix="step-breakdown-") as folder:
        job = dict(job, out=str(Path(folder) / "out.json"))
        mp.spawn(_rank_worker, nprocs=RANKS, args=(str(Path(folder) / "store"), job))
        return json.loads(Path(job["out"]).read_text())


def zero_main(stages: list[int], batches: list[int]) -> None:
    """ZeRO-2/3's phases on dp=2 against the plan's, with and without FSDP's figures."""
    sizes = dataclasses.replace(SIZES["cpu", True], clock=time.thread_time)
    numbers = device_numbers(sizes) | FREE_LINKS
    fsdp = _spawn({"measure": True})
    with_fsdp = numbers | {name: fsdp[key] for name, key in FSDP_FIGURES.items()}
    # Before the figures: no FSDP work but the collectives (its copies free).
    without = numbers | {name: 1e18 if name.endswith("bandwidth") else 0.0
                         for name in FSDP_FIGURES}
    print("FSDP per unit and microbatch: " + ", ".join(
        f"{name} {fsdp[key] / 1e9:.2f}GB/s" if name.endswith("bandwidth") else
        f"{name} {fsdp[key] * 1e6:.0f}us" for name, key in FSDP_FIGURES.items()))
    ids, _ = batch()
    rows, plans = [], {}
    with tempfile.TemporaryDirectory(prefix="step-breakdown-plans-") as folder:
        for zero in stages:
            for b in batches:
                predicted_phases = []
                for label, figures in (("fsdp", with_fsdp), ("before", without)):
                    program = partc.compile(
                        model(), (ids[:b],), loss_fn=loss_fn,
                        budget=partc.DeviceBudget(num_devices=RANKS, device="CPU",
                                                  **figures),
                        train=partc.TrainSpec(global_batch_size=RANKS * b),
                        constraints=partc.Constraints(pp=1, dp=RANKS, tp=1, zero_stage=zero,
                                                      num_microbatches=1, recompute="none"))
                    time_s = program.plan.stages[0].time_s
                    predicted_phases.append((time_s.forward, time_s.backward, time_s.tail))
                    if label == "fsdp":
                        plans[(zero, b)] = str(Path(folder) / f"zero{zero}-b{b}")
                        program.save(plans[(zero, b)])
                rows.append((zero, b, predicted_phases))
        measured_phases = _spawn({"measure": False, "programs": list(plans.values())})
    _print_rows([(f"Z{zero} b{b}", measured_phases[plans[(zero, b)]], *predicted)
                 for zero, b, predicted in rows], ("FSDP figures", "without"))


def _print_rows(rows: list, labels: tuple[str, str]) -> None:
    print(f"{'plan':<8}{'phase':<10}{'measured':>10}{'predicted':>11}{'ratio':>7}"
          f"{labels[1]:>11}{'ratio':>7}")
    errors: dict[str, list[float]] = {label: [] for label in labels}
    for name, measured_phases, rated, before in rows:
        for phase, seconds, new, old in zip(("forward", "backward", "tail"),
                                            measured_phases, rated, before):
            errors[labels[0]].append(abs(new / seconds - 1))
            errors[labels[1]].append(abs(old / seconds - 1))
            print(f"{name:<8}{phase:<10}{seconds * 1e3:>8.1f}ms{new * 1e3:>9.1f}ms"
                  f"{new / seconds:>7.2f}{old * 1e3:>9.1f}ms{old / seconds:>7.2f}")
    for label, values in errors.items():
        print(f"median |predicted/measured - 1| {label}: {statistics.median(values):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--wall", action="store_true", help="time by wall clock")
    parser.add_argument("--zero", type=int, nargs="*", choices=(2, 3),
                        help="ZeRO-2/3 on two gloo ranks instead (by CPU time)")
    parser.add_argument("--steps", nargs="*", choices=tuple(STEP_PLANS),
                        help="whole steps of these plans on two gloo ranks (by CPU time)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.zero:
        zero_main(args.zero, args.batches)
        return
    if args.steps:
        steps_main(args.steps, args.batches)
        return
    clock = time.perf_counter if args.wall else time.thread_time
    sizes = dataclasses.replace(SIZES["cpu", True], clock=clock)
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
