"""Tiny hand-built graphs for the unit tests of split, recompute and the pass runner.

:func:`tiny_graph` traces :class:`Tiny` with torch.fx and writes by hand what ``trace``,
``propagate`` and ``layers`` would: parameter FQNs, three layers, fake values. Its code::

    def forward(self, tokens):
        embed_weight = self.embed.weight                     # layer embed
        embedding = torch.nn.functional.embedding(tokens, embed_weight, ...)
        size = embedding.size(-1)
        block_weight = self.block.weight                     # layer block
        block_bias = self.block.bias
        linear = torch._C._nn.linear(embedding, block_weight, block_bias)
        relu = torch.relu(linear)
        add = relu + embedding                               # layer head
        view = add.view(-1, size)
        linear_1 = torch._C._nn.linear(view, embed_weight, None)
        return linear_1

so cut after every layer, ``embedding`` jumps the block's stage, ``size`` is an int read
two stages later, and ``embed.weight`` (tied to ``head.weight``) is read on the first
stage and on the last.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from partc import meta
from partc.identity import param_fqns
from partc.passes.context import Context, Lowering
from partc.passes.propagate import propagate

# The layers of the tiny graph, each the names of its nodes in graph order.
TINY_LAYERS: dict[str, tuple[str, ...]] = {
    "embed": ("embed_weight", "embedding", "size"),
    "block": ("block_weight", "block_bias", "linear", "relu"),
    "head": ("add", "view", "linear_1"),
}


class Tiny(nn.Module):
    """Embedding, linear + relu, a skip from the embedding to the head, a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        width = h.size(-1)
        y = torch.relu(self.block(h))
        return self.head((y + h).view(-1, width))


class Halves(nn.Module):
    """A tuple of tensors (``chunk``) made in one layer and unpacked in the next."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = x.chunk(2, -1)
        return parts[0] * parts[1]


HALVES_LAYERS: dict[str, tuple[str, ...]] = {
    "halve": ("chunk",),
    "multiply": ("getitem", "getitem_1", "mul"),
}


class _Functional(fx.Tracer):
    # As partc's trace: through every module, so parameters are get_attr nodes.
    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return False


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 16, (2, 3), generator=torch.Generator().manual_seed(seed))


def tiny_graph(seed: int = 0) -> tuple[Tiny, fx.GraphModule]:
    """A fresh :class:`Tiny` (weights from ``seed``) and its graph, layers and values set."""
    torch.manual_seed(seed)
    model = Tiny()
    return model, hand_built(model, (tokens(),), TINY_LAYERS)


def hand_built(model: nn.Module, inputs: tuple, layers: Mapping[str, Sequence[str]]
               ) -> fx.GraphModule:
    """``model`` traced, its nodes grouped into ``layers`` and given fake values."""
    gm = fx.GraphModule(model, _Functional().trace(model), class_name=type(model).__name__)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            meta.set_params(node, (str(node.target),))
    set_layers(gm, layers)
    return propagate(gm, context(model, inputs))


def set_layers(gm: fx.GraphModule, layers: Mapping[str, Sequence[str]]) -> None:
    """What ``layers`` writes: LAYER on every node (inputs on the first layer, the output
    on the last) and the LAYERS list. Every other node must be named in ``layers``."""
    nodes = {node.name: node for node in gm.graph.nodes}
    named = [name for names in layers.values() for name in names]
    inner = [n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert named == inner, f"the layers name {named}, the graph holds {inner}"
    infos = []
    for index, (name, names) in enumerate(layers.items()):
        ref = meta.LayerRef(index, name)
        for node_name in names:
            meta.set_layer(nodes[node_name], ref)
        infos.append(meta.LayerInfo(index=index, name=name, key=name, signature=name,
                                    nodes=tuple(names), is_loss=name == "loss"))
    first, last = infos[0], infos[-1]
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            home = last if meta.role(node) == meta.ROLE_TARGET else first
            meta.set_layer(node, meta.LayerRef(home.index, home.name))
        elif node.op == "output":
            meta.set_layer(node, meta.LayerRef(last.index, last.name))
    meta.set_layers(gm, tuple(infos))


def with_loss(model: nn.Module, gm: fx.GraphModule, inputs: tuple, target: torch.Tensor
              ) -> fx.GraphModule:
    """``gm`` with a cross-entropy loss appended as ``trace`` appends one: a ``target``
    placeholder and one ``loss`` call, in a layer of its own."""
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    logits = output.args[0]
    last_input = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last_input):
        target_node = graph.placeholder("target")
    meta.set_role(target_node, meta.ROLE_TARGET)
    gm.add_submodule("loss", nn.CrossEntropyLoss())
    with graph.inserting_before(output):
        loss = graph.call_module("loss", (logits, target_node))
    meta.set_role(loss, meta.ROLE_LOSS)
    output.args = (loss,)
    gm.recompile()
    layers = {info.name: info.nodes for info in meta.layers(gm)} | {"loss": ("loss",)}
    set_layers(gm, layers)
    for node in graph.nodes:  # the values again: the target's and the loss's are new
        node.meta.pop("val", None)
    return propagate(gm, context(model, inputs, target=target))


def context(model: nn.Module, inputs: tuple, *, target: torch.Tensor | None = None,
            lowering: Lowering | None = None) -> Context:
    """The Context ``trace`` would return for ``model`` on ``inputs``, with ``lowering``."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_target = None if target is None else fake_mode.from_tensor(target)
    return Context(model=model, name=type(model).__name__, fake_mode=fake_mode,
                   fake_inputs=tuple(fake_mode.from_tensor(t) for t in inputs),
                   fake_target=fake_target, batch_size=int(inputs[0].shape[0]),
                   param_fqns=param_fqns(model), lowering=lowering)
