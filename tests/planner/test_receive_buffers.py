"""The pipeline's receive buffers in a stage's memory, hand-solved.

partc's pipeline stage makes a microbatch's receive buffers when their receive is posted
and lets them go after its backward (``partc.runtime.pipeline_stage``): a buffer of
activations is the stage's input, which its first layer saves while its microbatch is in
flight, and a buffer of gradients lives through one backward of a run at a time
(``partc.cost.evaluate.receive_bytes``). ``benchmarks/memory_check.py`` measures
them (MemTracker's "Other": the gradient buffers as the stage makes them), e.g. the
shallow case ``gpt-pp2-1f1b-m32-shallow``.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest

from partc.compiler import plan_problem
from partc.cost.evaluate import evaluate
from partc.cost.pipeline_config import PS_PER_S, PipelineConfig
from partc.cost.tables import build_cost_table
from partc.problem import Pins

from .instances import best_split_of, devices, layer, problem

CUT = 30_000.0   # bytes crossing each cut per sample
SAVED = 100_000.0


def _problem(limit: int, schedule: str = "1f1b"):
    """Three equal layers on two stages, four microbatches of one sample."""
    layers = [layer(f"layer{i}", saved=SAVED, full=100.0) for i in range(3)]
    return problem(layers, [CUT, CUT], devices(2, limit), batch=4, micro_batch_sizes=(1,),
                   pins=Pins(pp=2, schedule=schedule))


def _config(schedule: str) -> PipelineConfig:
    return PipelineConfig(pp=2, dp=1, micro_batch_size=1, num_microbatches=4,
                          schedule=schedule)


def test_receive_buffers_by_hand():
    for schedule in ("1f1b", "gpipe"):
        table = build_cost_table(_problem(10**9, schedule), _config(schedule))
        first, later = evaluate(table, [0, 1, 1], ["none"] * 3).stages
        # The first stage holds the gradient coming back for the backward it runs,
        # whatever the microbatches.
        assert first.memory.receive == CUT
        # The later one the activations coming in, each the input its first layer
        # saves while its microbatch is in flight, counted in its activations.
        assert later.memory.receive == 0
        for stage in (first, later):
            assert stage.memory.peak == sum(
                v for k, v in asdict(stage.memory).items() if k != "peak")


def test_a_stage_pays_for_its_gradient_buffer_when_it_recomputes():
    """A limit where the plan without recompute fits but for the first stage's gradient
    buffer: the planner recomputes, the plan's stages record the buffer and fit with
    it, and brute force agrees."""
    limit = 240_000
    prob = _problem(limit)
    table = build_cost_table(prob, _config("1f1b"))
    # One layer on the first stage: 16,000 state + 2 x 100,000 in flight + 200 transient
    # + 30,000 gradient buffer = 246,200; two on the last: 32,000 + 1 x 200,000 + 200 =
    # 232,200. (Two layers on the first stage hold 400,000 of activations: no fit
    # either way.)
    stages = evaluate(table, [0, 1, 1], ["none"] * 3).stages
    assert [s.memory.peak for s in stages] == [246_200, 232_200]
    assert all(s.memory.peak - s.memory.receive <= limit for s in stages)
    assert not evaluate(table, [0, 0, 1], ["none"] * 3).fits
    plan = plan_problem(prob)
    assert (plan.pp, plan.num_microbatches, plan.schedule) == (2, 4, "1f1b")
    assert [s.memory_bytes.receive for s in plan.stages] == [CUT, 0]
    assert all(s.memory_bytes.peak <= limit for s in plan.stages)
    assert any(mode != "none" for mode in plan.recompute.values())
    oracle = best_split_of(prob, _config("1f1b"))
    assert plan.predicted.closed_form_step_s == pytest.approx(oracle[0] / PS_PER_S, rel=1e-12)
    assert oracle[3] != ["none"] * 3
