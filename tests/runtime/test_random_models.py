"""Property-based parity (issue 16, item 7): random models (``tests/random_models.py``)
compiled for 2 processes under pp=2, tp=2 and dp=2 train like one process — losses,
every parameter and buffer, rtol 1e-5 — in one torchrun launch
(``random_worker.py``). The quick profile; ``pytest -m slow`` adds a matrix of
zero-bubble schedules (a split backward) and of sequence-parallel tp=2 (linears run as
rings); ``python benchmarks/property_models.py`` runs the long one.
"""

from __future__ import annotations

import pytest

from tests.random_models import ZERO_BUBBLE, draw_cases

from .random_worker import failure, launch

# A few drawn per mesh (hypothesis, fixed seeds: the same models on every run); the first
# of each is the simplest model.
PER_MESH = 3
CASES = [case for seed, mesh in enumerate(("pp2", "tp2", "dp2"))
         for case in draw_cases(PER_MESH, seed=seed, meshes=(mesh,))]
# The slow matrix: each zero-bubble schedule, and tp=2 with sequence parallelism on.
PER_KIND = 3
SLOW_CASES = ([case for seed, schedule in enumerate(ZERO_BUBBLE, start=10)
               for case in draw_cases(PER_KIND, seed=seed, meshes=("pp2",),
                                      schedules=(schedule,))]
              + [case for case in draw_cases(4 * PER_KIND, seed=20, meshes=("tp2",))
                 if case.sequence_parallel][:2 * PER_KIND])


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[list[dict]]:
    return launch(CASES, tmp_path_factory.mktemp("random"))


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[f"{case.mesh}-{i}" for i, case in enumerate(CASES)])
def test_random_model_trains_like_one_process(results, index):
    message = failure(results[index])
    assert message is None, f"{message}\nreplay: {CASES[index]}"


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory) -> list[list[dict]]:
    return launch(SLOW_CASES, tmp_path_factory.mktemp("random-slow"))


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SLOW_CASES)),
                         ids=[f"{c.schedule if c.mesh == 'pp2' else 'tp2-sp'}-{i}"
                              for i, c in enumerate(SLOW_CASES)])
def test_zero_bubble_and_ring_models_train_like_one_process(slow_results, index):
    message = failure(slow_results[index])
    assert message is None, f"{message}\nreplay: {SLOW_CASES[index]}"
    if SLOW_CASES[index].mesh == "tp2":
        assert slow_results[index][0]["ring_steps"] > 0, "no linear ran as a ring"
