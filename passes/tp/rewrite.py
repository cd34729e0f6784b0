"""The tensor-parallel rewrite: the whole-model graph becomes the program that one rank of
a tensor-parallel group runs, on local parameter shards, with the collectives inserted.

Given a :class:`partc.passes.tp.chooser.Sharding` (a strategy for every node, from the
chooser or rebuilt from a plan by ``chooser.apply``):

- the group: a :class:`partc.runtime.tp.TensorParallelGroup` of ``tp`` ranks becomes the
  module's submodule ``tp``: a stand-in that moves no data (the shapes are right, which
  is what measuring needs) until the runtime binds the real one
  (``partc.runtime.tp.bind_group``). Each layer that meets the other ranks reads it
  once, ``tp = self.tp``, and calls its methods;
- a sharded parameter's attribute becomes a stand-in of this rank's shard;
- where a value's placement differs from what its consumer needs, a collective moves it
  (``tp.reduce_from_tp(x)``, ``tp.gather_from_tp(x, dim)``, …), once per value and
  target placement, shared by the consumers that need the same (and made again for
  those after an in-place write to the value: a moved value is a copy);
- values that leave their layer are brought to the layer boundary's placement, after
  the in-place writes their layer makes to them (``h = gelu(x); h.relu_()``: the later
  layers read the written ``h``);
- ops whose arguments hold sizes (``view``, ``reshape``, ``expand``, ``split``) get the
  local size of the dim they shard; ``x.size()`` of a sharded ``x`` asks for the global
  size (``tp.global_size``), so size arithmetic in the model's code keeps its meaning;
- a row-parallel linear adds ``bias / tp`` on each rank (the sum over ranks adds it once);
- a vocabulary-parallel embedding looks up only the rows this rank holds, and dropout
  of a shard keeps its part of the whole tensor's mask (``tp.dropout``);
- a vocabulary-parallel loss runs the user's loss on this rank's slice of the logits'
  classes (``partc.runtime.tp_loss.VocabParallelLoss``, the loss node's new target);
- a linear reading a sequence-parallel shard gathered whole (``rules.regathers``)
  becomes ``tp.linear_of_gathered``, and an ``addmm`` reading it flattened (GPT-2's
  ``Conv1D``) ``tp.addmm_of_gathered``: they keep the shard, not the whole, for
  backward and gather it again there;
- where linears are all that read the gathered value, the gather and they become
  one ``tp.linears_of_gathered`` (one output per linear), and a row-parallel linear
  whose output only the reduce-scatter to the sequence shard reads becomes
  ``tp.linear_reduce_scatter``: the runtime runs each as a ring that hides the
  collective behind the matmuls (:mod:`partc.runtime.tp_rings`, :func:`fuse_rings`).
  GPT-2's ``Conv1D`` products (``addmm`` over the flattened input, an (in, out)
  weight) join them as the linears of the transposed weight they are.

The graph is the same on every rank of the group (ranks differ only in which shard they
hold, and the group knows its rank at run time), so one emitted file serves the group.

Reads: ``meta.LAYERS``, ``meta.LAYER``, ``meta.PARAMS``, ``node.meta["val"]``.
Writes: the submodule ``tp``; new nodes with ``meta.LAYER``; a new ``meta.LAYERS``
(each layer's nodes and signature); drops ``node.meta["val"]`` of every node but the
placeholders.
Requires: ``layers``, and a sharding chosen (or applied) on this graph's nodes.
Ensures: every node's inputs have the placements its strategy needs; every collective
reads the group through a ``get_attr`` of ``tp`` in its own layer; ``propagate`` must
run again to give the nodes their local shapes (the stand-in group makes them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import operator
from typing import Any, Callable

import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from partc import meta
from partc.passes.context import Context
from partc.passes.helpers.graph import (aliases_input, carries_grad, in_place_writers,
                                        mutated_inputs, op_name, storage_of,
                                        tensor_inputs, writes_read_later)
from partc.passes.layers import attribute_place, signed_args
from partc.passes.tp.chooser import Sharding
from partc.passes.tp.rules import flattened_for_addmm, redistribute, regathers
from partc.placement import Placement
from partc.runtime.tp import ShardedDropout, TensorParallelGroup
from partc.runtime.tp_loss import VocabParallelLoss

# The group's calls the runtime runs as rings beside their collectives
# (partc.runtime.tp_rings): the column-parallel linears reading one gathered shard, and a
# row-parallel linear reduce-scattered.
LINEARS_OF_GATHERED, LINEAR_REDUCE_SCATTER = "linears_of_gathered", "linear_reduce_scatter"
RING_CALLS = frozenset((LINEARS_OF_GATHERED, LINEAR_REDUCE_SCATTER))

LocalParam = Callable[[str, torch.Tensor, Placement], torch.Tensor]

GROUP = "tp"  # the group's attribute on the rewritten module


def narrow_param(fqn: str, tensor: torch.Tensor, placement: Placement, tp: int) -> torch.Tensor:
    """Shape-only stand-in for a shard (a view of rank 0's rows): enough for measuring."""
    return tensor.narrow(placement.dim, 0, tensor.shape[placement.dim] // tp)


def copy_module(gm: fx.GraphModule, sharding: Sharding) -> tuple[fx.GraphModule, Sharding]:
    """A copy of ``gm`` (sharing its tensors) and ``sharding`` moved onto its nodes. Its
    Python code is generated when first asked for (torch's lazy GraphModule): the copies
    the tensor-parallel options measure are rewritten, then read node by node, never
    called, so neither the copy nor the rewrite's recompile writes code no one runs."""
    graph = fx.Graph()
    mapping: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, mapping)
    old_output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    graph.output(out).meta.update(old_output.meta)
    copied = _LazyGraphModule(gm, graph)
    copied.meta.update(gm.meta)
    moved = dataclasses.replace(
        sharding, strategy={mapping[n]: s for n, s in sharding.strategy.items()},
        boundary={mapping[n]: p for n, p in sharding.boundary.items()})
    return copied, moved


def tp_rewrite(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Rewrite ``gm`` in place for one rank of a group of ``ctx.sharding.tp``; a sharded
    parameter becomes a shape-only stand-in for its shard (:func:`narrow_param`: the
    runtime copies in each rank's own shard after lowering)."""
    sharding = ctx.sharding
    tp = sharding.tp
    local_param: LocalParam = lambda fqn, t, p: narrow_param(fqn, t, p, tp)  # noqa: E731
    if hasattr(gm, GROUP):
        raise ValueError(f"the module has an attribute {GROUP!r} already: rewritten twice?")
    gm.add_submodule(GROUP, TensorParallelGroup(tp))
    _shard_params(gm, sharding, local_param)
    rewriter = _Rewriter(gm, sharding)
    for node in list(gm.graph.nodes):
        if node.op != "placeholder":
            rewriter.visit(node)
    fuse_rings(gm)
    gm.graph.lint()
    gm.recompile()
    _relayer(gm, sharding)
    # Shapes changed: drop the fake values so that propagate recomputes them all.
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            node.meta.pop("val", None)
    return gm


def _shard_params(gm: fx.GraphModule, sharding: Sharding, local_param: LocalParam) -> None:
    done: set[str] = set()
    for node, chosen in sharding.strategy.items():
        if node.op != "get_attr" or chosen.out.kind != "S" or node.target in done:
            continue
        done.add(str(node.target))
        owner_name, _, attr = str(node.target).rpartition(".")
        owner = gm.get_submodule(owner_name) if owner_name else gm
        tensor = getattr(owner, attr)
        fqn = meta.params(node)[0] if meta.params(node) else str(node.target)
        local = local_param(fqn, tensor, chosen.out)
        if isinstance(tensor, torch.nn.Parameter):
            local = torch.nn.Parameter(local, requires_grad=tensor.requires_grad)
            owner._parameters[attr] = local
        else:
            owner._buffers[attr] = local


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, sharding: Sharding) -> None:
        self.gm, self.s, self.tp = gm, sharding, sharding.tp
        self.moved: dict[tuple, fx.Node] = {}
        self.at_boundary: dict[fx.Node, fx.Node] = {}
        self.grads = carries_grad(gm)  # the values a gradient reaches in backward
        self.group_reads: dict[int, fx.Node] = {}  # layer index → its get_attr of the group
        # Linears reading a gathered shard → (the gathered node, the shard, its dim).
        self.regather: dict[fx.Node, tuple[fx.Node, fx.Node, int]] = {}
        # In-place writes: a collective moves a copy, so one that reads a value must run
        # after the writes its readers see (eager order), not right after the value.
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.writers = in_place_writers(gm)  # storage → the nodes writing it, in order
        self.writes_seen: dict[fx.Node, int] = {}  # storage → its writers visited so far
        self.writes_read_later = writes_read_later(gm)

    def group(self, first_use: fx.Node) -> fx.Node:
        """The node that reads the group in ``first_use``'s layer; made just before
        ``first_use`` when the layer has none yet (nodes are visited in order, so every
        later use in the layer comes after it)."""
        layer = meta.layer(first_use).index
        if layer not in self.group_reads:
            with self.gm.graph.inserting_before(first_use):
                read = self.gm.graph.get_attr(GROUP)
            _set_layer(read, first_use)
            self.group_reads[layer] = read
        return self.group_reads[layer]

    def to_method(self, node: fx.Node, method: str, args: tuple) -> None:
        """Make ``node`` a call of the group's ``method`` with ``args``."""
        node.op, node.target = "call_method", method
        node.args, node.kwargs = (self.group(node), *args), {}

    # ------------------------------------------------------------------ placements
    def seen_as(self, producer: fx.Node, consumer: fx.Node) -> tuple[fx.Node, Placement]:
        """The node ``consumer`` should read for ``producer``, and its placement."""
        if producer.op == "get_attr":
            return producer, self.s.placement(producer)
        crosses = producer.op == "placeholder" or (
            consumer.op == "output" or meta.layer(consumer).index != meta.layer(producer).index)
        if crosses and producer in self.s.boundary:
            return self.at_boundary.get(producer, producer), self.s.boundary[producer]
        return producer, self.s.placement(producer)

    def visit(self, node: fx.Node) -> None:
        chosen = self.s.strategy.get(node)
        if chosen is None and op_name(node) not in ("size", "sym_size"):
            # No placement of its own (the output, an assertion): read crossing values
            # as the layer boundary has them.
            for producer in node.all_input_nodes:
                source, _ = self.seen_as(producer, node)
                if source is not producer:
                    node.replace_input_with(producer, source)
        if chosen is not None and node.op != "get_attr":
            for position, producer in enumerate(tensor_inputs(node)):
                self._feed(node, producer, chosen.ins[position], chosen.out, position)
            self._local_sizes(node, chosen)
            self._linear_of_gathered(node)
        elif node.op in ("call_function", "call_method"):
            self._global_sizes(node)
        if chosen is not None and node in self.s.boundary and node.op != "get_attr":
            self._to_boundary(node, chosen.out, self.s.boundary[node])
        for written in mutated_inputs(node):
            storage = storage_of(written, aliases_input)
            self.writes_seen[storage] = self.writes_seen.get(storage, 0) + 1

    def _feed(self, node: fx.Node, producer: fx.Node, need: Placement, out: Placement,
              position: int) -> None:
        source, have = self.seen_as(producer, node)
        if need.kind == "*":  # read for its dtype and device only: as it is
            if source is not producer:
                node.replace_input_with(producer, source)
            return
        if producer.op == "get_attr":
            grad_partial = (need.kind == "R" and out.kind != "R" and bool(meta.params(producer))
                            and meta.params(producer)[0] not in self.s.partial_grad_params
                            and producer in self.grads)
            if have != need:
                raise AssertionError(f"{node.name}: parameter {producer.name} is {have}, "
                                     f"needs {need}")
            if grad_partial:
                moved = self._move(source, have, need, True, node)
                node.replace_input_with(source, moved)
            return
        grad_partial = need.kind == "R" and out.kind != "R" and producer in self.grads
        if have == need and not grad_partial:
            if source is not producer:
                node.replace_input_with(producer, source)
            return
        if (node, producer) in self.writes_read_later:
            # The chooser's constraint (8): the write would land on the moved copy.
            raise AssertionError(f"{node.name} writes {producer.name} in place but reads "
                                 f"it moved from {have} to {need}")
        moved = self._move(source, have, need, grad_partial, node)
        node.replace_input_with(producer, moved)
        if regathers(node, position, have, need, grad_partial):
            # A linear reads the gathered value; addmm reads the view that flattens it.
            for product in flattened_for_addmm(node) or [node]:
                self.regather[product] = (node if product is not node else moved,
                                          source, have.dim)

    def _linear_of_gathered(self, node: fx.Node) -> None:
        """A product reading a gathered shard keeps the shard for backward and gathers it
        again there (:func:`~partc.passes.tp.rules.regathers`): ``tp.linear_of_gathered``, or
        ``tp.addmm_of_gathered`` for an ``addmm`` of the flattened gathered value."""
        if node not in self.regather:
            return
        whole, shard, dim = self.regather.pop(node)
        if op_name(node) == "addmm":
            bias, matrix, weight = node.args
            # The flattening view, or the copy_to_tp the rewrite put after it.
            if whole not in (matrix, *matrix.all_input_nodes):
                raise AssertionError(f"{node.name}: reads {matrix}, not the flattened "
                                     f"gathered {whole.name}")
            self.to_method(node, "addmm_of_gathered", (bias, matrix, weight, shard, dim))
            return
        names = ("input", "weight", "bias")
        args = [node.args[i] if len(node.args) > i else node.kwargs.get(k)
                for i, k in enumerate(names)]
        if args[0] is not whole:
            raise AssertionError(f"{node.name}: reads {args[0]}, not the gathered {whole.name}")
        self.to_method(node, "linear_of_gathered", (whole, shard, args[1], args[2], dim))

    def _move(self, source: fx.Node, have: Placement, need: Placement, grad_partial: bool,
              before: fx.Node) -> fx.Node:
        # A move made before an in-place write to ``source`` holds the value before it:
        # consumers after the write get their own.
        writes = self.writes_seen.get(storage_of(source, aliases_input), 0)
        key = (source, writes, have, need, grad_partial)
        if key in self.moved:
            return self.moved[key]
        if redistribute(have, need, grad_partial) is None:
            raise AssertionError(f"{before.name}: cannot move {source.name} from {have} to {need}")
        call = _collective(have, need, grad_partial)
        if call is None:
            self.moved[key] = source
            return source
        method, args = call
        # Before the first consumer (nodes are visited in order), in its layer: the
        # consumers that share the move all come later.
        group = self.group(before)
        with self.gm.graph.inserting_before(before):
            moved = self.gm.graph.call_method(method, (group, source, *args))
        _set_layer(moved, before)
        self.moved[key] = moved
        return moved

    def _to_boundary(self, node: fx.Node, have: Placement, need: Placement) -> None:
        if have == need:
            return
        method, args = _collective(have, need, False)
        group = self.group(node)
        with self.gm.graph.inserting_after(self._last_write(node)):
            moved = self.gm.graph.call_method(method, (group, node, *args))
        _set_layer(moved, node)
        self.at_boundary[node] = moved

    def _last_write(self, node: fx.Node) -> fx.Node:
        """The last node of ``node``'s layer that writes its value in place after it
        (``h.relu_()`` after ``h = gelu(x)``), else ``node``: the value later layers read
        is the one after those writes."""
        layer = meta.layer(node).index
        later = [w for w in self.writers.get(storage_of(node, aliases_input), ())
                 if self.order[w] > self.order[node] and meta.layer(w).index == layer]
        return later[-1] if later else node

    # ------------------------------------------------------------------ sizes
    def _local_sizes(self, node: fx.Node, chosen) -> None:
        name = op_name(node)
        out = chosen.out
        if name in ("view", "reshape", "_unsafe_view", "expand") and out.kind == "S":
            self._divide_size_arg(node, out.dim)
        elif (name == "split" and chosen.ins and chosen.ins[0].kind == "S"
              and chosen.ins[0].chunks > 1):
            size = node.args[1] if len(node.args) > 1 else node.kwargs["split_size"]
            new = [self._divided(s, node) for s in size] if isinstance(size, (list, tuple)) \
                else self._divided(size, node)
            if len(node.args) > 1:
                node.update_arg(1, new)
            else:
                node.update_kwarg("split_size", new)
        elif name in ("linear", "addmm", "matmul") and chosen.name == "row-parallel":
            bias = (node.args[0] if name == "addmm" else
                    (node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")))
            if isinstance(bias, fx.Node):
                with self.gm.graph.inserting_before(node):
                    share = self.gm.graph.call_function(operator.truediv, (bias, self.tp))
                _set_layer(share, node)
                node.replace_input_with(bias, share)
        elif name in ("dropout", "native_dropout") and out.kind == "S":
            self._sharded_dropout(node, out)
        elif node.op == "call_module" and chosen.name == "vocab-parallel":
            self._vocab_parallel_loss(node)
        elif name == "embedding" and chosen.name == "vocab-parallel":
            if isinstance(node.target, torch._ops.OpOverload):
                weight, ids = node.args[:2]
                padding = node.args[2] if len(node.args) > 2 else -1
            else:
                ids, weight = node.args[:2]
                padding = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx")
            self.to_method(node, "vocab_parallel_embedding",
                           (ids, weight, -1 if padding is None else int(padding)))

    def _vocab_parallel_loss(self, node: fx.Node) -> None:
        """The loss reads its logits as this rank's slice of the classes: the user's loss
        run under ``partc.runtime.tp_loss.VocabParallelLoss``."""
        name = f"{node.target}_vocab_parallel"
        if name not in dict(self.gm.named_modules()):
            self.gm.add_submodule(name, VocabParallelLoss(
                self.gm.get_submodule(GROUP), self.gm.get_submodule(str(node.target)),
                meta.vocab_sharded(node, self.tp)))
        node.target = name

    def _sharded_dropout(self, node: fx.Node, out: Placement) -> None:
        """Dropout on a shard draws the whole tensor's mask and keeps its own part: the
        ranks' masks are independent where the values differ and equal where they are
        copies, and are those of the unsharded program (recompute replays them too)."""
        if node.op == "call_module":
            original = self.gm.get_submodule(str(node.target))
            name = f"{node.target}_shard{out.dim}x{out.chunks}"
            if name not in dict(self.gm.named_modules()):
                sharded = ShardedDropout(self.gm.get_submodule(GROUP), original.p, out.dim,
                                         out.chunks)
                sharded.train(original.training)
                self.gm.add_submodule(name, sharded)
            node.target = name
            return
        # aten.dropout(input, p, train) or F.dropout(input, p=0.5, training=True, ...)
        functional = not isinstance(node.target, torch._ops.OpOverload)
        names = ("input", "p", "training" if functional else "train")
        defaults = (None, 0.5, True)
        x, p, train = [node.args[i] if len(node.args) > i else node.kwargs.get(k, d)
                       for i, (k, d) in enumerate(zip(names, defaults))]
        self.to_method(node, op_name(node), (x, p, train, out.dim, out.chunks))

    def _divide_size_arg(self, node: fx.Node, dim: int) -> None:
        if node.op == "call_method":
            sizes = list(node.args[1:])
            if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)):
                new = list(sizes[0])
                new[dim] = self._divided(new[dim], node)
                node.update_arg(1, type(sizes[0])(new) if isinstance(sizes[0], tuple) else new)
            else:
                node.update_arg(1 + dim, self._divided(sizes[dim], node))
        else:
            new = list(node.args[1])
            new[dim] = self._divided(new[dim], node)
            node.update_arg(1, new)

    def _divided(self, size: Any, node: fx.Node) -> Any:
        if isinstance(size, int):
            return size if size == -1 else size // self.tp
        if isinstance(size, fx.Node):
            with self.gm.graph.inserting_before(node):
                local = self.gm.graph.call_function(operator.floordiv, (size, self.tp))
            _set_layer(local, node)
            return local
        raise ValueError(f"{node.name}: size {size!r} of a sharded dim cannot be made local")

    def _global_sizes(self, node: fx.Node) -> None:
        """``x.size()`` / ``x.size(i)`` of a sharded ``x`` → its global size."""
        name = op_name(node)
        if name not in ("size", "sym_size") or not node.args:
            return
        source = node.args[0]
        if not isinstance(source, fx.Node):
            return
        seen, have = self.seen_as(source, node)
        if seen is not source:
            node.replace_input_with(source, seen)
        if have.kind != "S":
            return
        index = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        self.to_method(node, "global_size",
                       (seen, have.dim) + ((index,) if index is not None else ()))


def fuse_rings(gm: fx.GraphModule) -> None:
    """Fuse each sequence-parallel collective with the linears next to it, where the
    runtime can run them as one ring: a ``gather_from_tp`` whose every reader is a
    ``linear_of_gathered`` of its layer becomes one ``linears_of_gathered`` (the linears'
    parameters fetched before it); a ``reduce_scatter_to_tp`` of a linear that nothing
    else reads becomes ``linear_reduce_scatter``. The collectives they run are those
    they replace."""
    # Positions before fusing. Fusing only moves ``get_attr`` nodes (no inputs) earlier,
    # which is always safe, so a stale position at worst moves one earlier again.
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op != "call_method":
            continue
        if node.target == "gather_from_tp":
            _as_linears(gm, node, order)
            _fuse_gathered_linears(gm, node, order)
        elif node.target == "reduce_scatter_to_tp":
            _fuse_linear_reduce_scatter(node, order)


def _fuse_gathered_linears(gm: fx.GraphModule, gather: fx.Node,
                           order: dict[fx.Node, int]) -> None:
    readers = list(gather.users)
    layer = meta.layer(gather).index
    if not readers or any(r.op != "call_method" or r.target != "linear_of_gathered"
                          or r.args[1] is not gather or meta.layer(r).index != layer
                          or not _cuts_rows(r, r.args[5]) for r in readers):
        return
    first = min(readers, key=order.__getitem__)
    params = [a for r in readers for a in r.args[3:5] if isinstance(a, fx.Node)]
    late = [a for a in params if order[a] > order[first]]
    if any(a.op != "get_attr" for a in late):
        return   # a parameter computed after the first linear: left as it is
    for fetched in late:
        first.prepend(fetched)
    group, shard, dim = first.args[0], first.args[2], first.args[5]
    with gm.graph.inserting_before(first):
        fused = gm.graph.call_method(LINEARS_OF_GATHERED, (
            group, shard, tuple(r.args[3] for r in readers),
            tuple(r.args[4] for r in readers), dim))
    _set_layer(fused, first)
    for index, reader in enumerate(readers):
        reader.op, reader.target = "call_function", operator.getitem
        reader.args, reader.kwargs = (fused, index), {}
    gm.graph.erase_node(gather)


def _as_linears(gm: fx.GraphModule, gather: fx.Node, order: dict[fx.Node, int]) -> None:
    """GPT-2's ``Conv1D`` reading a gathered shard, ``addmm_of_gathered(bias,
    gathered.view(-1, in), weight)`` (through the ``copy_to_tp`` whose backward
    all-reduces the flattened input's gradient), as the ``linear_of_gathered`` it is:
    ``linear_of_gathered(gathered, weight.t(), bias).flatten(0, -2)``, so that
    :func:`_fuse_gathered_linears` makes a ring of it as of a linear (whose backward
    reduce-scatters the input's gradient where the copy all-reduced it and the gather
    sliced it). Left as it is unless every reader of the gather is such a product of its
    layer, cutting rows."""
    layer = meta.layer(gather).index
    local = gather.args[1].meta.get("val") if isinstance(gather.args[1], fx.Node) else None
    products = []
    for view in gather.users:
        value = view.meta.get("val")
        if (view.op != "call_function" or op_name(view) not in ("view", "reshape")
                or len(view.users) != 1 or not isinstance(value, torch.Tensor)
                or not isinstance(local, torch.Tensor) or value.dim() != 2
                or local.dim() < 2 or value.shape[-1] != local.shape[-1]):
            return
        product = next(iter(view.users))
        copy = None
        if product.op == "call_method" and product.target == "copy_to_tp" \
                and len(product.users) == 1:
            copy, product = product, next(iter(product.users))
        if (product.op != "call_method" or product.target != "addmm_of_gathered"
                or product.args[2] is not (copy or view) or product.kwargs
                or meta.layer(product).index != layer
                or product.args[5] % local.dim() == local.dim() - 1):
            return
        products.append((view, copy, product))
    if not products:
        return
    for view, copy, product in products:
        group, bias, _matrix, weight, shard, dim = product.args
        transposed = _transposed(weight, product, order)
        with gm.graph.inserting_before(product):
            linear = gm.graph.call_method("linear_of_gathered",
                                          (group, gather, shard, transposed, bias, dim))
            flat = gm.graph.call_function(torch.flatten, (linear, 0, -2))
        # The gathered shape: the shard's, its rows as many as the flattened product's.
        whole = list(local.shape)
        whole[dim] = product.meta["val"].shape[0] * local.shape[dim] // math.prod(
            local.shape[:-1])
        whole[-1] = product.meta["val"].shape[-1]
        linear.meta["val"] = local.new_empty(whole)
        for node in (linear, flat):
            _set_layer(node, product)
            order[node] = order[product]
        product.replace_all_uses_with(flat)
        for dead in (product, copy, view):
            if dead is not None:
                gm.graph.erase_node(dead)


def _transposed(weight: fx.Node, user: fx.Node, order: dict[fx.Node, int]) -> fx.Node:
    """``weight.t()`` (a ``Conv1D``'s (in, out) weight as a linear's), right after the
    weight, so that it is there before any ring its user joins."""
    with weight.graph.inserting_after(weight):
        transposed = weight.graph.call_function(torch.t, (weight,))
    _set_layer(transposed, user)
    order[transposed] = order[weight]
    return transposed


def _addmm_as_linear(scatter: fx.Node, order: dict[fx.Node, int]) -> None:
    """GPT-2's row-parallel ``Conv1D`` before a reduce-scatter, ``addmm(bias,
    x.view(-1, in), weight).view(..., out)``, as the linear it is, ``F.linear(x,
    weight.t(), bias)``, for :func:`_fuse_linear_reduce_scatter` to make a ring of."""
    unflat = scatter.args[1]
    if unflat.op != "call_function" or op_name(unflat) not in ("view", "reshape") \
            or len(unflat.users) != 1 or not isinstance(unflat.args[0], fx.Node):
        return
    product = unflat.args[0]
    if product.op != "call_function" or op_name(product) != "addmm" \
            or len(product.users) != 1 or product.kwargs or len(product.args) != 3:
        return
    bias, matrix, weight = product.args
    if not isinstance(matrix, fx.Node) or matrix.op != "call_function" \
            or op_name(matrix) not in ("view", "reshape") \
            or not isinstance(matrix.args[0], fx.Node):
        return
    x = matrix.args[0]
    values = [n.meta.get("val") for n in (x, matrix, unflat)]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return
    x_value, matrix_value, out_value = values
    if matrix_value.dim() != 2 or x_value.shape[-1] != matrix_value.shape[-1] \
            or tuple(out_value.shape[:-1]) != tuple(x_value.shape[:-1]):
        return
    transposed = _transposed(weight, product, order)
    with product.graph.inserting_before(product):
        linear = product.graph.call_function(torch.nn.functional.linear,
                                             (x, transposed, bias))
    linear.meta["val"] = out_value
    _set_layer(linear, product)
    order[linear] = order[product]
    unflat.replace_all_uses_with(linear)
    for dead in (unflat, product):
        dead.graph.erase_node(dead)
    if not matrix.users:
        matrix.graph.erase_node(matrix)


def _fuse_linear_reduce_scatter(scatter: fx.Node, order: dict[fx.Node, int]) -> None:
    _addmm_as_linear(scatter, order)
    group, linear, dim = scatter.args
    if (linear.op != "call_function" or op_name(linear) != "linear"
            or len(linear.users) != 1 or group.op != "get_attr"
            or meta.layer(linear).index != meta.layer(scatter).index
            or not _cuts_rows(linear, dim)):
        return
    names = ("input", "weight", "bias")
    x, weight, bias = [linear.args[i] if len(linear.args) > i else linear.kwargs.get(k)
                       for i, k in enumerate(names)]
    if order[group] > order[linear]:   # the layer's group was first read after the linear
        linear.prepend(group)
    linear.op, linear.target = "call_method", LINEAR_REDUCE_SCATTER
    linear.args, linear.kwargs = (group, x, weight, bias, dim), {}
    scatter.replace_all_uses_with(linear)
    scatter.graph.erase_node(scatter)


def _cuts_rows(linear: fx.Node, dim: int) -> bool:
    """Whether ``dim`` of a linear's input and output (``linear``'s value, as traced) is
    one of rows (batch, sequence) and not the features it maps: a ring cuts the matmul
    into chunks of rows, so a linear reduce-scattered along its output features (a
    vocabulary-parallel head), or reading its input gathered along its input features,
    keeps its blocking collective."""
    value = linear.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dim() > 1 \
        and dim % value.dim() != value.dim() - 1


def _collective(have: Placement, need: Placement, grad_partial: bool
                ) -> tuple[str, tuple] | None:
    """The group's method that moves a value from ``have`` to ``need``, and its
    arguments after the value (None: nothing to do)."""
    if have == need:
        return ("copy_to_tp", ()) if grad_partial else None
    if have.kind == "P" and need.kind == "R":
        return "reduce_from_tp", (grad_partial,) if grad_partial else ()
    if have.kind == "P" and need.kind == "S":
        return "reduce_scatter_to_tp", (need.dim,)
    if have.kind == "S" and need.kind == "R":
        args = (have.dim,) + ((have.chunks,) if have.chunks != 1 or grad_partial else ())
        return "gather_from_tp", args + ((True,) if grad_partial else ())
    if have.kind == "R" and need.kind == "S":
        return "scatter_to_tp", (need.dim,)
    raise AssertionError(f"no collective moves {have} to {need}")


def _set_layer(node: fx.Node, like: fx.Node) -> None:
    meta.set_layer(node, meta.layer(like))
    if meta.MODULE_PATH in like.meta:
        meta.set_module_path(node, meta.module_path(like))


def _relayer(gm: fx.GraphModule, sharding: Sharding) -> None:
    """Rebuild each layer's node list (in graph order) after nodes were added."""
    infos = meta.layers(gm)
    members: dict[int, list[str]] = {info.index: [] for info in infos}
    for node in gm.graph.nodes:
        if meta.LAYER in node.meta and node.op not in ("placeholder", "output"):
            members.setdefault(meta.layer(node).index, []).append(node.name)
    by_name = {node.name: node for node in gm.graph.nodes}

    def signature(info: meta.LayerInfo) -> str:
        # Layers that shared a signature may now differ (a different boundary placement
        # brought different collectives): the ops, their constant arguments and the
        # placements chosen decide. Values inside an argument (a size in a view's shape)
        # count by place, not by name, and parameters by their name inside the layer, so
        # that like blocks sign alike wherever they sit in the graph.
        fetched: dict[str, int] = {}
        ops = [f"{_op(by_name[name], info.key, fetched)}{_constants(by_name[name])}"
               f"{sharding.placement(by_name[name])}" for name in members[info.index]]
        digest = hashlib.sha256("|".join(ops).encode()).hexdigest()[:8]
        return f"{info.signature}:{digest}"

    meta.set_layers(gm, tuple(dataclasses.replace(info, nodes=tuple(members[info.index]),
                                                  signature=signature(info))
                              for info in infos))


def _op(node: fx.Node, key: str, fetched: dict[str, int]) -> str:
    if node.op == "get_attr":
        return f"get_attr {attribute_place(node, key, fetched)}"
    return op_name(node)


def _constants(node: fx.Node) -> list:
    return [fx.node.map_arg(a, lambda _: "%") for a in signed_args(node)
            if not isinstance(a, fx.Node)]
