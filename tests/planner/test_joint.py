"""The joint search over meshes and schedules (``partc.planner.joint``): a pinned mesh
or schedule is never predicted faster than the planner's own choice, and a mesh's plan
is never slower than the best of Megatron's interleavings on it (an even split of the
blocks, ``v`` chunks per rank for every ``v`` dividing the blocks per rank, the
modes of the 1F1B plan). The default profile checks one hand-built instance; the
validation rows (Megatron-Core's table, SC'21) are slow-marked.
"""

from __future__ import annotations

import dataclasses

import pytest

from partc.compiler import plan_of, plan_problem
from partc.cost.evaluate import evaluate, simulated_step_ps
from partc.cost.pipeline_config import PS_PER_S, PipelineConfig
from partc.cost.tables import TableCache, build_cost_table
from partc.errors import PlanInfeasibleError
from partc.names import Outcome, Schedule
from partc.planner import joint, solve
from partc.planner.bounds import greedy_result, lower_bound
from partc.problem import Pins

from tests.validation.megatron import plan_assignment

from .instances import devices, layer, problem

BLOCKS = 6


def _instance(pins: Pins = Pins()):
    """Eight equal blocks between an embedding and a head on 2 devices, 16 sequences:
    one stage of two replicas or two stages, each with its batch splits; the memory
    makes two stages the faster."""
    layers = [layer("emb", flops=1e8, params=8000, saved=2e3)]
    layers += [layer(f"block{i}", flops=1e9, params=4000, saved=3e4, full=500.0,
                     signature="block") for i in range(BLOCKS)]
    layers.append(layer("head", flops=2e9, params=8000, saved=6e3))
    cuts = [1e4] * (BLOCKS + 1)
    return problem(layers, cuts, devices(2, 600_000, bandwidth=1e9, node=2), batch=16,
                   micro_batch_sizes=(1, 2), pins=pins)


def _megatron_interleavings(prob, plan) -> list[float]:
    """The step times of Megatron's interleavings of ``plan``'s mesh and batch split:
    its layers (embedding with the first block, head with the last) cut evenly into
    ``pp * v`` runs for each ``v > 1`` dividing the blocks per rank, the plan's modes;
    those that fit."""
    config = plan_assignment(plan).config
    pp, per_rank = config.pp, BLOCKS // config.pp
    modes = tuple(plan.recompute[name] for name in (l.name for l in prob.layers))
    steps = []
    for v in (v for v in range(2, per_rank + 1) if per_rank % v == 0):
        interleaved = dataclasses.replace(config, schedule=Schedule.INTERLEAVED_1F1B, chunks=v)
        size = BLOCKS // (pp * v)
        stage_of = [0] + [block // size for block in range(BLOCKS)] + [pp * v - 1]
        evaluation = evaluate(build_cost_table(prob, interleaved), stage_of, modes)
        if evaluation.fits:
            steps.append(simulated_step_ps(interleaved, evaluation)[0] / PS_PER_S)
    return steps


@pytest.fixture(scope="module")
def own():
    """The planner's own result for the instance, and its plan."""
    prob = _instance()
    result = solve(prob)
    return result, plan_of(prob, result)


def test_a_pinned_mesh_is_never_faster_than_the_planners_choice(own):
    result, plan = own
    meshes = [(m.pp, m.dp) for m in result.meshes if m.outcome != Outcome.INFEASIBLE]
    assert len(meshes) == 2
    for pp, dp in meshes:
        pinned = plan_problem(_instance(Pins(pp=pp, dp=dp)))
        assert plan.predicted.step_time_s <= pinned.predicted.step_time_s * (1 + 1e-12), (pp, dp)
        for megatron in _megatron_interleavings(_instance(), pinned):
            assert pinned.predicted.step_time_s <= megatron * (1 + 1e-12), (pp, dp)


@pytest.mark.parametrize("name", [Schedule.INTERLEAVED_1F1B] + [
    pytest.param(name, marks=pytest.mark.slow) for name in Schedule
    if name != Schedule.INTERLEAVED_1F1B])
def test_a_pinned_schedule_is_never_faster_than_the_planners_choice(own, name):
    _, plan = own
    try:
        pinned = plan_problem(_instance(Pins(schedule=name)))
    except PlanInfeasibleError:
        return
    assert plan.predicted.step_time_s <= pinned.predicted.step_time_s * (1 + 1e-12)


def test_the_mesh_table_prices_each_mesh_with_its_fastest_schedule(own):
    """Each solved mesh's step in the report is its fastest trial played out, and the
    chosen mesh's is the plan's."""
    result, _ = own
    chosen = result.meshes[0]
    best = result.best.table.config
    assert (chosen.pp, chosen.dp, chosen.tp) == (best.pp, best.dp, best.tp)
    assert chosen.step_ps == min(t.step_ps for t in result.schedule_trials
                                 if t.step_ps is not None)
    for mesh in result.meshes:
        played = [t.step_ps for t in result.schedule_trials if t.step_ps is not None
                  and (t.config.pp, t.config.dp, t.config.tp) == (mesh.pp, mesh.dp, mesh.tp)]
        if played:
            assert mesh.outcome == Outcome.SOLVED and mesh.step_ps == min(played)
    # Interleavings beyond four chunks per rank are tried (up to a layer per run).
    assert best.pp == 2
    assert max(t.config.chunks for t in result.schedule_trials) == (BLOCKS + 2) // 2



def test_a_trial_played_past_the_fastest_plan_is_bounded_below_by_where_it_stopped(own):
    """A trial of a mesh after the first whose play stopped past the fastest plan (by
    ``NEAR``) and its mesh's fastest so far has no plan, and a bound no faster than
    both; the same split played in full is no faster than that bound. The report's
    schedules on the chosen mesh play such a trial in full."""
    result, plan = own
    prob = _instance()
    cache = TableCache()
    chosen = min(t.step_ps for t in result.schedule_trials if t.result is not None)
    past = [t for t in result.schedule_trials if t.why == joint.PLAYED_PAST]
    assert past
    for trial in past:
        assert trial.result is None and trial.bound_ps >= chosen * (1 + joint.NEAR) - 1
        greedy = greedy_result(prob, build_cost_table(prob, trial.config, cache), cache)
        if trial.greedy:   # a schedule's trial (not a mesh's first), its greedy split
            assert simulated_step_ps(trial.config, greedy.evaluation)[0] >= trial.bound_ps
    options = {(o.schedule, o.virtual_stages): o for o in plan.schedules}
    for trial in past:
        if joint.mesh_key(trial.config) == joint.mesh_key(result.best.table.config):
            option = options[trial.config.schedule, trial.config.chunks]
            assert option.step_time_s * PS_PER_S >= trial.bound_ps - 1


def test_the_chosen_meshs_interleavings_are_played_cut_evenly_too():
    """Megatron's even split of the blocks (the layers before the first block and after
    the last with the blocks beside them: here two embeddings, a final norm and the
    head) is among the cuts the chosen mesh's interleaved plans are played with: here a
    heavy head makes the cut of balanced compute play out slower than it."""
    blocks = 12
    layers = [layer("emb", flops=1e8, params=8000, saved=2e3),
              layer("pos", flops=1e7, params=2000, saved=2e3)]
    layers += [layer(f"block{i}", flops=1e9, params=4000, saved=3e4, full=500.0,
                     signature="block") for i in range(blocks)]
    layers += [layer("norm", flops=1e7, params=100, saved=2e3),
               layer("head", flops=2e9, params=8000, saved=6e3)]
    prob = problem(layers, [1e4] * (blocks + 3), devices(2, 1_500_000, bandwidth=1e9, node=3),
                   batch=12, micro_batch_sizes=(1,),
                   pins=Pins(pp=2, schedule=Schedule.INTERLEAVED_1F1B, virtual_stages=2))
    result = solve(prob)
    played = [t for t in result.schedule_trials if t.result is not None]
    assert played
    for trial in played:
        stage_of = [0, 0] + [block // 3 for block in range(blocks)] + [3, 3]
        evaluation = evaluate(trial.result.table, stage_of, trial.result.assignment.modes)
        assert evaluation.fits
        assert trial.step_ps <= simulated_step_ps(trial.config, evaluation)[0]


def test_a_mesh_no_greedy_split_fits_is_solved_only_below_the_fastest_plan(own, monkeypatch):
    """Where no greedy split fits a mesh, CP-SAT looks for its plan only among its
    configurations whose floor is below the fastest plan played; a mesh whose every
    configuration CP-SAT proved planless is reported infeasible, not left to the work
    limit."""
    import math

    from partc.options import PlannerOptions
    from partc.planner import search as search_module

    result, _ = own
    prob = _instance()
    cache = TableCache()
    config = result.best.table.config
    table = build_cost_table(prob, config, cache)
    found = joint._Search(prob, cache, work=10.0, limit=10**6)
    found.step = 1000
    calls = []
    real = search_module.solve_config
    monkeypatch.setattr(search_module, "solve_config",
                        lambda *args, **kwargs: calls.append(args) or real(*args, **kwargs))
    assert found.solved_rep(PlannerOptions(), [table], [1000.0]) == (None, 1000.0)
    assert not calls   # its floor reached the fastest plan: no model built
    tight = dataclasses.replace(prob, devices=dataclasses.replace(
        prob.devices, memory_bytes=(1_000,) * prob.devices.num_devices))
    planless = joint._Search(tight, cache, work=10.0, limit=10**6)
    assert planless.solved_rep(PlannerOptions(), [build_cost_table(tight, config)],
                               [0.0]) == (None, math.inf)
    assert len(calls) == 1 and not planless.unsettled
    # The report: that mesh infeasible, the others as the search left them.
    other = next(m for m in result.meshes if (m.pp, m.dp) != (config.pp, config.dp))
    assert other.outcome != Outcome.INFEASIBLE
    step = min(t.step_ps for t in result.schedule_trials if t.step_ps is not None)
    chosen = joint.Chosen(result.best, result.schedule_trials, True,
                          {joint.mesh_key(config): (result.best, step)},
                          {joint.mesh_key(config): 0.0,
                           joint.mesh_axes(other) + (False, None, 1): math.inf})
    priced = {(m.pp, m.dp): m for m in joint.priced_meshes(result.meshes, chosen)}
    assert priced[other.pp, other.dp].outcome == Outcome.INFEASIBLE
    assert priced[other.pp, other.dp].bound_ps is None
    assert priced[config.pp, config.dp].outcome == Outcome.SOLVED


def test_the_chosen_meshs_greedy_splits_share_one_configurations_work_to_improve(
        monkeypatch):
    """CP-SAT re-solves the chosen mesh's schedules whose greedy split is played (and
    so settled) with one configuration's work between them (``FIRST_SHARE``), fastest
    greedy split first, and none once it is spent; a trial without a split is still
    solved with the work left."""
    from partc.options import PlannerOptions
    from partc.planner import search as search_module

    prob, cache = _instance(), TableCache()
    options = PlannerOptions(config_work_limit=0.5)
    config = PipelineConfig(pp=2, dp=1, micro_batch_size=1, num_microbatches=16,
                            schedule=Schedule.ONE_F_ONE_B)
    planless = dataclasses.replace(config, schedule=Schedule.GPIPE)
    real = search_module.solve_config

    def pending(calls: list) -> tuple[joint._Search, set]:
        found = joint._Search(prob, cache, work=100.0, limit=10**6)
        key = joint.mesh_key(config)
        found.add(key, greedy_result(prob, build_cost_table(prob, config, cache), cache),
                  first=True)
        found.step *= 2   # every schedule's greedy split near the fastest plan
        for v in (2, 3, 4):
            found.price(key, dataclasses.replace(config, schedule=Schedule.INTERLEAVED_1F1B,
                                                 chunks=v), first=True)
        greedy = {p[2].config for p in found.pending if p[2].result is not None}
        found.pending.append((False, float("inf"),
                              joint.ScheduleTrial(config=planless, why=joint.NO_SPLIT), 0.0))

        def recorded(problem, table, options, work, *args):
            outcome = real(problem, table, options, work, *args)
            calls.append((table.config, work, outcome[3]))
            return outcome

        monkeypatch.setattr(search_module, "solve_config", recorded)
        return found, greedy

    calls: list = []
    found, greedy = pending(calls)
    assert len(greedy) == 3
    found.solve_pending(options)
    share = options.per_config_work * joint.FIRST_SHARE
    improving = [(work, spent) for config, work, spent in calls if config in greedy]
    assert improving and all(work <= share for work, _ in improving)
    assert sum(spent for _, spent in improving[:-1]) < share   # none after it is spent
    assert any(config == planless for config, _, _ in calls)

    monkeypatch.setattr(joint, "FIRST_SHARE", 0.0)
    calls.clear()
    found, greedy = pending(calls)
    found.solve_pending(options)
    assert [config for config, _, _ in calls] == [planless]


def test_a_mesh_is_priced_from_its_split_fastest_by_the_closed_form():
    """The closed-form search may have solved a mesh's slower batch split early and
    pruned a faster one later: the joint search then prices the mesh from the split of
    least closed-form bound, where its greedy plan is faster by the closed form
    (``joint._closest``), and keeps the solved plan otherwise."""
    prob, cache = _instance(), TableCache()
    tables = [build_cost_table(prob, PipelineConfig(
        pp=2, dp=1, micro_batch_size=b, num_microbatches=16 // b,
        schedule=Schedule.ONE_F_ONE_B), cache) for b in (1, 2)]
    plans = [greedy_result(prob, table, cache) for table in tables]
    slow, fast = sorted(range(2), key=lambda i: plans[i].evaluation.step_ps)[::-1]
    bounds = [lower_bound(table, cache) for table in tables]
    assert bounds[fast] < plans[slow].evaluation.step_ps
    closed = list(bounds)
    closed[slow] = plans[slow].evaluation.step_ps   # solved: known by its plan
    taken = joint._closest(prob, tables, [0, 1], closed, plans[slow], cache)
    assert taken.table is tables[fast]
    assert taken.evaluation.step_ps == plans[fast].evaluation.step_ps
    # A solved plan no sibling's bound undercuts stays.
    closed[fast] = plans[slow].evaluation.step_ps
    assert joint._closest(prob, tables, [0, 1], closed, plans[slow], cache) is plans[slow]
    # No plan from the closed-form search: the least bound's greedy plan.
    assert joint._closest(prob, tables, [0, 1], bounds, None, cache).table is tables[fast]


def test_a_schedules_guess_is_1f1bs_step_less_the_fill_its_chunks_save():
    """``joint._estimate`` orders the other meshes' schedules: 1F1B's own step at one
    chunk, less with each chunk more, never below the microbatches' share."""
    def guess(chunks: int, m: int = 8) -> float:
        return joint._estimate(1000.0, PipelineConfig(
            pp=4, dp=1, micro_batch_size=1, num_microbatches=m,
            schedule=Schedule.INTERLEAVED_1F1B, chunks=chunks))

    assert guess(1) == pytest.approx(1000.0)
    assert guess(1) > guess(2) > guess(4) > 1000.0 * 8 / 11
    assert guess(2) == pytest.approx(1000.0 * (8 + 3 / 2) / 11)
