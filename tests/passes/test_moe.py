"""Mixture-of-experts layers recognised from the graph (router, routed experts, shared
experts, balance loss), their balanced-routing figures, and the experts call lowered to
the runtime's expert-parallel module computing exactly what the model computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from partc import meta
from partc.passes.context import Lowering
from partc.passes.moe import recognize
from partc.passes.pipeline import _trace, analyze, lowering_passes, run_passes, stage_passes
from partc.passes.split import split
from partc.runtime.experts import expert_modules
from samples import moe
from tests import models
from tests.hf_families import FAMILIES
from tests.tolerances import FP32

BATCH, SEQ = 2, 8
# family: (MoE layers, top_k, scoring, shared expert parameters per layer)
EXPECTED = {"mixtral": (2, 2, "softmax", 0), "qwen2-moe": (2, 2, "softmax", 4),
            "qwen3-moe": (2, 2, "softmax", 0), "olmoe": (2, 2, "softmax", 0),
            "deepseek-v3": (1, 2, "sigmoid", 3)}


def _ids() -> torch.Tensor:
    return torch.randint(0, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _analysis(model, loss_fn=None):
    ids = _ids()
    target = ids if loss_fn is not None else None
    return analyze(model, (ids,), loss_fn=loss_fn, example_target=target)


def test_sample_layers_recognised_with_their_balance_loss():
    torch.manual_seed(0)
    _, analysis = _analysis(moe.moe_tiny(), moe.loss_fn)
    costs = [layer.moe for layer in analysis.layers if layer.moe is not None]
    assert len(costs) == 2
    for layer in analysis.layers:
        if layer.moe is not None:  # the layer's own figures include its experts
            assert layer.fwd_flops > layer.moe.expert_fwd_flops
    for cost in costs:
        assert (cost.num_experts, cost.top_k, cost.hidden, cost.tokens_per_sample) == (4, 1, 64, SEQ)
        assert cost.expert_param_count == 2 * 4 * 64 * 128
        # Balanced routing: each token through one expert's two matmuls.
        assert cost.expert_fwd_flops == 2.0 * SEQ * 1 * cost.expert_param_count / 4
        assert cost.dispatch_bytes == SEQ * 1 * 64 * 4
        assert cost.aux_loss
        assert cost.expert_saved_bytes["none"] > 0 and cost.expert_saved_bytes["full"] == 0


@pytest.mark.parametrize("family", [f if f == "qwen2-moe" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in sorted(EXPECTED)])
def test_hf_families_recognised(family):
    torch.manual_seed(0)
    model = FAMILIES[family].build()
    gm, ctx = _trace(model, (_ids(),))
    gm = run_passes(lowering_passes(Lowering(stages=(), recompute={})), gm, ctx)
    regions = recognize(gm, BATCH)
    layers, top_k, scoring, shared = EXPECTED[family]
    assert len(regions) == layers
    for region in regions:
        assert (region.num_experts, region.top_k, region.scoring) == (4, top_k, scoring)
        assert region.expert_form == "batched"
        assert {p.rpartition(".")[2] for p in region.expert_params} == {"gate_up_proj",
                                                                          "down_proj"}
        assert len(region.shared_params) == shared
        assert not region.aux_loss  # output_router_logits off


def test_module_list_experts_run_densely_recognised():
    """Experts in an nn.ModuleList, each run on every token and weighted by the router:
    they feed the combine without following the top-k, and are recognised as a module
    list (every expert's weights, none of the gate's or the norm's)."""
    torch.manual_seed(0)
    model = models.ListMoEModel()
    gm, analysis = analyze(model, (_ids(),), loss_fn=models.token_loss, example_target=_ids())
    regions = recognize(gm, BATCH)
    assert [r.module for r in regions] == ["moes.0", "moes.1"]
    for index, region in enumerate(regions):
        assert (region.num_experts, region.top_k, region.expert_form) == (4, 2, "module-list")
        assert set(region.expert_params) == {
            f"moes.{index}.experts.{e}.{proj}.{kind}" for e in range(4)
            for proj in ("up", "down") for kind in ("weight", "bias")}
        assert region.gate_params == (f"moes.{index}.gate.weight",)
    costs = [layer.moe for layer in analysis.layers if layer.moe is not None]
    assert [c.expert_form for c in costs] == ["module-list"] * 2
    assert costs[0].expert_param_count == sum(
        p.numel() for p in model.moes[0].experts.parameters())


@pytest.mark.slow
def test_hf_router_aux_loss_recognised():
    family = FAMILIES["mixtral"]
    fields = {**family.fields, "output_router_logits": True}
    model = dataclasses.replace(family, fields=fields).build()
    gm, ctx = _trace(model, (_ids(),))
    gm = run_passes(lowering_passes(Lowering(stages=(), recompute={})), gm, ctx)
    assert all(region.aux_loss for region in recognize(gm, BATCH))


@pytest.mark.parametrize("name", ["sample", *(pytest.param(n, marks=pytest.mark.slow)
                                            for n in ("mixtral", "qwen2-moe", "deepseek-v3"))])
def test_lowered_experts_compute_what_the_model_does(name):
    torch.manual_seed(0)
    model = moe.moe_tiny() if name == "sample" else FAMILIES[name].build()
    lowering = Lowering(stages=(), recompute={}, ep=2)
    gm, ctx = _trace(model, (_ids(),))
    gm = run_passes(lowering_passes(lowering), gm, dataclasses.replace(ctx, lowering=lowering))
    assert len(expert_modules(gm)) == (1 if name == "deepseek-v3" else 2)
    with torch.no_grad():
        ours, theirs = gm(_ids())[0], model(_ids())
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs.logits
    if name == "sample":   # the same ops in the same order
        assert torch.equal(ours, theirs)
    else:   # the same products, summed in another order where the model multiplies its
        # experts' tokens as one grouped matmul (transformers 5 on CPU): fp32's oracle
        torch.testing.assert_close(ours, theirs, rtol=FP32,
                                   atol=FP32 * theirs.abs().max().item())


def test_capacity_drops_per_sample():
    """Capacity 1 with top-2 keeps at most ceil(SEQ * 2 / 4) slots per sample and
    expert; a sample's output depends on that sample alone."""
    torch.manual_seed(0)
    model = moe.moe_tiny(top_k=2)
    lowering = Lowering(stages=(), recompute={}, capacity_factor=1.0)
    gm, ctx = _trace(model, (_ids(),))
    gm = run_passes(lowering_passes(lowering), gm, dataclasses.replace(ctx, lowering=lowering))
    with torch.no_grad():
        whole = gm(_ids())[0]
        dropless = model(_ids())[0]
    assert not torch.allclose(whole, dropless)
    gm1, ctx1 = _trace(model, (_ids()[:1],))
    gm1 = run_passes(lowering_passes(lowering), gm1, dataclasses.replace(ctx1, lowering=lowering))
    with torch.no_grad():
        first = gm1(_ids()[:1])[0]
    torch.testing.assert_close(first, whole[:1], rtol=1e-6, atol=1e-6)


def test_under_zero3_the_experts_call_holds_its_weights_and_is_a_layer_unit():
    """ZeRO-2/3: the experts call takes the experts module's place holding the routed
    weights under their FQNs (FSDP gathers a module's own weights around its call), and
    the layer's unit keeps it; the stage computes what the model does."""
    torch.manual_seed(0)
    model = moe.moe_tiny()
    names = set(dict(model.named_parameters()))
    lowering = Lowering(stages=(), recompute={}, ep=2, fsdp_units=True)
    gm, ctx = _trace(model, (_ids(),))
    ctx = dataclasses.replace(ctx, lowering=lowering)
    gm = run_passes(lowering_passes(lowering), gm, ctx)
    (stage,) = split(gm, [[info.name for info in meta.layers(gm)]])
    module = run_passes(stage_passes(lowering), stage.module, ctx)
    layers = expert_modules(module)
    assert len(layers) == 2
    for layer in layers:
        assert layer.owned == ("w_in", "w_out")
        assert all(module.get_parameter(f) is getattr(layer, f.rpartition(".")[2])
                   for f in layer.weight_names)
    assert set(dict(module.named_parameters())) == names
    unit = module.get_submodule("blocks.0")
    assert isinstance(unit, torch.fx.GraphModule)
    assert unit.get_submodule("moe.experts") is layers[0]
    with torch.no_grad():
        assert torch.equal(module(_ids())[0], model(_ids())[0])


def test_hf_experts_on_meta_in_mixed_precision_plan_with_every_variant_recognised(caplog):
    """A Hugging Face MoE model as a newcomer plans a big one: built on the meta device,
    bf16 on H100s. Three things this needs:

    - the forward recorded for the repeated blocks takes export's branches (its experts'
      eager ``torch._grouped_mm`` refuses float32 on meta; under export a custom op of
      theirs runs), so the blocks are deduplicated rather than the whole model traced;
    - the estimate measures the meta trace's GPU branch (``histc`` of int32 expert ids,
      which CPU kernels lack) on the op's traced device;
    - every tensor-parallel variant keeps its experts, a gate sharded along its input
      included (its partial logits all-reduced before the top-k)."""
    import partc

    family = FAMILIES["qwen3-moe"]   # four blocks: enough to deduplicate
    family = dataclasses.replace(family, fields={**family.fields, "num_hidden_layers": 4})
    with torch.device("meta"):
        model = family.build()
    ids = torch.zeros(BATCH, 64, dtype=torch.long, device="meta")
    with caplog.at_level("WARNING", logger="partc"):
        program = partc.compile(
            model, (ids,), loss_fn=lambda out, t: out.logits.float().mean(),
            example_target=ids, budget=partc.DeviceBudget(num_devices=8, device="H100-80GB"),
            train=partc.TrainSpec(global_batch_size=8, dtype=torch.bfloat16), cache=None)
    assert "tracing the whole model" not in caplog.text
    problem = program.problem
    moe_layers = [layer for layer in problem.layers if layer.moe is not None]
    assert len(moe_layers) == 4
    # Full recompute reruns the whole forward, the experts' grouped matmuls included
    # (seen before: it reran all but them, so recomputing a MoE layer looked cheap).
    assert all(layer.recompute_flops["full"] == layer.fwd_flops for layer in moe_layers)
    options = problem.model.tensor_parallel
    assert options
    sharded_gate = False
    for option in options:
        variant = {layer.name: layer for layer in option.model.layers}
        for whole in moe_layers:
            local = variant[whole.name]
            assert local.moe is not None, (option.tp, option.sequence_parallel, whole.name)
            # the rank computes at least its tp share of the routed experts
            assert local.fwd_flops >= whole.moe.expert_fwd_flops / option.tp
        sharded_gate |= any(name.endswith("mlp.gate.weight") and placement.kind == "S"
                            for name, placement in option.placements)
    # The chooser shards the gate in some variant here, so the all-reduced scores were
    # walked through (if it stops doing so, this test no longer covers that path).
    assert sharded_gate
