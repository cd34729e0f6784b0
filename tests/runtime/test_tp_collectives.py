"""The tensor-parallel group's blocking all-gather and reduce-scatter: single-tensor and
over lists, on two gloo processes, against the collectives' definitions, for batch-first
activations of one and more samples and every dim; what a stand-in (the estimate's
group) counts of them; and a stand-in rehearsing the rings launches and moves what a
rank running them does."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from partc.passes.helpers.op_bytes import MovedBytes
from partc.runtime import topology
from partc.runtime.tp import TensorParallelGroup
from partc.runtime.tp_rings import REHEARSE_BATCH, REHEARSE_SAMPLE

SHAPES = ((1, 6, 4), (3, 6, 4), (2, 4, 6))


def _worker(rank: int, world: int, path: str, failures) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank,
                            world_size=world)
    try:
        _collectives_agree(rank, world)
    except AssertionError as error:
        failures.append(f"rank {rank}: {error!r}")
        raise
    finally:
        # The groups went with the helper's frame: leaving joins their gloo
        # threads before the interpreter shuts down.
        topology.leave()


def _collectives_agree(rank: int, world: int) -> None:
    """``_worker``'s checks, in a frame of their own: the groups they hold go when it
    returns."""
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
                gathered = group.all_gather(x, dim, 1)
                assert gathered.is_contiguous() and torch.equal(
                    gathered, torch.cat(parts, dim)), (listed, shape, dim)
                total = x.clone()
                dist.all_reduce(total)
                scattered = group.reduce_scatter(x, dim)
                assert scattered.is_contiguous(), (listed, shape, dim)
                torch.testing.assert_close(scattered, total.chunk(world, dim)[rank])


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
    assert torch.equal(group.all_gather(x, 1, 1), torch.cat([x, x], 1))
    whole, shard = x.numel() * 4, x.numel() * 4 / 2
    for dim, copied in ((0, 0.0), (1, 2 * whole), (2, 2 * whole), (-1, 2 * whole)):
        with MovedBytes(set(), cuda=False) as counter:
            out = group.reduce_scatter(x, dim)
        assert torch.equal(out, x.chunk(2, dim)[0]) and out.is_contiguous()
        assert counter.moved == copied + 2 * shard, dim
    assert group.counts == {"all_gather": 1, "reduce_scatter": 4}


def _shard(samples: int, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A sequence shard of 3 positions: batch-first (sharded on dim 1) or sequence-first
    (dim 0)."""
    shape = (samples, 3, 8) if dim == 1 else (3, samples, 8)
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


def _sequence_parallel_block(group: TensorParallelGroup, samples: int, dim: int):
    """A column-parallel linear reading the gathered shard, then a row-parallel one
    reduce-scattered back, forward and backward, counted as the estimate counts ops:
    (bytes moved, kernels launched)."""
    torch.manual_seed(0)
    shard = _shard(samples, dim)
    up, bias = torch.randn(6, 8, requires_grad=True), torch.randn(6, requires_grad=True)
    down = torch.randn(8, 6, requires_grad=True)
    with MovedBytes(set(), cuda=False) as counted:
        (hidden,) = group.linears_of_gathered(shard, (up,), (bias,), dim)
        group.linear_reduce_scatter(hidden.relu(), down, None, dim).sum().backward()
    return counted.moved, counted.kernels


def _values(group: TensorParallelGroup, samples: int, dim: int, dtype: torch.dtype):
    """The block's output and every gradient, on this rank's values."""
    torch.manual_seed(1 + dist.get_rank())
    shard = _shard(samples, dim, dtype)
    torch.manual_seed(0)   # the weights alike on every rank, as after a broadcast
    up = torch.randn(6, 8, dtype=dtype, requires_grad=True)
    gate = torch.randn(6, 8, dtype=dtype, requires_grad=True)
    bias = torch.randn(6, dtype=dtype, requires_grad=True)
    down = torch.randn(8, 6, dtype=dtype, requires_grad=True)
    downs_bias = torch.randn(8, dtype=dtype, requires_grad=True)
    first, second = group.linears_of_gathered(shard, (up, gate), (bias, None), dim)
    out = group.linear_reduce_scatter(first.relu() * second, down, downs_bias, dim)
    (out * torch.arange(out.numel(), dtype=dtype).view_as(out)).sum().backward()
    return [out.detach()] + [t.grad for t in (shard, up, gate, bias, down, downs_bias)]


def _rings_worker(rank: int, world: int, path: str, found) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank,
                            world_size=world)
    try:
        _rings_agree(rank, world, found)
    finally:
        # The groups went with the helper's frame: leaving joins their gloo
        # threads before the interpreter shuts down.
        topology.leave()


def _rings_agree(rank: int, world: int, found) -> None:
    """``_rings_worker``'s checks, in a frame of their own: the groups they hold go when
    it returns."""
    for samples, dim in itertools.product((1, 2), (1, 0)):
        # The rings compute what the blocking collectives do, a chunk received and
        # written in place where it is contiguous (one sample, or sequence-first),
        # else copied.
        for dtype, tolerance in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
            ring = _values(TensorParallelGroup(world, dist.group.WORLD), samples, dim,
                           dtype)
            blocking = _values(TensorParallelGroup(world, dist.group.WORLD,
                                                   overlap=False), samples, dim, dtype)
            for got, want in zip(ring, blocking):
                torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
        ring = TensorParallelGroup(world, dist.group.WORLD)
        real = _sequence_parallel_block(ring, samples, dim)
        rehearsal, as_is = TensorParallelGroup(world), TensorParallelGroup(world)
        rehearsal.rehearsing, as_is.rehearsing = REHEARSE_BATCH, REHEARSE_SAMPLE
        found.append((rank, samples, dim, real,
                      _sequence_parallel_block(rehearsal, samples, dim),
                      _sequence_parallel_block(as_is, samples, dim),
                      _sequence_parallel_block(TensorParallelGroup(world), samples, dim),
                      ring.ring_steps, rehearsal.ring_steps, rehearsal.counts == ring.counts))


def test_rings_compute_what_blocking_does_and_a_rehearsal_counts_them(tmp_path):
    """On two gloo ranks the rings give the blocking collectives' outputs and gradients
    (a chunk of one sample written in place, of two copied), and the estimate, which
    prices the rings' local work (``LayerCost.ring_kernels``) by running each ring call
    again with its stand-in rehearsing them, counts the same ops as a rank of a real
    ring of more than one sample (sequence-first: of any) rehearsing a batch, and of its
    own shapes rehearsing them as they are, exchanges apart (communication is priced on
    its own)."""
    found = mp.Manager().list()
    mp.spawn(_rings_worker, args=(2, str(tmp_path / "store"), found), nprocs=2)
    assert len(found) == 8
    for (rank, samples, dim, real, rehearsed, as_is, blocking, steps, rehearsed_steps,
         same) in found:
        where = (rank, samples, dim)
        assert as_is == real, where
        if samples > 1 or dim == 0:
            assert rehearsed == real, where
        else:   # one sample's chunks are received and written in place, which a batch's
            # rehearsal copies as batches of several samples do
            assert rehearsed[0] > real[0] and rehearsed[1] > real[1], where
        assert steps == rehearsed_steps > 0 and same
        # Each ring runs a matmul and a copy or an add per chunk: more kernels than the
        # blocking calls the stand-in runs otherwise.
        assert rehearsed[1] > blocking[1], where
