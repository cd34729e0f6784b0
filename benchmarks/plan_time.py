"""Trace + plan time for a 32-layer Llama-3-8B config on the meta device, 8 devices.

Prints the time of each phase (median of --repeats runs) and the plan's headline. The
target for this 2-core machine is under 10 s for trace + plan.

    python benchmarks/plan_time.py [--repeats 3] [--devices 8] [--device H100-80GB]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "samples"))

import partc  # noqa: E402
from partc.compiler import build_problem, plan_problem  # noqa: E402
from partc.passes.pipeline import analyze  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--device", default="H100-80GB")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=64)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
