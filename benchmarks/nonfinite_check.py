"""Step time with and without the step's checks: the non-finite check
(``TrainSpec.on_nonfinite``) and the batch digest (``TrainSpec.batch_check_every``).

    python benchmarks/nonfinite_check.py            # starts torchrun with 2 processes
    torchrun --standalone --nproc-per-node=2 benchmarks/nonfinite_check.py [--steps 30]

Six programs train the same GPT (same weights, same batches, dp=2 under ZeRO-1, AdamW
through ``module.optimizer``) on the same processes in the same run: both checks off,
each alone, both on (the default), and without and with clipping (``max_grad_norm=1.0``)
both off and both on. Steps (forward, backward, gradient sync, the checks, the optimizer
step) rotate between the programs so that drift in the machine's speed hits all alike;
the figures are median step times and their ratios over both off. Without clipping the
non-finite check adds one pass over the rank's gradients (the squares' sum) to the
loss's all-reduce; with clipping it adds nothing the norm did not already need. The
batch digest adds hashing this rank's rows of the global batch (and one row per
replica) and four floats per rank to the same all-reduce; the hash's rate, timed alone
on this machine, is printed too, to price it against another machine's step.
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
from partc.runtime.batch_digest import digest  # noqa: E402
from benchmarks.tiny_gpt import model_and_batches  # noqa: E402
from benchmarks.torchrun_launch import run_under_torchrun  # noqa: E402
from samples.gpt import loss_fn  # noqa: E402

# name: (on_nonfinite, max_grad_norm, batch_check_every)
VARIANTS = {"both off": ("ignore", None, 0), "non-finite check": ("raise", None, 0),
            "batch digest": ("ignore", None, 1), "both on": ("raise", None, 1),
            "both off, clip": ("ignore", 1.0, 0), "both on, clip": ("raise", 1.0, 1)}
RATIOS = {"non-finite check / both off": ("non-finite check", "both off"),
          "batch digest / both off": ("batch digest", "both off"),
          "both on / both off": ("both on", "both off"),
          "both on / both off, with clipping": ("both on, clip", "both off, clip")}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    return parser.parse_args()


def build(model: torch.nn.Module, batch: torch.Tensor, target: torch.Tensor, mode: str,
          clip: float | None, every: int, args: argparse.Namespace) -> tuple:
    program = partc.compile(
        copy.deepcopy(model), (batch,), loss_fn=loss_fn, example_target=target,
        budget=partc.DeviceBudget(num_devices=dist.get_world_size(), device="CPU"),
        train=partc.TrainSpec(global_batch_size=args.batch, on_nonfinite=mode,
                              max_grad_norm=clip, batch_check_every=every),
        constraints=partc.Constraints(pp=1, dp=dist.get_world_size(), zero_stage=1,
                                      num_microbatches=2, recompute="none"))
    module = program.build()
    return module, module.optimizer(torch.optim.AdamW, lr=1e-4)


def hash_rate(megabytes: int = 64) -> float:
    """MB/s the batch digest hashes token ids at (the median of 5 runs)."""
    tokens = torch.randint(0, 50_000, (megabytes * 2 ** 17,))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        digest([tokens])
        times.append(time.perf_counter() - start)
    return tokens.numel() * 8 / 1e6 / statistics.median(times)


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    model, batches = model_and_batches(args, heads=4)
    programs = {name: build(model, *batches[0], mode, clip, every, args)
                for name, (mode, clip, every) in VARIANTS.items()}
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
            print(f"  {name:18s} {median * 1e3:8.2f} ms")
        for label, (over, under) in RATIOS.items():
            print(f"  {label:34s} {medians[over] / medians[under]:.3f}")
        print(f"  the digest's hash alone: {hash_rate():.0f} MB/s on this machine "
              f"(a rank hashes its rows: {args.batch // dist.get_world_size()} x "
              f"{args.seq} x 2 int64 = "
              f"{args.batch // dist.get_world_size() * args.seq * 16 / 1e3:.1f} kB a step)")
    for module, _ in programs.values():
        module.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_under_torchrun(main)
