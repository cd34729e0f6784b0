"""The memory a plan fills against what a device has: planned peak, usable, reported and
nominal memory, planning against the whole nominal memory (as partc did before it kept
the CUDA context, NCCL's buffers and fragmentation back) and against what is usable.

    python benchmarks/memory_headroom.py [--workload llama3-70b] [--devices 1024]

Llama-3-70B on 1,024 H100-80GB (the shape of ``benchmarks/plan_time.py``: sequence 4096,
1024 sequences per step, bf16 AdamW) is planned twice with one analysis (a plan cache):
first with ``DeviceBudget(memory="80GiB")`` and no reserves (the old preset), then with
the preset as it is (79.19 GiB as CUDA reports it, less the reserves of
``partc.device.presets``). Each line: the mesh, schedule and ZeRO stage, the step, and
``partc.report.text.plan_headroom``'s figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "samples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import partc  # noqa: E402
from partc.report.text import plan_headroom  # noqa: E402
from partc.units import format_bytes  # noqa: E402
from plan_time import WORKLOADS  # noqa: E402

WHOLE = dict(memory="80GiB", context_memory=0, communicator_memory=0, memory_fragmentation=0)


def describe(label: str, plan: partc.Plan, seconds: float) -> str:
    room = plan_headroom(plan)
    nominal = format_bytes(room.nominal) if room.nominal else "-"
    return (f"{label:<34} {str(plan.mesh):<22} {plan.schedule:<24} ZeRO-{plan.zero_stage} "
            f"b={plan.micro_batch_size} step {plan.predicted.step_time_s:6.2f} s | peak "
            f"{format_bytes(room.peak)} of usable {format_bytes(room.usable)} "
            f"({100 * room.peak / room.usable:.1f}%), reported {format_bytes(room.reported)}, "
            f"nominal {nominal} | planned in {seconds:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="llama3-70b", choices=sorted(WORKLOADS))
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    work = workload.build()
    cache = partc.PlanCache()
    for label, given in (("whole 80 GiB, no reserve (before)", WHOLE),
                         ("preset: usable memory (after)", {})):
        budget = partc.DeviceBudget(num_devices=workload.devices, device=workload.device,
                                    devices_per_node=8,
                                    inter_node_bandwidth=workload.inter_node, **given)
        start = time.perf_counter()
        program = partc.compile(work["model"], work["example_inputs"], budget=budget,
                                train=work["train"], loss_fn=work["loss_fn"],
                                example_target=work["example_target"], name=work["name"],
                                cache=cache)
        print(describe(label, program.plan, time.perf_counter() - start), flush=True)


if __name__ == "__main__":
    main()
