"""Step time of partc's emitted program against a hand-written pipelining program.

    python benchmarks/runtime_overhead.py            # starts torchrun with 2 processes
    torchrun --standalone --nproc-per-node=2 benchmarks/runtime_overhead.py [--steps 20]

Both programs train the same GPT (same weights, same batches) with the same two-stage
split, the same schedule and microbatches, on the same processes in the same run. The
hand-written one is what a person would write with ``torch.distributed.pipelining``: two
``nn.Module`` halves built from the model's own submodules, ``PipelineStage``, the
schedule, and an all-reduce of the tied embedding/head gradient. Steps alternate between
the two so that drift in the machine's speed hits both alike; the figure is the ratio of
median step times (target ≤ 1.05).
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
from torch import nn  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # noqa: E402

import partc  # noqa: E402
from benchmarks.torchrun_launch import run_under_torchrun  # noqa: E402
from benchmarks.tiny_gpt import model_and_batches  # noqa: E402
from samples.gpt import GPT, loss_fn  # noqa: E402


class FirstHalf(nn.Module):
    def __init__(self, model: GPT, cut: int) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = model.tok_emb, model.pos_emb, model.drop
        self.blocks = nn.ModuleList(model.blocks[:cut])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return x


class SecondHalf(nn.Module):
    def __init__(self, model: GPT, cut: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.blocks[cut:])
        self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class HandWritten:
    """The reference: the same split and schedule, written by hand."""

    def __init__(self, model: GPT, cut: int, microbatches: int, schedule: str) -> None:
        rank = dist.get_rank()
        half = FirstHalf(model, cut) if rank == 0 else SecondHalf(model, cut)
        self.module = copy.deepcopy(half)  # its own parameters, like partc's stage
        self.stage = PipelineStage(self.module, rank, 2, torch.device("cpu"))
        kind = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
        self.schedule = kind(self.stage, microbatches, loss_fn=loss_fn, scale_grads=True)
        self.tied = self.module.tok_emb.weight if rank == 0 else self.module.lm_head.weight
        self.microbatches = microbatches

    def forward_backward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if self.stage.is_first:
            self.schedule.step(ids)
        else:
            self.schedule.step(target=targets, losses=losses)
        dist.all_reduce(self.tied.grad)  # tied embedding and head: sum their gradients
        total = torch.stack(losses).sum().detach() if losses else torch.zeros(())
        dist.all_reduce(total)
        return total / self.microbatches

    def zero_grad(self) -> None:
        self.module.zero_grad(set_to_none=True)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per program")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    return parser.parse_args()


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, batches = model_and_batches(args, heads=4)
    ids, targets = batches[0]
    cut = args.layers // 2
    first = ["tok_emb", "pos_emb", "drop"] + [f"blocks.{i}" for i in range(cut)]
    second = [f"blocks.{i}" for i in range(cut, args.layers)] + ["ln_f", "lm_head", "loss"]
    program = partc.compile(
        model, (ids,), loss_fn=loss_fn, example_target=targets,
        budget=partc.DeviceBudget(num_devices=2, device="CPU"),
        train=partc.TrainSpec(global_batch_size=args.batch),
        constraints=partc.Constraints(stages=[first, second], recompute="none", dp=1,
                                      num_microbatches=args.microbatches,
                                      schedule=args.schedule))
    emitted = program.build()
    hand = HandWritten(model, cut, args.microbatches, args.schedule)
    programs = {"partc": (lambda x, y: emitted.forward_backward(x, target=y), emitted.zero_grad),
                "hand-written": (hand.forward_backward, hand.zero_grad)}
    times: dict[str, list[float]] = {name: [] for name in programs}
    losses: dict[str, list[float]] = {name: [] for name in programs}
    for step in range(args.warmup + args.steps):
        x, y = batches[step % len(batches)]
        order = list(programs) if step % 2 == 0 else list(reversed(programs))
        for name in order:
            run, zero = programs[name]
            dist.barrier()
            started = time.perf_counter()
            loss = run(x, y)
            elapsed = time.perf_counter() - started
            zero()
            if step >= args.warmup:
                times[name].append(elapsed)
                losses[name].append(loss.item())
    if rank == 0:
        medians = {name: statistics.median(t) for name, t in times.items()}
        tokens = args.batch * args.seq
        print(f"GPT {args.layers} layers × {args.width} wide, seq {args.seq}, batch "
              f"{args.batch}, 2 stages, {args.schedule}, {args.microbatches} microbatches; "
              f"median of {args.steps} steps (forward + backward + gradient sync)")
        for name, median in medians.items():
            print(f"  {name:13s} {median * 1e3:8.1f} ms   {tokens / median:9,.0f} tokens/s")
        print(f"  ratio partc / hand-written: {medians['partc'] / medians['hand-written']:.3f}"
              "   (target <= 1.05)")
        same = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses["partc"],
                                                             losses["hand-written"]))
        print(f"  losses agree step by step (1e-5 relative): {same}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_under_torchrun(main)
