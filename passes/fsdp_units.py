"""Give each layer its own module, holding its own parameters, for ZeRO-2/3 (FSDP2), and
for ZeRO-1 whose parameter all-gather overlaps the next forward (each layer's forward
pre-hook waits for its buckets: ``partc.runtime.optimizer.wait_in_forward``).

FSDP2 gathers and frees parameters around a module's ``forward`` and reduce-scatters
their gradients when that module's backward is done. A stage graph reads every
parameter with ``get_attr`` from the stage's root, so the only unit FSDP could see is the
whole stage. This pass moves each layer's nodes into a GraphModule that replaces the
submodule at the layer's own path (``blocks.3``): the layer becomes one ``call_module``,
its parameters keep their FQNs (``blocks.3.attn.c_attn.weight``), and
``fully_shard(stage.get_submodule("blocks.3"))`` makes it a unit that is gathered just
before the layer runs and freed after it.

A layer becomes a unit only if its name is a submodule path that no other layer reads
from and whose parameters and buffers the layer reads all of; otherwise (a tied weight
used by two layers, a layer with no module of its own) its parameters stay with the
stage's root unit, gathered for the whole stage. In the stage's code a unit reads::

    blocks_3 = getattr(self.blocks, "3")(getitem_7)
    getitem_8 = blocks_3[0]
"""

from __future__ import annotations

import operator
from typing import Any

from torch import fx, nn

from partc import meta
from partc.passes.context import Context


def fsdp_units(module: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Rewrite ``module`` (a stage, after ``recompute``) so that every layer that can be
    is one ``call_module`` of a submodule holding its parameters.

    Reads: ``meta.LAYER`` on nodes. Writes: the layer's submodule (now a GraphModule
    with the layer's nodes), a ``call_module`` node and one ``getitem`` per output;
    ``meta.FSDP_UNITS`` on the stage: the paths of those submodules, in order.
    Requires: ``split`` (a layer's nodes are consecutive in the stage).
    Ensures: the stage computes the same values; parameter FQNs are unchanged.
    """
    meta.set_fsdp_units(module, tuple(units(module)))
    return module


def units(module: fx.GraphModule) -> list[str]:
    """:func:`fsdp_units`'s rewrite; returns the paths of the units it made."""
    regions: dict[str, list[fx.Node]] = {}
    for node in module.graph.nodes:
        if node.op not in ("placeholder", "output") and meta.LAYER in node.meta:
            regions.setdefault(meta.layer(node).name, []).append(node)
    made = []
    for name, region in regions.items():
        owner = _submodule(module, name)
        if owner is None or isinstance(owner, fx.GraphModule):
            continue
        moved = _movable(module, name, owner, region)
        if moved is not None:
            _wrap(module, name, region, moved)
            made.append(name)
    module.graph.lint()
    module.recompile()
    return made


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _movable(module: fx.GraphModule, name: str, owner: nn.Module,
             region: list[fx.Node]) -> dict[fx.Node, str] | None:
    """The region's ``get_attr`` nodes that move into the unit, with their new targets;
    None if the layer cannot be a unit."""
    prefix = name + "."
    members = set(region)
    # The layer's tensors, and its submodules called as modules (the experts under
    # expert parallelism, which hold their weights).
    inside = {n for n in module.graph.nodes
              if n.op in ("get_attr", "call_module") and n.target.startswith(prefix)}
    if not inside or not inside <= members:
        return None  # another layer reads this module's tensors
    if any(user not in members for node in inside for user in node.users):
        return None
    read = {id(t) for n in inside for t in _tensors(_attr(module, n.target))}
    own = [t for t in (*owner.parameters(), *owner.buffers())]
    if not own or any(id(t) not in read for t in own):
        return None  # the unit would lose tensors the layer does not read
    moved = {n: n.target[len(prefix):] for n in inside}
    for node in region:  # submodules the layer calls (recompute): they move too
        if node.op == "get_attr" and node not in moved and isinstance(
                _attr(module, node.target), nn.Module) and set(node.users) <= members:
            moved[node] = node.target.replace(".", "_")
    return moved


def _tensors(value: Any) -> list[Any]:
    if isinstance(value, nn.Module):
        return [*value.parameters(), *value.buffers()]
    return [value]


def _attr(module: nn.Module, target: str) -> Any:
    owner, _, field = target.rpartition(".")
    return getattr(module.get_submodule(owner), field)


def _wrap(module: fx.GraphModule, name: str, region: list[fx.Node],
          moved: dict[fx.Node, str]) -> None:
    members = set(region)
    body = [n for n in region if n.op != "get_attr" or n in moved]
    inputs: list[fx.Node] = []
    for node in body:
        for arg in node.all_input_nodes:
            if arg not in members or (arg.op == "get_attr" and arg not in moved):
                if arg not in inputs:
                    inputs.append(arg)
    outputs = [n for n in body if any(user not in members for user in n.users)]

    sub = fx.Graph()
    env = {arg: sub.placeholder(arg.name) for arg in inputs}
    for node in body:
        copy = sub.node_copy(node, env.__getitem__)
        if node in moved:
            copy.target = moved[node]
        env[node] = copy
    sub.output(tuple(env[n] for n in outputs))
    tensors = {moved[n]: _attr(module, n.target) for n in moved}
    unit = fx.GraphModule(tensors, sub, class_name=name.replace(".", "_"))

    parent_path, _, field = name.rpartition(".")
    parent = module.get_submodule(parent_path)
    parent._modules[field] = unit

    graph = module.graph
    ref = meta.layer(body[0])
    with graph.inserting_before(region[-1].next):
        call = graph.call_module(name, tuple(inputs))
        results = [graph.call_function(operator.getitem, (call, i))
                   for i in range(len(outputs))]
    for node in (call, *results):
        meta.set_layer(node, ref)
    for node, result in zip(outputs, results):
        result.meta["val"] = node.meta.get("val")
        meta.set_tensors(result, meta.tensors(node))
        node.replace_all_uses_with(result, delete_user_cb=lambda user: user not in members)
    for node in reversed(body):
        graph.erase_node(node)
    fetched = {n.target for n in graph.nodes if n.op == "get_attr"}
    for node in moved:
        if "." not in node.target and node.target not in fetched and isinstance(
                getattr(module, node.target), nn.Module):
            # A recompute submodule now lives in the unit (the tensor-parallel group,
            # which other layers read too, stays).
            delattr(module, node.target)
