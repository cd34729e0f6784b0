"""Planning time for a 32-layer Llama-3-8B config on the meta device: 8 and 64 devices.

Two runs, each printing the time of its phases and the plan's headline:

1. ``--devices`` (8): trace + plan, median of ``--repeats`` runs, tensor parallelism not
   measured (pp x dp only). The target for this 2-core machine is under 10 s.
2. ``--joint-devices`` (64; 0 skips it): what ``partc.compile`` does, phase by phase, on
   8 nodes of 8 devices (NVLink inside a node, one 400 Gb/s NIC per GPU between nodes):
   trace + analyse, measure the tensor-parallel options (tp 2, 4, 8 inside a node, with
   and without sequence parallelism), then the joint search over every (pp, dp, tp),
   micro-batch size, microbatch count, schedule and ZeRO stage. It runs once: the search
   stops at the planner's time limit (``--time-limit``), so repeats would time the limit.
   Each phase prints wall and CPU seconds: on a shared machine the CPU time is the cost
   of the code, but CP-SAT's time limit is wall-clock.

The joint run trains on 512 sequences of 8192 tokens (4.2M tokens per step): 8192 is
Llama 3's pre-training context, and about 4M tokens is the batch Llama 2 used at 7B and
the one Llama 3 405B began pre-training with. It leaves every dp up to 64 at least 8
sequences per replica, so a pipeline has microbatches to fill its bubble.

    python benchmarks/plan_time.py [--repeats 3] [--devices 8] [--device H100-80GB]
        [--joint-devices 64] [--joint-seq-len 8192] [--joint-global-batch 512]
        [--time-limit 30] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "samples"))

import partc  # noqa: E402
from partc.compiler import build_problem, plan_problem  # noqa: E402
from partc.costs import build_cost_table  # noqa: E402
from partc.passes.pipeline import analyze  # noqa: E402
from partc.planner import PlannerOptions, candidate_configs, lower_bound  # noqa: E402
from plan_llama import LLAMA3_8B, workload  # noqa: E402


def run_once(args) -> tuple[float, float, float, partc.Plan]:
    start = time.perf_counter()
    work = workload(LLAMA3_8B, args.seq_len, args.global_batch)
    built = time.perf_counter()
    _, analysis = analyze(work["model"], work["example_inputs"], loss_fn=work["loss_fn"],
                          example_target=work["example_target"], name="llama3-8b")
    traced = time.perf_counter()
    budget = partc.DeviceBudget(num_devices=args.devices, device=args.device)
    problem = build_problem(analysis, budget, work["train"], partc.Constraints())
    plan = plan_problem(problem, budget=budget.to_dict(work["train"].dtype),
                        train=work["train"].to_dict())
    planned = time.perf_counter()
    return built - start, traced - built, planned - traced, plan


def quick(args) -> None:
    runs = [run_once(args) for _ in range(args.repeats)]
    build, trace, plan_t = (statistics.median(r[i] for r in runs) for i in range(3))
    plan = runs[-1][3]
    print(f"Llama-3-8B (32 layers), seq {args.seq_len}, global batch {args.global_batch}, "
          f"{args.devices} x {args.device}; median of {args.repeats}")
    print(f"  build model on meta  {build:7.2f} s")
    print(f"  trace + analyse      {trace:7.2f} s")
    print(f"  plan (CP-SAT)        {plan_t:7.2f} s")
    print(f"  trace + plan         {trace + plan_t:7.2f} s   (target < 10 s)")
    print(f"  plan: pp={plan.mesh['pp']} dp={plan.mesh['dp']} {plan.schedule} "
          f"m={plan.num_microbatches} b={plan.micro_batch_size}, step "
          f"{plan.predicted['step_time_s']:.3f} s, MFU {100 * plan.predicted['mfu']:.1f}%, "
          f"solver {plan.solver.status} gap {100 * plan.solver.gap:.2f}%")


def unfit_configs(problem) -> int:
    """Configurations whose lower bound says nothing fits: the cost tables and bounds the
    planner builds before its first solve, rebuilt here to time them alone."""
    floors = [lower_bound(build_cost_table(problem, c)) for c in candidate_configs(problem)]
    return sum(f == math.inf for f in floors)


def timed(times: dict[str, tuple[float, float]], name: str, thunk):
    """Run ``thunk``, recording its wall and CPU seconds under ``name``."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = thunk()
    times[name] = (time.perf_counter() - wall, time.process_time() - cpu)
    return result


def joint(args) -> None:
    times: dict[str, tuple[float, float]] = {}
    work = timed(times, "build model on meta", lambda: workload(
        LLAMA3_8B, args.joint_seq_len, args.joint_global_batch))
    graph, analysis = timed(times, "trace + analyse", lambda: analyze(
        work["model"], work["example_inputs"], loss_fn=work["loss_fn"],
        example_target=work["example_target"], name="llama3-8b"))
    # 50 GB/s between nodes is one 400 Gb/s NIC per GPU: the preset's figure, spelled out.
    budget = partc.DeviceBudget(num_devices=args.joint_devices, device=args.device,
                                devices_per_node=8, inter_node_bandwidth="50GB/s")
    problem = timed(times, "tensor-parallel options", lambda: build_problem(
        analysis, budget, work["train"], partc.Constraints(), graph))
    aside: dict[str, tuple[float, float]] = {}
    unfit = timed(aside, "cost tables + bounds", lambda: unfit_configs(problem))

    def plan_phase() -> partc.Plan:
        return plan_problem(problem, budget=budget.to_dict(work["train"].dtype),
                            train=work["train"].to_dict(),
                            options=PlannerOptions(time_limit_s=args.time_limit))

    profile = cProfile.Profile() if args.profile else None
    plan = timed(times, "plan", (lambda: profile.runcall(plan_phase)) if profile else plan_phase)
    report_joint(args, problem, plan, times, aside["cost tables + bounds"], unfit)
    if profile:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(15)


def report_joint(args, problem, plan: partc.Plan, times: dict[str, tuple[float, float]],
                 tables: tuple[float, float], unfit: int) -> None:
    solver, nodes = plan.solver, args.joint_devices // 8
    print(f"Llama-3-8B (32 layers), seq {args.joint_seq_len}, global batch "
          f"{args.joint_global_batch}, {args.joint_devices} x {args.device} ({nodes} nodes "
          f"of 8); joint search, one run, planner time limit {args.time_limit:g} s")
    print(f"  {'phase':<26} {'wall':>7}   {'CPU':>7}")
    for name, (wall, cpu) in times.items():
        print(f"  {name:<26} {wall:7.2f} s {cpu:7.2f} s")
    print(f"  {'total':<26} {sum(w for w, _ in times.values()):7.2f} s "
          f"{sum(c for _, c in times.values()):7.2f} s")
    print(f"  tensor-parallel options measured: {len(problem.model.tensor_parallel)}")
    print(f"  plan phase: search {solver.solve_time_s:.2f} s, the rest baselines and "
          f"validation; the search's cost tables + lower bounds of every configuration, "
          f"timed apart: {tables[0]:.2f} s ({tables[1]:.2f} s CPU)")
    unreached = solver.configs_total - solver.configs_solved - solver.configs_pruned
    print(f"  configurations: {solver.configs_total} enumerated, {solver.configs_solved} "
          f"solved by CP-SAT, {solver.configs_pruned} pruned by the lower bound ({unfit} "
          f"of them cannot fit in memory), {unreached} not reached within the time limit")
    print(f"  solver: {solver.status}, gap {100 * solver.gap:.2f}% (step {solver.objective:.3f}"
          f" s, bound {solver.bound:.3f} s)")
    tp = plan.tensor_parallel
    tp_text = f"tp={plan.tp}" + (f" ({'sequence parallel, ' if tp['sequence_parallel'] else ''}"
                                 f"{tp['objective']} first)" if tp else "")
    print(f"  plan: {tp_text} pp={plan.pp} dp={plan.dp}, ZeRO-{plan.zero_stage}, "
          f"{plan.schedule}, b={plan.micro_batch_size} x m={plan.num_microbatches}, step "
          f"{plan.predicted['step_time_s']:.3f} s, MFU {100 * plan.predicted['mfu']:.1f}%, "
          f"{plan.predicted.get('tokens_per_s', 0) / 1e6:.2f}M tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--device", default="H100-80GB")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--joint-devices", type=int, default=64,
                        help="devices of the joint search, in nodes of 8; 0 skips it")
    parser.add_argument("--joint-seq-len", type=int, default=8192)
    parser.add_argument("--joint-global-batch", type=int, default=512)
    parser.add_argument("--time-limit", type=float, default=PlannerOptions().time_limit_s,
                        help="the joint search's planner time limit, seconds")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the joint search's planning phase")
    args = parser.parse_args()
    if args.joint_devices % 8:
        parser.error("--joint-devices must be a multiple of 8 (whole nodes)")
    quick(args)
    if args.joint_devices:
        joint(args)


if __name__ == "__main__":
    main()
