"""The split pass on tiny hand-built graphs (``tests/passes/tiny_graphs.py``): what each
stage receives, sends and holds, its printed code, and that the stages compose to the
whole graph."""

from __future__ import annotations

import pytest
import torch

from partc import meta
from partc.errors import PlanMismatchError
from partc.identity import param_fqns
from partc.passes.helpers import verify
from partc.passes.split import parameter_holders, split
from tests.passes.tiny_graphs import (HALVES_LAYERS, Halves, hand_built, tiny_graph,
                                      tokens, with_loss)

THREE_STAGES = [["embed"], ["block"], ["head"]]


def lines(module: torch.fx.GraphModule) -> list[str]:
    """The printed forward, one stripped statement per line, without fx's ``x = None``s."""
    return [line.split(";")[0].strip() for line in module.code.strip().splitlines()]


def test_a_skip_is_sent_by_its_stage_and_forwarded_stage_by_stage():
    _, gm = tiny_graph()
    first, middle, last = split(gm, THREE_STAGES)
    assert (first.receives, first.sends) == (("tokens",), ("embedding",))
    # The head reads the embedding too: the block's stage receives it and sends it on.
    assert (middle.receives, middle.sends) == (("embedding",), ("embedding", "relu"))
    assert (last.receives, last.sends) == (("embedding", "relu"), ("linear_1",))
    assert lines(middle.module) == [
        "def forward(self, embedding):",
        "block_weight = self.block.weight",
        "block_bias = self.block.bias",
        "linear = torch._C._nn.linear(embedding, block_weight, block_bias)",
        "relu = torch.relu(linear)",
        "return (embedding, relu)",
    ]
    # Gradients go back for every float activation sent; the token ids take none.
    assert [(s.grad_receives, s.grad_sends) for s in (first, middle, last)] == [
        (0, 1), (1, 2), (2, 0)]
    assert [s.layers for s in (first, middle, last)] == [("embed",), ("block",), ("head",)]
    assert [(s.is_first, s.is_last) for s in (first, middle, last)] == [
        (True, False), (False, False), (False, True)]


def test_a_size_read_across_a_cut_is_folded_to_the_traced_value():
    _, gm = tiny_graph()
    *_, last = split(gm, THREE_STAGES)
    assert "size" not in last.receives
    assert "view = add.view(-1, 8)" in lines(last.module)
    assert "size" not in [node.name for node in last.module.graph.nodes]


def test_a_value_holding_tensors_across_a_cut_is_refused():
    x = torch.randn(2, 4)
    gm = hand_built(Halves(), (x,), HALVES_LAYERS)
    with pytest.raises(PlanMismatchError, match=r"chunk .* crosses a stage boundary but "
                                                r"is a tuple, not a tensor"):
        split(gm, [["halve"], ["multiply"]])
    # In one stage nothing crosses.
    (stage,) = split(gm, [["halve", "multiply"]])
    torch.testing.assert_close(stage.module(x)[0], x[:, :2] * x[:, 2:])


def test_parameters_keep_their_fqns_and_a_tied_one_is_on_both_stages():
    model, gm = tiny_graph()
    stages = split(gm, THREE_STAGES)
    assert [[name for name, _ in s.module.named_parameters()] for s in stages] == [
        ["embed.weight"], ["block.weight", "block.bias"], ["embed.weight"]]
    # The stages hold the model's own tensors, not copies.
    assert stages[0].module.get_parameter("embed.weight") is model.embed.weight
    assert stages[2].module.get_parameter("embed.weight") is model.head.weight
    assert "embed_weight = self.embed.weight" in lines(stages[2].module)
    assert parameter_holders(stages, param_fqns(model)) == {
        ("block.bias",): (1,),
        ("block.weight",): (1,),
        ("embed.weight", "head.weight"): (0, 2),
    }


def test_stage_nodes_keep_their_meta_and_pass_the_checks():
    _, gm = tiny_graph()
    code = gm.code
    layer = {node.name: meta.layer(node) for node in gm.graph.nodes}
    values = {node.name: meta.tensors(node) for node in gm.graph.nodes}
    for stage in split(gm, THREE_STAGES):
        verify.check("split", stage.module)
        assert meta.layers(stage.module) == meta.layers(gm)
        for node in stage.module.graph.nodes:
            if node.op != "output":
                assert meta.layer(node) == layer[node.name]
                assert meta.tensors(node) == values[node.name]
    assert gm.code == code  # split cuts copies: the whole graph is unchanged


@pytest.mark.parametrize("stages", [THREE_STAGES, [["embed", "block"], ["head"]],
                                    [["embed"], ["block", "head"]]],
                         ids=["3", "2+1", "1+2"])
def test_the_stages_compose_to_the_whole_graph(stages):
    model, gm = tiny_graph()
    x = tokens(1)
    expected = gm(x)
    expected.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    values: tuple = (x,)
    for stage in split(gm, stages):
        values = stage.module(*values)
    (got,) = values
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    got.square().sum().backward()
    for name, p in model.named_parameters():  # the tied weight sums both stages' grads
        torch.testing.assert_close(p.grad, grads[name])


def test_the_loss_is_on_no_stage_the_last_returns_its_inputs():
    model, gm = tiny_graph()
    target = torch.randint(0, 16, (6,))
    gm = with_loss(model, gm, (tokens(),), target)
    first, last = split(gm, [["embed", "block"], ["head", "loss"]])
    assert "target" not in first.receives + last.receives
    assert last.sends == ("linear_1",)
    assert not any(node.op == "call_module" for node in last.module.graph.nodes)
    (logits,) = last.module(*first.module(tokens()))
    torch.testing.assert_close(gm.loss(logits, target), gm(tokens(), target))


@pytest.mark.parametrize("stages, message", [
    ([["embed"], ["block", "tail"]],
     r"3 traced, 3 planned; planned but not traced: \['tail'\]; "
     r"traced but not planned: \['head'\]"),
    ([["embed"], ["block"]],
     r"3 traced, 2 planned; planned but not traced: none; "
     r"traced but not planned: \['head'\]"),
    ([["block"], ["embed", "head"]], r"the model's layers differ from the plan's"),
    ([["embed", "block", "head"], []], r"a stage without layers"),
], ids=["renamed", "missing", "reordered", "empty-stage"])
def test_a_plan_for_other_layers_is_refused(stages, message):
    _, gm = tiny_graph()
    with pytest.raises(PlanMismatchError, match=message):
        split(gm, stages)


class Tables(torch.nn.Module):
    """Makes a cosine and a sine table in the order ``order`` names them (as code that
    iterates a set of strings does, in an order each process's string hashing decides);
    the second stage reads both."""

    def __init__(self, order: tuple[str, ...]) -> None:
        super().__init__()
        self.stem, self.a = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.b, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tables = {}
        h = self.stem(x)
        for name in self.order:
            tables[name] = torch.cos(x) if name == "cos" else torch.sin(x)
        h = self.a(h) * tables["cos"]
        return self.head(self.b(h) * tables["sin"] + tables["cos"])


def test_values_are_sent_in_an_order_every_trace_agrees_on():
    """Two ranks that trace the model in different orders send and receive the same
    values at the same positions: in the order of what they compute, not of the trace."""
    from partc.passes import analyze

    sent = []
    for order in (("cos", "sin"), ("sin", "cos")):
        gm, _ = analyze(Tables(order), (torch.randn(2, 8),))
        first, second = split(gm, [["stem", "a"], ["b", "head"]])
        assert first.sends == second.receives
        nodes = {node.name: node for node in gm.graph.nodes}
        sent.append([getattr(nodes[name].target, "__name__", str(nodes[name].target))
                     for name in first.sends])
    assert sorted(sent[0]) == ["cos", "mul", "sin"]
    assert sent[0] == sent[1]  # in graph order: ["cos", "sin", "mul"], ["sin", "cos", "mul"]


def _call(sub: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return sub(x)


def _nested(first: str, second: str) -> tuple[torch.fx.GraphModule, list[torch.fx.Node]]:
    """A graph calling two nested graphs named ``submod_1`` and ``submod_3`` (as export
    names grad-mode regions, in trace order) that compute ``first`` and ``second``."""
    root = torch.nn.Module()
    for name, op in (("submod_1", first), ("submod_3", second)):
        setattr(root, name, torch.fx.symbolic_trace(_Unary(op)))
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    calls = [graph.call_function(_call, (graph.get_attr(name), x))
             for name in ("submod_1", "submod_3")]
    graph.output(tuple(calls))
    return torch.fx.GraphModule(root, graph), calls


class _Unary(torch.nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cos(x) if self.op == "cos" else torch.sin(x)


def test_nested_graphs_are_told_apart_by_what_they_compute_not_their_names():
    from partc.passes.helpers.graph import expression_keys

    gm, (cos, sin) = _nested("cos", "sin")
    swapped, (sin_too, cos_too) = _nested("sin", "cos")
    keys = expression_keys(gm, list(gm.graph.nodes))
    other = expression_keys(swapped, list(swapped.graph.nodes))
    assert keys[cos] == other[cos_too] and keys[sin] == other[sin_too]
    assert keys[cos] != keys[sin]
