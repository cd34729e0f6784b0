"""The report's wording: counts with their right number, rates people can read, and a
solver line that says how the plan was found."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

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


def _dp_plan(zero_stage: int, pp: int = 1, schedule: str | None = None):
    """Layers with parameters on 2 x pp devices of a slow link, so that the gradient
    sync and ZeRO's collectives cost something and a step has a shared tail."""
    from partc.problem import Pins

    layers = [layer(f"l{i}", params=10**6) for i in range(4)]
    prob = problem(layers, [1e6] * 3, devices(2 * pp, 10**10, bandwidth=1e9, latency=1e-5),
                   batch=8, micro_batch_sizes=(1,))
    pins = Pins(pp=pp, dp=2, tp=1, zero_stage=zero_stage, schedule=schedule)
    return dataclasses.replace(prob, pins=pins), plan_problem(dataclasses.replace(
        prob, pins=pins))


def test_one_step_time_in_the_report():
    # Two stages under ZBV (closed form and simulation differ) with dp = 2 (a step-wide
    # tail: the last gradient bucket's reduction): the timeline plays the plan's own
    # figures and tails, so it ends where the predicted step does.
    from partc.cost.timeline import simulate
    from partc.units import format_seconds

    _, plan = _dp_plan(1, pp=2, schedule="zbv-zero-bubble")
    p = plan.predicted
    assert p.closed_form_step_s != pytest.approx(p.step_time_s, rel=1e-6)
    timeline = simulate(plan)
    assert timeline.step_s == pytest.approx(p.step_time_s, rel=1e-9)
    assert timeline.bubble_fraction == pytest.approx(p.bubble_fraction, rel=1e-9)
    text = render(plan)
    step = format_seconds(p.step_time_s)
    assert f"predicted: step {step}," in text and f"The step: {step}," in text
    assert "Simulated step" not in text
    chosen = next(line for line in text.splitlines() if line.endswith(" chosen")
                  or "chosen;" in line)
    assert step in chosen
    assert f"closed-form estimate of it before simulation: " \
           f"{format_seconds(p.closed_form_step_s)}" in text
    # The alternatives are played out as the plan is, like for like.
    assert all(a.step_time_s >= p.step_time_s * (1 - 1e-9) for a in plan.alternatives)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_data_parallel_traffic_and_what_is_assumed_hidden(zero_stage):
    from partc.cost.timeline import simulate
    from partc.errors import PlanValidationError
    from partc.planner.validate import validate_plan
    from partc.units import format_seconds

    prob, plan = _dp_plan(zero_stage)
    section = plan.data_parallel
    assert section.dp == 2 and section.zero_stage == zero_stage and section.overlap == 1.0
    rows = {(c.kind, c.when): c for c in section.stages[0]}
    expected = ({("all_gather", "forward"), ("all_gather", "backward"),
                 ("reduce_scatter", "backward")} if zero_stage == 3 else
                {("reduce_scatter", "last backward"), ("all_gather", "next forward")})
    assert set(rows) == expected
    for c in rows.values():
        assert c.nbytes > 0 and c.seconds > 0 and 0 <= c.exposed_s <= c.seconds
        assert c.hidden_s + c.exposed_s == pytest.approx(c.seconds)
    if zero_stage == 3:   # each microbatch gathers 4 x 10^6 fp32 parameters
        assert plan.num_microbatches == 4
        assert rows["all_gather", "forward"].nbytes == 4 * 4 * 10**6 * 4
        assert section.seconds(0) > section.exposed_s(0)   # some hidden: say so
        # What forward and backward leave exposed is drawn as communication.
        exposed = sum(c.exposed_s for c in section.stages[0] if c.when != "step")
        assert simulate(plan).seconds(0, ("collective",)) == pytest.approx(exposed)
    text = render(plan)
    assert "Data parallelism:" in text and "assumed hidden" in text
    hidden = format_seconds(section.seconds(0) - section.exposed_s(0))
    assert f"assumes {hidden} of the {format_seconds(section.seconds(0))} of " \
           f"data-parallel collectives per step" in text
    tampered = dataclasses.replace(plan, data_parallel=dataclasses.replace(
        section, overlap=0.5))
    with pytest.raises(PlanValidationError, match="data_parallel"):
        validate_plan(prob, tampered)


def test_checkpoint_time_shares_the_storages_bandwidth():
    _, plan = _dp_plan(1)
    size = plan.checkpoint_bytes_per_rank
    figures = dataclasses.replace(plan.budget.figures, disk_bandwidth=2e9,
                                  storage_bandwidth=None)
    small = dataclasses.replace(plan, budget=dataclasses.replace(plan.budget, figures=figures))
    assert small.predicted_save_s == pytest.approx(size / 2e9)   # 2 ranks: their own rate
    big = dataclasses.replace(plan, budget=dataclasses.replace(
        plan.budget, figures=figures, num_devices=1024))
    assert big.predicted_save_s == pytest.approx(size / (100e9 / 1024))   # the default
    assert "1024 ranks sharing the storage's 100 GB/s" in render(big)
    given = dataclasses.replace(big, budget=dataclasses.replace(
        big.budget, figures=dataclasses.replace(figures, storage_bandwidth=4e12)))
    assert given.predicted_save_s == pytest.approx(size / 2e9)


def test_the_search_line_accounts_for_every_configuration_and_trial():
    """configurations and schedule trials = solved + ruled out + played with a greedy split
    (+ not reached, which an OPTIMAL plan has none of): the line's counts add up, and an
    OPTIMAL plan whose schedules were played out does not say some were not reached."""
    plan = _qwen2_plan()
    s = plan.solver
    assert s.status == "OPTIMAL" and s.configs_played > 0
    assert s.configs_total == s.configs_solved + s.configs_pruned + s.configs_played
    text = render(plan)
    assert f"; {s.configs_played} schedule trials played out with their greedy split" in text
    assert "not reached" not in text


def _qwen2_plan() -> Plan:
    """A tiny Qwen2 on 4 H100s, pp=2 x dp=2 pinned: the planner picks an interleaved
    zero-bubble schedule over 1F1B, the mesh's closed-form ranking, and ZeRO-1."""
    import torch
    import torch.nn.functional as F

    import partc
    from tests.hf_families import FAMILIES

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (8, 32))

    def loss_fn(output, target):
        return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())

    return partc.compile(FAMILIES["qwen2"].build(), (ids,), loss_fn=loss_fn,
                         example_target=ids,
                         budget=partc.DeviceBudget(num_devices=4, device="H100-80GB"),
                         # Eager: a compiled stage runs no split backward, and the
                         # zero-bubble schedules need one.
                         train=partc.TrainSpec(global_batch_size=8, compile=False),
                         constraints=partc.Constraints(pp=2, dp=2)).plan


def _table_of(section) -> list[dict[str, str]]:
    return [dict(zip(section.header, row)) for row in section.rows]


def _chosen_figures_agree(plan: Plan) -> list[str]:
    """Every figure a table of the report prints for the chosen plan, checked against
    the plan's own: its step time, peak memory, schedule, virtual stages, microbatches
    and their size, ZeRO stage. Returns what disagrees."""
    from partc.cost.timeline import simulate
    from partc.report.text import plural, sections
    from partc.units import format_bytes, format_seconds

    p, zero = plan.predicted, plan.effective_zero_stage
    step, peak = format_seconds(p.step_time_s), format_bytes(p.peak_memory_bytes)
    config = f"{plan.micro_batch_size} x {plan.num_microbatches}, {plan.schedule}, ZeRO-{zero}"
    found = {s.key: s for s in sections(plan)}
    wrong = []

    def expect(what: str, shown: str, truth: str) -> None:
        if shown != truth:
            wrong.append(f"{what}: {shown!r}, the plan's {truth!r}")

    headline = found["plan"].bullets
    line = next(b for b in headline if b.startswith("plan: "))
    expect("headline mesh", line.split(",")[0].split(" (")[0], f"plan: {plan.mesh}")
    expect("headline ZeRO", line.split(" (ZeRO-")[1][0] if " (ZeRO-" in line else "0",
           str(zero))
    expect("headline schedule and microbatches", line.split("), " if zero else ", ", 1)[1],
           f"{plan.schedule}, {plural(plan.num_microbatches, 'microbatch', 'microbatches')}"
           f" of {plural(plan.micro_batch_size, 'sample')}")
    line = next(b for b in headline if b.startswith("predicted: "))
    expect("headline step", line.split(",")[0], f"predicted: step {step}")
    expect("headline peak", line.rsplit("peak memory ", 1)[1], peak)
    mesh = found["mesh"]
    expect("mesh bullet", mesh.bullets[0].split(", b x m")[0].split(", ")[-1], plan.schedule)
    expect("mesh bullet ZeRO", mesh.bullets[0].split(", ")[1].split(" ")[0], f"ZeRO-{zero}")
    chosen = [r for r in _table_of(mesh) if r["note"].startswith("chosen")]
    expect("mesh rows marked chosen", str(len(chosen)), "1")
    for row in chosen:
        expect("mesh table config", row["best config (b x m, schedule, ZeRO)"][:len(config)],
               config)
        expect("mesh table step", row[mesh.header[4]], step)
    schedules = [r for r in _table_of(found["schedules"]) if r["split"] == "chosen"]
    expect("schedule rows marked chosen", str(len(schedules)), "1")
    for row in schedules:
        expect("schedules table schedule", row["schedule"], plan.schedule)
        expect("schedules table v", row["v"], str(plan.chunks))
        expect("schedules table step", row["step time"], step)
        expect("schedules table bubble", row["bubble"], f"{100 * p.bubble_fraction:.1f}%")
        expect("schedules table peak", row["peak memory"], peak)
    timeline = simulate(plan)
    expect("timeline step", format_seconds(timeline.step_s), step)
    expect("timeline note", found["timeline"].notes[0].split("The step: ")[1].split(",")[0],
           step)
    shown = [r["peak / limit"].split(" / ")[0] for r in _table_of(found["memory"])]
    fullest = max(range(len(plan.stages)), key=lambda i: plan.stages[i].memory_bytes.peak)
    expect("memory table peak", shown[fullest], peak)
    expect("memory headroom", found["memory"].notes[0].split("peak ")[1].split(" of ")[0], peak)
    ours = next(r for r in _table_of(found["alternatives"]) if r["plan"] == "partc plan")
    expect("alternatives step", ours["step time"], step)
    expect("alternatives peak", ours["peak memory"], peak)
    if "data_parallel" in found:
        line = found["data_parallel"].notes[0]
        expect("data-parallel ZeRO", line.split(", ")[1].split(":")[0],
               f"ZeRO-{zero}" if zero else "plain data parallelism")
    return wrong


@pytest.mark.parametrize("case", ["qwen2 interleaved zero-bubble, ZeRO-1",
                                  "zbv zero-bubble, ZeRO-1", "one stage, ZeRO-3"])
def test_every_table_shows_the_chosen_plans_own_figures(case):
    # The mesh table once showed the chosen mesh's closed-form configuration ("1f1b,
    # ZeRO-2" at its closed-form step) beside a plan that runs another schedule.
    plan = {"qwen2 interleaved zero-bubble, ZeRO-1": _qwen2_plan,
            "zbv zero-bubble, ZeRO-1": lambda: _dp_plan(1, pp=2,
                                                        schedule="zbv-zero-bubble")[1],
            "one stage, ZeRO-3": lambda: _dp_plan(3)[1]}[case]()
    if case.startswith("qwen2"):   # the closed form ranked the mesh by another schedule
        assert "zero-bubble" in plan.schedule and plan.chunks > 1
        assert plan.solver.objective != pytest.approx(plan.predicted.step_time_s)
    assert plan.effective_zero_stage == int(case[-1])
    assert _chosen_figures_agree(plan) == []
    # The page: its mesh picture marks the plan's step as the chosen one's.
    from partc.report.html import render_html
    from partc.units import format_seconds

    page = render_html(plan)
    assert f"{format_seconds(plan.predicted.step_time_s)} (chosen)" in page


def test_the_check_of_the_chosen_figures_finds_a_table_that_disagrees():
    _, plan = _dp_plan(1, pp=2, schedule="zbv-zero-bubble")
    other = dataclasses.replace(plan.schedules[0], step_time_s=plan.schedules[0].step_time_s * 2)
    tampered = dataclasses.replace(plan, schedules=(other, *plan.schedules[1:]))
    assert [w for w in _chosen_figures_agree(tampered) if w.startswith("schedules table step")]
