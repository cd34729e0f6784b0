"""Sequence-parallel linears fused with their collectives, computed as rings (Megatron's
tensor-parallel communication overlap).

Under sequence parallelism a column-parallel linear reads the all-gather of the
sequence shards, and a row-parallel linear's partial sums are reduce-scattered back to
them. Run blocking, each collective waits for the whole tensor before (or after) the
matmul next to it. Here the two are one ring over the ``n`` ranks of the group: the
sequence is cut into the ``n`` shards, and while the matmul of the chunk already here
runs, the next one travels (``n - 1`` exchanges with the neighbours, each hidden behind
one chunk's matmul):

=========================  ===============================  ===============================
call                       forward                          backward
=========================  ===============================  ===============================
``linears_of_gathered``    ring all-gather of the shard;    ring all-gather of the shard
(column-parallel)          each arriving chunk's rows of    again (each chunk's weight
                           every linear's output computed   gradient while the next comes)
                           while the next one comes         and ring reduce-scatter of the
                                                            input gradient (each rank's
                                                            partial of the chunk the next
                                                            rank sums computed while the
                                                            previous partial travels)
``linear_reduce_scatter``  ring reduce-scatter fused with   ring all-gather of the output
(row-parallel)             the matmul: the partial output   gradient; each chunk's input
                           chunk destined for each rank     and weight gradients while the
                           computed in ring order, summed   next one comes
                           as it passes
=========================  ===============================  ===============================

The results are those of the blocking calls up to the order of summation (a weight
gradient summed over chunks, a partial sum over ranks in ring order). With
``group.overlap`` off, and for a stand-in group (which moves no data) unless it
rehearses the rings for the estimate (``group.rehearsing``), the same calls run
blocking: the all-gather, then the matmuls; the matmul, then the reduce-scatter.
Either way each call counts the collectives it stands for in ``group.counts``, as the
blocking program runs them.

The linears compute as ``F.linear`` (autocast applies to the forward); backward
computes in the forward's dtype, as :class:`partc.runtime.tp._LinearOfGathered` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # a cycle: partc.runtime.tp imports this module for its rings
    from partc.runtime.tp import TensorParallelGroup


def _rows(x: torch.Tensor, dim: int, index: int, size: int) -> torch.Tensor:
    """Chunk ``index`` of ``x``'s ``dim`` cut in pieces of ``size``."""
    return x.narrow(dim, index * size, size)


def _gathered(chunk: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """An empty tensor of ``size`` chunks like ``chunk`` along ``dim``, for a ring to put
    each one in place as it comes."""
    shape = list(chunk.shape)
    shape[dim] *= size
    return chunk.new_empty(shape)


def _own(x: torch.Tensor) -> torch.Tensor:
    """``x``, no view: a linear over a batch of sequences returns its matrix product
    reshaped, a view of a temporary, and a custom Function's output that is a view
    cannot be written in place after it (a ReLU(inplace=True) on a projection). The
    same storage, no copy (what ``matmul`` itself returns)."""
    return torch.ops.aten._unsafe_view(x, x.shape) if x._is_view() else x


def _matrix(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


# How a stand-in rehearses the rings for the estimate (TensorParallelGroup.rehearsing):
# its chunks copied into place wherever a batch of several samples copies them, or
# received and written in place wherever its own shapes allow (one sample's).
REHEARSE_BATCH = "batch"
REHEARSE_SAMPLE = "sample"


def _in_place(group: "TensorParallelGroup", place: torch.Tensor, dim: int) -> bool:
    """Whether a chunk of ``dim`` can be received or written straight into ``place``:
    one contiguous block (``dim`` the first, or every dim before it of size one: one
    sample). A stand-in rehearsing a batch (:data:`REHEARSE_BATCH`) copies wherever
    ``dim`` is not the first, as a batch of several samples does whatever shapes it
    traced."""
    return place.is_contiguous() and not (group.rehearsing == REHEARSE_BATCH
                                          and dim % place.dim() > 0)


def _same_dtype(place: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.dtype == place.dtype for t in tensors)


def _linear_into(place: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, direct: bool) -> None:
    """``place[...] = F.linear(x, weight, bias)``: the matmul writing straight into
    ``place`` where it can (``direct``: :func:`_in_place`) and the dtypes agree, else
    computed and copied there."""
    if direct and _same_dtype(place, x, weight, bias):
        if bias is None:
            torch.mm(_matrix(x), weight.t(), out=_matrix(place))
        else:
            torch.addmm(bias, _matrix(x), weight.t(), out=_matrix(place))
    else:
        place.copy_(F.linear(x, weight, bias))


def _matmul_into(place: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 direct: bool) -> None:
    """``place[...] = x @ weight``, into ``place`` as :func:`_linear_into` writes."""
    if direct and _same_dtype(place, x, weight):
        torch.mm(_matrix(x), weight, out=_matrix(place))
    else:
        place.copy_(x.matmul(weight))


def _plus_matmul(total: torch.Tensor | None, x: torch.Tensor,
                 weight: torch.Tensor) -> torch.Tensor:
    """``total + x @ weight`` (``x @ weight`` for no ``total``: the input gradient of
    linears reading one input, summed over them), the sum in the matmul's epilogue where
    the dtypes agree (one kernel, ``total`` read once) rather than an add of its own."""
    if total is None:
        return x.matmul(weight)
    if _same_dtype(total, x, weight):
        return torch.addmm(_matrix(total), _matrix(x), weight).view(total.shape)
    return total + x.matmul(weight)


def _ring(group: "TensorParallelGroup", held: torch.Tensor,
          visit: Callable[[int, torch.Tensor], None], whole: torch.Tensor | None = None,
          dim: int = 0) -> None:
    """Pass ``held`` around the group: ``visit(rank, chunk)`` for every rank's chunk in
    ring order, this rank's first, each while the next chunk is in flight. With
    ``whole`` (room for every rank's chunk along ``dim``: :func:`_gathered`) each chunk
    is also put in its place there, received straight into it where it can be
    (:func:`_in_place`), else copied there."""
    size, rank = group.size, group.rank
    rows = held.shape[dim]
    if whole is not None:
        _rows(whole, dim, rank, rows).copy_(held)
    for step in range(size):
        exchange = place = None
        if step < size - 1:
            if whole is not None:
                place = _rows(whole, dim, (rank - step - 1) % size, rows)
            arriving = place if place is not None and _in_place(group, place, dim) \
                else torch.empty_like(held)
            exchange = group.ring_exchange(held, arriving)
        visit((rank - step) % size, held)
        if exchange is not None:
            exchange.wait()
            if place is not None and arriving is not place:
                place.copy_(arriving)
            held = arriving


def _ring_sum(group: "TensorParallelGroup", partial: Callable[[int], torch.Tensor]
              ) -> torch.Tensor:
    """This rank's chunk of a sum over the group, each rank's ``partial(chunk)`` summed
    around the ring: at step ``s`` this rank computes its partial of chunk ``rank - s -
    1`` while the running sum of that chunk comes from the previous rank, adds it and
    passes it on; after ``n - 1`` steps the sum of chunk ``rank`` is here. (The add
    stays a kernel of its own: summing in the matmul's epilogue would wait for the
    running sum before the matmul that should hide its transfer.)"""
    size, rank = group.size, group.rank
    exchange, arriving = None, None
    for step in range(size):
        local = partial((rank - step - 1) % size)
        if exchange is not None:
            exchange.wait()
            local = local + arriving
        if step == size - 1:
            return local
        local = local.contiguous()
        arriving = torch.empty_like(local)
        exchange = group.ring_exchange(local, arriving)
    raise AssertionError("a ring of no ranks")


def _rings(group: "TensorParallelGroup") -> bool:
    """Whether the group runs the ring (else the blocking collectives): over a process
    group, or a stand-in rehearsing them for the estimate."""
    return group.overlap and group.size > 1 and (group.process_group is not None
                                                 or group.rehearsing is not None)


class LinearsOfGathered(torch.autograd.Function):
    """``F.linear(gather_from_tp(shard, dim), weight_i, bias_i)`` for each linear reading
    one gathered sequence-parallel shard; saves the shard, not the whole."""

    @staticmethod
    def forward(ctx, shard, group, dim, count, *params):
        weights, biases = params[:count], params[count:]
        if _rings(group):
            group.counts["all_gather"] += 1
            outs = _ring_linears(group, shard, dim, weights, biases)
        else:
            whole = group.all_gather(shard, dim, 1)
            outs = [_own(F.linear(whole, w, b)) for w, b in zip(weights, biases)]
        ctx.group, ctx.dim, ctx.count = group, dim, count
        ctx.dtypes = (shard.dtype, tuple(w.dtype for w in weights),
                      tuple(None if b is None else b.dtype for b in biases))
        ctx.compute = outs[0].dtype
        ctx.save_for_backward(shard, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        shard, *weights = ctx.saved_tensors
        group, dim, compute = ctx.group, ctx.dim, ctx.compute
        shard_dtype, weight_dtypes, bias_dtypes = ctx.dtypes
        weights = [w.to(compute) for w in weights]
        grads = [g.to(compute) for g in grads]
        if _rings(group):
            group.counts["all_gather"] += 1
            group.counts["reduce_scatter"] += 1
            grad_shard, grad_weights = _ring_linears_backward(group, shard.to(compute), dim,
                                                              weights, grads)
        else:
            whole = _matrix(group.all_gather(shard, dim, 1).to(compute))
            grad_whole = sum(g.matmul(w) for g, w in zip(grads, weights))
            grad_shard = group.reduce_scatter(grad_whole, dim)
            grad_weights = [_matrix(g).t().mm(whole) for g in grads]
        grad_biases = [None if dtype is None else _matrix(g).sum(0).to(dtype)
                       for g, dtype in zip(grads, bias_dtypes)]
        grad_weights = [g.to(dtype) for g, dtype in zip(grad_weights, weight_dtypes)]
        return (grad_shard.to(shard_dtype), None, None, None, *grad_weights, *grad_biases)


def _ring_linears(group: "TensorParallelGroup", shard: torch.Tensor, dim: int,
                  weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
                  ) -> list[torch.Tensor]:
    rows = shard.shape[dim]
    outs: list[torch.Tensor] = []

    def visit(rank: int, chunk: torch.Tensor) -> None:
        for index, (w, b) in enumerate(zip(weights, biases)):
            if len(outs) <= index:   # the first chunk's result gives the output's dtype
                part = F.linear(chunk, w, b)
                outs.append(_gathered(part, dim, group.size))
                _rows(outs[index], dim, rank, rows).copy_(part)
            else:
                place = _rows(outs[index], dim, rank, rows)
                _linear_into(place, chunk, w, b, _in_place(group, place, dim))

    _ring(group, shard.contiguous(), visit)
    return outs


def _ring_linears_backward(group: "TensorParallelGroup", shard: torch.Tensor, dim: int,
                           weights: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
                           ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The shard's gradient (ring reduce-scatter of the input gradient, each partial
    computed while the previous one travels) and the weights' (one product each over the
    shard's ring all-gather, its chunks put in place as they come). Accumulating a
    weight's gradient chunk by chunk would read and write all of it once per rank: more
    than the gathered input at small batches (a 177B layer's at tp = 8: 1.8 GB against
    0.2 GB a microbatch of one sequence)."""
    rows = shard.shape[dim]
    whole = _gathered(shard, dim, group.size)

    def input_grad(chunk: int) -> torch.Tensor:
        total = None
        for g, w in zip(grads, weights):
            total = _plus_matmul(total, _rows(g, dim, chunk, rows), w)
        return total

    # The two rings advance together: at each step of the shard's all-gather (_ring:
    # its chunks land in ``whole``) the input gradient's partial for the next rank runs
    # while both rings' transfers are in flight.
    size = group.size
    step, total, passing, incoming = 0, None, None, None

    def visit(owner: int, _chunk: torch.Tensor) -> None:
        nonlocal step, total, passing, incoming
        local = input_grad((owner - 1) % size)
        if passing is not None:
            passing.wait()
            local = local + incoming
        if step < size - 1:
            local = local.contiguous()
            incoming = torch.empty_like(local)
            passing = group.ring_exchange(local, incoming, tag=1)
        else:
            total = local
        step += 1

    _ring(group, shard.contiguous(), visit, whole, dim)
    return total, [_matrix(g).t().mm(_matrix(whole)) for g in grads]


class LinearReduceScatter(torch.autograd.Function):
    """``reduce_scatter_to_tp(F.linear(x, weight, bias), dim)`` of a row-parallel linear:
    this rank's chunk of ``dim`` of the output summed over the group."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, dim):
        if _rings(group):
            group.counts["reduce_scatter"] += 1
            rows = x.shape[dim] // group.size
            out = _ring_sum(group, lambda c: F.linear(_rows(x, dim, c, rows), weight, bias))
        else:
            out = group.reduce_scatter(F.linear(x, weight, bias), dim)
        ctx.group, ctx.dim, ctx.compute = group, dim, out.dtype
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group, dim, compute = ctx.group, ctx.dim, ctx.compute
        x_dtype, weight_dtype, bias_dtype = ctx.dtypes
        x, weight, grad = x.to(compute), weight.to(compute), grad.to(compute)
        if _rings(group):
            group.counts["all_gather"] += 1
            rows = grad.shape[dim]
            grad_x = torch.empty_like(x)
            whole = _gathered(grad, dim, group.size)

            def visit(rank: int, chunk: torch.Tensor) -> None:
                place = _rows(grad_x, dim, rank, rows)
                _matmul_into(place, chunk, weight, _in_place(group, place, dim))

            # The weight's and bias's gradients as one product and one sum over the
            # gathered output gradient (see _ring_linears_backward).
            _ring(group, grad.contiguous(), visit, whole, dim)
            grad_weight = _matrix(whole).t().mm(_matrix(x))
            grad_bias = _matrix(whole).sum(0)
        else:
            whole = group.all_gather(grad, dim, 1)
            grad_x = whole.matmul(weight)
            grad_weight = _matrix(whole).t().mm(_matrix(x))
            grad_bias = _matrix(whole).sum(0)
        return (grad_x.to(x_dtype), grad_weight.to(weight_dtype),
                None if bias_dtype is None else grad_bias.to(bias_dtype), None, None)
