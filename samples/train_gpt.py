"""Compile the sample GPT with partc and train it under torchrun, on CPU or GPUs.

    torchrun --standalone --nproc-per-node=2 samples/train_gpt.py --steps 8 --out out/gpt

Every rank compiles the same model with the same arguments (the planner is
deterministic, and ranks compare plan hashes before training); rank 0 prints the plan's
report and saves the program directory (plan.json, report.md, code/stage_<k>.py). The
model learns characters of its own source file, so the loss visibly falls.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import partc  # noqa: E402
from samples.gpt import gpt_tiny, loss_fn  # noqa: E402


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=16, help="global batch, in sequences")
    parser.add_argument("--device", default="CPU", help="device preset (default CPU)")
    parser.add_argument("--memory", default=None,
                        help="memory per device, e.g. 3MiB (default: the preset's)")
    parser.add_argument("--pp", type=int, default=None, help="pin the pipeline degree")
    parser.add_argument("--tp", type=int, default=None, help="pin the tensor-parallel degree")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="with --tp: shard norms and dropouts on the sequence too")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", default="out/gpt", help="program directory to write")
    return parser.parse_args()


def corpus() -> torch.Tensor:
    """The bytes of this sample's GPT source: a small, learnable character stream."""
    text = (Path(__file__).with_name("gpt.py")).read_bytes()
    return torch.tensor(list(text), dtype=torch.int64)


def batch(data: torch.Tensor, step: int, size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same random windows on every rank (seeded by step)."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - seq - 1, (size,), generator=g)
    windows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def main() -> None:
    args = arguments()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = gpt_tiny(vocab_size=256, block_size=args.seq, n_layer=args.layers,
                     n_embd=args.width, n_head=4)
    data = corpus()
    ids, targets = batch(data, 0, args.batch, args.seq)
    budget = partc.DeviceBudget(num_devices=world, device=args.device,
                                **({"memory": args.memory} if args.memory else {}))
    started = time.perf_counter()
    constraints = partc.Constraints(pp=args.pp, tp=args.tp,
                                    sequence_parallel=True if args.sequence_parallel else None)
    program = partc.compile(model, (ids,), loss_fn=loss_fn, example_target=targets,
                            budget=budget, train=partc.TrainSpec(global_batch_size=args.batch),
                            constraints=constraints, name="gpt-sample")
    if rank == 0:
        print(program.report())
        print(f"compiled in {time.perf_counter() - started:.2f} s; program saved to "
              f"{program.save(args.out)}", flush=True)
    module = program.build()
    optimizer = module.optimizer(torch.optim.AdamW, lr=args.lr, weight_decay=0.1)
    tokens_per_step = args.batch * args.seq
    for step in range(1, args.steps + 1):
        ids, targets = batch(data, step, args.batch, args.seq)
        started = time.perf_counter()
        loss = module.forward_backward(ids, target=targets)
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - started
        if rank == 0:
            print(f"step {step:3d}/{args.steps}  loss {loss.item():.4f}  "
                  f"{tokens_per_step / seconds:9,.0f} tokens/s  ({seconds * 1e3:.0f} ms)",
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
