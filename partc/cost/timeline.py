"""One training step as each pipeline rank spends it, simulated event by event.

The one simulator that prices every schedule partc runs (:mod:`partc.cost.schedules`): the
cost model (:func:`partc.cost.evaluate.simulate`) calls it for a configuration's step time,
the report draws what it returns. Inputs are per virtual stage and per microbatch (the model
is cut into ``pp * v`` virtual stages; see :mod:`partc.cost.schedules`):

- the order each rank runs its operations in is the schedule's own: torch's
  ``pipeline_order`` for the schedule class (:func:`torch_order`), so what is priced is
  what ``torch.distributed.pipelining`` runs. An operation is a forward ``F``, a full
  backward ``B``, or, under the zero-bubble schedules, a backward split into its
  input-gradient part ``I`` and its weight-gradient part ``W``; DualPipeV's overlapped
  forward-backward pairs are played as their forward then their backward;
- an operation starts when its rank is free and its input is there: a forward needs the
  previous virtual stage's forward of the same microbatch, a backward (``B`` or ``I``)
  the next virtual stage's backward or, on the model's last virtual stage, its own
  forward; ``W`` follows its own ``I`` on the same rank;
- durations (:class:`StageSeconds`): a forward is the receipt of its input (its end's
  share of the transfer), its compute, then the send of its activation when the next
  virtual stage is on another rank (likewise its share); a backward is the receipt of its
  output's gradient (from another rank), the recompute, the backward, then the send of
  its input's gradient. What an operation sends to another rank leaves as its compute
  ends and arrives after the whole transfer, which runs on its link (one per boundary
  and direction) one at a time: the rank waiting for it waits for that, while the
  sender goes on beside it where its share is less than the transfer (NCCL's kernels
  beside compute). Under a split backward ``I`` carries the recompute and the
  input-gradient part and ``W`` the weight-gradient part. Tensor-parallel collectives are inside the forward and backward
  figures and drawn as communication;
- after its last operation each rank runs its tail: what the gradient sync and ZeRO-1's
  weight all-gather leave exposed (the all-gather runs beside the next step's forward;
  drawn here, as priced, after this step's), and the optimizer step. A plan's timeline
  (:func:`simulate`) starts the tails when the pipeline drains, as its step is priced.

Each row stands for every rank of a stage (its dp x tp ranks run alike).
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import operator
import types
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import NamedTuple
from unittest import mock

import torch
from torch.distributed.pipelining import schedules as torch_schedules

from partc.cost.schedules import (SCHEDULE_TABLE, crossing_runs, rank_of, refusal,
                                  schedule as schedule_info, stages_of_rank)
from partc.names import Phase, Schedule

#: Kinds of :class:`Block`, in the order pictures list them.
KINDS = ("forward", "backward", "weight", "recompute", "host", "collective", "p2p", "tail")
COMPUTE_KINDS = ("forward", "backward", "weight", "recompute")
COMM_KINDS = ("collective", "p2p")

#: The share of a layer's backward that is its weight gradient when a schedule splits
#: backward: the cost model prices backward as twice forward op by op, a heavy op's
#: input-gradient and weight-gradient matmuls alike, so half.
WEIGHT_SHARE = 0.5


@dataclass(frozen=True, kw_only=True)
class Block:
    """One stretch of a rank's step: ``kind`` (one of :data:`KINDS`) from ``start_s`` to
    ``end_s``; ``microbatch`` and ``chunk`` (the position among the rank's virtual
    stages, 0 with one) name the operation it belongs to, None for the tail;
    ``stage`` is the virtual stage (model order)."""

    rank: int
    kind: str
    start_s: float
    end_s: float
    microbatch: int | None = None
    chunk: int = 0
    stage: int | None = None

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


class Op(NamedTuple):
    """One operation of a rank: ``phase`` forward, backward (full), input or weight (a
    split backward's parts), of ``microbatch`` through virtual ``stage``. A tuple: the
    orders of a search's schedules hold hundreds of thousands."""

    phase: Phase
    microbatch: int
    stage: int


@dataclass(frozen=True, kw_only=True)
class StageSeconds:
    """Seconds of one microbatch through one virtual stage."""

    forward: float
    backward: float              # input + weight gradients
    recompute: float = 0.0
    # Part of ``recompute``: the activation offload copies' time compute does not hide
    # (partc.cost.offload_time), drawn as the host's.
    host: float = 0.0
    collective_forward: float = 0.0   # part of ``forward`` spent in tp collectives
    collective_backward: float = 0.0  # part of ``backward``
    # Each way across the cut after this virtual stage: this end's share of the transfer
    # (partc.cost.evaluate.end_share_ps), paid on sending the activation and on receipt
    # of its gradient; and what of the transfer it does not pay, which still delays the
    # next stage's forward.
    send: float = 0.0
    send_delay: float = 0.0
    # Each way across the cut before it: this end's share, paid on receipt of the
    # activation and on sending its gradient back; and what the gradient's transfer
    # delays the stage before's backward beyond it.
    receive: float = 0.0
    receive_delay: float = 0.0
    weight_share: float = WEIGHT_SHARE


@dataclass(frozen=True, kw_only=True)
class Timeline:
    schedule: str
    num_ranks: int
    num_microbatches: int
    chunks: int
    blocks: tuple[Block, ...]
    peak_inflight: tuple[int, ...] = ()   # per rank: (microbatch, virtual stage) pairs held

    @property
    def step_s(self) -> float:
        return max((b.end_s for b in self.blocks), default=0.0)

    @property
    def pipeline_s(self) -> float:
        """When the last backward ends (before the tails)."""
        return max((b.end_s for b in self.blocks if b.kind != "tail"), default=0.0)

    @cached_property
    def _totals(self) -> dict[tuple[int, str], float]:
        totals: dict[tuple[int, str], float] = {}
        for b in self.blocks:
            totals[(b.rank, b.kind)] = totals.get((b.rank, b.kind), 0.0) + b.seconds
        return totals

    def seconds(self, rank: int, kinds: tuple[str, ...] = KINDS) -> float:
        """Seconds rank ``rank`` spends in blocks of ``kinds``."""
        return sum(self._totals.get((rank, kind), 0.0) for kind in kinds)

    def idle_s(self, rank: int) -> float:
        """Time the rank waits within the step."""
        return self.step_s - self.seconds(rank)

    @property
    def bubble_fraction(self) -> float:
        """The share of the pipeline's rank-time (before the tails) no rank computes or
        communicates in."""
        span = self.pipeline_s * self.num_ranks
        if span <= 0:
            return 0.0
        work = sum(b.seconds for b in self.blocks if b.kind != "tail")
        return max(0.0, 1 - work / span)


# ------------------------------------------------------------------ the orders

_PHASES = {"F": Phase.FORWARD, "B": Phase.BACKWARD, "I": Phase.INPUT, "W": Phase.WEIGHT}


@lru_cache(maxsize=512)
def torch_order(name: str, pp: int, v: int, m: int) -> tuple[tuple[Op, ...], ...]:
    """Per rank, the compute operations torch's schedule ``name`` runs for ``pp`` ranks
    of ``v`` virtual stages over ``m`` microbatches, in order (its ``pipeline_order``,
    built without a process group from stand-in stages)."""
    refused = refusal(name, pp, v, m)
    if refused:
        raise ValueError(refused)
    if v == 1:
        return tuple(_single_stage_order(name, rank, pp, m) for rank in range(pp))
    cls = getattr(torch_schedules, schedule_info(name).torch_class)
    module = torch.nn.Module()

    def stage(index: int):
        return types.SimpleNamespace(num_stages=pp * v, group_size=pp, group_rank=0,
                                     stage_index=index, is_first=index == 0,
                                     is_last=index == pp * v - 1, submod=module)

    # The compute order is all that is read here. Lowering it to the runtime's actions
    # (the sends and receives, FSDP's unshard and reshard, quadratic in the actions: 22 s
    # of 256 microbatches over two ranks in torch 2.13) is skipped: each schedule class
    # builds its compute order first and lowers it last, in _prepare_schedule_with_comms.
    with mock.patch.object(torch_schedules._PipelineScheduleRuntime,
                           "_prepare_schedule_with_comms", lambda self, *args, **kwargs: None):
        built = cls([stage(j) for j in stages_of_rank(name, pp, v, 0)], m, loss_fn=_loss)
    # By the computation type itself: reading each action's ``.value`` cost more than the
    # rest of the walk.
    phases = {kind: _PHASES.get(kind.value) for kind in torch_schedules._ComputationType}
    orders = []
    for rank in range(pp):
        ops: list[Op] = []
        for action in built.pipeline_order.get(rank, ()):
            if action is None:
                continue
            for part in (action.sub_actions or (action,)):
                phase = phases[part.computation_type]
                if phase is not None:
                    ops.append(Op(phase, part.microbatch_index, part.stage_index))
        orders.append(tuple(ops))
    return tuple(orders)


#: The overlap windows' unit (:func:`overlap_windows`): this many steps to one virtual
#: stage's backward (or forward) of one microbatch; a window is rounded down to whole steps.
WINDOW_STEPS = 4
#: One virtual stage's window per rank: no schedule order to read (one stage per rank).
ONE_STAGE_WINDOWS = ((WINDOW_STEPS,), (WINDOW_STEPS,))


class Windows(NamedTuple):
    """What hides a rank's data-parallel collectives, per its virtual stages
    (:func:`overlap_windows`), in :data:`WINDOW_STEPS` of one virtual stage's backward
    (``sync``) or forward (``gather``) per microbatch: ``sync[j - 1]`` for the stage
    whose weight gradients are complete ``j``-th from last, ``gather[j - 1]`` for the
    ``j``-th stage to run its first forward."""

    sync: tuple[int, ...]
    gather: tuple[int, ...]


@lru_cache(maxsize=1024)
def overlap_windows(name: str, pp: int, v: int, m: int) -> tuple[Windows, ...]:
    """Per rank, the windows its data-parallel collectives hide behind, read off the
    schedule's order (:func:`torch_order`), as the runtime issues them: one set of gradient
    buckets per rank, a bucket reduced as soon as a virtual stage's last backward (or
    weight-gradient pass) has made all of its gradients (``GradBuckets``), so a stage that
    is done early is reduced beside the rank's later backwards; and ZeRO-1's gathers of
    the stepped weights issued in the order forward reads them, each virtual stage's
    waited for by its first forward, so a stage whose first forward comes late hides its
    gather behind the forwards before it.

    ``sync[j - 1]``: the backward work from the start of the last gradient-making op of the
    stage finished ``j``-th from last to the rank's end (a full backward one step's worth
    of its stage, a split backward's input and weight parts their shares,
    :data:`WEIGHT_SHARE`; forwards none). ``gather[j - 1]``: the ops before the ``j``-th
    stage's first forward and that forward, each counted as one forward (a backward is
    no shorter). Both are rounded down (:data:`WINDOW_STEPS`), so they never overstate
    what hides. Where torch refuses the shape, or a rank holds one stage, the one-stage
    windows (:data:`ONE_STAGE_WINDOWS`): the last backward, the first forward."""
    if v == 1 or refusal(name, pp, v, m):
        return (Windows(*ONE_STAGE_WINDOWS),) * pp
    backward = {Phase.FORWARD: 0.0, Phase.BACKWARD: 1.0, Phase.INPUT: 1.0 - WEIGHT_SHARE,
                Phase.WEIGHT: WEIGHT_SHARE}
    ranks = []
    for order in torch_order(name, pp, v, m):
        last: dict[int, int] = {}    # stage -> index of its last gradient-making op
        first: dict[int, int] = {}   # stage -> index of its first forward
        for i, (phase, _, stage) in enumerate(order):
            if phase is Phase.BACKWARD or phase is Phase.WEIGHT:
                last[stage] = i
            elif phase is Phase.FORWARD:
                first.setdefault(stage, i)
        after = list(itertools.accumulate(backward[op[0]] for op in reversed(order)))[::-1]
        sync = tuple(math.floor(WINDOW_STEPS * after[i] + 1e-9)
                     for i in sorted(last.values(), reverse=True))
        gather = tuple(WINDOW_STEPS * (i + 1) for i in sorted(first.values()))
        ranks.append(Windows(sync=sync or (WINDOW_STEPS,), gather=gather or (WINDOW_STEPS,)))
    return tuple(ranks)


def _single_stage_order(name: str, rank: int, pp: int, m: int) -> tuple[Op, ...]:
    """GPipe and 1F1B (one stage per rank), as torch's single-stage schedules run them:
    GPipe all forwards then all backwards; 1F1B ``pp - rank - 1`` warm-up forwards, then
    one forward and one backward in turn, then the remaining backwards. (Written here:
    the ``pipeline_order`` torch builds for these two is informational only and, for
    1F1B's last rank, off by one microbatch in torch 2.13.)"""
    forwards = [Op(phase=Phase.FORWARD, microbatch=i, stage=rank) for i in range(m)]
    backwards = [Op(phase=Phase.BACKWARD, microbatch=i, stage=rank) for i in range(m)]
    if name == Schedule.GPIPE:
        return tuple(forwards + backwards)
    warmup = min(pp - rank - 1, m)
    order = forwards[:warmup]
    for i in range(m - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return tuple(order + backwards[m - warmup:])


def _loss(output, target):   # stands in for the loss; the order only needs one
    return output


def schedule_order(schedule: str, rank: int, pp: int, microbatches: int,
                   chunks: int = 1) -> list[Op]:
    """The operations rank ``rank`` of ``pp`` runs, in order."""
    return list(torch_order(schedule, pp, chunks, microbatches)[rank])


def csv_rows(name: str, pp: int, v: int, m: int) -> list[list[str]]:
    """The schedule in torch's pipelining CSV format (one row per rank, one action per
    cell: virtual stage, ``F``/``B``/``I``/``W``, microbatch), as
    ``_PipelineScheduleRuntime._load_csv`` reads it (compute only)."""
    letters = {v_: k for k, v_ in _PHASES.items()}
    return [[f"{op.stage}{letters[op.phase]}{op.microbatch}" for op in ops]
            for ops in torch_order(name, pp, v, m)]


def csv_text(name: str, pp: int, v: int, m: int) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(csv_rows(name, pp, v, m))
    return out.getvalue()


def plan_csv(plan) -> str:
    """The plan's schedule in torch's pipelining CSV format (:func:`csv_rows`)."""
    return csv_text(plan.schedule, len(plan.stages), plan.chunks, plan.num_microbatches)


# ------------------------------------------------------------------ the simulation

def play(schedule: str, pp: int, v: int, m: int, stages: list[StageSeconds],
         tails: list[float] | None = None) -> Timeline:
    """Play ``schedule`` out: ``stages`` gives each of the ``pp * v`` virtual stages'
    seconds per microbatch (model order), ``tails`` each rank's tail."""
    blocks: list[Block] = []
    clock, peak, _, _ = _played(schedule, pp, v, m, stages, blocks)
    for r, tail in enumerate(tails or ()):
        if tail > 0:
            blocks.append(Block(rank=r, kind="tail", start_s=clock[r], end_s=clock[r] + tail))
    return Timeline(schedule=schedule, num_ranks=pp, num_microbatches=m, chunks=v,
                    blocks=tuple(blocks), peak_inflight=tuple(peak))


def played_span(schedule: str, pp: int, v: int, m: int, stages: list[StageSeconds],
                cutoff: float = math.inf) -> tuple[float, float | None]:
    """:func:`play`'s ``pipeline_s`` and ``bubble_fraction`` (its tails aside), the same
    numbers, without making the blocks: what pricing a plan needs of its timeline. Where
    the span would exceed ``cutoff`` the play may stop as soon as a rank's clock plus the
    work it has left passes it: then a lower bound on the span above ``cutoff`` and None
    for the bubble (what a search that only keeps faster plans needs of a slower one)."""
    _, _, (end, work), bound = _played(schedule, pp, v, m, stages, None, cutoff)
    if bound is not None:
        return bound, None
    span = end * pp
    return end, (max(0.0, 1 - work / span) if span > 0 else 0.0)


def _played(schedule: str, pp: int, v: int, m: int, stages: list[StageSeconds],
            blocks: list[Block] | None, cutoff: float = math.inf
            ) -> tuple[list[float], list[int], tuple[float, float], float | None]:
    """The simulation :func:`play` runs: each rank's clock and peak of microbatches held
    at the end, the last block's end and the blocks' seconds, and None; the blocks
    appended to ``blocks`` unless None. Each rank runs :func:`torch_order`'s operations
    in turn, each when its input is there (:func:`_layout`'s events); their durations
    come from :func:`_parts`, once per (phase, virtual stage).

    ``cutoff``: once a rank's clock and the durations of its operations not yet run add
    up to more (its waits only add to them, so the span does too), the play stops and
    returns that sum, a lower bound on the span, in the last place."""
    if len(stages) != pp * v:
        raise ValueError(f"{len(stages)} virtual stages given, {pp} x {v} expected")
    split = schedule_info(schedule).split_backward
    chunk_of, crosses, held_by, orders = _layout(schedule, pp, v, m)
    runs = pp * v
    parts = [_parts(phase, j, stages[j], crosses, split)
             for phase in _PHASE_INDEX for j in range(runs)]
    # Per part, the steps as the play without blocks walks them: zero ones dropped (they
    # move nothing), the sum of all, the transfer after it and its end's share of that
    # (the last step). Each rank runs every microbatch's forward and backward (whole, or
    # its input and weight parts, whose sum is the same) of each of its runs once: the
    # work it has left to start with.
    quick = [(tuple(seconds for _, seconds in steps if seconds != 0),
              sum(seconds for _, seconds in steps), transfer, steps[-1][1])
             for steps, transfer in parts]
    left = [m * sum(quick[j][1] + quick[runs + j][1] for j in held) for held in held_by]
    # The margin covers the rounding of the running sums it is compared with.
    limit = cutoff * (1 + 1e-9) if cutoff < math.inf else math.inf
    done: list[float | None] = [None] * (len(_EVENTS) * m * runs)   # event -> ready at
    clock, position = [0.0] * pp, [0] * pp
    free = [0.0] * (2 * runs)   # each link's next free moment: forward j, backward j
    holding, peak = [0] * pp, [0] * pp
    end, work = 0.0, 0.0   # the blocks' last end and their seconds, in play's arithmetic
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            order, at_r, now = orders[r], position[r], clock[r]
            count = len(order)
            while at_r < count:
                needs, part, mark, grad, held, link, forward, j, microbatch = order[at_r]
                # What it waits for (_layout): none, or the event that marks its input.
                if needs < 0:
                    start = now
                else:
                    ready = done[needs]
                    if ready is None:
                        break
                    start = now if now >= ready else ready
                moves, total, transfer, last_step = quick[part]
                if blocks is not None:
                    for name, seconds in parts[part][0]:
                        if seconds > 0:
                            stop = start + seconds
                            blocks.append(Block(rank=r, kind=name, start_s=start,
                                                end_s=stop, microbatch=microbatch,
                                                chunk=chunk_of[j], stage=j))
                            if stop > end:
                                end = stop
                            work += stop - start
                        start += seconds
                else:
                    for seconds in moves:
                        if seconds > 0:
                            stop = start + seconds
                            if stop > end:
                                end = stop
                            work += stop - start
                            start = stop
                        else:
                            start += seconds
                    left[r] -= total
                    if start + left[r] > limit:
                        clock[r], position[r] = now, at_r
                        return clock, peak, (end, work), start + left[r]
                now = arrive = start
                if transfer:
                    # What it sends leaves as its compute ends (its end's share of the
                    # send after it: the last step), one transfer at a time over the
                    # link, and arrives when the transfer ends.
                    leaves = max(start - last_step, free[link])
                    free[link] = leaves + transfer
                    arrive = max(start, free[link])
                done[mark] = arrive if forward else start
                if grad >= 0:
                    done[grad] = arrive
                if held:
                    holding[r] += held
                    if holding[r] > peak[r]:
                        peak[r] = holding[r]
                at_r += 1
                remaining -= 1
                progressed = True
            clock[r], position[r] = now, at_r
        if not progressed:
            raise RuntimeError(f"internal error: the {schedule} order deadlocks at "
                               f"positions {position}")
    return clock, peak, (end, work), None


# The events an operation waits for or marks, and the phases whose durations differ.
_EVENTS = ("forward", "input", "backward", "weight", "grad")
_PHASE_INDEX = {Phase.FORWARD: 0, Phase.BACKWARD: 1, Phase.INPUT: 2, Phase.WEIGHT: 3}


@lru_cache(maxsize=512)
def _layout(schedule: str, pp: int, v: int, m: int) -> tuple:
    """What the simulation reads of a schedule's shape: each run's place among its
    rank's; whether the cut after each run crosses to another rank; each rank's runs;
    and per rank :func:`torch_order`'s operations, each as ``(the event it waits for, -1
    for none; its durations' index in _parts' order; the event it marks; the gradient
    event it marks too, -1 for none; the change in microbatches held; the link its
    transfer takes; whether it is a forward; its run; its microbatch)``. An event's
    number: ``(its kind's place in _EVENTS * m + microbatch) * runs + run``."""
    runs = pp * v
    rank = [rank_of(schedule, pp, v, j) for j in range(runs)]
    chunk_of, held_by = [0] * runs, [[] for _ in range(pp)]
    for j in range(runs):
        chunk_of[j] = len(held_by[rank[j]])
        held_by[rank[j]].append(j)
    # Sends cross ranks only: the cut after virtual stage j, to j + 1.
    crossing = set(crossing_runs(schedule, pp, v))
    crosses = [j in crossing for j in range(runs)]
    block = m * runs   # the numbers of one kind
    forward_, input_, grad_ = (_EVENTS.index(kind) * block
                               for kind in ("forward", "input", "grad"))
    last = runs - 1
    # Per phase: its place in _PHASE_INDEX, the first number of the event it marks,
    # whether it passes a gradient back, the change in microbatches held.
    phases = {phase: (kind, _EVENTS.index(str(phase.value)) * block,
                      phase in (Phase.BACKWARD, Phase.INPUT),
                      1 if phase == Phase.FORWARD else 0 if phase == Phase.INPUT else -1)
              for phase, kind in _PHASE_INDEX.items()}
    orders = []
    for ops in torch_order(schedule, pp, v, m):
        encoded = []
        for phase, microbatch, j in ops:
            kind, own, passes, held = phases[phase]
            at = microbatch * runs + j   # this microbatch's run j, within a kind
            # A forward needs the previous run's forward of its microbatch; a weight
            # part its own input part; a backward (or its input part) the next run's
            # gradient or, on the last run, its own forward.
            if kind == 0:
                needs = forward_ + at - 1 if j > 0 else -1
            elif kind == 3:
                needs = input_ + at
            else:
                needs = grad_ + at + 1 if j < last else forward_ + at
            encoded.append((needs, kind * runs + j, own + at, grad_ + at if passes else -1,
                            held, j if kind == 0 else runs + j, kind == 0, j, microbatch))
        orders.append(tuple(encoded))
    return chunk_of, crosses, held_by, tuple(orders)


def _parts(phase: Phase, j: int, t: StageSeconds, crosses: list[bool], split: bool
           ) -> tuple[list[tuple[str, float]], float]:
    """The durations of a ``phase`` operation of virtual stage ``j`` on its rank, in
    order, and the transfer of what it sends to another rank (0: none): its end's share
    of it is its last step."""
    if phase == Phase.FORWARD:
        return ([("p2p", t.receive), ("forward", t.forward - t.collective_forward),
                 ("collective", t.collective_forward),
                 ("p2p", t.send if crosses[j] else 0.0)],
                t.send + t.send_delay if crosses[j] else 0.0)
    receive = t.send if crosses[j] else 0.0
    weight = t.backward * t.weight_share
    if phase == Phase.WEIGHT:
        return [("weight", weight)], 0.0
    backward = t.backward - weight if phase == Phase.INPUT else t.backward
    collective = min(t.collective_backward, backward)
    host = min(t.host, t.recompute)
    return ([("p2p", receive), ("host", host), ("recompute", t.recompute - host),
             ("backward", backward - collective), ("collective", collective),
             ("p2p", t.receive)], t.receive + t.receive_delay)


@lru_cache(maxsize=4096)
def held_per_run(schedule: str, pp: int, v: int, m: int
                 ) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank, the microbatches it holds activations of, per run (its virtual stages
    in model order), at each moment of the schedule's order that no other moment
    exceeds in every run: the peak of a rank whose runs save ``a_j`` bytes per
    microbatch is the largest ``sum_j h_j a_j`` over these vectors ``h``. A run's
    microbatch is held from its forward until its backward, or under a split backward
    until its weight gradient."""
    result = []
    for rank, ops in enumerate(torch_order(schedule, pp, v, m)):
        numbers = stages_of_rank(schedule, pp, v, rank) if v > 1 else (rank,)
        index = {j: i for i, j in enumerate(numbers)}
        holding = [0] * len(numbers)
        moments = set()
        for op in ops:
            if op.phase == Phase.FORWARD:
                holding[index[op.stage]] += 1
                moments.add(tuple(holding))
            elif op.phase in (Phase.BACKWARD, Phase.WEIGHT):
                holding[index[op.stage]] -= 1
        result.append(_undominated(moments))
    return tuple(result)


def _undominated(moments: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The vectors of ``moments`` no other one reaches in every component, sorted.
    One that does has a larger sum, and one dominated by a dominated vector is dominated
    by what dominates that one: so, visited by falling sum, a vector is checked against
    the undominated ones kept so far only."""
    kept: list[tuple[int, ...]] = []
    for h in sorted(moments, key=sum, reverse=True):
        if not any(all(map(operator.ge, g, h)) for g in kept):
            kept.append(h)
    return tuple(sorted(kept))


# ------------------------------------------------------------------ from a plan

def stage_seconds(plan) -> list[StageSeconds]:
    """Per virtual stage of ``plan``, the seconds of one microbatch: the figures the cost
    model played (``StagePlan.run_times``), or in a plan written before them each rank's
    figures (``StageTime`` over the microbatches) shared among its virtual stages by their
    layers' count; tensor-parallel collectives split between the phases by bytes, and the
    exposed part of the data-parallel ones that run beside the phases (ZeRO-2/3,
    ``Plan.data_parallel``) shared among the runs by their time."""
    pp, v, m = len(plan.stages), plan.chunks, plan.num_microbatches
    name = plan.schedule
    result: list[StageSeconds | None] = [None] * (pp * v)
    for stage in plan.stages:
        t = stage.time_s
        held = stages_of_rank(name, pp, v, stage.index) if v > 1 else (stage.index,)
        runs = stage.runs if v > 1 and stage.runs else (stage.layers,)
        sizes = [max(len(run), 1) for run in runs]
        total = sum(sizes)
        sending = sum(1 for j in held if j < pp * v - 1
                      and (v == 1 or rank_of(name, pp, v, j) != rank_of(name, pp, v, j + 1)))
        played = stage.run_times if len(stage.run_times) == len(held) else None
        dp_forward, dp_backward = _dp_exposed(plan, stage.index)
        for index, (j, run, size) in enumerate(zip(held, runs, sizes)):
            share = size / total / m
            host = 0.0
            if played is not None:
                own = played[index]
                forward, backward, recompute = own.forward, own.backward, own.recompute
                send, receive = own.send, own.receive
                send_delay, receive_delay = own.send_delay, own.receive_delay
                if len(stage.run_host_s) == len(held):
                    host = stage.run_host_s[index]
            else:
                forward, backward = t.forward * share, t.backward * share
                recompute, receive = t.recompute * share, 0.0
                send = t.comm / (m * sending) / 2 if sending else 0.0
                send_delay = receive_delay = 0.0
            forward_tp, backward_tp = _collective_seconds(plan, run)
            forward_tp += dp_forward * forward / t.forward * m if t.forward else 0.0
            backward_tp += dp_backward * backward / t.backward * m if t.backward else 0.0
            result[j] = StageSeconds(
                forward=forward, backward=backward, recompute=recompute, host=host,
                collective_forward=min(forward_tp, forward),
                collective_backward=min(backward_tp, backward),
                send=send, receive=receive, send_delay=send_delay,
                receive_delay=receive_delay)
    return result  # type: ignore[return-value]


def _dp_exposed(plan, stage: int) -> tuple[float, float]:
    """Seconds per microbatch of stage ``stage``'s data-parallel collectives that its
    forward and its backward leave exposed (inside those figures)."""
    section = getattr(plan, "data_parallel", None)
    if section is None:
        return 0.0, 0.0
    m = plan.num_microbatches
    rows = section.stages[stage]
    return (sum(c.exposed_s for c in rows if c.when == "forward") / m,
            sum(c.exposed_s for c in rows if c.when == "backward") / m)


def _collective_seconds(plan, layers) -> tuple[float, float]:
    """Seconds per microbatch of the layers' tp collectives in forward and in backward,
    the layer's time split between its phases by their bytes."""
    section = plan.tensor_parallel
    if section is None:
        return 0.0, 0.0
    forward = backward = 0.0
    for layer in layers:
        moves = section.collectives.get(layer, ())
        total = sum(move.nbytes for move in moves)
        if not total:
            continue
        seconds = section.collective_seconds.get(layer, 0.0)
        share = sum(move.nbytes for move in moves if move.phase == Phase.FORWARD) / total
        forward += seconds * share
        backward += seconds * (1 - share)
    return forward, backward


def simulate(plan, schedule: str | None = None) -> Timeline:
    """The plan's step played out rank by rank (see the module docstring); a rank per
    stage the plan lists. ``schedule`` plays another schedule over the same virtual
    stages (one placement and count of virtual stages).

    The tails are drawn as the step prices them (:func:`partc.cost.evaluate.simulated_step_ps`):
    from when the pipeline drains (the last backward of any rank), each rank's own tail,
    then the step's shared one (``Predicted.tail_time_s`` beyond the slowest rank's: the
    last gradient bucket's reduction, the first weight bucket's gather, the tied weights'
    sync), so that the step drawn is the plan's predicted step."""
    pp, m, v = len(plan.stages), plan.num_microbatches, plan.chunks
    played = play(schedule or plan.schedule, pp, v, m, stage_seconds(plan))
    tails = [stage.time_s.tail for stage in plan.stages]
    slowest = max(tails, default=0.0)
    shared = max(0.0, (plan.predicted.tail_time_s or 0.0) - slowest)
    drained = played.pipeline_s
    blocks = list(played.blocks)
    for rank, tail in enumerate(tails):
        if tail > 0:
            blocks.append(Block(rank=rank, kind="tail", start_s=drained, end_s=drained + tail))
        if shared > 0:
            blocks.append(Block(rank=rank, kind="tail", start_s=drained + slowest,
                                end_s=drained + slowest + shared))
    return Timeline(schedule=played.schedule, num_ranks=pp, num_microbatches=m, chunks=v,
                    blocks=tuple(blocks), peak_inflight=played.peak_inflight)


_LETTERS = {"forward": "F", "backward": "B", "weight": "W", "recompute": "R",
            "host": "H", "collective": "c", "p2p": "c", "tail": "T"}


def text_lines(timeline: Timeline, width: int = 72) -> list[str]:
    """The timeline as one line of ``width`` characters per rank: in each column the
    letter of what fills most of it (F forward, B backward, W weight gradient, R
    recompute, H host copies of offloaded activations left exposed, c communication, T
    tail), ``.`` where the rank mostly waits."""
    step = timeline.step_s
    if step <= 0:
        return []
    column = step / width
    filled_by_rank = [[{} for _ in range(width)] for _ in range(timeline.num_ranks)]
    for block in timeline.blocks:
        filled = filled_by_rank[block.rank]
        letter = _LETTERS[block.kind]
        first = min(int(block.start_s / column), width - 1)
        last = min(int(block.end_s / column), width - 1)
        for col in range(first, last + 1):
            overlap = min(block.end_s, (col + 1) * column) - max(block.start_s, col * column)
            filled[col][letter] = filled[col].get(letter, 0.0) + max(overlap, 0.0)
    lines = []
    for rank, filled in enumerate(filled_by_rank):
        row = "".join(max(cell, key=cell.get) if cell and sum(cell.values()) >= column / 2
                      else "." for cell in filled)
        lines.append(f"stage {rank:>{len(str(timeline.num_ranks - 1))}} |{row}|")
    return lines


__all__ = ["Block", "KINDS", "Op", "SCHEDULE_TABLE", "StageSeconds", "Timeline",
           "csv_rows", "csv_text", "held_per_run", "plan_csv", "play",
           "schedule_order", "simulate", "stage_seconds", "text_lines", "torch_order"]
