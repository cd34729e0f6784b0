"""Invariants each pass ensures, checked after it runs when ``PARTC_VERIFY=1`` (always in
tests). A check raises ``AssertionError`` naming the pass, the node and what is wrong;
it never changes the graph. :mod:`partc.passes.pipeline` calls these, one per pass.
"""

from __future__ import annotations

import os
from typing import Callable

from torch import fx

from partc import meta
from partc.passes.portable import is_assertion

NodeCheck = Callable[[fx.Node], str]


def enabled() -> bool:
    return os.environ.get("PARTC_VERIFY") == "1"


def check(pass_name: str, gm: fx.GraphModule) -> None:
    """Run the checks that follow ``pass_name`` on ``gm`` (a whole graph or one stage)."""
    gm.graph.lint()
    for node in gm.graph.nodes:
        for node_check in _NODE_CHECKS.get(pass_name, ()):
            problem = node_check(node)
            if problem:
                raise AssertionError(f"after pass {pass_name!r}, node {node.name!r} "
                                     f"({node.format_node()}): {problem}")
    for graph_check in _GRAPH_CHECKS.get(pass_name, ()):
        problem = graph_check(gm)
        if problem:
            raise AssertionError(f"after pass {pass_name!r}: {problem}")


# ------------------------------------------------------------------------ node checks

def placeholders_first(node: fx.Node) -> str:
    if node.op == "placeholder" and node.prev.op not in ("placeholder", "root"):
        return "placeholders must come first"
    return ""


def get_attr_named(node: fx.Node) -> str:
    if node.op == "get_attr" and not meta.params(node):
        return "get_attr without its parameter FQN"
    if node.op == "get_attr" and node.next not in node.users and node.next.op != "get_attr":
        return "get_attr is not next to its first user"
    return ""


def has_value(node: fx.Node) -> str:
    if node.op != "output" and "val" not in node.meta:
        return "no fake value"
    return ""


def in_a_layer(node: fx.Node) -> str:
    if meta.LAYER not in node.meta:
        return "no layer"
    if node.op in ("placeholder", "get_attr", "output"):
        return ""
    later = [u for u in node.users if meta.LAYER in u.meta
             and meta.layer(u).index < meta.layer(node).index]
    return f"used by an earlier layer: {later[0].name}" if later else ""


def has_cost(node: fx.Node) -> str:
    if node.op.startswith("call_") and meta.cost(node) is None:
        return "no cost"
    return ""


def computes_in_a_layer(node: fx.Node) -> str:
    """After a stage-level rewrite: every computing node still belongs to a layer."""
    if node.op.startswith("call_") and meta.LAYER not in node.meta:
        return "a computing node outside every layer"
    return ""


def no_assertion(node: fx.Node) -> str:
    if is_assertion(node) and not node.users:
        return "an export assertion is left"
    return ""


# ----------------------------------------------------------------------- graph checks

def one_cut_per_boundary(gm: fx.GraphModule) -> str:
    if len(meta.cut_bytes(gm)) != len(meta.layers(gm)) - 1:
        return "one cut per pair of adjacent layers"
    return ""


def parameters_keep_fqns(gm: fx.GraphModule) -> str:
    """Parameters are read where the model keeps them: every get_attr names a tensor."""
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner, _, attr = str(node.target).rpartition(".")
        try:
            holder = gm.get_submodule(owner) if owner else gm
        except AttributeError:
            return f"{node.name} reads {node.target}, which the module does not hold"
        if not hasattr(holder, attr):
            return f"{node.name} reads {node.target}, which the module does not hold"
    return ""


_NODE_CHECKS: dict[str, tuple[NodeCheck, ...]] = {
    "trace": (placeholders_first, get_attr_named),
    "drop_assertions": (placeholders_first, no_assertion),
    "propagate": (has_value,),
    "fuse_attention": (has_value,),
    "attention_softmax": (has_value,),
    "norm_dtype": (has_value,),
    "layers": (in_a_layer,),
    "estimate": (has_cost,),
    "tp_rewrite": (placeholders_first,),
    "split": (placeholders_first,),
    "recompute": (placeholders_first, computes_in_a_layer),
    "fsdp_units": (placeholders_first, computes_in_a_layer),
    "device_from_inputs": (placeholders_first,),
}

_GRAPH_CHECKS: dict[str, tuple[Callable[[fx.GraphModule], str], ...]] = {
    "layers": (one_cut_per_boundary,),
    "tp_rewrite": (parameters_keep_fqns,),
    "split": (parameters_keep_fqns,),
    "recompute": (parameters_keep_fqns,),
    "fsdp_units": (parameters_keep_fqns,),
}
