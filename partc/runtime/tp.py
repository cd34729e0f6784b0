"""Tensor-parallel collectives with their autograd conjugates, as the emitted code calls them.

Every rank of a tensor-parallel group runs the same stage code on its own shards; the
collectives are where the ranks meet. The group is an object, :class:`TensorParallelGroup`,
that the tensor-parallel rewrite puts into the stage as its submodule ``tp``; the
emitted code reads it (``tp = self.tp``) and calls its methods. Each collective is an
``autograd.Function`` whose backward is the conjugate of its forward (Megatron's pairs):

============================  ==========================  ============================
method                        forward                     backward
============================  ==========================  ============================
``copy_to_tp``                identity                    all-reduce
``reduce_from_tp``            all-reduce                  identity (all-reduce if the
                                                          consumer's gradient is partial)
``gather_from_tp``            all-gather on ``dim``       slice (reduce-scatter if the
                                                          consumer's gradient is partial)
``scatter_to_tp``             slice on ``dim``            all-gather
``reduce_scatter_to_tp``      reduce-scatter on ``dim``   all-gather
============================  ==========================  ============================

Under sequence parallelism two calls fuse a collective with the linears beside it and
run it as a ring that hides it behind their matmuls (:mod:`partc.runtime.tp_rings`;
blocking when the group's ``overlap`` is off): ``linears_of_gathered`` (the
column-parallel linears reading one all-gathered shard) and ``linear_reduce_scatter``
(a row-parallel linear reduce-scattered to the sequence shard). They count the
collectives they replace.

Three calls keep less for backward than the ops they stand for: ``dropout`` of a shard
keeps a bool mask of this rank's part only (drawn for the whole tensor, so that it equals
the unsharded program's), and ``linear_of_gathered`` and ``addmm_of_gathered`` (a linear,
or GPT-2's ``Conv1D`` product, of an all-gathered sequence-parallel shard) keep the shard,
in the dtype the product computes in, and all-gather it again in backward.

A shard ``Shard(dim, chunks=k)`` holds this rank's part of each of ``k`` equal pieces of
``dim`` (a fused QKV projection split into query, key and value afterwards); gathers and
slices respect that layout.

A group made without a process group stands in for one of its size: it acts as rank 0
and moves no data, so outputs have the right shapes, which is what measuring on fake
tensors needs (the rewrite inserts such a stand-in). The runtime puts a group over the
real process group in its place (:func:`bind_group`) before the first step. Each group
counts the collectives run through it (``counts``), so a test can compare those of a
step with the plan's. Nothing here is global: two programs in one process each run
over their own group.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from partc.runtime.topology import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE
from partc.runtime.tp_rings import LinearReduceScatter, LinearsOfGathered


class TensorParallelGroup(nn.Module):
    """The tensor-parallel group a stage's collectives run over: ``size`` ranks, this
    process being ``rank`` of them, over ``process_group``; without one, a stand-in
    that acts as rank 0 and moves no data (``simulated``).

    An ``nn.Module`` so that it lives in the stage's GraphModule (as ``tp``) and shows in
    its code; it holds no tensors.
    """

    def __init__(self, size: int, process_group: dist.ProcessGroup | None = None,
                 overlap: bool = True) -> None:
        super().__init__()
        if process_group is not None and dist.get_world_size(process_group) != size:
            raise ValueError(f"a tensor-parallel group of {size} ranks cannot run over a "
                             f"process group of {dist.get_world_size(process_group)}")
        self.size = size
        self.rank = dist.get_rank(process_group) if process_group is not None else 0
        self.process_group = process_group
        self.counts: Counter[str] = Counter()  # collectives run, forward and backward
        # Sequence-parallel linears run their collectives as rings beside the matmuls
        # (:mod:`partc.runtime.tp_rings`); off: blocking (``TrainSpec.tp_overlap``).
        self.overlap = overlap
        # The estimate's measurement of the rings (passes/estimate.py): a stand-in runs
        # the rings its linears run on ranks, each exchange moving nothing (the shapes
        # and the local work, not the data). None, or REHEARSE_BATCH (copying chunks
        # as a batch of several samples does) or REHEARSE_SAMPLE (as the shapes allow).
        self.rehearsing: str | None = None
        self.ring_steps = 0  # exchanges with the ring's neighbours (not collectives)
        self._next = self._previous = None
        # The blocking collectives that run over lists of tensors, not single-tensor.
        # NCCL's list collectives stage through one flat buffer, copied out to (or in
        # from) the list; gloo's single-tensor reduce-scatter is an all-reduce of a copy
        # of the whole: so only gloo's reduce-scatter runs over a list
        # (benchmarks/tp_collectives.py measures both forms).
        self.listed: frozenset[str] = frozenset(
            ("reduce_scatter",) if process_group is not None
            and dist.get_backend(process_group) == "gloo" else ())
        if process_group is not None and size > 1:
            self._next = dist.get_global_rank(process_group, (self.rank + 1) % size)
            self._previous = dist.get_global_rank(process_group, (self.rank - 1) % size)

    @property
    def simulated(self) -> bool:
        """True for a stand-in of more than one rank: it moves no data."""
        return self.process_group is None and self.size > 1

    def extra_repr(self) -> str:
        where = "simulated" if self.simulated else f"rank={self.rank}"
        return f"size={self.size}, {where}" + ("" if self.overlap else ", blocking")

    # ------------------------------------------------------------------------ primitives
    # Collectives without autograd, each counted in ``counts``: the autograd functions
    # below and the rings of partc/runtime/tp_rings.py are made of them.

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The sum (or, ``op="max"``, the maximum) of ``x`` over the group, as a new
        tensor (no autograd conjugate: for the runtime's gradient sums and the
        vocab-parallel loss's statistics; the emitted code calls ``reduce_from_tp``)."""
        self.counts["all_reduce"] += 1
        x = x.contiguous().clone()
        if self.process_group is not None and self.size > 1:
            reduce = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
            dist.all_reduce(x, op=reduce, group=self.process_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int, chunks: int) -> torch.Tensor:
        """The whole of ``x``'s ``Shard(dim, chunks)``. Single-tensor (one shard per
        rank; :attr:`listed` not naming it): the shards gather into one buffer one
        after another, viewed as the whole where they lie so (the first dim, or every
        dim before ``dim`` of size one) and copied into place otherwise; else into one
        tensor per rank, then concatenated. A stand-in makes the whole by that copy from
        its own shard (every rank's, as it acts), which the estimate counts wherever the
        runtime may copy: a batch of one sequence shard traces what larger batches
        copy."""
        self.counts["all_gather"] += 1
        if self.process_group is None or self.size == 1:
            return whole_of([x.contiguous()] * self.size, dim, chunks)
        if chunks != 1 or not x.dim() or "all_gather" in self.listed:
            parts = [torch.empty_like(x, memory_format=torch.contiguous_format)
                     for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous(), group=self.process_group)
            return whole_of(parts, dim, chunks)
        # (gloo wants the ranks' shards stacked on their first dim)
        gathered = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        ALL_GATHER_SINGLE(gathered, x.contiguous(), group=self.process_group)
        dim = dim % x.dim()
        return gathered.view(self.size, *x.shape).movedim(0, dim).flatten(dim, dim + 1)

    def own_shard(self, x: torch.Tensor, dim: int, chunks: int) -> torch.Tensor:
        """This rank's ``Shard(dim, chunks)`` of the whole ``x`` (no communication)."""
        return shard_of(x, dim, chunks, self.rank, self.size).contiguous()

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's chunk of ``dim`` of the sum of ``x`` over the group. Single-tensor
        (:attr:`listed` not naming it): the chunks are laid out one after another for one
        reduce-scatter, a view where they lie so (the first dim, or every dim before
        ``dim`` of size one), a copy of the whole otherwise; else each chunk made
        contiguous (the same copy) for a reduce-scatter of the list. A stand-in copies
        so wherever ``dim`` is not the first (what the estimate counts: a batch of one
        traces what larger batches copy), then keeps a copy of its own chunk as the sum
        (the collective's output)."""
        self.counts["reduce_scatter"] += 1
        dim = dim % x.dim()
        if self.process_group is None or self.size == 1:
            if dim and self.size > 1:
                chunks = x.movedim(dim, 0).clone(memory_format=torch.contiguous_format)
                return chunks.chunk(self.size, 0)[0].movedim(0, dim).clone(
                    memory_format=torch.contiguous_format)
            return x.chunk(self.size, dim)[0].contiguous().clone()
        if x.shape[dim] % self.size or "reduce_scatter" in self.listed:
            parts = [p.contiguous() for p in x.chunk(self.size, dim)]
            out = torch.empty_like(parts[0])
            dist.reduce_scatter(out, parts, group=self.process_group)
            return out
        chunks = x.unflatten(dim, (self.size, -1)).movedim(dim, 0).contiguous()
        out = x.new_empty(chunks.shape[1:])
        REDUCE_SCATTER_SINGLE(out, chunks.flatten(0, 1), group=self.process_group)
        return out

    def ring_exchange(self, send: torch.Tensor, receive: torch.Tensor, tag: int = 0):
        """Send ``send`` to the next rank of the ring and receive ``receive`` from the
        previous one, without waiting: the returned handle's ``wait()`` does (a step of
        a ring in :mod:`partc.runtime.tp_rings`, not a collective of its own)."""
        self.ring_steps += 1
        if self.process_group is None:   # a rehearsal (``rehearsing``)
            return _Exchange([])
        ops = [dist.P2POp(dist.isend, send, self._next, self.process_group, tag),
               dist.P2POp(dist.irecv, receive, self._previous, self.process_group, tag)]
        return _Exchange(dist.batch_isend_irecv(ops))

    # ------------------------------------------------------------- what the code calls

    def copy_to_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Replicated in, replicated out; the gradient, partial on each rank, is all-reduced."""
        return _CopyToTP.apply(x, self)

    def reduce_from_tp(self, x: torch.Tensor, grad_partial: bool = False) -> torch.Tensor:
        """Partial sums in, their all-reduced total out."""
        return _ReduceFromTP.apply(x, self, grad_partial)

    def gather_from_tp(self, x: torch.Tensor, dim: int, chunks: int = 1,
                       grad_partial: bool = False) -> torch.Tensor:
        """Shards on ``dim`` in, the whole tensor out (all-gather)."""
        return _GatherFromTP.apply(x, self, dim, chunks, grad_partial)

    def scatter_to_tp(self, x: torch.Tensor, dim: int, chunks: int = 1) -> torch.Tensor:
        """The whole tensor in, this rank's shard on ``dim`` out (no communication)."""
        return _ScatterToTP.apply(x, self, dim, chunks)

    def reduce_scatter_to_tp(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Partial sums in, this rank's shard of the total on ``dim`` out."""
        return _ReduceScatterToTP.apply(x, self, dim)

    def linear_of_gathered(self, whole: torch.Tensor, shard: torch.Tensor,
                           weight: torch.Tensor, bias: torch.Tensor | None = None,
                           dim: int = 1) -> torch.Tensor:
        """``F.linear(whole, weight, bias)`` where ``whole`` is ``gather_from_tp(shard,
        dim)``: the same output, but backward keeps ``shard`` (cast to the dtype the
        product computes in, as autocast's copy of ``whole`` would be) and all-gathers it
        again for the weight's gradient instead of keeping ``whole`` (Megatron's
        sequence parallelism). The products that read one gathered tensor share one
        gather again in backward."""
        return _ProductOfGathered.apply(whole, shard.detach(), weight, bias, self, dim,
                                        "linear")

    def addmm_of_gathered(self, bias: torch.Tensor | None, whole: torch.Tensor,
                          weight: torch.Tensor, shard: torch.Tensor, dim: int = 1
                          ) -> torch.Tensor:
        """``torch.addmm(bias, whole, weight)`` (GPT-2's ``Conv1D``: ``weight`` is (in,
        out)) where ``whole`` is ``gather_from_tp(shard, dim)`` flattened to a matrix:
        kept and regathered as :meth:`linear_of_gathered` does."""
        return _ProductOfGathered.apply(whole, shard.detach(), weight, bias, self, dim,
                                        "addmm")

    def linears_of_gathered(self, shard: torch.Tensor, weights: tuple, biases: tuple,
                            dim: int = 1) -> tuple[torch.Tensor, ...]:
        """``F.linear(gather_from_tp(shard, dim), w, b)`` for each weight and bias: the
        column-parallel linears that read one gathered sequence-parallel shard, run as
        one ring that hides the all-gather behind their matmuls (and, in backward, the
        shard's second all-gather and the input gradient's reduce-scatter behind the
        gradients' matmuls); keeps the shard for backward, not the whole
        (:class:`partc.runtime.tp_rings.LinearsOfGathered`)."""
        return LinearsOfGathered.apply(shard, self, dim, len(weights), *weights, *biases)

    def linear_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None = None, dim: int = 1
                              ) -> torch.Tensor:
        """``reduce_scatter_to_tp(F.linear(x, weight, bias), dim)`` of a row-parallel
        linear, run as one ring: each rank's chunk of the output computed in ring order
        and summed as it passes (:class:`partc.runtime.tp_rings.LinearReduceScatter`)."""
        return LinearReduceScatter.apply(x, weight, bias, self, dim)

    def vocab_parallel_embedding(self, ids: torch.Tensor, weight: torch.Tensor,
                                 padding_idx: int = -1) -> torch.Tensor:
        """Look up ``ids`` in this rank's rows of a vocabulary-sharded table.

        Ids owned by other ranks give zeros, so the result is this rank's partial sum of
        the full lookup (``reduce_from_tp`` or ``reduce_scatter_to_tp`` completes it).
        """
        rows = weight.shape[0]
        low = self.rank * rows
        outside = (ids < low) | (ids >= low + rows)
        local = (ids - low).masked_fill(outside, 0)
        local_padding = padding_idx - low if 0 <= padding_idx - low < rows else -1
        out = torch.nn.functional.embedding(local, weight,
                                            local_padding if local_padding >= 0 else None)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def global_size(self, x: torch.Tensor, dim: int, index: int | None = None):
        """``x.size()`` (or ``x.size(index)``) as the whole tensor has it, ``x`` sharded
        on ``dim``."""
        sizes = list(x.shape)
        sizes[dim] *= self.size
        if index is not None:
            return sizes[index]
        return torch.Size(sizes)

    def dropout(self, x: torch.Tensor, p: float, train: bool | None, dim: int,
                chunks: int = 1) -> torch.Tensor:
        """Dropout of a tensor sharded as ``Shard(dim, chunks)``: the values of the
        unsharded program's ``x * (mask / keep)`` on this rank's part, with only this
        rank's part of the mask, one byte an element, kept for backward."""
        if not train or p == 0:
            return x
        if p == 1:
            return x * 0
        keep = 1.0 - p
        return _MaskedScale.apply(x, self._local_mask(x, keep, dim, chunks), keep)

    def native_dropout(self, x: torch.Tensor, p: float, train: bool | None, dim: int,
                       chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``aten.native_dropout`` of a sharded tensor: (output, keep-mask)."""
        if not train or p == 0:
            return x.clone(), torch.ones_like(x, dtype=torch.bool)
        keep = 1.0 - p
        mask = self._local_mask(x, keep, dim, chunks)
        # A bool mask: autograd's multiply keeps it (one byte an element), not a float copy.
        return x * mask * (1.0 / keep if keep else 0.0), mask

    def _local_mask(self, x: torch.Tensor, keep: float, dim: int, chunks: int
                    ) -> torch.Tensor:
        """This rank's part of a keep-mask drawn for the whole tensor, as one device
        draws it (``bernoulli_`` over the global shape), so that every rank consumes the
        same random numbers and sharded and unsharded programs drop the same elements.

        The whole mask is drawn as bool: ``bernoulli_`` gives the same elements in every
        dtype for the same generator state (CPU: one seed per call, each element from
        its position; CUDA: the same float draw for bool, half, bfloat16 and float), so
        it equals the noise the unsharded program draws in ``x``'s dtype. Only this
        rank's part is kept (a copy), so the whole one is freed here, not at backward.
        """
        shape = list(x.shape)
        shape[dim] *= self.size
        whole = torch.empty(shape, dtype=torch.bool, device=x.device).bernoulli_(keep)
        if self.size == 1:
            return whole
        part = shard_of(whole, dim, chunks, self.rank, self.size)
        # A view of ``whole`` would keep all of it alive: copy (``cat`` already made one).
        return part.clone(memory_format=torch.contiguous_format) if chunks == 1 else part


class _Exchange:
    """The pending sends and receives of one ring step."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def bind_group(module: nn.Module, group: TensorParallelGroup) -> None:
    """Make ``group`` the group of every collective in ``module``: each
    :class:`TensorParallelGroup` inside it (the rewrite's stand-in ``tp``, and wherever a
    ZeRO unit or a sharded dropout holds it) is replaced by ``group``."""
    for owner in list(module.modules()):
        for name, child in list(owner.named_children()):
            if isinstance(child, TensorParallelGroup) and child is not group:
                if child.size != group.size:
                    raise ValueError(f"{name}: the stage was rewritten for a tensor-parallel "
                                     f"group of {child.size}, not {group.size}")
                setattr(owner, name, group)


# ------------------------------------------------------------------- autograd functions

class _MaskedScale(torch.autograd.Function):
    """``x * (mask / keep)`` with ``mask`` bool: the arithmetic of a dropout that draws
    its noise in ``x``'s dtype and divides it by ``keep`` (so values are those of the
    unsharded program), saving only the bool mask for backward."""

    @staticmethod
    def forward(ctx, x, mask, keep):
        ctx.keep = keep
        ctx.save_for_backward(mask)
        return x * mask.to(x.dtype).div_(keep)

    @staticmethod
    def backward(ctx, grad):
        mask, = ctx.saved_tensors
        return grad * mask.to(grad.dtype).div_(ctx.keep), None, None


class _Regathered:
    """The whole tensor gathered again in backward from a saved shard, shared by the
    linears that read one gathered tensor in forward: gathered by the first of their
    backwards to need it, dropped after the last."""

    def __init__(self) -> None:
        self.readers = 0
        self.whole: torch.Tensor | None = None

    def take(self, group: TensorParallelGroup, shard: torch.Tensor, dim: int
             ) -> torch.Tensor:
        whole = self.whole if self.whole is not None else group.all_gather(shard, dim, 1)
        self.whole = whole
        self.release()
        return whole

    def release(self) -> None:
        """One reader fewer; the last one drops the whole tensor."""
        self.readers -= 1
        if self.readers <= 0:
            self.whole = None


class _ProductOfGathered(torch.autograd.Function):
    """A product of an all-gathered tensor that saves the shard (see
    :meth:`TensorParallelGroup.linear_of_gathered`): ``F.linear`` (``kind="linear"``,
    weight (out, in)) or ``torch.addmm`` (``kind="addmm"``, weight (in, out)). Backward
    computes the gradients as autograd does for the op (the input flattened to a matrix,
    as ``addmm`` runs it), in the dtype the forward computed in (autocast's, where it
    casts); the kept shard is in that dtype already, so regathering it gives autocast's
    copy of the whole."""

    @staticmethod
    def forward(ctx, whole, shard, weight, bias, group, dim, kind):
        if kind == "linear":
            out = torch.nn.functional.linear(whole, weight, bias)
        else:
            out = torch.addmm(bias, whole, weight) if bias is not None else whole.mm(weight)
        # One regather for every product that reads this gathered tensor.
        regathered = whole.__dict__.setdefault("_partc_regathered", _Regathered())
        regathered.readers += 1
        ctx.regathered, ctx.group, ctx.dim, ctx.kind = regathered, group, dim, kind
        ctx.dtypes = (whole.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.compute = out.dtype
        ctx.save_for_backward(shard.to(out.dtype), weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        whole_dtype, weight_dtype, bias_dtype = ctx.dtypes
        needs_whole, _, needs_weight, needs_bias = ctx.needs_input_grad[:4]
        grad2 = grad.reshape(-1, grad.shape[-1])
        # (in, out) as addmm reads it: linear's (out, in) weight transposed.
        matrix = weight.to(ctx.compute)
        matrix = matrix.t() if ctx.kind == "linear" else matrix
        grad_whole = grad_weight = grad_bias = None
        if needs_whole:
            grad_whole = grad2.mm(matrix.t()).view(*grad.shape[:-1], -1).to(whole_dtype)
        if needs_weight:
            whole = ctx.regathered.take(ctx.group, shard, ctx.dim)
            whole2 = whole.reshape(-1, whole.shape[-1])
            grad_weight = whole2.t().mm(grad2)   # (in, out), as autograd computes both
            grad_weight = (grad_weight.t() if ctx.kind == "linear" else grad_weight
                           ).to(weight_dtype)
        else:
            ctx.regathered.release()
        if needs_bias and bias_dtype is not None:
            grad_bias = grad2.sum(0).to(bias_dtype)
        return grad_whole, None, grad_weight, grad_bias, None, None, None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_reduce(grad), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_partial):
        ctx.group, ctx.grad_partial = group, grad_partial
        return group.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return (ctx.group.all_reduce(grad) if ctx.grad_partial else grad), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, chunks, grad_partial):
        ctx.group, ctx.dim, ctx.chunks, ctx.grad_partial = group, dim, chunks, grad_partial
        return group.all_gather(x, dim, chunks)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        if ctx.grad_partial:
            if ctx.chunks != 1:
                grad = group.own_shard(group.all_reduce(grad), ctx.dim, ctx.chunks)
            else:
                grad = group.reduce_scatter(grad, ctx.dim)
        else:
            grad = group.own_shard(grad, ctx.dim, ctx.chunks)
        return grad, None, None, None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, chunks):
        ctx.group, ctx.dim, ctx.chunks = group, dim, chunks
        return group.own_shard(x, dim, chunks)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather(grad, ctx.dim, ctx.chunks), None, None, None


class _ReduceScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return group.reduce_scatter(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather(grad, ctx.dim, 1), None, None


# ------------------------------------------------------------------------ layouts

def shard_of(tensor: torch.Tensor, dim: int, chunks: int, tp_rank: int, tp: int) -> torch.Tensor:
    """Rank ``tp_rank``'s shard of a whole parameter, laid out as ``Shard(dim, chunks)``."""
    if chunks == 1:
        return tensor.chunk(tp, dim)[tp_rank]
    dim = dim % tensor.dim()
    if tp > 1 and tensor.shape[dim] % (chunks * tp) == 0:
        # Every piece splits evenly: the rank's slice of each, gathered by one copy, as
        # the cat below makes it, which issues an op per piece (a head-interleaved weight
        # has one piece per head).
        return tensor.unflatten(dim, (chunks, tp, -1)).select(dim + 1, tp_rank) \
            .clone(memory_format=torch.contiguous_format).flatten(dim, dim + 1)
    return torch.cat([piece.chunk(tp, dim)[tp_rank] for piece in tensor.chunk(chunks, dim)], dim)


def whole_of(parts: list[torch.Tensor], dim: int, chunks: int) -> torch.Tensor:
    """The whole tensor from every rank's shard (in rank order), laid out as
    ``Shard(dim, chunks)``: the inverse of :func:`shard_of`."""
    if chunks == 1:
        return torch.cat(parts, dim)
    # Each rank holds its slice of every piece: piece j is the ranks' j-th slices in order.
    pieces = [p.chunk(chunks, dim) for p in parts]
    return torch.cat([pieces[r][j] for j in range(chunks) for r in range(len(parts))], dim)


class ShardedDropout(nn.Module):
    """``nn.Dropout`` for a tensor sharded as ``Shard(dim, chunks)`` over ``group``
    (see :meth:`TensorParallelGroup.dropout`)."""

    def __init__(self, group: TensorParallelGroup, p: float, dim: int, chunks: int = 1
                 ) -> None:
        super().__init__()
        self.tp = group
        self.p, self.dim, self.chunks = p, dim, chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.dropout(x, self.p, self.training, self.dim, self.chunks)

    def extra_repr(self) -> str:
        return f"p={self.p}, dim={self.dim}, chunks={self.chunks}"
