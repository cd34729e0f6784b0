"""Gradient buckets over data parallelism, and ZeRO-1's distributed optimizer.

Under ZeRO 0/1 with dp > 1 the stage's gradients are accumulated, microbatch after
microbatch, into flat fp32 buckets (:class:`GradBuckets`): a hook on each parameter
(``register_post_accumulate_grad_hook``) adds the gradient autograd just produced into
the parameter's slots of its bucket and drops it. During the step's last backward a
bucket's collective is issued (asynchronously) as soon as every parameter in it has its
gradient, so it overlaps the rest of that backward:

- ZeRO-0: the bucket is all-reduced; the parameters' ``.grad`` are then views of it, so
  any ``torch.optim`` optimizer over ``module.parameters()`` steps as on one device;
- ZeRO-1: the bucket is reduce-scattered. A bucket is laid out rank by rank: rank r's
  region holds, for each of the bucket's parameters, its dp shard (FSDP's: rows
  ``chunk(dp)[r]`` of dim 0, padded to the chunk size; a 0-dim parameter in every region),
  so after the reduce-scatter each rank holds the summed gradient of its shards (``.grad``
  stays None: a plain optimizer's step is refused, ``partc/runtime/rank_optimizer.py``).
  :class:`DistributedOptimizer` steps those shards with the user's optimizer class and
  all-gathers the updated rows bucket by bucket, every bucket's all-gather issued before
  the first is waited for. In fp32 its parameters are views of this rank's rows of the
  module's parameters (which are their own master). In mixed precision it is Megatron's
  distributed optimizer: this rank's rows are an fp32 master of their own, the module's
  parameters are kept in the compute dtype (the stage computes with them, with no per-step
  copy), and the all-gather moves compute-dtype rows, cast from the masters.

  As Megatron's ``overlap_param_gather`` (``TrainSpec.overlap_param_gather``, on by
  default), ``step()`` returns with those all-gathers in flight, issued in the order
  forward reads the buckets: forward pre-hooks (:func:`wait_in_forward`) on each layer's
  module wait for the buckets of its parameters just before it runs, so the next
  step's forward overlaps the rest. Anything else reading the parameters first finishes
  them all (:meth:`GradBuckets.wait_gathers`: ``DistributedModule`` does so when it hands
  out parameters, saves or loads a checkpoint, evaluates).

Routed expert weights (expert parallelism) are in buckets of their own, reduced over
their expert-data-parallel group (the ranks holding the same experts) instead of dp and
under ZeRO-1 sharded over it; their gradients are divided by dp all the same.

Buckets are filled in reverse parameter order (the order backward produces gradients),
each up to ``TrainSpec.bucket_elements`` elements (the plan's training setup; the plan
prices that many). The bytes per parameter this keeps
(``partc.problem.Precision`` prices them): the parameter (4), its fp32 gradient bucket
slot (4; ZeRO-1's padding aside) and, under ZeRO-1, the optimizer state of 1/dp of it;
under ZeRO-1 in bf16 with Adam, 2 + 4 + (4 + 8)/dp as Megatron's (the bf16 parameter,
the fp32 gradient, 1/dp of the fp32 master and of the state).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from partc.errors import PartcError
from partc.problem import BUCKET_ELEMENTS
from partc.runtime.offload import HostTier
from partc.runtime.parameters import dp_shard
from partc.runtime.topology import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE


class _Slot:
    """One parameter in a bucket: for each dp rank, the rows of the parameter that rank
    holds (as a flat range of the parameter) and where they sit in its region."""

    def __init__(self, param: nn.Parameter, dp: int, sharded: bool, offset: int) -> None:
        self.param = param
        self.offset = offset  # within each rank's region
        numel = param.numel()
        if not sharded:
            self.ranges = [(0, numel)]
            self.width = numel
        elif param.dim() == 0:  # every rank holds (and steps) it whole
            self.ranges = [(0, 1)] * dp
            self.width = 1
        else:
            rows = param.shape[0]
            row = numel // rows if rows else 0
            chunk = math.ceil(rows / dp) if rows else 0
            self.ranges = [(min(r * chunk, rows) * row, min((r + 1) * chunk, rows) * row)
                           for r in range(dp)]
            self.width = chunk * row
        # The first `whole` ranks hold full chunks; the next one a short last chunk of
        # `rest` elements, if any (the later ranks hold nothing).
        self.whole = sum(end - start == self.width for start, end in self.ranges)
        self.rest = next((end - start for start, end in self.ranges
                          if 0 < end - start < self.width), 0)
        self.everywhere = sharded and param.dim() == 0

    def rank_view(self, region: torch.Tensor, rank: int) -> torch.Tensor:
        """This parameter's part held by ``rank``, in ``region`` (that rank's region)."""
        start, end = self.ranges[rank]
        return region[self.offset:self.offset + end - start]

    def columns(self, regions: torch.Tensor) -> torch.Tensor:
        """This parameter's place in every region of ``regions`` (a bucket's buffer
        viewed as one row per region): one row per rank, ``width`` wide."""
        return regions[:, self.offset:self.offset + self.width]

    def pieces(self, columns: torch.Tensor,
               flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``columns`` (one row per rank, ``width`` wide: :meth:`columns`, or an
        all-gather of one parameter's shards) paired with the same elements of ``flat``
        (the parameter, flattened), as at most two pairs of equal-shaped views: every
        rank's full chunk at once, then the short last chunk. One kernel each, however
        many ranks (a rank-by-rank loop would launch dp of them per parameter and
        microbatch). Not for a 0-dim parameter held whole everywhere (``everywhere``)."""
        found = []
        if self.whole and self.width:
            found.append((columns[:self.whole],
                          flat[:self.whole * self.width].view(self.whole, self.width)))
        if self.rest:
            start = self.whole * self.width
            found.append((columns[self.whole, :self.rest], flat[start:start + self.rest]))
        return found


class _Bucket:
    """Parameters whose gradients are reduced together over ``group`` (None: the dp
    group), of whose ranks this one is ``rank``; ``shards`` regions when sharded (the
    group's size), else one."""

    def __init__(self, slots: list[_Slot], shards: int, rank: int, group: Any,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.slots = slots
        self.shards, self.rank, self.group = shards, rank, group
        self.region = sum(s.width for s in slots)
        self.buffer = torch.zeros(self.region * shards, dtype=dtype, device=device)
        self.ready = 0
        self.work: Any = None

    def region_of(self, rank: int) -> torch.Tensor:
        return self.buffer[rank * self.region:(rank + 1) * self.region]

    def regions(self, flat: torch.Tensor | None = None) -> torch.Tensor:
        """``flat`` (the buffer, or a tensor laid out as it is) as one row per region."""
        return (self.buffer if flat is None else flat).view(self.shards, self.region)


class GradBuckets:
    """This stage's gradients in fp32 buckets, reduced over the dp group bucket by bucket
    during the step's last backward (see the module's doc). ``sharded``: ZeRO-1's
    reduce-scatter (each rank keeps its shards' gradients) instead of an all-reduce.

    The pipeline stage calls :meth:`begin` before each microbatch's backward (``last``:
    the step's last), and :meth:`finish` after the last, before anything reads the
    gradients."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, dp: int, dp_rank: int,
                 *, sharded: bool, elements: int | None = None,
                 at_end: set[int] = frozenset(),
                 groups: Mapping[int, Any] | None = None,
                 host: HostTier | None = None) -> None:
        """``at_end``: ids of parameters whose gradient comes from several backwards of
        one microbatch (a weight two virtual stages of the rank share): their buckets
        are reduced in :meth:`finish` only. (A split backward's weight gradients, made
        outside autograd's accumulation hooks, are handed over by :meth:`take`.)
        ``groups``: parameter id → the group its gradient is summed over instead of the
        dp group (a routed expert's weights: the expert-data-parallel group, whose ranks
        hold the same experts), in buckets of their own, still averaged over ``dp``;
        ZeRO-1 shards them over that group (rows ``chunk(size)[rank in it]``).
        ``host``: the buckets live on the host tier (optimizer offload with one replica,
        ``partc/runtime/offload.py``): each gradient is copied out as backward makes it,
        counted there, and stays in the buckets (``.grad`` is never set: the optimizer
        reads :meth:`grad_of`)."""
        self.groups = dict(groups or {})
        self.group, self.dp, self.dp_rank, self.sharded = group, dp, dp_rank, sharded
        self._taken = False   # gradients were handed over by take(): some may be left
        self.collecting = False  # inside one of the schedule's backwards
        self.armed = False  # inside the step's last backward: reduce full buckets
        self._in_step = False  # a backward of this step has begun
        limit = BUCKET_ELEMENTS if elements is None else elements
        params = [p for p in {id(p): p for p in module.parameters()}.values()
                  if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        self.host = host
        if host is not None:
            device = host.device
        # Host buckets: gradients streamed out whose copies may be in flight (bucket,
        # slot, host copy, its event), added in order (drain).
        self._landing: list[tuple[_Bucket, _Slot, torch.Tensor, Any]] = []
        self.buckets: list[_Bucket] = []
        self._hooks: dict[int, Any] = {}  # on compute-dtype copies (stand_in)
        self._copies: dict[int, nn.Parameter] = {}
        self._slot: dict[int, tuple[_Bucket, _Slot]] = {}
        self._masters: dict[int, torch.Tensor] | None = None  # make_masters
        # ZeRO-1: bucket index -> its parameters' all-gather in flight (gather_params).
        self._gathers: dict[int, _Gather] = {}
        # The optimizer leaves the all-gathers in flight, for forward to finish: set by
        # wait_in_forward, which registers the hooks that do.
        self.defer_gathers = False
        # The step's gradients were dropped (a non-finite step skipped,
        # partc/runtime/nonfinite.py): DistributedOptimizer's next step does nothing.
        # Cleared by that step or the next step's first backward.
        self.skip_step = False
        # Shared weights last, in buckets of their own that never count as ready.
        # Expert weights in buckets of their own per group, after the others.
        self._late = {id(p) for p in params if id(p) in at_end}

        def kind(param: nn.Parameter) -> tuple[bool, int]:
            group = self.groups.get(id(param))
            return id(param) in self._late, 0 if group is None else 1 + id(group)

        ordered = sorted(reversed(params), key=kind)  # stable: backward's order in a kind
        current: list[_Slot] = []
        offset = 0
        for param in ordered:
            if current and kind(param) != kind(current[-1].param):
                self._close(current, device)
                current, offset = [], 0
            slot = _Slot(param, self._shards_of(param)[0], sharded, offset)
            current.append(slot)
            offset += slot.width
            if offset >= limit:
                self._close(current, device)
                current, offset = [], 0
        if current:
            self._close(current, device)
        for param in params:
            if not param.is_contiguous():
                raise PartcError("gradient buckets need contiguous parameters")
            param.register_post_accumulate_grad_hook(self._accumulate)

    def stand_in(self, copy: nn.Parameter, param: nn.Parameter) -> None:
        """``copy`` computes for ``param`` (a compute-dtype copy, ``partc/runtime/
        precision.py``): its gradients go to ``param``'s slots."""
        self._slot[id(copy)] = self._slot[id(param)]
        self._copies[id(copy)] = copy
        self._hooks[id(copy)] = copy.register_post_accumulate_grad_hook(self._accumulate)

    def drop_stand_in(self, copy: nn.Parameter) -> None:
        self._slot.pop(id(copy), None)
        self._copies.pop(id(copy), None)
        hook = self._hooks.pop(id(copy), None)
        if hook is not None:
            hook.remove()

    def _shards_of(self, param: nn.Parameter) -> tuple[int, int]:
        """Over how many ranks ``param``'s gradient is reduced, and this rank's place
        among them: its group's (an expert weight's), or dp."""
        group = self.groups.get(id(param))
        if group is None:
            return self.dp, self.dp_rank
        return group.size(), group.rank()

    def _close(self, slots: list[_Slot], device: torch.device) -> None:
        shards, rank = self._shards_of(slots[0].param)
        bucket = _Bucket(slots, shards if self.sharded else 1, rank,
                         self.groups.get(id(slots[0].param)), torch.float32, device)
        self.buckets.append(bucket)
        if self.host is not None:
            self.host.counters.host_resident += bucket.buffer.numel() * 4
        for slot in slots:
            self._slot[id(slot.param)] = (bucket, slot)

    # -- during backward ----------------------------------------------------------------

    def begin(self, last: bool) -> None:
        """Before one of the schedule's backwards. Under ZeRO-0 ``.grad`` is a view of the
        bucket after a step: kept as the gradient so far if still that view, zeroed where
        it was set to None (``zero_grad``), taken over if the user assigned another."""
        self.skip_step = False
        if not self._in_step and not self.holds_grads:
            for bucket in self.buckets:
                for slot in bucket.slots:
                    view = self._view(bucket, slot)
                    grad = slot.param.grad
                    if grad is None:
                        view.zero_()
                    elif not _same_view(grad, view):
                        view.copy_(grad.reshape(-1))
                    slot.param.grad = None
        self.collecting, self.armed, self._in_step = True, last, True

    def end(self) -> None:
        self.collecting = self.armed = False

    def _accumulate(self, param: nn.Parameter) -> None:
        if not self.collecting or param.grad is None:
            return
        bucket, slot = self._slot[id(param)]
        self._add(bucket, slot, param.grad)
        param.grad = None
        if self.armed and id(slot.param) not in self._late:
            bucket.ready += 1
            if bucket.ready == len(bucket.slots):
                self._launch(bucket)

    def take(self, params: Iterable[nn.Parameter]) -> None:
        """The gradients just set on ``params`` outside autograd's accumulation hooks (a
        split backward's weight pass, ``partc/runtime/split_backward.py``), taken as the
        hook takes them: in the stage's last weight pass a bucket made full is reduced at
        once, beside the rank's later backwards, as after a last full backward."""
        self._taken = True
        for param in params:
            if id(param) in self._slot:
                self._accumulate(param)

    @property
    def holds_grads(self) -> bool:
        """Whether the reduced gradients stay in the buckets (:meth:`grad_of`), never in
        ``.grad``: ZeRO-1's shards, or buckets on the host tier."""
        return self.sharded or self.host is not None

    def _add(self, bucket: _Bucket, slot: _Slot, grad: torch.Tensor) -> None:
        flat = grad.detach().reshape(-1)
        if self.host is not None:
            # Streamed out as backward makes it (on a GPU on the host tier's copy
            # stream, beside the rest of backward), added into the host bucket once
            # there: the earliest copies landed are added at each later gradient, the
            # rest before anything reads the buckets (drain).
            staging, copied = self.host.stream_out(flat)
            self.host.counters.streamed += flat.numel() * flat.element_size()
            self._landing.append((bucket, slot, staging, copied))
            self.drain(block=False)
            return
        self._add_into(bucket, slot, flat)

    def drain(self, block: bool = True) -> None:
        """Add the gradients streamed to the host into their buckets: those whose copy
        has landed, or with ``block`` all of them (waiting for their copies)."""
        while self._landing:
            bucket, slot, staging, copied = self._landing[0]
            if not block and copied is not None and not copied.query():
                return
            self._landing.pop(0)
            self.host.wait(copied)
            self._add_into(bucket, slot, staging)

    def _add_into(self, bucket: _Bucket, slot: _Slot, flat: torch.Tensor) -> None:
        columns = slot.columns(bucket.regions())
        if slot.everywhere:  # a 0-dim parameter: whole in every region
            columns.add_(flat)
            return
        for into, part in slot.pieces(columns, flat):
            into.add_(part)

    def _take_the_rest(self) -> None:
        """Add the gradients no hook took (a split backward's weight gradients, which
        torch's stage assigns to ``.grad`` itself) into their buckets."""
        owners = [slot.param for bucket in self.buckets for slot in bucket.slots]
        for param in (*owners, *self._copies.values()):
            grad = param.grad
            if grad is None:
                continue
            bucket, slot = self._slot[id(param)]
            if not self.holds_grads and _same_view(grad, self._view(bucket, slot)):
                continue
            self._add(bucket, slot, grad)
            param.grad = None

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.work is not None:
            return
        group = self.group if bucket.group is None else bucket.group
        if (self.dp if bucket.group is None else group.size()) == 1:
            # Mixed precision alone, or experts no other rank holds: nothing to reduce.
            bucket.work = _Done()
        elif self.sharded:
            bucket.work = REDUCE_SCATTER_SINGLE(
                bucket.region_of(bucket.rank), bucket.buffer, group=group, async_op=True)
        else:
            bucket.work = dist.all_reduce(bucket.buffer, group=group, async_op=True)

    def finish(self, scale: int) -> None:
        """After the step's last backward: reduce the buckets not reduced yet (parameters
        without a gradient this step), wait for all, take the mean over dp and divide by
        ``scale`` (the microbatches: the schedule's scaling of ``.grad``, done here)."""
        self.wait_gathers()  # of parameters no forward read: none in flight past a step
        if self._late or self._taken:
            self._take_the_rest()
        if self.host is not None:
            self.drain()   # every gradient streamed out is in its bucket
        for bucket in self.buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work, bucket.ready = None, 0
            mine = bucket.region_of(bucket.rank if self.sharded else 0)
            # The mean over dp replicas, whichever group summed them: an expert's
            # ranks together saw every replica's tokens routed to it.
            if self.dp > 1:
                mine.div_(self.dp)
            if scale != 1:
                mine.div_(scale)
            if not self.holds_grads:
                for slot in bucket.slots:
                    slot.param.grad = self._view(bucket, slot).view_as(slot.param)
        self.end()
        self._in_step = False

    # -- after the step's backward ------------------------------------------------------

    def _view(self, bucket: _Bucket, slot: _Slot) -> torch.Tensor:
        return slot.rank_view(bucket.region_of(0), 0)

    def grad_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """This rank's reduced gradient of ``param``: shaped as its dp shard (ZeRO-1),
        its slots in host buckets, or the parameter's ``.grad`` (ZeRO-0)."""
        if not self.holds_grads:
            return param.grad
        found = self._slot.get(id(param))
        if found is None:
            return None
        bucket, slot = found
        view = slot.rank_view(bucket.region_of(bucket.rank), bucket.rank)
        return view.view(shard_shape(param, bucket.shards, bucket.rank))

    def shards_of(self, param: nn.Parameter) -> tuple[int, int]:
        """ZeRO-1: over how many ranks ``param`` is sharded, and this rank's shard."""
        bucket, _ = self._slot[id(param)]
        return bucket.shards, bucket.rank

    def counted_once(self, param: nn.Parameter) -> bool:
        """Whether this rank's gradient of ``param`` is a part no other rank of its
        group holds (a 0-dim parameter is whole on every rank: counted on rank 0)."""
        return not self.sharded or param.dim() > 0 or self.shards_of(param)[1] == 0

    def zero_(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()
        if not self.sharded:
            for bucket in self.buckets:
                for slot in bucket.slots:
                    slot.param.grad = None

    def slots(self) -> Iterator[tuple[_Bucket, _Slot]]:
        for bucket in self.buckets:
            for slot in bucket.slots:
                yield bucket, slot

    # -- ZeRO-1 in mixed precision: sharded fp32 masters ---------------------------------

    def make_masters(self, dtype: torch.dtype) -> dict[int, torch.Tensor]:
        """ZeRO-1 in mixed precision, as Megatron's distributed optimizer: this rank's
        shard of each fp32 parameter (over dp, or an expert weight's group) becomes a
        master tensor of its own, and the parameter itself is kept in the compute
        ``dtype`` (its fp32 rows of the other ranks are dropped). Made once (a second
        optimizer reuses them); parameters already in ``dtype`` get none."""
        self.wait_gathers()
        if self._masters is None:
            self._masters = {}
            with torch.no_grad():
                for bucket, slot in self.slots():
                    param = slot.param
                    if not param.is_floating_point() or param.dtype == dtype:
                        continue
                    start, end = slot.ranges[bucket.rank]
                    rows = param.detach().reshape(-1)[start:end].clone()
                    self._masters[id(param)] = rows.view(
                        shard_shape(param, bucket.shards, bucket.rank))
                    param.data = param.data.to(dtype)
        return self._masters

    @property
    def has_masters(self) -> bool:
        """Whether :meth:`make_masters` made fp32 masters of any parameter."""
        return bool(self._masters)

    def master_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """This rank's fp32 master shard of ``param`` (see :meth:`make_masters`), or None
        when the parameter is its own master."""
        return None if self._masters is None else self._masters.get(id(param))

    @torch.no_grad()
    def gather_params(self, *, wait: bool = True) -> None:
        """Every replica's rows of each parameter into every replica's parameter: one
        all-gather per bucket over its group, in the parameters' dtype (the compute dtype
        where :meth:`make_masters` made fp32 masters: bf16 moves half the bytes), all
        issued before any is waited for, in the order forward reads them (the buckets
        hold the parameters backwards). A rank's own rows are its master's, or (no
        masters) the parameter's own, updated in place.

        ``wait`` False: return with the all-gathers in flight; each bucket's is finished
        by :meth:`wait_gathers` (the forward pre-hooks of :func:`wait_in_forward`, before
        the first module reading its parameters runs, or anything else that reads them).
        Gathers still pending from an earlier call are finished first."""
        self.wait_gathers()
        for index in reversed(range(len(self.buckets))):
            self._gathers[index] = self._issue_gather(self.buckets[index])
        if wait:
            self.wait_gathers()

    def _issue_gather(self, bucket: _Bucket) -> _Gather:
        rank, shards = bucket.rank, bucket.shards
        group = self.group if bucket.group is None else bucket.group
        dtype = bucket.slots[0].param.dtype
        device = bucket.buffer.device
        mine = torch.zeros(bucket.region, dtype=dtype, device=device)
        for slot in bucket.slots:
            start, end = slot.ranges[rank]
            master = self.master_of(slot.param)
            source = master.reshape(-1) if master is not None \
                else slot.param.detach().reshape(-1)[start:end]
            slot.rank_view(mine, rank).copy_(source)
        if shards == 1:  # experts no other rank holds: stepped whole here
            return _Gather(mine, _Done())
        out = torch.empty(bucket.region * shards, dtype=dtype, device=device)
        work = ALL_GATHER_SINGLE(out, mine, group=group, async_op=True)
        return _Gather(out, work)

    @property
    def pending_gathers(self) -> tuple[int, ...]:
        """The buckets (indices into :attr:`buckets`) whose all-gather is in flight."""
        return tuple(self._gathers)

    def buckets_of(self, params: Iterable[nn.Parameter]) -> tuple[int, ...]:
        """The buckets (indices) holding any of ``params``, in forward order."""
        index = {id(bucket): i for i, bucket in enumerate(self.buckets)}
        found = {index[id(self._slot[id(p)][0])] for p in params if id(p) in self._slot}
        return tuple(sorted(found, reverse=True))

    @torch.no_grad()
    def wait_gathers(self, buckets: tuple[int, ...] | None = None) -> None:
        """Finish the pending all-gathers of ``buckets`` (indices; all by default): wait
        for each and copy the other ranks' rows (and this rank's, from its master) into
        the parameters."""
        for index in self.pending_gathers if buckets is None else buckets:
            gather = self._gathers.pop(index, None)
            if gather is not None:
                gather.work.wait()
                self._scatter_rows(self.buckets[index], gather.out)

    def _scatter_rows(self, bucket: _Bucket, out: torch.Tensor) -> None:
        """Every rank's rows from ``out`` (the bucket's all-gather) into the parameters,
        this rank's own too: its master's, or the parameter's own rows unchanged."""
        regions = bucket.regions(out)
        for slot in bucket.slots:
            flat = slot.param.detach().reshape(-1)
            columns = slot.columns(regions)
            if slot.everywhere:  # whole on every rank, as this rank stepped it
                if self.master_of(slot.param) is not None:
                    flat.copy_(columns[bucket.rank])
                continue
            for into, part in slot.pieces(columns, flat):
                part.copy_(into)

    def full_master(self, param: nn.Parameter) -> torch.Tensor:
        """``param`` whole (this rank's local tensor, every rank's rows of its group) in
        fp32 from the masters. Collective over the parameter's group."""
        master = self.master_of(param)
        bucket, slot = self._slot[id(param)]
        if param.dim() == 0:
            return master.clone()
        mine = torch.zeros(slot.width, dtype=master.dtype, device=master.device)
        mine[:master.numel()].copy_(master.reshape(-1))
        out = torch.empty(slot.width * bucket.shards, dtype=master.dtype,
                          device=master.device)
        if bucket.shards > 1:
            group = self.group if bucket.group is None else bucket.group
            ALL_GATHER_SINGLE(out, mine, group=group)
        else:
            out.copy_(mine)
        whole = torch.empty(param.shape, dtype=master.dtype, device=master.device)
        for gathered, part in slot.pieces(out.view(bucket.shards, slot.width),
                                          whole.reshape(-1)):
            part.copy_(gathered)
        return whole

    @torch.no_grad()
    def load_whole(self, param: nn.Parameter, whole: torch.Tensor) -> None:
        """Set ``param`` (this rank's local tensor) to ``whole``: its master takes this
        rank's rows in fp32, the parameter the compute-dtype copy of all of it."""
        self.wait_gathers()  # an all-gather in flight would overwrite it
        master = self.master_of(param)
        bucket, slot = self._slot[id(param)]
        start, end = slot.ranges[bucket.rank]
        master.reshape(-1).copy_(whole.reshape(-1)[start:end])
        param.detach().copy_(whole)


def wait_in_forward(buckets: GradBuckets, stage: nn.Module, units: Sequence[str]) -> None:
    """Megatron's overlapped parameter all-gather: the optimizer step leaves the
    buckets' all-gathers in flight (:attr:`GradBuckets.defer_gathers`) and forward
    pre-hooks finish each just before its parameters are first read. ``units``:
    submodule paths of ``stage`` that forward calls as modules, each holding its layer's
    parameters (``partc.passes.fsdp_units``); each waits for the buckets holding its
    parameters, and ``stage`` itself, before it runs, for those holding the parameters
    outside units. The rest of the stage's forward overlaps the gathers still in flight.
    (Under pipelining the next step's first microbatch meets the waits; a rank's
    virtual stages each wait for their own.)"""
    inside: set[int] = set()
    for path in units:
        unit = stage.get_submodule(path)
        params = list(unit.parameters())
        inside.update(id(p) for p in params)
        _wait_before(unit, buckets, buckets.buckets_of(params))
    outside = [p for p in stage.parameters() if id(p) not in inside]
    _wait_before(stage, buckets, buckets.buckets_of(outside))
    buckets.defer_gathers = True


def _wait_before(module: nn.Module, buckets: GradBuckets, indices: tuple[int, ...]) -> None:
    if not indices:
        return

    def hook(*_: Any) -> None:
        if buckets.pending_gathers:
            buckets.wait_gathers(indices)

    module.register_forward_pre_hook(hook)


class _Done:
    def wait(self) -> None:
        pass


class _Gather:
    """One bucket's all-gather in flight: ``work`` fills ``out`` (every rank's region)."""

    def __init__(self, out: torch.Tensor, work: Any) -> None:
        self.out, self.work = out, work


def shard_shape(param: torch.Tensor, dp: int, dp_rank: int) -> torch.Size:
    if param.dim() == 0:
        return param.shape
    return dp_shard(torch.empty(param.shape, device="meta"), dp, dp_rank).shape


def _same_view(grad: torch.Tensor, view: torch.Tensor) -> bool:
    return grad.data_ptr() == view.data_ptr() and grad.numel() == view.numel()


class DistributedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 (see the module's doc): ``optimizer_class`` over this rank's dp shard of
    each parameter, stepped with the reduce-scattered gradients of :class:`GradBuckets`;
    the updated shards are all-gathered, bucket by bucket, into every replica's
    parameters.

    ``param_groups`` and ``state`` are the inner optimizer's (``self.optim``): learning
    rate schedulers and ``state_dict`` act on this rank's shards. ``param_of`` maps a
    shard back to the module's parameter (checkpoints save its state as that
    parameter's dp shard)."""

    def __init__(self, buckets: GradBuckets, optimizer_class: type[torch.optim.Optimizer],
                 *, compute_dtype: torch.dtype | None = None, **defaults: Any) -> None:
        """``compute_dtype``: mixed precision; the parameters are then kept in it and
        the optimizer steps fp32 masters of this rank's shards
        (:meth:`GradBuckets.make_masters`)."""
        self.buckets = buckets
        masters = buckets.make_masters(compute_dtype) if compute_dtype is not None else {}
        shards: list[nn.Parameter] = []
        self.param_of: dict[int, nn.Parameter] = {}
        self._shard: dict[int, nn.Parameter] = {}
        for bucket, slot in buckets.slots():
            param, rank = slot.param, bucket.rank
            start, end = slot.ranges[rank]
            # The fp32 master of this rank's rows, or a view of them: stepping it
            # updates the parameter in place.
            rows = masters[id(param)] if id(param) in masters else \
                param.detach().reshape(-1)[start:end].view(
                    shard_shape(param, bucket.shards, rank))
            shard = nn.Parameter(rows, requires_grad=True)
            shards.append(shard)
            self.param_of[id(shard)] = param
            self._shard[id(param)] = shard
        self.optim = optimizer_class(shards, **defaults)
        super().__init__(shards, self.optim.defaults)
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state

    def sharding(self, shard: torch.Tensor) -> tuple[int, int] | None:
        """Over how many ranks ``shard``'s parameter is cut along dim 0 (dp, or an
        expert weight's expert-data-parallel group) and which part this is; None for a
        0-dim parameter, held whole."""
        if shard.dim() == 0:
            return None
        return self.buckets.shards_of(self.param_of[id(shard)])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.buckets.zero_()
        for group in self.param_groups:
            for shard in group["params"]:
                shard.grad = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        if self.buckets.skip_step:
            # A skipped step (partc/runtime/nonfinite.py): no shard, no state and no
            # all-gather changes; every rank agreed, so every rank returns here.
            self.buckets.skip_step = False
            return loss
        for group in self.param_groups:
            for shard in group["params"]:
                grad = self.buckets.grad_of(self.param_of[id(shard)])
                if grad is not None:
                    # A user's gradient (zeros to initialise state) stands if set.
                    shard.grad = grad if shard.grad is None else shard.grad
        self.optim.step()
        for group in self.param_groups:
            for shard in group["params"]:
                shard.grad = None
        # Every replica's updated rows to every replica; left in flight for the next
        # forward to finish, layer by layer, where its hooks are (wait_in_forward).
        self.buckets.gather_params(wait=not self.buckets.defer_gathers)
        return loss
