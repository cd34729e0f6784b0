"""A loss curve of the sample GPT trained with FP8 linears (emulated) beside bf16, on CPU.

    python benchmarks/fp8_curve.py [--steps 200] [--plot out/fp8_curve.png]

The sample GPT (samples/gpt.py; 4 layers, 128 wide, a byte vocabulary) learns the bytes
of its own source (samples/train_gpt.py's data), compiled by partc for one CPU process
twice from the same initial weights and trained on the same batches with AdamW:

- ``bf16``: mixed precision (bf16 compute, fp32 master weights);
- ``bf16 + fp8``: the same with ``TrainSpec(fp8=True)`` and the blocks' linears pinned
  to FP8 (``Constraints.fp8_linears``: the CPU has no FP8 matmuls, so the planner
  chooses none by itself), which torchao's float8 training emulates: the same dynamic
  casts to e4m3/e5m2 as on an H100, the matmuls in fp32. The output layer (the LM head,
  tied to the embedding) stays bf16, as the planner keeps it and torchtitan does;
  ``--head-fp8`` runs it FP8 too (it learns visibly worse: 3-bit mantissas on the
  logits).

It prints both curves every 20 steps, their final losses (the mean of the last 10
steps) and the largest gap between them, and writes the plot (matplotlib) to ``--plot``.
About 2 minutes of CPU time (more where the cores are shared).

Measured (200 steps, tensorwise): final loss bf16 2.783, FP8 blocks 2.974 (+6.9%),
FP8 blocks and head 3.262 (+17.2%): at 128 wide, below the shapes FP8 is meant for,
e4m3's 3-bit mantissas cost accuracy; the curves agree to 0.01 for the first 70 steps.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "samples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import partc  # noqa: E402
from partc.runtime import topology  # noqa: E402
from samples.gpt import gpt_tiny, loss_fn  # noqa: E402
from train_gpt import batch, corpus, samples  # noqa: E402

SEQ, BATCH, LAYERS, WIDTH = 64, 16, 4, 128


def train(fp8: bool, steps: int, lr: float, recipe: str, head: bool) -> list[float]:
    """The losses of ``steps`` steps of the sample GPT, compiled bf16 (and FP8: the
    blocks' linears, and the head's with ``head``)."""
    torch.manual_seed(0)
    model = gpt_tiny(vocab_size=256, block_size=SEQ, n_layer=LAYERS, n_embd=WIDTH, n_head=4)
    linears = "all" if head else [f"blocks.{name}.weight" for name, module
                                  in model.blocks.named_modules()
                                  if isinstance(module, torch.nn.Linear)]
    windows = samples(corpus(), SEQ)
    ids, targets = batch(windows, torch.arange(BATCH))
    program = partc.compile(
        model, (ids,), loss_fn=loss_fn, example_target=targets,
        budget=partc.DeviceBudget(num_devices=1, device="CPU"),
        train=partc.TrainSpec(global_batch_size=BATCH, dtype=torch.bfloat16, fp8=fp8,
                              fp8_recipe=recipe),
        constraints=partc.Constraints(fp8_linears=linears if fp8 else None), cache=None)
    if fp8:
        print(f"FP8 linears: {len(program.plan.fp8.linears)} "
              f"({program.plan.fp8.recipe}, emulated={program.plan.fp8.emulated})")
    module = program.build()
    optimizer = module.optimizer(torch.optim.AdamW, lr=lr, weight_decay=0.1)
    order = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        ids, targets = batch(windows, torch.randint(0, len(windows), (BATCH,),
                                                    generator=order))
        losses.append(module.forward_backward(ids, target=targets).item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        axes.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1)
    axes.set_xlabel("step")
    axes.set_ylabel("training loss (cross entropy, nats)")
    axes.set_title("sample GPT on CPU: bf16 vs FP8 linears (torchao, emulated)")
    axes.legend()
    axes.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--plot", default="out/fp8_curve.png")
    parser.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise"])
    parser.add_argument("--head-fp8", action="store_true",
                        help="run the output layer FP8 too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with socket.socket() as probe:    # a free port for a world of one process
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo")
    curves = {}
    for label, fp8 in (("bf16", False), ("bf16 + fp8", True)):
        started = time.perf_counter()
        curves[label] = train(fp8, args.steps, args.lr, args.recipe, args.head_fp8)
        print(f"{label}: {args.steps} steps in {time.perf_counter() - started:.1f} s",
              flush=True)
    plain, fp8 = curves["bf16"], curves["bf16 + fp8"]
    print("\nstep    bf16      bf16 + fp8   gap")
    for step in range(0, args.steps, max(1, args.steps // 10)):
        print(f"{step + 1:4d}  {plain[step]:8.4f}  {fp8[step]:8.4f}  {fp8[step] - plain[step]:+8.4f}")
    last = min(10, args.steps)
    final = {k: sum(v[-last:]) / last for k, v in curves.items()}
    gap = max(abs(a - b) for a, b in zip(plain, fp8))
    print(f"\nfinal loss (mean of the last {last} steps): bf16 {final['bf16']:.4f}, "
          f"bf16 + fp8 {final['bf16 + fp8']:.4f} "
          f"({100 * (final['bf16 + fp8'] / final['bf16'] - 1):+.2f}%)")
    worst = max(range(args.steps), key=lambda s: abs(plain[s] - fp8[s]))
    print(f"largest gap at any step: {gap:.4f} (step {worst + 1}: bf16 {plain[worst]:.4f}, "
          f"fp8 {fp8[worst]:.4f})")
    plot(curves, Path(args.plot))
    print(f"plot written to {args.plot}")
    topology.leave()


if __name__ == "__main__":
    main()
