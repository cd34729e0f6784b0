"""The stage model: segments of equal layers, the plan it names, its named variables."""

from __future__ import annotations

import re

import pytest

from partc.compiler import plan_problem
from partc.cost.pipeline_config import PipelineConfig
from partc.cost.tables import build_cost_table
from partc.planner.stage_model import StageModel, memory_unit, segments
from partc.problem import Pins, SharedParam

from .instances import devices, layer, problem


def test_equal_blocks_form_one_segment():
    blocks = [layer(f"b{i}", signature="block") for i in range(6)]
    layers = [layer("emb", flops=1e8), *blocks, layer("head", flops=2e9)]
    config = PipelineConfig(pp=2, dp=1, micro_batch_size=1, num_microbatches=2,
                            schedule="1f1b")

    def spans(prob, pinned=None):
        table = build_cost_table(prob, config)
        return [(s.first, s.last) for s in segments(prob, table, pinned)]

    cuts = [1e4] + [1e5] * 5 + [1e4]
    assert spans(problem(layers, cuts, devices(2, 10**9))) == [(0, 0), (1, 6), (7, 7)]
    # A cut of another size, a pinned mode or a pinned stage boundary breaks the blocks.
    cuts[3] = 2e5
    assert spans(problem(layers, cuts, devices(2, 10**9))) == [
        (0, 0), (1, 3), (4, 6), (7, 7)]
    cuts[3] = 1e5
    pinned = problem(layers, cuts, devices(2, 10**9), pins=Pins(recompute={"b2": "full"}))
    assert spans(pinned) == [(0, 0), (1, 2), (3, 3), (4, 6), (7, 7)]
    assert spans(problem(layers, cuts, devices(2, 10**9)), [0] * 5 + [1] * 3) == [
        (0, 0), (1, 4), (5, 6), (7, 7)]


def test_equal_blocks_take_the_heavier_mode_first():
    # Four equal blocks on one stage, 1 MB saved each, 2.5 MB free: recomputing one
    # rematerialises its 1 MB in backward, so three recompute (1 MB kept + 1 MB); any
    # three would do, and the plan names the first three.
    layers = [layer(f"b{i}", params=0, saved=1e6, full=0.0, workspace=0.0)
              for i in range(4)]
    prob = problem(layers, [0.0] * 3, devices(1, 2_500_000))
    plan = plan_problem(prob)
    assert plan.recompute == {"b0": "full", "b1": "full", "b2": "full", "b3": "none"}
    assert plan.solver.status == "OPTIMAL"


def test_every_variable_is_named():
    """Each CP-SAT variable carries its symbol's name (the module docstring's list), and
    no two share one."""
    blocks = [layer(f"b{i}", signature="block", saved=1e6, selective=2e5) for i in range(5)]
    tied = SharedParam(name="wte", fqns=("emb.weight", "head.weight"), param_count=1000,
                       param_bytes=4000, layers=(0, 6))
    layers = [layer("emb", flops=1e8), *blocks, layer("head", flops=2e9)]
    prob = problem(layers, [1e4] * 6, devices(4, 10**7), batch=4, micro_batch_sizes=(1,),
                   shared=(tied,))
    config = PipelineConfig(pp=2, dp=2, micro_batch_size=1, num_microbatches=2,
                            schedule="1f1b", zero_stage=0)
    built = StageModel(prob, build_cost_table(prob, config), None)
    names = [variable.name for variable in built.model.proto.variables]
    assert names and all(names) and len(set(names)) == len(names)
    prefixes = {re.sub(r"\d+", "#", name) for name in names}
    assert prefixes <= {"segment#_in_runs_to#", "segment#_started_by_run#",
                        "segment#_finished_by_run#", "segment#_rank#_none",
                        "segment#_rank#_selective", "segment#_rank#_full",
                        "segment#_rank#_uses_none", "segment#_rank#_uses_selective",
                        "segment#_rank#_uses_full", "shared#_on_stage#", "peak_busy", "tail",
                        "exposed_sync_stage#", "transient_stage#"}, prefixes


def test_memory_units_round_sizes_up_and_limits_down():
    prob = problem([layer("a"), layer("b")], [0.0], devices(1, 3 * 2**30))
    config = PipelineConfig(pp=1, dp=1, micro_batch_size=1, num_microbatches=1,
                            schedule="1f1b")
    built = StageModel(prob, build_cost_table(prob, config), None)
    assert built.unit == memory_unit(built.table) == 3 * 2**10
    assert built.memory_units(1) == 1 and built.memory_units(3 * 2**10 + 1) == 2
    assert built.memory_units(2 * 3 * 2**10 - 1, limit=True) == 1


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_many_virtual_stages_of_long_layers_keep_the_model_within_its_integers(zero_stage):
    """A rank's exposed gradient reduction and weight gather under a schedule of many
    virtual stages (looped BFS, 6 a rank: windows of dozens of quarter-backwards, each a
    large coefficient) on layers of seconds with tens of seconds of reduction each:
    CP-SAT accepts the model (it refuses a constraint whose terms could pass 2^63, as a
    Megatron-Core row's 42-stage trial once made it) and names its variables."""
    layers = [layer(f"l{i}", flops=1e12, params=10**9) for i in range(24)]
    prob = problem(layers, [1e7] * 23, devices(4, 10**13, bandwidth=1e8), batch=8,
                   micro_batch_sizes=(1,))
    config = PipelineConfig(pp=2, dp=2, micro_batch_size=1, num_microbatches=4,
                            schedule="looped-bfs", chunks=6, zero_stage=zero_stage)
    built = StageModel(prob, build_cost_table(prob, config), None)
    assert built.model.validate() == ""
    names = {re.sub(r"\d+", "#", v.name) for v in built.model.proto.variables}
    assert {"sync_stage#_collective", "sync_stage#_hiding"} <= names


def test_a_linear_expressions_bounds_read_each_domain_to_its_end():
    """``_bounds`` spans every value a sum can take: each variable's domain read to its
    last value (OR-Tools 9.15's repeated field reads 0 at index -1, which once bounded a
    negative coefficient's term by its low end and a positive one's by 0)."""
    from ortools.sat.python import cp_model

    from partc.planner.stage_model import _bounds

    model = cp_model.CpModel()
    a, b = model.new_int_var(2, 5, "a"), model.new_int_var(1, 4, "b")
    assert _bounds(model, 3 * a - 2 * b + 7) == (3 * 2 - 2 * 4 + 7, 3 * 5 - 2 * 1 + 7)
    assert _bounds(model, 11) == (11, 11)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "looped-bfs",
                                      "interleaved-zero-bubble"])
def test_an_interleaved_split_the_greedy_one_fits_is_not_proven_infeasible(schedule):
    """Two ranks of two runs each over a tied embedding and head, the blocks between
    them: the greedy split fits with room to spare, so CP-SAT finds a split too (the
    helper variables of each rank's exposed collectives once had domains that left
    none)."""
    from partc.cost.tables import TableCache
    from partc.options import PlannerOptions
    from partc.planner.bounds import greedy_result
    from partc.planner.search import solve_config

    layers = [layer("emb", flops=1e8, params=8000, saved=2e3)]
    layers += [layer(f"block{i}", flops=1e9, params=4000, saved=3e4, signature="block")
               for i in range(5)]
    layers.append(layer("head", flops=2e9, params=8000, saved=6e3))
    prob = problem(layers, [1e4] * 6, devices(4, 10**8, bandwidth=1e9), batch=2,
                   micro_batch_sizes=(1,),
                   shared=(SharedParam(name="tied", fqns=("emb.weight", "head.weight"),
                                       param_count=8000, param_bytes=32000,
                                       layers=(0, len(layers) - 1)),))
    config = PipelineConfig(pp=2, dp=2, micro_batch_size=1, num_microbatches=1,
                            schedule=schedule, chunks=2, zero_stage=1)
    table = build_cost_table(prob, config)
    assert greedy_result(prob, table, TableCache()) is not None
    result, status, _, _ = solve_config(prob, table, PlannerOptions(), 2.0, None)
    assert result is not None and status == "OPTIMAL"
