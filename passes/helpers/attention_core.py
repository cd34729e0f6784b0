"""The attention cores of a layer: what selective recompute reruns.

Korthikanti et al. (MLSys'23, section 4.2) recompute only the attention core in backward:
the product of queries and keys, its scale and mask, softmax, dropout and the product
with the values. Its (seq x seq) intermediates are most of a transformer layer's
activations (``5 a s^2 b`` bytes of the layer's ``34 s b h + 5 a s^2 b``) and cost few
FLOPs (two of the layer's matrix products); everything else in the layer is kept. In
the graph a core is::

    scores = q @ k.transpose(-2, -1)     # the first product: a batched matmul
    ...                                  # scale, mask, casts
    probs  = softmax(scores, -1)         # the core's softmax
    ...                                  # casts, dropout (tp.dropout on a shard)
    out    = probs @ v                   # the second product

and a core is every node on a path from the first product to the second, both included
(the mask made outside it, from shapes or a buffer, is an input). A fused attention
call (``scaled_dot_product_attention``, or context parallelism's
``partc.runtime.cp_group.attention``) is a core by itself: recomputing it keeps
q, k and v only.

A candidate is a core only when nothing outside it reads a value made inside it but the
second product's (or the fused call's) output: models that return the attention
probabilities keep them anyway.
"""

from __future__ import annotations

import operator

from torch import fx

from partc.passes.fuse_attention import is_fused
from partc.passes.helpers.graph import is_dtype_check, op_name, outside_inputs
from partc.runtime import cp_group

# The batched products an attention core starts and ends with.
_PRODUCTS = frozenset({"matmul", "bmm", "baddbmm", "einsum"})
_SOFTMAX = frozenset({"softmax", "_softmax", "safe_softmax", "_safe_softmax"})


def attention_cores(nodes: list[fx.Node]) -> list[tuple[fx.Node, ...]]:
    """The attention cores among ``nodes`` (one layer's, in graph order), each as its
    nodes in graph order, the core's output (second product, or fused call) last."""
    members = set(nodes)
    cores = []
    for node in nodes:
        if _is_fused_call(node):
            # With the getitems of a call that returns a tuple (output, log-sum-exp).
            core = (node, *(user for user in nodes if user in node.users
                            and user.target is operator.getitem))
        elif node.op in ("call_function", "call_method") and op_name(node) in _SOFTMAX:
            core = _written_core(node, nodes, members)
        else:
            continue
        if core and _closed(core):
            cores.append(core)
    return cores


def _is_fused_call(node: fx.Node) -> bool:
    # Context-parallel attention (the ring or the all-to-all) is a fused call too: its
    # recompute reruns the exchange.
    return is_fused(node) or (node.op == "call_function" and (
        "scaled_dot_product" in op_name(node) or node.target is cp_group.attention))


def _is_product(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    return node.target is operator.matmul or op_name(node) in _PRODUCTS


def _written_core(softmax: fx.Node, nodes: list[fx.Node], members: set[fx.Node]
                  ) -> tuple[fx.Node, ...] | None:
    first = _nearest(softmax, members, lambda n: n.all_input_nodes)
    second = _nearest(softmax, members, lambda n: list(n.users))
    if first is None or second is None:
        return None
    after_first = _reach(first, members, lambda n: list(n.users))
    before_second = _reach(second, members, lambda n: n.all_input_nodes)
    inside = (after_first & before_second) | {first, second}
    # Dtype checks export leaves on values of the core belong to it.
    inside |= {n for n in nodes if is_dtype_check(n) and n.all_input_nodes
               and set(n.all_input_nodes) <= inside}
    return tuple(n for n in nodes if n in inside)


def _nearest(start: fx.Node, members: set[fx.Node], step) -> fx.Node | None:
    """The first product met walking from ``start`` (breadth first) along ``step``
    within the layer."""
    frontier, seen = [start], {start}
    while frontier:
        following = []
        for node in frontier:
            for other in step(node):
                if other in seen or other not in members:
                    continue
                if _is_product(other):
                    return other
                seen.add(other)
                following.append(other)
        frontier = following
    return None


def _reach(start: fx.Node, members: set[fx.Node], step) -> set[fx.Node]:
    seen, stack = set(), [start]
    while stack:
        for other in step(stack.pop()):
            if other in members and other not in seen:
                seen.add(other)
                stack.append(other)
    return seen


def _closed(core: tuple[fx.Node, ...]) -> bool:
    """At most one value of the core is read outside it: its output."""
    inside = set(core)
    return sum(1 for node in core if any(user not in inside for user in node.users)) <= 1


def core_inputs(core: tuple[fx.Node, ...]) -> list[fx.Node]:
    """The values a core reads from outside it (what its checkpoint keeps), in order of
    first use."""
    return outside_inputs(core)

