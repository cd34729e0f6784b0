"""The step timeline: schedule orders written out by hand, hand-solved pipelines whose
simulated step equals the cost model's, and the invariants every simulation keeps."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from partc.compiler import plan_problem
from partc.placement import Placement
from partc.plan import TensorParallelPlan, TPCollective
from partc.problem import Pins
from partc.cost.schedules import SCHEDULE_TABLE, schedule, stages_of_rank
from partc.cost.evaluate import exposed_sync_ps
from partc.cost.timeline import (KINDS, ONE_STAGE_WINDOWS, WINDOW_STEPS, Op, StageSeconds,
                                 Windows, _undominated, csv_text, overlap_windows, play,
                                 played_span, schedule_order, simulate, text_lines,
                                 torch_order)

from .planner.instances import devices, layer, problem

MS = 1e-3


def _ops(order: list[Op], pp: int) -> list[str]:
    return [f"{op.phase[0].upper()}{op.microbatch}" + (f"c{op.stage // pp}" if op.stage >= pp
                                                      else "")
            for op in order]


def test_schedule_orders():
    assert _ops(schedule_order("gpipe", 0, 2, 3), 2) == ["F0", "F1", "F2", "B0", "B1", "B2"]
    # 1F1B: pp - rank - 1 warm-up forwards, then one forward and one backward in turn.
    assert _ops(schedule_order("1f1b", 0, 3, 4), 3) == ["F0", "F1", "F2", "B0", "F3", "B1",
                                                         "B2", "B3"]
    assert _ops(schedule_order("1f1b", 2, 3, 4), 3) == ["F0", "B0", "F1", "B1", "F2", "B2",
                                                         "F3", "B3"]
    # Interleaved (torch's order): microbatches go through the chunks pp at a time,
    # backwards take the chunks last first.
    assert _ops(schedule_order("interleaved-1f1b", 0, 2, 2, chunks=2), 2) == [
        "F0", "F1", "F0c1", "F1c1", "B0c1", "B1c1", "B0", "B1"]
    # Zero-bubble: the backward split into input (I) and weight (W) gradients.
    phases = {op.phase for op in schedule_order("zbv-zero-bubble", 0, 2, 4, chunks=2)}
    assert phases >= {"forward", "input", "weight"}
    with pytest.raises(ValueError, match="multiple of its rounds"):
        schedule_order("interleaved-1f1b", 0, 2, 5, chunks=2)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                                    ("looped-bfs", 2), ("interleaved-zero-bubble", 2),
                                    ("zbv-zero-bubble", 2), ("dualpipev", 2)])
def test_every_schedule_plays_out(name, v):
    # 4 ranks, 8 microbatches, equal virtual stages of 1 ms forward, 2 ms backward (per
    # rank). Every operation runs once; the step is at least the busiest rank's work and
    # at most GPipe's fill-and-drain.
    stages = [StageSeconds(forward=1 * MS / v, backward=2 * MS / v)] * (4 * v)
    timeline = play(name, 4, v, 8, stages, [0.0] * 4)
    for rank in range(4):
        assert timeline.seconds(rank) == pytest.approx(8 * 3 * MS)
    assert 8 * 3 * MS - 1e-12 <= timeline.step_s <= (8 + 3) * 3 * MS + 1e-12
    if name in ("gpipe", "1f1b"):
        assert timeline.step_s == pytest.approx((8 + 3) * 3 * MS)
    if name == "interleaved-1f1b":   # Megatron's (m + (p - 1) / v) t
        assert timeline.step_s == pytest.approx((8 + 3 / 2) * 3 * MS)
    if schedule(name).split_backward:   # the weight gradients fill the bubble
        assert timeline.bubble_fraction < 0.1
        assert 0 < timeline.seconds(0, ("weight",)) <= 8 * MS + 1e-12


def test_the_span_alone_is_the_timelines():
    """played_span (what pricing a plan reads, no blocks made) gives the timeline's own
    pipeline end and bubble, to the bit, on unequal stages of every schedule."""
    rng = random.Random(3)
    for name in SCHEDULE_TABLE:
        v = 1 if schedule(name).virtual_stages == (1,) else 2
        for m in (3, 6):
            if name == "dualpipev" and m < 3 * v:
                continue
            stages = [StageSeconds(forward=rng.choice([0.0, rng.random()]),
                                   backward=rng.random(), recompute=0.1 * rng.random(),
                                   send=0.01 * rng.random(), receive=0.001 * rng.random())
                      for _ in range(3 * v)]
            timeline = play(name, 3, v, m, stages, [1.0] * 3)
            assert played_span(name, 3, v, m, stages) == (timeline.pipeline_s,
                                                           timeline.bubble_fraction)


def test_a_play_past_its_cutoff_stops_at_a_lower_bound():
    """A play told a cutoff returns the span in full where it does not exceed it, and
    where it does either the span in full or a lower bound on it above the cutoff and
    no bubble; well below the span it stops, on every schedule, unequal stages."""
    rng = random.Random(5)
    stopped = set()
    for name in SCHEDULE_TABLE:
        v = 1 if schedule(name).virtual_stages == (1,) else 2
        for m in (6, 12):
            stages = [StageSeconds(forward=rng.random(), backward=2 * rng.random(),
                                   recompute=0.1 * rng.random(), host=0.05 * rng.random(),
                                   send=0.01 * rng.random(), send_delay=0.02 * rng.random(),
                                   receive=0.01 * rng.random(),
                                   receive_delay=0.02 * rng.random())
                      for _ in range(3 * v)]
            full = played_span(name, 3, v, m, stages)
            for share in (0.3, 0.9, 0.999999, 1.0, 1.5):
                cutoff = full[0] * share
                span, bubble = played_span(name, 3, v, m, stages, cutoff)
                if bubble is not None or full[0] <= cutoff:
                    assert (span, bubble) == full, (name, m, share)
                else:
                    assert cutoff < span <= full[0] * (1 + 1e-12), (name, m, share)
                    stopped.add((name, share))
    assert {(name, 0.3) for name in SCHEDULE_TABLE} <= stopped


@pytest.mark.parametrize("name", ["interleaved-1f1b", "zbv-zero-bubble"])
def test_csv_export_loads_in_torch(name, tmp_path):
    """What partc writes, torch's own CSV loader reads back (and lowers with its sends and
    receives) to the order partc priced."""
    import types

    import torch
    from torch.distributed.pipelining import schedules as torch_schedules

    pp, v, m = 2, 2, 4
    path = tmp_path / "schedule.csv"
    path.write_text(csv_text(name, pp, v, m))
    module = torch.nn.Module()
    stages = [types.SimpleNamespace(num_stages=pp * v, group_size=pp, group_rank=0,
                                    stage_index=j, is_first=j == 0,
                                    is_last=j == pp * v - 1, submod=module)
              for j in stages_of_rank(name, pp, v, 0)]
    loaded = getattr(torch_schedules, schedule(name).torch_class)(
        stages, m, loss_fn=lambda output, target: output)
    loaded.pipeline_order = {}
    loaded._load_csv(str(path))
    letters = {"forward": "F", "backward": "B", "input": "I", "weight": "W"}
    assert [[(a.stage_index, a.computation_type.value, a.microbatch_index)
             for a in loaded.pipeline_order[rank]] for rank in range(pp)] == \
        [[(op.stage, letters[op.phase], op.microbatch) for op in ops]
         for ops in torch_order(name, pp, v, m)]
    assert loaded.pipeline_order_with_comms   # lowered with its sends and receives


def _four_layers(pins: Pins, batch: int = 4, cuts: float = 0.0):
    """4 equal layers (1 ms forward, 2 ms backward), no parameters."""
    layers = [layer(f"l{i}", params=0) for i in range(4)]
    return plan_problem(problem(layers, [cuts] * 3, devices(2, 10**9), batch=batch,
                                micro_batch_sizes=(1,), pins=pins))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_balanced_stages_take_the_cost_models_time(schedule):
    # Two layers per stage: (m - 1) * 6 + 2 * 6 = 30 ms for m = 4, either schedule.
    plan = _four_layers(Pins(pp=2, schedule=schedule))
    timeline = simulate(plan)
    assert timeline.pipeline_s == pytest.approx(30 * MS)
    assert timeline.pipeline_s == pytest.approx(plan.predicted.pipeline_time_s)
    # Stage 1 starts after stage 0's first forward (2 ms) and waits nowhere else but
    # at the end: its 24 ms of work end at 26 ms, then it idles until stage 0 is done.
    assert timeline.idle_s(1) == pytest.approx(2 * MS + 4 * MS + timeline.step_s
                                               - timeline.pipeline_s)


def test_interleaving_matches_the_cost_model():
    # Rank 0 runs layers 0 and 2, rank 1 layers 1 and 3: m * 6 + (12 - 6) / 2 = 15 ms.
    plan = _four_layers(Pins(pp=2, schedule="interleaved-1f1b"), batch=2)
    assert plan.chunks == 2
    timeline = simulate(plan)
    assert timeline.pipeline_s == pytest.approx(15 * MS)
    assert {b.chunk for b in timeline.blocks if b.rank == 0} == {0, 1}


def test_every_rank_does_its_stages_work_in_order():
    plan = _four_layers(Pins(pp=2, schedule="1f1b"), batch=8, cuts=2e6)
    timeline = simulate(plan)
    for stage in plan.stages:
        t = stage.time_s
        assert timeline.seconds(stage.index) == pytest.approx(
            t.forward + t.backward + t.recompute + t.comm + t.tail)
        assert timeline.seconds(stage.index, ("p2p",)) == pytest.approx(t.comm)
        blocks = sorted((b for b in timeline.blocks if b.rank == stage.index),
                        key=lambda b: b.start_s)
        assert all(a.end_s <= b.start_s + 1e-15 for a, b in zip(blocks, blocks[1:]))
        assert {b.kind for b in blocks} <= set(KINDS)
    # The 2 MB activations cross at 1 GB/s: NCCL's sends cost neither end's compute
    # (overlap 1), and the transfer delays stage 1.
    [run] = plan.stages[0].run_times
    assert plan.stages[0].time_s.comm == 0 and run.send_delay > 0
    first = {}   # the first block of each kind per rank and microbatch
    for b in timeline.blocks:
        first.setdefault((b.rank, b.microbatch, b.kind), b)
    for mb in range(plan.num_microbatches):   # stage 1 computes what stage 0 sent
        sent = first[(0, mb, "forward")].end_s + run.send + run.send_delay
        assert first[(1, mb, "forward")].start_s >= sent - 1e-15


def test_text_timeline():
    plan = _four_layers(Pins(pp=2, schedule="gpipe"))
    lines = text_lines(simulate(plan), width=30)
    # 30 ms in 30 columns. Stage 1 runs its 4 forwards (2 ms each) from 2 ms, then its
    # backwards (4 ms each) from 10 ms to 26 ms; stage 0 runs its forwards from 0, waits
    # for stage 1's first backward until 14 ms, then runs each backward as it is handed
    # over, until 30 ms.
    assert lines == ["stage 0 |FFFFFFFF......BBBBBBBBBBBBBBBB|",
                     "stage 1 |..FFFFFFFFBBBBBBBBBBBBBBBB....|"]


def test_tensor_parallel_collectives_are_split_by_their_bytes():
    plan = _four_layers(Pins(pp=2, schedule="1f1b"))
    # As if l1 ran tensor-parallel: 3 ms of collectives per microbatch, a third of the
    # bytes in forward (inside the stage's forward and backward figures).
    section = TensorParallelPlan(
        degree=2, sequence_parallel=False, objective="time",
        params={"l1.weight": Placement.parse("Shard(0)")},
        collectives={"l1": (TPCollective(kind="all_reduce", phase="forward", nbytes=1000),
                            TPCollective(kind="all_reduce", phase="backward", nbytes=2000))},
        collective_seconds={"l1": 0.3 * MS})
    plan = dataclasses.replace(plan, tensor_parallel=section)
    timeline = simulate(plan)
    m = plan.num_microbatches
    assert timeline.seconds(0, ("collective",)) == pytest.approx(0.3 * MS * m)
    assert timeline.seconds(1, ("collective",)) == 0
    forward = [b for b in timeline.blocks if b.rank == 0 and b.microbatch == 0
               and b.kind == "collective"]
    assert [b.seconds for b in forward] == pytest.approx([0.1 * MS, 0.2 * MS])
    # The stage's work is unchanged: its forward and backward figures hold the collectives.
    stage = plan.stages[0].time_s
    assert timeline.seconds(0) == pytest.approx(stage.forward + stage.backward + stage.tail)


def test_the_plan_prices_every_schedule_on_its_mesh():
    # 8 equal layers on 4 ranks, 8 microbatches, ZBV pinned: the plan's step is its
    # simulation; every other schedule is priced on the same mesh, and the zero-bubble
    # ones beat 1F1B (whose bubble is (p - 1) / (m + p - 1) of the step, 3/11).
    layers = [layer(f"l{i}", params=0) for i in range(8)]
    plan = plan_problem(problem(layers, [0.0] * 7, devices(4, 10**9), batch=8,
                                micro_batch_sizes=(1,),
                                pins=Pins(pp=4, schedule="zbv-zero-bubble")))
    options = {(o.schedule, o.virtual_stages): o for o in plan.schedules}
    chosen = plan.schedules[0]
    assert (chosen.schedule, chosen.how) == ("zbv-zero-bubble", "chosen")
    assert chosen.step_time_s == pytest.approx(plan.predicted.step_time_s)
    assert {name for name, _ in options} == set(SCHEDULE_TABLE)
    assert options[("1f1b", 1)].bubble_fraction == pytest.approx(3 / 11, abs=1e-3)
    assert chosen.step_time_s < options[("1f1b", 1)].step_time_s
    assert simulate(plan).step_s == pytest.approx(plan.predicted.step_time_s, rel=1e-6)


def test_a_ranks_peaks_are_the_moments_no_other_reaches_everywhere():
    """held_per_run keeps the moments of a rank no other moment reaches in every run:
    its frontier check equals the pairwise definition."""
    rng = random.Random(3)
    for _ in range(400):
        width = rng.randint(1, 4)
        moments = {tuple(rng.randint(0, 5) for _ in range(width))
                   for _ in range(rng.randint(1, 25))}
        kept = tuple(sorted(h for h in moments if not any(
            g != h and all(a >= b for a, b in zip(g, h)) for g in moments)))
        assert _undominated(moments) == kept


# -- what hides the data-parallel collectives ---------------------------------------------

def test_overlap_windows_read_the_schedules_order():
    """Interleaved 1F1B's cool-down runs each virtual stage's last ``pp`` backwards, so
    the stage done ``j``-th from last has ``(j - 1) pp`` backwards after its own on every
    rank; a split backward's last weight pass hides half a backward; one stage per rank
    hides behind its last backward and its first forward. Forwards come ``pp`` per stage
    in the warm-up."""
    steps = WINDOW_STEPS
    for rank in overlap_windows("interleaved-1f1b", 8, 6, 32):
        assert rank.sync == tuple(steps * (1 + 8 * j) for j in range(6))
        assert rank.gather == tuple(steps * (1 + 8 * j) for j in range(6))
    for rank in overlap_windows("zbv-zero-bubble", 4, 2, 8):
        assert rank.sync[0] == steps // 2 and rank.sync[1] >= steps
    assert overlap_windows("1f1b", 4, 1, 8) == (Windows(*ONE_STAGE_WINDOWS),) * 4


def _queued(done: list[float], share: float, end: float) -> float:
    """What a serial link leaves after ``end`` of reductions of ``share`` seconds each,
    released at ``done``: played out reduction by reduction."""
    clock = -math.inf
    for release in sorted(done):
        clock = max(clock, release) + share
    return max(0.0, clock - end)


@pytest.mark.parametrize("name, pp, v, m", [("interleaved-1f1b", 4, 2, 8),
                                            ("interleaved-1f1b", 2, 4, 4),
                                            ("looped-bfs", 3, 3, 6),
                                            ("interleaved-zero-bubble", 4, 2, 8),
                                            ("zbv-zero-bubble", 4, 2, 8),
                                            ("dualpipev", 2, 2, 4)])
def test_exposed_sync_is_the_reductions_played_after_each_stage(name, pp, v, m):
    """The closed form of a rank's exposed gradient reduction (at a whole overlap) is what
    a serial link leaves when each virtual stage's ``v``-th of it starts as that stage's
    last gradient-making op starts, the rank's ops run back to back at the windows'
    durations (a backward one stage's ``B / v``, a split one's input and weight parts
    their shares, forwards taking no time): the reductions played one by one."""
    rng = random.Random(0)
    for rank, windows in enumerate(overlap_windows(name, pp, v, m)):
        for _ in range(20):
            backward = rng.randint(1, 10**6) * v * WINDOW_STEPS
            sync = rng.randint(0, 3 * backward)
            one = backward // (v * WINDOW_STEPS)   # a window step, in picoseconds
            done = [-k * one for k in windows.sync]   # each stage's start, the end at 0
            expected = _queued(done, sync / v, 0.0)
            assert exposed_sync_ps(sync, backward, 1000, 0, windows.sync) == \
                pytest.approx(expected, abs=1)


def test_more_stages_per_rank_hide_no_less():
    """Against one stage per rank (the last microbatch's backward), a rank's stages done
    early hide more of its reduction, never less, and at no overlap nothing hides."""
    windows = overlap_windows("interleaved-1f1b", 4, 4, 16)[0]
    for sync, backward in ((900, 100), (100, 900), (500, 500), (0, 10)):
        one = exposed_sync_ps(sync, backward, 800)
        many = exposed_sync_ps(sync, backward, 800, windows=windows.sync)
        assert many <= one
        assert exposed_sync_ps(sync, backward, 0, windows=windows.sync) == sync
    assert exposed_sync_ps(1000, 100, 1000, windows=windows.sync) < 1000 - 100


def test_a_transfer_no_end_pays_still_takes_its_link_one_at_a_time():
    """Where neither end pays a transfer (NCCL beside compute: its share 0), the stage
    after still waits for it, and transfers over one link queue: GPipe's forwards over a
    link slower than their compute arrive a transfer apart, not all at once."""
    compute, transfer, m = 1.0, 3.0, 4
    stages = [StageSeconds(forward=compute, backward=2 * compute, send=0.0,
                           send_delay=transfer),
              StageSeconds(forward=compute, backward=2 * compute, receive=0.0,
                           receive_delay=transfer)]
    timeline = play("gpipe", 2, 1, m, stages)
    starts = sorted(b.start_s for b in timeline.blocks if b.rank == 1 and b.kind == "forward")
    assert starts == pytest.approx([compute + transfer * (i + 1) for i in range(m)])
    # Rank 0 is not held up by its sends: its forwards run back to back.
    ends = sorted(b.end_s for b in timeline.blocks if b.rank == 0 and b.kind == "forward")
    assert ends == pytest.approx([compute * (i + 1) for i in range(m)])
