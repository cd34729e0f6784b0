"""The tensor-parallel group's blocking all-gather and reduce-scatter: single-tensor and
over lists, on two gloo processes, against the collectives' definitions, for batch-first
activations of one and more samples and every dim; and what a stand-in (the estimate's
group) counts of them."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from partc.passes.op_bytes import MovedBytes
from partc.runtime.tp import TensorParallelGroup

SHAPES = ((1, 6, 4), (3, 6, 4), (2, 4, 6))


def _worker(rank: int, world: int, path: str, failures) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank,
                            world_size=world)
    try:
        group = TensorParallelGroup(world, dist.group.WORLD)
        # Over gloo the reduce-scatter runs over a list, the all-gather single-tensor.
        assert group.listed == frozenset(("reduce_scatter",))
        torch.manual_seed(rank)
        for listed in (frozenset(), frozenset(("all_gather", "reduce_scatter"))):
            group.listed = listed
            for shape in SHAPES:
                for dim in (0, 1, 2, -1):
                    if shape[dim] % world:
                        continue
                    x = torch.randn(*shape)
                    parts = [torch.empty_like(x) for _ in range(world)]
                    dist.all_gather(parts, x)
                    gathered = group._all_gather(x, dim, 1)
                    assert gathered.is_contiguous() and torch.equal(
                        gathered, torch.cat(parts, dim)), (listed, shape, dim)
                    total = x.clone()
                    dist.all_reduce(total)
                    scattered = group._reduce_scatter(x, dim)
                    assert scattered.is_contiguous(), (listed, shape, dim)
                    torch.testing.assert_close(scattered, total.chunk(world, dim)[rank])
    except AssertionError as error:
        failures.append(f"rank {rank}: {error!r}")
        raise
    finally:
        dist.destroy_process_group()


def test_single_tensor_and_listed_collectives_agree_with_their_definitions(tmp_path):
    failures = mp.Manager().list()
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), failures), nprocs=2)
    assert not failures


def test_a_stand_in_counts_the_copy_that_lays_chunks_out_for_a_reduce_scatter():
    # Rank 0 of two: it gathers its own shard twice, and keeps its own chunk as the sum;
    # the estimate counts the reduce-scatter's layout copy wherever dim is not the
    # first (a batch of one traces what larger batches copy).
    group = TensorParallelGroup(2)
    x = torch.arange(48.0).view(2, 6, 4)
    assert torch.equal(group._all_gather(x, 1, 1), torch.cat([x, x], 1))
    whole, shard = x.numel() * 4, x.numel() * 4 / 2
    for dim, copied in ((0, 0.0), (1, 2 * whole), (2, 2 * whole), (-1, 2 * whole)):
        with MovedBytes(set(), cuda=False) as counter:
            out = group._reduce_scatter(x, dim)
        assert torch.equal(out, x.chunk(2, dim)[0]) and out.is_contiguous()
        assert counter.moved == copied + 2 * shard, dim
    assert group.counts == {"all_gather": 1, "reduce_scatter": 4}
