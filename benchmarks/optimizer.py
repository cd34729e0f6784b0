"""ZeRO 0/1's gradient buckets and distributed optimizer against what they replaced, and
the bytes per parameter each ZeRO stage allocates against the plan's ``Precision``.

    python benchmarks/optimizer.py            # starts torchrun with 2 CPU processes
    torchrun --standalone --nproc-per-node=2 benchmarks/optimizer.py [--steps 10]

Step times (forward_backward + optimizer step, Adam, dp=2) in the same run, steps
alternating between the variants so that drift in the machine's speed hits all alike:

- ZeRO-0: the runtime's fp32 gradient buckets (one all-reduce per bucket, issued as the
  last backward fills it) against one all-reduce per parameter (``OverlappedAllReduce``,
  the previous runtime's);
- ZeRO-1: the distributed optimizer (bucketed reduce-scatter, each rank stepping its dp
  shard, bucketed all-gather) against ``ZeroRedundancyOptimizer`` after a per-parameter
  all-reduce (the previous runtime's).

Bytes per parameter: after a step, the tensors this rank allocated for weights (and the
bf16 copies the step made), gradients and Adam's state, over the stage's parameters,
for ZeRO 0-3 in fp32 and bf16, beside what the plan budgets (``Plan.stages[i]
.memory_bytes``, from ``partc.problem.Precision``). Under ZeRO-2/3 the weights counted
are FSDP's shards only: the weights it gathers (ZeRO-2: every weight for the step,
which the plan budgets; ZeRO-3: the root unit's) are FSDP's own storage, not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import partc  # noqa: E402
from partc.runtime import DistributedModule, topology  # noqa: E402
from benchmarks.torchrun_launch import run_under_torchrun  # noqa: E402
from samples.gpt import gpt_tiny, loss_fn  # noqa: E402


class OverlappedAllReduce:
    """Gradient sync over dp one parameter at a time, overlapping the last microbatch's
    backward: while armed, each parameter's gradient is all-reduced (asynchronously) as
    soon as that backward has accumulated it, and :meth:`finish` waits and averages.
    The runtime uses :class:`partc.runtime.optimizer.GradBuckets` (one collective per
    bucket); this is what it replaced, kept here to measure against. It has the same
    calls as ``GradBuckets``."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, dp: int,
                 groups: dict[int, dist.ProcessGroup] | None = None) -> None:
        self.group, self.dp = group, dp
        # Parameters summed over another group (by id), still averaged over dp: expert
        # weights over their expert-data-parallel group.
        self.groups = groups or {}
        self.armed = False
        self._pending: list[tuple[torch.Tensor, Any]] = []
        for param in {id(p): p for p in module.parameters()}.values():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._launch)

    def begin(self, last: bool) -> None:
        self.armed = last

    def end(self) -> None:
        self.armed = False

    def _launch(self, param: torch.Tensor) -> None:
        if self.armed:
            work = dist.all_reduce(param.grad, group=self.groups.get(id(param), self.group),
                                   async_op=True)
            self._pending.append((param.grad, work))

    def finish(self, scale: int) -> None:
        for grad, work in self._pending:
            work.wait()
            grad.div_(self.dp)
        self._pending.clear()

VOCAB = 1024


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bucket-elements", type=int, default=1_000_000,
                        help="elements per gradient bucket (TrainSpec.bucket_elements)")
    return parser.parse_args()


def _model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt_tiny(vocab_size=VOCAB, block_size=args.seq, n_layer=args.layers,
                    n_embd=args.width, n_head=4)


def _batch(args: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _build(args: argparse.Namespace, zero: int, dtype: torch.dtype = torch.float32):
    model = _model(args)
    x, y = _batch(args, 0)
    program = partc.compile(
        model, (x,), loss_fn=loss_fn, example_target=y,
        budget=partc.DeviceBudget(num_devices=2, device="CPU"),
        train=partc.TrainSpec(global_batch_size=args.batch, optimizer="adam", dtype=dtype,
                              bucket_elements=args.bucket_elements),
        constraints=partc.Constraints(pp=1, dp=2, zero_stage=zero, recompute="none",
                                      num_microbatches=2))
    return program, program.build()


def _previous(built, zero: int) -> tuple[Any, torch.optim.Optimizer]:
    """The previous runtime on a ZeRO-0 module: per-parameter all-reduce, and under
    ZeRO-1 torch's ZeroRedundancyOptimizer. Returns the module (``built``'s stage, its
    gradients synced by the stage instead of the buckets) and the optimizer."""
    stage = built.parts.stages[0]
    stage.grad_sync = OverlappedAllReduce(built.module, built.topology.dp_group, 2)
    module = DistributedModule(dataclasses.replace(built.parts, buckets=None))
    if zero == 0:
        return module, torch.optim.Adam(module.parameters(), lr=1e-3)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return module, ZeroRedundancyOptimizer(
        module.parameters(), optimizer_class=torch.optim.Adam,
        process_group=module.topology.dp_group, lr=1e-3)


def step_times(args: argparse.Namespace) -> dict[str, float]:
    variants = {}
    for zero in (0, 1):
        _, new = _build(args, zero)
        variants[f"zero{zero}-buckets"] = (new, new.optimizer(torch.optim.Adam, lr=1e-3))
        _, old = _build(args, 0)
        variants[f"zero{zero}-previous"] = _previous(old, zero)
    times: dict[str, list[float]] = {name: [] for name in variants}
    losses: dict[str, list[float]] = {name: [] for name in variants}
    for step in range(args.warmup + args.steps):
        x, y = _batch(args, step)
        order = list(variants) if step % 2 == 0 else list(reversed(variants))
        for name in order:
            module, opt = variants[name]
            dist.barrier()
            started = time.perf_counter()
            loss = module.forward_backward(x, target=y)
            opt.step()
            elapsed = time.perf_counter() - started
            opt.zero_grad()
            module.zero_grad()
            if step >= args.warmup:
                times[name].append(elapsed)
                losses[name].append(loss.item())
    for zero in (0, 1):
        new, old = losses[f"zero{zero}-buckets"], losses[f"zero{zero}-previous"]
        if any(abs(a - b) > 1e-5 * abs(b) for a, b in zip(new, old)):
            raise AssertionError(f"ZeRO-{zero}: the two runs' losses differ: {new} vs {old}")
    return {name: statistics.median(t) for name, t in times.items()}


def bytes_per_parameter(args: argparse.Namespace) -> list[tuple]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for zero in (0, 1, 2, 3):
            program, module = _build(args, zero, dtype)
            opt = module.optimizer(torch.optim.Adam, lr=1e-3)
            x, y = _batch(args, 0)
            module.forward_backward(x, target=y)
            opt.step()
            measured = _allocated(module, opt)
            stage = program.plan.stages[module.stage_index]
            planned = stage.memory_bytes
            n = stage.param_count
            rows.append((str(dtype).removeprefix("torch."), zero,
                         [measured[k] / n for k in ("params", "grads", "optimizer")],
                         [planned.params / n, planned.grads / n, planned.optimizer / n]))
            module.close()
    return rows


def _allocated(module, opt) -> dict[str, int]:
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    params = list({id(p): p for p in module.parameters()}.values())
    weights = sum(local(p).numel() * p.element_size() for p in params)
    copies = module.parts.copies
    weights += copies.last_bytes if copies is not None else 0
    buckets = module.parts.buckets
    if buckets is not None:
        grads = sum(b.buffer.numel() * b.buffer.element_size() for b in buckets.buckets)
    else:
        grads = sum(local(p.grad).numel() * p.grad.element_size() for p in params
                    if p.grad is not None)
    state = getattr(opt, "optim", opt).state
    optimizer = sum(local(t).numel() * t.element_size() for s in state.values()
                    for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"params": weights, "grads": grads, "optimizer": optimizer}


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    medians = step_times(args)
    rows = bytes_per_parameter(args)
    if rank == 0:
        n = sum(p.numel() for p in _model(args).parameters())
        print(f"GPT {args.layers} layers x {args.width} wide ({n:,} parameters), seq "
              f"{args.seq}, batch {args.batch}, dp=2 on 2 CPU processes (gloo), Adam, "
              f"buckets of {args.bucket_elements:,} elements; median of {args.steps} steps "
              "(forward_backward + optimizer step)")
        for zero, old_name in ((0, "per-parameter all-reduce"),
                               (1, "ZeroRedundancyOptimizer + per-parameter all-reduce")):
            new, old = medians[f"zero{zero}-buckets"], medians[f"zero{zero}-previous"]
            print(f"  ZeRO-{zero}: buckets {new * 1e3:7.1f} ms   {old_name} "
                  f"{old * 1e3:7.1f} ms   ratio new/old {new / old:.3f}")
        print("bytes per parameter after a step (rank 0's stage): measured (allocated "
              "tensors) / planned (Precision); ZeRO-2/3 weights: FSDP's shards only")
        print("  dtype     ZeRO   weights        gradients      optimizer      total")
        for dtype, zero, measured, planned in rows:
            cells = "  ".join(f"{m:5.2f} / {p:5.2f}" for m, p in zip(measured, planned))
            print(f"  {dtype:9s} {zero:4d}   {cells}  {sum(measured):5.2f} / "
                  f"{sum(planned):5.2f}")
    dist.barrier()
    topology.leave()


if __name__ == "__main__":
    run_under_torchrun(main)
