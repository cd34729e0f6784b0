"""The tensor-parallel group's blocking all-gather and reduce-scatter run as single-tensor
collectives against the same over lists of tensors, side by side.

    python benchmarks/tp_collectives.py             # starts torchrun with 2 processes
    torchrun --standalone --nproc-per-node=2 benchmarks/tp_collectives.py [--rounds 30]
    python benchmarks/tp_collectives.py --backend nccl   # on 2 GPUs

``TensorParallelGroup.all_gather`` run single-tensor gathers the ranks' shards into one
buffer and views it as the whole where the shards lie one after another (a sequence
shard of one sample), copying it into place otherwise; ``reduce_scatter`` lays the
chunks out one after another (a view, or one copy) for one reduce-scatter. The list
forms gather into one tensor per rank and concatenate them, and reduce-scatter a list
of chunks. NCCL's list collectives stage through one flat buffer (a copy out or in of
the whole beside the transfer), so over NCCL the group runs both single-tensor; gloo's
single-tensor reduce-scatter all-reduces a copy of the whole, so over gloo its
reduce-scatter runs over the list (``TensorParallelGroup.listed``). Per shape of a
batch-first activation (batch, sequence, hidden) and dim: the median of ``--rounds``
interleaved rounds of each form, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.torchrun_launch import run_under_torchrun  # noqa: E402
from partc.runtime.tp import TensorParallelGroup  # noqa: E402


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    return parser.parse_args()


def groups() -> dict[str, TensorParallelGroup]:
    """The world's group twice: run single-tensor, and over lists."""
    made = {}
    for form in ("single", "listed"):
        group = TensorParallelGroup(dist.get_world_size(), dist.group.WORLD)
        group.listed = frozenset(("all_gather", "reduce_scatter") if form == "listed" else ())
        made[form] = group
    return made


def timed(fn, device: torch.device) -> float:
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    args = arguments()
    dist.init_process_group(args.backend)
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    forms = groups()
    size, rank = forms["single"].size, forms["single"].rank
    rows = []
    for batch in args.batches:
        for dim in (1, 2):
            whole = torch.randn(batch, args.seq, args.hidden, device=device)
            shard = whole.chunk(size, dim)[rank].contiguous()
            for name in ("all-gather", "reduce-scatter"):
                def run(form: str, name: str = name, dim: int = dim) -> torch.Tensor:
                    if name == "all-gather":
                        return forms[form].all_gather(shard, dim, 1)
                    return forms[form].reduce_scatter(whole, dim)

                assert torch.equal(run("single"), run("listed"))
                times: dict[str, list[float]] = {"single": [], "listed": []}
                for round_ in range(args.rounds):
                    order = ["single", "listed"] if round_ % 2 == 0 else ["listed", "single"]
                    for form in order:
                        times[form].append(timed(lambda: run(form), device))
                single_s, listed_s = (statistics.median(times[k]) for k in ("single", "listed"))
                rows.append((name, batch, dim, single_s, listed_s))
    if dist.get_rank() == 0:
        print(f"{size} {args.backend} processes, whole tensor (batch, {args.seq}, "
              f"{args.hidden}) fp32; median of {args.rounds} interleaved rounds")
        print(f"  {'collective':15s} {'batch':>5s} {'dim':>3s} {'single':>10s} {'listed':>10s} "
              f"{'single/listed':>13s}")
        for name, batch, dim, single_s, listed_s in rows:
            print(f"  {name:15s} {batch:5d} {dim:3d} {single_s * 1e3:8.2f} ms "
                  f"{listed_s * 1e3:8.2f} ms {single_s / listed_s:13.3f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_under_torchrun(main)
