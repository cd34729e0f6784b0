"""ZeRO-1's gradient buckets: adding one microbatch's gradients into the sharded fp32
buckets, and putting an all-gather's rows back into the parameters, against the
rank-by-rank placement they replaced, in one process (no collective runs).

    PYTHONPATH=. python benchmarks/grad_buckets.py [--dp 2,8,48] [--rounds 7]

A bucket is laid out region by region, rank r's region holding rows ``chunk(dp)[r]`` of
each parameter. Placing a gradient rank by rank launches dp kernels per parameter every
microbatch (and dp per parameter per step for the all-gather's rows); the runtime now
launches at most two (every full chunk as one strided view, then a short last chunk),
which is what the cost model prices per parameter tensor. Printed per dp: the kernels
(as the cost model's counter, ``MovedBytes``, counts them) per microbatch and
parameter, and the median time of each, rounds interleaved, and their ratio. The model is the sample GPT (12 layers of width 768),
with bf16 gradients (mixed precision) and fp32 ones.

On a GPU each launch costs the device microseconds beyond its bytes
(``DeviceNumbers.kernel_overhead_s``): at dp=48 a stage of 200 parameter tensors saved
9,400 launches a microbatch. On CPU ranks the times say less: an fp32 buffer adding a
bf16 tensor first converts it into a temporary as large as the addend, so one add over
all ranks' chunks can take longer than dp small ones (seen: 1.6-1.8x at dp=8), while fp32
gradients, or dp=2 (the tests' and benchmarks'), come out even or faster.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "samples"))

import torch  # noqa: E402

from gpt import GPT, GPTConfig  # noqa: E402
from partc.passes.helpers.op_bytes import MovedBytes  # noqa: E402
from partc.runtime.optimizer import GradBuckets  # noqa: E402


def rank_by_rank_add(buckets: GradBuckets, grads) -> None:
    """The placement the runtime replaced: each rank's rows of each gradient, in turn."""
    for bucket, slot, grad in grads:
        flat = grad.reshape(-1)
        for rank in range(len(slot.ranges)):
            start, end = slot.ranges[rank]
            slot.rank_view(bucket.region_of(rank), rank).add_(flat[start:end])


def rank_by_rank_scatter(buckets: GradBuckets, outs) -> None:
    for bucket, out in outs:
        for other in range(bucket.shards):
            region = out[other * bucket.region:(other + 1) * bucket.region]
            for slot in bucket.slots:
                start, end = slot.ranges[other]
                if end > start and (slot.param.dim() > 0 or other == bucket.rank):
                    slot.param.detach().reshape(-1)[start:end].copy_(
                        slot.rank_view(region, other))


def runtime_add(buckets: GradBuckets, grads) -> None:
    for bucket, slot, grad in grads:
        buckets._add(bucket, slot, grad)


def runtime_scatter(buckets: GradBuckets, outs) -> None:
    for bucket, out in outs:
        buckets._scatter_rows(bucket, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", default="2,8,48")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    count = sum(1 for _ in model.parameters())
    print(f"sample GPT: {count} parameter tensors, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    print(f"{'grads':>5} {'dp':>3} {'what':>22} {'kernels':>10} {'rank by rank':>13} "
          f"{'runtime':>9} {'ratio':>6}")
    for dtype, dp in ((dtype, int(d)) for dtype in (torch.bfloat16, torch.float32)
                      for d in args.dp.split(",")):
        buckets = GradBuckets(model, None, dp, 0, sharded=True)
        grads = [(bucket, slot, slot.param.detach().to(dtype))
                 for bucket, slot in buckets.slots()]
        outs = [(bucket, bucket.buffer.clone()) for bucket in buckets.buckets]
        cases = {"add (per microbatch)": ((rank_by_rank_add, runtime_add), grads),
                 "rows back (per step)": ((rank_by_rank_scatter, runtime_scatter), outs)}
        for what, (pair, work) in cases.items():
            ops = []
            for fn in pair:
                with MovedBytes(set(), cuda=True) as counted:   # the cost model's kernels
                    fn(buckets, work)
                ops.append(counted.kernels / count)
            times: list[list[float]] = [[], []]
            for _ in range(args.rounds):
                for i, fn in enumerate(pair):
                    start = time.perf_counter()
                    fn(buckets, work)
                    times[i].append(time.perf_counter() - start)
            old, new = (statistics.median(t) * 1e3 for t in times)
            print(f"{'bf16' if dtype == torch.bfloat16 else 'fp32':>5} {dp:>3} {what:>22} {ops[0]:>4.1f}->{ops[1]:<4.1f} {old:>10.1f} ms "
                  f"{new:>6.1f} ms {new / old:>6.3f}")


if __name__ == "__main__":
    main()
