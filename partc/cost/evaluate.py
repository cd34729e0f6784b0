"""An assignment of layers to runs and recompute modes, evaluated from a
:class:`~partc.cost.tables.CostTable` independently of any solver: each rank's time and
memory (:class:`StageCost`), the step in closed form, as the planner's search prices it
(:func:`evaluate`, :func:`pipeline_ps`), and the step a plan reports, its schedule played
out by :mod:`partc.cost.timeline` (:func:`simulated_step_ps`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from partc.cost.offload_time import host_bytes
from partc.cost.pipeline_config import PipelineConfig
from partc.cost.state_bytes import step_total
from partc.cost.tables import CostTable
from partc.cost.timeline import (ONE_STAGE_WINDOWS, WINDOW_STEPS, StageSeconds, Windows,
                                 overlap_windows, play, played_span)
from partc.plan import StageMemory


@dataclass(frozen=True, kw_only=True)
class StageCost:
    layers: tuple[int, ...]
    compute_ps: int
    forward_ps: int
    backward_ps: int
    recompute_ps: int
    comm_ps: int
    tail_ps: int
    param_count: int
    memory: StageMemory
    limit: int
    runs: tuple[tuple[int, ...], ...] = ()   # interleaved: the rank's runs of layers
    # Per run of the rank (model order): forward, backward, recompute, its share of the
    # cut after it (both ways) and of the cut into it (:func:`end_share_ps`), per
    # microbatch; what the simulation plays.
    run_ps: tuple[tuple[int, int, int, int, int], ...] = ()
    # Per run, the whole transfers across the cut after it and into it (both ways), which
    # delay the operation on the other side (the simulation's).
    run_cut_ps: tuple[tuple[int, int], ...] = ()
    # Offloaded activations: bytes per microbatch copied to the host (and back), and the
    # rank's share of its node's host memory (None: not known, no limit).
    offload_bytes: int = 0
    host_limit: int | None = None
    # Per run, the part of its recompute that is offload's exposed copies (the timeline
    # draws it as the host's).
    run_host_ps: tuple[int, ...] = ()

    @property
    def busy_ps(self) -> int:
        return self.compute_ps + self.comm_ps

    @property
    def host_fits(self) -> bool:
        return self.host_limit is None or self.memory.host <= self.host_limit


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    stages: tuple[StageCost, ...]
    pipeline_ps: int
    tail_ps: int
    tie_ps: int
    step_ps: int

    @property
    def fits(self) -> bool:
        return all(s.memory.peak <= s.limit and s.host_fits for s in self.stages)

    @property
    def worst_stage(self) -> StageCost:
        return max(self.stages, key=lambda s: s.memory.peak / max(s.limit, 1))


def exposed_sync_ps(sync_ps: int, backward_ps: int, overlap_permille: int = 1000,
                    last_ps: int = 0, windows: Sequence[int] = ONE_STAGE_WINDOWS[0]) -> int:
    """What is left of a stage's dp gradient all-reduce once its backwards are done,
    rounded up. The last bucket's reduction (``last_ps``: it starts as backward ends, and
    is charged whole in ``CostTable.tail_latency_ps``) is not counted here.

    The rank's ``v`` virtual stages (``len(windows)``) each reduce a ``v``-th of it,
    bucket by bucket from their last backward on, one after the other over the network:
    the reductions of the ``j`` stages finished last start no earlier than the ``j``-th
    from last did, and what the rank's backward does after it (``windows[j - 1]`` in
    :data:`~partc.cost.timeline.WINDOW_STEPS` of one stage's, a ``v``-th of
    ``backward_ps``: :func:`~partc.cost.timeline.overlap_windows`) hides the share
    ``overlap_permille`` / 1000 of them (:func:`partc.cost.pipeline_config.overlapped`);
    what the worst ``j`` leaves is exposed. One stage per rank: all but the share of the
    shorter of the reduction and the last microbatch's backward, ``max(0, sync -
    backward)`` at a whole overlap."""
    sync_ps = max(0, sync_ps - last_ps)
    v, steps = len(windows), WINDOW_STEPS
    worst = max(max(1000 * steps * j * sync_ps - overlap_permille * k * backward_ps
                    for j, k in enumerate(windows, 1)),
                (1000 - overlap_permille) * steps * v * sync_ps)
    return max(0, -(-worst // (1000 * steps * v)))


def exposed_gather_ps(gather_ps: int, forward_ps: int, first_ps: int,
                      overlap_permille: int = 1000,
                      windows: Sequence[int] = ONE_STAGE_WINDOWS[1]) -> int:
    """What is left of a stage's ZeRO-1 weight all-gather (``gather_ps``, overlapping
    the next step's forward) beyond the first bucket's (``first_ps``, which the first
    layer waits for before any runs: charged whole in ``CostTable.tail_latency_ps``): what
    the forwards before each virtual stage's first and that one (``windows``, of a
    ``v``-th of ``forward_ps``, one microbatch's; the first microbatch's meets the waits)
    do not hide, the stages' gathers issued in the order forward reads them, as
    :func:`exposed_sync_ps`."""
    return exposed_sync_ps(max(0, gather_ps - first_ps), forward_ps, overlap_permille,
                           windows=windows)


def stage_windows(config: PipelineConfig, stage: int) -> Windows:
    """Rank ``stage``'s :func:`~partc.cost.timeline.overlap_windows` under ``config``."""
    if config.chunks == 1:
        return Windows(*ONE_STAGE_WINDOWS)
    return overlap_windows(config.schedule, config.pp, config.chunks,
                           config.num_microbatches)[stage]


def _holders(table: CostTable, stage_of: Sequence[int]) -> list[set[int]]:
    """Per shared group, the ranks holding it (``stage_of`` gives runs, see
    :attr:`PipelineConfig.virtual_stages`)."""
    config = table.config
    return [{config.rank_of(stage_of[l]) for l in group.layers} for group in table.shared]


def receive_bytes(table: CostTable, runs: Sequence[Sequence[int]],
                  numbers: Sequence[int]) -> int:
    """The receive buffers of the rank whose runs ``numbers`` hold the layers ``runs``:
    the gradient crossing the cut after each run but the model's last.

    partc's stage (:class:`partc.runtime.pipeline_stage.CountingStage`) makes a
    microbatch's buffers when their receive is posted and lets them go after its
    backward, as Megatron does. A buffer of activations is the stage's input itself,
    which its first layer saves for backward while its microbatch is in flight: counted
    in :meth:`PipelineConfig.activations`, nothing more here. A buffer of gradients
    lives from just before a run's backward to its end: one per run at a time, the bytes
    crossing out once. (What crosses a cut is counted whole, though a value without a
    gradient, a mask or the positions, gets no gradient buffer; and a value read by
    several layers, charged to the layer that makes it, is not among the first layer's
    saved inputs.) ``benchmarks/memory_check.py`` measures it."""
    last = table.config.virtual_stages - 1
    return sum(table.cut_bytes[run[-1]] for j, run in zip(numbers, runs)
               if run and j < last)


def end_share_ps(table: CostTable, transfer_ps: int) -> int:
    """What one end of a pipeline transfer of ``transfer_ps`` (a cut's ``cut_ps``, both
    ways) loses of its own time: all but the share ``comm_overlap`` of it, the sender
    and the receiver alike. The transfer itself delays the operation waiting for it by
    all of it (the simulation's, :func:`~partc.cost.timeline.play`). NCCL's send and
    receive kernels run beside both ends' compute (overlap 1: nothing lost), gloo's
    threads on the cores they compute on (a CPU's calibrated overlap, about 0.2), so
    both ends lose it there."""
    return transfer_ps * (1000 - table.overlap_permille) // 1000


def boundary_share_ps(table: CostTable, cut: int, boundary: int) -> int:
    """Either end's share (:func:`end_share_ps`) of cut ``cut``'s transfers as the
    boundary ``boundary -> boundary + 1`` (both ways: the activation, its gradient
    back), charged to the runs on both sides of the boundary."""
    return end_share_ps(table, table.cut_ps[cut][boundary])


def _stage_cost(table: CostTable, stage: int, runs: list[list[int]], modes: Sequence[str],
                held: list[int], numbers: Sequence[int] = ()) -> StageCost:
    """Rank ``stage``'s costs; ``runs`` are its runs of layers (one unless interleaved),
    each sending to the next run's rank unless it is the model's last."""
    config = table.config
    members = sorted(l for run in runs for l in run)
    rows = [table.layers[l] for l in members]
    state = {k: sum(r.state_bytes[k] for r in rows)
             + sum(table.shared[g].state_bytes[k] for g in held)
             for k in ("params", "grads", "optimizer")}
    saved = [sum(table.layers[l].saved_bytes[modes[l]] for l in run) for run in runs]
    activations = config.activations(stage, saved)
    offloaded = [sum(host_bytes(table.layers[l], modes[l]) for l in run)
                 for run in runs]
    host = config.activations(stage, offloaded)
    transient = max(table.layers[l].transient_bytes[modes[l]] for l in members)
    step = step_total([r.step_bytes for r in rows] + [table.shared[g].step_bytes for g in held],
                      table.step_sums)
    forward = sum(r.forward_ps for r in rows)
    backward = sum(r.backward_ps for r in rows)
    recompute = sum(table.layers[l].recompute_ps[modes[l]] for l in members)
    numbers = numbers or config.runs_of(stage)
    windows = stage_windows(config, stage)
    receive = receive_bytes(table, runs, numbers)
    # The whole transfers across the cut after each run and into it (the simulation's
    # delays), and this rank's end's share of each (its time).
    out_cut = [table.cut_ps[run[-1]][j] if run and j < config.virtual_stages - 1 else 0
               for j, run in zip(numbers, runs)]
    # Runs are contiguous in model order: the cut into run j is its first layer's - 1.
    into_cut = [table.cut_ps[run[0] - 1][j - 1] if run and j > 0 else 0
                for j, run in zip(numbers, runs)]
    sent = [end_share_ps(table, cut) for cut in out_cut]
    received = [end_share_ps(table, cut) for cut in into_cut]
    comm = sum(sent) + sum(received)
    run_ps = tuple(
        (sum(table.layers[l].forward_ps for l in run),
         sum(table.layers[l].backward_ps for l in run),
         sum(table.layers[l].recompute_ps[modes[l]] for l in run), out, into)
        for run, out, into in zip(runs, sent, received))
    return StageCost(
        run_ps=run_ps,
        run_cut_ps=tuple(zip(out_cut, into_cut)),
        layers=tuple(members),
        compute_ps=forward + backward + recompute,
        forward_ps=forward, backward_ps=backward, recompute_ps=recompute, comm_ps=comm,
        tail_ps=exposed_sync_ps(
            sum(r.sync_ps for r in rows) + sum(table.shared[g].sync_ps for g in held),
            backward, table.overlap_permille, table.last_sync_ps, windows.sync)
        + sum(r.tail_ps for r in rows)
        + sum(table.shared[g].tail_ps for g in held)
        + exposed_gather_ps(
            sum(r.gather_ps for r in rows) + sum(table.shared[g].gather_ps for g in held),
            forward, table.first_gather_ps, table.overlap_permille, windows.gather),
        param_count=sum(r.param_count for r in rows)
        + sum(table.shared[g].param_count for g in held),
        memory=StageMemory(**state, activations=activations, transient=transient,
                           receive=receive, step=step,
                           peak=sum(state.values()) + max(activations + transient + receive,
                                                          step), host=host),
        limit=table.limits[stage],
        offload_bytes=sum(offloaded), host_limit=table.host_limit,
        run_host_ps=tuple(sum(table.layers[l].recompute_ps[modes[l]] for l in run
                              if modes[l] == "offload") for run in runs),
        runs=tuple(tuple(run) for run in runs) if config.chunks > 1 else (),
    )


def pipeline_ps(config: PipelineConfig, busy: Sequence[int], delays: int = 0) -> int:
    """Forward and backward of all microbatches, ``busy`` per rank and microbatch: every
    microbatch passes the bottleneck rank, and the first one passes every rank once, and
    every transfer between them (``delays``: what of each its ends do not pay, both
    ways, :func:`transfer_delays_ps`); interleaving divides that fill-and-drain by the
    chunks (Megatron: ``(m + (p - 1) / v) t`` for equal ranks)."""
    peak = max(busy)
    return config.num_microbatches * peak + (sum(busy) - peak + delays) // config.fill_divisor


def transfer_delays_ps(stages: Sequence[StageCost]) -> int:
    """What of the pipeline's transfers, both ways across every cut between two ranks,
    neither end pays (:func:`end_share_ps`): the time they still add to the first
    microbatch's way through the pipeline and the last one's way back."""
    return sum(whole - share for stage in stages
               for (whole, _), (*_, share, _) in zip(stage.run_cut_ps, stage.run_ps))


def simulate(config: PipelineConfig, evaluation: Evaluation, schedule: str | None = None):
    """The configuration's step played out by :func:`partc.cost.timeline.play` from the
    evaluation's figures per run and microbatch, in picoseconds (a ``Timeline`` whose
    seconds are picoseconds; the tails are the ranks' own). ``schedule`` plays another
    schedule of the same placement and virtual stages."""
    return play(schedule or config.schedule, config.pp, config.chunks,
                config.num_microbatches, _run_seconds(config, evaluation),
                [stage.tail_ps for stage in evaluation.stages])


def _run_seconds(config: PipelineConfig, evaluation: Evaluation) -> list[StageSeconds]:
    """Each run's figures per microbatch, as the simulation takes them."""
    runs: list[StageSeconds | None] = [None] * config.virtual_stages
    for s, stage in enumerate(evaluation.stages):
        host = stage.run_host_ps or (0,) * len(stage.run_ps)
        for j, (forward, backward, recompute, cut, into), copies, (out_ps, in_ps) in zip(
                config.runs_of(s), stage.run_ps, host, stage.run_cut_ps):
            runs[j] = StageSeconds(forward=forward, backward=backward, recompute=recompute,
                                   host=copies, send=cut / 2, receive=into / 2,
                                   send_delay=(out_ps - cut) / 2,
                                   receive_delay=(in_ps - into) / 2)
    return runs  # type: ignore[return-value]


def simulated_step_ps(config: PipelineConfig, evaluation: Evaluation,
                      cutoff: float = math.inf) -> tuple[int, float | None]:
    """The step time the plan reports, in picoseconds: the simulated pipeline
    (:func:`simulate`, its span alone: :func:`~partc.cost.timeline.played_span`) then
    the slowest tail and the tied-weight syncs, as :func:`evaluate` adds them to the
    closed form; and the simulation's bubble. Where the step would exceed ``cutoff``,
    the play may stop early: then a lower bound on the step, at least ``cutoff``, and
    None for the bubble."""
    extra = evaluation.tail_ps + evaluation.tie_ps
    span, bubble = played_span(config.schedule, config.pp, config.chunks,
                               config.num_microbatches, _run_seconds(config, evaluation),
                               cutoff - extra)
    return round(span) + extra, bubble


def evaluate(table: CostTable, stage_of: Sequence[int], modes: Sequence[str]) -> Evaluation:
    """Step time and memory of one assignment; independent of any solver. ``stage_of``
    gives each layer's run (its rank unless interleaved: run ``j`` is on rank ``j % pp``)."""
    config = table.config
    pp = config.pp
    runs: list[list[int]] = [[] for _ in range(config.virtual_stages)]
    for layer, run in enumerate(stage_of):
        runs[run].append(layer)
    holders = _holders(table, stage_of)
    stages = tuple(
        _stage_cost(table, s, [runs[j] for j in config.runs_of(s)], modes,
                    [g for g, held in enumerate(holders) if s in held], config.runs_of(s))
        for s in range(pp)
    )
    pipeline = pipeline_ps(config, [s.busy_ps for s in stages], transfer_delays_ps(stages))
    tail = max(s.tail_ps for s in stages) + table.tail_latency_ps
    tie = sum(group.tie_sync_ps * (len(held) - 1)
              for group, held in zip(table.shared, holders))
    return Evaluation(stages=stages, pipeline_ps=pipeline, tail_ps=tail, tie_ps=tie,
                      step_ps=pipeline + tail + tie)
