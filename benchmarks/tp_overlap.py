"""Sequence-parallel collectives as rings beside the matmuls against blocking ones:
measured step times and what the plan predicts.

    python benchmarks/tp_overlap.py             # starts torchrun with 2 processes
    torchrun --standalone --nproc-per-node=2 benchmarks/tp_overlap.py [--steps 10]

The same GPT (same weights, same batches) is planned twice at tp = 2 with sequence
parallelism and the built-in CPU preset, once with ``TrainSpec(tp_overlap=False)``: the
all-gathers before the column-parallel linears and the reduce-scatters after the
row-parallel ones run blocking instead of as rings (:mod:`partc.runtime.tp_rings`).
Steps alternate between the two programs, the order flipped every step, so that drift
in the machine's speed hits both alike. Printed: each program's predicted and measured
median step, the ring/blocking ratios, and whether both programs' losses agree (they
should within 1e-5: the same sums in another order). On a CPU the ranks' compute and
gloo's threads share the cores (the CPU preset's ``comm_overlap`` is 0, so the plan
predicts no gain): a ratio near 1 is what this machine allows, not what a GPU gets.
"""

from __future__ import annotations

import argparse
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


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per program")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=2)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    model, batches = model_and_batches(args, heads=8)
    ids, targets = batches[0]
    programs = {}
    for rings in (True, False):
        program = partc.compile(
            model, (ids,), loss_fn=loss_fn, example_target=targets,
            budget=partc.DeviceBudget(num_devices=2, device="CPU"),
            train=partc.TrainSpec(global_batch_size=args.batch, optimizer="sgd",
                                  tp_overlap=rings),
            constraints=partc.Constraints(pp=1, tp=2, sequence_parallel=True,
                                          tp_objective="memory", recompute="none",
                                          num_microbatches=args.microbatches))
        programs["rings" if rings else "blocking"] = (program, program.build())
    times: dict[str, list[float]] = {name: [] for name in programs}
    losses: dict[str, list[float]] = {name: [] for name in programs}
    for step in range(args.warmup + args.steps):
        x, y = batches[step % len(batches)]
        order = list(programs) if step % 2 == 0 else list(reversed(programs))
        for name in order:
            module = programs[name][1]
            dist.barrier()
            started = time.perf_counter()
            loss = module.forward_backward(x, target=y)
            elapsed = time.perf_counter() - started
            module.zero_grad()
            if step >= args.warmup:
                times[name].append(elapsed)
                losses[name].append(loss.item())
    ring_steps = programs["rings"][1].tp.ring_steps
    if dist.get_rank() == 0:
        report(args, programs, times, losses, ring_steps)
    dist.barrier()
    dist.destroy_process_group()


def report(args, programs, times, losses, ring_steps: int) -> None:
    measured = {name: statistics.median(t) for name, t in times.items()}
    predicted = {name: program.plan.predicted.step_time_s
                 for name, (program, _) in programs.items()}
    print(f"GPT {args.layers} layers x {args.width} wide, seq {args.seq}, batch {args.batch}, "
          f"tp=2 with sequence parallelism, {args.microbatches} microbatches; median of "
          f"{args.steps} steps (forward + backward), CPU preset; {ring_steps} ring steps run")
    print(f"  {'':9s} {'predicted':>10s} {'measured':>10s}")
    for name in programs:
        print(f"  {name:9s} {predicted[name] * 1e3:8.1f} ms {measured[name] * 1e3:8.1f} ms")
    print(f"  rings / blocking: predicted {predicted['rings'] / predicted['blocking']:.3f}, "
          f"measured {measured['rings'] / measured['blocking']:.3f}")
    same = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses["rings"], losses["blocking"]))
    print(f"  losses agree step by step (1e-5 relative): {same}")


if __name__ == "__main__":
    run_under_torchrun(main, PARTC_WATCHDOG_S="600")
