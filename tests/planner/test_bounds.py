"""Lower bounds and the min-max split, against exhaustive enumeration."""

from __future__ import annotations

import itertools
import random

from partc.cost.evaluate import evaluate
from partc.cost.tables import build_cost_table
from partc.planner.bounds import balanced_split, lower_bound, min_max_split
from partc.planner.search import candidate_configs

from .instances import random_problem


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
