"""Lower bounds and the min-max split, against exhaustive enumeration."""

from __future__ import annotations

import itertools
import random

from partc.cost.evaluate import evaluate
from partc.cost.tables import TableCache, build_cost_table
from partc.planner.bounds import (balanced_split, incumbent, lower_bound, min_max_split,
                                  played_floor)
from partc.planner.search import candidate_configs, schedule_candidates

from .instances import devices, layer, least_played, problem, random_problem


def test_lower_bound_never_exceeds_a_configurations_optimum():
    rng = random.Random(11)
    checked = 0
    for _ in range(60):
        prob = random_problem(rng)
        for config in candidate_configs(prob):
            table = build_cost_table(prob, config)
            best = None
            n = prob.num_layers
            for starts in itertools.combinations(range(1, n), config.virtual_stages - 1):
                stage_of = [sum(1 for s in starts if s <= l) for l in range(n)]
                for modes in itertools.product(*(l.modes for l in prob.layers)):
                    ev = evaluate(table, stage_of, modes)
                    if ev.fits and (best is None or ev.step_ps < best):
                        best = ev.step_ps
            if best is not None:
                assert lower_bound(table) <= best
                checked += 1
    assert checked > 50


def test_min_max_split_equals_every_split():
    rng = random.Random(5)
    for _ in range(300):
        costs = []
        while len(costs) < 7:   # stretches of equal costs, as equal blocks give
            costs += [rng.choice([0, 1, 2, 5, 8])] * rng.randint(1, 4)
        costs = tuple(costs[:rng.randint(1, 7)])
        if not any(costs):
            continue
        parts = rng.randint(1, len(costs))
        best = min(max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
                   for used in range(parts)
                   for cuts in itertools.combinations(range(1, len(costs)), used))
        assert min_max_split(costs, parts) == best



def test_balanced_split_reaches_the_min_max_split():
    rng = random.Random(6)
    for _ in range(200):
        costs = [rng.choice([0, 1, 3, 7]) for _ in range(rng.randint(1, 8))]
        parts = rng.randint(1, len(costs))
        run_of = balanced_split(costs, parts)
        assert run_of == sorted(run_of) and set(run_of) == set(range(parts))
        assert max(sum(c for c, r in zip(costs, run_of) if r == run)
                   for run in range(parts)) == min_max_split(tuple(costs), parts)


def test_bounds_kept_in_a_table_cache_are_the_bounds_made_afresh():
    """The bounds and greedy plans the search reads through one TableCache (each family's
    fastest compute, its split and the schedules' least-held microbatches, kept once)
    equal the same made without a cache, table by table, under every schedule."""
    rng = random.Random(23)
    checked = 0
    for _ in range(25):
        prob, cache = random_problem(rng), TableCache()   # a cache serves one problem
        for config in candidate_configs(prob):
            for other in [config] + schedule_candidates(prob, config):
                kept, fresh = build_cost_table(prob, other, cache), build_cost_table(prob, other)
                assert lower_bound(kept, cache) == lower_bound(fresh)
                for flags in ({}, {"any_schedule": True}, {"one_in_flight": True}):
                    assert played_floor(kept, cache, **flags) == played_floor(fresh, **flags)
                assert incumbent(prob, kept, cache) == incumbent(prob, fresh)
                assert other.least_held() == tuple(
                    max(min(h) for h in other.held(s)) for s in range(other.pp))
                checked += other.chunks > 1
    assert checked > 20   # interleaved ones among them


def test_the_played_floor_counts_the_first_microbatchs_way_through_every_layer():
    """Where microbatches are few against the ranks, the floor on the step played is the
    first microbatch's forward through every layer and its backward (its input gradient
    under a split backward) back, not the busiest rank's share: never above the least
    step any split plays (brute force), and at it or near where the pipeline holds one
    microbatch."""
    rng = random.Random(3)
    checked = near = 0
    for _ in range(24):
        prob = random_problem(rng)
        if prob.num_layers > 8:
            continue
        for config in candidate_configs(prob):
            for trial in [config] + schedule_candidates(prob, config):
                if trial.pp < 2 or trial.num_microbatches > 4 or trial.virtual_stages > 6:
                    continue
                played = least_played(prob, trial)
                if played is None:
                    continue
                table = build_cost_table(prob, trial)
                floors = [played_floor(table), played_floor(table, one_in_flight=True),
                          played_floor(table, any_schedule=True, backward_scale=(
                              prob.devices.split_backward_factor or 1.0))]
                assert max(floors) <= played, trial
                checked += 1
                near += trial.num_microbatches == 1 and floors[0] >= 0.95 * played
    assert checked > 40 and near > 5


def _pressed_pipeline(rng: random.Random):
    """A pipeline of 4 to 6 layers on 2 or 4 ranks whose memory holds the layers' state
    and, on the ranks 1F1B fills first, too few of their activations: the ranks that
    hold more microbatches must recompute, or take fewer layers."""
    num_layers, num_devices = rng.randint(4, 6), rng.choice([2, 4])
    layers = [layer(f"layer{i}", flops=rng.choice([1e9, 2e9]), params=rng.choice([1000, 4000]),
                    saved=rng.choice([2e4, 5e4]), full=500.0) for i in range(num_layers)]
    state = sum(16 * l.param_count for l in layers) / num_devices
    activations = sum(l.saved_bytes["none"] for l in layers) / num_devices
    memory = int(state + rng.choice([1.0, 1.5, 2.0, 3.0]) * activations) + 4000
    return problem(layers, [0.0] * (num_layers - 1), devices(num_devices, memory),
                   batch=rng.choice([2, 4]), micro_batch_sizes=(1,))


def test_the_played_floor_counts_the_busiest_ranks_recompute_that_memory_forces(monkeypatch):
    """Under memory pressure the floor is the busiest rank's least compute over every
    placement that fits each rank's limit with the microbatches it holds
    (``_busiest_rank_floor``, a linear relaxation): where it raises the floor (the
    ranks 1F1B fills first must recompute or take fewer layers), never above the least
    step any split plays (brute force); elsewhere the floor is the one checked above."""
    from partc.planner import bounds

    rng = random.Random(17)
    raised = 0
    for _ in range(30):
        prob = _pressed_pipeline(rng)
        for config in candidate_configs(prob):
            for trial in [config] + schedule_candidates(prob, config):
                if trial.pp < 2 or trial.virtual_stages > 4:
                    continue
                table = build_cost_table(prob, trial)
                floor = played_floor(table)
                with monkeypatch.context() as patched:
                    patched.setattr(bounds, "_busiest_rank_floor", lambda *_: 0.0)
                    without = played_floor(table)
                assert without <= floor, trial
                if floor == without:
                    continue
                played = least_played(prob, trial)
                assert played is None or floor <= played, trial
                raised += played is not None
    assert raised > 10, raised
