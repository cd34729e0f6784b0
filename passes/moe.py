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
from typing import Callable, Iterable

import torch
from torch import fx

from partc import meta
from partc.errors import PartcError
from partc.passes.context import Context
from partc.passes.helpers.graph import op_name
from partc.runtime.experts import ExpertParallel

# Ops a router's score may pass through between the gate and the top-k; in a
# tensor-parallel rank's graph also the all-reduce of a gate sharded along its input
# (``reduce_from_tp``: the partial logits summed, the whole scores again).
_SCORE_OPS = {"softmax", "_softmax", "sigmoid", "to", "_to_copy", "type", "float", "add",
              "masked_fill", "where", "mul", "div", "view", "reshape", "_unsafe_view",
              "clone", "contiguous", "log_softmax", "reduce_from_tp"}
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
    return node.op in ("call_function", "call_method") and bool(inputs) \
        and all(_weight_only(a) for a in inputs)


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
    fqns = _block_weights(gm, downstream, prefix, exclude)
    shapes = {f: tuple(_param(gm, f).shape) for f in fqns}
    batched = tuple(f for f in fqns if shapes[f] and shapes[f][0] == num_experts
                    and len(shapes[f]) >= 2)
    if batched:
        return batched, "batched"
    # A module list may run every expert on every token and weight the outputs by the
    # router (dense compute): its experts then feed the combine, not follow the top-k.
    feeding = downstream | _reachable_from(downstream, lambda n: n.all_input_nodes)
    listed = _module_list(_block_weights(gm, feeding, prefix, exclude), num_experts, prefix)
    return (listed, "module-list") if listed else None


def _block_weights(gm: fx.GraphModule, nodes: set[fx.Node], prefix: str,
                   exclude: set[str]) -> list[str]:
    """FQNs below ``prefix`` that ``nodes`` read, in graph order, but ``exclude``."""
    fqns: list[str] = []
    for node in gm.graph.nodes:
        if node in nodes:
            fqns += [f for f in _weights_read(node)
                     if f.startswith(prefix) and f not in exclude and f not in fqns]
    return fqns


def _module_list(fqns: list[str], num_experts: int, prefix: str) -> tuple[str, ...]:
    """The FQNs of one list of ``num_experts`` modules below ``prefix``
    (``<prefix><list>.<i>.…`` for every i below num_experts), or none."""
    lists: dict[str, dict[str, int]] = {}
    for fqn in fqns:
        parts = fqn[len(prefix):].split(".")
        at = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if at is not None:
            lists.setdefault(".".join(parts[:at]), {})[fqn] = int(parts[at])
    for members in lists.values():
        if set(members.values()) == set(range(num_experts)):
            return tuple(members)
    return ()


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
    return _reachable(node, lambda n: n.users)


def _reachable(node: fx.Node, step: Callable[[fx.Node], Iterable[fx.Node]]
               ) -> set[fx.Node]:
    """The nodes ``step`` leads to from ``node``, transitively (``node`` not included
    unless a cycle returns to it)."""
    return _reachable_from({node}, step)


def _reachable_from(nodes: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]
                    ) -> set[fx.Node]:
    """The nodes ``step`` leads to from any of ``nodes``, transitively."""
    seen, stack = set(), list(nodes)
    while stack:
        for nxt in step(stack.pop()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
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


# ------------------------------------------------------------------------------ lowering

def lower_experts(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Each recognised experts call becomes one call of the runtime's
    :class:`partc.runtime.experts.ExpertParallel` (which the runtime binds to its
    expert-parallel group and gives this rank's experts).

    Under ZeRO-2/3 (``lowering.fsdp_units``) the module takes the experts module's place
    and owns its weights, under their FQNs: the runtime makes it an FSDP unit of its own,
    sharded over the expert-data-parallel group (the ranks holding the same experts),
    gathered around its call.

    Reads: ``meta.LAYER``, ``meta.MODULE_PATH``, ``meta.PARAMS``, ``meta.TENSORS``,
    ``ctx.lowering`` (``ep``, ``capacity_factor``, ``fsdp_units``). Writes: a submodule
    ``<experts>_ep`` per layer (under ZeRO-2/3: the module at ``<experts>``), and the call
    node's meta copied from the experts' output.
    Requires: ``layers`` ran; the experts are batched weights called as
    ``experts(tokens, indices, weights)`` with grouped ops over tokens sorted by expert
    (Hugging Face's experts, the sample's). Ensures: no node of the experts module is
    left; the router and the weights' get_attr nodes stay.
    """
    lowering = ctx.lowering
    for region in recognize(gm, ctx.batch_size):
        call = _experts_call(gm, region)
        _replace(gm, region, call, ctx)
    gm.graph.lint()
    gm.recompile()
    return gm


@dataclass(frozen=True)
class _ExpertsCall:
    module: str
    nodes: tuple[fx.Node, ...]         # the experts module's nodes, weight views too
    tokens: fx.Node
    indices: fx.Node
    weights: fx.Node
    output: fx.Node
    body: tuple[fx.Node, ...]          # the grouped compute, from sorted tokens
    routed: fx.Node                    # sorted tokens the body reads
    ends: fx.Node                      # the experts' end offsets the body reads


def _refuse(region: MoERegion, why: str) -> PartcError:
    return PartcError(f"expert parallelism for layer {region.layer} ({region.module}): "
                      f"{why}")


def _experts_call(gm: fx.GraphModule, region: MoERegion) -> _ExpertsCall:
    if region.expert_form != "batched":
        raise _refuse(region, "only experts held as batched weights (a leading experts "
                              "dimension) run expert-parallel or with a capacity factor; "
                              "this model's are a module list")
    module = _common_prefix([f.rpartition(".")[0] for f in region.expert_params])
    inside = [n for n in gm.graph.nodes if n.op.startswith("call_")
              and (meta.module_path(n) == module or meta.module_path(n).startswith(module + "."))]
    members = set(inside)
    outside_inputs = []
    for node in inside:
        for arg in node.all_input_nodes:
            if arg not in members and not _weight_only(arg) and arg not in outside_inputs:
                outside_inputs.append(arg)
    outputs = [n for n in inside if any(u not in members for u in n.users)]
    floats = [a for a in outside_inputs if _is_float(a)]
    ints = [a for a in outside_inputs if not _is_float(a)]
    if len(outputs) != 1 or len(floats) != 2 or len(ints) != 1:
        raise _refuse(region, f"the experts module {module} is not called as "
                              "experts(tokens, indices, weights) -> output")
    tokens, weights = sorted(floats, key=lambda a: -_shape(a)[-1])
    weight_readers = [n for n in inside if set(_weights_read(n)) & set(region.expert_params)]
    last = weight_readers[-1]
    ancestors = _ancestors(last) | {last}
    start = _descendants(weight_readers[0]) | {weight_readers[0]}
    body = tuple(n for n in inside if n in ancestors and n in start)
    body_set = set(body)
    feeds = []
    for node in body:
        for arg in node.all_input_nodes:
            if arg not in body_set and not _weight_only(arg) and arg not in feeds:
                feeds.append(arg)
    routed = [a for a in feeds if _is_float(a)]
    ends = [a for a in feeds if not _is_float(a)]
    if len(routed) != 1 or len(ends) != 1 or _shape(ends[0]) != (region.num_experts,):
        raise _refuse(region, "its experts are not grouped ops over tokens sorted by "
                              "expert with the experts' end offsets")
    return _ExpertsCall(module=module, nodes=tuple(inside), tokens=tokens, indices=ints[0],
                        weights=weights, output=outputs[0], body=body, routed=routed[0],
                        ends=ends[0])


def _body_module(gm: fx.GraphModule, call: _ExpertsCall,
                 expert_params: tuple[str, ...]) -> fx.GraphModule:
    """The grouped compute as a graph of its own: (routed tokens, ends, *weights)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {call.routed: graph.placeholder("routed"),
                                   call.ends: graph.placeholder("ends")}
    weights = {fqn: graph.placeholder(fqn.replace(".", "_")) for fqn in expert_params}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in weights:
            env[node] = weights[str(node.target)]

    def copy(node: fx.Node) -> fx.Node:
        if node not in env:
            for arg in node.all_input_nodes:
                copy(arg)
            env[node] = graph.node_copy(node, lambda a: env[a])
        return env[node]

    graph.output(copy(call.body[-1]))
    return fx.GraphModule(torch.nn.Module(), graph)


def _replace(gm: fx.GraphModule, region: MoERegion, call: _ExpertsCall, ctx: Context) -> None:
    lowering = ctx.lowering
    experts = ExpertParallel(
        _body_module(gm, call, region.expert_params), num_experts=region.num_experts,
        top_k=region.top_k, tokens_per_sample=region.tokens_per_sample,
        capacity_factor=lowering.capacity_factor if lowering is not None else None,
        ends_dtype=call.ends.meta["val"].dtype, weight_names=region.expert_params)
    if lowering is not None and lowering.fsdp_units:
        name, weights = call.module, ()
        _take_weights(gm, region, call.module, experts)
    else:
        name = call.module.replace(".", "_") + "_ep"
        gm.add_submodule(name, experts)
        getters = {str(n.target): n for n in gm.graph.nodes if n.op == "get_attr"}
        weights = tuple(getters[f] for f in region.expert_params)
    with gm.graph.inserting_before(call.output):
        node = gm.graph.call_module(name, (call.tokens, call.indices, call.weights,
                                           *weights))
    node.meta.update({k: v for k, v in call.output.meta.items()})
    meta.set_module_path(node, call.module)
    call.output.replace_all_uses_with(node)
    for old in reversed(call.nodes):
        if not old.users:
            gm.graph.erase_node(old)
    for getter in list(gm.graph.nodes):
        if getter.op == "get_attr" and not getter.users:
            gm.graph.erase_node(getter)


def _take_weights(gm: fx.GraphModule, region: MoERegion, path: str,
                  experts: torch.nn.Module) -> None:
    """``experts`` replaces the module at ``path`` and holds its routed expert weights
    (the same parameters, under the same FQNs): FSDP shards a module's own parameters
    and gathers them around its forward, so the weights must be the call's own."""
    owner = gm.get_submodule(path)
    names = tuple(f.rpartition(".")[2] for f in region.expert_params)
    if any(f.rpartition(".")[0] != path for f in region.expert_params) or \
            set(dict(owner.named_parameters())) != set(names) or \
            next(owner.buffers(), None) is not None:
        raise _refuse(region, f"under ZeRO-2/3 the experts module {path} must hold the "
                              "routed expert weights and nothing else (they are sharded "
                              "over the ranks holding the same experts); pin zero_stage=1")
    for attr in names:
        experts.register_parameter(attr, owner._parameters[attr])
    experts.owned = names
    parent, _, field = path.rpartition(".")
    gm.get_submodule(parent)._modules[field] = experts


def _ancestors(node: fx.Node) -> set[fx.Node]:
    return _reachable(node, lambda n: n.all_input_nodes)


def _is_float(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_floating_point()
