"""Predicted step time with and without FP8 linears (TrainSpec.fp8) on Llama 3 shapes.

    python benchmarks/fp8_step_time.py [--workloads 8b 70b 405b] [--recipe tensorwise]

Each workload is planned three ways, on the meta device (no weights): bf16 as the
planner chooses, bf16 + ``fp8=True`` as the planner chooses (FP8 is priced per linear
and the planner may keep tensor parallelism, under which no linear runs FP8), and
bf16 + ``fp8=True`` with ``tp=1`` pinned beside bf16 with ``tp=1`` (the mesh FP8 can run
on). It prints the predicted step time, the mesh, how many linears run FP8 and the
speedup. The shapes and batches:

- ``8b``: Llama-3-8B on 8 H100, 8 x 8,192-token sequences (torchtitan's Llama 3.1 8B
  run: local batch 1, sequence 8,192);
- ``70b``: Llama-3-70B on 64 H100, 64 x 8,192 tokens;
- ``405b``: Llama-3-405B on 8,192 H100, 2,048 x 8,192 tokens (the Llama 3 paper's).

Planning 405B takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "samples"))

import torch  # noqa: E402

import partc  # noqa: E402
from plan_llama import LLAMA3_8B, build_llama, causal_lm_loss  # noqa: E402
from schedules import LLAMA3_405B, LLAMA3_70B  # noqa: E402

WORKLOADS = {"8b": (LLAMA3_8B, 8, 8), "70b": (LLAMA3_70B, 64, 64),
             "405b": (LLAMA3_405B, 8192, 2048)}
SEQ = 8192


def plan(shape: dict, devices: int, batch: int, fp8: bool, recipe: str,
         constraints: partc.Constraints, cache: partc.PlanCache) -> partc.Plan:
    model = build_llama(shape)
    ids = torch.zeros(batch, SEQ, dtype=torch.long, device="meta")
    train = partc.TrainSpec(global_batch_size=batch, dtype=torch.bfloat16,
                            optimizer="adamw", fp8=fp8, fp8_recipe=recipe)
    budget = partc.DeviceBudget(num_devices=devices, device="H100-80GB")
    return partc.compile(model, (ids,), loss_fn=causal_lm_loss, example_target=ids,
                         budget=budget, train=train, constraints=constraints,
                         cache=cache).plan


def row(name: str, result: partc.Plan, base: float, seconds: float) -> str:
    mesh = result.mesh
    linears = len(result.fp8.linears) if result.fp8 is not None else 0
    step = result.predicted.step_time_s
    return (f"{name:<22} {step:9.3f} s  {base / step:6.3f}x  pp={mesh.pp} dp={mesh.dp} "
            f"tp={mesh.tp} mb={result.micro_batch_size} {result.schedule} "
            f"ZeRO-{result.zero_stage}  fp8 linears {linears}  (planned in {seconds:.0f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS),
                        choices=list(WORKLOADS))
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    args = parser.parse_args()
    for name in args.workloads:
        shape, devices, batch = WORKLOADS[name]
        print(f"\n== Llama-3-{name.upper()} on {devices} H100-80GB, {batch} x {SEQ} tokens, "
              f"bf16, AdamW; FP8 recipe {args.recipe}")
        runs = {"bf16": (False, partc.Constraints()),
                "bf16 + fp8": (True, partc.Constraints()),
                "bf16, tp=1": (False, partc.Constraints(tp=1)),
                "bf16 + fp8, tp=1": (True, partc.Constraints(tp=1))}
        base, cache = None, partc.PlanCache()   # the model measured once, planned four ways
        for label, (fp8, constraints) in runs.items():
            started = time.perf_counter()
            try:
                result = plan(shape, devices, batch, fp8, args.recipe, constraints, cache)
            except partc.PlanInfeasibleError as error:
                print(f"{label:<22} no plan: {str(error).splitlines()[0]}")
                continue
            base = base or result.predicted.step_time_s
            print(row(label, result, base, time.perf_counter() - started), flush=True)


if __name__ == "__main__":
    main()
