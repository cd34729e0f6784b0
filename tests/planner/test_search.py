"""The planner end to end (``solve``): hand-solved instances, brute force, its errors,
and no state kept between calls but the table cache a caller passes."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time

import pytest

from partc.compiler import plan_of, plan_problem
from partc.cost.evaluate import evaluate, simulated_step_ps
from partc.cost.pipeline_config import PS_PER_S
from partc.cost.tables import TableCache, build_cost_table
from partc.errors import PlanInfeasibleError, PlanValidationError
from partc.planner import joint, solve
from partc.planner.bounds import incumbent, played_floor
from partc.planner.results import Assignment, ConfigResult
from partc.planner.stage_model import memory_unit
from partc.planner.search import balanced_cut, balanced_runs, candidate_configs
from partc.problem import Pins, SharedParam
from partc.planner.validate import validate_plan

from .instances import (best_split_of, brute_force, devices, layer, least_played, problem,
                        random_problem, repeated_problem, schedule_trials_expected)

# peak 1e12 FLOP/s, efficiency 1: a layer of 1e9 forward FLOPs takes 1 ms forward and
# 2 ms backward; the optimizer touches 2*4 + 4 + 2*8 = 28 bytes per parameter at 1 TB/s.
MS = 1e-3


def test_one_device_sums_every_layer():
    prob = problem([layer("a"), layer("b", flops=2e9)], [0.0], devices(1, 10**9),
                   optimizer_bytes=0.0)
    plan = plan_problem(prob)
    validate_plan(prob, plan)
    # 3 ms + 6 ms of compute, optimizer step over 2000 params x 12 bytes = 24 ns.
    assert plan.pp == 1 and plan.predicted.step_time_s == pytest.approx(9 * MS + 24e-9)


def test_two_balanced_stages_halve_the_steady_state():
    layers = [layer(f"l{i}", params=0) for i in range(4)]
    prob = problem(layers, [0.0] * 3, devices(2, 10**9), batch=4, micro_batch_sizes=(1,),
                   pins=Pins(pp=2, schedule="1f1b"))
    plan = plan_problem(prob)
    # Two layers per stage: 6 ms per microbatch; (m - 1) * 6 + 2 * 6 = 30 ms for m = 4.
    assert [len(s.layers) for s in plan.stages] == [2, 2]
    assert plan.predicted.step_time_s == pytest.approx(30 * MS)
    assert plan.predicted.bubble_fraction == pytest.approx(1 / 5)
    # Left to the planner, a schedule that leaves less of the bubble plays out faster
    # on the same two stages: each rank's 4 x 6 = 24 ms of work, plus at most 1 ms.
    auto = plan_problem(problem(layers, [0.0] * 3, devices(2, 10**9), batch=4,
                                micro_batch_sizes=(1,), pins=Pins(pp=2)))
    assert auto.schedule != "1f1b" and 24 * MS <= auto.predicted.step_time_s <= 25 * MS
    # CP-SAT solves the schedules whose greedy split played out within NEAR of the plan.
    assert {o.schedule for o in auto.schedules if o.how.startswith("solved split")} >= {
        "zbv-zero-bubble", "dualpipev"}
    assert all(o.step_time_s > auto.predicted.step_time_s * (1 + joint.NEAR)
               for o in auto.schedules if o.how.startswith("greedy split"))


def test_heavy_layer_gets_a_stage_of_its_own():
    layers = [layer("a", params=0), layer("b", params=0), layer("c", flops=4e9, params=0)]
    prob = problem(layers, [0.0, 0.0], devices(2, 10**9), batch=2, micro_batch_sizes=(1,),
                   pins=Pins(pp=2))
    plan = plan_problem(prob)
    assert [list(s.layers) for s in plan.stages] == [["a", "b"], ["c"]]


def test_memory_forces_recompute_on_the_cheapest_layers():
    # Each layer saves 1 MB; recomputing one rematerialises its 1 MB during backward.
    # Keeping all three needs 3 MB; recomputing one needs 2 + 1 = 3 MB; recomputing two
    # needs 1 + 1 = 2 MB, which fits 2.5 MB: the two cheapest forwards are redone.
    layers = [layer("a", params=0, saved=1e6, full=0.0, workspace=0.0),
              layer("b", flops=3e9, params=0, saved=1e6, full=0.0, workspace=0.0),
              layer("c", flops=4e9, params=0, saved=1e6, full=0.0, workspace=0.0)]
    prob = problem(layers, [0.0, 0.0], devices(1, 2_500_000))
    plan = plan_problem(prob)
    assert plan.recompute == {"a": "full", "b": "full", "c": "none"}
    # Recompute redoes the forwards of a and b: 1 ms + 3 ms.
    assert plan.stages[0].time_s.recompute == pytest.approx(4 * MS)


def test_selective_chosen_when_it_is_enough():
    # GPipe with 2 microbatches in flight: none needs 2 x 1 MB; selective 2 x 0.2 MB +
    # 0.8 MB rematerialised = 1.2 MB, free of extra FLOPs; full 2 x 0.1 + 0.9 = 1.1 MB but
    # redoes the forward. 1.5 MB fits selective and full, and selective is faster.
    layers = [layer("attn", params=0, saved=1e6, selective=2e5, full=1e5, workspace=0.0)]
    prob = problem(layers, [], devices(1, 1_500_000), batch=2, micro_batch_sizes=(1,),
                   pins=Pins(schedule="gpipe"))
    plan = plan_problem(prob)
    assert plan.recompute == {"attn": "selective"}
    assert plan.stages[0].memory_bytes.peak == 1_200_000


def test_tied_parameter_is_held_by_every_stage_using_it():
    layers = [layer("emb", params=0), layer("mid", params=0), layer("head", params=0)]
    tied = SharedParam(name="wte", fqns=("emb.weight", "head.weight"), param_count=1000,
                       param_bytes=4000, layers=(0, 2))
    prob = problem(layers, [0.0, 0.0], devices(2, 10**9), shared=(tied,), pins=Pins(pp=2))
    plan = plan_problem(prob)
    for stage in plan.stages:
        assert stage.memory_bytes.params == 4000   # weights of the tied matrix, each
        assert stage.param_count == 1000


def test_pins_are_kept():
    layers = [layer(f"l{i}") for i in range(4)]
    pins = Pins(stages=(("l0",), ("l1", "l2", "l3")), recompute={"l1": "full"},
                schedule="gpipe")
    prob = problem(layers, [0.0] * 3, devices(2, 10**9), pins=pins)
    plan = plan_problem(prob)
    assert [list(s.layers) for s in plan.stages] == [["l0"], ["l1", "l2", "l3"]]
    assert plan.recompute["l1"] == "full" and plan.schedule == "gpipe"


def test_bad_stage_pin_is_an_error():
    layers = [layer("a"), layer("b")]
    prob = problem(layers, [0.0], devices(2, 10**9), pins=Pins(stages=(("b",), ("a",))))
    with pytest.raises(PlanInfeasibleError, match="every layer once, in order") as info:
        solve(prob)
    assert info.value.pin == "stages"


def test_infeasible_names_stage_need_limit_and_fix_quickly():
    layers = [layer(f"l{i}", params=10**6) for i in range(8)]   # 24 MB of state each
    prob = problem(layers, [0.0] * 7, devices(2, 50 * 10**6))
    start = time.perf_counter()
    with pytest.raises(PlanInfeasibleError) as info:
        solve(prob)
    elapsed = time.perf_counter() - start
    message = str(info.value)
    assert "stage" in message and "limit" in message and "would fit with" in message
    assert info.value.need_bytes > info.value.limit_bytes
    # 8 layers of 16 MB of state (4 + 4 + 8 bytes per parameter): 3 fit in 50 MB.
    assert "3 devices (pp=3" in message
    assert elapsed < 0.5


def test_validator_rejects_broken_plans():
    layers = [layer(f"l{i}") for i in range(3)]
    prob = problem(layers, [0.0, 0.0], devices(1, 10**9))
    plan = plan_problem(prob)
    from dataclasses import replace
    wrong_time = replace(plan, predicted=replace(plan.predicted, step_time_s=1.0))
    with pytest.raises(PlanValidationError, match="predicted step time"):
        validate_plan(prob, wrong_time)
    wrong_order = replace(plan, stages=(replace(plan.stages[0],
                                                layers=("l1", "l0", "l2")),))
    with pytest.raises(PlanValidationError, match="once in order"):
        validate_plan(prob, wrong_order)
    tight = replace(prob, devices=devices(1, 1000))
    with pytest.raises(PlanValidationError, match="needs"):
        validate_plan(tight, plan)


def test_a_pipeline_of_day_long_layers_plans_as_one_of_seconds_scaled():
    """Layers of days each (a million-token sequence's attention takes seconds a layer):
    counted in picoseconds, the pipeline's objective passes CP-SAT's 64-bit integers
    ("Possible integer overflow") and its double's 2^53; the planner counts time in a
    coarser unit there and plans what it plans for the same model 10^5 times faster, its
    times scaled (but for the optimizer's step, a few milliseconds that do not scale)."""
    def planned(flops: float):
        layers = [layer(f"l{i}", flops=flops, params=0, saved=1e6, full=1e3)
                  for i in range(4)]
        return plan_problem(problem(layers, [1e6] * 3, devices(2, 10**9), batch=4,
                                    micro_batch_sizes=(1,), pins=Pins(pp=2)))

    fast, slow = planned(1e12), planned(1e17)
    assert (slow.schedule, slow.num_microbatches) == (fast.schedule, fast.num_microbatches)
    assert [s.layers for s in slow.stages] == [s.layers for s in fast.stages]
    assert slow.predicted.step_time_s == pytest.approx(1e5 * fast.predicted.step_time_s,
                                                       rel=1e-3)


def test_planner_is_deterministic():
    rng = random.Random(7)
    prob = random_problem(rng)
    first = [solve(prob).best.assignment for _ in range(2)] if _feasible(prob) else []
    assert len(set(first)) <= 1


def _feasible(prob) -> bool:
    try:
        solve(prob)
        return True
    except PlanInfeasibleError:
        return False


def _plan_and_oracle(prob):
    """(plan, the validated evaluation of the closed-form search's plan, brute force's
    optimum), or None when brute force finds nothing, after checking the planner says
    infeasible too. The automatic schedule choice after the search is checked against
    brute force too (:func:`_check_schedule_choice`)."""
    oracle = brute_force(prob)
    if oracle is None:
        with pytest.raises(PlanInfeasibleError):
            plan_problem(prob)
        return None
    result = solve(prob)
    plan = plan_of(prob, result)
    validate_plan(prob, plan)
    first = result.searched
    _check_schedule_choice(prob, result, plan)
    return plan, first.evaluation, oracle


def _check_schedule_choice(prob, result, plan) -> None:
    """The joint search tried exactly the schedules brute force enumerates on the
    searched configuration's mesh and batch split; each it solved has a
    brute-force-optimal split (the closed form; an interleaved one re-cut into balanced
    runs only where those fit and play out faster); each it left out has a floor no
    split plays out below (brute force of the step played) and at least the plan's step;
    every mesh's floor under any schedule lies below each of its schedules' plays; and
    the plan is the fastest trial played, the one the plan reports."""
    trials = result.schedule_trials
    searched = trials[0].config
    mine = [t for t in trials[1:] if (joint.mesh_key(t.config), t.config.micro_batch_size,
                                      t.config.num_microbatches) == (
        joint.mesh_key(searched), searched.micro_batch_size, searched.num_microbatches)]
    tried = {(t.config.schedule, t.config.chunks, t.config.zero_stage) for t in mine}
    assert tried == schedule_trials_expected(prob, searched)
    fastest = min(t.step_ps for t in trials if t.step_ps is not None)
    base_floor = played_floor(build_cost_table(prob, searched), any_schedule=True,
                              backward_scale=prob.devices.split_backward_factor or 1.0)
    for trial in trials:
        if trial.solved is not None:   # re-cut into balanced runs, or the greedy split:
            assert trial.config.chunks > 1 and trial.result.evaluation.fits   # fits, and
            assert trial.step_ps < simulated_step_ps(trial.config, trial.solved.evaluation)[0]
            assert trial.result.assignment.modes == trial.solved.assignment.modes or \
                trial.result.assignment == incumbent(prob.variant(
                    trial.config.tp, trial.config.sequence_parallel, trial.config.tp_objective),
                    trial.result.table)   # plays out faster
        if trial.result is not None:
            assert trial.step_ps == simulated_step_ps(trial.config, trial.result.evaluation)[0]
    assert all(base_floor <= t.step_ps for t in [trials[0], *mine] if t.step_ps is not None)
    for trial in mine:
        if trial.why == joint.PRUNED:   # rightly: no split plays out below its floor
            played = least_played(prob, trial.config)
            floor = played_floor(build_cost_table(prob, trial.config))
            quick = played_floor(build_cost_table(prob, trial.config), one_in_flight=True)
            assert played is None or max(floor, quick) <= played and base_floor <= played
            assert quick <= floor
            assert floor >= fastest
            continue
        if trial.greedy:
            continue
        oracle = best_split_of(prob, trial.config)
        if oracle is None:
            assert trial.result is None and trial.why == "no split fits"
            continue
        solved = trial.solved or trial.result
        assert solved is not None and solved.status == "OPTIMAL"
        assert solved.evaluation.step_ps >= oracle[0]
        if solved.evaluation.step_ps > oracle[0]:   # memory units, as below
            assert _memory_slack_in_units(prob, oracle) < 4 * (prob.num_layers + 2)
    # A greedy split is solved by CP-SAT after, fastest first, unless its floor reached
    # the plan by then or it played out more than NEAR above the fastest plan (then above
    # it when skipped), or the chosen mesh's greedy splits had spent their share of the
    # work (joint.FIRST_SHARE): the fastest of those left is solved.
    left = sorted((trial for trial in mine if trial.greedy and trial.result is not None
                   and played_floor(build_cost_table(prob, trial.config)) < fastest
                   and trial.step_ps <= fastest * (1 + joint.NEAR)),
                  key=lambda trial: trial.step_ps)
    solved = [any(t.config == trial.config and not t.greedy for t in mine) for trial in left]
    assert solved == sorted(solved, reverse=True) and (not left or solved[0])
    assert result.best is min((t for t in trials if t.step_ps is not None),
                              key=lambda t: (t.step_ps, t.greedy)).result
    assert plan.predicted.step_time_s == pytest.approx(fastest / PS_PER_S, rel=1e-9)


# Two seeds (one at real models' sizes) in the default profile; -m slow draws more.
@pytest.mark.parametrize("seed, scale", [(0, 1), pytest.param(1, 1, marks=pytest.mark.slow),
                                         pytest.param(2, 1, marks=pytest.mark.slow),
                                         pytest.param(3, 1, marks=pytest.mark.slow),
                                         (4, 2**16)])
def test_plan_equals_brute_force(seed, scale):
    """63 random instances each of <= 6 layers x <= 3 stages, recompute and memory
    limits; at scale 2^16 the sizes are those of real models (GB), where byte-sized
    coefficients once made CP-SAT's presolve return a wrong OPTIMAL."""
    rng = random.Random(seed)
    feasible = sum(_matches_oracle(random_problem(rng, scale)) for _ in range(63))
    assert feasible > 30


def _matches_oracle(prob) -> bool:
    """Whether ``prob`` has a plan; if so, the planner's is the brute-force optimum, proven."""
    checked = _plan_and_oracle(prob)
    if checked is None:
        return False
    plan, evaluation, oracle = checked
    assert evaluation.step_ps >= oracle[0]
    if evaluation.step_ps > oracle[0]:
        # The planner counts memory in units of 1/2^20 of the limit, rounding sizes up:
        # only a plan that fits with less than a unit per term to spare is lost.
        assert _memory_slack_in_units(prob, oracle) < 4 * (prob.num_layers + 2)
    assert plan.solver.status == "OPTIMAL" and plan.solver.gap == 0.0
    return True


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_interleaved_plan_equals_brute_force(seed):
    """Interleaved 1F1B pinned: 5-7 layers on 2 ranks of 2-3 runs each, against every
    split into runs and every recompute mode."""
    rng = random.Random(100 + seed)
    feasible = 0
    for _ in range(12):
        layers = [layer(f"layer{i}", flops=rng.choice([1e8, 1e9, 3e9]), params=1000,
                        saved=rng.choice([1e3, 1e5]), full=100.0,
                        selective=5e2 if rng.random() < 0.3 else None)
                  for i in range(rng.randint(5, 7))]
        tied = SharedParam(name="tied", fqns=("a.weight", "b.weight"), param_count=4000,
                           param_bytes=16000, layers=(0, len(layers) - 1))
        prob = problem(layers, [rng.choice([0.0, 1e5]) for _ in layers[1:]],
                       devices(2, rng.choice([10**6, 10**7]),
                               bandwidth=rng.choice([1e8, 1e10])),
                       batch=rng.choice([2, 4]), micro_batch_sizes=(1,),
                       shared=(tied,) if rng.random() < 0.4 else (),
                       pins=Pins(pp=2, schedule="interleaved-1f1b"))
        checked = _plan_and_oracle(prob)
        if checked is None:
            continue
        feasible += 1
        plan, evaluation, oracle = checked
        assert plan.chunks > 1 and evaluation.step_ps == oracle[0]
        assert plan.solver.status == "OPTIMAL"
    assert feasible >= 8


def test_an_interleaved_rank_recomputes_the_run_its_schedule_holds_most():
    """Interleaved 1F1B, 4 layers on 2 ranks of 2 runs, 4 microbatches: rank 0 holds
    run 0 (layer 0, 1 MB saved) three or four times at its peaks and run 2 (layer 2,
    0.1 MB) twice or once: 4.1 MB, which 3.5 MB does not hold, though the average of its
    runs (5 in flight x 1.1 MB / 2 = 2.75 MB) would. Layer 0 is recomputed, as brute
    force finds."""
    layers = [layer(f"l{i}", saved=1e6 if i == 0 else 1e5) for i in range(4)]
    prob = problem(layers, [0.0] * 3, devices(2, 3_500_000), batch=4,
                   micro_batch_sizes=(1,), pins=Pins(pp=2, schedule="interleaved-1f1b"))
    plan, evaluation, oracle = _plan_and_oracle(prob)
    assert evaluation.step_ps == oracle[0] and plan.chunks == 2
    assert plan.stages[0].runs == (("l0",), ("l2",))
    assert plan.recompute == {"l0": "full", "l1": "none", "l2": "none", "l3": "none"}
    assert plan.stages[0].memory_bytes.activations == max(3 * 100 + 2 * 1e5,
                                                          4 * 100 + 1 * 1e5)


@pytest.mark.parametrize("foreach", [True, False])
def test_the_optimizer_steps_temporaries_rule_out_a_replica_that_fits_its_microbatches(
        foreach):
    """Two layers of 1M parameters on 2 devices of 36 MB, Adam in fp32 (16 bytes a
    parameter), ZeRO-0 pinned: two replicas hold 32 MB each and their microbatches fit,
    and without the step's temporaries they are the fastest plan; with them (foreach:
    4 bytes a parameter, 8 MB; one tensor at a time: twice the largest, 8 MB) they do
    not fit, and the plan is a pipeline, as brute force finds, each stage fitting at its
    step."""
    from dataclasses import replace

    layers = [layer(f"l{i}", params=1_000_000, largest=1_000_000, saved=1e3)
              for i in range(2)]
    machine = replace(devices(2, 36_000_000, bandwidth=1e15), dispatch_ahead=foreach)
    free = problem(layers, [0.0], machine, batch=2, pins=Pins(zero_stage=0))
    _, _, unbound = _plan_and_oracle(free)
    assert unbound[1].pp == 1
    prob = problem(layers, [0.0], machine, batch=2, pins=Pins(zero_stage=0),
                   step_copies=1.0)
    plan, evaluation, oracle = _plan_and_oracle(prob)
    assert evaluation.step_ps == oracle[0] > unbound[0]
    assert plan.pp == 2
    for stage in plan.stages:
        memory = stage.memory_bytes
        assert memory.step == (4_000_000 if foreach else 8_000_000)
        assert memory.params + memory.grads + memory.optimizer + memory.step <= 36_000_000


@pytest.mark.parametrize("schedule", ["looped-bfs", "interleaved-zero-bubble",
                                      "zbv-zero-bubble", "dualpipev"])
def test_every_schedule_pinned_equals_brute_force(schedule):
    """Each schedule of several virtual stages per rank pinned: 4-5 layers on 2 ranks,
    against every split into runs and every recompute mode; under the "V" schedules rank
    0 holds the first and the last run."""
    rng = random.Random(sum(map(ord, schedule)))   # stable across processes
    feasible = 0
    for _ in range(5):
        layers = [layer(f"layer{i}", flops=rng.choice([1e8, 1e9, 3e9]), params=1000,
                        saved=rng.choice([1e3, 1e5]), full=100.0)
                  for i in range(rng.randint(4, 5))]
        prob = problem(layers, [rng.choice([0.0, 1e5]) for _ in layers[1:]],
                       devices(2, rng.choice([10**6, 10**7]), bandwidth=1e9),
                       batch=4, micro_batch_sizes=(1,),
                       pins=Pins(pp=2, schedule=schedule))
        checked = _plan_and_oracle(prob)
        if checked is None:
            continue
        feasible += 1
        plan, evaluation, oracle = checked
        assert plan.schedule == schedule and plan.chunks >= 2
        assert evaluation.step_ps == oracle[0] and plan.solver.status == "OPTIMAL"
        if schedule in ("zbv-zero-bubble", "dualpipev"):
            assert plan.stages[0].runs[0] == plan.runs[0]
            assert plan.stages[0].runs[-1] == plan.runs[-1]
    assert feasible >= 3


def test_interleaving_divides_the_bubble():
    # 4 equal layers (1 ms forward, 2 ms backward), pp=2, 2 microbatches. 1F1B: 2 layers
    # per rank, (m - 1) * 6 + 12 = 18 ms. Interleaved, one layer per run, rank 0 runs
    # layers 0 and 2: m * 6 + (12 - 6) / 2 = 15 ms.
    layers = [layer(f"l{i}", params=0) for i in range(4)]
    plans = {}
    for schedule in ("1f1b", "interleaved-1f1b"):
        prob = problem(layers, [0.0] * 3, devices(2, 10**9), batch=2, micro_batch_sizes=(1,),
                       pins=Pins(pp=2, schedule=schedule))
        plans[schedule] = plan_problem(prob)
        validate_plan(prob, plans[schedule])
    assert plans["1f1b"].predicted.step_time_s == pytest.approx(18 * MS)
    interleaved = plans["interleaved-1f1b"]
    assert interleaved.predicted.step_time_s == pytest.approx(15 * MS)
    assert interleaved.chunks == 2
    assert [list(s.runs) for s in interleaved.stages] == [[("l0",), ("l2",)],
                                                         [("l1",), ("l3",)]]
    assert interleaved.runs == (("l0",), ("l1",), ("l2",), ("l3",))


def _memory_slack_in_units(prob, oracle) -> float:
    _, config, stage_of, modes = oracle
    table = build_cost_table(prob, config)
    stages = evaluate(table, stage_of, modes).stages
    return min(s.limit - s.memory.peak for s in stages) / memory_unit(table)


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_repeated_blocks_plan_equals_brute_force(seed):
    """Models of equal blocks (the planner counts them per segment instead of placing
    each): its plan equals the per-layer brute-force optimum, with blocks broken by a
    different block, a different cut or a pin, and tied parameters."""
    rng = random.Random(200 + seed)
    feasible = sum(_matches_oracle(repeated_problem(rng)) for _ in range(12))
    assert feasible >= 8


def _plan(result) -> tuple:
    """What a plan is made of: configuration, assignment, step time, status and bound."""
    best = result.best
    return (best.table.config, best.assignment, best.evaluation.step_ps, result.status,
            result.bound)


def _search(result) -> tuple:
    """The plan and how the search got there."""
    return _plan(result) + (result.configs_total, result.configs_solved,
                            result.configs_pruned, result.meshes)


@pytest.mark.parametrize("seed", [0, 1])
def test_same_problem_twice_gives_identical_plans_with_or_without_a_shared_table_cache(seed):
    """Nothing is kept between two solves in one process: without a cache the second
    solve repeats the first exactly. A shared TableCache may only change how the search
    gets there (it starts from the first solve's best configuration and plans), never
    the plan."""
    rng = random.Random(300 + seed)
    checked = 0
    for _ in range(8):
        prob = repeated_problem(rng) if rng.random() < 0.5 else random_problem(rng)
        if not _feasible(prob):
            continue
        alone = solve(prob)
        assert _search(solve(prob)) == _search(alone)
        shared = TableCache()
        assert _search(solve(prob, table_cache=shared)) == _search(alone)
        again = solve(prob, table_cache=shared)
        # The closed-form search's best configuration seeds the next search.
        assert shared.best_config == alone.searched.table.config
        assert _plan(again) == _plan(alone)
        checked += 1
    assert checked >= 4


def test_balanced_cut_is_the_least_largest_run():
    """Every cut of up to 9 items into 1-5 non-empty runs, against brute force."""
    rng = random.Random(7)
    for _ in range(200):
        work = [rng.choice([1, 2, 3, 10, 40]) for _ in range(rng.randint(1, 9))]
        runs = rng.randint(1, 5)
        cut = balanced_cut(work, runs)
        if len(work) < runs:
            assert cut is None
            continue
        assert list(cut) == sorted(cut) and set(cut) == set(range(runs))
        largest = max(sum(w for w, j in zip(work, cut) if j == run) for run in range(runs))
        best = min(max(sum(work[a:b]) for a, b in zip((0, *ends), (*ends, len(work))))
                   for ends in itertools.combinations(range(1, len(work)), runs - 1))
        assert largest == best, (work, runs, cut)


def test_an_interleaved_split_is_recut_into_balanced_runs_when_they_play_faster():
    """Eight equal layers on 2 ranks of 2 runs: runs of 1, 3, 3 and 1 layers give each
    rank four, which the closed form prices as runs of two each, but the schedule plays
    out slower (the long runs keep the other rank waiting); the planner's re-cut takes
    the same modes into runs of two."""
    layers = [layer(f"l{i}", saved=1e3) for i in range(8)]
    prob = problem(layers, [0.0] * 7, devices(2, 10**9), batch=8, micro_batch_sizes=(1,),
                   pins=Pins(pp=2, schedule="interleaved-1f1b", virtual_stages=2))
    table = solve(prob).best.table
    assert table.config.chunks == 2
    modes = ("none",) * 8
    uneven = (0, 1, 1, 1, 2, 2, 2, 3)
    evaluation = evaluate(table, uneven, modes)
    even = evaluate(table, (0, 0, 1, 1, 2, 2, 3, 3), modes)
    assert evaluation.step_ps == even.step_ps          # the closed form cannot tell
    result = ConfigResult(table=table, assignment=Assignment(stage_of=uneven, modes=modes),
                          evaluation=evaluation, status="OPTIMAL", bound=0, solve_time_s=0.0)
    recut, step = balanced_runs(prob, result)
    assert recut.assignment == Assignment(stage_of=(0, 0, 1, 1, 2, 2, 3, 3), modes=modes)
    assert step == simulated_step_ps(table.config, even)[0]
    assert step < simulated_step_ps(table.config, evaluation)[0]
    assert balanced_runs(prob, recut) == (recut, step)   # balanced already: kept


def test_an_interleaved_split_whose_balanced_cut_does_not_fit_gives_way_to_the_greedy_one():
    """As above where memory is tight: runs of 1, 3, 3 and 1 layers fit without
    recompute (the long runs are those that hold fewer microbatches in flight), the same
    modes cut into runs of two do not, and the greedy split (runs of two, recompute
    where a rank is over its memory) fits and plays out faster: it is kept."""
    layers = [layer(f"l{i}", saved=1e6, selective=5e5, full=500.0, mem_bytes=1e6)
              for i in range(8)]
    prob = problem(layers, [0.0] * 7, devices(2, 10**7), batch=8, micro_batch_sizes=(1,),
                   pins=Pins(pp=2, schedule="interleaved-1f1b", virtual_stages=2,
                             zero_stage=0))
    table = solve(prob).best.table
    modes, uneven = ("none",) * 8, (0, 1, 1, 1, 2, 2, 2, 3)
    evaluation = evaluate(table, uneven, modes)
    assert evaluation.fits and not evaluate(table, (0, 0, 1, 1, 2, 2, 3, 3), modes).fits
    result = ConfigResult(table=table, assignment=Assignment(stage_of=uneven, modes=modes),
                          evaluation=evaluation, status="OPTIMAL", bound=0, solve_time_s=0.0)
    played, step = balanced_runs(prob, result)
    greedy = incumbent(prob, table)
    assert played.assignment == greedy and greedy.stage_of == (0, 0, 1, 1, 2, 2, 3, 3)
    assert step == simulated_step_ps(table.config, played.evaluation)[0] \
        < simulated_step_ps(table.config, evaluation)[0]


def test_a_schedule_no_mesh_can_run_is_refused_with_its_reason():
    # DualPipeV runs a microbatch per virtual stage: 2 ranks of 2 need 4, the batch gives 2.
    layers = [layer(f"l{i}") for i in range(4)]
    prob = problem(layers, [0.0] * 3, devices(2, 10**9), batch=2, micro_batch_sizes=(1,),
                   pins=Pins(pp=2, schedule="dualpipev"))
    with pytest.raises(PlanInfeasibleError, match="needs at least 4 microbatches"):
        solve(prob)


def test_a_sequence_parallel_pin_no_variant_has_is_refused_naming_what_was_measured():
    prob = problem([layer("a"), layer("b")], [0.0], devices(2, 10**9),
                   pins=Pins(tp=2, sequence_parallel=True))
    with pytest.raises(PlanInfeasibleError,
                       match=r"No measured tensor-parallel layout .* \(measured for this "
                             r"model: none\)"):
        solve(prob)


def test_gpipe_is_weighed_only_where_pinned_as_1f1b_is_never_slower():
    """The search leaves GPipe out unless pinned (``search.candidate_configs``): by brute
    force over every split and mode, 1F1B's best plan of each configuration is as fast
    as GPipe's or faster (and fits wherever GPipe's does), closed form and played out."""
    rng = random.Random(17)
    checked = 0
    for _ in range(40):
        prob = random_problem(rng)
        assert all(c.schedule != "gpipe" for c in candidate_configs(prob))
        for config in candidate_configs(prob):
            if config.pp == 1 or config.num_microbatches == 1:
                continue
            gpipe = dataclasses.replace(config, schedule="gpipe")
            slow = best_split_of(prob, gpipe)
            if slow is None:
                continue
            fast = best_split_of(prob, config)
            assert fast is not None and fast[0] <= slow[0]
            assert least_played(prob, config) <= least_played(prob, gpipe)
            checked += 1
    assert checked > 10
    pinned = problem([layer("a"), layer("b")], [1e4], devices(2, 10**9), batch=4,
                     pins=Pins(schedule="gpipe"))
    assert {c.schedule for c in candidate_configs(pinned)} == {"gpipe"}
