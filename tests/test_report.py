"""The report's wording: counts with their right number, rates people can read, and a
solver line that says how the plan was found."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from partc.compiler import plan_problem
from partc.plan import Plan, TPCollective
from partc.problem import Pins
from partc.report.text import readable, render

from .planner.instances import devices, layer, problem


def _plan(batch: int = 1, pins: Pins = Pins()):
    layers = [layer(f"l{i}", params=0) for i in range(4)]
    return plan_problem(problem(layers, [0.0] * 3, devices(2, 10**9), batch=batch,
                                micro_batch_sizes=(1,), pins=pins))


def test_counts_take_their_number():
    one = render(_plan(batch=1, pins=Pins(pp=2)))
    assert "1 microbatch of 1 sample" in one and "1 microbatches" not in one
    many = render(_plan(batch=4, pins=Pins(pp=2, schedule="1f1b")))
    assert "4 microbatches of 1 sample" in many and "(1f1b, 4 microbatches)" in many


def test_rates_read_as_people_write_them():
    assert [readable(n) for n in (42675782, 822189.3, 28072.3, 999.96, 512, 3.2e9)] == [
        "42.7M", "822K", "28.1K", "1K", "512", "3.2B"]
    plan = _plan(batch=4, pins=Pins(pp=2))
    plan = dataclasses.replace(plan, predicted=dataclasses.replace(
        plan.predicted, tokens_per_s=42675782.0))
    assert ", 42.7M tokens/s," in render(plan)


def test_solver_line_says_how_the_plan_was_found():
    plan = _plan(batch=4)
    text = render(plan)
    solver = plan.solver
    assert solver.status == "OPTIMAL" and solver.configs_solved == 0
    assert "no configuration can beat this plan under the cost model" in text
    assert "none needed CP-SAT: the greedy starting plan meets its own configuration's " \
           "lower bound" in text
    assert "0 solved" not in text
    searched = dataclasses.replace(plan, solver=dataclasses.replace(
        solver, configs_total=593, configs_solved=3, configs_pruned=588))
    text = render(searched)
    assert "593 configurations" in text and "3 searched with CP-SAT" in text
    assert "the other 588 ruled out without a solve" in text
    assert "2 not reached within the work limit" in text
    markdown = render(searched, "markdown")
    assert "- search: 593 configurations" in markdown and "```\nstage 0 |" in markdown


def test_the_tensor_parallel_layout_is_named_for_what_the_layers_run():
    # The flag alone does not name the layout: a plan whose layers reduce-scatter partial
    # sums runs sequence parallelism whatever sequence_parallel says, and the report says
    # so, naming the layers; plain tensor parallelism (all-reduces) is named as such.
    plan = Plan.from_json((Path(__file__).parent / "data" / "plan_v2_tp2_sp.json").read_text())
    section = plan.tensor_parallel

    def tp_line(section) -> str:
        text = render(dataclasses.replace(plan, tensor_parallel=section))
        return next(line for line in text.splitlines() if line.startswith("tp=2 "))

    assert "sequence parallelism on (the hidden states between layers on sequence shards" \
        in tp_line(section)
    off = dataclasses.replace(section, sequence_parallel=False)
    assert "sequence parallelism off in name only: tok_emb .. blocks.1 (4) reduce-scatter " \
           "partial sums" in tp_line(off)
    all_reduced = {layer: tuple(TPCollective(kind="all_reduce", phase=move.phase,
                                             nbytes=move.nbytes)
                                for move in moves if move.kind == "reduce_scatter")
                   for layer, moves in section.collectives.items()}
    plain = tp_line(dataclasses.replace(off, collectives=all_reduced, partial_grad_params=()))
    assert "sequence parallelism off: Megatron's plain tensor parallelism (each row-parallel " \
           "output all-reduced; norms, residuals and dropout whole on every rank)" in plain
    assert "in name only" not in plain and "sequence shards" not in plain
