"""Each attention core's softmax becomes :func:`partc.runtime.softmax.softmax`, which keeps
its output for backward in the autocast dtype (Megatron's fused softmax keeps 16 bits;
autocast's fp32 softmax would keep 32: see that module).

Only the softmax between an attention core's two products
(:func:`partc.passes.helpers.attention_core.attention_cores`) is rewritten (its ``dtype``
argument kept, as Llama's fp32 softmax has one): a router's scores or a loss's
log-softmax are left alone. Where the second product is the probabilities' only reader
(directly or through a dropout of probability 0) it becomes
:func:`partc.runtime.softmax.softmax_for_product`, which hands the product the copy it
keeps in the autocast dtype instead of the fp32 values autocast would cast again.
"""

from __future__ import annotations

import torch
from torch import fx

from partc.passes.context import Context
from partc.passes.helpers.attention_core import attention_cores
from partc.passes.helpers.graph import dropout_args, op_name
from partc.runtime.softmax import softmax, softmax_for_product

# Products autocast computes in its low dtype (it casts their floating inputs to it).
_LOW_PRECISION_PRODUCTS = frozenset({"matmul", "bmm"})


def attention_softmax(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Rewrite the softmax of each attention core as ``softmax(x, dim)`` of
    :mod:`partc.runtime.softmax`.

    Reads: the graph, ``node.meta["val"]`` (kept as it is). Writes: the target and
    arguments of each rewritten node. Requires: ``propagate``. Ensures: every value is
    the same; only what backward keeps changes (under autocast).
    """
    changed = False
    for core in attention_cores(list(gm.graph.nodes)):
        for node in core:
            operands = _softmax_operands(node)
            if operands is not None:
                x, dim, dtype = operands
                node.op, node.target = "call_function", (
                    softmax_for_product if _only_a_product_reads(node) else softmax)
                node.args, node.kwargs = (x, dim) if dtype is None else (x, dim, dtype), {}
                changed = True
    if changed:
        gm.recompile()
    return gm


def _only_a_product_reads(node: fx.Node) -> bool:
    """Whether ``node``'s value reaches nothing but one matmul that autocast computes in
    its low dtype, directly or through dropouts that return their input (probability
    0)."""
    while len(node.users) == 1:
        (user,) = node.users
        if user.op in ("call_function", "call_method") \
                and op_name(user) in _LOW_PRECISION_PRODUCTS:
            return True
        if not _returns_its_input(user, node):
            return False
        node = user
    return False


def _returns_its_input(node: fx.Node, value: fx.Node) -> bool:
    """A dropout of probability 0 applied to ``value``: the same tensor comes back."""
    found = dropout_args(node)
    return found is not None and found[0] == 0 and node.args[:1] == (value,)


def _softmax_operands(node: fx.Node) -> tuple[fx.Node, int, torch.dtype | None] | None:
    """``(input, dim, dtype)`` of a softmax (``_softmax`` only where it does not widen
    to fp32), else None."""
    if node.op == "call_method" and node.target == "softmax":
        names = ("input", "dim", "dtype")
    elif node.op != "call_function":
        return None
    elif node.target is torch.nn.functional.softmax:
        names = ("input", "dim", "_stacklevel", "dtype")
    elif node.target in (torch.ops.aten.softmax.int, torch.softmax):
        names = ("input", "dim", "dtype")
    elif node.target is torch.ops.aten._softmax.default:
        names = ("input", "dim", "half_to_float")
    else:
        return None
    values = {**dict(zip(names, node.args)), **node.kwargs}
    x, dim, dtype = values.get("input", values.get("self")), values.get("dim"), \
        values.get("dtype")
    if not isinstance(x, fx.Node) or not isinstance(dim, int) \
            or not (dtype is None or isinstance(dtype, torch.dtype)) \
            or values.get("half_to_float"):
        return None
    return x, dim, dtype
