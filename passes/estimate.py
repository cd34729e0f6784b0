"""Measure each layer's costs, forward and backward, by running it on fake tensors.

One fx interpreter loop per layer runs under ``FakeTensorMode`` (no memory),
``FlopCounterMode`` (FLOPs read before and after each node) and
``saved_tensors_hooks`` with grad enabled (what autograd keeps for backward). Saved
tensors are deduplicated by storage, parameters and buffers are left out, and each saved
storage is attributed to the node that *produced* it. Selective recompute is costed as
the runtime runs it (Megatron's): each attention core
(:func:`partc.passes.helpers.attention_core.attention_cores`) is rerun in backward, so what only
its nodes save is dropped and its inputs are kept instead; everything else the layer
saves is kept. A layer without an attention core has no selective mode.

In mixed precision (``Context.autocast``) the layers run as the runtime runs them: with
their floating parameters in the compute dtype (``partc.runtime.precision``'s copies,
ZeRO-1's bf16 parameters, FSDP's ``MixedPrecisionPolicy``; buffers keep their dtype)
under ``torch.autocast`` with CUDA's policy, which the runtime applies on CPU ranks too
(applied to the CPU stand-ins by :mod:`partc.autocast_policy`): matmuls compute
in the compute dtype and the ops it lists as fp32 (softmax, norms, losses) cast their
inputs to fp32, so what a norm saves is an fp32 copy of its input, while the residual
stream is in the dtype the graph makes it (the compute dtype, unless the traced graph
pins a cast to fp32). Autocast's fp32 casts of the weights (a norm's), made and kept
per microbatch, count as the activations they are in the runtime, and a layer's inputs
have the dtypes the layers before it made them in.
Only activations change: parameter and optimizer bytes are the cost model's
(``partc.problem.Precision``: fp32 masters beside the compute-dtype weights).

On the runtime's device (``Context.autocast_device``, the budget's device type, with or
without autocast): causal fused attention counts half its (seq x seq) FLOPs where the kernel skips
the masked blocks (:func:`partc.passes.fuse_attention.skips_masked_blocks`), and on a GPU
dropout runs as CUDA's fused ``native_dropout``, saving a 1-byte mask rather than the
noise a CPU decomposes it into.

Backward is measured too (:func:`partc.passes.helpers.layer_run._backward_bytes`): autograd
runs on the fake values the forward made, outside autocast as the runtime runs it, and the
bytes its memory-bound ops read and write are counted as a forward node's
(:class:`~partc.passes.helpers.op_bytes.MovedBytes`), matmuls and attention kernels apart
(the roofline prices their FLOPs), with CUDA's kernels where they differ from the ops
dispatched. A gradient is not twice its forward: a cast's is one cast, softmax's reads two
tensors and writes one, cross entropy's fills a vocabulary-wide gradient and scatters into
it.

A value that several later layers read (Llama's attention mask and rotary cos/sin, made
once and read by every block) is held once, not once per reader: it is charged to the
layer that makes it, in every recompute mode, and to none of its readers (see
:func:`_shared_values`).

For a compiled stage (``TrainSpec.compile``) the same run also gives the light ops' bytes as
inductor fuses them (:func:`partc.passes.helpers.layer_cost._fused`): each connected chain
of memory-bound ops between the heavy ones (and the tensor-parallel calls, which stay
outside compiled code) is one kernel that reads the chain's inputs once and writes only what
leaves the chain or is saved for backward.

Layers with the same signature (``transformer.h.0`` … ``h.N``) are measured once and the
numbers copied, which keeps a 32-layer 8B model to a handful of layer runs.
"""

from __future__ import annotations

from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from partc import meta
from partc.passes.context import Context
from partc.passes.helpers.graph import carries_grad, layer_nodes, outside_inputs, param_usage
from partc.passes.helpers.layer_cost import layer_cost
from partc.passes.helpers.layer_run import LayerRun, Setting, autocast_rules, run_layer
from partc.passes.helpers.run_memo import given_run, kept_run, run_key
from partc.passes.layers import crossing_bytes


def estimate(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Give every node its forward costs and every layer its ``LayerCost``.

    Reads: ``meta.LAYERS``, ``meta.LAYER``, ``meta.TENSORS``, ``node.meta["val"]``.
    Writes: ``meta.COST`` and ``meta.RUN_DTYPES`` on every node it runs,
    ``meta.LAYER_COSTS`` on ``gm`` and ``meta.CUTS`` again, in the dtypes as run.
    Requires: ``propagate`` and ``layers`` (layers are measured one at a time, and once
    per signature). Ensures: every non-placeholder node has a ``COST``.
    """
    setting = Setting(fake_mode=FakeTensorMode(allow_non_fake_inputs=True),
                      with_grad=carries_grad(gm), autocast=ctx.autocast, dtypes={},
                      device="cpu" if ctx.autocast is not None and _on_meta(gm) else None,
                      runtime_device=ctx.autocast_device, rings=ctx.ring_work)
    usage = param_usage(gm, ctx)
    shared = _shared_values(gm)
    measured: dict[tuple, tuple[meta.LayerInfo, LayerRun]] = {}
    costs = []
    with autocast_rules(setting, [layer_nodes(gm, info) for info in meta.layers(gm)]):
        for info in meta.layers(gm):
            costs.append(_measure_layer(gm, info, setting, measured, usage, ctx, shared))
    meta.set_layer_costs(gm, tuple(costs))
    # What crosses each cut, in the dtypes the runtime sends it in (under autocast the
    # residual stream stays fp32 while matmul outputs are bf16).
    meta.set_cut_bytes(gm, crossing_bytes(gm, len(costs), size=meta.run_bytes))
    return gm


def _measure_layer(gm: fx.GraphModule, info: meta.LayerInfo, setting: Setting,
                   measured: dict[tuple, tuple[meta.LayerInfo, LayerRun]], usage: dict,
                   ctx: Context, shared: set[fx.Node]) -> meta.LayerCost:
    """One layer's costs, written on its nodes: run, or copied from a layer of the same
    signature measured already (``measured``)."""
    nodes = layer_nodes(gm, info)
    # Under autocast a layer like another may read values of other dtypes.
    key = (info.signature, tuple(setting.dtypes.get(n) for n in outside_inputs(nodes)))
    if key in measured:
        first, run = measured[key]
        run = _copy_run(run, layer_nodes(gm, first), nodes)
    else:
        run = _run_once(gm, nodes, setting, ctx.layer_runs)
        measured[key] = (info, run)
    setting.dtypes.update(run.dtypes)
    for node, node_cost in run.costs.items():
        meta.set_cost(node, node_cost)
    for node, made in run.dtypes.items():
        if len(made) == len(meta.tensors(node)):
            meta.set_run_dtypes(node, made)
    return layer_cost(gm, info, nodes, run, usage, ctx.batch_size, shared, setting.dtypes)


def _run_once(gm: fx.GraphModule, nodes: list[fx.Node], setting: Setting,
              kept: dict[tuple, LayerRun]) -> LayerRun:
    """The run of ``nodes``, or of a layer of another graph measured from the same
    context that reads all the same (``Context.layer_runs``), given to these nodes."""
    key = run_key(gm, nodes, setting)
    if key is None:
        return run_layer(gm, nodes, setting)
    if key not in kept:
        run = run_layer(gm, nodes, setting)
        kept[key] = kept_run(run, nodes)
        return run
    return given_run(kept[key], nodes)


def _on_meta(gm: fx.GraphModule) -> bool:
    return any(info.device == "meta" for node in gm.graph.nodes for info in meta.tensors(node))


# Fetching a parameter moves no bytes and saves nothing: it is a view of the weight.
_FETCH_COST = meta.NodeCost(flops=0.0, bytes_moved=0.0, compute_heavy=False, is_view=True,
                            output_bytes=0.0, saved_bytes=0.0)


def _copy_run(run: LayerRun, source: list[fx.Node], target: list[fx.Node]) -> LayerRun:
    """Reuse a measured layer for one with the same signature, node by node."""
    # Parameters are matched by where they are used, not where they are fetched: a layer
    # that reuses another's weight has no get_attr of its own.
    fetches = [node for node in target if node.op == "get_attr"]
    source = [node for node in source if node.op != "get_attr"]
    target = [node for node in target if node.op != "get_attr"]
    mapping = dict(zip(source, target))
    # Values from outside the layer map by order of first use (same signature, same order).
    mapping.update(zip(outside_inputs(source), outside_inputs(target)))
    copied = LayerRun(inputs={mapping[node]: size for node, size in run.inputs.items()},
                      dtypes={mapping[node]: d for node, d in run.dtypes.items()
                              if node.op != "get_attr"},
                      backward_bytes=run.backward_bytes,
                      kernels={mapping[node]: count for node, count in run.kernels.items()
                               if node.op != "get_attr"},
                      backward_kernels=run.backward_kernels,
                      rings=run.rings)
    copied.costs = {mapping[node]: cost for node, cost in run.costs.items()
                    if node.op != "get_attr"}
    copied.costs.update({node: _FETCH_COST for node in fetches})
    copied.saved = {key: (size, mapping.get(node, node)) for key, (size, node) in run.saved.items()}
    copied.savers = {key: {mapping.get(node, node) for node in nodes}
                     for key, nodes in run.savers.items()}
    copied.storages = {mapping.get(node, node): found for node, found in run.storages.items()
                       if node.op != "get_attr"}
    return copied


def _shared_values(gm: fx.GraphModule) -> set[fx.Node]:
    """Values read by two or more layers besides the one that makes them (inputs count as
    made by the first layer). A stage holds such a value once whichever of its layers
    keep it, so it is charged to its maker alone: exact for the stage that makes it; a
    later stage that reads it holds it in the pipeline's receive buffers while its
    microbatch is in flight (``partc.cost.evaluate.receive_bytes`` takes those for the first
    layer's saved inputs: short by them here)."""
    shared = set()
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "output") or meta.LAYER not in node.meta:
            continue
        readers = {meta.layer(user).index for user in node.users} - {meta.layer(node).index}
        if len(readers) >= 2:
            shared.add(node)
    return shared
