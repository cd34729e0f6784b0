"""Tensor-parallel strategy rules: every way one node can run on a group of ``tp`` ranks.

A *strategy* is a placement for a node's output and the placement it needs of each tensor
input (:class:`partc.placement.Placement`: ``Replicate()``, ``Shard(dim)``,
``Shard(dim, chunks=k)``, ``Partial()``), worked out from the op and the shapes alone, with
no table of module names:

- a linear (``linear``, ``addmm``, a matmul by a 2-D weight) is replicated, column-parallel
  (weight ``Shard(0)``, output sharded on its last dim) or row-parallel (weight
  ``Shard(1)``, input sharded on its last dim, output ``Partial()``);
- an elementwise op keeps any shard its inputs share (a broadcast dim of size 1 stays
  replicated); a linear one (``neg``, a scale by a constant, ``add`` of equal shapes)
  keeps a partial sum partial;
- a view carries a shard into the dim it becomes; a transpose, permute, squeeze or
  unsqueeze moves it with its dim;
- a reduction, softmax, slice or layer norm keeps shards off the dims it works along;
- attention (``scaled_dot_product_attention``) is split by heads;
- an embedding can be vocabulary-parallel (table ``Shard(0)``, output ``Partial()``) or
  split by columns;
- the loss (the user's, a ``call_module``) can read its logits sharded by their class dim
  where a probe found it computes a vocab-parallel cross entropy
  (``partc.runtime.tp_loss``; its own all-reduces: :func:`own_collectives`).

Dim 0 (the batch) is never sharded: tensor-parallel ranks see the same samples.
``Shard(d, chunks=k)`` shards each of ``k`` equal pieces of dim ``d`` (a fused QKV
projection whose output is later split into q, k and v); :class:`ChunkHints` says which
values are split so, and the rules offer those shards too.

:func:`redistribute` says which collectives move a value from the placement its producer
made to the one a consumer needs, and which its gradient needs on the way back.

Everything here is a pure function of a node, its ``node.meta["val"]`` (and, for the loss,
the probe's finding) and the hints; the
chooser (:mod:`partc.passes.tp.chooser`) picks among the strategies and the rewrite
(:mod:`partc.passes.shard`) carries out the pick.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import fx

from partc import meta
from partc.passes.helpers.graph import is_tensorish, op_name, tensor_inputs
from partc.placement import PARTIAL, REPLICATE, Placement, Shard


ANY = Placement("*")  # x.new_ones(...) reads x's dtype and device: any placement will do


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: what it needs of each tensor input, what it makes."""

    name: str
    out: Placement
    ins: tuple[Placement, ...]  # one per tensor input, in ``tensor_inputs`` order


@dataclass(frozen=True)
class Collective:
    """One collective a layer runs per step: its kind (all_reduce, all_gather,
    reduce_scatter), its phase (forward or backward), the bytes of the whole tensor."""

    kind: str
    phase: str
    bytes: int


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
            back = (("all_reduce", "backward"),) if grad_partial else ()
            return (("all_reduce", "forward"),) + back
        if dst.chunks == 1:
            return (("reduce_scatter", "forward"), ("all_gather", "backward"))
        return None
    # src is a shard
    if dst.kind == "R":
        back = ("reduce_scatter" if src.chunks == 1 else "all_reduce") if grad_partial else None
        return (("all_gather", "forward"),) + (((back, "backward"),) if back else ())
    return None  # shard to another shard: not needed by any strategy


def regathers(consumer: fx.Node, position: int, src: Placement, dst: Placement,
              grad_partial: bool) -> bool:
    """Whether the all-gather that brings a value to input ``position`` of ``consumer``
    runs again in backward: a product reading a sequence-parallel shard gathered whole
    keeps the shard for its weight's gradient and gathers it again (Megatron's sequence
    parallelism; ``TensorParallelGroup.linear_of_gathered``), one backward all-gather per
    gathered value however many products read it. The products: a column-parallel
    linear, and ``addmm`` reading the gathered value through the view that flattens it
    to a matrix (GPT-2's ``Conv1D``: the gather's consumer is that view)."""
    if not (position == 0 and src.kind == "S" and src.chunks == 1 and dst.kind == "R"):
        return False
    if consumer.op == "call_function" and op_name(consumer) == "linear":
        return grad_partial
    return bool(flattened_for_addmm(consumer))


def flattened_for_addmm(view: fx.Node) -> list[fx.Node]:
    """The ``addmm`` nodes that read ``view`` as their matrix input, when ``view`` is a
    view read by nothing else (``torch.addmm(b, x.view(-1, n), w)``); else none."""
    if view.op != "call_function" or op_name(view) not in _VIEWS or not view.users:
        return []
    readers = list(view.users)
    if all(op_name(user) == "addmm" and len(user.args) == 3 and not user.kwargs
           and user.args[1] is view and view not in (user.args[0], user.args[2])
           for user in readers):
        return readers
    return []


# ------------------------------------------------------------- op families and hints

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
# Ops that make no tensor worth placing: the chooser leaves them out of its model.
NO_STRATEGY_OPS = frozenset({"_assert_tensor_metadata", "size", "sym_size", "dim", "getattr"})


@dataclass(frozen=True, eq=False)
class ChunkHints:
    """Values that are later split into ``k`` equal pieces along a dim (a fused QKV
    projection's output, split into q, k and v): node → the piece counts ``k``. The
    rules then offer ``Shard(d, chunks=k)`` for them and for what they are made from, so
    that each rank holds its share of every piece."""

    pieces: Mapping[fx.Node, frozenset[int]] = field(
        default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, gm: fx.GraphModule) -> "ChunkHints":
        """The hints of ``gm``: each split into equal pieces marks its input, and back
        through views and elementwise ops to the linear or matmul that made it."""
        pieces: dict[fx.Node, set[int]] = {}
        for node in gm.graph.nodes:
            k = _equal_pieces(node)
            source = node.args[0] if k else None
            while isinstance(source, fx.Node):
                pieces.setdefault(source, set()).add(k)
                source = _carried_from(source)
        return cls(MappingProxyType({n: frozenset(ks) for n, ks in pieces.items()}))

    def options(self, inputs: Iterable[fx.Node]) -> list[int]:
        """The piece counts a shard of a value made from ``inputs`` may take (1: whole)."""
        options = {1}
        for a in inputs:
            options.update(self.pieces.get(a, ()))
        return sorted(options)


def _equal_pieces(node: fx.Node) -> int:
    """``k`` where ``node`` splits its input into ``k >= 2`` pieces of one shape, else 0."""
    if node.op not in ("call_function", "call_method") or op_name(node) not in ("split", "chunk"):
        return 0
    value = node.meta.get("val")
    if not isinstance(value, (tuple, list)) or len(value) < 2:
        return 0
    return len(value) if len({tuple(v.shape) for v in value}) == 1 else 0


def _carried_from(node: fx.Node) -> fx.Node | None:
    """The one input a view or elementwise op carries a split from; None past a linear,
    matmul or anything else."""
    name = op_name(node)
    if name in ("linear", "addmm", "matmul") or node.op not in ("call_function", "call_method"):
        return None
    if name not in _VIEWS and name not in _ELEMENTWISE:
        return None
    inputs = tensor_inputs(node)
    return inputs[0] if len(inputs) == 1 else None


# ------------------------------------------------------------------------------- rules

# A rule: (node, its tensor inputs, tp, hints) -> the strategies beyond replicated.
Rule = Callable[[fx.Node, list[fx.Node], int, ChunkHints], list[Strategy]]


def strategies(node: fx.Node, tp: int, hints: ChunkHints) -> list[Strategy]:
    """Every way ``node`` can run on a group of ``tp``; the first is always replicated."""
    inputs = tensor_inputs(node)
    replicated = Strategy("replicate", REPLICATE, tuple(REPLICATE for _ in inputs))
    if node.op == "call_module" and meta.role(node) == meta.ROLE_LOSS:
        return [replicated] + _vocab_parallel_loss(node, inputs, tp)
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
        found = rule(node, inputs, tp, hints)
    except (IndexError, TypeError, ValueError, KeyError):
        found = []  # an unusual call signature: stay replicated
    seen, result = set(), [replicated]
    for strategy in found:
        key = (strategy.out, strategy.ins)
        if key not in seen and key != (replicated.out, replicated.ins):
            seen.add(key)
            result.append(strategy)
    return result


def output_shape(node: fx.Node) -> tuple[int, ...]:
    """The shape of ``node``'s value (of its first piece, for a split)."""
    value = node.meta["val"]
    if isinstance(value, (tuple, list)):
        value = value[0]
    return tuple(int(d) for d in value.shape)


def divides(size: int, tp: int, chunks: int = 1) -> bool:
    """Whether ``tp`` ranks can split each of ``chunks`` pieces of ``size`` evenly."""
    return size % (tp * chunks) == 0 and size >= tp * chunks


def _ndim(node: fx.Node) -> int:
    return len(output_shape(node))


def _elementwise(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints
                 ) -> list[Strategy]:
    out = output_shape(node)
    n = len(out)
    result = []
    for d in range(1 if n > 1 else 0, n):
        for chunks in hints.options(inputs):
            if not divides(out[d], tp, chunks):
                continue
            ins, any_shard = [], False
            for a in inputs:
                shape = output_shape(a)
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
        if all(output_shape(a) == out for a in inputs):
            result.append(Strategy("partial", PARTIAL, (PARTIAL, PARTIAL)))
    return result


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


def _view(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    src, dst = output_shape(inputs[0]), output_shape(node)
    result = []
    for gi, gj in _view_groups(src, dst):
        first_in = next((i for i in gi if src[i] != 1), None)
        first_out = next((j for j in gj if dst[j] != 1), None)
        if first_in is None or first_out is None or first_out == 0:
            continue
        one_to_one = len([i for i in gi if src[i] != 1]) == 1 and \
            len([j for j in gj if dst[j] != 1]) == 1
        for chunks in hints.options(inputs):
            if chunks > 1 and not one_to_one:
                continue
            if divides(src[first_in], tp, chunks) and divides(dst[first_out], tp, chunks):
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
        src = output_shape(inputs[0])
        dims = args[0] if args else None
        if dims is None:
            keep = [i for i in range(n_in) if src[i] != 1]
        else:
            dims = {int(x) % n_in for x in (dims if isinstance(dims, (list, tuple)) else [dims])}
            keep = [i for i in range(n_in) if not (i in dims and src[i] == 1)]
        return keep if len(keep) == out_rank else []
    raise ValueError(name)


def _permute(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    perm = _permutation(node, inputs)
    src = output_shape(inputs[0])
    result = []
    for d, from_dim in enumerate(perm):
        if from_dim is None or (d == 0 and len(perm) > 1) or src[from_dim] == 1:
            continue
        for chunks in hints.options(inputs):
            if divides(src[from_dim], tp, chunks):
                result.append(Strategy(f"shard dim {d}", Shard(d, chunks),
                                       (Shard(from_dim, chunks),)))
    result.append(Strategy("partial", PARTIAL, (PARTIAL,)))
    return result


def _expand(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    src, out = output_shape(inputs[0]), output_shape(node)
    offset = len(out) - len(src)
    result = []
    for d in range(1, len(out)):
        da = d - offset
        if da >= 0 and src[da] == out[d] and src[da] != 1 and divides(out[d], tp):
            result.append(Strategy(f"shard dim {d}", Shard(d), (Shard(da),)))
    return result


def _dim_arg(node: fx.Node, position: int, name: str, default: Any = None) -> Any:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _split(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    src = output_shape(inputs[0])
    n = len(src)
    dim = int(_dim_arg(node, 2, "dim", 0)) % n
    pieces = [tuple(int(s) for s in v.shape) for v in node.meta["val"]]
    result = []
    for d in range(1, n):
        if d != dim and divides(src[d], tp):
            result.append(Strategy(f"shard dim {d}", Shard(d), (Shard(d),)))
    k = len(pieces)
    if k > 1 and len({p[dim] for p in pieces}) == 1 and divides(src[dim], tp, k) and dim > 0:
        result.append(Strategy(f"shard dim {dim} per piece", Shard(dim), (Shard(dim, k),)))
    return result


def _getitem(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    source = inputs[0]
    if isinstance(source.meta.get("val"), torch.Tensor):
        return []  # indexing a tensor: replicated only
    options = {s.out for s in strategies(source, tp, hints)}
    return [Strategy(str(p), p, (p,)) for p in sorted(options) if p.kind != "R"]


def _keep_dims(node: fx.Node, inputs: list[fx.Node], tp: int, reduced: set[int],
               keepdim: bool) -> list[Strategy]:
    src = output_shape(inputs[0])
    result = []
    for d in range(1, len(src)):
        if d in reduced or not divides(src[d], tp):
            continue
        out_d = d if keepdim else d - sum(1 for r in reduced if r < d)
        result.append(Strategy(f"shard dim {out_d}", Shard(out_d), (Shard(d),)
                               + tuple(REPLICATE for _ in inputs[1:])))
    return result


def _reduction(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    n = _ndim(inputs[0])
    dims = _dim_arg(node, 1, "dim", None)
    if dims is None:
        return []
    dims = {int(d) % n for d in (dims if isinstance(dims, (list, tuple)) else [dims])}
    keepdim = bool(_dim_arg(node, 2, "keepdim", False))
    result = _keep_dims(node, inputs, tp, dims, keepdim)
    result.append(Strategy("partial", PARTIAL, (PARTIAL,)))
    return result


def _softmax(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    n = _ndim(inputs[0])
    dim = int(_dim_arg(node, 1, "dim")) % n
    return _keep_dims(node, inputs, tp, {dim}, True)


def _slice(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    n = _ndim(inputs[0])
    dim = int(_dim_arg(node, 1, "dim", 0)) % n
    keep = op_name(node) != "select"
    return _keep_dims(node, inputs, tp, {dim}, keep)


def _pad(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    """``F.pad`` / ``constant_pad_nd``: any dim it leaves unpadded may stay sharded."""
    n = _ndim(inputs[0])
    pads = list(_dim_arg(node, 1, "pad", ()))
    padded = {n - 1 - i // 2 for i, amount in enumerate(pads) if amount}
    return _keep_dims(node, inputs, tp, padded, True)


def _cat(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    n = _ndim(node)
    dim = int(_dim_arg(node, 1, "dim", 0)) % n
    result = []
    for d in range(1, n):
        if d != dim and all(_ndim(a) == n and divides(output_shape(a)[d], tp) for a in inputs):
            result.append(Strategy(f"shard dim {d}", Shard(d), tuple(Shard(d) for _ in inputs)))
    return result


def _layer_norm(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    x = node.args[0]
    n = _ndim(x)
    normalized = node.args[1] if len(node.args) > 1 else node.kwargs["normalized_shape"]
    first_normalized = n - len(normalized)
    result = []
    for d in range(1, first_normalized):
        if divides(output_shape(x)[d], tp):
            result.append(Strategy(f"shard dim {d}", Shard(d),
                                   tuple(Shard(d) if a is x else REPLICATE for a in inputs)))
    return result


def _linear_like(node: fx.Node, x: fx.Node, w: fx.Node, b: fx.Node | None,
                 inputs: list[fx.Node], tp: int, hints: ChunkHints, weight_out_dim: int
                 ) -> list[Strategy]:
    """Column- and row-parallel forms of ``x @ w`` (+ ``b``) with w's output dim given."""
    out_rank = _ndim(node)
    w_shape = output_shape(w)
    w_in_dim = 1 - weight_out_dim
    result = []
    for chunks in sorted({1} | hints.pieces.get(node, frozenset())):
        if divides(w_shape[weight_out_dim], tp, chunks):
            need = {x: REPLICATE, w: Shard(weight_out_dim, chunks)}
            if b is not None:
                need[b] = Shard(_ndim(b) - 1, chunks)
            result.append(Strategy("column-parallel", Shard(out_rank - 1, chunks),
                                   tuple(need[a] for a in inputs)))
    if divides(w_shape[w_in_dim], tp) and x is not w:
        need = {x: Shard(_ndim(x) - 1), w: Shard(w_in_dim)}
        if b is not None:
            need[b] = REPLICATE
        result.append(Strategy("row-parallel", PARTIAL, tuple(need[a] for a in inputs)))
    return result


def _linear(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    x, w = node.args[0], node.args[1]
    b = _dim_arg(node, 2, "bias", None)
    if _ndim(w) != 2 or x is w or b is x or b is w:
        return []
    return _linear_like(node, x, w, b if isinstance(b, fx.Node) else None, inputs, tp, hints, 0)


def _addmm(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    b, x, w = node.args[:3]
    if len({b, x, w}) != 3 or not all(isinstance(a, fx.Node) for a in (b, x, w)):
        return []
    return _linear_like(node, x, w, b, inputs, tp, hints, 1)


def _matmul(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    a, b = node.args[:2]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or a is b:
        return []
    out = output_shape(node)
    n = len(out)
    result = []
    if _ndim(b) == 2 and _ndim(a) >= 2:
        result += _linear_like(node, a, b, None, inputs, tp, hints, 1)
    for d in range(1, n - 2):
        need = {}
        for operand in (a, b):
            shape = output_shape(operand)
            da = d - (n - len(shape))
            need[operand] = REPLICATE if da < 0 or shape[da] == 1 else Shard(da)
        if any(p.is_shard for p in need.values()) and divides(out[d], tp):
            result.append(Strategy(f"shard dim {d}", Shard(d), tuple(need[x] for x in inputs)))
    return result


def _sdpa(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    q, k, v = node.args[:3]
    if _ndim(q) != 4 or not divides(output_shape(q)[1], tp) or not divides(output_shape(k)[1], tp):
        return []
    need = {}
    for a in inputs:
        shape = output_shape(a)
        da = 1 - (4 - len(shape))
        need[a] = Shard(1) if a in (q, k, v) else (
            REPLICATE if da < 0 or shape[da] == 1 else Shard(da))
    return [Strategy("shard heads", Shard(1), tuple(need[a] for a in inputs))]


def _embedding(node: fx.Node, inputs: list[fx.Node], tp: int, hints: ChunkHints) -> list[Strategy]:
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        w, ids = node.args[:2]
    else:
        ids, w = node.args[:2]
    if not isinstance(w, fx.Node) or _ndim(w) != 2 or ids is w:
        return []
    rows, width = output_shape(w)
    result = []
    if divides(rows, tp):
        result.append(Strategy("vocab-parallel", PARTIAL,
                               tuple(Shard(0) if a is w else REPLICATE for a in inputs)))
    if divides(width, tp):
        result.append(Strategy("column-parallel", Shard(_ndim(node) - 1),
                               tuple(Shard(1) if a is w else REPLICATE for a in inputs)))
    return result


def _vocab_parallel_loss(node: fx.Node, inputs: list[fx.Node], tp: int) -> list[Strategy]:
    """The loss reading its logits sharded by their last (class) dim, where the probe
    found it computes a vocab-parallel cross entropy so (``meta.vocab_sharded``)."""
    position = meta.vocab_sharded(node, tp)
    if position is None:
        return []
    logits = node.args[position]
    return [Strategy("vocab-parallel", REPLICATE, tuple(
        Shard(_ndim(a) - 1) if a is logits else REPLICATE for a in inputs))]


def own_collectives(node: fx.Node, chosen: Strategy, tp: int) -> tuple[Collective, ...]:
    """The collectives ``node`` runs itself under ``chosen``, beyond the moves of its
    inputs and output: a vocab-parallel loss's all-reduces, as its probe counted them
    (per cross entropy, in forward, each position's maximum, then its sum of
    exponentials and target logit); none for any other strategy."""
    if chosen.name != "vocab-parallel" or node.op != "call_module":
        return ()
    return tuple(Collective(kind, phase, nbytes)
                 for kind, phase, nbytes in meta.vocab_collectives(node, tp))


_RULES: dict[str, Rule] = {
    **{name: _view for name in _VIEWS},
    **{name: _permute
       for name in ("transpose", "swapaxes", "t", "permute", "unsqueeze", "squeeze")},
    "expand": _expand, "split": _split, "chunk": _split, "getitem": _getitem,
    "mean": _reduction, "sum": _reduction, "softmax": _softmax, "log_softmax": _softmax,
    "_softmax": _softmax, "slice": _slice, "select": _slice, "narrow": _slice, "cat": _cat,
    "pad": _pad, "constant_pad_nd": _pad,
    "layer_norm": _layer_norm, "linear": _linear, "addmm": _addmm, "matmul": _matmul,
    "scaled_dot_product_attention": _sdpa, "embedding": _embedding,
}
