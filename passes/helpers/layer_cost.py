"""A layer's :class:`~partc.problem.LayerCost` from its run on fake tensors
(:class:`~partc.passes.helpers.layer_run.LayerRun`), per sample: its compute-heavy ops for
the roofline (:func:`_heavy_ops`), its light ops' bytes and calls, what it saves per
recompute mode (none; full: its inputs; selective: all but what only its attention cores
save, with the cores' inputs, :func:`_kept_around`), its backward working set, its light
ops' bytes and kernels as a compiled stage fuses them (:func:`_fused`), and what its rings
add (:func:`_ring_fields`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from partc import meta
from partc.passes import fuse_attention
from partc.passes.helpers.attention_core import attention_cores, core_inputs
from partc.passes.helpers.graph import fetch, linear_weight, storage_of
from partc.passes.helpers.layer_run import LayerRun, RingWork, bytes_as_made
from partc.passes.helpers.sequence_facts import attention_cost
from partc.passes.layers import canonical_signature
from partc.problem import HeavyOp, LayerCost
from partc.runtime.tp import TensorParallelGroup
from partc.runtime.tp_loss import VocabParallelLoss


def _vocab_parallel(gm: fx.GraphModule, nodes: list[fx.Node]) -> bool:
    return any(n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)),
                                                    VocabParallelLoss) for n in nodes)


def layer_cost(gm: fx.GraphModule, info: meta.LayerInfo, nodes: list[fx.Node], run: LayerRun,
               usage: dict, batch: int, shared: set[fx.Node],
               dtypes: dict[fx.Node, tuple[torch.dtype, ...]]) -> LayerCost:
    heavy = {n for n in nodes if run.costs[n].compute_heavy}
    flops = sum(run.costs[n].flops for n in nodes)

    def light(among) -> float:
        # Autocast's casts are kernels of their own beside every op, heavy ones included.
        return sum(run.costs[n].bytes_moved for n in among if n not in heavy) \
            + sum(run.costs[n].cast_bytes for n in among)

    light_bytes = light(nodes)
    calls = {n: int(n.op.startswith("call_")) + run.costs[n].casts for n in nodes}
    # Shared values: made here, held in every mode; read here, charged to their maker.
    held = sum(bytes_as_made(n, dtypes) for n in shared if meta.layer(n).index == info.index)
    input_bytes = sum(size for node, size in run.inputs.items() if node not in shared)
    saved_all = held + sum(size for size, node in run.saved.values() if node not in shared)
    # The cost model charges twice this while the layer's backward runs: twice the
    # largest output, or what a node's backward is known to allocate at once, less what
    # the backward of the layer's later nodes has freed by then.
    workspace = max((run.costs[n].output_bytes for n in nodes), default=0.0)
    order = {node: i for i, node in enumerate(nodes)}
    for node in nodes:
        if run.costs[node].backward_bytes:
            freed = sum(size for key, (size, _) in run.saved.items()
                        if run.savers.get(key) and all(order.get(reader, -1) > order[node]
                                                       for reader in run.savers[key]))
            workspace = max(workspace, (run.costs[node].backward_bytes - freed) / 2)
    if info.is_loss:
        # The loss's backward, the first of the step's, runs while the schedule still
        # holds the stage's output, the loss's input (torch.distributed.pipelining keeps
        # it until then to run backward from), and makes the gradient of its largest
        # saved tensor and of its input, each as large as that tensor (cross entropy:
        # the fp32 log-softmax). The cost model charges a layer twice its workspace
        # while its backward runs, so the loss's is half of that working set. (Held
        # input storages it saves itself are counted once.)
        own = {key for key, (_, node) in run.saved.items() if node not in shared}
        held_input = sum(size for node in run.inputs if node not in shared
                         for key, size in run.storages.get(node, ()) if key not in own)
        largest = max((size for size, node in run.saved.values() if node not in shared),
                      default=0.0)
        # A vocab-parallel loss (partc.runtime.tp_loss) makes one gradient the size of
        # its saved softmax, working in place from there, where cross entropy makes two.
        made = largest if _vocab_parallel(gm, nodes) else 2 * largest
        workspace = max(workspace, (made + held_input) / 2)
    saved = {"none": saved_all, "full": held + input_bytes}
    rec_flops = {"none": 0.0, "full": flops}
    rec_bytes = {"none": 0.0, "full": light_bytes}
    rerun = {"none": 0, "full": sum(calls.values())}
    kernels = {node: run.kernels.get(node, 0) for node in nodes}
    rekernels = {"none": 0, "full": sum(kernels.values())}
    # Selective recompute as the runtime does it (passes/recompute_layers.py): the attention
    # cores are rerun, everything else is kept.
    cores = attention_cores(nodes)
    inside = {node for core in cores for node in core}
    kept = held + _kept_around(cores, run, shared)
    if cores and kept < saved_all:
        saved["selective"] = kept
        rec_flops["selective"] = sum(run.costs[n].flops for n in inside)
        rec_bytes["selective"] = light(inside)
        rerun["selective"] = sum(calls[n] for n in inside)
        rekernels["selective"] = sum(kernels[n] for n in inside)
    count, nbytes, tensors, largest = usage["own"].get(info.index, (0, 0, 0, 0))
    per = 1.0 / batch
    fused_bytes, fused_kernels = _fused(gm, nodes, run, heavy)
    return LayerCost(
        heavy_ops=_heavy_ops([n for n in nodes if n in heavy], run, per),
        name=info.name, signature=canonical_signature(gm, nodes, info.key), fwd_flops=flops * per,
        fwd_mem_bytes=light_bytes * per,
        backward_mem_bytes=None if run.backward_bytes is None else run.backward_bytes * per,
        param_count=count, param_bytes=nbytes,
        param_tensors=tensors, largest_param=largest,
        saved_bytes={k: v * per for k, v in saved.items()},
        recompute_flops={k: v * per for k, v in rec_flops.items()},
        recompute_mem_bytes={k: v * per for k, v in rec_bytes.items()},
        recompute_nodes=rerun,
        workspace_bytes=workspace * per,
        num_nodes=sum(calls.values()),
        forward_kernels=rekernels["full"], backward_kernels=run.backward_kernels,
        recompute_kernels=rekernels,
        offload_bytes=sum(size for size, _ in run.saved.values()) * per,
        fused_mem_bytes=fused_bytes * per, fused_kernels=fused_kernels,
        attention=attention_cost(nodes, lambda n: run.costs[n].flops, per),
        **_ring_fields(run.rings, per))


def _ring_fields(rings: list[RingWork], per: float) -> dict[str, Any]:
    """The layer's rings (:class:`RingWork`, one per call) as ``LayerCost`` fields, per
    sample."""
    if not rings:
        return {}

    def total(which: list[dict]) -> dict[str, int]:
        return {phase: sum(k.get(phase, 0) for k in which) for phase in ("forward", "backward")}

    fields = {"ring_kernels": total([r.kernels for r in rings]),
              "ring_bwd_mem_bytes": sum(r.backward_bytes for r in rings) * per}
    if any(r.single_kernels is not None for r in rings):
        fields["ring_kernels_single"] = total(
            [r.kernels if r.single_kernels is None else r.single_kernels for r in rings])
        fields["ring_bwd_mem_bytes_single"] = sum(
            r.backward_bytes * per if r.single_kernels is None else r.single_backward_bytes
            for r in rings)
    return fields


def _kept_around(cores: list[tuple[fx.Node, ...]], run: LayerRun,
                 shared: set[fx.Node]) -> float:
    """Bytes the layer keeps when its attention ``cores`` are rerun in backward: every
    storage a node outside the cores saves, and the storages of the cores' inputs (their
    checkpoint holds them), each once; shared values are their maker's (held apart)."""
    inside = {node for core in cores for node in core}
    kept = {key: size for key, (size, node) in run.saved.items()
            if node not in shared and run.savers.get(key, set()) - inside}
    for core in cores:
        for value in core_inputs(core):
            if value not in shared:
                kept.update(run.storages.get(value, ()))
    return float(sum(kept.values()))


def _fused(gm: fx.GraphModule, nodes: list[fx.Node], run: LayerRun,
           heavy: set[fx.Node]) -> tuple[float, int]:
    """The bytes the layer's light ops move when each connected chain of them between the
    same heavy ops is one fused kernel, and how many kernels those are: a chain reads each
    value from outside it once (parameters are left out, as
    :func:`partc.passes.helpers.layer_run._node_cost` leaves them) and writes each value
    that a node outside it reads or that backward keeps. Heavy ops and the tensor-parallel
    group's calls (eager in a compiled stage) end chains, and queries of metadata
    (``x.size()``) join none; a chain of views alone is no kernel."""
    breaks = {n for n in nodes if n in heavy or _tp_call(gm, n)}
    light = [n for n in nodes if n.op.startswith("call_") and n not in breaks
             and run.dtypes.get(n)]   # a size query is no kernel
    # How many breaks precede a node on its longest path within the layer: two light ops
    # joined by a value share a kernel only when no heavy op must run between them
    # (``h = x + a; ...; y = h + mlp(h)``: the two adds are two kernels).
    depth: dict[fx.Node, int] = {}
    for node in nodes:
        depth[node] = max((depth.get(arg, 0) + (arg in breaks)
                           for arg in node.all_input_nodes), default=0)
    chain = {n: n for n in light}

    def root(node: fx.Node) -> fx.Node:
        # Path halving: a reference scan's thousands of light ops in one chain made the
        # plain walk quadratic (Mamba at 2,048 tokens: 17 of 200 s). The root is the
        # same either way, so are the groups and their order.
        while chain[node] is not node:
            chain[node] = chain[chain[node]]
            node = chain[node]
        return node

    for node in light:
        for arg in node.all_input_nodes:
            if arg in chain and depth[arg] == depth[node]:
                chain[root(arg)] = root(node)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in light:
        groups.setdefault(root(node), []).append(node)
    kept = {node for _, node in run.saved.values()}
    total, kernels = 0.0, 0
    for group in groups.values():
        inside = set(group)
        if all(run.costs[n].is_view for n in group):
            continue
        kernels += 1
        read = {_base(arg, run) for n in group for arg in n.all_input_nodes
                if arg not in inside}
        written = {_base(n, run) for n in group
                   if n in kept or any(user not in inside for user in n.users)}
        total += sum(_value_bytes(value, run) for value in read - inside)
        total += sum(_value_bytes(value, run) for value in written & inside)
    return total, kernels


def _tp_call(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A call of a method of the stage's tensor-parallel group (``tp.reduce_from_tp``)."""
    if node.op != "call_method" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    owner = node.args[0]
    return owner.op == "get_attr" and isinstance(fetch(gm, str(owner.target)),
                                                 TensorParallelGroup)


def _base(node: fx.Node, run: LayerRun) -> fx.Node:
    """The node whose storage ``node``'s value is (through views of this layer)."""
    return storage_of(node, lambda n: n in run.costs and run.costs[n].is_view)


def _value_bytes(node: fx.Node, run: LayerRun) -> float:
    """Bytes of a value as made: a node of the layer's output, an input's size as read
    (parameters and buffers: 0, never counted as moved)."""
    if node.op == "get_attr":
        return 0.0
    if node in run.costs:
        return run.costs[node].output_bytes
    return float(run.inputs.get(node, 0))


def _heavy_ops(nodes: list[fx.Node], run: LayerRun, per: float) -> tuple[HeavyOp, ...]:
    """The layer's compute-heavy ops for the roofline, equal ones counted together:
    FLOPs, activation bytes and extra backward FLOPs per sample, weight bytes per
    microbatch, whether the op is a fused attention kernel (priced at its own rate), and
    for a linear its weight's features and FQN (FP8 linears,
    :func:`~partc.passes.helpers.graph.linear_weight`)."""
    counts: dict[tuple, list[str]] = {}
    for node in nodes:
        cost = run.costs[node]
        extra = fuse_attention.backward_recompute_flops(node, cost.flops)
        features, name = linear_weight(node)
        key = (cost.flops * per, cost.bytes_moved * per, cost.weight_bytes, extra * per,
               fuse_attention.is_fused(node), features)
        counts.setdefault(key, []).append(name)
    return tuple(HeavyOp(flops=flops, activation_bytes=moved, weight_bytes=weight,
                         bwd_extra_flops=extra, count=len(names), attention=attention,
                         linear=features,
                         linear_names=tuple(names) if features is not None else ())
                 for (flops, moved, weight, extra, attention, features), names
                 in counts.items())
