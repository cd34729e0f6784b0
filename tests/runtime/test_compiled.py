"""Stages run through ``torch.compile`` (``TrainSpec(compile=True)``, inductor's CPU
kernels) train like one eager process: losses and parameters within 1e-5 after several
SGD steps, under torchrun with gloo.

The default run is one launch of two processes: the sample GPT in a two-stage pipeline,
with a fully and a selectively recomputed block (which run eagerly inside the compiled
stage), then over two data-parallel replicas. The slow profile adds four processes
(pipeline x replicas), tensor and sequence parallelism with dropout (each rank's mask
equal to its part of one process's, the collectives eager and as many as planned) and
Llama from its config in a pipeline. Inductor compiles in the worker itself (one
compile thread): a pool of compile processes costs more than it saves on two cores.
"""

from __future__ import annotations

import pytest

from .test_parity import check_parity, launch

DEFAULT = ["gpt-pp2-compiled", "gpt-dp2-compiled"]
SLOW = ["gpt-tp2-sp-dropout-compiled", "llama-pp2-compiled"]


def _launch(nproc: int, cases: list[str], out) -> list[dict]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
        # The first step compiles each stage while its peers wait: longer than the
        # watchdog's default minute on a loaded machine (partc.runtime.compiled).
        patch.setenv("PARTC_WATCHDOG_S", "600")
        return launch(nproc, cases, out)


@pytest.fixture(scope="module")
def default(tmp_path_factory) -> list[dict]:
    return _launch(2, DEFAULT, tmp_path_factory.mktemp("compiled"))


@pytest.mark.parametrize("name", DEFAULT)
def test_compiled_stages_train_like_one_process(default, name):
    check_parity(default, name)
    assert all(rank[name]["compiled_graphs"] > 0 for rank in default)


@pytest.mark.slow
def test_compiled_pipeline_over_replicas_trains_like_one_process(tmp_path):
    ranks = _launch(4, ["gpt-pp2-dp2-compiled"], tmp_path)
    check_parity(ranks, "gpt-pp2-dp2-compiled")


@pytest.mark.slow
def test_compiled_stages_with_tensor_parallelism_and_llama(tmp_path):
    ranks = _launch(2, SLOW, tmp_path)
    for name in SLOW:
        check_parity(ranks, name)
        assert all(rank[name]["compiled_graphs"] > 0 for rank in ranks)
    for rank in ranks:
        seen = rank["gpt-tp2-sp-dropout-compiled"]
        assert seen["collectives"] == seen["planned_collectives"]
