"""The step timeline: schedule orders written out by hand, hand-solved pipelines whose
simulated step equals the cost model's, and the invariants every simulation keeps."""

from __future__ import annotations

import dataclasses

import pytest

from partc.compiler import plan_problem
from partc.placement import Placement
from partc.plan import TensorParallelPlan, TPCollective
from partc.problem import Pins
from partc.timeline import KINDS, Op, schedule_order, simulate, text_lines

from .planner.instances import devices, layer, problem

MS = 1e-3


def _ops(order: list[Op]) -> list[str]:
    return [f"{op.phase[0].upper()}{op.microbatch}" + (f"c{op.chunk}" if op.chunk else "")
            for op in order]


def test_schedule_orders():
    assert _ops(schedule_order("gpipe", 0, 2, 3)) == ["F0", "F1", "F2", "B0", "B1", "B2"]
    # 1F1B: pp - rank - 1 warm-up forwards, then one forward and one backward in turn.
    assert _ops(schedule_order("1f1b", 0, 3, 4)) == ["F0", "F1", "F2", "B0", "F3", "B1",
                                                      "B2", "B3"]
    assert _ops(schedule_order("1f1b", 2, 3, 4)) == ["F0", "B0", "F1", "B1", "F2", "B2",
                                                      "F3", "B3"]
    # Interleaved (Megatron): microbatches go through the chunks pp at a time, backwards
    # take the chunks last first; rank 0 of 2 warms up with 2 (pp - 1) + (v - 1) pp = 4.
    assert _ops(schedule_order("interleaved-1f1b", 0, 2, 2, chunks=2)) == [
        "F0", "F1", "F0c1", "F1c1", "B0c1", "B1c1", "B0", "B1"]
    assert _ops(schedule_order("interleaved-1f1b", 1, 2, 2, chunks=2)) == [
        "F0", "F1", "F0c1", "B0c1", "F1c1", "B1c1", "B0", "B1"]
    with pytest.raises(ValueError, match="multiple of the pipeline degree"):
        schedule_order("interleaved-1f1b", 0, 2, 3, chunks=2)


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
    assert plan.stages[0].time_s.comm > 0   # the 2 MB activations cross at 1 GB/s
    first = {}   # the first block of each kind per rank and microbatch
    for b in timeline.blocks:
        first.setdefault((b.rank, b.microbatch, b.kind), b)
    for mb in range(plan.num_microbatches):   # stage 1 computes what stage 0 sent
        sent = first[(0, mb, "p2p")]
        assert sent.start_s >= first[(0, mb, "forward")].end_s - 1e-15
        assert first[(1, mb, "forward")].start_s >= sent.end_s - 1e-15


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
