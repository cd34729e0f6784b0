"""Group graph nodes into layers: module boundaries first, single-tensor graph cuts after.

A *repeated container* is a module whose children are named ``0 .. k-1`` (ModuleList,
Sequential). A node's layer key comes from its module path: walk it from the root while
the module is an ancestor of a repeated container; the key is the first module that is
not, or ``container.<index>`` inside a container. GPT-2 gives ``transformer.wte``,
``transformer.wpe``, ``transformer.drop``, ``transformer.h.0`` … ``transformer.ln_f``,
``lm_head``. Nodes without a key (root-level functions) join the layer in progress, and
so does an in-place op writing to a value that layer made (``nn.ReLU(inplace=True)`` as a
child of a Sequential): an op may write only to its own layer's values, since stages are
cut and layers recomputed at layer boundaries; the pass refuses any other in-place write.

Layers are runs of consecutive nodes in graph order, so their sequence is a topological
order of the layer DAG by construction; the pass still checks it with networkx.

A layer has two signatures. ``LayerInfo.signature`` (:func:`_signature`) lists its ops in
graph order: layers of one such signature pair node by node, within one trace (estimate
copies a measurement, the sharding chooser a solution). It leaves out what tells like
blocks apart without changing their costs or shardings: where an index or slice points,
which lifted constant or other module's parameter of one shape they read. ``LayerCost.signature``
(:func:`canonical_signature`) says what the layer computes, in no order: two traces of
one model agree on it even where Python code iterates a set of strings, in an order that
string hashing, seeded per process, decides (Gemma-3 computes its sliding-window and
global rotary tables in ``set(layer_types)`` order). The plan cache's problem key reads
it, so a new process finds the plan another one stored.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Sequence

import networkx as nx
import torch
from torch import fx, nn

from partc import meta
from partc.errors import TraceError
from partc.passes.context import Context
from partc.passes.context_parallel import shape_masks
from partc.passes.helpers.graph import (attribute_key, carries_grad, mutated_inputs,
                                         nested_graph, op_name)

ROOT_LAYER = "root"
OUTPUT_LAYER = "output"

# Ops that only reshape, alias or inspect: a tail made of them is no layer of its own.
_TRIVIAL_OPS = {
    "view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand", "getitem",
    "slice", "select", "t", "contiguous", "flatten", "unflatten", "size", "getattr", "alias",
    "detach", "split", "chunk", "_assert_tensor_metadata", "to", "float", "clone", "dim",
}
# Ops whose presence marks a segment worth a layer when the graph has to be cut.
_HEAVY_OPS = {
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "conv1d", "conv2d",
    "conv3d", "convolution", "scaled_dot_product_attention", "embedding",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
}


def layers(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Assign every node to a layer and measure what crosses each layer boundary.

    Reads: ``meta.MODULE_PATH``, ``meta.ROLE``, ``meta.TENSORS``, ``meta.PARAMS``.
    Writes: ``meta.LAYER`` on every node; ``meta.LAYERS``, ``meta.CUTS`` and
    ``meta.CUT_TENSORS`` on ``gm``.
    Requires: ``propagate``; placeholders first, get_attr nodes next to their first user.
    Ensures: layers are contiguous runs of graph order; every data edge goes from a layer
    to itself or a later one; ``len(CUTS) == len(LAYERS) - 1``.
    """
    keyer = _LayerKeyer(ctx.model)
    runs = _module_runs(gm, keyer)
    runs = _split_tail(runs)
    if sum(1 for run in runs if not run.is_loss) <= 1:
        runs = _split_at_cuts(gm, runs)
    infos = _name_layers(runs)
    _assign(gm, infos)
    _check_dag(gm, infos)
    _check_writes(gm)
    meta.set_layers(gm, tuple(infos))
    meta.set_cut_bytes(gm, crossing_bytes(gm, len(infos)))
    meta.set_cut_tensors(gm, crossing_tensors(gm, len(infos)))
    return gm


class _LayerKeyer:
    """Maps a module path to its layer key (``None``: above every layer)."""

    def __init__(self, model: nn.Module) -> None:
        self.containers = {name for name, module in model.named_modules()
                           if is_repeated(module)}
        self.ancestors = {".".join(name.split(".")[:i]) if name else ""
                          for name in self.containers
                          for i in range(len(name.split(".")) + 1)}
        self.ancestors.add("")

    def key(self, path: str) -> str | None:
        current = ""
        for part in path.split(".") if path else []:
            child = f"{current}.{part}" if current else part
            if current in self.containers or child not in self.ancestors:
                return child
            current = child
        return None


def is_repeated(module: nn.Module) -> bool:
    """A container whose children are named ``0 .. k-1``: each child is a layer."""
    names = [name for name, _ in module.named_children()]
    return bool(names) and names == [str(i) for i in range(len(names))]


class _Run:
    """A run of consecutive nodes with one layer key, before layers get names."""

    def __init__(self, key: str | None, is_loss: bool = False) -> None:
        self.key = key
        self.is_loss = is_loss
        self.nodes: list[fx.Node] = []
        self.keyed_until = 0  # nodes[:keyed_until] end with the last keyed node


def _module_runs(gm: fx.GraphModule, keyer: _LayerKeyer) -> list[_Run]:
    runs: list[_Run] = []
    pending: list[fx.Node] = []  # keyless nodes before the first keyed one
    made_in: dict[fx.Node, _Run] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue  # placed after grouping: inputs first, parameters with their user
        is_loss = meta.role(node) == meta.ROLE_LOSS
        key = "loss" if is_loss else keyer.key(meta.module_path(node))
        if runs and any(made_in.get(value) is runs[-1] for value in mutated_inputs(node)):
            key = runs[-1].key  # an in-place op stays with the value it writes to
        if key is None:
            (runs[-1].nodes if runs else pending).append(node)
        else:
            if not runs or runs[-1].key != key:
                runs.append(_Run(key, is_loss))
            runs[-1].nodes.append(node)
            runs[-1].keyed_until = len(runs[-1].nodes)
        if runs:
            made_in[node] = runs[-1]
    if not runs or runs[0].is_loss:
        runs.insert(0, _Run(None))
    runs[0].nodes[:0] = pending
    runs[0].keyed_until += len(pending)
    return runs


def _split_tail(runs: list[_Run]) -> list[_Run]:
    """Keyless nodes after the model's last module form an "output" layer if they compute."""
    model_runs = [r for r in runs if not r.is_loss]
    last = model_runs[-1]
    tail = last.nodes[last.keyed_until:]
    if not tail or all(op_name(n) in _TRIVIAL_OPS for n in tail) or last.key is None:
        return runs
    del last.nodes[last.keyed_until:]
    output = _Run(OUTPUT_LAYER)
    output.nodes = tail
    return runs[:runs.index(last) + 1] + [output] + runs[runs.index(last) + 1:]


def _split_at_cuts(gm: fx.GraphModule, runs: list[_Run]) -> list[_Run]:
    """Models without module structure: cut where a single tensor crosses."""
    live = _live_tensor_counts(gm)
    result: list[_Run] = []
    for run in runs:
        if run.is_loss:
            result.append(run)
            continue
        result.extend(_cut_run(run, live))
    return result


def _cut_run(run: _Run, live: dict[fx.Node, int]) -> list[_Run]:
    """Cut before each heavy op at the last single-tensor point since the previous one.

    Taking the last such point keeps an op's cheap epilogue (an activation, a norm)
    with it, and no piece is made of reshapes alone.
    """
    pieces, start, seen_heavy, candidate = [], 0, False, None
    for position, node in enumerate(run.nodes):
        if op_name(node) in _HEAVY_OPS:
            if seen_heavy and candidate is not None:
                pieces.append(run.nodes[start:candidate + 1])
                start = candidate + 1
            seen_heavy, candidate = True, None
        if seen_heavy and live[node] == 1:
            candidate = position
    pieces.append(run.nodes[start:])
    if len(pieces) == 1:
        return [run]
    out = []
    for index, nodes in enumerate(pieces):
        piece = _Run(f"{run.key or ROOT_LAYER}.{index}")
        piece.nodes = nodes
        out.append(piece)
    return out


def _live_tensor_counts(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """For each node, how many tensor values made at or before it are used after it."""
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    delta = [0] * (len(nodes) + 1)
    for node in nodes:
        if not _is_activation(node) or not node.users:
            continue
        last_use = max(position[user] for user in node.users)
        delta[position[node]] += 1
        delta[last_use] -= 1
    counts, running = {}, 0
    for node, change in zip(nodes, delta):
        running += change
        counts[node] = running
    return counts


def _is_activation(node: fx.Node) -> bool:
    """A value that carries tensors between nodes and is not a parameter or the target."""
    if node.op in ("get_attr", "output") or meta.role(node) == meta.ROLE_TARGET:
        return False
    return bool(meta.tensors(node))


def _name_layers(runs: list[_Run]) -> list[meta.LayerInfo]:
    seen: dict[str, int] = {}
    infos = []
    for index, run in enumerate(runs):
        key = run.key or ROOT_LAYER
        seen[key] = seen.get(key, 0) + 1
        # A module called again after another layer started is a new layer.
        name = key if seen[key] == 1 else f"{key}#{seen[key]}"
        infos.append(meta.LayerInfo(index=index, name=name, key=key, signature="",
                                    nodes=tuple(n.name for n in run.nodes),
                                    is_loss=run.is_loss))
    return infos


def _assign(gm: fx.GraphModule, infos: list[meta.LayerInfo]) -> None:
    """Write LAYER on every node, placing inputs, parameters and the output, and sign."""
    by_name = {node.name: node for node in gm.graph.nodes}
    for info in infos:
        for name in info.nodes:
            meta.set_layer(by_name[name], meta.LayerRef(info.index, info.name))
    first, last = infos[0], infos[-1]
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            home = last if meta.role(node) == meta.ROLE_TARGET else first
            meta.set_layer(node, meta.LayerRef(home.index, home.name))
        elif node.op == "output":
            meta.set_layer(node, meta.LayerRef(last.index, last.name))
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            user = min(node.users, key=lambda u: meta.layer(u).index)
            meta.set_layer(node, meta.layer(user))
    for i, info in enumerate(infos):
        nodes = [n for n in gm.graph.nodes if meta.layer(n).index == info.index
                 and n.op not in ("placeholder", "output")]
        infos[i] = meta.LayerInfo(index=info.index, name=info.name, key=info.key,
                                  signature=_signature(nodes, info.key),
                                  nodes=tuple(n.name for n in nodes), is_loss=info.is_loss)


def _check_dag(gm: fx.GraphModule, infos: list[meta.LayerInfo]) -> None:
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(infos)))
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            continue  # parameters are held by every layer using them, not passed along
        for user in node.users:
            dag.add_edge(meta.layer(node).index, meta.layer(user).index)
    dag.remove_edges_from(nx.selfloop_edges(dag))
    if not nx.is_directed_acyclic_graph(dag):
        raise AssertionError(f"layer graph has a cycle: {nx.find_cycle(dag)}")
    backward = [(a, b) for a, b in dag.edges if a > b]
    if backward:
        a, b = backward[0]
        raise AssertionError(f"layer {infos[a].name} feeds earlier layer {infos[b].name}")


def _check_writes(gm: fx.GraphModule) -> None:
    """Refuse an in-place write to a value another layer made (parameters and buffers
    aside: their ``get_attr`` lives with its first user). A stage receives such a value as
    a leaf of its own and a recomputed layer would write it twice: what runs would not
    be what eager PyTorch runs."""
    for node in gm.graph.nodes:
        for value in mutated_inputs(node):
            if value.op == "get_attr" or meta.layer(value).index == meta.layer(node).index:
                continue
            where = meta.module_path(node) or "the model's forward"
            line = (node.meta.get("stack_trace") or "").strip().splitlines()[-2:]
            raise TraceError(
                f"{op_name(node)} ({node.format_node()}) in {where} writes in place to "
                f"{value.name}, made in layer {meta.layer(value).name}, not its own "
                f"({meta.layer(node).name})" + (f"; at {' '.join(line)}" if line else "")
                + ". partc cuts stages and recomputes at layer boundaries and cannot keep "
                "that write as eager PyTorch does: write it out of place (y = y * 0.5 for "
                "y.mul_(0.5), nn.ReLU() for nn.ReLU(inplace=True)) or inside the module "
                "that makes the value.")


def crossing_users(gm: fx.GraphModule) -> list[tuple[fx.Node, int, set[int]]]:
    """Each activation used in a later layer, with the layer that makes it and the
    layers that use it. Placeholders count as made in layer 0; the target goes straight
    to the loss and parameters are never passed, so neither crosses."""
    result = []
    for node in gm.graph.nodes:
        if not _is_activation(node) or not node.users:
            continue
        made = 0 if node.op == "placeholder" else meta.layer(node).index
        users = {meta.layer(user).index for user in node.users}
        if max(users) > made:
            result.append((node, made, users))
    return result


def _crossings(gm: fx.GraphModule) -> list[tuple[fx.Node, int, int]]:
    """Each crossing value with the layer that makes it and the last layer that uses it:
    it crosses the boundaries ``made .. used - 1`` (boundary l lies after layer l)."""
    return [(node, made, max(users)) for node, made, users in crossing_users(gm)]


def crossing_bytes(gm: fx.GraphModule, num_layers: int,
                   size=meta.output_bytes) -> tuple[float, ...]:
    """Bytes of every activation made at or before layer l and used after it, per cut l
    (``size``: a node's bytes; as traced, or :func:`partc.meta.run_bytes`)."""
    return cut_sums([(size(node), made, used)
                     for node, made, used in _crossings(gm)], num_layers)


def cut_sums(spans: list[tuple[float, int, int]], num_layers: int) -> tuple[float, ...]:
    """Per cut l, the sum of the amounts whose span (made, last used) crosses it."""
    delta = [0.0] * (num_layers + 1)
    for amount, made, used in spans:
        delta[made] += amount
        delta[used] -= amount
    cuts, running = [], 0.0
    for boundary in range(num_layers - 1):
        running += delta[boundary]
        cuts.append(running)
    return tuple(cuts)


def crossing_tensors(gm: fx.GraphModule, num_layers: int) -> tuple[tuple[int, int, int], ...]:
    """Per cut l: how many tensor values cross it, how many of those carry gradients, and
    how many are attention masks made from shapes (context parallelism erases them).

    The same values as :func:`crossing_bytes`, counted the way a pipeline sends them:
    one message per tensor; a value that is not a single tensor (a size) is not sent.
    """
    grads, masks = carries_grad(gm), shape_masks(gm)
    return cut_counts([(node in grads, node in masks, made, used)
                       for node, made, used in _crossings(gm)
                       if isinstance(node.meta.get("val"), torch.Tensor)], num_layers)


def cut_counts(spans: list[tuple[bool, bool, int, int]], num_layers: int
               ) -> tuple[tuple[int, int, int], ...]:
    """Per cut l: how many spans (with grad, a shape mask, made, last used) cross it,
    how many with grad, how many shape masks."""
    tensors = cut_sums([(1, made, used) for _, _, made, used in spans], num_layers)
    with_grad = cut_sums([(1, made, used) for grad, _, made, used in spans if grad],
                         num_layers)
    masks = cut_sums([(1, made, used) for _, mask, made, used in spans if mask], num_layers)
    return tuple((int(t), int(g), int(k)) for t, g, k in zip(tensors, with_grad, masks))


def _signature(nodes: list[fx.Node], prefix: str) -> str:
    """Hash of a layer's ops, wiring, shapes and relative parameter names, in graph order
    (one trace's: layers of one signature pair node by node). What differs between
    like blocks without changing what they cost or how they shard is left out
    (:func:`signed_args`, :func:`attribute_place`)."""
    # Parameters are named where they are used: a layer reusing another layer's weight
    # signs like the layer that fetched it first.
    nodes = [node for node in nodes if node.op != "get_attr"]
    local = {node: i for i, node in enumerate(nodes)}
    external: dict[fx.Node, int] = {}
    fetched: dict[str, int] = {}

    def arg_repr(value: Any) -> Any:
        if isinstance(value, fx.Node):
            if value.op == "get_attr":
                return attribute_place(value, prefix, fetched)
            if value in local:
                return ("n", local[value])
            return ("in", external.setdefault(value, len(external)))
        if isinstance(value, (list, tuple)):
            return tuple(arg_repr(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, arg_repr(v)) for k, v in value.items()))
        return repr(value)

    items = []
    for node in nodes:
        target = _relative(str(node.target), prefix) if node.op == "call_module" \
            else op_name(node)
        # Whether a later layer reads it: what backward must carry a gradient from
        # (Gemma 3n's blocks 18 and 19 hand their keys and values to blocks 20-34).
        read_later = any(user not in local for user in node.users)
        items.append((node.op, target, arg_repr(signed_args(node)), arg_repr(node.kwargs),
                      _shapes(node), read_later))
    return hashlib.sha1(repr(items).encode()).hexdigest()[:16]


def signed_args(node: fx.Node) -> tuple:
    """``node``'s positional arguments as a layer's signature reads them (here and in the
    tensor-parallel rewrite's): as they are, but without where an index or a slice
    points (a select's index, a slice's bounds, the ints and slices of a tensor's
    subscript), which changes neither the shapes (signed apart) nor the cost, and which
    no sharding splits (:mod:`partc.passes.tp.rules` keeps every other dim sharded, and
    a tensor's subscript replicated). Gemma 3n's blocks each read their own slice of the
    per-layer inputs, at the block's number: with it, no two of its 35 blocks signed
    alike, and each was measured and sharded on its own."""
    args, name = node.args, op_name(node)
    if name == "select" and len(args) == 3:
        return (*args[:2], "index")
    if name == "slice" and len(args) >= 3:   # (self, dim, start, end, step)
        return (*args[:2], "bounds", *args[4:])
    if name == "getitem" and len(args) == 2 and isinstance(args[0], fx.Node) \
            and isinstance(args[0].meta.get("val"), torch.Tensor):
        return (args[0], _subscript(args[1]))
    return args


def _subscript(index: Any) -> Any:
    if isinstance(index, int) and not isinstance(index, bool):
        return "index"
    if isinstance(index, slice):
        return ("slice", index.step)
    if isinstance(index, tuple):
        return tuple(_subscript(i) for i in index)
    return index


# torch.export names each tensor constant it lifts by its count in the whole trace
# (``lifted_tensor_12`` in one block, ``lifted_tensor_16`` in the next), fx's own tracer
# likewise (``_tensor_constant3``).
_LIFTED = re.compile(r"(?:^|\.)(?:lifted_tensor_|_tensor_constant)\d+$")


def attribute_place(node: fx.Node, prefix: str, seen: dict[str, int]) -> Any:
    """What the ``get_attr`` ``node`` reads, as a layer's signature names it (here and in
    the tensor-parallel rewrite's): a parameter or buffer of the layer (``prefix``) by
    its name inside it; a tensor constant the trace lifted, or a parameter of another
    module, by its order among those the layer reads (``seen``: met so far, by name)
    and its shapes, not by a name that tells one block from the next (Zamba2's hybrid
    blocks each read their own adapter of the one shared transformer); anything else
    by content (:func:`_attribute`)."""
    target = str(node.target)
    outside = bool(meta.params(node)) and not target.startswith(prefix + ".") \
        and not nested_graph(node.graph.owning_module, node)
    if outside or _LIFTED.search(target):
        return ("outside", seen.setdefault(target, len(seen)), _shapes(node))
    return _attribute(node, prefix)


def canonical_signature(gm: fx.GraphModule, nodes: Sequence[fx.Node], prefix: str) -> str:
    """What a layer computes (``nodes``, in graph order), in a digest that neither trace
    order nor node names enter. It hashes the sorted digests of the layer's values and,
    per value read from outside the layer, the sorted places that read it (which of
    those reads are of one value). A value's digest is that of its op, its shapes, how
    many of the layer's nodes read it, whether a later layer does, and its arguments:
    the layer's values by digest (recursively, as
    :func:`~partc.passes.helpers.graph.expression_keys` describes a whole graph),
    parameters by their name inside the layer (``prefix``), other attributes by content
    (:func:`~partc.passes.helpers.graph.attribute_key`), values from outside by their
    shapes. Like blocks sign alike wherever they sit, and two traces of one model alike
    whatever order they ran in."""
    inside = {node for node in nodes if node.op != "get_attr"}
    keys: dict[fx.Node, str] = {}
    reads: dict[fx.Node, list[str]] = {}   # value from outside -> where the layer reads it
    for node in nodes:
        if node in inside:
            outside: list[tuple[fx.Node, tuple]] = []
            what = _expression(gm, node, prefix, inside, keys, outside)
            keys[node] = hashlib.sha1(repr(what).encode()).hexdigest()[:16]
            for value, place in outside:
                reads.setdefault(value, []).append(repr((keys[node], place)))
    places = sorted(repr(sorted(found)) for found in reads.values())
    return hashlib.sha1(repr((sorted(keys.values()), places)).encode()).hexdigest()[:16]


def _expression(gm: fx.GraphModule, node: fx.Node, prefix: str, inside: set[fx.Node],
                keys: dict[fx.Node, str], outside: list[tuple[fx.Node, tuple]]) -> tuple:
    """``node`` as :func:`canonical_signature` describes it; appends to ``outside`` each
    value from outside the layer it reads, with the place it reads it at."""
    def arg(value: Any, place: tuple) -> Any:
        if isinstance(value, fx.Node):
            if value.op == "get_attr":
                return _attribute(value, prefix)
            if value in inside:
                return keys[value]
            outside.append((value, place))
            return ("in", _shapes(value))
        if isinstance(value, (list, tuple)):
            return tuple(arg(v, place + (i,)) for i, v in enumerate(value))
        if isinstance(value, dict):
            return tuple(sorted((str(k), arg(v, place + (str(k),))) for k, v in value.items()))
        return repr(value)

    target = _relative(str(node.target), prefix) if node.op == "call_module" \
        else op_name(node)
    readers = sum(1 for user in node.users if user in inside)
    return (node.op, target, arg(node.args, ("args",)), arg(node.kwargs, ("kwargs",)),
            _shapes(node), readers, readers < len(node.users))


def _attribute(node: fx.Node, prefix: str) -> Any:
    """What a ``get_attr`` fetches, for a signature: a parameter or buffer by its name
    inside the layer (``prefix``), anything else by content (a higher-order op's nested
    graph, which export names by its count in the whole trace:
    :func:`~partc.passes.helpers.graph.attribute_key`)."""
    gm = node.graph.owning_module
    if meta.params(node) and not nested_graph(gm, node):
        return ("p", _relative(str(node.target), prefix))
    return attribute_key(gm, node)


def _shapes(node: fx.Node) -> tuple:
    return tuple((tuple(t.shape), str(t.dtype)) for t in meta.tensors(node))


def _relative(fqn: str, prefix: str) -> str:
    if fqn == prefix:
        return ""
    return fqn[len(prefix) + 1:] if prefix and fqn.startswith(prefix + ".") else fqn


