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

Backward is measured too (:func:`_backward_bytes`): autograd runs on the fake values
the forward made, outside autocast as the runtime runs it, and the bytes its memory-bound
ops read and write are counted as a forward node's (:class:`MovedBytes`), matmuls and
attention kernels apart (the roofline prices their FLOPs), with CUDA's kernels where they
differ from the ops dispatched. A gradient is not twice its forward: a cast's is one
cast, softmax's reads two tensors and writes one, cross entropy's fills a
vocabulary-wide gradient and scatters into it.

A value that several later layers read (Llama's attention mask and rotary cos/sin, made
once and read by every block) is held once, not once per reader: it is charged to the
layer that makes it, in every recompute mode, and to none of its readers (see
:func:`_shared_values`).

For a compiled stage (``TrainSpec.compile``) the same run also gives the light ops'
bytes as inductor fuses them (:func:`_fused`): each connected chain of memory-bound ops
between the heavy ones (and the tensor-parallel calls, which stay outside compiled
code) is one kernel that reads the chain's inputs once and writes only what leaves the
chain or is saved for backward.

Layers with the same signature (``transformer.h.0`` … ``h.N``) are measured once and the
numbers copied, which keeps a 32-layer 8B model to a handful of layer runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from partc import meta
from partc.problem import HeavyOp, LayerCost
from partc.runtime.tp import TensorParallelGroup
from partc.runtime.tp_loss import VocabParallelLoss
from partc.runtime.tp_rings import REHEARSE_BATCH, REHEARSE_SAMPLE

from partc.passes import fuse_attention
from partc.passes.helpers.attention_core import attention_cores, core_inputs
from partc.autocast_policy import cuda_autocast
from partc.passes.context import Context
from partc.passes.helpers.graph import (carries_grad, dropout_args, fetch, is_dtype_check, layer_nodes,
                    param_usage, storage_of)
from partc.passes.layers import crossing_bytes
from partc.passes.helpers.op_bytes import COPY_THEN_IN_PLACE, FLOP_FORMULAS, MovedBytes, nbytes
from partc.passes.tp.rewrite import RING_CALLS

log = logging.getLogger("partc")


@dataclass
class _LayerRun:
    """What one run of a layer observed (whole traced batch)."""

    costs: dict[fx.Node, meta.NodeCost] = field(default_factory=dict)
    saved: dict[StorageWeakRef, tuple[int, fx.Node]] = field(default_factory=dict)
    inputs: dict[fx.Node, int] = field(default_factory=dict)   # values read from outside
    dtypes: dict[fx.Node, tuple[torch.dtype, ...]] = field(default_factory=dict)
    # The nodes whose backward keeps each saved storage (one storage, several readers).
    savers: dict[StorageWeakRef, set[fx.Node]] = field(default_factory=dict)
    # The storages (and their bytes) of each value the layer makes or reads, parameters
    # left out: what a checkpoint of part of the layer keeps of its inputs.
    storages: dict[fx.Node, tuple[tuple[StorageWeakRef, int], ...]] = field(
        default_factory=dict)
    # The bytes the layer's backward moves in its memory-bound ops (:func:`_backward_bytes`);
    # None: not measured.
    backward_bytes: float | None = None
    # The kernels each node's forward launches, and the layer's backward (None: not
    # measured), as :class:`MovedBytes` counts them.
    kernels: dict[fx.Node, int] = field(default_factory=dict)
    backward_kernels: int | None = None
    # What its sequence-parallel linears add run as rings (:func:`_rehearsed_ring`).
    rings: list = field(default_factory=list)


@dataclass(frozen=True)
class _Setting:
    """What every layer run shares: the fake mode, the values that carry a gradient,
    the autocast dtype, and the dtypes each value was made in so far (autocast's)."""

    fake_mode: FakeTensorMode
    with_grad: set[fx.Node]
    autocast: torch.dtype | None
    dtypes: dict[fx.Node, tuple[torch.dtype, ...]]
    # Where the stand-ins live: "cpu" for a model on the meta device under autocast
    # (which does not act on meta tensors; fake ones hold no data either way), None:
    # where the traced values are.
    device: str | None = None
    # The device type the runtime trains on ("cuda" or "cpu", the budget's): which kernels
    # run (causal attention that skips masked blocks, dropout's fused kernel).
    runtime_device: str = "cuda"
    # The rings measured so far (``Context.ring_work``, :func:`_rehearsed_ring`).
    rings: dict = field(default_factory=dict)


def estimate(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Give every node its forward costs and every layer its ``LayerCost``.

    Reads: ``meta.LAYERS``, ``meta.LAYER``, ``meta.TENSORS``, ``node.meta["val"]``.
    Writes: ``meta.COST`` and ``meta.RUN_DTYPES`` on every node it runs,
    ``meta.LAYER_COSTS`` on ``gm`` and ``meta.CUTS`` again, in the dtypes as run.
    Requires: ``propagate`` and ``layers`` (layers are measured one at a time, and once
    per signature). Ensures: every non-placeholder node has a ``COST``.
    """
    setting = _Setting(fake_mode=FakeTensorMode(allow_non_fake_inputs=True),
                       with_grad=carries_grad(gm), autocast=ctx.autocast, dtypes={},
                       device="cpu" if ctx.autocast is not None and _on_meta(gm) else None,
                       runtime_device=ctx.autocast_device, rings=ctx.ring_work)
    usage = param_usage(gm, ctx)
    shared = _shared_values(gm)
    measured: dict[tuple, tuple[meta.LayerInfo, _LayerRun]] = {}
    costs = []
    for info in meta.layers(gm):
        nodes = layer_nodes(gm, info)
        # Under autocast a layer like another may read values of other dtypes.
        key = (info.signature, tuple(setting.dtypes.get(n) for n in _external_inputs(nodes)))
        if key in measured:
            first, run = measured[key]
            run = _copy_run(run, layer_nodes(gm, first), nodes)
        else:
            run = _run_layer(gm, nodes, setting)
            measured[key] = (info, run)
        setting.dtypes.update(run.dtypes)
        for node, node_cost in run.costs.items():
            meta.set_cost(node, node_cost)
        for node, made in run.dtypes.items():
            if len(made) == len(meta.tensors(node)):
                meta.set_run_dtypes(node, made)
        costs.append(_layer_cost(gm, info, nodes, run, usage, ctx.batch_size, shared,
                                 setting.dtypes))
    meta.set_layer_costs(gm, tuple(costs))
    # What crosses each cut, in the dtypes the runtime sends it in (under autocast the
    # residual stream stays fp32 while matmul outputs are bf16).
    meta.set_cut_bytes(gm, crossing_bytes(gm, len(costs), size=meta.run_bytes))
    return gm


def _on_meta(gm: fx.GraphModule) -> bool:
    return any(info.device == "meta" for node in gm.graph.nodes for info in meta.tensors(node))


def _run_layer(gm: fx.GraphModule, nodes: list[fx.Node], setting: _Setting) -> _LayerRun:
    fake_mode = setting.fake_mode
    run = _LayerRun()
    members = set(nodes)
    env: dict[fx.Node, Any] = {}
    producer: dict[StorageWeakRef, fx.Node] = {}
    frozen: set[StorageWeakRef] = set()  # parameters and buffers: never activations
    current: list[fx.Node] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = StorageWeakRef(tensor.untyped_storage())
        if storage not in frozen and storage not in run.saved:
            made_by = producer.get(storage, current[-1])
            run.saved[storage] = (tensor.untyped_storage().nbytes(), made_by)
        if storage not in frozen:
            run.savers.setdefault(storage, set()).add(current[-1])
        return tensor

    def value_of(node: fx.Node) -> Any:
        if node not in env:
            env[node] = _outside_value(gm, node, setting, frozen, producer)
            if node not in members and node.op != "get_attr":
                run.inputs[node] = _bytes_as_made(node, setting.dtypes)
        return env[node]

    rings: list[tuple[fx.Node, tuple]] = []   # calls the runtime runs as rings
    counter = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
    # The kernels each node launches, paused with the casts while stand-ins are made.
    launched = MovedBytes(frozen, cuda=setting.runtime_device == "cuda")
    casts = _Casts(cuda=launched.cuda, launched=launched)
    with contextlib.ExitStack() as scope:
        for context in (fake_mode, counter, casts, launched, torch.enable_grad(),
                        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
            scope.enter_context(context)
        if setting.autocast is not None:
            scope.enter_context(_autocast(setting, nodes))
        for node in nodes:
            current.append(node)
            before = counter.get_total_flops()
            args = fx.node.map_arg(node.args, value_of)
            kwargs = fx.node.map_arg(node.kwargs, value_of)
            casts.made.clear()   # the stand-ins' own making is no cast the runtime runs
            casts.copied = 0.0
            kernels_before = launched.kernels
            if node.op == "get_attr":
                with launched.paused():   # a fetch launches nothing; its stand-in's making
                    result = value_of(node)
            elif setting.autocast is not None and is_dtype_check(node):
                result = None   # autocast changes dtypes; the runtime drops these checks
            elif setting.autocast is not None and meta.role(node) == meta.ROLE_LOSS:
                result = _loss_in_fp32(gm, node, args, setting, frozen, nodes, casts)
            elif node.op == "call_module":
                result = _call_module(gm, node, args, kwargs, setting, frozen, casts)
            else:
                moved = _moved(setting.device, args, kwargs)
                result = _call(gm, node, setting, *moved)
                if node.op == "call_method" and node.target in RING_CALLS:
                    rings.append((node, moved))
            env[node] = result
            run.kernels[node] = launched.kernels - kernels_before
            run.dtypes[node] = tuple(t.dtype for t in pytree.tree_leaves(result)
                                     if isinstance(t, torch.Tensor))
            flops = counter.get_total_flops() - before
            if fuse_attention.skips_masked_blocks(node, setting.runtime_device):
                flops //= 2   # the kernel skips the blocks the causal mask hides
            run.costs[node] = _with_casts(
                _node_cost(node, args, kwargs, result, flops, producer, frozen,
                           casts.copied),
                casts.made, result if _casts_itself(node) else None)
            working_set = getattr(node.target, "backward_working_set", None)
            if working_set is not None:
                run.costs[node] = dataclasses.replace(
                    run.costs[node], backward_bytes=float(working_set(result)))
            run.storages[node] = _storages(result, frozen)
            if node.op == "call_module":   # its parameters are read, not passed
                state = [t for _, t in _named_state(gm.get_submodule(str(node.target)))]
                run.costs[node] = dataclasses.replace(run.costs[node], weight_bytes=_weight_bytes(
                    state, [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]))
    # Backward runs outside autocast, as the runtime runs it.
    run.backward_bytes, run.backward_kernels = _backward_bytes(
        nodes, env, frozen, fake_mode, cuda=setting.runtime_device == "cuda")
    for node in run.inputs:
        run.storages[node] = _storages(env[node], frozen)
    _attribute_saved(run)
    run.rings = [_rehearsed_ring(node, args, kwargs, setting, frozen)
                 for node, (args, kwargs) in rings]
    return run


def _rehearsed_ring(node: fx.Node, args: tuple, kwargs: dict, setting: _Setting,
                    frozen: set) -> _RingWork:
    """What ``node`` (a sequence-parallel linear the runtime runs as a ring beside its
    collective, ``partc.runtime.tp_rings``: a matmul and a copy or an add per chunk) adds
    to the blocking call the layer's run measured (:class:`_RingWork`). Measured on the
    call alone, run again on the values the layer's run gave it (detached: nothing joins
    the layer's graph), blocking and with its stand-in group rehearsing the ring (each
    exchange moving nothing); once per call shape (``Context.ring_work``). Nothing where
    the group runs no rings."""
    group = args[0]
    if not (isinstance(group, TensorParallelGroup) and group.overlap and group.size > 1):
        return _RingWork()
    key = (node.target, group.size, setting.autocast, setting.device, setting.runtime_device,
           tuple((tuple(t.shape), t.stride(), t.dtype, t.requires_grad)
                 if isinstance(t, torch.Tensor) else t
                 for t in pytree.tree_leaves((args[1:], kwargs))))
    if key not in setting.rings:
        setting.rings[key] = _measured_ring(node, group, args, kwargs, setting, frozen)
    return setting.rings[key]


@dataclass(frozen=True)
class _RingWork:
    """A ring's kernels (by phase, per microbatch) and backward bytes beyond the blocking
    call's, for the traced batch as a batch of several samples runs it (chunks copied
    into place where one sample's would not be), and for one sample (``single``: its
    chunks received and written in place; None where that is the same)."""

    kernels: dict = field(default_factory=dict)
    backward_bytes: float = 0.0      # the whole traced batch's
    single_kernels: dict | None = None
    single_backward_bytes: float = 0.0   # one sample's


def _measured_ring(node: fx.Node, group: TensorParallelGroup, args: tuple, kwargs: dict,
                   setting: _Setting, frozen: set) -> _RingWork:
    cuda = setting.runtime_device == "cuda"
    call = getattr(group, node.target)
    bound = inspect.signature(call).bind(*args[1:], **kwargs)
    bound.apply_defaults()
    # The batch-first activations a sequence shard's chunk of one sample is contiguous
    # in (the runtime then receives and writes it in place, whatever the traced batch).
    samples = [t for t in pytree.tree_leaves((args[1:], kwargs)) if isinstance(t, torch.Tensor)
               and StorageWeakRef(t.untyped_storage()) not in frozen and t.dim() > 1]
    by_sample = bound.arguments["dim"] % samples[0].dim() > 0 if samples else False

    def leaf(value: Any, one: bool) -> Any:
        if isinstance(value, torch.Tensor):
            if one and any(value is t for t in samples):
                value = value[:1]
            return value.detach().requires_grad_(value.requires_grad)
        return value

    def counted(rehearsing: str | None, one: bool = False) -> tuple[int, int, float]:
        group.rehearsing = rehearsing
        try:
            with contextlib.ExitStack() as scope:
                scope.enter_context(setting.fake_mode)
                scope.enter_context(torch.enable_grad())
                inputs = pytree.tree_map(lambda v: leaf(v, one), (args[1:], kwargs))
                if setting.autocast is not None:
                    scope.enter_context(_autocast(setting, [node]))
                with MovedBytes(frozen, cuda) as forward:
                    result = call(*inputs[0], **inputs[1])
            outputs = [t for t in pytree.tree_leaves(result)
                       if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            with setting.fake_mode, torch.enable_grad(), MovedBytes(frozen, cuda) as back:
                torch.autograd.backward(outputs, [torch.empty_like(t) for t in outputs])
        finally:
            group.rehearsing = None
        return forward.kernels, back.kernels, back.moved

    def beyond(ring, blocking) -> tuple[dict[str, int], float]:
        return ({"forward": ring[0] - blocking[0], "backward": ring[1] - blocking[1]},
                ring[2] - blocking[2])

    try:
        blocking = counted(None)
        kernels, moved = beyond(counted(REHEARSE_BATCH), blocking)
        # The stand-in's blocking calls copy alike for any batch (what larger batches
        # copy): one sample launches the same kernels and moves its share of the bytes.
        single = beyond(counted(REHEARSE_SAMPLE, True),
                        (blocking[0], blocking[1], blocking[2] / samples[0].shape[0])) \
            if by_sample else None
    except Exception as error:   # noqa: BLE001 - any op the stand-ins cannot run
        log.debug("rings of %s not measured on fake tensors: %s", node.name, error)
        return _RingWork()
    if single is None:
        return _RingWork(kernels=kernels, backward_bytes=moved)
    return _RingWork(kernels=kernels, backward_bytes=moved, single_kernels=single[0],
                     single_backward_bytes=single[1])


def _backward_bytes(nodes: list[fx.Node], env: dict[fx.Node, Any], frozen: set,
                    fake_mode: FakeTensorMode,
                    cuda: bool) -> tuple[float | None, int | None]:
    """The bytes the memory-bound ops of the layer's backward read and write, counted as
    :func:`_node_cost` counts a forward node's (:class:`MovedBytes`), and the kernels
    its ops launch: autograd run on the fake values the forward made, from a gradient
    for each of the layer's outputs (values read outside it) that needs one; ``cuda``:
    with the kernels CUDA runs where they differ from the ops dispatched. None where
    autograd cannot run on the stand-ins (the cost model then charges backward twice the
    forward's bytes and kernels)."""
    members = set(nodes)
    outputs = [t for node in nodes if node in env and any(u not in members for u in node.users)
               for t in pytree.tree_leaves(env[node])
               if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    if not outputs:
        return 0.0, 0
    counted = MovedBytes(frozen, cuda)
    try:
        with fake_mode, torch.enable_grad():
            grads = [torch.empty_like(t) for t in outputs]
            with counted:
                torch.autograd.backward(outputs, grads)
    except Exception as error:   # noqa: BLE001 - any op the stand-ins cannot run
        log.debug("backward of %s not measured on fake tensors: %s", nodes[0].name, error)
        return None, None
    return counted.moved, counted.kernels


_HALF_TO_FLOAT = (torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default)


class _Casts(TorchDispatchMode):
    """Records the dtype casts run below autocast (``made``: each cast's output and the
    bytes it reads and writes), the node's own and those autocast inserts, and the copies
    out-of-place ops make before running in place (``copied``: their bytes). ``cuda``:
    as CUDA runs them, where softmax and log-softmax read an fp16 input and write fp32 in
    one kernel (ATen fuses the widening for float16 only: a bf16 input is widened by a
    cast of its own, as on a CPU)."""

    def __init__(self, cuda: bool, launched: MovedBytes) -> None:
        super().__init__()
        self.cuda = cuda
        self.made: list[tuple[torch.Tensor, float, torch.dtype]] = []   # and its source
        self.copied = 0.0
        # The kernels counted beside these casts, paused with them (:meth:`paused`).
        self.launched = launched

    @contextlib.contextmanager
    def paused(self):
        """Record no cast (nor, in ``launched``, kernel) of what runs inside."""
        made = self.made
        self.made = []
        with self.launched.paused():
            try:
                yield
            finally:
                self.made = made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor) \
                and isinstance(args[0], torch.Tensor) and out.dtype != args[0].dtype:
            self.made.append((out, float(nbytes(args[0]) + nbytes(out)), args[0].dtype))
        elif self.cuda and func in _HALF_TO_FLOAT and self.made \
                and self.made[-1][0] is args[0] and self.made[-1][2] == torch.float16:
            self.made.pop()
        elif func.overloadpacket in COPY_THEN_IN_PLACE and isinstance(out, torch.Tensor):
            self.copied += 2.0 * nbytes(out)
        return out


def _casts_itself(node: fx.Node) -> bool:
    """Whether a cast making ``node``'s result is the node's own work (whose bytes
    ``bytes_moved`` counts): an explicit ``.to(dtype)``, a parameter handed over in the
    compute dtype. Not where the node's function computes wider and narrows its result
    as a kernel of its own (``casts_its_result``: :func:`partc.runtime.norm.layer_norm`)."""
    return not getattr(node.target, "casts_its_result", False)


def _with_casts(cost: meta.NodeCost, made: list[tuple[torch.Tensor, float, torch.dtype]],
                result: Any) -> meta.NodeCost:
    """``cost`` with the casts made while the node ran (autocast's beside it, a runtime
    function's inside it) but the node's own ``result`` where it is given: an explicit
    ``.to(dtype)`` is the node itself, whose bytes ``bytes_moved`` already counts."""
    own = {id(t) for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)}
    implicit = [size for out, size, _ in made if id(out) not in own]
    if not implicit:
        return cost
    return dataclasses.replace(cost, casts=len(implicit), cast_bytes=float(sum(implicit)))


def _storages(value: Any, frozen: set[StorageWeakRef]) -> tuple[tuple[StorageWeakRef, int], ...]:
    """The storages of the tensors in ``value`` with their bytes, parameters left out."""
    found = {}
    for tensor in pytree.tree_leaves(value):
        if isinstance(tensor, torch.Tensor):
            storage = StorageWeakRef(tensor.untyped_storage())
            if storage not in frozen:
                found[storage] = tensor.untyped_storage().nbytes()
    return tuple(found.items())


def _autocast(setting: _Setting, nodes: list[fx.Node]) -> Any:
    """Autocast as the runtime applies it: CUDA's policy, on GPUs and on CPU ranks alike
    (``partc.runtime.precision`` installs it there: CPU autocast would run a norm on an
    fp32 input with bf16 weights). On CPU stand-ins (this torch may have no CUDA) the
    policy is applied at CPU autocast's key."""
    where = setting.device or _device_type(nodes)
    if where == "cpu":
        return cuda_autocast(setting.autocast)
    return torch.autocast(where, dtype=setting.autocast)


def _device_type(nodes: list[fx.Node]) -> str:
    """Where autocast acts: the device of the layer's values (fake CUDA ones, or CPU)."""
    for node in nodes:
        for info in meta.tensors(node):
            if info.device.startswith("cuda"):
                return "cuda"
    return "cpu"


def _bytes_as_made(node: fx.Node, dtypes: dict[fx.Node, tuple[torch.dtype, ...]]) -> int:
    """Bytes of ``node``'s value in the dtypes its layer's run made it in (as traced when
    not run, or not under autocast)."""
    infos = meta.tensors(node)
    made = dtypes.get(node, tuple(info.dtype for info in infos))
    return sum(info.nbytes // info.dtype.itemsize * dtype.itemsize
               for info, dtype in zip(infos, made))


def _outside_value(gm: fx.GraphModule, node: fx.Node, setting: _Setting, frozen: set,
                   producer: dict) -> Any:
    """A fresh fake stand-in for a value the layer reads: a parameter or an input. An
    input has the dtypes it was made in, and requires grad only where the runtime's does
    (it depends on a trainable parameter, :func:`partc.passes.layers.carries_grad`):
    what autograd saves depends on it (a product saves each factor only for the other's
    gradient)."""
    if node.op == "get_attr":
        value = fetch(gm, str(node.target))
        if isinstance(value, fx.GraphModule) and setting.device is not None:
            return _subgraph_on(value, setting.device)
        if not isinstance(value, torch.Tensor):
            return value  # a subgraph that export's higher-order ops call
        tensor = _frozen_copy(value, setting)
        frozen.add(StorageWeakRef(tensor.untyped_storage()))
        return tensor
    requires_grad = node in setting.with_grad
    dtypes = iter(setting.dtypes.get(node, ()))

    def fresh(value: torch.Tensor) -> torch.Tensor:
        tensor = torch.empty_strided(tuple(value.shape), tuple(value.stride()),
                                     dtype=next(dtypes, value.dtype),
                                     device=setting.device or value.device)
        producer[StorageWeakRef(tensor.untyped_storage())] = node
        return tensor.requires_grad_(requires_grad and tensor.is_floating_point())

    return pytree.tree_map_only(torch.Tensor, fresh, node.meta.get("val"))


def _call_module(gm: fx.GraphModule, node: fx.Node, args: tuple, kwargs: dict,
                 setting: _Setting, frozen: set, casts: _Casts) -> Any:
    # The module runs on fake copies of its parameters, known to be frozen, so that what
    # autograd saves of them (a weight, its transpose) is never counted as activation.
    module = gm.get_submodule(str(node.target))
    with casts.paused():   # making the copies is no cast the runtime runs
        state = {name: _frozen_copy(t, setting) for name, t in _named_state(module)}
    for tensor in state.values():
        frozen.add(StorageWeakRef(tensor.untyped_storage()))
    return torch.func.functional_call(module, state, args, kwargs, tie_weights=True)


def _loss_in_fp32(gm: fx.GraphModule, node: fx.Node, args: tuple, setting: _Setting,
                  frozen: set, nodes: list[fx.Node], casts: _Casts) -> Any:
    """The loss as the runtime computes it in mixed precision (``partc.runtime.module``'s
    ``_Loss``): on the model's floating outputs cast to fp32 (the target as it is),
    outside autocast. The casts save nothing; the loss keeps what it keeps in fp32."""
    outputs = pytree.tree_map_only(
        torch.Tensor, lambda t: t.float() if t.is_floating_point() else t, tuple(args[:-1]))
    where = setting.device or _device_type(nodes)
    with torch.autocast(where, enabled=False):
        return _call_module(gm, node, (*outputs, args[-1]), {}, setting, frozen, casts)


def _frozen_copy(value: torch.Tensor, setting: _Setting) -> torch.Tensor:
    """A fake copy of a parameter or buffer, on the stand-ins' device. In mixed precision
    a floating parameter is in the compute dtype, as the runtime computes with it
    (``partc.runtime.precision``, FSDP's ``MixedPrecisionPolicy``); buffers keep theirs."""
    dtype = value.dtype
    if setting.autocast is not None and isinstance(value, nn.Parameter) \
            and value.is_floating_point():
        dtype = setting.autocast
    if setting.device is None:
        tensor = setting.fake_mode.from_tensor(value)
        if dtype == value.dtype:
            return tensor
        return tensor.detach().to(dtype).requires_grad_(value.requires_grad)
    return torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=dtype,
                               device=setting.device).requires_grad_(value.requires_grad)


def _subgraph_on(module: fx.GraphModule, device: str) -> fx.GraphModule:
    """A copy of a subgraph that export's higher-order ops call, making its tensors on
    ``device`` instead of the meta device (its own subgraphs too)."""
    graph = copy.deepcopy(module.graph)
    for node in graph.nodes:
        node.args, node.kwargs = _moved(device, node.args, node.kwargs)
    moved = fx.GraphModule(module, graph)
    for name, child in list(moved.named_children()):
        if isinstance(child, fx.GraphModule):
            setattr(moved, name, _subgraph_on(child, device))
    return moved


def _moved(device: str | None, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments with the meta device the graph was traced on replaced by the
    stand-ins' ``device`` (tensors made inside the layer, ``arange(device=...)``)."""
    if device is None:
        return args, kwargs
    return pytree.tree_map_only(
        torch.device, lambda d: torch.device(device) if d.type == "meta" else d,
        (tuple(args), dict(kwargs)))   # fx's immutable containers are leaves to pytree


def _named_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return (list(module.named_parameters(remove_duplicate=False))
            + list(module.named_buffers(remove_duplicate=False)))


def _call(gm: fx.GraphModule, node: fx.Node, setting: _Setting, args: tuple,
          kwargs: dict) -> Any:
    if node.op == "call_function":
        if setting.runtime_device == "cuda" and _fused_dropout(node):
            return _native_dropout(*args, **kwargs)
        return fuse_attention.measured(node)(*args, **kwargs)
    self_arg, *rest = args
    return getattr(self_arg, node.target)(*rest, **kwargs)


def _fused_dropout(node: fx.Node) -> bool:
    """A functional training dropout (0 < p < 1, not in place) that CUDA runs as its
    fused ``native_dropout``, saving a 1-byte mask for backward; a CPU decomposes it
    instead into noise in the input's dtype, which is what it saves (measured as it
    runs)."""
    found = dropout_args(node) if node.op == "call_function" else None
    if found is None:
        return False
    p, training, inplace = found
    return isinstance(p, (int, float)) and 0 < p < 1 and training is True and not inplace


def _native_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,
                    inplace: bool = False, **kwargs: Any) -> torch.Tensor:
    """Dropout as CUDA's fused kernel runs it: autograd saves its boolean mask."""
    return torch.ops.aten.native_dropout(input, float(kwargs.get("p", p)), True)[0]


def _node_cost(node: fx.Node, args: tuple, kwargs: dict, result: Any, flops: int,
               producer: dict, frozen: set, copied: float = 0.0) -> meta.NodeCost:
    """What ``node`` computed and moved: the tensors it read (parameters and buffers
    apart, as its weight bytes) and wrote, and ``copied``, the bytes of the copies its
    ops made before running in place (:data:`COPY_THEN_IN_PLACE`)."""
    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    outputs = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
    input_storages = {StorageWeakRef(t.untyped_storage()) for t in inputs}
    out_bytes = sum(nbytes(t) for t in outputs)
    # (An op with FLOPs that returns its input's storage is a product accumulating in
    # place, ``c.addmm_(a, b)``: it reads and writes, as ``torch.addmm`` does.)
    is_view = node.op == "get_attr" or not flops and bool(outputs) and all(
        StorageWeakRef(t.untyped_storage()) in input_storages for t in outputs)
    for tensor in outputs:
        producer.setdefault(StorageWeakRef(tensor.untyped_storage()), node)
    fixed = [t for t in inputs if StorageWeakRef(t.untyped_storage()) in frozen]
    # A view moves nothing; nor does a query of metadata (size, dim) that returns no tensor.
    moved = 0 if is_view or not outputs else \
        sum(nbytes(t) for t in inputs) - sum(nbytes(t) for t in fixed) + out_bytes + copied
    return meta.NodeCost(flops=float(flops), bytes_moved=float(moved),
                         compute_heavy=flops > 0, is_view=is_view,
                         output_bytes=float(0 if is_view else out_bytes), saved_bytes=0.0,
                         weight_bytes=0.0 if is_view else _weight_bytes(fixed, outputs))


def _weight_bytes(params: list[torch.Tensor], outputs: list[torch.Tensor]) -> float:
    """Bytes of the parameters an op reads, in the dtype it computes in (its floating
    output's): under autocast a matmul reads the low-precision copy of a weight."""
    floating = [t for t in outputs if t.is_floating_point()]
    return float(sum(t.numel() * (floating[0].element_size() if floating else t.element_size())
                     for t in params))


def _attribute_saved(run: _LayerRun) -> None:
    """Add each saved storage's bytes to the node in this layer that produced it."""
    extra: dict[fx.Node, int] = {}
    for size, node in run.saved.values():
        extra[node] = extra.get(node, 0) + size
    for node, size in extra.items():
        if node in run.costs:
            cost = run.costs[node]
            run.costs[node] = dataclasses.replace(cost, saved_bytes=cost.saved_bytes + size)


# Fetching a parameter moves no bytes and saves nothing: it is a view of the weight.
_FETCH_COST = meta.NodeCost(flops=0.0, bytes_moved=0.0, compute_heavy=False, is_view=True,
                            output_bytes=0.0, saved_bytes=0.0)


def _copy_run(run: _LayerRun, source: list[fx.Node], target: list[fx.Node]) -> _LayerRun:
    """Reuse a measured layer for one with the same signature, node by node."""
    # Parameters are matched by where they are used, not where they are fetched: a layer
    # that reuses another's weight has no get_attr of its own.
    fetches = [node for node in target if node.op == "get_attr"]
    source = [node for node in source if node.op != "get_attr"]
    target = [node for node in target if node.op != "get_attr"]
    mapping = dict(zip(source, target))
    # Values from outside the layer map by order of first use (same signature, same order).
    mapping.update(zip(_external_inputs(source), _external_inputs(target)))
    copied = _LayerRun(inputs={mapping[node]: size for node, size in run.inputs.items()},
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


def _external_inputs(nodes: list[fx.Node]) -> list[fx.Node]:
    members, seen = set(nodes), {}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in members:
                seen.setdefault(arg, None)
    return list(seen)


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


def _vocab_parallel(gm: fx.GraphModule, nodes: list[fx.Node]) -> bool:
    return any(n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)),
                                                    VocabParallelLoss) for n in nodes)


def _layer_cost(gm: fx.GraphModule, info: meta.LayerInfo, nodes: list[fx.Node], run: _LayerRun,
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
    held = sum(_bytes_as_made(n, dtypes) for n in shared if meta.layer(n).index == info.index)
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
        name=info.name, signature=info.signature, fwd_flops=flops * per,
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
        fused_mem_bytes=fused_bytes * per, fused_kernels=fused_kernels,
        **_ring_fields(run.rings, per))


def _ring_fields(rings: list[_RingWork], per: float) -> dict[str, Any]:
    """The layer's rings (:class:`_RingWork`, one per call) as ``LayerCost`` fields, per
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


def _kept_around(cores: list[tuple[fx.Node, ...]], run: _LayerRun,
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


def _fused(gm: fx.GraphModule, nodes: list[fx.Node], run: _LayerRun,
           heavy: set[fx.Node]) -> tuple[float, int]:
    """The bytes the layer's light ops move when each connected chain of them between
    the same heavy ops is one fused kernel, and how many kernels those are: a chain
    reads each value from outside it once (parameters are left out, as :func:`_node_cost` leaves them) and writes each
    value that a node outside it reads or that backward keeps. Heavy ops and the
    tensor-parallel group's calls (eager in a compiled stage) end chains, and queries of
    metadata (``x.size()``) join none; a chain of views alone is no kernel."""
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
        while chain[node] is not node:
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


def _base(node: fx.Node, run: _LayerRun) -> fx.Node:
    """The node whose storage ``node``'s value is (through views of this layer)."""
    return storage_of(node, lambda n: n in run.costs and run.costs[n].is_view)


def _value_bytes(node: fx.Node, run: _LayerRun) -> float:
    """Bytes of a value as made: a node of the layer's output, an input's size as read
    (parameters and buffers: 0, never counted as moved)."""
    if node.op == "get_attr":
        return 0.0
    if node in run.costs:
        return run.costs[node].output_bytes
    return float(run.inputs.get(node, 0))


def _heavy_ops(nodes: list[fx.Node], run: _LayerRun, per: float) -> tuple[HeavyOp, ...]:
    """The layer's compute-heavy ops for the roofline, equal ones counted together:
    FLOPs, activation bytes and extra backward FLOPs per sample, weight bytes per
    microbatch, and whether the op is a fused attention kernel (priced at its own rate)."""
    counts: dict[tuple[float, float, float, float, bool], int] = {}
    for node in nodes:
        cost = run.costs[node]
        extra = fuse_attention.backward_recompute_flops(node, cost.flops)
        key = (cost.flops * per, cost.bytes_moved * per, cost.weight_bytes, extra * per,
               fuse_attention.is_fused(node))
        counts[key] = counts.get(key, 0) + 1
    return tuple(HeavyOp(flops=flops, activation_bytes=moved, weight_bytes=weight,
                         bwd_extra_flops=extra, count=n, attention=attention)
                 for (flops, moved, weight, extra, attention), n in counts.items())


