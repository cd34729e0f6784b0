"""Tensor-parallel collectives with their autograd conjugates, as the emitted code calls them.

Every rank of a tensor-parallel group runs the same stage code on its own shards; these
functions are where the ranks meet. Each is an ``autograd.Function`` whose backward is
the conjugate of its forward (Megatron's pairs):

============================  ==========================  ============================
function                      forward                     backward
============================  ==========================  ============================
``copy_to_tp``                identity                    all-reduce
``reduce_from_tp``            all-reduce                  identity (all-reduce if the
                                                          consumer's gradient is partial)
``gather_from_tp``            all-gather on ``dim``       slice (reduce-scatter if the
                                                          consumer's gradient is partial)
``scatter_to_tp``             slice on ``dim``            all-gather
``reduce_scatter_to_tp``      reduce-scatter on ``dim``   all-gather
============================  ==========================  ============================

A shard ``Shard(dim, chunks=k)`` holds this rank's part of each of ``k`` equal pieces of
``dim`` (a fused QKV projection split into query, key and value afterwards); gathers and
slices respect that layout.

The group comes from :func:`use_group` (the runtime sets it at build time). Without one,
:func:`simulate` stands in a group of a given size that moves no data: outputs have the
right shapes, which is what planning-time measurement on fake tensors needs.
Every call is counted (:func:`counts`), so a test can compare the collectives a step
ran with the plan's.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch
import torch.distributed as dist

_group: dist.ProcessGroup | None = None
_simulated: int | None = None
_counts: Counter = Counter()


def use_group(group: dist.ProcessGroup | None) -> None:
    """Make ``group`` the tensor-parallel group of this process (``None`` clears it)."""
    global _group
    _group = group


@contextlib.contextmanager
def simulate(size: int) -> Iterator[None]:
    """Within the block, act as rank 0 of a group of ``size`` that moves no data."""
    global _simulated
    before, _simulated = _simulated, size
    try:
        yield
    finally:
        _simulated = before


def size() -> int:
    if _simulated is not None:
        return _simulated
    return dist.get_world_size(_group) if _group is not None else 1


def rank() -> int:
    if _simulated is not None or _group is None:
        return 0
    return dist.get_rank(_group)


def counts() -> Counter:
    """Collectives run so far in this process, by kind (forward and backward together)."""
    return Counter(_counts)


def count(kind: str) -> None:
    """Record a collective run outside these functions (the runtime's gradient sums)."""
    _counts[kind] += 1


def reset_counts() -> None:
    _counts.clear()


# ---------------------------------------------------------------------------- primitives

def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    _counts["all_reduce"] += 1
    x = x.contiguous().clone()
    if _simulated is None and size() > 1:
        dist.all_reduce(x, group=_group)
    return x


def _all_gather(x: torch.Tensor, dim: int, chunks: int) -> torch.Tensor:
    _counts["all_gather"] += 1
    n = size()
    if _simulated is not None or n == 1:
        parts = [x.contiguous()] * n
    else:
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=_group)
    return whole_of(parts, dim, chunks)


def _slice(x: torch.Tensor, dim: int, chunks: int) -> torch.Tensor:
    n, r = size(), rank()
    if chunks == 1:
        return x.chunk(n, dim)[r].contiguous()
    return torch.cat([piece.chunk(n, dim)[r] for piece in x.chunk(chunks, dim)], dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int) -> torch.Tensor:
    _counts["reduce_scatter"] += 1
    n = size()
    if _simulated is not None or n == 1:
        return x.chunk(n, dim)[0].contiguous().clone()
    parts = [p.contiguous() for p in x.chunk(n, dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=_group)
    return out


# ------------------------------------------------------------------- autograd functions

class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad)


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grad_partial):
        ctx.grad_partial = grad_partial
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return (_all_reduce(grad) if ctx.grad_partial else grad), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks, grad_partial):
        ctx.dim, ctx.chunks, ctx.grad_partial = dim, chunks, grad_partial
        return _all_gather(x, dim, chunks)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_partial:
            if ctx.chunks != 1:
                grad = _slice(_all_reduce(grad), ctx.dim, ctx.chunks)
            else:
                grad = _reduce_scatter(grad, ctx.dim)
        else:
            grad = _slice(grad, ctx.dim, ctx.chunks)
        return grad, None, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, chunks):
        ctx.dim, ctx.chunks = dim, chunks
        return _slice(x, dim, chunks)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.chunks), None, None


class _ReduceScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):
        ctx.dim = dim
        return _reduce_scatter(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, 1), None


def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
    """Replicated in, replicated out; the gradient, partial on each rank, is all-reduced."""
    return _CopyToTP.apply(x)


def reduce_from_tp(x: torch.Tensor, grad_partial: bool = False) -> torch.Tensor:
    """Partial sums in, their all-reduced total out."""
    return _ReduceFromTP.apply(x, grad_partial)


def gather_from_tp(x: torch.Tensor, dim: int, chunks: int = 1,
                   grad_partial: bool = False) -> torch.Tensor:
    """Shards on ``dim`` in, the whole tensor out (all-gather)."""
    return _GatherFromTP.apply(x, dim, chunks, grad_partial)


def scatter_to_tp(x: torch.Tensor, dim: int, chunks: int = 1) -> torch.Tensor:
    """The whole tensor in, this rank's shard on ``dim`` out (no communication)."""
    return _ScatterToTP.apply(x, dim, chunks)


def reduce_scatter_to_tp(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Partial sums in, this rank's shard of the total on ``dim`` out."""
    return _ReduceScatterToTP.apply(x, dim)


# ------------------------------------------------------------------------ sharded ops

def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor,
                             padding_idx: int = -1) -> torch.Tensor:
    """Look up ``ids`` in this rank's rows of a vocabulary-sharded table.

    Ids owned by other ranks give zeros, so the result is this rank's partial sum of the
    full lookup (``reduce_from_tp`` or ``reduce_scatter_to_tp`` completes it).
    """
    rows = weight.shape[0]
    low = rank() * rows
    outside = (ids < low) | (ids >= low + rows)
    local = (ids - low).masked_fill(outside, 0)
    local_padding = padding_idx - low if 0 <= padding_idx - low < rows else -1
    out = torch.nn.functional.embedding(local, weight, local_padding if local_padding >= 0 else None)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def global_size(x: torch.Tensor, dim: int, index: int | None = None):
    """``x.size()`` (or ``x.size(index)``) as the whole tensor has it, ``x`` sharded on ``dim``."""
    sizes = list(x.shape)
    sizes[dim] *= size()
    if index is not None:
        return sizes[index]
    return torch.Size(sizes)


def shard_of(tensor: torch.Tensor, dim: int, chunks: int, tp_rank: int, tp: int) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of a whole parameter, laid out as ``Shard(dim, chunks)``."""
    if chunks == 1:
        return tensor.chunk(tp, dim)[tp_rank]
    return torch.cat([piece.chunk(tp, dim)[tp_rank] for piece in tensor.chunk(chunks, dim)], dim)


def whole_of(parts: list[torch.Tensor], dim: int, chunks: int) -> torch.Tensor:
    """The whole tensor from every rank's shard (in rank order), laid out as
    ``Shard(dim, chunks)``: the inverse of :func:`shard_of`."""
    if chunks == 1:
        return torch.cat(parts, dim)
    # Each rank holds its slice of every piece: piece j is the ranks' j-th slices in order.
    pieces = [p.chunk(chunks, dim) for p in parts]
    return torch.cat([pieces[r][j] for j in range(chunks) for r in range(len(parts))], dim)


def _global_mask(x: torch.Tensor, keep: float, dim: int, chunks: int) -> torch.Tensor:
    """This rank's part of a keep-mask drawn for the whole tensor, as one device draws
    it (``bernoulli_`` over the global shape), so that every rank consumes the same
    random numbers and sharded and unsharded programs drop the same elements."""
    shape = list(x.shape)
    shape[dim] *= size()
    noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(keep)
    return shard_of(noise, dim, chunks, rank(), size())


def dropout(x: torch.Tensor, p: float, train: bool | None, dim: int, chunks: int = 1
            ) -> torch.Tensor:
    """Dropout of a tensor sharded as ``Shard(dim, chunks)``."""
    if not train or p == 0:
        return x
    if p == 1:
        return x * 0
    keep = 1.0 - p
    return x * _global_mask(x, keep, dim, chunks).div_(keep)


def native_dropout(x: torch.Tensor, p: float, train: bool | None, dim: int, chunks: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.native_dropout`` of a sharded tensor: (output, keep-mask)."""
    if not train or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    keep = 1.0 - p
    mask = _global_mask(x, keep, dim, chunks)
    return x * mask * (1.0 / keep if keep else 0.0), mask.bool()


class ShardedDropout(torch.nn.Module):
    """``nn.Dropout`` for a tensor sharded as ``Shard(dim, chunks)`` (see :func:`dropout`)."""

    def __init__(self, p: float, dim: int, chunks: int = 1) -> None:
        super().__init__()
        self.p, self.dim, self.chunks = p, dim, chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, self.dim, self.chunks)

    def extra_repr(self) -> str:
        return f"p={self.p}, dim={self.dim}, chunks={self.chunks}"
