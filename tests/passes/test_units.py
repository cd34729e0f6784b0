"""The units pass (ZeRO-2/3, and ZeRO-1 with its all-gather overlapped): each layer that
owns its parameters becomes one module call at its own path, with the same parameter
FQNs and the same values out."""

from __future__ import annotations

import pytest
import torch

import partc
from partc import meta
from partc.passes.context import Lowering
from partc.passes.pipeline import analyze, lower
from partc.passes.fsdp_units import units
from samples import gpt
from tests import models

MODELS = {
    "gpt": (gpt.gpt_tiny, gpt.loss_fn),
    "gpt2": (lambda: models.gpt2(dropout=0.0), models.causal_lm_loss),
    "llama": (models.llama, models.causal_lm_loss),
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("pp", [1, 2])
def test_units_keep_names_and_values(name, pp):
    build, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model = build()
    x = torch.randint(0, 128, (2, 16))
    gm, _ = analyze(model, (x,), loss_fn=loss_fn)
    names = [layer.name for layer in meta.layers(gm)]
    cut = len(names) // 2
    stages = [names] if pp == 1 else [names[:cut], names[cut:]]
    recompute = {n: "full" for n in names if n.endswith(".0")}
    lowering = Lowering(stages=tuple(map(tuple, stages)), recompute=recompute)
    plain = lower(model, (x,), lowering, loss_fn=loss_fn).stages
    wrapped = lower(model, (x,), lowering, loss_fn=loss_fn).stages
    inputs: tuple = (x,)
    for before, after in zip(plain, wrapped):
        made = units(after.module)
        blocks = [n for n in before.layers if n.split(".")[-1].isdigit()]
        assert set(blocks) <= set(made)  # every transformer block is a unit
        assert all(isinstance(after.module.get_submodule(path), torch.fx.GraphModule)
                   for path in made)
        assert dict(before.module.named_parameters()).keys() == \
            dict(after.module.named_parameters()).keys()
        expected, got = before.module(*inputs), after.module(*inputs)
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
        inputs = tuple(expected)


def test_a_tied_weight_read_by_two_layers_stays_with_the_stage():
    model = gpt.gpt_tiny()
    x = torch.randint(0, 128, (2, 16))
    gm, _ = analyze(model, (x,), loss_fn=gpt.loss_fn)
    names = [layer.name for layer in meta.layers(gm)]
    (stage,) = lower(model, (x,), Lowering(stages=(tuple(names),), recompute={}),
                     loss_fn=gpt.loss_fn).stages
    made = units(stage.module)
    # tok_emb.weight is also the LM head's: neither layer can own it.
    assert "tok_emb" not in made and "lm_head" not in made
    assert "blocks.0" in made and "ln_f" in made


def test_lowering_makes_the_units_when_the_plan_shards_over_dp():
    """With ``fsdp_units`` (ZeRO-2/3 over dp > 1) lowering leaves the units in place and
    names them on the stage, where the runtime finds them."""
    model = gpt.gpt_tiny()
    x = torch.randint(0, 128, (2, 16))
    gm, _ = analyze(model, (x,), loss_fn=gpt.loss_fn)
    names = tuple(layer.name for layer in meta.layers(gm))
    lowering = Lowering(stages=(names,), recompute={}, fsdp_units=True)
    (stage,) = lower(model, (x,), lowering, loss_fn=gpt.loss_fn).stages
    assert "blocks.0" in meta.fsdp_units(stage.module)
    assert isinstance(stage.module.get_submodule("blocks.0"), torch.fx.GraphModule)


@pytest.mark.parametrize("train, made", [({}, True), ({"overlap_param_gather": False}, False),
                                         ({"compile": True}, False)])
def test_zero1_lowers_units_where_its_overlapped_gathers_wait_in_layers(train, made):
    """Under ZeRO-1 each layer's forward pre-hook waits for the buckets of its parameters
    (``TrainSpec.overlap_param_gather``): lowering makes the units then, and not for a
    blocking all-gather or a compiled stage (which waits for all its buckets at once)."""
    model = gpt.gpt_tiny()
    x = torch.randint(0, 128, (4, 16))
    program = partc.compile(
        model, (x,), loss_fn=gpt.loss_fn, example_target=x,
        budget=partc.DeviceBudget(num_devices=2, device="CPU"),
        train=partc.TrainSpec(global_batch_size=4, **train),
        constraints=partc.Constraints(pp=1, dp=2, zero_stage=1, recompute="none"))
    (stage,) = program.lower().stages
    assert ("blocks.0" in meta.fsdp_units(stage.module)) == made


def test_the_tensor_parallel_group_stays_with_the_stage():
    """Under tensor parallelism each layer's unit takes along the group its collectives
    run over; the stage keeps it too, for the layers that are not units."""
    torch.manual_seed(0)
    model = gpt.gpt_tiny()
    ids, targets = gpt.example_inputs(model, batch=8, seq=16)
    program = partc.compile(
        model, (ids,), loss_fn=gpt.loss_fn, example_target=targets,
        budget=partc.DeviceBudget(num_devices=2, device="CPU"),
        train=partc.TrainSpec(global_batch_size=8),
        constraints=partc.Constraints(pp=1, tp=2, tp_objective="memory", num_microbatches=4,
                                      recompute={"blocks.0": "full"}))
    (stage,) = program.stages()
    module = stage.module
    group = module.get_submodule("tp")
    made = units(module)
    assert {"blocks.0", "blocks.1"} <= set(made)
    assert module.get_submodule("tp") is group
    assert module.get_submodule("blocks.1.tp") is group
    (logits,) = module(ids[:2])  # rank 0 of the stand-in group
    assert logits.shape == (2, 16, 128)
