"""Compiled stages against eager ones: measured step times and what the plan predicts.

    python benchmarks/compiled.py             # starts torchrun with 2 processes
    torchrun --standalone --nproc-per-node=2 benchmarks/compiled.py [--steps 10]

The same GPT (same weights, same batches) is planned twice with the same pins (a
two-stage pipeline, or two data-parallel replicas with ``--dp``) and the built-in CPU
preset, once with ``TrainSpec(compile=True)``: inductor's CPU kernels. Steps alternate
between the two programs so that drift in the machine's speed hits both alike. Printed:
each program's predicted and measured median step, and the compiled/eager ratio
predicted (the fused element-wise bytes and kernels the cost model charges) against the
one measured; and whether both programs' losses agree (they should within 1e-5: the
same arithmetic, fused). The first compiled step (compiling) is not timed.
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
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--dp", action="store_true", help="two replicas instead of two stages")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    model, batches = model_and_batches(args, heads=4, dropout=args.dropout)
    ids, targets = batches[0]
    mesh = dict(pp=1, dp=2, zero_stage=0) if args.dp else dict(pp=2, dp=1, schedule="1f1b")
    programs = {}
    for compiled in (False, True):
        program = partc.compile(
            model, (ids,), loss_fn=loss_fn, example_target=targets,
            budget=partc.DeviceBudget(num_devices=2, device="CPU"),
            train=partc.TrainSpec(global_batch_size=args.batch, compile=compiled),
            constraints=partc.Constraints(recompute="none", num_microbatches=args.microbatches,
                                          **mesh))
        programs["compiled" if compiled else "eager"] = (program, program.build())
    times: dict[str, list[float]] = {name: [] for name in programs}
    losses: dict[str, list[float]] = {name: [] for name in programs}
    for step in range(args.warmup + args.steps):
        x, y = batches[step % len(batches)]
        order = list(programs) if step % 2 == 0 else list(reversed(programs))
        for name in order:
            module = programs[name][1]
            torch.manual_seed(step)   # the same dropout masks in both programs
            dist.barrier()
            started = time.perf_counter()
            loss = module.forward_backward(x, target=y)
            elapsed = time.perf_counter() - started
            module.zero_grad()
            if step >= args.warmup:
                times[name].append(elapsed)
                losses[name].append(loss.item())
    if dist.get_rank() == 0:
        report(args, programs, times, losses)
    dist.barrier()
    dist.destroy_process_group()


def report(args, programs, times, losses) -> None:
    measured = {name: statistics.median(t) for name, t in times.items()}
    predicted = {name: program.plan.predicted.step_time_s
                 for name, (program, _) in programs.items()}
    shape = "2 replicas" if args.dp else f"2 stages, 1f1b, {args.microbatches} microbatches"
    print(f"GPT {args.layers} layers x {args.width} wide, seq {args.seq}, batch {args.batch}, "
          f"dropout {args.dropout}, "
          f"{shape}; median of {args.steps} steps (forward + backward), CPU preset")
    print(f"  {'':9s} {'predicted':>10s} {'measured':>10s}")
    for name in programs:
        print(f"  {name:9s} {predicted[name] * 1e3:8.1f} ms {measured[name] * 1e3:8.1f} ms")
    print(f"  compiled / eager: predicted {predicted['compiled'] / predicted['eager']:.3f}, "
          f"measured {measured['compiled'] / measured['eager']:.3f}")
    same = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses["compiled"], losses["eager"]))
    print(f"  losses agree step by step (1e-5 relative): {same}")


if __name__ == "__main__":
    run_under_torchrun(main, PARTC_WATCHDOG_S="600", TORCHINDUCTOR_COMPILE_THREADS="1")
