"""What a checkpoint costs: GPT-2 124M (samples/gpt.py's gpt_small) with AdamW on 4
processes (pp=2 x dp=2, ZeRO-1; gloo on CPU), synchronous and asynchronous saves.

Measured on every rank and reported as the slowest rank's:

- sync save: ``module.save_checkpoint(...)`` until it returns (written and committed);
- async pause: ``module.save_checkpoint(..., async_save=True)`` until it returns, the
  time training stops (this rank's tensors copied to CPU memory); then one training step
  runs while the write goes on, and ``wait_checkpoint`` until it is committed;
- load: ``module.load_checkpoint`` into a module of the same plan;
- bytes per rank: the DCP file each rank wrote (parameters and optimizer state of its
  stage; a ZeRO-1 rank writes the Adam state of its half only).

Prints the figures and the ratio async pause / sync save.

    python benchmarks/checkpoint_save.py [--repeats 2] [--seq 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROCESSES = 4
BATCH = 4


def worker(out: Path, repeats: int, seq: int) -> None:
    import torch
    import torch.distributed as dist

    import partc
    from samples.gpt import gpt_small, loss_fn

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = gpt_small(block_size=seq)
    x = torch.randint(0, model.config.vocab_size, (BATCH, seq + 1))
    inputs, target = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    program = partc.compile(
        model, (inputs,), loss_fn=loss_fn, example_target=target,
        budget=partc.DeviceBudget(num_devices=PROCESSES, device="CPU"),
        train=partc.TrainSpec(global_batch_size=BATCH),
        constraints=partc.Constraints(pp=2, dp=2, tp=1, zero_stage=1, schedule="1f1b",
                                      num_microbatches=2, recompute="none"))
    module = program.build()
    opt = module.optimizer(torch.optim.AdamW, lr=1e-4)

    def step() -> float:
        started = time.perf_counter()
        module.forward_backward(inputs, target=target)
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - started

    def slowest(seconds: float) -> float:
        value = torch.tensor([seconds])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return value.item()

    step()  # the optimizer's state exists from here on
    plain_step = slowest(step())
    root = out / "ckpt"
    figures: dict[str, list[float]] = {"sync": [], "pause": [], "async_total": [],
                                       "step_during_write": [], "load": []}
    for repeat in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        module.save_checkpoint(root, optimizer=opt, step=2 * repeat + 1)
        figures["sync"].append(slowest(time.perf_counter() - started))
        dist.barrier()
        started = time.perf_counter()
        module.save_checkpoint(root, optimizer=opt, step=2 * repeat + 2, async_save=True)
        pause = time.perf_counter() - started
        during = step()
        module.wait_checkpoint()
        figures["async_total"].append(slowest(time.perf_counter() - started))
        figures["pause"].append(slowest(pause))
        figures["step_during_write"].append(slowest(during))
        dist.barrier()
        started = time.perf_counter()
        module.load_checkpoint(root, optimizer=opt)
        figures["load"].append(slowest(time.perf_counter() - started))
    latest = root / (root / "latest").read_text().strip()
    written = {f.name: f.stat().st_size for f in latest.glob("*.distcp")}
    if rank == 0:
        (out / "figures.json").write_text(json.dumps({
            "figures": figures, "plain_step": plain_step, "files": written,
            "params": sum(p.numel() for p in model.parameters())}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="checkpoint_save_"))
    if args.worker:
        worker(out, args.repeats, args.seq)
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={PROCESSES}", __file__, "--worker", "--out", str(out),
               "--repeats", str(args.repeats), "--seq", str(args.seq)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARTC_TIMEOUT_S": "1800",
           "PARTC_WATCHDOG_S": "1800"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"torchrun exited with {done.returncode}:\n{done.stderr[-4000:]}")
    data = json.loads((out / "figures.json").read_text())
    best = {key: min(values) for key, values in data["figures"].items()}
    sizes = data["files"]
    print(f"GPT-2 124M ({data['params'] / 1e6:.0f}M parameters), AdamW, {PROCESSES} processes "
          f"pp=2 x dp=2 ZeRO-1, gloo on CPU; best of {args.repeats}, slowest rank")
    print("bytes per rank: " + ", ".join(f"{name} {size / 2**20:.0f} MiB"
                                         for name, size in sorted(sizes.items())))
    print(f"training step:            {data['plain_step']:.2f} s")
    print(f"sync save:                {best['sync']:.2f} s")
    print(f"async save, pause:        {best['pause']:.2f} s")
    print(f"async save, until commit: {best['async_total']:.2f} s (a step ran meanwhile: "
          f"{best['step_during_write']:.2f} s)")
    print(f"load:                     {best['load']:.2f} s")
    print(f"pause / sync save:        {best['pause'] / best['sync']:.2f}")


if __name__ == "__main__":
    main()
