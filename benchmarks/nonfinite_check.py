"""Step time with and without the non-finite check (``TrainSpec.on_nonfinite``).

    python benchmarks/nonfinite_check.py            # starts torchrun with 2 processes
    torchrun --standalone --nproc-per-node=2 benchmarks/nonfinite_check.py [--steps 30]

Four programs train the same GPT (same weights, same batches, dp=2 under ZeRO-1, AdamW
through ``module.optimizer``) on the same processes in the same run: the check on
(``"raise"``, the default) and off (``"ignore"``), each without and with clipping
(``max_grad_norm=1.0``). Steps (forward, backward, gradient sync, the check, the
optimizer step) rotate between the programs so that drift in the machine's speed hits
all alike; the figures are median step times and their ratios, on over off. Without
clipping the check adds one pass over the rank's gradients (the squares' sum) to the
loss's all-reduce; with clipping it adds nothing the norm did not already need.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import partc  # noqa: E402
from benchmarks.tiny_gpt import model_and_batches  # noqa: E402
from benchmarks.torchrun_launch import run_under_torchrun  # noqa: E402
from samples.gpt import loss_fn  # noqa: E402

VARIANTS = {"check on": ("raise", None), "check off": ("ignore", None),
            "check on, clip": ("raise", 1.0), "check off, clip": ("ignore", 1.0)}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    return parser.parse_args()


def build(model: torch.nn.Module, batch: torch.Tensor, target: torch.Tensor, mode: str,
          clip: float | None, args: argparse.Namespace) -> tuple:
    program = partc.compile(
        copy.deepcopy(model), (batch,), loss_fn=loss_fn, example_target=target,
        budget=partc.DeviceBudget(num_devices=dist.get_world_size(), device="CPU"),
        train=partc.TrainSpec(global_batch_size=args.batch, on_nonfinite=mode,
                              max_grad_norm=clip),
        constraints=partc.Constraints(pp=1, dp=dist.get_world_size(), zero_stage=1,
                                      num_microbatches=2, recompute="none"))
    module = program.build()
    return module, module.optimizer(torch.optim.AdamW, lr=1e-4)


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    model, batches = model_and_batches(args, heads=4)
    programs = {name: build(model, *batches[0], mode, clip, args)
                for name, (mode, clip) in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in programs}
    for step in range(args.steps + 2):   # the first two learn shapes and allocate state
        x, y = batches[step % len(batches)]
        for name, (module, opt) in programs.items():
            dist.barrier()
            start = time.perf_counter()
            module.forward_backward(x, target=y)
            opt.step()
            opt.zero_grad()
            dist.barrier()
            if step >= 2:
                times[name].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        medians = {name: statistics.median(t) for name, t in times.items()}
        print(f"GPT {args.layers} layers x {args.width} wide, batch {args.batch} x "
              f"{args.seq} tokens, dp={dist.get_world_size()} ZeRO-1, AdamW; median of "
              f"{args.steps} steps (forward + backward + check + optimizer step)")
        for name, median in medians.items():
            print(f"  {name:16s} {median * 1e3:8.2f} ms")
        print(f"  ratio on / off, no clipping:   "
              f"{medians['check on'] / medians['check off']:.3f}")
        print(f"  ratio on / off, with clipping: "
              f"{medians['check on, clip'] / medians['check off, clip']:.3f}")
    for module, _ in programs.values():
        module.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_under_torchrun(main)
