"""The report's wording: counts with their right number, rates people can read, and a
solver line that says how the plan was found."""

from __future__ import annotations

import dataclasses
import re

from partc.compiler import plan_problem
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


HOSTILE = "<img src=x onerror=alert(1)>|[link](http://x)\nimport os"


def _hostile_plan():
    """A plan whose model and layer names carry HTML, Markdown and a newline."""
    layers = [layer(f"{HOSTILE}{i}", params=0) for i in range(4)]
    plan = plan_problem(problem(layers, [0.0] * 3, devices(2, 10**9), batch=2,
                                micro_batch_sizes=(1,), pins=Pins(pp=2)))
    return dataclasses.replace(plan, model=dataclasses.replace(plan.model, name=HOSTILE))


def test_markdown_report_shows_names_literally():
    markdown = render(_hostile_plan(), "markdown")
    assert not re.search(r"(?<!\\)<img", markdown)   # raw HTML only behind a backslash
    assert "\\<img src=x onerror=alert(1)>" in markdown
    assert "\\[link\\](http://x)" in markdown and "\nimport os" not in markdown
    assert "\\\\nimport os" in markdown   # renders as the two characters \n
    # every table row keeps its columns: a name's "|" is escaped, not a cell border
    for table in ("| stage | layers |",):
        header = next(line for line in markdown.splitlines() if line.startswith(table))
        rows = [line for line in markdown.splitlines()
                if line.startswith("| 0 |") or line.startswith("| 1 |")]
        columns = header.count(" | ")
        assert rows and all(row.replace("\\|", "").count(" | ") == columns for row in rows)
    text = render(_hostile_plan())
    assert "\nimport os" not in text and "\\nimport os" in text


def test_html_report_escapes_names():
    page = render(_hostile_plan(), "html")
    assert "<img" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
