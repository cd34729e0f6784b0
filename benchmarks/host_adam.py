"""The host's optimizer step under offload, in parameters per second, beside torch's CPU
AdamW in each of its forms, in one run.

Rows, each over the same fp32 tensors (transformer blocks' shapes, ``--params`` in all):

- ``HostOptimizer``: partc's offloaded step (``partc/runtime/offload.py``): the
  gradients copied into host tensors, torch's AdamW stepping the fp32 masters (the form
  it picks, fused), the weights copied back;
- ``torch AdamW fused`` / ``foreach`` / ``for-loop``: torch.optim.AdamW alone over the
  tensors, in each form.

    python benchmarks/host_adam.py [--params 4e6] [--steps 5] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from partc.calibrate.memory_rates import block_shapes  # noqa: E402
from partc.runtime.offload import HostOptimizer, HostTier  # noqa: E402


def tensors(params: float) -> list[torch.nn.Parameter]:
    width = max(64, int((params / 12) ** 0.5))
    found = [torch.nn.Parameter(torch.randn(shape)) for shape in block_shapes(width)]
    for param in found:
        param.grad = torch.randn_like(param)
    return found


def rate(optimizer: torch.optim.Optimizer, count: int, steps: int) -> float:
    optimizer.step()   # the state is made in the first step
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    return count * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=4e6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = {
        "HostOptimizer (offload: copies + fused AdamW)":
            lambda p: HostOptimizer(p, torch.optim.AdamW, HostTier("cpu"), lr=1e-4),
        "torch AdamW fused": lambda p: torch.optim.AdamW(p, lr=1e-4, fused=True),
        "torch AdamW foreach": lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True),
        "torch AdamW for-loop": lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=False),
    }
    count = sum(p.numel() for p in tensors(args.params))
    print(f"{count:,} fp32 parameters, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, {args.steps} steps each")
    results = {name: rate(make(tensors(args.params)), count, args.steps)
               for name, make in rows.items()}
    base = results["torch AdamW foreach"]
    for name, value in results.items():
        print(f"{name:<48}{value / 1e6:10.1f} M parameters/s  {value / base:5.2f}x foreach")


if __name__ == "__main__":
    main()
