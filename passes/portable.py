"""Make a lowered graph independent of the machine and the tracer that produced it.

``torch.export`` leaves two kinds of trace-time facts in a graph. Assertions on each
tensor's metadata (``aten._assert_tensor_metadata`` and the other ``aten._assert_*``
ops) compute nothing and check what the trace already knew. Device literals
(``arange(16, device=device(type='cpu'))``, ``to.device(x, device(type='cpu'), ...)``)
name the device the model sat on while it was traced, the planning machine's CPU or
the meta device, not the one a rank runs on. ``drop_assertions`` removes the first;
``device_from_inputs`` makes every such literal read the device of one of the graph's
own inputs instead, so the same code runs wherever its inputs are. A device move
carries a dtype literal too: ``x.to(device)`` is exported as ``aten.to.dtype_layout(x,
dtype=torch.float32, device=...)``, which in mixed precision would cast a bf16 value
back to the dtype it was traced in (GPT-2's position embeddings, and so its residual
stream). ``unpin_dtypes`` drops the device moves the trace saw do nothing.

The first two work on the module and every GraphModule nested in it (higher-order-op
bodies such as export's ``wrap_with_set_grad_enabled``, and the ``recompute_<layer>``
modules), in place, and leave what the graph computes unchanged; the third works on the
module itself, and changes only the dtype a value is kept in.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch import fx

from partc import meta
from partc.passes.context import Context
from partc.runtime.value_checks import value_check

DEVICE_NODE = "input_device"


def drop_assertions(gm: fx.GraphModule, ctx: Context | None = None) -> fx.GraphModule:
    """Erase export's metadata assertions (``aten._assert_*`` calls nothing reads), and
    what only they read. A check of a tensor's values (``torch._check(cond.all())``:
    ``_is_all_true``, ``item``, a ``sym_ite`` and assertions on it, LLaVA's count of
    image tokens against image features) asks fake tensors for a value they do not
    have: it becomes one :func:`partc.runtime.value_checks.value_check` of the same
    condition, which checks real batches only.

    Reads: ``meta.MODULE_PATH``. Writes: the graph.
    Ensures: no ``aten._assert_*`` node without users in ``gm`` or its nested modules,
    nor a pure node whose only readers were such assertions; no ``item`` of an
    ``_is_all_true`` that only assertions read.
    """
    for module in _graph_modules(gm):
        read: list[fx.Node] = []
        for node in list(module.graph.nodes):
            if is_assertion(node) and not node.users:
                read.extend(node.all_input_nodes)
                module.graph.erase_node(node)
        for node in list(module.graph.nodes):
            if _is_value_check(node):
                _keep_checked(module.graph, node)
        while read:
            node = read.pop()
            if node.graph is module.graph and not node.users \
                    and node.op == "call_function" and not node.is_impure():
                read.extend(node.all_input_nodes)
                module.graph.erase_node(node)
        module.recompile()
    return gm


def _is_value_check(node: fx.Node) -> bool:
    """``item(_is_all_true(cond))`` read by nothing but the symbolic numbers its
    assertions compared (already erased: only those numbers remain)."""
    if not (node.op == "call_function" and node.target is torch.ops.aten.item.default):
        return False
    source = node.args[0]
    if not (isinstance(source, fx.Node)
            and source.target is torch.ops.aten._is_all_true.default):
        return False
    pending, seen = list(node.users), set()
    while pending:   # every reader a number made of it that nothing else reads
        user = pending.pop()
        if user in seen:
            continue
        seen.add(user)
        if isinstance(user.meta.get("val"), torch.Tensor):
            return False
        pending.extend(user.users)
    return True


def _keep_checked(graph: fx.Graph, item: fx.Node) -> None:
    """A :func:`value_check` of ``item``'s condition in its place."""
    condition = item.args[0].args[0]
    where = meta.module_path(item.args[0]) or ""
    with graph.inserting_before(item):
        check = graph.call_function(value_check, (condition, where))
    check.meta.update({k: v for k, v in item.args[0].meta.items()
                       if k in ("nn_module_stack", meta.MODULE_PATH)})
    check.meta["val"] = None


def is_assertion(node: fx.Node) -> bool:
    """A check the exporter added (``aten._assert_tensor_metadata``, ``_assert_scalar``,
    ``_assert_async``): it returns nothing and computes nothing the graph uses."""
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) \
        and target.namespace == "aten" and target._opname.startswith("_assert_")


# The aten overloads a device move is exported as (``x.to(device)``, ``x.to(device,
# dtype)``): each names the dtype the trace saw.
_MOVES = ("to.dtype_layout", "to.device")


def unpin_dtypes(gm: fx.GraphModule, ctx: Context | None = None) -> fx.GraphModule:
    """Drop each device move the trace recorded as doing nothing: a
    ``aten.to.dtype_layout`` or ``aten.to.device`` call (not asked to copy) whose input
    was traced in the dtype and on the device it names. Its dtype is the trace's, not
    the model's: run in bf16 it would cast the value to fp32. The pass lists run it for
    mixed precision only (in fp32 such a move does nothing either way).

    Casts that name only a dtype (``aten.to.dtype``) stay, doing nothing or not: the
    graph cannot tell ``x.to(x.dtype)`` (the trace's dtype) from an RMSNorm's
    ``x.to(torch.float32)`` (the model's upcast, which its normalisation shares).

    Reads: ``node.meta["val"]`` (the traced dtypes and devices). Writes: nothing.
    Ensures: no such move in ``gm`` itself (the bodies of higher-order ops run as
    written).
    """
    for node in list(gm.graph.nodes):
        if _does_nothing(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _does_nothing(node: fx.Node) -> bool:
    """A device move to the dtype and device its input was traced in, which returns its
    input."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or \
            target.namespace != "aten" or \
            f"{target._opname}.{target._overloadname}" not in _MOVES:
        return False
    source, result = node.args[0], node.meta.get("val")
    value = source.meta.get("val") if isinstance(source, fx.Node) else None
    if not isinstance(value, torch.Tensor) or not isinstance(result, torch.Tensor):
        return False
    return (not _argument(node, "copy") and value.dtype == result.dtype
            and value.device == result.device and value.is_floating_point())


def _argument(node: fx.Node, name: str) -> Any:
    """The argument ``name`` of an aten call, given by position or keyword (None: not
    given)."""
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            return node.args[index] if index < len(node.args) else None
    return None


def device_from_inputs(gm: fx.GraphModule, ctx: Context | None = None) -> fx.GraphModule:
    """Replace the trace's device literals with the device of the graph's first tensor input.

    A literal equal to the device the inputs were traced on becomes a node
    ``input_device = <input>.device`` placed after the placeholders; a literal naming
    another device (the model's own choice, such as an explicit ``.to("cpu")``) stays.
    Reads: ``node.meta["val"]`` of placeholders (for a nested module whose placeholders
    carry none, the values passed at its call site). Writes: nothing.
    Ensures: no ``torch.device`` equal to the inputs' in any node's arguments, where the
    module has a tensor input to read it from.
    """
    _retarget(gm, {})
    return gm


def _retarget(gm: fx.GraphModule, passed: Mapping[str, Any]) -> None:
    """``passed``: values given to ``gm``'s placeholders at its call site, by name."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    source = next((n for n in placeholders
                   if isinstance(_value(n, passed), torch.Tensor)), None)
    traced = _value(source, passed).device if source is not None else None
    users = [n for n in graph.nodes
             if traced is not None and _mentions((n.args, n.kwargs), traced)]
    if users:
        with graph.inserting_after(placeholders[-1]):
            device = graph.create_node("call_function", getattr, (source, "device"),
                                       name=DEVICE_NODE)
        for node in users:
            node.args, node.kwargs = fx.node.map_aggregate(
                (node.args, node.kwargs), lambda a: device if _is_device(a, traced) else a)
        gm.recompile()
    for name, child in gm.named_children():
        if isinstance(child, fx.GraphModule):
            _retarget(child, _call_site_values(gm, name, passed))


def _value(node: fx.Node, passed: Mapping[str, Any]) -> Any:
    value = node.meta.get("val")
    return passed.get(node.name) if value is None and node.op == "placeholder" else value


def _is_device(value: Any, traced: torch.device) -> bool:
    return isinstance(value, torch.device) and value == traced


def _mentions(args: Any, traced: torch.device) -> bool:
    leaves: list[Any] = []
    fx.node.map_aggregate(args, leaves.append)
    return any(_is_device(leaf, traced) for leaf in leaves)


def _call_site_values(gm: fx.GraphModule, child: str,
                      passed: Mapping[str, Any]) -> dict[str, Any]:
    """The values a nested module receives: the last arguments of the call that takes it,
    one per placeholder (``checkpoint_layer(module, mode, *inputs)``, a higher-order op's
    ``wrap_with_set_grad_enabled(enabled, module, *inputs)``)."""
    names = [n.name for n in gm.get_submodule(child).graph.nodes if n.op == "placeholder"]
    fetch = next((n for n in gm.graph.nodes if n.op == "get_attr" and n.target == child), None)
    call = next((u for u in fetch.users if fetch in u.args), None) if fetch else None
    if call is None or not names or len(call.args) <= len(names):
        return {}
    inputs = call.args[-len(names):]
    return {name: _value(a, passed) if isinstance(a, fx.Node) else a
            for name, a in zip(names, inputs)}


def _graph_modules(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    yield gm
    for child in gm.children():
        if isinstance(child, fx.GraphModule):
            yield from _graph_modules(child)
