"""The recompute pass: on a tiny hand-built graph (``tests/passes/tiny_graphs.py``), the
printed code and node.meta of a recomputed layer, and the same values and gradients as
the graph it rewrote; on GPT-2, that selective recompute wraps exactly the attention
cores, that the rerun replays dropout and keeps less."""

from __future__ import annotations

import pytest
import torch

from partc import meta
from partc.passes.helpers import verify
from partc.passes.context import Lowering
from partc.passes.helpers.graph import op_name
from partc.passes.pipeline import analyze
from partc.passes.recompute_layers import recompute, recompute_layers
from partc.passes.split import StageGraph, split
from partc.runtime.activation_offload import ledgers
from partc.runtime.recompute import checkpoint_layer
from tests import models
from tests.passes.tiny_graphs import TINY_LAYERS, context, tiny_graph, tokens

STAGE = (tuple(TINY_LAYERS),)  # one stage holding every layer


def lines(module: torch.fx.GraphModule) -> list[str]:
    """The printed forward, one stripped statement per line, without fx's ``x = None``s."""
    return [line.split(";")[0].strip() for line in module.code.strip().splitlines()]


def values_and_grads(model: torch.nn.Module, gm: torch.fx.GraphModule
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = gm(tokens(1))
    out.square().sum().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_a_recomputed_layer_becomes_a_checkpointed_submodule():
    mode = "full"
    model, gm = tiny_graph()
    params = [name for name, _ in gm.named_parameters()]
    recompute_layers(gm, {"block": mode})
    assert lines(gm)[4:8] == [
        "block_weight = self.block.weight",
        "block_bias = self.block.bias",
        "recompute_block = self.recompute_block",
        "checkpoint_layer = partc_runtime_recompute_checkpoint_layer(recompute_block, "
        f"'{mode}', embedding, block_weight, block_bias)",
    ]
    assert lines(gm)[8:10] == ["getitem = checkpoint_layer[0]",
                               "add = getitem + embedding"]
    assert lines(gm.recompute_block) == [
        "def forward(self, embedding, block_weight, block_bias):",
        "linear = torch._C._nn.linear(embedding, block_weight, block_bias)",
        "relu = torch.relu(linear)",
        "return (relu,)",
    ]
    # The parameters stay where the model keeps them; the layer reads them as inputs.
    assert [name for name, _ in gm.named_parameters()] == params
    assert list(gm.recompute_block.parameters()) == []
    verify.check("recompute", gm)


def test_the_new_nodes_carry_the_layer_and_the_outputs_values():
    _, gm = tiny_graph()
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    relu_val, relu_tensors = relu.meta["val"], meta.tensors(relu)
    recompute_layers(gm, {"block": "full"})
    nodes = {node.name: node for node in gm.graph.nodes}
    for name in ("recompute_block", "checkpoint_layer", "getitem"):
        assert meta.layer(nodes[name]) == meta.LayerRef(1, "block")
    assert nodes["checkpoint_layer"].target is checkpoint_layer
    assert nodes["getitem"].meta["val"] is relu_val
    assert meta.tensors(nodes["getitem"]) == relu_tensors
    # Inside the submodule the layer's nodes keep their meta.
    inner = {node.name: node for node in gm.recompute_block.graph.nodes}
    assert meta.layer(inner["relu"]) == meta.LayerRef(1, "block")
    assert meta.tensors(inner["relu"]) == relu_tensors


@pytest.mark.parametrize("modes", [{"block": "full"},
                                   {"embed": "full", "block": "selective", "head": "full"}],
                         ids=["full", "every-layer"])
def test_values_and_gradients_equal_the_original(modes):
    model, gm = tiny_graph()
    expected, expected_grads = values_and_grads(model, gm)
    model, gm = tiny_graph()
    recompute_layers(gm, modes)
    wrapped = [name for name, _ in gm.named_children() if name.startswith("recompute_")]
    # The block has no attention core: selective recompute leaves it as it is.
    assert wrapped == [f"recompute_{layer}" for layer, mode in modes.items() if mode == "full"]
    verify.check("recompute", gm)
    got, grads = values_and_grads(model, gm)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0)


def test_an_offloaded_layer_runs_under_the_stages_ledger_keeping_its_weights():
    model, gm = tiny_graph()
    expected, expected_grads = values_and_grads(model, gm)
    model, gm = tiny_graph()
    recompute_layers(gm, {"block": "offload"})
    assert lines(gm)[4:9] == [
        "block_weight = self.block.weight",
        "block_bias = self.block.bias",
        "offload_block = self.offload_block",
        "activation_offload = self.activation_offload",
        "offload_layer = partc_runtime_activation_offload_offload_layer(activation_offload, "
        "offload_block, embedding, block_weight, block_bias, held = (1, 2))",
    ]
    assert list(gm.offload_block.parameters()) == []
    verify.check("recompute", gm)
    got, grads = values_and_grads(model, gm)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0)
    # The linear saves its input (2 x 3 x 8 floats: 192 bytes; its weight stays) and relu
    # its output (as many): both out and back, none left on the host.
    counters = ledgers(gm)[0].counters
    assert (counters.to_host, counters.to_device, counters.resident,
            counters.peak_resident) == (2 * 192, 2 * 192, 0, 2 * 192)


@pytest.mark.parametrize("mode", ["none", "selective"])
def test_none_leaves_the_graph_unchanged_and_so_does_selective_without_attention(mode):
    _, gm = tiny_graph()
    code = gm.code
    recompute_layers(gm, {name: mode for name in TINY_LAYERS})
    assert gm.code == code
    assert not any(name.startswith("recompute_") for name, _ in gm.named_children())


def test_an_unknown_mode_is_refused():
    _, gm = tiny_graph()
    with pytest.raises(ValueError, match="layer block: unknown recompute mode 'all'"):
        recompute_layers(gm, {"block": "all"})


def test_the_pass_reads_the_modes_from_the_lowering():
    model, gm = tiny_graph()
    lowering = Lowering(stages=STAGE, recompute={"head": "full"})
    recompute(gm, context(model, (tokens(),), lowering=lowering))
    assert [name for name, _ in gm.named_children()][-1] == "recompute_head"
    assert ("checkpoint_layer = partc_runtime_recompute_checkpoint_layer(recompute_head, "
            "'full', relu, embedding, size, embed_weight)") in lines(gm)
    # While analysing there is no lowering, and nothing to recompute.
    model, gm = tiny_graph()
    code = gm.code
    recompute(gm, context(model, (tokens(),)))
    assert gm.code == code


# ------------------------------------------------------- GPT-2: dropout and memory

def gpt2_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, 128, (8, 17), generator=torch.Generator().manual_seed(0))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _stage_of_gpt2(dropout: float, modes: dict
                   ) -> tuple[torch.nn.Module, StageGraph, torch.fx.GraphModule]:
    model = models.gpt2(dropout=dropout)
    x, y = gpt2_tokens()
    gm, _ = analyze(model, (x,), loss_fn=models.causal_lm_loss, example_target=y)
    names = [layer.name for layer in meta.layers(gm)]
    [stage] = split(gm, [names])
    recompute_layers(stage.module, {n: modes.get(n, "none") for n in names})
    return model, stage, gm


def test_selective_recompute_wraps_the_attention_cores_only():
    """Megatron's selective recompute: in each block, q @ k^T, scale, mask, softmax,
    dropout and @ v are rerun; the projections, norms and MLP keep what they save."""
    _, stage, _ = _stage_of_gpt2(0.1, {"transformer.h.0": "selective",
                                       "transformer.h.1": "selective"})
    module = stage.module
    wrapped = [name for name, _ in module.named_children() if name.startswith("recompute_")]
    assert wrapped == ["recompute_transformer_h_0_attention",
                       "recompute_transformer_h_1_attention"]
    core = module.get_submodule(wrapped[0])
    ops = [op_name(n) for n in core.graph.nodes if n.op in ("call_function", "call_method")]
    assert ops[0] == "matmul" and ops[-1] == "matmul", ops
    assert "softmax" in ops and "dropout" in ops, ops
    assert not {"addmm", "linear", "layer_norm", "gelu"} & set(ops), ops
    verify.check("recompute", module)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_replays_dropout_masks(mode):
    """With dropout on, a recomputed layer's gradients equal the stored layer's: the rerun
    draws the forward's masks (RNG state preserved)."""
    grads = {}
    for label, modes in (("stored", {}), ("recomputed", {"transformer.h.0": mode,
                                                          "transformer.h.1": mode})):
        torch.manual_seed(0)
        model, stage, gm = _stage_of_gpt2(0.1, modes)
        x, y = gpt2_tokens()
        torch.manual_seed(1)
        (logits,) = stage.module(x)
        loss = gm.get_submodule("loss")(logits, y)
        loss.backward()
        grads[label] = {n: p.grad.clone() for n, p in stage.module.named_parameters()}
    assert grads["stored"].keys() == grads["recomputed"].keys()
    for name, grad in grads["stored"].items():
        torch.testing.assert_close(grads["recomputed"][name], grad, rtol=1e-6, atol=1e-7)


def test_recompute_keeps_less_for_backward():
    """Activation bytes alive after the forward (what backward will read), as MemTracker
    counts them: full < selective < none."""
    from torch.distributed._tools.mem_tracker import MemTracker

    kept = {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model, stage, gm = _stage_of_gpt2(0.0, {"transformer.h.0": mode, "transformer.h.1": mode})
        x, _ = gpt2_tokens()
        tracker = MemTracker()
        tracker.track_external(stage.module)
        with tracker:
            (logits,) = stage.module(x)
            snapshot = tracker.get_tracker_snapshot("current")
        kept[mode] = sum(by_type[t] for by_type in snapshot.values()
                         for t in by_type if "ACT" in str(t))
    assert kept["full"] < kept["selective"] < kept["none"], kept
