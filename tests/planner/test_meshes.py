"""The mesh section of the plan: every (pp, dp, tp) factorisation the planner weighed,
its best configuration or why it has none, and memory per rank by category.

A 4-layer GPT on four CPU devices of one node, planned twice: with room to spare, and
with a device memory just below what some factorisation's tightest split needs (found
from the cost tables, so the test does not hang on today's cost model), which leaves it
without a plan. Every claim the section makes is checked by planning again with that
factorisation pinned, which does not read the record.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import partc
from partc.planner.assemble import mesh_summary
from partc.compiler import plan_problem
from partc.cost.evaluate import simulated_step_ps
from partc.cost.pipeline_config import PS_PER_S
from partc.cost.tables import build_cost_table
from partc.report.explain import tightest_split
from partc.plan import Mesh, MeshOutcome, Plan
from partc.planner import ConfigResult, candidate_configs, lower_bound, mesh_results, solve
from partc.report.text import render
from partc.units import format_bytes, format_seconds
from samples.gpt import gpt_tiny, loss_fn
from tests.test_compile import check

MiB = 2**20
DEVICES = 4
OUTCOMES = {"solved", "pruned", "work limit", "infeasible"}


@pytest.fixture(scope="module")
def roomy() -> partc.Program:
    budget = partc.DeviceBudget(num_devices=DEVICES, device="CPU", devices_per_node=DEVICES,
                                memory="16MiB")
    return partc.compile(gpt_tiny(n_layer=4), (torch.zeros(2, 16, dtype=torch.long),),
                         loss_fn=loss_fn, budget=budget,
                         train=partc.TrainSpec(global_batch_size=8))


@pytest.fixture(scope="module")
def tight(roomy) -> partc.Program:
    """Planned with the most memory, just below some factorisation's need, at which the
    planner proves a factorisation does not fit (it may instead prune one that does not)."""
    for need in sorted(set(_least_needs(roomy.problem).values()), reverse=True):
        problem = _with_memory(roomy.problem, need - 1)
        try:
            plan = plan_problem(problem)
        except partc.PlanInfeasibleError:
            break
        if any(m.outcome == "infeasible" for m in plan.meshes):
            return partc.Program(plan=plan, problem=problem)
    pytest.fail("no memory leaves one factorisation infeasible and another feasible")


def _least_needs(problem) -> dict[tuple[int, int, int], int]:
    """Per factorisation, the least memory per device any of its configurations needs."""
    needs: dict[tuple[int, int, int], int] = {}
    for config in candidate_configs(problem):
        need = max(tightest_split(build_cost_table(problem, config), problem).stage_need)
        key = (config.pp, config.dp, config.tp)
        needs[key] = min(needs.get(key, math.inf), need)
    return needs


def _with_memory(problem, memory: int):
    devices = replace(problem.devices, memory_bytes=(memory,) * DEVICES)
    return replace(problem, devices=devices)


def _pinned(problem, key: tuple[int, int, int]):
    pp, dp, tp = key
    return replace(problem, pins=replace(problem.pins, pp=pp, dp=dp, tp=tp))


def _key(mesh: MeshOutcome) -> tuple[int, int, int]:
    return mesh.pp, mesh.dp, mesh.tp


def _row(text: str, mesh: MeshOutcome) -> str:
    prefix = f"{mesh.pp}   {mesh.dp}   {mesh.tp}   "
    return next(line for line in text.splitlines() if line.startswith(prefix))


def test_every_factorisation_appears_once(roomy):
    # tp is measured for 2 and 4 (divisors of the node), every dp divides the batch of 8
    # and every pp is at most the 10 layers: all ordered factorisations of 4 are allowed.
    expected = {(pp, dp, tp) for pp in (1, 2, 4) for dp in (1, 2, 4) for tp in (1, 2, 4)
                if pp * dp * tp == DEVICES}
    keys = [_key(m) for m in roomy.plan.meshes]
    assert len(keys) == len(set(keys)) and set(keys) == expected
    assert {m.outcome for m in roomy.plan.meshes} <= OUTCOMES


def test_pins_limit_the_factorisations(roomy):
    pinned = replace(roomy.problem, pins=replace(roomy.problem.pins, pp=2))
    assert {(m.pp, m.dp, m.tp) for m in solve(pinned).meshes} == {(2, 2, 1), (2, 1, 2)}


@pytest.mark.parametrize("which", ["roomy", "tight"])
def test_chosen_mesh_leads_with_ratio_one_and_the_lowest_time(which, request):
    program = request.getfixturevalue(which)
    plan = check(program)
    first, *rest = plan.meshes
    assert _key(first) == (plan.pp, plan.dp, plan.tp) and first.outcome == "solved"
    # Meshes carry the step of their fastest schedule played out, by which they are
    # ranked: the chosen mesh's is the plan's, of its configuration.
    assert first.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-12)
    assert (first.micro_batch_size, first.num_microbatches, first.zero_stage) == (
        plan.micro_batch_size, plan.num_microbatches, plan.zero_stage)
    for mesh in rest:   # a mesh left unsettled by the work limit may be faster
        floor = next((t for t in (mesh.step_time_s, mesh.bound_s) if t is not None), math.inf)
        assert floor >= first.step_time_s or mesh.outcome == "work limit"
    row = _row(program.report(), first)
    assert "1.00x" in row and "chosen" in row


@pytest.mark.parametrize("which", ["roomy", "tight"])
def test_each_claim_holds_with_the_mesh_pinned(which, request):
    program = request.getfixturevalue(which)
    plan, text = program.plan, program.report()
    step = plan.predicted.step_time_s
    for mesh in plan.meshes:
        if mesh.outcome == "infeasible":
            with pytest.raises(partc.PlanInfeasibleError) as info:
                solve(_pinned(program.problem, _key(mesh)))
            assert info.value.need_bytes == mesh.need_bytes > mesh.limit_bytes
            assert (f"does not fit: needs {format_bytes(mesh.need_bytes)} of "
                    f"{format_bytes(mesh.limit_bytes)} per device") in _row(text, mesh)
            continue
        optimum = _pinned_optimum(program.problem, _key(mesh))
        if mesh.outcome == "solved":
            # (times in seconds round-trip through floats: compare whole picoseconds)
            assert round(mesh.bound_s * PS_PER_S) <= optimum <= round(
                mesh.step_time_s * PS_PER_S)
            assert f"{mesh.step_time_s / step:.2f}x" in _row(text, mesh)
        elif mesh.outcome == "work limit":   # not settled: no claim but its bound
            assert optimum is None or round(mesh.bound_s * PS_PER_S) <= optimum
        else:
            # Pruned unsolved, it may have no plan at all; if it has, the bound holds.
            assert mesh.outcome == "pruned" and mesh.bound_s >= step
            assert optimum is None or round(mesh.bound_s * PS_PER_S) <= optimum
            assert f"pruned: bound >= {format_seconds(mesh.bound_s)}" in _row(text, mesh)


def _pinned_result(problem, key: tuple[int, int, int]) -> ConfigResult | None:
    try:
        return solve(_pinned(problem, key)).searched
    except partc.PlanInfeasibleError:
        return None


def _pinned_optimum(problem, key: tuple[int, int, int]) -> int | None:
    """The step the planner's plan of the mesh plays out, the mesh pinned."""
    try:
        best = solve(_pinned(problem, key)).best
    except partc.PlanInfeasibleError:
        return None
    return simulated_step_ps(best.table.config, best.evaluation)[0]


def test_infeasible_factorisations_say_what_they_need(roomy, tight):
    needs, memory = _least_needs(roomy.problem), tight.problem.devices.memory_bytes[0]
    unfit = {_key(m): m for m in tight.plan.meshes if m.outcome == "infeasible"}
    assert unfit and all(needs[key] > memory for key in unfit)
    for key, mesh in unfit.items():
        assert mesh.need_bytes == needs[key] and mesh.limit_bytes == memory
    outcomes = [m.outcome for m in tight.plan.meshes]
    assert outcomes[-len(unfit):] == ["infeasible"] * len(unfit)      # best first: last
    text = tight.report()
    solved = sum(m.outcome == "solved" for m in tight.plan.meshes)
    assert solved > 1 or f"{len(unfit)} do not fit" in text \
        or f"{len(unfit)} others do not" in text or "was not settled" in text


@pytest.fixture(scope="module")
def best_and_runner_up(roomy) -> tuple[ConfigResult, ConfigResult]:
    """The closed-form search's best plan (its configuration is a candidate, where the
    plan itself may run another schedule), and the same of the fastest other
    factorisation."""
    result = solve(roomy.problem)
    config = result.searched.table.config
    others = [_pinned_result(roomy.problem, (m.pp, m.dp, m.tp)) for m in result.meshes
              if (m.pp, m.dp, m.tp) != (config.pp, config.dp, config.tp)]
    return result.searched, min((r for r in others if r is not None),
                            key=lambda r: r.evaluation.step_ps)


def _render_history(program, best: ConfigResult, solved: tuple[ConfigResult, ...],
                    unsolved: str) -> tuple[str, tuple]:
    """The report as if the search had solved only ``solved`` (``best`` among them) and
    left every other configuration that has a finite lower bound ``unsolved``."""
    problem = program.problem
    tables = [build_cost_table(problem, c) for c in candidate_configs(problem)]
    floors = [lower_bound(t) for t in tables]
    by_config = {r.table.config: r for r in solved}
    outcomes = [by_config.get(t.config, unsolved if f < math.inf else "infeasible")
                for t, f in zip(tables, floors)]
    meshes = mesh_results(problem, tables, floors, outcomes, best)
    config = best.table.config
    step_s = best.evaluation.step_ps / PS_PER_S
    plan = replace(program.plan, meshes=tuple(mesh_summary(m) for m in meshes),
                   mesh=Mesh(pp=config.pp, dp=config.dp, tp=config.tp),
                   predicted=replace(program.plan.predicted, step_time_s=step_s,
                                     closed_form_step_s=step_s),
                   solver=replace(program.plan.solver, objective=step_s))
    return render(plan), meshes


def test_why_names_the_runner_up_and_its_ratio(roomy, best_and_runner_up):
    best, runner = best_and_runner_up
    step = best.evaluation.step_ps
    text, meshes = _render_history(roomy, best, (best, runner), "pruned")
    assert [m.outcome for m in meshes[:2]] == ["solved", "solved"]
    name = f"pp={runner.table.config.pp} dp={runner.table.config.dp} tp={runner.table.config.tp}"
    assert (f"why: fastest predicted step; the runner-up, {name}, takes "
            f"{format_seconds(runner.evaluation.step_ps / PS_PER_S)} with its fastest "
            f"schedule ({runner.evaluation.step_ps / step:.2f}x the chosen plan's") in text


def test_meshes_the_work_limit_left_unsettled_are_not_claimed_beaten(roomy,
                                                                   best_and_runner_up):
    # As if the work limit struck after solving one configuration of a slower mesh: the
    # optimum's own configurations have lower bounds below it, and the report must say so.
    best, slower = best_and_runner_up
    assert slower.evaluation.step_ps > best.evaluation.step_ps
    text, meshes = _render_history(roomy, slower, (slower,), "work limit")
    assert "was not settled within the solver's work limit and might be faster" in text
    unsettled = sum(m.outcome == "work limit" for m in meshes)
    assert "can beat it" not in text and text.count("work limit: bound >= ") == unsettled > 0


@pytest.mark.parametrize("format", ["text", "markdown"])
def test_report_has_mesh_and_memory_sections(tight, format):
    plan, text = tight.plan, tight.report(format)
    heading = "## Mesh" if format == "markdown" else "Mesh:"
    assert heading in text and "Memory per rank" in text
    assert (f"chosen: pp={plan.pp} dp={plan.dp} tp={plan.tp}, ZeRO-{plan.zero_stage}, "
            f"{plan.schedule}, b x m = {plan.micro_batch_size} x {plan.num_microbatches}"
            ) in text
    assert "why: " in text and "does not fit: needs" in text
    memory = text[text.index("Memory per rank"):]
    for stage in plan.stages:
        mem = stage.memory_bytes
        cells = [format_bytes(getattr(mem, kind)) for kind in
                 ("params", "grads", "optimizer", "activations", "transient")]
        cells.append(f"{format_bytes(mem.peak)} / {format_bytes(stage.limit_bytes)}")
        row = next(line for line in memory.splitlines()
                   if line.strip("| ").startswith(str(stage.index)))
        assert all(cell in row for cell in cells), (row, cells)


def test_meshes_survive_save_and_load(tight, tmp_path):
    tight.save(tmp_path, code=False)
    loaded = Plan.from_json((tmp_path / "plan.json").read_text())
    assert loaded.meshes == tight.plan.meshes and loaded == tight.plan
    assert render(loaded, "markdown") == (tmp_path / "report.md").read_text()
    # A plan saved before meshes were recorded still loads and reports its chosen mesh.
    old = {k: v for k, v in tight.plan.to_dict().items() if k != "meshes"}
    text = render(Plan.from_dict(old))
    assert f"chosen: pp={tight.plan.pp} dp={tight.plan.dp}" in text and "why:" not in text
