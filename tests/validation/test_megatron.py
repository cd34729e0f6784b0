"""partc's cost model and planner against Megatron-LM's published runs (SC'21, Table 1).

One matmul efficiency for the A100 is fitted on the 18.4B run (``megatron.FIT_RUN``);
at that efficiency partc must predict every other published configuration's throughput
within 15%, price what the planner returns when every decision is pinned exactly as the
direct evaluation of Megatron's assignment does, fit it in 80 GiB, and find a plan of
its own that is at least as fast. Every row is predicted here (each traces and
measures in about a second); partc's own plan is searched on three rows (no tensor
parallelism, the fitted row, a pipeline), as planning more than a thousand devices
runs into the planner's work limit today. ``benchmarks/megatron.py`` prints all ten
with their own plans and the step broken down by cause.
"""

from __future__ import annotations

import functools

import pytest

import partc
from partc.cost.evaluate import simulated_step_ps
from partc.cost.pipeline_config import PS_PER_S
from tests.validation import megatron
from tests.validation.megatron import FIT_RUN, run_named

TARGET = 0.15
# Every row is checked against the published figure -m slow; by default the smallest,
# one in the middle and the largest.
_DEFAULT_ROWS = {"3.6B", "76.1B", "1008B"}
OTHER_ROWS = tuple(name if name in _DEFAULT_ROWS else pytest.param(name, marks=pytest.mark.slow)
                   for name in (run.name for run in megatron.RUNS if run is not FIT_RUN))


@functools.lru_cache(maxsize=None)
def analysed(name: str):
    return megatron.analyse(run_named(name))


@functools.lru_cache(maxsize=None)
def efficiency() -> float:
    pinned = pinned_problem(FIT_RUN.name, None)
    return megatron.fit_efficiency(FIT_RUN, pinned,
                                   megatron.published_assignment(FIT_RUN, pinned))


@functools.lru_cache(maxsize=None)
def pinned_problem(name: str, flops_efficiency: float | None):
    run = run_named(name)
    graph, analysis = analysed(name)
    return megatron.problem(run, analysis, graph, megatron.published(run), flops_efficiency)


def published_prediction(name: str):
    """(problem, Megatron's assignment, its evaluation) at the fitted efficiency."""
    run = run_named(name)
    if run is FIT_RUN:
        problem = megatron.with_efficiency(pinned_problem(name, None), efficiency())
    else:
        problem = pinned_problem(name, efficiency())
    assignment = megatron.published_assignment(run, problem)
    return problem, assignment, megatron.price(problem, assignment)


def test_eq3_counts_the_flops_partc_measures():
    # The paper's F = 96 B s l h^2 (1 + s/6h + V/16lh) is four forward passes of every
    # block (full recompute) and three of the head, as partc traces the sample GPT.
    run = run_named("1.7B")
    _, analysis = analysed(run.name)
    per_sample = sum(layer.fwd_flops * (4 if layer.name.startswith("blocks.") else 3)
                     for layer in analysis.layers)
    assert per_sample * run.batch == pytest.approx(megatron.step_flops(run), rel=1e-6)
    blocks = [layer for layer in analysis.layers if layer.name.startswith("blocks.")]
    assert len(blocks) == run.layers
    # Megatron's parameter count, 12 l h^2 + 13 l h + (V + s) h with the head tied,
    # plus the final LayerNorm's 2 h that the paper's formula leaves out.
    h, l = run.hidden, run.layers
    assert analysis.summary.num_params == 12 * l * h**2 + 13 * l * h + \
        (megatron.VOCAB + megatron.SEQ_LEN) * h + 2 * h


def test_fitted_efficiency_reproduces_the_fitted_row():
    value = efficiency()
    # A plausible share of the A100's 312 TFLOP/s for large fp16 matmuls.
    assert 0.5 < value < 0.85
    _, _, evaluation = published_prediction(FIT_RUN.name)
    predicted = megatron.tflops_per_gpu(FIT_RUN, megatron.step_seconds(evaluation))
    assert predicted == pytest.approx(FIT_RUN.tflops_per_gpu, rel=1e-4)


@pytest.mark.parametrize("name", OTHER_ROWS)
def test_published_configuration_within_target(name):
    run = run_named(name)
    problem, _, evaluation = published_prediction(name)
    predicted = megatron.tflops_per_gpu(run, megatron.step_seconds(evaluation))
    ratio = predicted / run.tflops_per_gpu
    assert abs(ratio - 1) <= TARGET, (
        f"{name}: predicted {predicted:.1f} TFLOP/s per GPU, published "
        f"{run.tflops_per_gpu:g} (ratio {ratio:.3f}); "
        f"{megatron.breakdown(problem, megatron.published_assignment(run, problem))}")
    assert megatron.peak_bytes(evaluation) <= 80 * 2**30


@pytest.mark.parametrize("name", ["1.7B", "39.1B", "1008B"])
def test_planner_pinned_to_the_published_configuration_prices_it_alike(name):
    # Every decision pinned (runs without virtual stages: partc cannot pin interleaved
    # runs of layers): the planner has one assignment left, Megatron's.
    problem, assignment, evaluation = published_prediction(name)
    plan = megatron.plan(problem)
    assert megatron.plan_assignment(plan) == assignment
    assert plan.predicted.closed_form_step_s == pytest.approx(
        megatron.step_seconds(evaluation), rel=1e-9)
    # The plan reports the schedule played out, which the closed form bounds: equal where
    # the last stage is the slowest, below it where another is.
    simulated, _ = simulated_step_ps(assignment.config, evaluation)
    assert plan.predicted.step_time_s == pytest.approx(simulated / PS_PER_S, rel=1e-9)
    assert plan.predicted.step_time_s <= megatron.step_seconds(evaluation) * (1 + 1e-9)


def test_breakdown_adds_up_to_the_step():
    problem, assignment, evaluation = published_prediction("39.1B")
    parts = megatron.breakdown(problem, assignment)
    assert sum(parts.terms.values()) == pytest.approx(megatron.step_seconds(evaluation),
                                                      rel=1e-9)
    # pp = 2, m = 12: the fill and drain is one microbatch of the other stage.
    run = run_named("39.1B")
    assert parts.bubble / parts.step == pytest.approx(1 / (run.num_microbatches + 1), rel=0.1)
    assert parts.compute > parts.memory > 0 and parts.tp > 0 and parts.dp_sync > 0


# The smallest row by default (the same search as the larger ones, 14 s against 40 s);
# -m slow the others.
_UNSETTLED = {"529.6B", "1008B"}
@pytest.mark.parametrize("name", ["1.7B"] + [
    pytest.param(run.name, marks=pytest.mark.slow) for run in megatron.RUNS
    if run.name != "1.7B"])
def test_own_plan_is_at_least_as_fast_and_fits(name):
    run = run_named(name)
    graph, analysis = analysed(run.name)
    own_problem = megatron.problem(run, analysis, graph, partc.Constraints(), efficiency())
    own = megatron.plan(own_problem)
    _, _, evaluation = published_prediction(run.name)
    published = megatron.tflops_per_gpu(run, megatron.step_seconds(evaluation))
    assert megatron.tflops_per_gpu(run, own.predicted.step_time_s) >= published
    assert own.predicted.peak_memory_bytes <= own_problem.devices.memory_bytes[0]
    # Settled, not stopped by the work limit; on the two largest rows the schedule
    # trials limit and CP-SAT's work limit still leave trials of later meshes unsettled
    # (529.6B: 1,109 not reached by the trials limit, 8 by the work limit; 1008B: 3,409
    # and 92), so the plan is FEASIBLE: checked as such, to fail when they settle.
    assert own.solver.status == ("FEASIBLE" if name in _UNSETTLED else "OPTIMAL")


@pytest.mark.slow
def test_planner_left_the_interleaved_runs_is_as_fast_as_megatrons_split():
    """76.1B, its interleaved 1F1B and every other decision pinned, the runs of layers
    and their count left to the planner (partc cannot pin the runs): its plan plays out
    as fast as Megatron's even split of three runs per rank, priced directly, within 1%.
    The closed form CP-SAT minimises cannot tell an unequal cut of a rank's runs from an
    even one (it once chose runs of 1, 14 and 1 blocks, 1.52x Megatron's step); the
    planner plays each interleaved plan re-cut to balanced runs too. (With the sends
    beside compute, as NCCL runs them, more runs a rank pay: it picks 15.)"""
    problem, _, evaluation = published_prediction("76.1B")
    plan = megatron.plan(problem)
    assert plan.schedule == "interleaved-1f1b" and plan.chunks > 1
    assert plan.predicted.step_time_s <= 1.01 * megatron.step_seconds(evaluation)
