"""Run by tests/runtime/test_watchdog.py under torchrun with 2 ranks: a pp=2 GPT trains,
and after step 1 rank 1 stops itself with SIGSTOP; rank 0's watchdog must end the job."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # torchrun runs this file

import partc  # noqa: E402
from samples.gpt import gpt_tiny, loss_fn  # noqa: E402

B, T = 8, 16


def main() -> None:
    torch.manual_seed(0)
    model = gpt_tiny()
    data = torch.randint(0, 128, (B, T + 1))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    program = partc.compile(model, (x,), loss_fn=loss_fn, example_target=y,
                            budget=partc.DeviceBudget(num_devices=2, device="CPU"),
                            train=partc.TrainSpec(global_batch_size=B),
                            constraints=partc.Constraints(pp=2), cache=None)
    module = program.build()
    opt = module.optimizer(torch.optim.SGD, lr=0.1)
    rank = module.topology.rank
    for step in range(1, 50):
        module.forward_backward(x, target=y)
        opt.step()
        opt.zero_grad()
        if rank == 1 and step == 1:
            time.sleep(0.5)  # the watchdog publishes this rank's last phase (0.1 s at most)
            print(f"watchdog test: rank 1 stops itself at {time.time():.3f}", file=sys.stderr,
                  flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
    print(f"watchdog test: rank {rank} finished every step", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
