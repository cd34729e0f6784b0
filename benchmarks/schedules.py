"""Every pipeline schedule priced by the cost model's event simulation, side by side.

    python benchmarks/schedules.py                 # both parts
    python benchmarks/schedules.py --parts 405b plan-time

(Predicted against measured on CPU processes, the same model and sizes for both:
``benchmarks/plan_choice.py --set schedules``.)

- ``405b``: Llama-3-405B's shape (126 layers, hidden 16384, FFN 53248, 128/8 heads,
  vocab 128000, sequence 8192; built on the meta device) on 8,192 H100-80GB with
  tp=8, pp=16, dp=64 pinned and 2,048 sequences per step: each schedule pinned
  (predicted step time, bubble, peak memory), the schedule the planner picks with
  those pins, and with nothing pinned (``--work-limit`` for that search).
- ``plan-time``: planning Llama-3-70B on 1,024 H100 (as ``benchmarks/plan_time.py``) with
  the schedule pinned to 1F1B and with the schedule free, in one run: the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "samples"))
sys.path.insert(0, str(ROOT))

import partc  # noqa: E402
from plan_llama import LLAMA3_70B, LLAMA3_405B  # noqa: E402
from partc.compiler import autocast_dtype, build_problem, plan_problem  # noqa: E402
from partc.passes.pipeline import analyze  # noqa: E402
from partc.plan import BudgetInfo  # noqa: E402
from partc.planner import PlannerOptions  # noqa: E402
from partc.cost.schedules import SCHEDULE_TABLE  # noqa: E402
from partc.units import format_bytes, format_seconds  # noqa: E402



def virtual_stages(name: str, wanted: int = 2) -> int:
    allowed = SCHEDULE_TABLE[name].virtual_stages
    return allowed[0] if allowed else wanted


def table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))


def plan_rows(plans: dict[str, partc.Plan | str]) -> list[list[str]]:
    steps = [p.predicted.step_time_s for p in plans.values() if not isinstance(p, str)]
    fastest = min(steps) if steps else 1.0
    rows = []
    for name, plan in plans.items():
        if isinstance(plan, str):
            rows.append([name, "-", "-", "-", "-", "-", plan])
            continue
        p = plan.predicted
        rows.append([name, str(plan.chunks), format_seconds(p.step_time_s),
                     f"{p.step_time_s / fastest:.3f}x", f"{100 * p.bubble_fraction:.1f}%",
                     format_bytes(p.peak_memory_bytes),
                     f"closed form {format_seconds(p.closed_form_step_s)}"])
    return rows


HEADER = ["schedule", "v", "step", "vs fastest", "bubble", "peak memory", "note"]


def _problem(shape: dict, seq: int, batch: int, devices: int, constraints):
    from plan_llama import build_llama
    import plan_llama

    model = build_llama(shape)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    train = partc.TrainSpec(global_batch_size=batch, dtype=torch.bfloat16, optimizer="adamw")
    budget = partc.DeviceBudget(num_devices=devices, device="H100-80GB", devices_per_node=8,
                                inter_node_bandwidth="50GB/s")
    graph, analysis = analyze(model, (ids,), loss_fn=plan_llama.causal_lm_loss,
                              example_target=ids, name="llama",
                              autocast=autocast_dtype(train),
                              autocast_device=budget.device_type)
    recorded = BudgetInfo.from_dict(budget.to_dict(train.dtype))
    return graph, analysis, budget, train, recorded


def _plan(graph, analysis, budget, train, recorded, constraints, options):
    problem = build_problem(analysis, budget, train, constraints, graph)
    return plan_problem(problem, budget=recorded, train=train, options=options)


def part_405b(work_limit: float) -> None:
    start = time.perf_counter()
    graph, analysis, budget, train, recorded = _problem(LLAMA3_405B, 8192, 2048, 8192, None)
    print(f"\n== Llama-3-405B shape on 8,192 H100-80GB, 2,048 x 8,192-token sequences "
          f"(traced in {time.perf_counter() - start:.0f} s)")
    options = PlannerOptions(work_limit=work_limit)
    pins = dict(tp=8, pp=16, dp=64)
    plans: dict[str, partc.Plan | str] = {}
    for name in SCHEDULE_TABLE:
        v = virtual_stages(name)
        try:
            plans[name] = _plan(graph, analysis, budget, train, recorded,
                                partc.Constraints(**pins, schedule=name, virtual_stages=v),
                                options)
        except (partc.PlanInfeasibleError, ValueError) as error:
            plans[name] = f"refused: {str(error).splitlines()[0][:90]}"
    print("tp=8 pp=16 dp=64 pinned, each schedule pinned:")
    table(plan_rows(plans), HEADER)
    for label, constraints in (("tp=8 pp=16 dp=64 pinned", partc.Constraints(**pins)),
                               ("nothing pinned", partc.Constraints())):
        start = time.perf_counter()
        plan = _plan(graph, analysis, budget, train, recorded, constraints, options)
        p = plan.predicted
        print(f"planner's pick, {label}: {plan.schedule} v={plan.chunks}, pp={plan.pp} "
              f"dp={plan.dp} tp={plan.tp}, {plan.micro_batch_size} x "
              f"{plan.num_microbatches}, ZeRO {plan.zero_stage}: step "
              f"{format_seconds(p.step_time_s)}, bubble {100 * p.bubble_fraction:.1f}% "
              f"(planned in {time.perf_counter() - start:.1f} s)")
        for option in plan.schedules[:4]:
            if option.step_time_s is not None:
                print(f"    {option.schedule:<24} v={option.virtual_stages} "
                      f"{format_seconds(option.step_time_s):>10}  bubble "
                      f"{100 * (option.bubble_fraction or 0):.1f}%  ({option.how})")


def plan_time_part(work_limit: float) -> None:
    graph, analysis, budget, train, recorded = _problem(LLAMA3_70B, 4096, 1024, 1024, None)
    options = PlannerOptions(work_limit=work_limit)
    seconds = {}
    for label, constraints in (("schedule pinned to 1f1b", partc.Constraints(schedule="1f1b")),
                               ("schedule free", partc.Constraints())):
        start = time.perf_counter()
        plan = _plan(graph, analysis, budget, train, recorded, constraints, options)
        seconds[label] = time.perf_counter() - start
        print(f"Llama-3-70B on 1,024 H100, {label}: planned in {seconds[label]:.1f} s -> "
              f"{plan.schedule} v={plan.chunks}, step "
              f"{format_seconds(plan.predicted.step_time_s)}")
    pinned, free = seconds.values()
    print(f"plan time, schedule free / pinned 1f1b: {free / pinned:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["405b", "plan-time"],
                        choices=["405b", "plan-time"])
    parser.add_argument("--work-limit", type=float, default=2 * PlannerOptions().work_limit,
                        help="deterministic seconds of CP-SAT work (default twice the planner's)")
    args = parser.parse_args()
    if "405b" in args.parts:
        part_405b(args.work_limit)
    if "plan-time" in args.parts:
        plan_time_part(args.work_limit)


if __name__ == "__main__":
    main()
