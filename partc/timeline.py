"""One training step as each pipeline rank spends it, simulated from a plan's cost figures.

The cost model (:mod:`partc.costs`) prices a step in closed form: ``(m - 1) * max_s t_s +
sum_s t_s`` for the pipeline, then the tail. This module plays the schedule out instead,
so a person can see where each rank computes, communicates and waits:

- every rank runs its operations in the schedule's order (:func:`schedule_order`):
  GPipe all forwards then all backwards; 1F1B ``pp - s - 1`` warm-up forwards, then one
  forward and one backward in turn, then the remaining backwards; interleaved 1F1B
  Megatron's order over ``v`` chunks per rank;
- an operation starts when its rank is free and its input is there: a forward needs the
  previous run's forward of the same microbatch (its activation sent), a backward the
  next run's backward (the gradient of its output) or, on the model's last run, its own
  forward;
- durations are the plan's per-rank figures per microbatch (``StageTime`` over the
  microbatches, and over the chunks when interleaved): a forward is its compute, then
  the send of its activation (half of the rank's point-to-point time); a backward is the
  receipt of its output's gradient (the other half), the recompute, then the backward.
  Tensor-parallel collectives (``TensorParallelPlan.collective_seconds``) are inside the
  forward and backward figures; they are drawn as communication, split between the
  phases by their bytes;
- after its last backward each rank runs its tail (exposed gradient sync, optimizer
  step).

Each row stands for every rank of a stage (its dp x tp ranks run alike). The simulated
step can differ a little from the cost model's when the stages differ in time (the
closed form assumes every microbatch waits only for the slowest stage); the report shows
both.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .plan import Plan
from .spec import INTERLEAVED

#: Kinds of :class:`Block`, in the order pictures list them.
KINDS = ("forward", "backward", "recompute", "collective", "p2p", "tail")
COMPUTE_KINDS = ("forward", "backward", "recompute")
COMM_KINDS = ("collective", "p2p")


@dataclass(frozen=True, kw_only=True)
class Block:
    """One stretch of a rank's step: ``kind`` (one of :data:`KINDS`) from ``start_s`` to
    ``end_s``; ``microbatch`` and ``chunk`` (the rank's run of layers, 0 unless
    interleaved) name the operation it belongs to, None for the tail."""

    rank: int
    kind: str
    start_s: float
    end_s: float
    microbatch: int | None = None
    chunk: int = 0

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, kw_only=True)
class Op:
    """One forward or backward of a microbatch through one chunk of a rank."""

    phase: str        # "forward" | "backward"
    microbatch: int
    chunk: int = 0


@dataclass(frozen=True, kw_only=True)
class OpTimes:
    """Seconds of one operation's parts on a rank, per microbatch and chunk."""

    forward: float
    backward: float
    recompute: float
    collective_forward: float   # part of ``forward`` spent in tp collectives
    collective_backward: float  # part of ``backward``
    p2p: float                  # each way: activation out, gradient in


@dataclass(frozen=True, kw_only=True)
class Timeline:
    schedule: str
    num_ranks: int
    num_microbatches: int
    chunks: int
    blocks: tuple[Block, ...]

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


def schedule_order(schedule: str, rank: int, pp: int, microbatches: int,
                   chunks: int = 1) -> list[Op]:
    """The operations rank ``rank`` of ``pp`` runs, in order."""
    m = microbatches
    if schedule == "gpipe":
        return ([Op(phase="forward", microbatch=i) for i in range(m)]
                + [Op(phase="backward", microbatch=i) for i in range(m)])
    if schedule == "1f1b":
        warmup = min(pp - rank - 1, m)
        return _one_forward_one_backward(
            [Op(phase="forward", microbatch=i) for i in range(m)],
            [Op(phase="backward", microbatch=i) for i in range(m)], warmup)
    if schedule == INTERLEAVED:
        if m % pp:
            raise ValueError(f"interleaved 1F1B needs the microbatches ({m}) to be a "
                             f"multiple of the pipeline degree ({pp})")
        total = m * chunks
        warmup = min(2 * (pp - rank - 1) + (chunks - 1) * pp, total)
        return _one_forward_one_backward(
            [_interleaved(k, pp, chunks, "forward") for k in range(total)],
            [_interleaved(k, pp, chunks, "backward") for k in range(total)], warmup)
    raise ValueError(f"no timeline for schedule {schedule!r}")


def _one_forward_one_backward(forwards: list[Op], backwards: list[Op], warmup: int) -> list[Op]:
    order = forwards[:warmup]
    for i in range(len(forwards) - warmup):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[len(forwards) - warmup:]


def _interleaved(k: int, pp: int, chunks: int, phase: str) -> Op:
    """Megatron's k-th forward (or backward) of a rank: microbatches go through the
    chunks ``pp`` at a time; backwards visit the chunks last first."""
    group, within = divmod(k, pp * chunks)
    chunk = within // pp
    if phase == "backward":
        chunk = chunks - 1 - chunk
    return Op(phase=phase, microbatch=group * pp + within % pp, chunk=chunk)


def op_times(plan: Plan) -> list[OpTimes]:
    """Per rank, the seconds of one operation's parts (see the module docstring)."""
    m, chunks, pp = plan.num_microbatches, plan.chunks, len(plan.stages)
    result = []
    for stage in plan.stages:
        t = stage.time_s
        per = m * chunks
        forward_tp, backward_tp = _collective_seconds(plan, stage.layers)
        sending = sum(stage.index + c * pp < pp * chunks - 1 for c in range(chunks))
        result.append(OpTimes(
            forward=t.forward / per, backward=t.backward / per, recompute=t.recompute / per,
            collective_forward=min(forward_tp / chunks, t.forward / per),
            collective_backward=min(backward_tp / chunks, t.backward / per),
            p2p=t.comm / (m * sending) / 2 if sending else 0.0))
    return result


def _collective_seconds(plan: Plan, layers: tuple[str, ...]) -> tuple[float, float]:
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
        share = sum(move.nbytes for move in moves if move.phase == "forward") / total
        forward += seconds * share
        backward += seconds * (1 - share)
    return forward, backward


def simulate(plan: Plan) -> Timeline:
    """The plan's step played out rank by rank (see the module docstring); a rank per
    stage the plan lists."""
    pp, m, chunks = len(plan.stages), plan.num_microbatches, plan.chunks
    runs = pp * chunks
    orders = [schedule_order(plan.schedule, r, pp, m, chunks) for r in range(pp)]
    times = op_times(plan)
    done: dict[tuple[str, int, int], float] = {}   # (phase, microbatch, run) -> ready at
    clock, position = [0.0] * pp, [0] * pp
    blocks: list[Block] = []
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for rank in range(pp):
            while position[rank] < len(orders[rank]):
                op = orders[rank][position[rank]]
                run = rank + op.chunk * pp
                if op.phase == "forward":
                    needs = ("forward", op.microbatch, run - 1) if run > 0 else None
                else:
                    needs = (("backward", op.microbatch, run + 1) if run < runs - 1
                             else ("forward", op.microbatch, run))
                if needs is not None and needs not in done:
                    break
                start = max(clock[rank], done[needs] if needs is not None else 0.0)
                parts = _parts(op, times[rank], sends=run < runs - 1)
                for kind, seconds in parts:
                    if seconds > 0:
                        blocks.append(Block(rank=rank, kind=kind, start_s=start,
                                            end_s=start + seconds, microbatch=op.microbatch,
                                            chunk=op.chunk))
                    start += seconds
                clock[rank] = start
                done[(op.phase, op.microbatch, run)] = start
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"internal error: the {plan.schedule} order deadlocks at "
                               f"positions {position}")
    for rank, stage in enumerate(plan.stages):
        if stage.time_s.tail > 0:
            blocks.append(Block(rank=rank, kind="tail", start_s=clock[rank],
                                end_s=clock[rank] + stage.time_s.tail))
    return Timeline(schedule=plan.schedule, num_ranks=pp, num_microbatches=m, chunks=chunks,
                    blocks=tuple(blocks))


def _parts(op: Op, t: OpTimes, *, sends: bool) -> list[tuple[str, float]]:
    p2p = t.p2p if sends else 0.0
    if op.phase == "forward":
        return [("forward", t.forward - t.collective_forward),
                ("collective", t.collective_forward), ("p2p", p2p)]
    return [("p2p", p2p), ("recompute", t.recompute),
            ("backward", t.backward - t.collective_backward),
            ("collective", t.collective_backward)]


_LETTERS = {"forward": "F", "backward": "B", "recompute": "R", "collective": "c", "p2p": "c",
            "tail": "T"}


def text_lines(timeline: Timeline, width: int = 72) -> list[str]:
    """The timeline as one line of ``width`` characters per rank: in each column the
    letter of what fills most of it (F forward, B backward, R recompute, c communication,
    T tail), ``.`` where the rank mostly waits."""
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
