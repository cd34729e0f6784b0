"""The planner with ZeRO-1's weight all-gather overlapped with the next forward
(``TrainNumbers.param_gather_overlap``) or blocking: its plans equal the brute-force
optimum of :func:`partc.cost.evaluate.evaluate` (the validator's figures), on instances where
the all-gather is large against the forward (30M-parameter layers over 1-10 GB/s links),
so that how much of it a stage's forward hides decides the split."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from partc.problem import Pins

from .instances import devices, layer, problem
from .test_search import _matches_oracle


def _instance(rng: random.Random, overlap: bool):
    layers = [layer(f"layer{i}", flops=rng.choice([1e9, 1e10, 4e10]),
                    params=rng.choice([1_000_000, 10_000_000, 30_000_000]),
                    saved=rng.choice([1e3, 1e5]), full=100.0)
              for i in range(rng.randint(2, 4))]
    numbers = devices(4, 10**12, bandwidth=rng.choice([1e9, 1e10]),
                      latency=rng.choice([0.0, 1e-5]),
                      overlap=rng.choice([0.5, 1.0]))
    prob = problem(layers, [rng.choice([0.0, 1e5])] * (len(layers) - 1), numbers,
                   batch=4, pins=Pins(zero_stage=1))
    return replace(prob, train=replace(prob.train, param_gather_overlap=overlap))


@pytest.mark.parametrize("overlap", [True, False])
def test_zero1_plan_equals_brute_force(overlap):
    rng = random.Random(7)
    assert sum(_matches_oracle(_instance(rng, overlap)) for _ in range(6)) == 6
