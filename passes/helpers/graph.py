"""Graph queries several passes share: which values carry gradients, short op names,
a layer's nodes, tensor inputs, parameter usage, side effects, what a value computes
(:func:`expression_keys`, the same in every trace of one model). Pure functions of a
GraphModule and its ``node.meta``; nothing here changes a graph."""

from __future__ import annotations

import hashlib
import operator
from typing import Any, Callable

import torch
from torch import fx

from partc import meta
from partc.passes.context import Context


_NO_GRAD_OPS = {"detach", "_assert_tensor_metadata", "zeros_like", "ones_like",
                "empty_like", "full_like", "new_zeros", "new_ones", "new_empty", "new_full"}


def carries_grad(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value is a float tensor that depends on a trainable parameter and that
    the graph's output depends on: the values a gradient reaches in backward (and that
    carry one when they cross a stage boundary). An output the loss ignores (BERT's pooler
    under a loss on the last hidden state) gets none."""
    wanted = _ancestors_of_output(gm)
    result: set[fx.Node] = set()
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, (tuple, list)) and value and all(
                isinstance(v, torch.Tensor) for v in value):
            value = value[0]  # a split's pieces: one value for this purpose
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        if node.op == "get_attr":
            owner, _, attr = str(node.target).rpartition(".")
            tensor = getattr(gm.get_submodule(owner) if owner else gm, attr, None)
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                result.add(node)
        elif op_name(node) not in _NO_GRAD_OPS and any(a in result for a in node.all_input_nodes):
            result.add(node)
    return result & wanted


def _ancestors_of_output(gm: fx.GraphModule) -> set[fx.Node]:
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    seen: set[fx.Node] = set()
    stack: list[fx.Node] = []
    for node in output.all_input_nodes:
        uses = meta.loss_uses(node) if meta.role(node) == meta.ROLE_LOSS else None
        if uses is None:
            stack.append(node)
        else:  # the loss's inputs it does not read get no gradient
            seen.add(node)
            stack += [a for a, used in zip(node.args, uses) if used and isinstance(a, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen

def op_name(node: fx.Node) -> str:
    """A short op name: ``aten.view.default`` → ``view``, ``F.linear`` → ``linear``; a
    runtime function the passes put in names the op it stands for (``op_name``)."""
    target = node.target
    if node.op == "call_module":
        return type(node.graph.owning_module.get_submodule(target)).__name__.lower()
    if node.op == "call_method":
        return str(target)
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "op_name", None) or getattr(target, "__name__", str(target))

def has_side_effects(node: fx.Node) -> bool:
    """Whether ``node`` must run even when nothing reads its result: fx's own impure ops
    (mutable ATen schemas, random ops, assertions) and what fx misses, a symbolic trace's
    in-place ops (:func:`mutated_inputs`). Dead-code elimination keeps these, so a model
    trains as in eager PyTorch."""
    if node.op == "call_module":  # a stage's graph is checked before it has a module
        return node.graph.owning_module is not None and node.is_impure()
    return node.is_impure() or bool(mutated_inputs(node))


_IN_PLACE_OPERATORS = (operator.setitem, operator.iadd, operator.isub, operator.imul,
                       operator.itruediv)


# Batch norm in training updates its running statistics (arguments 3 and 4) in place,
# though these schemas do not mark them written (``_native_batch_norm_legit``'s does);
# argument 5 is ``training`` (``use_input_stats`` for instance norm).
_RUNNING_STATS_OPS = ("batch_norm", "native_batch_norm", "instance_norm",
                      "_batch_norm_impl_index", "cudnn_batch_norm", "miopen_batch_norm")


def mutated_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs ``node`` writes to: an in-place Tensor method (``y.mul_(0.5)``) or
    function (``torch.relu_``, ``F.relu(x, inplace=True)``), slice assignment
    (``y[:, 0] = 0``), an ``out=`` argument, an ATen op whose schema writes an argument,
    the running statistics a batch norm in training updates."""
    if node.op not in ("call_method", "call_function"):
        return []
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        values = _schema_values(node, target)
        if target.overloadpacket.__name__ in _RUNNING_STATS_OPS:
            # values[5] is False in eval: the running statistics are read, not written.
            written = values[3:5] if values[5] is not False else []
        else:
            written = [v for v, a in zip(values, target._schema.arguments)
                       if a.alias_info is not None and a.alias_info.is_write]
        return [v for v in written if isinstance(v, fx.Node)]
    name = target if node.op == "call_method" else getattr(target, "__name__", "")
    first = node.args[0] if node.args else None
    out = node.kwargs.get("out")
    writes_first = (node.kwargs.get("inplace") is True or target in _IN_PLACE_OPERATORS
                    or (isinstance(name, str) and name.endswith("_")
                        and not name.startswith("_")))
    found = ([first] if writes_first else []) + [out]
    return [v for v in found if isinstance(v, fx.Node)]


# Ops whose result may share its input's storage: a write to either is seen in the
# other (``h.view(-1).relu_()`` writes ``h``). Erring wide costs only order, never a value.
_ALIASING = frozenset(("view", "view_as", "reshape", "_unsafe_view", "flatten", "unflatten",
                       "transpose", "permute", "t", "movedim", "narrow", "select",
                       "squeeze", "unsqueeze", "expand", "expand_as", "as_strided",
                       "diagonal", "split", "chunk", "unbind", "getitem", "alias",
                       "detach", "contiguous"))


def aliases_input(node: fx.Node) -> bool:
    """Whether ``node``'s value may be a view of its first input's storage."""
    return node.op in ("call_function", "call_method") and op_name(node) in _ALIASING


def in_place_writers(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """The nodes that write each storage in place (:func:`mutated_inputs`), in graph
    order, keyed by the node that makes the storage (:func:`storage_of` through
    :func:`aliases_input`): after such a write, that node and every view of it hold the
    written value, which is what a reader after the write must see."""
    writers: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        for value in mutated_inputs(node):
            writers.setdefault(storage_of(value, aliases_input), []).append(node)
    return writers


def writes_read_later(gm: fx.GraphModule) -> set[tuple[fx.Node, fx.Node]]:
    """``(writer, value)`` where ``writer`` writes ``value`` in place and a later node
    reads the written storage by another name than the writer's own result (``h`` or a
    view of it after ``h.relu_()``): such a write must land on that storage. Where only
    the writer's result is read on (``h = F.relu(h, inplace=True)``), writing a copy
    computes the same."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    found: set[tuple[fx.Node, fx.Node]] = set()
    for writer in gm.graph.nodes:
        for value in mutated_inputs(writer):
            names = _aliases(storage_of(value, aliases_input))
            if any(order[user] > order[writer] for name in names for user in name.users
                   if user is not writer):
                found.add((writer, value))
    return found


def _aliases(storage: fx.Node) -> set[fx.Node]:
    """``storage`` and every node that may view it (:func:`aliases_input`)."""
    found, stack = {storage}, [storage]
    while stack:
        for user in stack.pop().users:
            if user not in found and aliases_input(user) and user.all_input_nodes \
                    and user.all_input_nodes[0] in found:
                found.add(user)
                stack.append(user)
    return found


def _schema_values(node: fx.Node, target: torch._ops.OpOverload) -> list[Any]:
    """The value of each argument of ``target``'s schema in ``node`` (None if not given)."""
    return [node.kwargs.get(a.name, node.args[i] if i < len(node.args) else None)
            for i, a in enumerate(target._schema.arguments)]


def layer_nodes(gm: fx.GraphModule, info: meta.LayerInfo) -> list[fx.Node]:
    by_name = {node.name: node for node in gm.graph.nodes}
    return [by_name[name] for name in info.nodes]

# The functional dropouts a traced graph calls (F.dropout, torch.dropout, export's aten op).
_DROPOUTS = (torch.nn.functional.dropout, torch.dropout, torch.ops.aten.dropout.default)


def dropout_args(node: fx.Node) -> tuple[Any, Any, Any] | None:
    """``(p, training, inplace)`` of a dropout, a functional call or an ``nn.Dropout``
    module's (whose ``training`` is the module's mode); None for any other node. Values
    may be nodes where the graph computes them."""
    if node.op == "call_module":
        module = node.graph.owning_module.get_submodule(str(node.target))
        if not isinstance(module, torch.nn.Dropout):
            return None
        return module.p, module.training, module.inplace
    if node.op != "call_function" or node.target not in _DROPOUTS:
        return None

    def arg(index: int, *names: str, default: Any) -> Any:
        if len(node.args) > index:
            return node.args[index]
        return next((node.kwargs[name] for name in names if name in node.kwargs), default)

    return (arg(1, "p", default=0.5), arg(2, "training", "train", default=True),
            arg(3, "inplace", default=False))


def is_dtype_check(node: fx.Node) -> bool:
    """An exported graph's assertion of the dtype a tensor was traced with."""
    return node.op == "call_function" and \
        getattr(node.target, "__name__", "").startswith("_assert_tensor_metadata")


def storage_of(node: fx.Node, is_view: Callable[[fx.Node], bool]) -> fx.Node:
    """The node whose storage ``node``'s value is: through the views (``is_view``) of
    each one's first input, up to a parameter fetch."""
    while node.op != "get_attr" and node.all_input_nodes and is_view(node):
        node = node.all_input_nodes[0]
    return node


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if is_tensorish(a)]


def is_tensorish(node: fx.Node) -> bool:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and bool(value) and all(
        isinstance(v, torch.Tensor) for v in value)

def param_usage(gm: fx.GraphModule, ctx: Context) -> dict:
    """Which layers use each parameter (by identity, so tied weights are one parameter).

    Returns ``{"layers": {id: set of layer indices}, "tensors": {id: parameter},
    "own": {layer index: (count, bytes, tensors, largest tensor's count) of parameters
    only that layer uses}}``.
    """
    parameter_ids = {id(p) for p in ctx.model.parameters()}
    layers_of: dict[int, set[int]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for node in gm.graph.nodes:
        for fqn in meta.params(node):
            tensor = fetch(gm, fqn)
            if id(tensor) not in parameter_ids:
                continue  # buffers and constants are not parameters
            tensors[id(tensor)] = tensor
            users = node.users if node.op == "get_attr" else [node]
            layers_of.setdefault(id(tensor), set()).update(meta.layer(u).index for u in users)
    own: dict[int, tuple[int, int, int, int]] = {}
    for key, indices in layers_of.items():
        if len(indices) == 1:
            (index,) = indices
            count, nbytes, held, largest = own.get(index, (0, 0, 0, 0))
            tensor = tensors[key]
            own[index] = (count + tensor.numel(),
                          nbytes + tensor.numel() * tensor.element_size(), held + 1,
                          max(largest, tensor.numel()))
    return {"layers": layers_of, "tensors": tensors, "own": own}


def outside_inputs(nodes: list[fx.Node] | tuple[fx.Node, ...]) -> list[fx.Node]:
    """The values ``nodes`` read from outside them, in order of first use."""
    members, seen = set(nodes), {}
    for node in nodes:
        for value in node.all_input_nodes:
            if value not in members:
                seen.setdefault(value, None)
    return list(seen)


def fetch(gm: fx.GraphModule, target: str) -> torch.Tensor:
    """The parameter, buffer or constant a ``get_attr`` target names."""
    owner, _, attr = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, attr)


def nested_graph(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` fetches a graph a higher-order op runs (export's ``submod_<n>``,
    numbered through the whole trace: PhiMoE's router runs part of itself without
    gradients in one), which is no parameter however ``meta.PARAMS`` lists it."""
    return node.op == "get_attr" and isinstance(fetch(gm, str(node.target)), fx.GraphModule)


# How a traced graph calls a linear: torch's function (export and fx keep it) or aten's.
LINEARS = (torch._C._nn.linear, torch.ops.aten.linear.default)


def linear_weight(node: fx.Node) -> tuple[tuple[int, int] | None, str]:
    """A linear's weight (in, out) features and FQN, where ``node`` is ``aten.linear``
    (:data:`LINEARS`) with a parameter (a ``get_attr``) for weight; else (None, "")."""
    if node.op != "call_function" or node.target not in LINEARS or len(node.args) < 2:
        return None, ""
    weight = node.args[1]
    value = weight.meta.get("val") if isinstance(weight, fx.Node) else None
    if not isinstance(weight, fx.Node) or weight.op != "get_attr" or value is None \
            or value.dim() != 2:
        return None, ""
    out_features, in_features = value.shape
    return (int(in_features), int(out_features)), str(weight.target)


def expression_keys(gm: fx.GraphModule, nodes: list[fx.Node]) -> dict[fx.Node, str]:
    """Per node, a digest of what it computes, independent of names and trace order:
    parameters and buffers by FQN, and what tracers name by count (a nested graph's
    ``submod_1``, a lifted constant's ``lifted_tensor_0``) by content."""
    keys: dict[fx.Node, str] = {}
    inputs = 0

    def arg(value: Any) -> Any:
        if isinstance(value, fx.Node):
            return keys[value]
        if isinstance(value, (list, tuple)):
            return tuple(arg(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((str(k), arg(v)) for k, v in value.items()))
        return repr(value)

    for node in nodes:
        if node.op == "placeholder":
            what: Any = ("input", inputs)
            inputs += 1
        elif node.op == "get_attr":
            what = attribute_key(gm, node)
        else:
            target = node.target if isinstance(node.target, str) else \
                getattr(node.target, "__qualname__", None) or str(node.target)
            what = (node.op, str(target), arg(node.args), arg(node.kwargs))
        keys[node] = hashlib.sha1(repr(what).encode()).hexdigest()
    return keys


def attribute_key(gm: fx.GraphModule, node: fx.Node) -> Any:
    """What a ``get_attr`` fetches: a parameter or buffer by FQN, a nested graph by what
    it computes, a constant tensor by its shape, dtype and (when small) content."""
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    if isinstance(value, fx.GraphModule):
        nodes = list(value.graph.nodes)
        return ("graph", expression_keys(value, nodes)[nodes[-1]])
    if meta.params(node):
        return ("param", meta.params(node)[0])
    if isinstance(value, torch.Tensor):
        small = value.numel() <= 4096 and value.device.type != "meta"
        content = hashlib.sha1(value.detach().cpu().contiguous().view(-1).view(torch.uint8)
                               .numpy().tobytes()).hexdigest() if small else ""
        return ("tensor", tuple(value.shape), str(value.dtype), content)
    return ("attribute", str(node.target))
