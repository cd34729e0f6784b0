"""What the planner picks as memory per device tightens, for tests/planner/test_regimes.py's workload.

A 12-layer, 1024-wide GPT (50k vocabulary, 1024-token sequences, 204M parameters), bf16
AdamW, 2048 sequences per step, on 2 nodes of 8 H100s; only the memory per device
changes. Prints one markdown row per memory: the chosen mesh, ZeRO stage, schedule,
micro-batch size x microbatches, recompute, predicted step time and peak memory.

``--compare`` adds, per memory, the plan Megatron's rule of thumb would take — plain data
parallelism if it fits, else pp=1 and tp=1 with ZeRO, else pp=1 with tp inside a node,
else anything — solved with that mesh pinned, so the two step times can be compared.
``--frontiers`` prints the least memory with which each mesh fits at all (the need that
PlanInfeasibleError reports for the tightest split), the bounds of the regimes.

    python benchmarks/regimes.py [--memory 80,16,3.3,0.58,0.47] [--compare] [--frontiers]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import partc  # noqa: E402
from partc.compiler import plan_problem  # noqa: E402
from tests.planner.test_regimes import at_memory, regime_problem  # noqa: E402

MEMORIES = (80, 40, 20, 10, 5, 4, 3.3, 3, 2.5, 2, 1.5, 1.2, 1, 0.8, 0.7, 0.58, 0.5, 0.47)
# Megatron's order: each a mesh to try, pinned, before the next.
RULE_OF_THUMB = (("plain dp", dict(pp=1, tp=1, zero_stage=0)), ("ZeRO", dict(pp=1, tp=1)),
                 ("tp", dict(pp=1)), ("pp", {}))
FRONTIER_MESHES = (dict(pp=1, tp=1, zero_stage=0), dict(pp=1, tp=1, zero_stage=1),
                   dict(pp=1, tp=1, zero_stage=2), dict(pp=1, tp=1), dict(pp=1, tp=2),
                   dict(pp=1, tp=4), dict(pp=1), dict(pp=2, tp=2), dict(pp=2, tp=4), {})
HEADER = ("| memory/GPU | pp x dp x tp | ZeRO | schedule | b x m | recompute "
          "| step (predicted) | peak memory |\n|---|---|---|---|---|---|---|---|")


def recompute_summary(plan: partc.Plan) -> str:
    modes = list(plan.recompute.values())
    return ", ".join(f"{modes.count(mode)} {mode}" for mode in ("none", "selective", "full")
                     if mode in modes)


def row(memory: str, plan: partc.Plan, note: str = "") -> str:
    mesh = f"{plan.pp} x {plan.dp} x {plan.tp}"
    if plan.sequence_parallel:
        mesh += " (sp)"
    return (f"| {memory} | {mesh}{note} | {plan.zero_stage} | {plan.schedule} "
            f"| {plan.micro_batch_size} x {plan.num_microbatches} | {recompute_summary(plan)} "
            f"| {plan.predicted.step_time_s * 1e3:.0f} ms "
            f"| {plan.predicted.peak_memory_bytes / 2**30:.2f} GiB |")


def rule_of_thumb(gib: float) -> tuple[str, partc.Plan]:
    """The first of Megatron's meshes that fits, pinned."""
    for name, pins in RULE_OF_THUMB:
        try:
            return name, plan_problem(at_memory(gib, **pins))
        except partc.PlanInfeasibleError:
            continue
    raise partc.PlanInfeasibleError(f"nothing fits {gib} GiB")


def frontiers() -> None:
    print("| pinned | least memory/GPU it fits in |\n|---|---|")
    for pins in FRONTIER_MESHES:
        try:
            plan_problem(at_memory(0.05, **pins))
        except partc.PlanInfeasibleError as error:
            name = ", ".join(f"{k}={v}" for k, v in pins.items()) or "nothing"
            print(f"| {name} | {error.need_bytes / 2**30:.2f} GiB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", default=",".join(map(str, MEMORIES)),
                        help="GiB per device, comma-separated")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--frontiers", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    regime_problem()
    print(f"analysed and measured tensor parallelism in {time.perf_counter() - start:.1f} s\n")
    print(HEADER)
    for gib in (float(m) for m in args.memory.split(",")):
        try:
            plan = plan_problem(at_memory(gib))
        except partc.PlanInfeasibleError:
            print(f"| {gib:g} GiB | infeasible | | | | | | |")
            continue
        print(row(f"{gib:g} GiB", plan), flush=True)
        if args.compare:
            name, pinned = rule_of_thumb(gib)
            if (pinned.pp, pinned.dp, pinned.tp, pinned.zero_stage) != \
                    (plan.pp, plan.dp, plan.tp, plan.zero_stage):
                print(row(f"({name} pinned)", pinned), flush=True)
    if args.frontiers:
        print()
        frontiers()


if __name__ == "__main__":
    main()
