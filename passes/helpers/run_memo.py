"""A layer's run, kept for another graph that runs the same layer on the same values.

The tensor-parallel variants (``passes.pipeline.tensor_parallel_options``) measure a
rewritten copy of one graph each; a layer the sharding leaves alone (a rotary table, a
final norm outside sequence parallelism, a replicated loss) is the same run in every
variant. :func:`run_key` describes everything :func:`partc.passes.helpers.layer_run.run_layer`
reads of a layer — its nodes in order (op, callable, wiring, literal arguments, role,
traced tensors), the values it reads from outside (their fake values' shapes, strides and
dtypes, the dtypes they were made in, whether they carry a gradient), its parameters'
shapes, strides, dtypes and kinds, the modules it calls, and the setting's precision and
devices — and a run kept (:func:`kept_run`, each node replaced by its place) is given to
the nodes of another layer of the same key (:func:`given_run`): the same
:class:`LayerRun` a run of that layer gives.

A layer that reads a submodule other than through a module call (the tensor-parallel
group, an exported subgraph) has no key: it is measured each time. So has a layer with an
argument this cannot describe by value (an object other than numbers, strings, dtypes,
devices and containers of them).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from partc import meta
from partc.passes.helpers.graph import fetch, outside_inputs
from partc.passes.helpers.layer_run import LayerRun, Setting

# Literal arguments compared by value (what an fx node's args hold besides nodes).
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format, type(Ellipsis))


class _NoKey(Exception):
    """Something in the layer that its key cannot describe by value."""


def run_key(gm: fx.GraphModule, nodes: list[fx.Node], setting: Setting) -> tuple | None:
    """All a run of ``nodes`` reads, as a hashable value; None where something cannot be
    described so (the layer is then measured each time)."""
    described = layer_form(gm, nodes)
    try:
        read = tuple(_outside(gm, node, setting) for node in outside_inputs(nodes))
    except _NoKey:
        return None
    if described is None:
        return None
    return (setting.autocast, setting.device, setting.runtime_device, described, read)


def layer_form(gm: fx.GraphModule, nodes: list[fx.Node], propagating: bool = False
               ) -> tuple | None:
    """What ``nodes`` run, in order, as a hashable value: each node's op, callable, wiring
    (a node of the layer by its place, a value from outside by its order of first use),
    literal arguments, role and traced tensors, its parameters' shapes, strides, dtypes
    and kinds, the modules it calls; None where something cannot be described by value.
    ``propagating``: for comparing layers of one graph while ``propagate`` makes their
    values: a submodule read other than through a call (the tensor-parallel group) is
    described as that very object, and the traced tensors, which it is remaking, not
    at all."""
    members = {node: index for index, node in enumerate(nodes)}
    outside = {node: index for index, node in enumerate(outside_inputs(nodes))}

    def argument(value: Any) -> Any:
        if isinstance(value, fx.Node):
            return ("node", members[value]) if value in members else ("outside", outside[value])
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(argument(v) for v in value))
        if isinstance(value, dict):
            return ("dict", tuple((k, argument(v)) for k, v in value.items()))
        if isinstance(value, slice):
            return ("slice", argument(value.start), argument(value.stop), argument(value.step))
        if type(value) in _PLAIN:
            return (type(value).__name__, repr(value))
        raise _NoKey(type(value).__name__)

    try:
        return tuple(_node(gm, node, argument, propagating) for node in nodes)
    except _NoKey:
        return None


def _node(gm: fx.GraphModule, node: fx.Node, argument: Any, propagating: bool) -> tuple:
    if node.op == "get_attr":
        target: Any = _attribute(gm, node, propagating)
    elif node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        target = (module, _state(module))
    elif node.op == "call_function":
        target = node.target
    else:
        target = str(node.target)
    traced = meta.tensors(node) if meta.TENSORS in node.meta and not propagating else None
    return (node.op, target, argument(node.args), argument(node.kwargs), meta.role(node),
            traced)


def _attribute(gm: fx.GraphModule, node: fx.Node, same_module: bool = False) -> tuple:
    value = fetch(gm, str(node.target))
    if same_module and isinstance(value, nn.Module):
        return ("module", value)
    if not isinstance(value, torch.Tensor):
        raise _NoKey(type(value).__name__)   # a group or a subgraph: measured each time
    return _tensor(value) + (isinstance(value, nn.Parameter), value.requires_grad)


def _tensor(value: torch.Tensor) -> tuple:
    return (tuple(value.shape), value.stride(), value.dtype, str(value.device),
            value.storage_offset())


def _state(module: nn.Module) -> tuple:
    return tuple((name, _tensor(t), isinstance(t, nn.Parameter), t.requires_grad)
                 for name, t in (list(module.named_parameters(remove_duplicate=False))
                                 + list(module.named_buffers(remove_duplicate=False))))


def _outside(gm: fx.GraphModule, node: fx.Node, setting: Setting) -> tuple:
    """A value the layer reads from outside it (:func:`outside_inputs`, in their order),
    as its stand-in is made."""
    if node.op == "get_attr":
        return ("attribute", _attribute(gm, node))
    leaves, spec = pytree.tree_flatten(node.meta.get("val"))
    values = tuple(_tensor(leaf) if isinstance(leaf, torch.Tensor) else
                   (type(leaf).__name__, repr(leaf)) for leaf in leaves)
    if any(not isinstance(leaf, (torch.Tensor, *_PLAIN)) for leaf in leaves):
        raise _NoKey("a value of another kind")
    return ("value", str(spec), values, setting.dtypes.get(node), node in setting.with_grad,
            meta.tensors(node) if meta.TENSORS in node.meta else None)


def kept_run(run: LayerRun, nodes: list[fx.Node]) -> LayerRun:
    """``run`` (of the layer of ``nodes``) to keep: each node, the layer's own and those it
    reads from outside, replaced by its place (so that no graph is kept alive by it)."""
    places = {node: place for place, node in enumerate(nodes + outside_inputs(nodes))}
    return _mapped(run, places.__getitem__)


def given_run(kept: LayerRun, nodes: list[fx.Node]) -> LayerRun:
    """A :func:`kept_run` given to the layer of ``nodes`` (of the same :func:`run_key`):
    each place back to the node in it, the same :class:`LayerRun` a run of the layer
    gives."""
    return _mapped(kept, (nodes + outside_inputs(nodes)).__getitem__)


def _mapped(run: LayerRun, to: Callable[[Any], Any]) -> LayerRun:
    def keyed(found: dict) -> dict:
        return {to(node): value for node, value in found.items()}

    mapped = LayerRun(costs=keyed(run.costs), inputs=keyed(run.inputs), dtypes=keyed(run.dtypes),
                      backward_bytes=run.backward_bytes, kernels=keyed(run.kernels),
                      backward_kernels=run.backward_kernels, rings=list(run.rings))
    mapped.saved = {key: (size, to(node)) for key, (size, node) in run.saved.items()}
    mapped.savers = {key: {to(node) for node in found} for key, found in run.savers.items()}
    mapped.storages = keyed(run.storages)
    return mapped

