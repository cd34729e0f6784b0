"""ZeRO-1's weight all-gather overlapped with the next forward against finishing it
inside ``optimizer.step()``: measured step times and what the plan predicts.

    python benchmarks/param_gather.py               # starts torchrun with 2 processes
    python benchmarks/param_gather.py --dp 4        # 4 processes
    torchrun --standalone --nproc-per-node=2 benchmarks/param_gather.py [--steps 12]

The same GPT (same weights, same batches) is planned twice at dp = ``--dp`` under ZeRO-1
with Adam, in bf16 by default (Megatron's distributed optimizer: bf16 weights gathered
from fp32 master shards), once with ``TrainSpec(overlap_param_gather=False)``. A step is
``forward_backward`` + ``optimizer.step()`` + ``zero_grad()``: the overlapped program's
all-gather moves from the step into the next forward, so only whole steps compare.
Programs alternate in blocks of ``--block`` steps, the order flipped every block, so that
drift in the machine's speed hits both alike; each block ends by finishing what is still
in flight (``module.wait_param_gathers()``), so that the other program's steps hide none
of it. Buckets hold ``--bucket-elements`` (``TrainSpec.bucket_elements``): the default 25M
would put the whole model in one bucket, which the first layer waits for.

Printed: the machine's load (``os.getloadavg``), each program's predicted and measured
median step (per block, over the block's steps), the overlapped/blocking ratios, every
block's step, and whether the losses agree bit for bit (they must: the same values arrive, only later).
On a CPU the ranks' compute and gloo's threads share the cores (the CPU preset's
``comm_overlap`` is 0, so the plan predicts no gain): a ratio near 1 is what this
machine allows, not what a GPU gets.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import partc  # noqa: E402
from benchmarks.torchrun_launch import run_under_torchrun  # noqa: E402
from benchmarks.tiny_gpt import model_and_batches  # noqa: E402
from samples.gpt import loss_fn  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2, help="processes to start (data parallel)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per program")
    parser.add_argument("--block", type=int, default=3, help="steps in a row per program")
    parser.add_argument("--warmup", type=int, default=1, help="untimed blocks")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--bucket-elements", type=int, default=1 << 20)
    return parser.parse_args()


def build(args, overlap: bool, ids: torch.Tensor, targets: torch.Tensor, model):
    program = partc.compile(
        model, (ids,), loss_fn=loss_fn, example_target=targets,
        budget=partc.DeviceBudget(num_devices=dist.get_world_size(), device="CPU"),
        train=partc.TrainSpec(global_batch_size=args.batch, optimizer="adam",
                              dtype=DTYPES[args.dtype], overlap_param_gather=overlap,
                              bucket_elements=args.bucket_elements),
        constraints=partc.Constraints(pp=1, tp=1, dp=dist.get_world_size(), zero_stage=1,
                                      recompute="none", num_microbatches=1))
    module = program.build()
    return program, module, module.optimizer(torch.optim.Adam, lr=1e-4)


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    model, batches = model_and_batches(args, heads=8)
    ids, targets = batches[0]
    programs = {name: build(args, name == "overlapped", ids, targets, model)
                for name in ("overlapped", "blocking")}
    times: dict[str, list[float]] = {name: [] for name in programs}
    losses: dict[str, list[float]] = {name: [] for name in programs}
    blocks = args.warmup + -(-args.steps // args.block)
    for block in range(blocks):
        order = list(programs) if block % 2 == 0 else list(reversed(programs))
        for name in order:
            _, module, opt = programs[name]
            first = len(losses[name])
            dist.barrier()
            started = time.perf_counter()
            for step in range(first, first + args.block):
                x, y = batches[step % len(batches)]
                losses[name].append(module.forward_backward(x, target=y).item())
                opt.step()
                opt.zero_grad()
            module.wait_param_gathers()
            elapsed = time.perf_counter() - started
            if block >= args.warmup:
                times[name].append(elapsed / args.block)
    if dist.get_rank() == 0:
        report(args, programs, times, losses)
    dist.barrier()
    dist.destroy_process_group()


def report(args, programs, times, losses) -> None:
    measured = {name: statistics.median(t) for name, t in times.items()}
    predicted = {name: program.plan.predicted.step_time_s
                 for name, (program, _, _) in programs.items()}
    buckets = len(programs["overlapped"][1].parts.buckets.buckets)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"GPT {args.layers} layers x {args.width} wide, seq {args.seq}, batch {args.batch}, "
          f"dp={dist.get_world_size()} ZeRO-1 {args.dtype} Adam, {buckets} buckets of "
          f"{args.bucket_elements} elements; median over blocks of {args.block} steps "
          f"(forward_backward + step + zero_grad), {len(times['overlapped'])} blocks each, "
          f"CPU preset; load average {load}")
    print(f"  {'':10s} {'predicted':>10s} {'measured':>10s}")
    for name in programs:
        print(f"  {name:10s} {predicted[name] * 1e3:8.1f} ms {measured[name] * 1e3:8.1f} ms")
    print(f"  overlapped / blocking: predicted "
          f"{predicted['overlapped'] / predicted['blocking']:.3f}, "
          f"measured {measured['overlapped'] / measured['blocking']:.3f}")
    for name, seen in times.items():   # the spread: the machine's noise
        print(f"  {name} per block: " + " ".join(f"{t * 1e3:.0f}" for t in seen) + " ms")
    print(f"  losses agree bit for bit: {losses['overlapped'] == losses['blocking']}")


if __name__ == "__main__":
    run_under_torchrun(main, nproc=arguments().dp, PARTC_WATCHDOG_S="600")
