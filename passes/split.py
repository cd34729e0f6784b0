"""Cut the traced graph into one GraphModule per pipeline stage, as the plan says.

A value made on stage ``p`` and last used on stage ``c > p`` crosses every boundary in
between: each stage from ``p`` to ``c - 1`` returns it and the next one receives it, so
a skip connection that jumps stages is passed along, stage by stage, as the pipeline
runtime (``torch.distributed.pipelining``) requires. Model inputs enter on stage 0.

The loss is not part of any stage: the last stage returns the loss's inputs and the
runtime calls the loss on them with the target (see ``partc.runtime``).

Values that are not tensors (sizes read off a tensor in symbolically traced code) cannot
be sent; the consumer stage gets the value the graph was traced with, which is right
because the runtime refuses batches whose shapes differ from the plan's.

Every rank traces the model itself, and two processes need not trace it in the same
order: Python code that iterates a set of strings runs in an order that string hashing,
seeded per process, decides (Gemma-3 computes one rotary table per ``set(layer_types)``).
Node names follow trace order, so the values crossing a cut are sent in the order of
what they compute (:func:`~partc.passes.helpers.graph.expression_keys`: ops,
constants, parameter FQNs and model inputs, recursively), which every rank agrees on,
and graph order only among equal expressions. Sent in graph order, one rank's
sliding-window table arrived where the other expected the global one. (The plan cache's
key meets the same order: :func:`partc.passes.layers.canonical_signature`.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import fx

from partc import meta
from partc.errors import PlanMismatchError
from partc.passes.helpers.graph import carries_grad, expression_keys, has_side_effects


@dataclass(frozen=True)
class StageGraph:
    """One stage: its module and what it receives, sends and holds.

    ``module(*received)`` returns a tuple: the values sent to the next stage (in the
    order of ``sends``), or, on the last stage, the model's outputs for the loss.
    """

    index: int
    num_stages: int
    module: fx.GraphModule
    layers: tuple[str, ...]
    receives: tuple[str, ...]
    sends: tuple[str, ...]
    grad_receives: int  # received tensors whose gradients go back
    grad_sends: int  # sent tensors whose gradients come back

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def split(gm: fx.GraphModule, stages: Sequence[Sequence[str]]) -> list[StageGraph]:
    """One :class:`StageGraph` per entry of ``stages`` (layer names, in order).

    Reads: ``meta.LAYERS``, ``meta.LAYER``, ``meta.ROLE``, ``node.meta["val"]``.
    Writes: nothing on ``gm``; stage graphs keep each copied node's meta.
    Requires: ``layers`` (and ``propagate``: values are needed to fold non-tensors).
    Ensures: every node of ``gm`` but the loss, the target, the placeholders and the
    output is on exactly one stage; parameters keep their FQNs (a parameter used by two
    stages is on both); stage ``k`` sends exactly what stage ``k + 1`` receives.
    """
    infos = meta.layers(gm)
    _check_layers(infos, stages)
    stage_of_layer = {name: s for s, names in enumerate(stages) for name in names}
    last = len(stages) - 1
    layer_stage = {info.index: stage_of_layer[info.name] for info in infos}
    nodes = list(gm.graph.nodes)
    loss = next((n for n in nodes if meta.role(n) == meta.ROLE_LOSS), None)
    output = nodes[-1]
    final_values = _final_values(loss, output)

    def stage_of(node: fx.Node) -> int:
        if node.op == "placeholder":
            return last if meta.role(node) == meta.ROLE_TARGET else 0
        if node is loss or node is output:
            return last
        return layer_stage[meta.layer(node).index]

    crossing: list[list[fx.Node]] = [[] for _ in range(last)]
    for node in nodes:
        if node.op in ("get_attr", "output") or node is loss or not node.users:
            continue
        if meta.role(node) == meta.ROLE_TARGET:
            continue
        made, used = stage_of(node), max(stage_of(user) for user in node.users)
        if used > made and _is_tensor(node):
            for boundary in range(made, used):
                crossing[boundary].append(node)
        elif used > made:
            _check_constant(node)
    keys = expression_keys(gm, nodes)
    position = {node: i for i, node in enumerate(nodes)}
    for values in crossing:
        values.sort(key=lambda node: (keys[node], position[node]))
    grads = carries_grad(gm)
    result = []
    for index in range(len(stages)):
        receives = _model_inputs(nodes) if index == 0 else crossing[index - 1]
        sends = final_values if index == last else crossing[index]
        module = _build(gm, nodes, index, stage_of, receives, sends)
        result.append(StageGraph(
            index=index, num_stages=len(stages), module=module,
            layers=tuple(stages[index]), receives=tuple(n.name for n in receives),
            sends=tuple(n.name for n in sends),
            grad_receives=0 if index == 0 else sum(n in grads for n in receives),
            grad_sends=0 if index == last else sum(n in grads for n in sends)))
    return result


def _check_layers(infos: Sequence[meta.LayerInfo], stages: Sequence[Sequence[str]]) -> None:
    traced = [info.name for info in infos]
    planned = [name for names in stages for name in names]
    if traced != planned:
        missing = [n for n in planned if n not in traced][:3]
        extra = [n for n in traced if n not in planned][:3]
        position = next(i for i, (a, b) in enumerate(zip(traced + [None], planned + [None]))
                        if a != b)
        raise PlanMismatchError(
            "the model's layers differ from the plan's "
            f"({len(traced)} traced, {len(planned)} planned; planned but not traced: "
            f"{missing or 'none'}; traced but not planned: {extra or 'none'}; first "
            f"difference at layer {position}: traced {traced[position:position + 1] or 'none'}"
            f", planned {planned[position:position + 1] or 'none'}): "
            "the plan was made for another model or another version of it")
    if any(not names for names in stages):
        raise PlanMismatchError("the plan has a stage without layers")


def _final_values(loss: fx.Node | None, output: fx.Node) -> list[fx.Node]:
    """What the last stage returns: the loss's inputs (without the target) or the output."""
    if loss is not None:
        return [a for a in loss.args if meta.role(a) != meta.ROLE_TARGET]
    values = output.args[0]
    return list(values) if isinstance(values, (tuple, list)) else [values]


def _model_inputs(nodes: list[fx.Node]) -> list[fx.Node]:
    return [n for n in nodes if n.op == "placeholder" and meta.role(n) != meta.ROLE_TARGET]


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _check_constant(node: fx.Node) -> None:
    value = node.meta.get("val")
    leaves = torch.utils._pytree.tree_leaves(value)
    if any(isinstance(leaf, torch.Tensor) for leaf in leaves) or any(
            isinstance(leaf, (torch.SymInt, torch.SymFloat)) for leaf in leaves):
        raise PlanMismatchError(
            f"{node.name} ({node.format_node()}) crosses a stage boundary but is a "
            f"{type(value).__name__}, not a tensor: only tensors can be sent between "
            "stages; keep the values that hold tensors inside one layer")


def _build(gm: fx.GraphModule, nodes: list[fx.Node], index: int, stage_of: Any,
           receives: list[fx.Node], sends: list[fx.Node]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in receives:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)

    def lookup(arg: fx.Node) -> Any:
        if arg in env:
            return env[arg]
        if arg.op == "get_attr":
            env[arg] = graph.node_copy(arg)
            return env[arg]
        if stage_of(arg) < index and not _is_tensor(arg):
            return arg.meta["val"]  # a size or flag, fixed by the plan's shapes
        raise AssertionError(f"stage {index} needs {arg.name}, which it neither makes "
                             "nor receives")

    for node in nodes:
        if node.op in ("placeholder", "output", "get_attr") or stage_of(node) != index:
            continue
        if meta.role(node) == meta.ROLE_LOSS:
            continue
        env[node] = graph.node_copy(node, lookup)
    graph.output(tuple(lookup(node) for node in sends))
    # fx's own notion of impure misses a symbolic trace's in-place methods (``y.mul_``):
    # deleting one whose result nobody reads would silently change the model.
    graph.eliminate_dead_code(is_impure_node=has_side_effects)
    graph.lint()
    module = fx.GraphModule(gm, graph, class_name=f"Stage{index}")
    module.meta.update({key: gm.meta[key] for key in (meta.TRACE, meta.LAYERS)
                        if key in gm.meta})
    return module


def parameter_holders(stages: Sequence[StageGraph], param_fqns: dict[int, tuple[str, ...]]
                      ) -> dict[tuple[str, ...], tuple[int, ...]]:
    """For each parameter (all its FQNs, ``Context.param_fqns``'s values), the stages that
    hold it, in stage order: more than one for a weight tied across stages."""
    aliases = {name: names for names in param_fqns.values() for name in names}
    holders: dict[tuple[str, ...], list[int]] = {}
    for stage in stages:
        for name, _ in stage.module.named_parameters():
            key = aliases.get(name, (name,))
            if stage.index not in holders.setdefault(key, []):
                holders[key].append(stage.index)
    return {key: tuple(indices) for key, indices in sorted(holders.items())}
