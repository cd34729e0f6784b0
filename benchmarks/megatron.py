"""partc's cost model and planner against Megatron-LM's published runs (SC'21, Table 1).

For each GPT from 1.7B to 1T on DGX A100-80GB nodes (the model, budget and published
configuration are built in ``tests/validation/megatron.py``):

1. fits the A100's matmul efficiency (``DeviceBudget(flops_efficiency=...)``) on one
   row (``--fit``, default 18.4B) so that partc's predicted throughput of the published
   configuration equals the published one;
2. predicts every row's published configuration at that efficiency, in teraFLOP/s per
   GPU counted with the paper's eq. 3 (as the paper counts), and the ratio to the
   published figure (target: within 15% on every row not fitted);
3. plans each row with nothing pinned (partc's own plan on the same budget) and counts
   its throughput with the same eq. 3 FLOPs, so the two compare;
4. breaks each published configuration's predicted step down by cause (compute at the
   fitted efficiency, memory-bound ops, tensor-parallel collectives' bytes and latency,
   pipeline sends, bubble, dp all-reduce, optimizer step, tied-embedding sync), in % of
   the step;
5. for the interleaved runs, plans with the published pins (partc cannot pin the
   chunks per rank nor the runs of layers of an interleaved schedule, so the planner
   chooses them) and compares with Megatron's own split, priced directly.

Each row prints as soon as it is done, with the seconds it took to trace, measure
tensor parallelism and plan. The big rows trace 100+ layer GPTs on the meta device and
plan thousands of devices: expect minutes in all on a small machine.

    python benchmarks/megatron.py [--rows 1.7B,18.4B] [--fit 18.4B] [--no-own-plan]
        [--work-limit 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import partc  # noqa: E402
from tests.validation import megatron  # noqa: E402
from tests.validation.megatron import Run  # noqa: E402

GIB = 2**30
TARGET = 0.15


def measured(run: Run, efficiency: float | None, own_plan: bool):
    """(pinned problem, own problem or None, seconds to trace, seconds to measure)."""
    start = time.perf_counter()
    graph, analysis = megatron.analyse(run)
    traced = time.perf_counter()
    if own_plan:   # measure every tensor-parallel variant once; the pins pick theirs
        own = megatron.problem(run, analysis, graph, partc.Constraints(), efficiency)
        pinned = megatron.problem(run, own.model, None, megatron.published(run), efficiency)
    else:
        own = None
        pinned = megatron.problem(run, analysis, graph, megatron.published(run), efficiency)
    return pinned, own, traced - start, time.perf_counter() - traced


def fit(run: Run) -> float:
    start = time.perf_counter()
    pinned, _, _, _ = measured(run, None, own_plan=False)
    efficiency = megatron.fit_efficiency(run, pinned,
                                         megatron.published_assignment(run, pinned))
    print(f"fitted on {run.name}: flops_efficiency = {efficiency:.4f} "
          f"({efficiency * 312:.1f} of 312 TFLOP/s fp16; {time.perf_counter() - start:.1f} s)")
    return efficiency


def describe(plan: partc.Plan) -> str:
    """Mesh, microbatches, schedule, ZeRO and recompute of a plan, in one cell."""
    sp = "+sp" if plan.sequence_parallel else ""
    blocks = Counter(mode for name, mode in plan.recompute.items()
                     if name.startswith("blocks."))
    recompute = ",".join(f"{mode} {count}" if len(blocks) > 1 else mode
                         for mode, count in sorted(blocks.items()))
    return (f"pp{plan.pp} dp{plan.dp} tp{plan.tp}{sp}, {plan.micro_batch_size}x"
            f"{plan.num_microbatches}, {plan.schedule}, ZeRO-{plan.zero_stage}, {recompute}")


HEADER = ("| model | tp | pp | dp | GPUs | batch | b | published | predicted | ratio "
          "| peak GiB | partc's plan | its TFLOP/s | its peak GiB | seconds: trace, measure, "
          "plan |\n|" + "---|" * 15)
TERMS = ("compute", "memory", "tp", "tp_latency", "p2p", "grads", "bubble", "dp_sync",
         "optimizer", "tied")


def row_line(run: Run, predicted: float, peak: int, own: partc.Plan | None,
             seconds: tuple[float, ...], fitted: bool) -> str:
    ratio = predicted / run.tflops_per_gpu
    mark = " (fit)" if fitted else ("" if abs(ratio - 1) <= TARGET else " MISS")
    own_cells = "| (not planned) | | "
    if own is not None:
        own_tflops = megatron.tflops_per_gpu(run, own.predicted.step_time_s)
        own_cells = (f"| {describe(own)} | {own_tflops:.1f} "
                     f"| {own.predicted.peak_memory_bytes / GIB:.1f} ")
    times = ", ".join(f"{s:.1f}" for s in seconds)
    return (f"| {run.name} | {run.tp} | {run.pp} | {run.dp} | {run.gpus} | {run.batch} "
            f"| {run.micro_batch_size} | {run.tflops_per_gpu:g} | {predicted:.1f} "
            f"| {ratio:.3f}{mark} | {peak / GIB:.1f} {own_cells}| {times} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(r.name for r in megatron.RUNS),
                        help="comma-separated model names (default: all ten)")
    parser.add_argument("--fit", default=megatron.FIT_RUN.name)
    parser.add_argument("--no-own-plan", action="store_true",
                        help="only predict the published configurations")
    parser.add_argument("--work-limit", type=float, default=2 * partc.PlannerOptions().work_limit,
                        help="the planner's work limit per row, deterministic seconds of "
                             "CP-SAT work (default twice the planner's)")
    args = parser.parse_args()
    fit_run = megatron.run_named(args.fit)
    efficiency = fit(fit_run)
    print(f"schedule of the interleaved runs: {megatron.SCHEDULE}\n")
    print(HEADER, flush=True)
    breakdowns, interleaved = [], []
    for run in (megatron.run_named(name) for name in args.rows.split(",")):
        pinned, own_problem, trace_s, measure_s = measured(run, efficiency,
                                                            not args.no_own_plan)
        assignment = megatron.published_assignment(run, pinned)
        evaluation = megatron.price(pinned, assignment)
        predicted = megatron.tflops_per_gpu(run, megatron.step_seconds(evaluation))
        own, plan_s = None, 0.0
        if own_problem is not None:
            start = time.perf_counter()
            own = megatron.plan(own_problem, partc.PlannerOptions(work_limit=args.work_limit))
            plan_s = time.perf_counter() - start
        print(row_line(run, predicted, megatron.peak_bytes(evaluation), own,
                       (trace_s, measure_s, plan_s), run is fit_run), flush=True)
        breakdowns.append((run, megatron.breakdown(pinned, assignment)))
        if megatron.schedule(run) == megatron.INTERLEAVED:
            interleaved.append((run, pinned, evaluation))
    print("\nPredicted step of each published configuration, % of the step by cause:\n")
    print("| model | step s | " + " | ".join(TERMS) + " |\n|" + "---|" * (len(TERMS) + 2))
    for run, parts in breakdowns:
        cells = " | ".join(f"{100 * parts.terms[t] / parts.step:.1f}" for t in TERMS)
        print(f"| {run.name} | {parts.step:.2f} | {cells} |")
    if interleaved:
        print("\nInterleaved runs planned with the published pins (chunks and runs of "
              "layers left to the planner):\n")
        print(pinned_header())
        for run, pinned, evaluation in interleaved:
            print(pinned_line(run, pinned, evaluation, args.work_limit), flush=True)


def pinned_header() -> str:
    return ("| model | Megatron's split: chunks, step s | planner: chunks, layers per run "
            "on rank 0, step s | planner / Megatron | solver | seconds |\n|" + "---|" * 6)


def pinned_line(run: Run, pinned, evaluation, work_limit: float) -> str:
    start = time.perf_counter()
    plan = megatron.plan(pinned, partc.PlannerOptions(work_limit=work_limit))
    seconds = time.perf_counter() - start
    runs = plan.stages[0].runs or (plan.stages[0].layers,)
    step = megatron.step_seconds(evaluation)
    return (f"| {run.name} | {run.virtual_stages}, {step:.2f} | {len(runs)}, "
            f"{[len(r) for r in runs]}, {plan.predicted.step_time_s:.2f} "
            f"| {plan.predicted.step_time_s / step:.3f} | {plan.solver.status} "
            f"| {seconds:.1f} |")


if __name__ == "__main__":
    main()
