"""What context parallelism needs to know of the traced graph: each layer's attention
cores as shapes (:func:`attention_cost`), and whether anything else in the model mixes
positions of the sequence (:func:`context_parallel_blocker`).

Context parallelism splits every sequence over ``cp`` ranks. Everything a transformer
does position by position (linears, norms, activations, residuals, rotary embeddings
given the shard's positions) runs on a shard unchanged; only attention reads other
positions, and the runtime exchanges keys and values (ring) or re-shards to heads
(all-to-all) around each core. An op outside the cores that reads along the sequence
(a scan such as ``cumsum``, a sort, a reduction or softmax over it, a product
contracting it, a convolution along it) would see only its shard: such a model is
refused at plan time with that op named. Only ops on values that depend on a parameter
count (the mask and position ids built from shapes are the runtime's to shard), and the
loss is left out (its mean over tokens is reduced over the cp group).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import fx

from partc import meta
from partc.passes.helpers.attention_core import attention_cores
from partc.passes.helpers.graph import carries_grad, layer_nodes, op_name
from partc.problem import AttentionCost

# Ops that read along a dimension (``dim`` argument), by name.
_ALONG_DIM = frozenset({"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "sort",
                        "argsort", "topk", "kthvalue", "softmax", "_softmax", "log_softmax",
                        "_log_softmax", "sum", "mean", "amax", "amin", "max", "min", "prod",
                        "std", "var", "logsumexp", "median", "mode", "flip", "roll"})
_PRODUCTS = frozenset({"matmul", "bmm", "mm", "baddbmm", "einsum"})
_CONVOLUTIONS = frozenset({"convolution", "conv1d", "conv2d", "_convolution"})
# Views and copies between a core's keys (or values) and the projection that made them.
_RESHAPES = frozenset({"view", "reshape", "_unsafe_view", "expand", "unsqueeze", "clone",
                       "contiguous", "transpose", "permute", "repeat_interleave",
                       "_to_copy", "to", "alias"})


def _val(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _qkv(core: tuple[fx.Node, ...]) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """The query, key and value a core reads: a fused call's first three arguments; the
    first product's operands and the second's right-hand one otherwise."""
    last = core[-1]
    if "scaled_dot_product" in op_name(last) or len(core) == 1 or \
            op_name(core[0]) not in _PRODUCTS:
        call = core[0]
        args = [a for a in call.args[:3] if isinstance(a, fx.Node)]
        return tuple(args) if len(args) == 3 else None
    first, second = core[0], last
    if len(first.args) < 2 or len(second.args) < 2:
        return None
    q, k, v = first.args[0], first.args[1], second.args[1]
    return (q, k, v) if all(isinstance(a, fx.Node) for a in (q, k, v)) else None


def _kv_heads(node: fx.Node, tokens: int, head_dim: int) -> int | None:
    """Heads of the keys (values) before any repeat: the fewest heads of a (batch,
    heads, ..., tokens, head_dim) value met walking back through views and copies."""
    found, frontier, seen = None, [node], set()
    while frontier:
        current = frontier.pop()
        if current in seen:
            continue
        seen.add(current)
        value = _val(current)
        if value is not None and value.dim() >= 4 and value.shape[-1] == head_dim \
                and value.shape[-2] == tokens:
            found = int(value.shape[1]) if found is None else min(found, int(value.shape[1]))
        if current is node or op_name(current) in _RESHAPES:
            frontier.extend(current.all_input_nodes[:1])
    return found


def attention_cost(nodes: list[fx.Node], flops_of, per: float) -> AttentionCost | None:
    """The layer's attention cores as :class:`AttentionCost` (``flops_of(node)``: a
    node's forward FLOPs; ``per``: one over the traced batch), or None when it has none
    or their shapes are not (batch, heads, tokens, head_dim)."""
    cores = attention_cores(nodes)
    if not cores or any(meta.attention_sink(node) for core in cores for node in core):
        # A call holding attention sinks holds one more key (and query row) than the
        # sequence's tokens: no split of the sequence splits it.
        return None
    shapes = []
    for core in cores:
        qkv = _qkv(core)
        query = _val(qkv[0]) if qkv else None
        if query is None or query.dim() != 4:
            return None
        heads, tokens, head_dim = (int(d) for d in query.shape[1:])
        kv = [_kv_heads(n, tokens, head_dim) for n in qkv[1:]]
        if None in kv:
            return None
        shapes.append((heads, max(kv), tokens, head_dim))
    heads, kv_heads, tokens, head_dim = max(shapes)
    flops = sum(flops_of(n) for core in cores for n in core)
    return AttentionCost(cores=len(cores), heads=heads, kv_heads=kv_heads,
                         head_dim=head_dim, tokens=tokens, flops=flops * per)


def context_parallel_blocker(gm: fx.GraphModule, tokens: int,
                             other: Mapping[str, tuple] | None = None) -> str:
    """The first op outside the attention cores and the loss that reads along the
    sequence of a value a parameter reaches, as "op (in layer)"; "" when there is none.

    The sequence's dims are told as lowering tells them (``partc.passes.context_parallel``):
    ``other`` (:func:`input_shapes` of a trace at another sequence length) holds each
    op's inputs' shapes there, and a dim is the sequence where its size differs. Without
    ``other``, or for an op that trace lacks, a dim of ``tokens`` positions is taken for
    the sequence: a guess that also catches a width equal to the sequence's length, which
    :func:`partc.passes.pipeline.analyze` then checks on a second trace."""
    if tokens <= 1:
        return ""
    reached = carries_grad(gm)
    for info in meta.layers(gm):
        if info.is_loss:
            continue
        nodes = layer_nodes(gm, info)
        inside = {n for core in attention_cores(nodes) for n in core}
        for node in nodes:
            if node.op in ("call_function", "call_method") and node not in inside \
                    and _reads_along_sequence(node, tokens, reached, other):
                return f"{op_name(node)} ({node.name}, in layer {info.name})"
    return ""


def input_shapes(gm: fx.GraphModule) -> dict[str, tuple[tuple[int, ...] | None, ...]]:
    """The shapes of each call's first two arguments (None: not a tensor), by node name."""
    return {node.name: tuple(None if _val(a) is None else tuple(_val(a).shape)
                             for a in node.args[:2])
            for node in gm.graph.nodes if node.op in ("call_function", "call_method")}


def _is_sequence(node: fx.Node, index: int, dim: int, value: torch.Tensor, tokens: int,
                 other: Mapping[str, tuple] | None) -> bool:
    """Whether dim ``dim`` of the value ``node`` reads as argument ``index`` is the
    sequence (:func:`context_parallel_blocker`)."""
    shapes = other.get(node.name) if other is not None else None
    there = shapes[index] if shapes is not None and len(shapes) > index else None
    if there is not None and len(there) == value.dim():
        return there[dim] != value.shape[dim]
    return value.shape[dim] == tokens


def _reads_along_sequence(node: fx.Node, tokens: int, reached: set[fx.Node],
                          other: Mapping[str, tuple] | None) -> bool:
    source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    value = _val(source) if source is not None else None
    if source not in reached or value is None or value.dim() < 2:
        return False
    name = op_name(node)
    if name in _ALONG_DIM:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dims is None or not isinstance(dims, (int, list, tuple)):
            return False
        dims = [dims] if isinstance(dims, int) else list(dims)
        return any(isinstance(d, int) and -value.dim() <= d < value.dim()
                   and _is_sequence(node, 0, d % value.dim(), value, tokens, other)
                   for d in dims)
    if name in _PRODUCTS and len(node.args) > 1 and isinstance(node.args[1], fx.Node):
        second = _val(node.args[1])
        return second is not None and second.dim() >= 2 \
            and _is_sequence(node, 0, value.dim() - 1, value, tokens, other) \
            and _is_sequence(node, 1, second.dim() - 2, second, tokens, other)
    if name in _CONVOLUTIONS:
        return value.dim() >= 3 and _is_sequence(node, 0, value.dim() - 1, value, tokens,
                                                 other)
    return False
