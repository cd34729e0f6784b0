"""Context parallelism in the planner: how long a sequence partc plans, at what host cost,
and Llama 3 405B's long-context mesh against the published one.

    python benchmarks/context_parallel_plans.py --parts longest --model 8b
    python benchmarks/context_parallel_plans.py --parts 405b

Run under a memory limit (``prlimit --as=...``): every model is built on the meta device.

- ``longest``: Llama-3-8B on 8 H100-80GB (or ``--model 70b``: Llama-3-70B on 64), bf16,
  ``attention="fused"`` (causal flash attention), one sequence per device per step:
  each sequence length of ``--seqs`` planned with cp pinned to 1 and with cp left to the
  planner; per length, the plan (mesh, predicted step, peak memory) or why there is
  none, the planning time and the planner's peak host memory (the process's maximum
  resident set so far, ``ru_maxrss``: it only grows, so the figure of a length is that
  of the longest planned up to it).
- ``405b``: Llama-3-405B's shape at 131,072 tokens on 16,384 H100-80GB, 128 sequences a
  step (the Llama 3 paper's long-context stage, Table 4: TP 8, CP 16, PP 16, DP 8, 380
  TFLOPs per GPU): cp pinned to 1; the published mesh pinned; partc's own plan. TFLOPs
  per GPU are the model's FLOPs per step (forward and backward, recompute not counted,
  attention as measured: the fused causal kernel's (seq x seq) products counted half,
  as it skips the masked blocks) over the predicted step and the GPUs.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "samples"))
sys.path.insert(0, str(ROOT))

import partc  # noqa: E402
from plan_llama import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B  # noqa: E402
from partc.compiler import autocast_dtype, build_problem, plan_problem  # noqa: E402
from partc.passes.pipeline import analyze  # noqa: E402
from partc.plan import BudgetInfo  # noqa: E402
from partc.planner import PlannerOptions  # noqa: E402
from partc.units import format_bytes, format_seconds  # noqa: E402

PUBLISHED_TFLOPS = 380.0   # Llama 3 paper, Table 4, the 131,072-token stage


def max_rss() -> str:
    return format_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _analysis(shape: dict, seq: int, devices: int, batch: int):
    from plan_llama import build_llama, causal_lm_loss

    model = build_llama({**shape, "max_position_embeddings": seq})
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    train = partc.TrainSpec(global_batch_size=batch, dtype=torch.bfloat16, optimizer="adamw",
                            attention="fused")
    budget = partc.DeviceBudget(num_devices=devices, device="H100-80GB", devices_per_node=8)
    graph, analysis = analyze(model, (ids,), loss_fn=causal_lm_loss, example_target=ids,
                              name="llama", attention="fused",
                              autocast=autocast_dtype(train),
                              autocast_device=budget.device_type)
    return graph, analysis, budget, train


def _plan(graph, analysis, budget, train, constraints, options) -> partc.Plan | str:
    try:
        problem = build_problem(analysis, budget, train, constraints, graph)
        return plan_problem(problem, budget=BudgetInfo.from_dict(budget.to_dict(train.dtype)),
                            train=train, options=options)
    except (partc.PlanInfeasibleError, ValueError) as error:
        return "no plan: " + " ".join(str(error).split())[:420]


def _describe(plan: partc.Plan | str) -> str:
    if isinstance(plan, str):
        return plan
    p = plan.predicted
    return (f"{plan.mesh}, ZeRO-{plan.zero_stage}, {plan.schedule} "
            f"{plan.micro_batch_size} x {plan.num_microbatches}, recompute "
            f"{'/'.join(sorted({str(mode) for mode in plan.recompute.values()}))}: step {format_seconds(p.step_time_s)}, "
            f"peak {format_bytes(p.peak_memory_bytes)}, MFU {100 * p.mfu:.1f}%")


def part_longest(model: str, seqs: list[int], work_limit: float) -> None:
    shape, devices = (LLAMA3_8B, 8) if model == "8b" else (LLAMA3_70B, 64)
    print(f"== Llama-3-{model.upper()} on {devices} H100-80GB, bf16, fused attention, "
          f"{devices} sequences a step")
    options = PlannerOptions(work_limit=work_limit)
    longest = {"cp=1": None, "cp free": None}
    for seq in seqs:
        start, cpu = time.perf_counter(), time.process_time()
        graph, analysis, budget, train = _analysis(shape, seq, devices, devices)
        traced = time.perf_counter() - start
        print(f"{seq:>9,} tokens: traced and measured in {traced:.1f} s "
              f"({time.process_time() - cpu:.1f} s of CPU), host peak {max_rss()}")
        for label, constraints in (("cp=1", partc.Constraints(cp=1)),
                                   ("cp free", partc.Constraints())):
            start, cpu = time.perf_counter(), time.process_time()
            plan = _plan(graph, analysis, budget, train, constraints, options)
            print(f"    {label:<8} planned in {time.perf_counter() - start:5.1f} s "
                  f"({time.process_time() - cpu:.1f} s of CPU, host peak {max_rss()}): "
                  f"{_describe(plan)}")
            if not isinstance(plan, str):
                longest[label] = seq
        del graph, analysis
    for label, seq in longest.items():
        print(f"longest planned, {label}: {seq if seq is None else f'{seq:,}'} tokens "
              f"(of those tried: {', '.join(f'{s:,}' for s in seqs)})")


def _tflops(plan: partc.Plan) -> float:
    return plan.predicted.mfu * plan.budget.figures.peak_flops / 1e12


def part_405b(work_limit: float, seq: int = 131072, devices: int = 16384,
              batch: int = 128) -> None:
    start = time.perf_counter()
    graph, analysis, budget, train = _analysis(LLAMA3_405B, seq, devices, batch)
    print(f"== Llama-3-405B shape at {seq:,} tokens on {devices:,} H100-80GB, {batch} "
          f"sequences a step (traced and measured in {time.perf_counter() - start:.0f} s, "
          f"host peak {max_rss()})")
    options = PlannerOptions(work_limit=work_limit)
    for label, constraints in (
            ("cp pinned to 1", partc.Constraints(cp=1)),
            ("published mesh pinned (tp 8, cp 16, pp 16, dp 8)",
             partc.Constraints(tp=8, cp=16, pp=16, dp=8)),
            ("partc's own plan", partc.Constraints())):
        start = time.perf_counter()
        plan = _plan(graph, analysis, budget, train, constraints, options)
        tflops = "" if isinstance(plan, str) else (
            f"; {_tflops(plan):.0f} TFLOPs per GPU predicted (published: "
            f"{PUBLISHED_TFLOPS:.0f})")
        print(f"{label}, planned in {time.perf_counter() - start:.1f} s: "
              f"{_describe(plan)}{tflops}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["longest", "405b"],
                        choices=["longest", "405b"])
    parser.add_argument("--model", choices=["8b", "70b"], default="8b")
    parser.add_argument("--seqs", type=int, nargs="+",
                        default=[32768, 65536, 131072, 262144])
    parser.add_argument("--work-limit", type=float, default=PlannerOptions().work_limit)
    args = parser.parse_args()
    if "longest" in args.parts:
        part_longest(args.model, args.seqs, args.work_limit)
    if "405b" in args.parts:
        part_405b(args.work_limit)


if __name__ == "__main__":
    main()
