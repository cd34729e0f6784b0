"""Choose how each layer's tensors are split across a tensor-parallel group.

Every node that makes a tensor gets a list of *strategies*, each a placement for its
output and the placement it needs of each tensor input, worked out from the op and the
shapes alone (no table of module names): a linear can be replicated, column-parallel
(weight ``Shard(0)``, output sharded on its last dim) or row-parallel (weight
``Shard(1)``, input sharded, output ``Partial()``); an elementwise op keeps any shard its
inputs share; a view carries a shard into the dim it becomes; an embedding can be
vocabulary-parallel. Where a producer's placement differs from what a consumer needs,
a collective moves the value (all-reduce, all-gather, reduce-scatter, or a free local
slice), and its gradient moves the conjugate way.

Within a layer a small CP-SAT model picks one strategy per node to minimise compute
(sharded ops do 1/tp of the work) plus communication, forward and backward, with the
layer's inputs and outputs in a fixed *boundary placement*: ``Replicate()``, or, with
sequence parallelism, ``Shard(1)`` (the sequence dim) for the hidden states that flow
from layer to layer. Layers with the same signature are solved once. A parameter that
several layers use gets one placement for all of them.

Megatron-LM's layouts come out of this search rather than going into it: attention split
by heads (QKV column-parallel, output projection row-parallel), the MLP column-then-row,
the embedding vocabulary-parallel, the LM head column-parallel followed by a gather.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from ortools.sat.python import cp_model
from torch import fx

from partc import meta
from partc.collectives import Group, collective_seconds
from partc.placement import PARTIAL, REPLICATE, Placement, Shard

from .graph import carries_grad, is_tensorish, layer_nodes, op_name, tensor_inputs


ANY = Placement("*")  # x.new_ones(...) reads x's dtype and device: any placement will do


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: what it needs of each tensor input, what it makes."""

    name: str
    out: Placement
    ins: tuple[Placement, ...]  # one per tensor input, in ``tensor_inputs`` order


def _shape(node: fx.Node) -> tuple[int, ...]:
    value = node.meta["val"]
    if isinstance(value, (tuple, list)):
        value = value[0]
    return tuple(int(d) for d in value.shape)


# ------------------------------------------------------------------------------- costs

@dataclass(frozen=True)
class Link:
    """What the cost of a choice depends on: the group's communicator, priced by
    :mod:`partc.collectives` as the cost model prices it, and the device."""

    group: Group
    flops: float            # achievable FLOP/s
    hbm_bandwidth: float

    @property
    def tp(self) -> int:
        return self.group.ranks


@dataclass(frozen=True)
class Collective:
    kind: str           # all_reduce, all_gather, reduce_scatter
    phase: str          # forward or backward
    bytes: int          # of the whole tensor


def redistribute(src: Placement, dst: Placement, grad_partial: bool
                 ) -> tuple[tuple[str, str], ...] | None:
    """The collectives (kind, phase) that move a value from ``src`` to ``dst``.

    ``grad_partial``: the consumer leaves a partial gradient that must be summed. ``None``
    when the move is not supported. A free local slice is the empty tuple (but for its
    backward all-gather).
    """
    if dst.kind == "*":
        return ()
    if dst.kind == "P":
        return () if src == dst else None
    if src == dst:
        return (("all_reduce", "backward"),) if grad_partial and src.kind == "R" else ()
    if src.kind == "R":
        if dst.kind == "S" and dst.chunks == 1:
            return (("all_gather", "backward"),)
        return None
    if src.kind == "P":
        if dst.kind == "R":
            return (("all_reduce", "forward"),) + ((("all_reduce", "backward"),) if grad_partial else ())
        if dst.chunks == 1:
            return (("reduce_scatter", "forward"), ("all_gather", "backward"))
        return None
    # src is a shard
    if dst.kind == "R":
        back = ("reduce_scatter" if src.chunks == 1 else "all_reduce") if grad_partial else None
        return (("all_gather", "forward"),) + (((back, "backward"),) if back else ())
    return None  # shard to another shard: not needed by any strategy


# ------------------------------------------------------------------------------- rules

_ELEMENTWISE = {
    "add", "sub", "mul", "div", "truediv", "neg", "pow", "rsqrt", "sqrt", "exp", "tanh",
    "gelu", "silu", "relu", "sigmoid", "to", "type", "float", "half", "bfloat16",
    "dropout", "clone", "contiguous", "masked_fill", "where", "alias", "_to_copy", "abs",
    "erf", "sin", "cos", "square", "reciprocal", "log", "softplus", "mish", "leaky_relu",
    "native_dropout", "detach", "lift_fresh_copy", "fill", "invert", "eq", "ne", "lt",
    "le", "gt", "ge", "logical_not", "bitwise_not",
}
_LINEAR_UNARY = {"neg", "to", "type", "float", "half", "bfloat16", "clone", "contiguous",
                 "alias", "_to_copy", "detach"}
_VIEWS = {"view", "reshape", "_unsafe_view"}
_METADATA_ONLY = {"new_ones", "new_zeros", "new_empty", "new_full"}
_NO_STRATEGY_OPS = {"_assert_tensor_metadata", "size", "sym_size", "dim", "getattr"}


def strategies(node: fx.Node, tp: int) -> list[Strategy]:
    """Every way ``node`` can run on a group of ``tp``; the first is always replicated."""
    inputs = tensor_inputs(node)
    replicated = Strategy("replicate", REPLICATE, tuple(REPLICATE for _ in inputs))
    if node.op != "call_function" and node.op != "call_method":
        return [replicated]
    name = op_name(node)
    if name in _METADATA_ONLY:
        return [Strategy("reads dtype and device", REPLICATE, tuple(ANY for _ in inputs))]
    rule = _RULES.get(name)
    if rule is None and name in _ELEMENTWISE:
        rule = _elementwise
    if rule is None or not inputs or not is_tensorish(node):
        return [replicated]
    found = []
    try:
        found = rule(node, inputs, tp)
    except (IndexError, TypeError, ValueError, KeyError):
        found = []  # an unusual call signature: stay replicated
    seen, result = set(), [replicated]
    for strategy in found:
        key = (strategy.out, strategy.ins)
        if key not in seen and key != (replicated.out, replicated.ins):
            seen.add(key)
            result.append(strategy)
    return result


def _ndim(node: fx.Node) -> int:
    return len(_shape(node))


def _divides(size: int, tp: int, chunks: int = 1) -> bool:
    return size % (tp * chunks) == 0 and size >= tp * chunks


def _elementwise(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    out = _shape(node)
    n = len(out)
    result = []
    for d in range(1 if n > 1 else 0, n):
        for chunks in _chunk_options(inputs):
            if not _divides(out[d], tp, chunks):
                continue
            ins, any_shard = [], False
            for a in inputs:
                shape = _shape(a)
                da = d - (n - len(shape))
                if da < 0 or shape[da] == 1 and out[d] != 1:
                    ins.append(REPLICATE)
                else:
                    ins.append(Shard(da, chunks))
                    any_shard = True
            if any_shard:
                result.append(Strategy(f"shard dim {d}", Shard(d, chunks), tuple(ins)))
    name = op_name(node)
    tensors_in_args = [a for a in node.args if isinstance(a, fx.Node) and a in inputs]
    if name in _LINEAR_UNARY and len(inputs) == 1:
        result.append(Strategy("partial", PARTIAL, (PARTIAL,)))
    elif name in ("mul", "div", "truediv") and len(inputs) == 1 and len(tensors_in_args) == 1:
        result.append(Strategy("partial", PARTIAL, (PARTIAL,)))
    elif name in ("add", "sub") and len(inputs) == len(tensors_in_args) == 2:
        if all(_shape(a) == out for a in inputs):
            result.append(Strategy("partial", PARTIAL, (PARTIAL, PARTIAL)))
    return result


def _chunk_options(inputs: Iterable[fx.Node]) -> list[int]:
    options = {1}
    for a in inputs:
        options.update(_CHUNK_HINTS.get(a, ()))
    return sorted(options)


# Values that are split into k equal pieces along a dim downstream: node → {k}.
_CHUNK_HINTS: dict[fx.Node, set[int]] = {}


def _view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of dims of ``src`` and ``dst`` with equal products (a reshape's blocks)."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        if i < len(src):
            gi.append(i)
            pi = src[i]
            i += 1
        if j < len(dst):
            gj.append(j)
            pj = dst[j]
            j += 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i)
                pi *= src[i]
                i += 1
            elif j < len(dst):
                gj.append(j)
                pj *= dst[j]
                j += 1
            else:
                return []
        groups.append((gi, gj))
    return groups


def _view(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    src, dst = _shape(inputs[0]), _shape(node)
    result = []
    for gi, gj in _view_groups(src, dst):
        first_in = next((i for i in gi if src[i] != 1), None)
        first_out = next((j for j in gj if dst[j] != 1), None)
        if first_in is None or first_out is None or first_out == 0:
            continue
        one_to_one = len([i for i in gi if src[i] != 1]) == 1 and \
            len([j for j in gj if dst[j] != 1]) == 1
        for chunks in _chunk_options(inputs):
            if chunks > 1 and not one_to_one:
                continue
            if _divides(src[first_in], tp, chunks) and _divides(dst[first_out], tp, chunks):
                result.append(Strategy(f"shard dim {first_out}", Shard(first_out, chunks),
                                       (Shard(first_in, chunks),)))
    result.append(Strategy("partial", PARTIAL, (PARTIAL,)))
    return result


def _permutation(node: fx.Node, inputs: list[fx.Node]) -> list[int | None]:
    """For each output dim, the input dim it comes from (``None``: a new dim)."""
    n_in = _ndim(inputs[0])
    name = op_name(node)
    args = node.args[1:]
    if name in ("transpose", "swapaxes"):
        a, b = (int(x) % n_in for x in args[:2])
        perm: list[int | None] = list(range(n_in))
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    if name == "t":
        return [1, 0] if n_in == 2 else list(range(n_in))
    if name == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
        return [int(d) % n_in for d in dims]
    if name == "unsqueeze":
        d = int(args[0]) % (n_in + 1)
        return [i if i < d else (None if i == d else i - 1) for i in range(n_in + 1)]
    if name == "squeeze":
        out_rank = _ndim(node)
        src = _shape(inputs[0])
        dims = args[0] if args else None
        if dims is None:
            keep = [i for i in range(n_in) if src[i] != 1]
        else:
            dims = {int(x) % n_in for x in (dims if isinstance(dims, (list, tuple)) else [dims])}
            keep = [i for i in range(n_in) if not (i in dims and src[i] == 1)]
        return keep if len(keep) == out_rank else []
    raise ValueError(name)


def _permute(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    perm = _permutation(node, inputs)
    src = _shape(inputs[0])
    result = []
    for d, from_dim in enumerate(perm):
        if from_dim is None or (d == 0 and len(perm) > 1) or src[from_dim] == 1:
            continue
        for chunks in _chunk_options(inputs):
            if _divides(src[from_dim], tp, chunks):
                result.append(Strategy(f"shard dim {d}", Shard(d, chunks), (Shard(from_dim, chunks),)))
    result.append(Strategy("partial", PARTIAL, (PARTIAL,)))
    return result


def _expand(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    src, out = _shape(inputs[0]), _shape(node)
    offset = len(out) - len(src)
    result = []
    for d in range(1, len(out)):
        da = d - offset
        if da >= 0 and src[da] == out[d] and src[da] != 1 and _divides(out[d], tp):
            result.append(Strategy(f"shard dim {d}", Shard(d), (Shard(da),)))
    return result


def _dim_arg(node: fx.Node, position: int, name: str, default: Any = None) -> Any:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _split(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    src = _shape(inputs[0])
    n = len(src)
    dim = int(_dim_arg(node, 2, "dim", 0)) % n
    pieces = [tuple(int(s) for s in v.shape) for v in node.meta["val"]]
    result = []
    for d in range(1, n):
        if d != dim and _divides(src[d], tp):
            result.append(Strategy(f"shard dim {d}", Shard(d), (Shard(d),)))
    k = len(pieces)
    if k > 1 and len({p[dim] for p in pieces}) == 1 and _divides(src[dim], tp, k) and dim > 0:
        result.append(Strategy(f"shard dim {dim} per piece", Shard(dim), (Shard(dim, k),)))
    return result


def _getitem(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    source = inputs[0]
    if isinstance(source.meta.get("val"), torch.Tensor):
        return []  # indexing a tensor: replicated only
    options = {s.out for s in strategies(source, tp)}
    return [Strategy(str(p), p, (p,)) for p in sorted(options) if p.kind != "R"]


def _keep_dims(node: fx.Node, inputs: list[fx.Node], tp: int, reduced: set[int],
               keepdim: bool) -> list[Strategy]:
    src = _shape(inputs[0])
    result = []
    for d in range(1, len(src)):
        if d in reduced or not _divides(src[d], tp):
            continue
        out_d = d if keepdim else d - sum(1 for r in reduced if r < d)
        result.append(Strategy(f"shard dim {out_d}", Shard(out_d), (Shard(d),)
                               + tuple(REPLICATE for _ in inputs[1:])))
    return result


def _reduction(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    n = _ndim(inputs[0])
    dims = _dim_arg(node, 1, "dim", None)
    if dims is None:
        return []
    dims = {int(d) % n for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    keepdim = bool(_dim_arg(node, 2, "keepdim", False))
    result = _keep_dims(node, inputs, tp, dims, keepdim)
    result.append(Strategy("partial", PARTIAL, (PARTIAL,)))
    return result


def _softmax(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    n = _ndim(inputs[0])
    dim = int(_dim_arg(node, 1, "dim")) % n
    return _keep_dims(node, inputs, tp, {dim}, True)


def _slice(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    n = _ndim(inputs[0])
    dim = int(_dim_arg(node, 1, "dim", 0)) % n
    keep = op_name(node) != "select"
    return _keep_dims(node, inputs, tp, {dim}, keep)


def _cat(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    n = _ndim(node)
    dim = int(_dim_arg(node, 1, "dim", 0)) % n
    result = []
    for d in range(1, n):
        if d != dim and all(_ndim(a) == n and _divides(_shape(a)[d], tp) for a in inputs):
            result.append(Strategy(f"shard dim {d}", Shard(d), tuple(Shard(d) for _ in inputs)))
    return result


def _layer_norm(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    x = node.args[0]
    n = _ndim(x)
    normalized = node.args[1] if len(node.args) > 1 else node.kwargs["normalized_shape"]
    first_normalized = n - len(normalized)
    result = []
    for d in range(1, first_normalized):
        if _divides(_shape(x)[d], tp):
            result.append(Strategy(f"shard dim {d}", Shard(d),
                                   tuple(Shard(d) if a is x else REPLICATE for a in inputs)))
    return result


def _linear_like(node: fx.Node, x: fx.Node, w: fx.Node, b: fx.Node | None,
                 inputs: list[fx.Node], tp: int, weight_out_dim: int) -> list[Strategy]:
    """Column- and row-parallel forms of ``x @ w`` (+ ``b``) with w's output dim given."""
    out_rank = _ndim(node)
    w_shape = _shape(w)
    w_in_dim = 1 - weight_out_dim
    result = []
    for chunks in sorted({1} | _CHUNK_HINTS.get(node, set())):
        if _divides(w_shape[weight_out_dim], tp, chunks):
            need = {x: REPLICATE, w: Shard(weight_out_dim, chunks)}
            if b is not None:
                need[b] = Shard(_ndim(b) - 1, chunks)
            result.append(Strategy("column-parallel", Shard(out_rank - 1, chunks),
                                   tuple(need[a] for a in inputs)))
    if _divides(w_shape[w_in_dim], tp) and x is not w:
        need = {x: Shard(_ndim(x) - 1), w: Shard(w_in_dim)}
        if b is not None:
            need[b] = REPLICATE
        result.append(Strategy("row-parallel", PARTIAL, tuple(need[a] for a in inputs)))
    return result


def _linear(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    x, w = node.args[0], node.args[1]
    b = _dim_arg(node, 2, "bias", None)
    if _ndim(w) != 2 or x is w or b is x or b is w:
        return []
    return _linear_like(node, x, w, b if isinstance(b, fx.Node) else None, inputs, tp, 0)


def _addmm(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    b, x, w = node.args[:3]
    if len({b, x, w}) != 3 or not all(isinstance(a, fx.Node) for a in (b, x, w)):
        return []
    return _linear_like(node, x, w, b, inputs, tp, 1)


def _matmul(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    a, b = node.args[:2]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or a is b:
        return []
    out = _shape(node)
    n = len(out)
    result = []
    if _ndim(b) == 2 and _ndim(a) >= 2:
        result += _linear_like(node, a, b, None, inputs, tp, 1)
    for d in range(1, n - 2):
        need = {}
        for operand in (a, b):
            shape = _shape(operand)
            da = d - (n - len(shape))
            need[operand] = REPLICATE if da < 0 or shape[da] == 1 else Shard(da)
        if any(p.is_shard for p in need.values()) and _divides(out[d], tp):
            result.append(Strategy(f"shard dim {d}", Shard(d), tuple(need[x] for x in inputs)))
    return result


def _sdpa(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    q, k, v = node.args[:3]
    if _ndim(q) != 4 or not _divides(_shape(q)[1], tp) or not _divides(_shape(k)[1], tp):
        return []
    need = {}
    for a in inputs:
        shape = _shape(a)
        da = 1 - (4 - len(shape))
        need[a] = Shard(1) if a in (q, k, v) else (
            REPLICATE if da < 0 or shape[da] == 1 else Shard(da))
    return [Strategy("shard heads", Shard(1), tuple(need[a] for a in inputs))]


def _embedding(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        w, ids = node.args[:2]
    else:
        ids, w = node.args[:2]
    if not isinstance(w, fx.Node) or _ndim(w) != 2 or ids is w:
        return []
    rows, width = _shape(w)
    result = []
    if _divides(rows, tp):
        result.append(Strategy("vocab-parallel", PARTIAL,
                               tuple(Shard(0) if a is w else REPLICATE for a in inputs)))
    if _divides(width, tp):
        result.append(Strategy("column-parallel", Shard(_ndim(node) - 1),
                               tuple(Shard(1) if a is w else REPLICATE for a in inputs)))
    return result


_RULES = {
    **{name: _view for name in _VIEWS},
    **{name: _permute for name in ("transpose", "swapaxes", "t", "permute", "unsqueeze", "squeeze")},
    "expand": _expand, "split": _split, "chunk": _split, "getitem": _getitem,
    "mean": _reduction, "sum": _reduction, "softmax": _softmax, "log_softmax": _softmax,
    "_softmax": _softmax, "slice": _slice, "select": _slice, "narrow": _slice, "cat": _cat,
    "layer_norm": _layer_norm, "linear": _linear, "addmm": _addmm, "matmul": _matmul,
    "scaled_dot_product_attention": _sdpa, "embedding": _embedding,
}


# ----------------------------------------------------------------------- the choice

@dataclass(frozen=True)
class LayerSharding:
    """What was chosen for one layer, in the words the report uses."""

    name: str
    choices: tuple[int, ...]            # strategy index per node of the layer (-1: none)
    params: tuple[tuple[str, str], ...]  # (parameter FQN, placement) for the layer's own
    collectives: tuple[Collective, ...]  # per step of the traced batch, whole tensors
    note: str = ""                       # why the layer stays replicated, when it does


@dataclass
class Sharding:
    """The result of :func:`choose` (or :func:`apply`): a strategy for every node."""

    tp: int
    sequence_parallel: bool
    strategy: dict[fx.Node, Strategy] = field(default_factory=dict)
    boundary: dict[fx.Node, Placement] = field(default_factory=dict)
    layers: tuple[LayerSharding, ...] = ()
    # Replicated parameters whose gradient is partial on every rank (they feed sharded
    # ops only): their gradients are all-reduced over the group once per step.
    partial_grad_params: frozenset[str] = frozenset()

    def placement(self, node: fx.Node) -> Placement:
        chosen = self.strategy.get(node)
        return chosen.out if chosen is not None else REPLICATE

    def param_placements(self) -> dict[str, Placement]:
        result = {}
        for node, chosen in self.strategy.items():
            if node.op == "get_attr":
                for fqn in meta.params(node):
                    result[fqn] = chosen.out
        return result


def sequence_length(gm: fx.GraphModule) -> int:
    """Tokens per sample: dim 1 of the first integer 2-D input (0 if there is none)."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and meta.role(node) != meta.ROLE_TARGET:
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point():
                return int(value.shape[1])
            return 0
    return 0


def boundaries(gm: fx.GraphModule, tp: int, sequence_parallel: bool) -> dict[fx.Node, Placement]:
    """The placement of every value that crosses from one layer to another."""
    grads = carries_grad(gm)
    seq = sequence_length(gm) if sequence_parallel else 0
    loss_layers = {info.index for info in meta.layers(gm) if info.is_loss}
    result = {}
    for node in gm.graph.nodes:
        if node.op in ("output", "get_attr") or not is_tensorish(node):
            continue
        here = meta.layer(node).index if node.op != "placeholder" else -1
        users = list(node.users)
        crossing = [u for u in users if u.op == "output" or meta.layer(u).index != here]
        if not crossing:
            continue
        value = node.meta["val"]
        hidden = (seq and node in grads and isinstance(value, torch.Tensor)
                  and value.is_floating_point() and value.dim() == 3
                  and int(value.shape[1]) == seq and _divides(seq, tp)
                  and not any(u.op == "output" or meta.layer(u).index in loss_layers
                              for u in crossing))
        result[node] = Shard(1) if hidden else REPLICATE
    return result


def _chunk_hints(gm: fx.GraphModule) -> dict[fx.Node, set[int]]:
    """Nodes whose output is later split into k equal pieces along a sharded-capable dim."""
    hints: dict[fx.Node, set[int]] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or op_name(node) not in ("split", "chunk"):
            continue
        value = node.meta.get("val")
        if not isinstance(value, (tuple, list)) or len(value) < 2:
            continue
        if len({tuple(v.shape) for v in value}) != 1:
            continue
        k, source = len(value), node.args[0]
        while isinstance(source, fx.Node):
            hints.setdefault(source, set()).add(k)
            name = op_name(source)
            if name in ("linear", "addmm", "matmul") or source.op not in ("call_function", "call_method"):
                break
            if name not in _VIEWS and name not in _ELEMENTWISE:
                break
            inputs = tensor_inputs(source)
            if len(inputs) != 1:
                break
            source = inputs[0]
    return hints


def choose(gm: fx.GraphModule, tp: int, link: Link, *, sequence_parallel: bool = False,
           prefer: str = "time") -> Sharding:
    """Pick every node's strategy for a group of ``tp``, layer by layer.

    Reads ``meta.LAYERS``, ``meta.LAYER``, ``meta.COST``, ``node.meta["val"]``. Requires
    ``estimate``. ``prefer="memory"`` puts parameter bytes first and time second.
    Returns a :class:`Sharding`; ``gm`` is not changed.
    """
    with _layer_problems(gm, tp, link, sequence_parallel) as (result, problems, grads):
        pins: dict[str, Placement] = {}
        # Solutions by layer key, shared by the trials: a pin changes only the keys of
        # the layers that use the pinned parameter.
        cache: dict[tuple, tuple[list[int], int]] = {}
        solved = _solve_all(problems, pins, prefer, cache)
        # A parameter several layers use has one placement: try each the layers chose.
        for fqn, options in _disagreements(problems, solved).items():
            best = None
            for option in sorted(options):
                trial = _solve_all(problems, {**pins, fqn: option}, prefer, cache)
                total = sum(cost for _, cost in trial)
                if best is None or total < best[0]:
                    best = (total, option)
            pins[fqn] = best[1]
            solved = _solve_all(problems, pins, prefer, cache)
        return _apply_choices(gm, result, problems, [c for c, _ in solved], grads)


def apply(gm: fx.GraphModule, tp: int, sequence_parallel: bool,
          choices: dict[str, tuple[int, ...]]) -> Sharding:
    """Rebuild a :class:`Sharding` from a plan's per-layer strategy indices."""
    # Costs play no part in rebuilding: any link will do.
    link = Link(group=Group(ranks=tp, bandwidth=1.0, latency_s=0.0), flops=1.0,
                hbm_bandwidth=1.0)
    with _layer_problems(gm, tp, link, sequence_parallel) as (result, problems, grads):
        picked = []
        for problem in problems:
            indices = choices.get(problem.info.name)
            if indices is None or len(indices) != len(problem.items):
                raise ValueError(f"layer {problem.info.name}: the plan's sharding has "
                                 f"{len(indices or ())} node choices, the traced layer "
                                 f"{len(problem.items)}")
            picked.append(dict(zip(problem.items, indices)))
        return _apply_choices(gm, result, problems, picked, grads)


@contextlib.contextmanager
def _layer_problems(gm: fx.GraphModule, tp: int, link: Link, sequence_parallel: bool
                    ) -> Iterator[tuple[Sharding, list, set]]:
    """An empty Sharding with its boundaries, one problem per layer, and the nodes that
    carry gradients; the split hints the strategy rules read hold within the block."""
    global _CHUNK_HINTS
    _CHUNK_HINTS = _chunk_hints(gm)
    try:
        result = Sharding(tp=tp, sequence_parallel=sequence_parallel)
        result.boundary = boundaries(gm, tp, sequence_parallel)
        grads = carries_grad(gm)
        problems = [_LayerProblem(gm, info, tp, link, result.boundary, grads)
                    for info in meta.layers(gm)]
        yield result, problems, grads
    finally:
        _CHUNK_HINTS = {}


class _LayerProblem:
    """One layer's nodes, their strategies, and the edges between them."""

    def __init__(self, gm: fx.GraphModule, info: meta.LayerInfo, tp: int, link: Link,
                 boundary: dict[fx.Node, Placement], grads: set[fx.Node]) -> None:
        self.info, self.tp, self.link = info, tp, link
        self.boundary, self.grads = boundary, grads
        nodes = layer_nodes(gm, info)
        members = set(nodes)
        self.members = members
        computed = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")
                    and is_tensorish(n) and op_name(n) not in _NO_STRATEGY_OPS]
        self.options: dict[fx.Node, list[Strategy]] = {n: strategies(n, tp) for n in computed}
        params: dict[fx.Node, set[Placement]] = {}
        for n in computed:
            for position, a in enumerate(tensor_inputs(n)):
                if a.op == "get_attr":
                    wanted = params.setdefault(a, {REPLICATE})
                    wanted.update(s.ins[position] for s in self.options[n])
        for a, wanted in params.items():
            self.options[a] = [Strategy("parameter", p, ()) for p in sorted(wanted)
                               if p.kind != "P"]
        # Deterministic order: the layer's nodes, then parameters fetched elsewhere.
        self.items = [n for n in nodes if n in self.options] + \
            [a for a in params if a not in members]
        self.computed = computed

    def signature_key(self, pins: dict[str, Placement]) -> tuple:
        pinned = tuple(str(pins.get(meta.params(a)[0], "")) for a in self.items
                       if a.op == "get_attr" and meta.params(a))
        ends = tuple(str(self.boundary.get(a, REPLICATE)) for n in self.computed
                     for a in tensor_inputs(n) if a not in self.members and a.op != "get_attr")
        outs = tuple(str(self.boundary[n]) for n in self.computed if n in self.boundary)
        return (self.info.signature, pinned, ends, outs)


def _solve_all(problems: list[_LayerProblem], pins: dict[str, Placement], prefer: str,
               cache: dict[tuple, tuple[list[int], int]]
               ) -> list[tuple[dict[fx.Node, int], int]]:
    solved = []
    for problem in problems:
        key = problem.signature_key(pins)
        if key not in cache:
            choice, cost = _solve_layer(problem, pins, prefer)
            cache[key] = ([choice[n] for n in problem.items], cost)
        indices, cost = cache[key]
        solved.append((dict(zip(problem.items, indices)), cost))
    return solved


def _disagreements(problems: list[_LayerProblem], solved: list) -> dict[str, set[Placement]]:
    seen: dict[str, set[Placement]] = {}
    for problem, (choice, _) in zip(problems, solved):
        for node, index in choice.items():
            if node.op == "get_attr" and meta.params(node):
                seen.setdefault(meta.params(node)[0], set()).add(problem.options[node][index].out)
    return {fqn: options for fqn, options in seen.items() if len(options) > 1}


def _compute_seconds(node: fx.Node, chosen: Strategy, link: Link) -> float:
    cost = meta.cost(node)
    if cost is None:
        return 0.0
    # Forward and backward (twice forward), each op at its roofline: its FLOPs or its
    # bytes, parameters included, whichever binds. Unlike partc.costs (heavy ops only),
    # a light op's parameters count too, as they always have here: an embedding's table
    # then weighs in its split.
    seconds = 3.0 * max(cost.flops / link.flops,
                        (cost.bytes_moved + cost.weight_bytes) / link.hbm_bandwidth)
    sharded = chosen.out.kind != "R" or any(p.kind != "R" for p in chosen.ins)
    return seconds / link.tp if sharded else seconds


def _moves_seconds(moves: tuple, nbytes: float, link: Link) -> float:
    return sum(collective_seconds(kind, nbytes, link.group) for kind, _ in moves)


def _edge_moves(problem: _LayerProblem, producer: fx.Node, src: Placement, dst: Placement,
                consumer_out: Placement) -> tuple | None:
    if producer.op == "get_attr" or not isinstance(producer.meta.get("val"), torch.Tensor):
        return () if src == dst or dst.kind == "*" else None
    grad_partial = dst.kind == "R" and consumer_out.kind != "R" and producer in problem.grads
    return redistribute(src, dst, grad_partial)


def _param_fraction(node: fx.Node, placement: Placement, tp: int) -> float:
    nbytes = meta.output_bytes(node)
    return nbytes / tp if placement.kind == "S" else float(nbytes)


def _solve_layer(problem: _LayerProblem, pins: dict[str, Placement], prefer: str
                 ) -> tuple[dict[fx.Node, int], int]:
    model = cp_model.CpModel()
    link = problem.link
    x = {n: [model.NewBoolVar("") for _ in problem.options[n]] for n in problem.items}
    for n in problem.items:
        model.AddExactlyOne(x[n])
        if n.op == "get_attr" and meta.params(n) and meta.params(n)[0] in pins:
            for i, s in enumerate(problem.options[n]):
                if s.out != pins[meta.params(n)[0]]:
                    model.Add(x[n][i] == 0)
    time_terms, param_terms = [], []
    total_param = sum(meta.output_bytes(n) for n in problem.items if n.op == "get_attr") or 1

    def ps(seconds: float) -> int:
        return int(round(seconds * 1e12))

    # One redistribution per (value, where it comes from, what it must become): consumers
    # that need the same thing share it, as the shard pass emits it.
    moved: dict[tuple, Any] = {}

    def need(key: tuple, seconds: float, when: list) -> None:
        if key not in moved:
            moved[key] = model.NewBoolVar("")
            time_terms.append((ps(seconds), moved[key]))
        model.AddBoolOr([lit.Not() for lit in when] + [moved[key]])

    for v in problem.computed:
        for i, s in enumerate(problem.options[v]):
            time_terms.append((ps(_compute_seconds(v, s, link)), x[v][i]))
        for position, u in enumerate(tensor_inputs(v)):
            nbytes = float(meta.output_bytes(u))
            for i, s in enumerate(problem.options[v]):
                dst = s.ins[position]
                sources = list(enumerate(problem.options[u])) if u in x else \
                    [(None, Strategy("boundary", problem.boundary.get(u, REPLICATE), ()))]
                for j, su in sources:
                    moves = _edge_moves(problem, u, su.out, dst, s.out)
                    when = [x[v][i]] + ([x[u][j]] if j is not None else [])
                    if moves is None:
                        model.AddBoolOr([lit.Not() for lit in when])
                    elif moves:
                        need((u, su.out, dst, moves), _moves_seconds(moves, nbytes, link), when)
        if v in problem.boundary:
            nbytes = float(meta.output_bytes(v))
            for i, s in enumerate(problem.options[v]):
                moves = redistribute(s.out, problem.boundary[v], False)
                if moves is None:
                    model.Add(x[v][i] == 0)
                elif moves:
                    time_terms.append((ps(_moves_seconds(moves, nbytes, link)), x[v][i]))
    # Parameter bytes in per-mille of the layer's: a tie-breaker for time, and, with
    # prefer="memory", the first goal (a replicated bias is below its resolution).
    for n in problem.items:
        if n.op == "get_attr":
            # Vectors (biases, norm weights) are too small to matter for memory; counting
            # them would trade a row-parallel layer for a column-parallel one.
            if prefer == "memory" and len(_shape(n)) < 2:
                continue
            for i, s in enumerate(problem.options[n]):
                weight = int(round(1000 * _param_fraction(n, s.out, problem.tp) / total_param))
                param_terms.append((weight, x[n][i]))
    time_expr = sum(c * var for c, var in time_terms if c)
    param_expr = sum(c * var for c, var in param_terms if c)
    if prefer == "memory":
        model.Minimize(param_expr * (10 ** 12) + time_expr)
    else:
        model.Minimize(time_expr * 1000 + param_expr)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 20.0
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"layer {problem.info.name}: no sharding found ({solver.StatusName(status)})")
    choice = {n: next(i for i, var in enumerate(x[n]) if solver.Value(var)) for n in problem.items}
    return choice, int(solver.ObjectiveValue())


def _apply_choices(gm: fx.GraphModule, result: Sharding, problems: list[_LayerProblem],
                   picked: list[dict[fx.Node, int]], grads: set[fx.Node]) -> Sharding:
    layers = []
    partial_uses: dict[fx.Node, list[bool]] = {}
    param_edges: dict[int, list[fx.Node]] = {}
    for problem, choice in zip(problems, picked):
        for node, index in choice.items():
            result.strategy[node] = problem.options[node][index]
    for problem, choice in zip(problems, picked):
        collectives, seen = [], set()
        for v in problem.computed:
            chosen = result.strategy[v]
            for position, u in enumerate(tensor_inputs(v)):
                src = result.placement(u) if u in problem.members or u.op == "get_attr" \
                    else result.boundary.get(u, REPLICATE)
                dst = chosen.ins[position]
                if u.op == "get_attr":
                    partial = dst.kind == "R" and chosen.out.kind != "R" and u in grads
                    partial_uses.setdefault(u, []).append(partial)
                    if partial:
                        param_edges.setdefault(len(layers), []).append(u)
                    continue
                moves = _edge_moves(problem, u, src, dst, chosen.out) or ()
                if moves and (u, dst, moves) not in seen:
                    seen.add((u, dst, moves))
                    collectives += [Collective(k, ph, meta.output_bytes(u)) for k, ph in moves]
            if v in result.boundary:
                moves = redistribute(chosen.out, result.boundary[v], False) or ()
                collectives += [Collective(k, ph, meta.output_bytes(v)) for k, ph in moves]
        own = tuple((meta.params(n)[0], str(result.strategy[n].out)) for n in problem.items
                    if n.op == "get_attr" and n in problem.members and meta.params(n))
        layers.append(LayerSharding(
            name=problem.info.name, choices=tuple(choice[n] for n in problem.items),
            params=own, collectives=tuple(collectives), note=_why_replicated(problem, result)))
    result.partial_grad_params = frozenset(
        meta.params(node)[0] for node, uses in partial_uses.items()
        if meta.params(node) and all(uses) and result.strategy[node].out.kind == "R")
    # A parameter used both ways sums its partial gradient where it is used sharded.
    for index, nodes in param_edges.items():
        extra = tuple(Collective("all_reduce", "backward", meta.output_bytes(u)) for u in
                      dict.fromkeys(nodes) if meta.params(u)
                      and meta.params(u)[0] not in result.partial_grad_params)
        if extra:
            layers[index] = dataclasses.replace(layers[index],
                                                collectives=layers[index].collectives + extra)
    result.layers = tuple(layers)
    return result


def _why_replicated(problem: _LayerProblem, result: Sharding) -> str:
    """For a layer whose heavy nodes all stay replicated, say what stopped sharding."""
    heavy = [n for n in problem.computed if (meta.cost(n) and meta.cost(n).compute_heavy)]
    if not heavy or any(result.strategy[n].out.kind != "R" for n in heavy):
        return ""
    for n in heavy:
        if len(problem.options[n]) == 1:
            shape = _shape(n)
            return (f"{n.name} ({op_name(n)}, output {list(shape)}) has no dim that "
                    f"{problem.tp} ranks can split evenly")
    return "replicating is faster than any split at this group's bandwidth"
