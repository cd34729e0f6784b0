"""Compile the sample GPT with partc and train it under torchrun, on CPU or GPUs.

    torchrun --standalone --nproc-per-node=2 samples/train_gpt.py --steps 8 --out out/gpt

Every rank compiles the same model with the same arguments (the planner is
deterministic, and ranks compare plan hashes before training); rank 0 prints the plan's
report and saves the program directory (plan.json, report.md, code/stage_<k>.py). The
model learns characters of its own source file, so the loss visibly falls.

Checkpoints, suspend and resume:

    torchrun --standalone --nproc-per-node=2 --max-restarts=3 samples/train_gpt.py \
        --steps 100 --checkpoint-dir out/ckpt --checkpoint-every 10 --resume

saves every 10 steps (and at the end) under out/ckpt; ``--resume`` starts from the
latest complete checkpoint there, if any, on any number of processes (the plan is
made again for them and the checkpoint resharded into it; each step reads the same
samples whatever the data-parallel degree). A SIGTERM or SIGUSR1 to torchrun (or to
any rank) makes every rank finish its step, save it, and exit with
``partc.runtime.suspend.SUSPEND_EXIT_CODE`` (86); run the same command to continue.
Under ``--max-restarts`` a rank that dies makes torchrun restart the job, which resumes
from the latest checkpoint by itself.
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
from partc.runtime import topology  # noqa: E402
from partc.runtime.suspend import SUSPEND_EXIT_CODE  # noqa: E402
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
    parser.add_argument("--seed", type=int, default=0, help="data order seed")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save checkpoints here (every --checkpoint-every steps, at "
                             "the end, and when a stop signal arrives)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help="save every N steps (default: only at the end and on a stop)")
    parser.add_argument("--resume", action="store_true",
                        help="start from the latest checkpoint in --checkpoint-dir, if any")
    args = parser.parse_args()
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        parser.error("--resume and --checkpoint-every need --checkpoint-dir")
    return args


def corpus() -> torch.Tensor:
    """The bytes of this sample's GPT source: a small, learnable character stream."""
    text = (Path(__file__).with_name("gpt.py")).read_bytes()
    return torch.tensor(list(text), dtype=torch.int64)


def samples(data: torch.Tensor, seq: int) -> torch.Tensor:
    """The data set: consecutive windows of ``seq + 1`` bytes (inputs and next bytes)."""
    count = (len(data) - 1) // seq
    return torch.stack([data[i * seq:i * seq + seq + 1] for i in range(count)])


def batch(windows: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples ``indices`` names: token ids and their targets."""
    rows = windows[indices]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def main() -> int:
    """Train; returns the exit status."""
    args = arguments()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = gpt_tiny(vocab_size=256, block_size=args.seq, n_layer=args.layers,
                     n_embd=args.width, n_head=4)
    windows = samples(corpus(), args.seq)
    ids, targets = batch(windows, torch.arange(args.batch) % len(windows))
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
    sampler = module.data_sampler(len(windows), seed=args.seed)
    done = 0  # optimizer steps so far: the data position
    checkpoints = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if args.resume and (checkpoints / "latest").exists():
        done, extra = module.load_checkpoint(checkpoints, optimizer=optimizer)
        if extra.get("data", sampler.state_dict()) != sampler.state_dict():
            raise SystemExit(f"{checkpoints} was saved reading the data as "
                             f"{extra['data']}, this run reads {sampler.state_dict()}: "
                             "resume with the same --seq, --batch and --seed")
        if rank == 0:
            print(f"resumed from {checkpoints} at step {done} on {world} processes",
                  flush=True)
    tokens_per_step = args.batch * args.seq
    while done < args.steps:
        # This rank's data-parallel slice of the step's global batch.
        ids, targets = batch(windows, sampler.indices(done))
        started = time.perf_counter()
        loss = module.forward_backward(ids, target=targets)
        optimizer.step()
        optimizer.zero_grad()
        done += 1
        seconds = time.perf_counter() - started
        if rank == 0:
            print(f"step {done} loss {loss.item():.6f}  ({tokens_per_step / seconds:,.0f} "
                  f"tokens/s, {seconds * 1e3:.0f} ms)", flush=True)
        if module.stop_requested():  # every rank, from the same step on
            if checkpoints is not None:
                save(module, optimizer, sampler, checkpoints, done, rank)
            print(f"rank {rank}: stopped at step {done} on a signal; exiting with "
                  f"{SUSPEND_EXIT_CODE}", flush=True)
            dist.destroy_process_group()
            module.close()  # last: until here a second signal only sets the flag again
            return SUSPEND_EXIT_CODE
        if checkpoints is not None and (done == args.steps or (
                args.checkpoint_every and done % args.checkpoint_every == 0)):
            save(module, optimizer, sampler, checkpoints, done, rank)
    module.close()
    dist.barrier()
    return 0


def save(module, optimizer, sampler, directory: Path, step: int, rank: int) -> None:
    """A checkpoint of ``step`` (every rank), with what fixes the data order: the step
    is the position in it."""
    started = time.perf_counter()
    path = module.save_checkpoint(directory, optimizer=optimizer, step=step,
                                  extra={"data": sampler.state_dict()})
    if rank == 0:
        print(f"checkpoint: step {step} saved to {path} in "
              f"{time.perf_counter() - started:.2f} s", flush=True)


if __name__ == "__main__":
    status = main()
    # The module is released: leaving frees the process groups, their gloo threads
    # joined before the interpreter shuts down (a thread still finishing the last
    # collective then could abort the finished run).
    topology.leave()
    sys.exit(status)
