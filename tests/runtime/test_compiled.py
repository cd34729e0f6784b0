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

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore

import partc
from partc.runtime import compiled, rank_build
from samples.gpt import gpt_tiny, loss_fn

from .test_parity import POOL_ENV, check_parity, launch, launched

DEFAULT = ["gpt-pp2-compiled", "gpt-dp2-compiled"]
SLOW = ["gpt-tp2-sp-dropout-compiled", "llama-pp2-compiled"]


def _launch(nproc: int, cases: list[str], out) -> list[dict]:
    return launch(nproc, cases, out, env=POOL_ENV)


default = launched("default", 2, DEFAULT)


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


@pytest.mark.slow
def test_compiled_fsdp_units_under_zero3_train_like_one_process(tmp_path):
    ranks = _launch(2, ["gpt-dp2-zero3-compiled"], tmp_path)
    check_parity(ranks, "gpt-dp2-zero3-compiled")
    assert all(rank["gpt-dp2-zero3-compiled"]["compiled_graphs"] > 0 for rank in ranks)


@contextlib.contextmanager
def _built_on_rank0(program: partc.Program, world: int, monkeypatch):
    """Rank 0 of ``world`` under a fake process group, its stages compiled with dynamo's
    ``aot_eager`` backend (no kernels built): the built module."""
    monkeypatch.setattr(rank_build, "compile_stage",
                        functools.partial(compiled.compile_stage, backend="aot_eager"))
    torch._dynamo.reset()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield program.build()
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_zero3_compiles_each_fsdp_unit_not_the_stage(monkeypatch):
    """Under ZeRO-3 (FSDP2) each unit's forward is compiled and the stage's own code,
    with FSDP's gather and free hooks, stays eager; checked on one rank of two under a
    fake process group, with dynamo's ``aot_eager`` backend (no kernels built), through
    one step."""
    ids = torch.randint(0, 128, (8, 16))
    program = partc.compile(gpt_tiny(), (ids,), loss_fn=loss_fn, example_target=ids,
                            budget=partc.DeviceBudget(num_devices=2, device="CPU"),
                            train=partc.TrainSpec(global_batch_size=8, compile=True),
                            constraints=partc.Constraints(pp=1, dp=2, zero_stage=3))
    assert program.plan.train.compile and program.plan.effective_zero_stage == 3
    with _built_on_rank0(program, 2, monkeypatch) as module:
        stage = module.parts.module
        units = set(compiled.compiled_units(stage))
        sharded = {path for path, sub in stage.named_modules()
                   if isinstance(sub, FSDPModule) and sub is not stage}
        # Every layer's module, each an FSDP unit (but the smallest, which join the
        # root's: ln_f), and the root's own code eager.
        assert sharded <= units and len(sharded) >= 2 and units - sharded == {"ln_f"}
        assert isinstance(stage, FSDPModule) and "" not in units
        module.forward_backward(ids[:4], target=ids[:4])
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= len(units)


def test_a_compiled_stage_compiles_under_cpu_telemetry(monkeypatch):
    """On CPU telemetry counts the first step's tensors under a dispatch mode, under which
    dynamo traces nothing and marks the stage's frame skipped for good: that step runs
    the compiled stage eagerly (torch.compiler.set_stance), the next compiles it, and
    neither is judged against the plan. Dynamo's ``aot_eager`` backend, one rank."""
    ids = torch.randint(0, 128, (8, 16))
    program = partc.compile(gpt_tiny(), (ids,), loss_fn=loss_fn, example_target=ids,
                            budget=partc.DeviceBudget(num_devices=1, device="CPU"),
                            train=partc.TrainSpec(global_batch_size=8, compile=True))
    with _built_on_rank0(program, 1, monkeypatch) as module:
        telemetry = module.telemetry(console=False)
        stats = torch._dynamo.utils.counters["stats"]
        before, graphs = stats["unique_graphs"], []
        for _ in range(3):
            module.forward_backward(ids, target=ids)
            graphs.append(stats["unique_graphs"] - before)
        telemetry.end()
        assert graphs[0] == 0 and graphs[1] >= 1 and graphs[2] == graphs[1]
        assert telemetry.records[0].memory_measure == "live_tensor_bytes"
        assert telemetry.records[0].memory_step == 1 and len(telemetry.records) == 3
        assert telemetry._unjudged == 2
