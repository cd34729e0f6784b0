"""Mixture-of-experts layers, recognised in a traced graph.

A mixture-of-experts layer is found by its router: a ``topk`` over a 2-D (tokens,
experts) score whose producer chain goes back, through element-wise ops only (softmax,
sigmoid, casts, a bias, a mask), to a linear of the tokens with a weight of ``experts``
rows — the gate. From there:

- **routed experts**: the parameters read by nodes downstream of the top-k (the
  dispatch). They are *batched* (each has a leading dimension of ``num_experts``:
  Hugging Face's 3-D ``gate_up_proj``/``down_proj``, the sample's ``w_in``/``w_out``) or
  a *module list* (``experts.<i>.…`` for every i below ``num_experts``);
- **shared experts**: the other parameters of the block that holds the gate and the
  experts (Qwen2-MoE's ``shared_expert`` and its gate, DeepSeek's ``shared_experts``);
- **combine**: where the expert outputs come back to the tokens (everything downstream
  of the expert weights in the block);
- **auxiliary loss**: the model's output (or the loss it feeds) depends on the router's
  scores through a path that does not go through the experts — a load-balancing loss
  (Switch, Mixtral's ``router_aux_loss``, the sample's sequence-wise loss).

``recognize(gm)`` reads ``meta.PARAMS``, ``meta.MODULE_PATH``, ``meta.TENSORS`` and
``meta.LAYER`` (it runs after ``layers`` and ``propagate``) and returns one
:class:`MoERegion` per router; it changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from partc import meta

from .graph import op_name

# Ops a router's score may pass through between the gate and the top-k.
_SCORE_OPS = {"softmax", "_softmax", "sigmoid", "to", "_to_copy", "type", "float", "add",
              "masked_fill", "where", "mul", "div", "view", "reshape", "_unsafe_view",
              "clone", "contiguous", "log_softmax"}
_GATE_OPS = {"linear", "matmul", "mm", "addmm", "t"}


@dataclass(frozen=True)
class MoERegion:
    """One recognised mixture-of-experts layer (node names refer to the graph it was
    recognised in)."""

    layer: str                        # the partc layer holding it
    module: str                       # FQN of the block (gate, experts, shared experts)
    router: str                       # the top-k node
    gate: str                         # the gate's linear node
    gate_params: tuple[str, ...]
    scoring: str                      # softmax | sigmoid | none: what the top-k ranks
    num_experts: int
    top_k: int
    tokens: str                       # the (tokens, hidden) node the gate reads
    hidden: int
    tokens_per_sample: int
    expert_form: str                  # batched | module-list
    expert_params: tuple[str, ...]    # FQNs of every routed expert's weights
    shared_params: tuple[str, ...]    # FQNs of shared experts (and their gates)
    aux_loss: bool


def recognize(gm: fx.GraphModule, batch_size: int) -> tuple[MoERegion, ...]:
    """Every mixture-of-experts layer of ``gm`` (traced at ``batch_size``), in graph order."""
    regions = []
    for node in gm.graph.nodes:
        if op_name(node) == "topk":
            region = _region(gm, node, batch_size)
            if region is not None:
                regions.append(region)
    return tuple(regions)


def _region(gm: fx.GraphModule, topk: fx.Node, batch_size: int) -> MoERegion | None:
    scores = topk.args[0]
    shape = _shape(scores)
    if not isinstance(scores, fx.Node) or shape is None or len(shape) != 2:
        return None
    gate, scoring = _gate_of(scores)
    if gate is None:
        return None
    num_experts, top_k = shape[1], int(_arg(topk, 1, "k"))
    tokens = gate.args[0]
    tokens_shape = _shape(tokens)
    if tokens_shape is None or tokens_shape[0] != shape[0]:
        return None
    gate_params = _weights_read(gate)
    # The experts sit beside the gate, in the block that holds it, and in its layer.
    block = meta.module_path(gate).rpartition(".")[0]
    layer = meta.layer(topk).name if meta.LAYER in topk.meta else ""
    downstream = {n for n in _descendants(topk)
                  if not layer or (meta.LAYER in n.meta and meta.layer(n).name == layer)}
    expert_params = _expert_params(gm, downstream, num_experts, set(gate_params), block)
    if expert_params is None:
        return None
    fqns, form = expert_params
    module = _common_prefix([meta.module_path(gate)] + [f.rpartition(".")[0] for f in fqns])
    shared = _shared_params(gm, module, set(gate_params) | set(fqns))
    router_path = meta.module_path(gate) + "."
    gate_params = gate_params + tuple(f for f in shared if f.startswith(router_path))
    shared = tuple(f for f in shared if f not in gate_params)
    return MoERegion(
        layer=layer, module=module, router=topk.name, gate=gate.name,
        gate_params=gate_params, scoring=scoring, num_experts=num_experts, top_k=top_k,
        tokens=tokens.name, hidden=tokens_shape[-1],
        tokens_per_sample=shape[0] // batch_size, expert_form=form,
        expert_params=fqns, shared_params=shared,
        aux_loss=_has_aux_loss(gm, gate, set(fqns)))


def _gate_of(scores: fx.Node) -> tuple[fx.Node | None, str]:
    """The linear the top-k's scores come from, through element-wise ops; and whether a
    softmax or sigmoid made probabilities of its logits on the way."""
    scoring, node = "none", scores
    for _ in range(32):
        name = op_name(node)
        if name in _GATE_OPS or (node.op == "call_module" and meta.params(node)):
            return (node, scoring) if meta.params(node) or _reads_param(node) else (None, "")
        if name not in _SCORE_OPS:
            return None, ""
        if name in ("softmax", "_softmax", "sigmoid", "log_softmax") and scoring == "none":
            scoring = "sigmoid" if name == "sigmoid" else "softmax"
        inputs = [a for a in node.all_input_nodes if _shape(a) is not None
                  and len(_shape(a)) >= 2]
        if not inputs:
            return None, ""
        node = inputs[0]
    return None, ""


def _reads_param(node: fx.Node) -> bool:
    return bool(_weights_read(node))


def _weights_read(node: fx.Node) -> tuple[str, ...]:
    """FQNs of the weights ``node`` reads: its own (a module's) and those of inputs
    computed from weights alone (a get_attr, a transpose or cast of one)."""
    found = list(meta.params(node)) if node.op == "call_module" else []
    for arg in node.all_input_nodes:
        if _weight_only(arg):
            found += [f for f in _weights_below(arg) if f not in found]
    return tuple(found)


def _weight_only(node: fx.Node) -> bool:
    if node.op == "get_attr":
        return True
    inputs = node.all_input_nodes
    return node.op == "call_function" and bool(inputs) and all(_weight_only(a) for a in inputs)


def _weights_below(node: fx.Node) -> list[str]:
    if node.op == "get_attr":
        return list(meta.params(node)) or [str(node.target)]
    return [f for a in node.all_input_nodes for f in _weights_below(a)]


def _expert_params(gm: fx.GraphModule, downstream: set[fx.Node], num_experts: int,
                   exclude: set[str], block: str
                   ) -> tuple[tuple[str, ...], str] | None:
    """The routed experts' parameter FQNs among those the dispatch reads in ``block``,
    and their form."""
    prefix = block + "." if block else ""
    fqns: list[str] = []
    for node in gm.graph.nodes:
        if node not in downstream:
            continue
        for fqn in _weights_read(node):
                if fqn.startswith(prefix) and fqn not in exclude and fqn not in fqns:
                    fqns.append(fqn)
    shapes = {f: tuple(_param(gm, f).shape) for f in fqns}
    batched = tuple(f for f in fqns if shapes[f] and shapes[f][0] == num_experts
                    and len(shapes[f]) >= 2)
    if batched:
        return batched, "batched"
    listed = tuple(f for f in fqns if _list_index(f, num_experts) is not None)
    indices = {_list_index(f, num_experts) for f in listed}
    if listed and indices == set(range(num_experts)):
        return listed, "module-list"
    return None


def _list_index(fqn: str, num_experts: int) -> int | None:
    """``i`` of ``…experts.<i>.weight``: the last number in the FQN, below num_experts."""
    parts = fqn.split(".")
    numbers = [i for i, p in enumerate(parts) if p.isdigit()]
    if not numbers:
        return None
    index = int(parts[numbers[-1]])
    return index if index < num_experts else None


def _shared_params(gm: fx.GraphModule, module: str, routed: set[str]) -> tuple[str, ...]:
    prefix = module + "." if module else ""
    found = []
    for node in gm.graph.nodes:
        for fqn in meta.params(node):
            if fqn.startswith(prefix) and fqn not in routed and fqn not in found:
                found.append(fqn)
    return tuple(found)


def _has_aux_loss(gm: fx.GraphModule, gate: fx.Node, experts: set[str]) -> bool:
    """Whether the output reaches the gate other than through the experts: walk forward
    from the gate, never entering a node of the gate's layer that reads an expert weight
    or follows one (later layers all follow the experts, through the residual stream)."""
    layer = meta.layer(gate).name if meta.LAYER in gate.meta else None
    past_experts: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if layer is not None and (meta.LAYER not in node.meta
                                  or meta.layer(node).name != layer):
            continue
        if set(_weights_read(node)) & experts or any(a in past_experts
                                                     for a in node.all_input_nodes):
            past_experts.add(node)
    seen, stack = set(), [gate]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen:
                continue
            if user.op == "output":
                return True
            if meta.role(user) == meta.ROLE_LOSS:
                uses = meta.loss_uses(user)
                if uses is None or any(used and a is node
                                       for a, used in zip(user.args, uses)):
                    return True
                continue
            if user not in past_experts:
                seen.add(user)
                stack.append(user)
    return False


def _descendants(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths if p]
    common: list[str] = []
    for pieces in zip(*parts):
        if len(set(pieces)) != 1:
            break
        common.append(pieces[0])
    return ".".join(common)


def _shape(node: object) -> tuple[int, ...] | None:
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return tuple(int(d) for d in value.shape)
    return None


def _arg(node: fx.Node, index: int, name: str) -> object:
    return node.args[index] if len(node.args) > index else node.kwargs[name]


def _param(gm: fx.GraphModule, fqn: str) -> torch.Tensor:
    owner, _, attr = fqn.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, attr)



def expert_nodes(gm: fx.GraphModule, region: MoERegion) -> list[fx.Node]:
    """The nodes of ``region``'s block that read a routed expert's weight or follow one:
    the experts' compute and the combine."""
    experts = set(region.expert_params)
    prefix = region.module + "." if region.module else ""
    found: list[fx.Node] = []
    for node in gm.graph.nodes:
        if meta.LAYER not in node.meta or meta.layer(node).name != region.layer:
            continue
        in_block = meta.module_path(node) == region.module or \
            meta.module_path(node).startswith(prefix)
        if in_block and (set(_weights_read(node)) & experts
                         or any(a in found for a in node.all_input_nodes)):
            found.append(node)
    return found
