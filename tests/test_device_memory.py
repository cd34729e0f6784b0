"""The memory a plan may fill: what a device reports, less the CUDA context, NCCL's
buffers and fragmentation (partc.device.usable), planned against, recorded and shown."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import partc
from partc.compiler import budget_from_info, device_numbers, plan_problem
from partc.cost.pipeline_config import PipelineConfig, stage_limits
from partc.device.usable import communicators, device_memory_for, usable_memory
from partc.plan import BudgetInfo
from partc.report.text import plan_headroom, render
from partc.units import format_bytes
from tests.models import WHOLE_MEMORY
from partc.problem import Pins
from tests.planner.instances import devices, layer, problem

MIB = 2**20


def test_communicators_are_the_groups_a_rank_runs_collectives_on():
    assert communicators(1, 1, 1, 1) == 0                 # one device: none
    assert communicators(8, 1, 8, 1) == 1                 # dp spans the world: one
    assert communicators(1024, 1, 256, 4) == 3            # world, dp, tp
    assert communicators(8, 2, 2, 2) == 4                 # world, pp, dp, tp
    assert communicators(16, 2, 4, 2, ep=8) == 5          # world, pp, dp, tp, ep (8 x 1)
    assert communicators(16, 2, 4, 2, ep=4) == 6          # ... and expert-dp over 2


def test_a_preset_plans_against_what_cuda_reports_less_its_reserves():
    budget = partc.DeviceBudget(num_devices=8, device="H100-80GB")
    figures = budget.figures
    # An H100 80GB reports 79.19 GiB to CUDA, not its nominal 80.
    assert figures.memory == 85_029_158_912 < figures.nominal_memory == 80 * 2**30
    numbers = device_numbers(budget, torch.bfloat16)
    prob = problem([layer("l0")], [], numbers)
    config = PipelineConfig(pp=2, dp=2, tp=2, micro_batch_size=1, num_microbatches=2,
                            schedule="1f1b")
    # 4 communicators (the world, pp, dp, tp) of 688 MB, a 512 MiB context, then 5%.
    expected = math.floor((85_029_158_912 - 512 * MIB - 4 * 688 * 10**6) * 0.95)
    assert stage_limits(prob, config) == (expected, expected)
    # The CPU keeps nothing back.
    cpu = device_numbers(partc.DeviceBudget(num_devices=8, device="CPU"), torch.float32)
    assert stage_limits(problem([layer("l0")], [], cpu), config) == (16 * 2**30,) * 2


def test_an_explicit_memory_is_the_device_total_and_the_reserves_can_be_set():
    given = partc.DeviceBudget(num_devices=2, memory="80GiB")
    assert given.memory_bytes == (80 * 2**30,) * 2
    numbers = device_numbers(given, torch.float32)
    assert usable_memory(80 * 2**30, numbers, 1) < 80 * 2**30 - 512 * MIB - 688 * 10**6
    whole = device_numbers(partc.DeviceBudget(num_devices=2, memory="80GiB", **WHOLE_MEMORY),
                           torch.float32)
    assert usable_memory(80 * 2**30, whole, 1) == 80 * 2**30
    # The inverse: the device a need calls for leaves exactly that need.
    need = 70 * 2**30
    total = device_memory_for(need, numbers, 3)
    assert usable_memory(total, numbers, 3) >= need > usable_memory(total - 1, numbers, 3)


def _tight(reserve: bool) -> partc.Plan:
    """Four layers on one device whose whole memory holds them without recompute, and
    whose usable memory does not."""
    layers = [layer(f"l{i}", params=10, saved=4000.0) for i in range(4)]
    numbers = devices(1, 20_000)
    if reserve:
        numbers = dataclasses.replace(numbers, context_memory=2_000, memory_fragmentation=0.25)
    return plan_problem(problem(layers, [0.0] * 3, numbers, batch=1))


def test_the_planner_leaves_the_reserves_free():
    whole, kept = _tight(False), _tight(True)
    usable = math.floor((20_000 - 2_000) * 0.75)
    assert [s.limit_bytes for s in kept.stages] == [usable]
    assert whole.predicted.peak_memory_bytes > usable   # what it planned before
    assert kept.predicted.peak_memory_bytes <= usable
    assert set(kept.recompute.values()) != {"none"}


def test_the_report_shows_the_headroom_from_nominal_to_peak():
    plan = _tight(True)
    figures = dataclasses.replace(plan.budget.figures, context_memory=2_000,
                                  memory_fragmentation=0.25, nominal_memory=24_000)
    plan = dataclasses.replace(plan, budget=dataclasses.replace(plan.budget, figures=figures))
    room = plan_headroom(plan)
    assert (room.nominal, room.reported, room.usable) == (24_000, 20_000, 13_500)
    assert room.peak == plan.predicted.peak_memory_bytes <= room.usable
    text = render(plan)
    assert (f"Headroom: peak {format_bytes(room.peak)} of {format_bytes(room.usable)} usable"
            in text)
    assert f"the device reports {format_bytes(20_000)}, nominal {format_bytes(24_000)}" in text
    assert "25% for fragmentation" in text


def test_a_plan_written_before_the_reserves_was_planned_against_its_whole_memory():
    budget = partc.DeviceBudget(num_devices=2, device="H100-80GB")
    recorded = BudgetInfo.from_dict(budget.to_dict(torch.bfloat16))
    assert budget_from_info(recorded).figures.context_memory == 512 * MIB
    old = {k: v for k, v in budget.to_dict(torch.bfloat16).items()
           if k not in ("context_memory", "communicator_memory", "memory_fragmentation")}
    again = budget_from_info(BudgetInfo.from_dict(old)).figures
    assert (again.context_memory, again.communicator_memory, again.memory_fragmentation) \
        == (0, 0, 0.0)


def test_the_reserves_are_flags_of_the_budget():
    from partc.cli.main import _budget, _parser

    args = _parser().parse_args(["plan", "x.py:f", "--devices", "2", "--context-memory", "0",
                                 "--communicator-memory", "1GiB",
                                 "--memory-fragmentation", "0.1"])
    figures = _budget(args).figures
    assert (figures.context_memory, figures.communicator_memory,
            figures.memory_fragmentation) == (0, 2**30, 0.1)


def test_problems_that_differ_in_what_is_kept_back_share_their_cost_tables():
    base = problem([layer("l0")], [], devices(2, 10**9))
    kept = dataclasses.replace(base, devices=dataclasses.replace(
        base.devices, context_memory=10**6, memory_fragmentation=0.1))
    cache = partc.PlanCache()
    tables = cache.table_cache(base)
    assert cache.table_cache(kept) is tables
    config = PipelineConfig(pp=1, dp=2, micro_batch_size=1, num_microbatches=1,
                            schedule="1f1b")
    # ... each with its own limits.
    assert tables.limits(base, config) == (10**9,)
    assert tables.limits(kept, config) == (math.floor((10**9 - 10**6) * 0.9),)


def test_devices_of_different_memory_are_shown_as_they_are_and_the_tightest_stage_judged():
    """Seen before: ``--memory 40GiB,40GiB,80GiB,80GiB`` read "4 x A100-40GB (40.00 GiB
    each)" and "Headroom: peak 49.37 GiB of 35.70 GiB usable (138.3%, -13.67 GiB left)"
    for a plan that fits: the stage peaking at 49 GiB is on the 80 GiB devices. The budget
    line counts each size, and the headroom is the tightest stage's against its own
    devices."""
    layers = [layer(f"l{i}", params=10, saved=4000.0) for i in range(4)]
    plan = plan_problem(problem(layers, [0.0] * 3, devices(2, [20_000, 60_000]), batch=1,
                                pins=Pins(pp=2)))
    assert "budget: 2 x" in render(plan) and "(1 x 19.53 KiB, 1 x 58.59 KiB, " in render(plan)
    room = plan_headroom(plan)
    limits = [s.limit_bytes for s in plan.stages]
    tightest = max(plan.stages, key=lambda s: s.memory_bytes.peak / s.limit_bytes)
    assert (room.usable, room.peak) == (tightest.limit_bytes, tightest.memory_bytes.peak)
    assert room.peak <= room.usable and limits[0] < limits[1]
