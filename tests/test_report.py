"""The report's wording: counts with their right number, rates people can read, and a
solver line that says how the plan was found."""

from __future__ import annotations

import dataclasses
import re
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


import re
from pathlib import Path
