"""Wrap what the plan recomputes in checkpointed calls: a fully recomputed layer, or the
attention cores of a selectively recomputed one.

The region's nodes move into a small GraphModule of their own, registered on the stage
as ``recompute_<layer>`` (``recompute_<layer>_attention`` for a core,
:func:`partc.passes.helpers.attention_core.attention_cores`); its inputs are everything the
region reads from outside — activations, sizes and the parameters themselves — so it
holds no parameters and the stage's parameter FQNs do not change. In the stage's code
the layer reads::

    recompute_blocks_3 = self.recompute_blocks_3
    checkpoint_layer = partc.runtime.recompute.checkpoint_layer(recompute_blocks_3, 'full', ...)
    getitem_7 = checkpoint_layer[0]

A selectively recomputed layer without an attention core runs as without recompute
(the planner offers it no selective mode; a pin of one behaves as ``"none"``).

A layer the plan offloads (mode ``"offload"``) is wrapped the same way, as
``offload_<layer>``, and called through
:func:`partc.runtime.activation_offload.offload_layer` with the stage's ledger of
offloaded tensors, one ``activation_offload`` module per stage::

    offload_blocks_3 = self.offload_blocks_3
    activation_offload = self.activation_offload
    offload_layer = partc.runtime.activation_offload.offload_layer(activation_offload, offload_blocks_3, ...)
"""

from __future__ import annotations

import operator
import re
from typing import Mapping

from torch import fx

from partc import meta
from partc.passes.context import Context
from partc.passes.helpers.attention_core import attention_cores
from partc.passes.helpers.graph import mutated_inputs
from partc.runtime.activation_offload import OFFLOADED_MODE, ActivationOffload, offload_layer
from partc.runtime.recompute import RECOMPUTED_MODES, checkpoint_layer

LEDGER = "activation_offload"   # the stage's ActivationOffload submodule


def recompute(module: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Rewrite ``module`` (a stage) so that what the plan recomputes
    (``ctx.lowering.recompute``) is rerun in backward: each ``"full"`` layer whole, each
    ``"selective"`` layer's attention cores.

    Reads: ``meta.LAYER`` on nodes. Writes: a ``recompute_<layer>`` (or
    ``recompute_<layer>_attention``) submodule per region; ``meta.LAYER`` on the nodes
    that call it, and the values (``val``, ``meta.TENSORS``) of the region's outputs on
    the nodes that now stand for them; with an ``"offload"`` layer, an
    ``activation_offload`` submodule and an ``offload_<layer>`` one per such layer.
    Requires: ``split`` (one stage's graph; a layer's nodes are consecutive).
    Ensures: the stage computes the same values; its parameters are unchanged.
    """
    modes = ctx.lowering.recompute if ctx.lowering is not None else {}
    return recompute_layers(module, modes)


def recompute_layers(module: fx.GraphModule, modes: Mapping[str, str]) -> fx.GraphModule:
    """:func:`recompute` with the modes given: ``modes`` maps a layer to its mode."""
    graph = module.graph
    for layer_name, mode in modes.items():
        if mode == "none":
            continue
        if mode not in RECOMPUTED_MODES and mode != OFFLOADED_MODE:
            raise ValueError(f"layer {layer_name}: unknown recompute mode {mode!r}")
        region = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")
                  and meta.LAYER in n.meta and meta.layer(n).name == layer_name]
        if mode == OFFLOADED_MODE and region:
            if not hasattr(module, LEDGER):
                module.add_submodule(LEDGER, ActivationOffload())
            _wrap(module, region, layer_name, mode)
        elif mode == "full" and region:
            _wrap(module, region, layer_name, mode)
        elif mode == "selective":
            cores = attention_cores(region)
            for index, core in enumerate(cores):
                suffix = "_attention" + (str(index) if len(cores) > 1 else "")
                _wrap(module, list(core), layer_name + suffix, mode)
    graph.lint()
    module.recompile()
    return module


def _wrap(module: fx.GraphModule, region: list[fx.Node], name: str, mode: str) -> None:
    members = set(region)
    inputs: list[fx.Node] = []
    for node in region:
        for arg in node.all_input_nodes:
            if arg not in members and arg not in inputs:
                inputs.append(arg)
    outputs = [n for n in region if any(user not in members for user in n.users)]
    # Buffers the layer updates in place (BatchNorm's running statistics): written once
    # per microbatch, by the forward, as in eager PyTorch (checkpoint_layer's docstring).
    written = tuple(i for i, arg in enumerate(inputs)
                    if any(arg in mutated_inputs(node) for node in region))

    sub = fx.Graph()
    env = {arg: sub.placeholder(arg.name) for arg in inputs}
    for node in region:
        env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(tuple(env[n] for n in outputs))
    prefix = "offload_" if mode == OFFLOADED_MODE else "recompute_"
    name = prefix + re.sub(r"\W", "_", name)
    module.add_submodule(name, fx.GraphModule(module, sub, class_name=name))

    graph = module.graph
    ref = meta.layer(region[0])
    # After the region's last node: every input (parameters are fetched inside the
    # region's span) is defined by then, and every outside user comes later.
    with graph.inserting_before(region[-1].next):
        fetch = graph.get_attr(name)
        fetched = [fetch]
        if mode == OFFLOADED_MODE:
            # Buffers written in place (``written``) are updated once: the forward
            # runs once, and what it saves is only moved.
            fetched.append(graph.get_attr(LEDGER))
            held = tuple(i for i, arg in enumerate(inputs) if arg.op == "get_attr")
            call = graph.call_function(offload_layer, (fetched[1], fetch, *inputs),
                                       {"held": held} if held else {})
        else:
            options = {"written": written} if written else {}
            # The mode as a plain string (a Recompute member is one): the code prints a
            # literal.
            call = graph.call_function(checkpoint_layer, (fetch, str(mode), *inputs),
                                       options)
        results = [graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for node in (*fetched, call, *results):
        meta.set_layer(node, ref)
    for node, result in zip(outputs, results):
        result.meta["val"] = node.meta.get("val")
        meta.set_tensors(result, meta.tensors(node))
    for node, result in zip(outputs, results):
        node.replace_all_uses_with(result, delete_user_cb=lambda user: user not in members)
    for node in reversed(region):
        graph.erase_node(node)
