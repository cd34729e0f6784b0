"""Property-based parity (issue 16, item 7): random models (``tests/random_models.py``)
compiled for 2 processes under pp=2, tp=2 and dp=2 train like one process — losses,
every parameter and buffer, rtol 1e-5 — in one torchrun launch
(``random_worker.py``). The quick profile; ``python benchmarks/property_models.py``
runs the long one.
"""

from __future__ import annotations

import pytest

from tests.random_models import draw_cases

from .random_worker import failure, launch

# A few drawn per mesh (hypothesis, fixed seeds: the same models on every run); the first
# of each is the simplest model.
PER_MESH = 3
CASES = [case for seed, mesh in enumerate(("pp2", "tp2", "dp2"))
         for case in draw_cases(PER_MESH, seed=seed, meshes=(mesh,))]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[list[dict]]:
    return launch(CASES, tmp_path_factory.mktemp("random"))


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[f"{case.mesh}-{i}" for i, case in enumerate(CASES)])
def test_random_model_trains_like_one_process(results, index):
    message = failure(results[index])
    assert message is None, f"{message}\nreplay: {CASES[index]}"
