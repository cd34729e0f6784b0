"""From a measured graph to the plain numbers the planner reads.

``summarize`` collects per-layer costs, cuts and shared parameters into a
:class:`partc.problem.ModelAnalysis`; ``tp_option`` does the same for one rank of a
tensor-parallel variant (local parameter counts, the collectives each layer runs).
Nothing here changes a graph.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import fx, nn

from partc import meta
from partc.errors import ContextParallelError
from partc.identity import model_hash
from partc.passes.context import Context
from partc.passes.context_parallel import attention_masks
from partc.passes.helpers import loss_labels
from partc.passes.helpers.graph import fetch, param_usage
from partc.passes.layers import crossing_bytes, crossing_tensors
from partc.passes.helpers.sequence_facts import context_parallel_blocker
from partc.passes.moe import MoERegion, expert_nodes, recognize
from partc.passes.tp.rewrite import LINEAR_REDUCE_SCATTER, LINEARS_OF_GATHERED
from partc.placement import REPLICATE
from partc.problem import (HeavyOp, ModelAnalysis, ModelSummary, MoECost, SharedParam,
                           TPOption)
from partc.runtime.padding import PADDING_MASK
from partc.runtime.ring_attention import CAUSAL, SLIDING

if TYPE_CHECKING:
    from partc.passes.tp.chooser import Sharding


def tp_option(ctx: Context, base: ModelAnalysis, usage: dict, local: fx.GraphModule,
               chosen: Sharding) -> TPOption:
    """Per-rank costs: measured FLOPs and bytes, local parameter counts, collectives.
    ``base`` and ``usage`` are the whole model's analysis and parameter usage."""
    tp, per_sample = chosen.tp, 1.0 / ctx.batch_size
    placements = chosen.param_placements()

    def local_count(key: int) -> tuple[int, int]:
        tensor = usage["tensors"][key]
        placement = next((placements[f] for f in ctx.param_fqns[key] if f in placements),
                         REPLICATE)
        divisor = tp if placement.kind == "S" else 1
        return tensor.numel() // divisor, tensor.numel() * tensor.element_size() // divisor

    own: dict[int, list[int]] = {}   # layer: [elements, bytes, largest tensor's elements]
    for key, indices in usage["layers"].items():
        if len(indices) == 1:
            count, nbytes = local_count(key)
            totals = own.setdefault(next(iter(indices)), [0, 0, 0])
            totals[0] += count
            totals[1] += nbytes
            totals[2] = max(totals[2], count)
    layers = []
    rings = _rings(local, tp)
    for cost, sharded in zip(meta.layer_costs(local), chosen.layers):
        count, nbytes, largest = own.get(len(layers), (0, 0, 0))
        ringed = rings.get(len(layers), [])
        collectives = _as_ringed(sharded.collectives, ringed)
        comm = tuple((c.kind, c.phase, c.bytes * per_sample) for c in collectives)
        beside = _overlap_flops(collectives, ringed)
        layers.append(dataclasses.replace(
            cost, param_count=count, param_bytes=nbytes, largest_param=largest, tp_comm=comm,
            tp_overlap_flops=tuple(f * per_sample for f in beside) if any(beside) else ()))
    shared = []
    for group in base.shared:
        key = next(k for k, fqns in ctx.param_fqns.items() if fqns[0] == group.fqns[0])
        count, nbytes = local_count(key)
        shared.append(dataclasses.replace(group, param_count=count, param_bytes=nbytes))
    num_layers = len(layers)
    model = dataclasses.replace(
        base, layers=_with_experts(local, ctx, tuple(layers)), shared=tuple(shared),
        cut_bytes=tuple(c * per_sample for c in crossing_bytes(local, num_layers,
                                                               size=meta.run_bytes)),
        cut_tensors=crossing_tensors(local, num_layers))
    return TPOption(
        tp=tp, sequence_parallel=chosen.sequence_parallel, model=model,
        choices=tuple((layer.name, layer.choices) for layer in chosen.layers),
        placements=tuple(sorted(placements.items())),
        partial_grad_params=tuple(sorted(chosen.partial_grad_params)),
        notes=tuple((layer.name, layer.note) for layer in chosen.layers if layer.note))


def _rings(local: fx.GraphModule, tp: int) -> dict[int, list[tuple[str, str, int, float]]]:
    """Per layer, the collectives its rings run beside matmuls
    (``partc.passes.tp.rewrite.fuse_rings``): (kind, phase, bytes of the whole tensor, FLOPs
    of the matmuls beside it). The gathered linears: the forward all-gather beside their
    forward, the backward all-gather of the shard beside the input gradients, the input
    gradient's reduce-scatter beside the weight gradients (equal FLOPs each). The
    reduce-scattered linear: the forward beside its forward, the output gradient's
    all-gather beside its input and weight gradients."""
    rings: dict[int, list[tuple[str, str, int, float]]] = {}
    for node in local.graph.nodes:
        if node.op != "call_method" or meta.cost(node) is None:
            continue
        flops = meta.cost(node).flops
        if node.target == LINEARS_OF_GATHERED:
            whole = meta.run_bytes(node.args[1]) * tp
            moves = [("all_gather", "forward", flops), ("all_gather", "backward", flops),
                     ("reduce_scatter", "backward", flops)]
        elif node.target == LINEAR_REDUCE_SCATTER:
            whole = meta.run_bytes(node) * tp
            moves = [("reduce_scatter", "forward", flops), ("all_gather", "backward", 2 * flops)]
        else:
            continue
        rings.setdefault(meta.layer(node).index, []).extend(
            (kind, phase, whole, beside) for kind, phase, beside in moves)
    return rings


def _as_ringed(collectives, rings: list[tuple[str, str, int, float]]) -> list:
    """A layer's collectives (the chooser's, in its order) as its rings run them: a ring's
    reduce-scatter of an input gradient that the chooser priced as an all-reduce (GPT-2's
    ``Conv1D`` reads its gathered input flattened: the blocking form all-reduces the
    flattened gradient and slices it, ``copy_to_tp`` then ``gather_from_tp``) takes the
    unclaimed all-reduce of its phase nearest in bytes."""
    found = list(collectives)
    for kind, phase, nbytes, _flops in rings:
        if kind != "reduce_scatter":
            continue
        same = [c for c in found if c.kind == kind and c.phase == phase]
        if sum(1 for k, p, _b, _f in rings if (k, p) == (kind, phase)) <= len(same):
            continue
        free = [i for i, c in enumerate(found) if c.kind == "all_reduce" and c.phase == phase]
        if free:
            nearest = min(free, key=lambda i: abs(found[i].bytes - nbytes))
            found[nearest] = dataclasses.replace(found[nearest], kind=kind)
    return found


def _overlap_flops(collectives, rings: list[tuple[str, str, int, float]]) -> list[float]:
    """Per collective of a layer (the chooser's, in its order), the FLOPs of the matmuls
    a ring runs beside it, 0 if none: each ring's collective taken by the unclaimed one
    of its kind and phase nearest in bytes."""
    beside = [0.0] * len(collectives)
    for kind, phase, nbytes, flops in rings:
        free = [i for i, c in enumerate(collectives)
                if c.kind == kind and c.phase == phase and not beside[i]]
        if free:
            nearest = min(free, key=lambda i: abs(collectives[i].bytes - nbytes))
            beside[nearest] = flops
    return beside


def _mask_facts(gm: fx.GraphModule) -> tuple[str, bool]:
    """Why lowering would refuse to split an attention's mask with the sequence
    (:func:`~partc.passes.context_parallel.attention_masks`), or "": known when planning,
    so that no context-parallel plan is made that its lowering refuses; and whether every
    attention is causal (or a sliding window), there being one at least."""
    try:
        masks = attention_masks(gm)
    except ContextParallelError as error:
        if PADDING_MASK not in meta.trace_info(gm).keywords:
            return str(error), False
        return (f"{error} (the example batch's {PADDING_MASK} pads its rows in a way the "
                f"model cannot be traced without: context parallelism splits rows padded "
                f"at their end, whose pads count no label, or unpadded ones: "
                f"partc.runtime.padding)"), False
    return "", bool(masks) and all(mask.kind in (CAUSAL, SLIDING) for mask in masks)


def summarize(gm: fx.GraphModule, ctx: Context) -> ModelAnalysis:
    """Collect the per-layer costs, cuts and shared parameters into a ModelAnalysis."""
    info = meta.trace_info(gm)
    per_sample = 1.0 / ctx.batch_size
    mask_refusal, causal = _mask_facts(gm)
    return ModelAnalysis(
        summary=ModelSummary(
            name=ctx.name, num_params=_num_params(ctx.model), hash=model_hash(ctx.model),
            tokens_per_sample=_tokens_per_sample(ctx), traced_batch_size=ctx.batch_size,
            traced_dtype_bytes=_dtype_bytes(ctx.model), tracer=info.tracer,
            inputs=input_specs(gm), keywords=info.keywords, own_loss=info.own_loss or "",
            shift_labels=info.shift_labels,
            counted_target=False if info.own_loss else loss_labels.counts_its_target(gm),
            autocast=str(ctx.autocast).removeprefix("torch.") if ctx.autocast else "",
            context_parallel_blocker=context_parallel_blocker(gm, sequence_length(gm, ctx)),
            context_parallel_mask=mask_refusal, attention_causal=causal),
        layers=_with_experts(gm, ctx, meta.layer_costs(gm)),
        cut_bytes=tuple(c * per_sample for c in meta.cut_bytes(gm)),
        shared=_shared(gm, ctx),
        cut_tensors=meta.cut_tensors(gm),
    )


def input_specs(gm: fx.GraphModule) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """Name, per-sample shape and dtype of each placeholder (the target last); inputs
    given by keyword are named by their keyword."""
    info = meta.trace_info(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = {node: node.name for node in placeholders}
    model_inputs = [n for n in placeholders if meta.role(n) != meta.ROLE_TARGET]
    if info.keywords:
        names.update(zip(model_inputs[-len(info.keywords):], info.keywords))
    specs = []
    for node in placeholders:
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        value = node.meta["val"]
        specs.append((names[node], tuple(int(d) for d in value.shape[1:]),
                      str(value.dtype).removeprefix("torch.")))
    return tuple(specs)


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in model.parameters()}.values())


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in _unique_params(model))


def _dtype_bytes(model: nn.Module) -> int:
    floats = [p for p in _unique_params(model) if p.is_floating_point()]
    return floats[0].element_size() if floats else 4


def sequence_length(gm: fx.GraphModule, ctx: Context) -> int:
    """Positions per sample that attention reads: its cores' (a model fed embeddings
    has no token ids), else the token ids'."""
    return next((cost.attention.tokens for cost in meta.layer_costs(gm)
                 if cost.attention is not None), _tokens_per_sample(ctx))


def _tokens_per_sample(ctx: Context) -> int:
    first = ctx.fake_inputs[0] if ctx.fake_inputs else None
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return int(first.shape[1])
    return 0


def _shared(gm: fx.GraphModule, ctx: Context) -> tuple[SharedParam, ...]:
    usage = param_usage(gm, ctx)
    shared = []
    for key, indices in usage["layers"].items():
        if len(indices) < 2:
            continue
        tensor = usage["tensors"][key]
        fqns = ctx.param_fqns[key]
        shared.append(SharedParam(name=fqns[0], fqns=fqns, param_count=tensor.numel(),
                                  param_bytes=tensor.numel() * tensor.element_size(),
                                  layers=tuple(sorted(indices))))
    return tuple(sorted(shared, key=lambda s: s.name))


def _with_experts(gm: fx.GraphModule, ctx: Context, costs: tuple) -> tuple:
    """``costs`` with :class:`MoECost` on every mixture-of-experts layer."""
    regions = {region.layer: region for region in recognize(gm, ctx.batch_size)}
    return tuple(_with_moe(cost, moe_cost(gm, ctx, regions[cost.name]),
                           _counted_flops(gm, ctx, regions[cost.name]))
                 if cost.name in regions else cost for cost in costs)


def _with_moe(cost, moe: MoECost, counted: float):
    """The layer with its MoE figures; where ``estimate`` counted no FLOPs for the
    experts' grouped ops (a custom op FlopCounterMode does not know), the routed experts
    at balanced routing join its heavy ops, so that the layer's figures include them."""
    missing = moe.expert_fwd_flops - counted
    if missing <= 0.5 * moe.expert_fwd_flops:
        return dataclasses.replace(cost, moe=moe)
    experts = HeavyOp(flops=missing, activation_bytes=2.0 * moe.dispatch_bytes,
                      weight_bytes=moe.expert_param_bytes)
    recompute = {mode: flops + missing if mode == "full" else flops   # full recompute
                 for mode, flops in cost.recompute_flops.items()}    # reruns the experts
    return dataclasses.replace(cost, moe=moe, fwd_flops=cost.fwd_flops + missing,
                               heavy_ops=cost.heavy_ops + (experts,),
                               recompute_flops=recompute)


def _counted_flops(gm: fx.GraphModule, ctx: Context, region: MoERegion) -> float:
    costs = (meta.cost(n) for n in expert_nodes(gm, region))
    return sum(c.flops for c in costs if c is not None) / ctx.batch_size


def moe_cost(gm: fx.GraphModule, ctx: Context, region: MoERegion) -> MoECost:
    """The routed experts' figures per sample at balanced routing: every token reaches
    ``top_k`` experts, each expert ``tokens * top_k / num_experts`` tokens; one matmul
    FLOP pair per expert weight and routed token. Saved bytes are those the traced
    graph's expert compute and combine keep (its shapes are the balanced total: every
    routed token slot once); full recompute keeps none of them, selective (which reruns
    the attention cores only) all."""
    weights = [fetch(gm, fqn) for fqn in region.expert_params]
    count = sum(w.numel() for w in weights)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    slots = region.tokens_per_sample * region.top_k
    flops = 2.0 * slots * count / region.num_experts
    saved = sum(c.saved_bytes for c in (meta.cost(n) for n in expert_nodes(gm, region))
                if c is not None) / ctx.batch_size
    token_bytes = region.hidden * meta.tensors(_node(gm, region.tokens))[0].dtype.itemsize
    return MoECost(
        num_experts=region.num_experts, top_k=region.top_k, hidden=region.hidden,
        tokens_per_sample=region.tokens_per_sample, expert_param_count=count,
        expert_param_bytes=nbytes, expert_fwd_flops=flops,
        expert_saved_bytes={"none": saved, "selective": saved, "full": 0.0},
        dispatch_bytes=slots * token_bytes, aux_loss=region.aux_loss,
        expert_form=region.expert_form)


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)
