"""The pipeline's receive buffers in a stage's memory, hand-solved.

torch.distributed.pipelining's stage allocates one receive buffer per microbatch, for the
activations coming in and for the gradients coming back, and keeps them from step to
step; a buffer of activations is the stage's input, which its first layer saves while
its microbatch is in flight (``partc.costs.PipelineConfig.receive_bytes``).
``benchmarks/memory_check.py`` measures them (MemTracker's "Other": the buffers it is
given), e.g. the wide case ``gpt-pp2-1f1b-m16-wide``.
"""

from __future__ import annotations

import pytest

from partc.compiler import plan_problem
from partc.costs import PS_PER_S, PipelineConfig, build_cost_table, evaluate
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
    for schedule, received in (("1f1b", (4 - 1) * CUT), ("gpipe", 0)):
        table = build_cost_table(_problem(10**9, schedule), _config(schedule))
        first, later = evaluate(table, [0, 1, 1], ["none"] * 3).stages
        # The first stage holds a buffer per microbatch for the gradient coming back.
        assert first.memory["receive"] == 4 * CUT
        # The later one a buffer per microbatch for the activations coming in, of which
        # those of the microbatches in flight (1F1B: one on the last stage; GPipe: all
        # four) are the input its first layer saves, counted in its activations.
        assert later.memory["receive"] == received
        for stage in (first, later):
            assert stage.memory["peak"] == sum(
                v for k, v in stage.memory.items() if k != "peak")


def test_a_later_stage_pays_for_its_buffers_when_it_recomputes():
    """A limit where the plan without recompute fits but for its receive buffers: the
    planner recomputes, the plan's stages record the buffers and fit with them, and
    brute force agrees."""
    limit = 320_000
    prob = _problem(limit)
    table = build_cost_table(prob, _config("1f1b"))
    # One layer on the first stage: 16,000 state + 2 x 100,000 in flight + 200 transient
    # + 4 x 30,000 gradient buffers = 336,200; two on the last: 32,000 + 1 x 200,000 +
    # 200 + 3 x 30,000 activation buffers = 322,200. (Two layers on the first stage
    # hold 400,000 of activations: no fit either way.)
    stages = evaluate(table, [0, 1, 1], ["none"] * 3).stages
    assert [s.memory["peak"] for s in stages] == [336_200, 322_200]
    assert all(s.memory["peak"] - s.memory["receive"] <= limit for s in stages)
    assert not evaluate(table, [0, 0, 1], ["none"] * 3).fits
    plan = plan_problem(prob)
    assert (plan.pp, plan.num_microbatches, plan.schedule) == (2, 4, "1f1b")
    assert [s.memory_bytes.receive for s in plan.stages] == [4 * CUT, 3 * CUT]
    assert all(s.memory_bytes.peak <= limit for s in plan.stages)
    assert any(mode != "none" for mode in plan.recompute.values())
    oracle = best_split_of(prob, _config("1f1b"))
    assert plan.predicted.closed_form_step_s == pytest.approx(oracle[0] / PS_PER_S, rel=1e-12)
    assert oracle[3] != ["none"] * 3
