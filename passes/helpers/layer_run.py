"""One layer run on fake tensors, as :func:`partc.passes.estimate.estimate` measures it:
an fx interpreter loop under ``FakeTensorMode``, ``FlopCounterMode`` and autograd's
saved-tensor hooks (:func:`run_layer`). Per node it records the FLOPs, the bytes read and
written, the casts autocast adds and the kernels launched; of the layer, what autograd
saves and which node made each storage, the bytes and kernels of its backward
(:func:`_backward_bytes`), and what its sequence-parallel linears add run as rings
(:class:`RingWork`): a :class:`LayerRun`. The values it reads are fresh stand-ins, made
as the runtime makes them (:func:`_outside_value`, :func:`_frozen_copy`)."""

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
from partc.autocast_policy import cuda_autocast, cuda_policy
from partc.passes import fuse_attention
from partc.passes.helpers.graph import dropout_args, fetch, is_dtype_check
from partc.passes.helpers.op_bytes import COPY_THEN_IN_PLACE, MovedBytes, flop_formulas, nbytes
from partc.passes.tp.rewrite import RING_CALLS
from partc.runtime.tp import TensorParallelGroup
from partc.runtime.tp_rings import REHEARSE_BATCH, REHEARSE_SAMPLE


log = logging.getLogger("partc")


@dataclass
class LayerRun:
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
class Setting:
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


def run_layer(gm: fx.GraphModule, nodes: list[fx.Node], setting: Setting) -> LayerRun:
    fake_mode = setting.fake_mode
    run = LayerRun()
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
                run.inputs[node] = bytes_as_made(node, setting.dtypes)
        return env[node]

    rings: list[tuple[fx.Node, tuple]] = []   # calls the runtime runs as rings
    counter = FlopCounterMode(display=False, custom_mapping=flop_formulas())
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
                try:
                    result = _call(gm, node, setting, *moved)
                except RuntimeError:
                    if setting.device is None:
                        raise
                    result = _as_traced(gm, node, setting, args, kwargs, launched, casts)
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


def _rehearsed_ring(node: fx.Node, args: tuple, kwargs: dict, setting: Setting,
                    frozen: set) -> RingWork:
    """What ``node`` (a sequence-parallel linear the runtime runs as a ring beside its
    collective, ``partc.runtime.tp_rings``: a matmul and a copy or an add per chunk) adds
    to the blocking call the layer's run measured (:class:`RingWork`). Measured on the
    call alone, run again on the values the layer's run gave it (detached: nothing joins
    the layer's graph), blocking and with its stand-in group rehearsing the ring (each
    exchange moving nothing); once per call shape (``Context.ring_work``). Nothing where
    the group runs no rings."""
    group = args[0]
    if not (isinstance(group, TensorParallelGroup) and group.overlap and group.size > 1):
        return RingWork()
    key = (node.target, group.size, setting.autocast, setting.device, setting.runtime_device,
           tuple((tuple(t.shape), t.stride(), t.dtype, t.requires_grad)
                 if isinstance(t, torch.Tensor) else t
                 for t in pytree.tree_leaves((args[1:], kwargs))))
    if key not in setting.rings:
        setting.rings[key] = _measured_ring(node, group, args, kwargs, setting, frozen)
    return setting.rings[key]


@dataclass(frozen=True)
class RingWork:
    """A ring's kernels (by phase, per microbatch) and backward bytes beyond the blocking
    call's, for the traced batch as a batch of several samples runs it (chunks copied
    into place where one sample's would not be), and for one sample (``single``: its
    chunks received and written in place; None where that is the same)."""

    kernels: dict = field(default_factory=dict)
    backward_bytes: float = 0.0      # the whole traced batch's
    single_kernels: dict | None = None
    single_backward_bytes: float = 0.0   # one sample's


def _measured_ring(node: fx.Node, group: TensorParallelGroup, args: tuple, kwargs: dict,
                   setting: Setting, frozen: set) -> RingWork:
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
        return RingWork()
    if single is None:
        return RingWork(kernels=kernels, backward_bytes=moved)
    return RingWork(kernels=kernels, backward_bytes=moved, single_kernels=single[0],
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


def _autocast(setting: Setting, nodes: list[fx.Node]) -> Any:
    """Autocast as the runtime applies it: CUDA's policy, on GPUs and on CPU ranks alike
    (``partc.runtime.precision`` installs it there: CPU autocast would run a norm on an
    fp32 input with bf16 weights). On CPU stand-ins (this torch may have no CUDA) the
    policy is applied at CPU autocast's key."""
    where = setting.device or _device_type(nodes)
    if where == "cpu":
        return cuda_autocast(setting.autocast)
    return torch.autocast(where, dtype=setting.autocast)


def autocast_rules(setting: Setting, layers: list[list[fx.Node]]) -> Any:
    """CUDA's autocast rules installed for the runs of all of ``layers`` at once, where
    some run under CPU autocast (:func:`_autocast`), rather than at each region a run
    enters: an installation registers hundreds of kernels, and a block open inside
    shares it (``cuda_policy``), so the runs compute the same either way."""
    if setting.autocast is None or not any((setting.device or _device_type(nodes)) == "cpu"
                                           for nodes in layers):
        return contextlib.nullcontext()
    return cuda_policy(setting.autocast)


def _device_type(nodes: list[fx.Node]) -> str:
    """Where autocast acts: the device of the layer's values (fake CUDA ones, or CPU)."""
    for node in nodes:
        for info in meta.tensors(node):
            if info.device.startswith("cuda"):
                return "cuda"
    return "cpu"


def bytes_as_made(node: fx.Node, dtypes: dict[fx.Node, tuple[torch.dtype, ...]]) -> int:
    """Bytes of ``node``'s value in the dtypes its layer's run made it in (as traced when
    not run, or not under autocast)."""
    infos = meta.tensors(node)
    made = dtypes.get(node, tuple(info.dtype for info in infos))
    return sum(info.nbytes // info.dtype.itemsize * dtype.itemsize
               for info, dtype in zip(infos, made))


def _outside_value(gm: fx.GraphModule, node: fx.Node, setting: Setting, frozen: set,
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
                 setting: Setting, frozen: set, casts: _Casts) -> Any:
    # The module runs on fake copies of its parameters, known to be frozen, so that what
    # autograd saves of them (a weight, its transpose) is never counted as activation.
    module = gm.get_submodule(str(node.target))
    with casts.paused():   # making the copies is no cast the runtime runs
        state = {name: _frozen_copy(t, setting) for name, t in _named_state(module)}
    for tensor in state.values():
        frozen.add(StorageWeakRef(tensor.untyped_storage()))
    return torch.func.functional_call(module, state, args, kwargs, tie_weights=True)


def _loss_in_fp32(gm: fx.GraphModule, node: fx.Node, args: tuple, setting: Setting,
                  frozen: set, nodes: list[fx.Node], casts: _Casts) -> Any:
    """The loss as the runtime computes it in mixed precision
    (``partc.runtime.rank_build.PlannedLoss``): on the model's floating outputs cast to
    fp32 (the target as it is), outside autocast. The casts save nothing; the loss keeps
    what it keeps in fp32."""
    outputs = pytree.tree_map_only(
        torch.Tensor, lambda t: t.float() if t.is_floating_point() else t, tuple(args[:-1]))
    where = setting.device or _device_type(nodes)
    with torch.autocast(where, enabled=False):
        return _call_module(gm, node, (*outputs, args[-1]), {}, setting, frozen, casts)


def _frozen_copy(value: torch.Tensor, setting: Setting) -> torch.Tensor:
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
    if not _names_device((args, kwargs)):   # most calls: nothing to replace
        return tuple(args), dict(kwargs)
    return pytree.tree_map_only(
        torch.device, lambda d: torch.device(device) if d.type == "meta" else d,
        (tuple(args), dict(kwargs)))   # fx's immutable containers are leaves to pytree


def _names_device(value: Any) -> bool:
    """Whether a device is among ``value``'s items, at any depth of its containers."""
    if isinstance(value, torch.device):
        return True
    if isinstance(value, (list, tuple)):
        return any(_names_device(item) for item in value)
    if isinstance(value, dict):
        return any(_names_device(item) for item in value.values())
    return False


def _named_state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return (list(module.named_parameters(remove_duplicate=False))
            + list(module.named_buffers(remove_duplicate=False)))


def _call(gm: fx.GraphModule, node: fx.Node, setting: Setting, args: tuple,
          kwargs: dict) -> Any:
    if node.op == "call_function":
        if setting.runtime_device == "cuda" and _fused_dropout(node):
            return _native_dropout(*args, **kwargs)
        return fuse_attention.measured(node, setting.runtime_device)(*args, **kwargs)
    self_arg, *rest = args
    return getattr(self_arg, node.target)(*rest, **kwargs)


def _as_traced(gm: fx.GraphModule, node: fx.Node, setting: Setting, args: tuple,
               kwargs: dict, launched: MovedBytes, casts: _Casts) -> Any:
    """``node`` run on the meta device it was traced on, its result moved back to the
    stand-ins' device: where the stand-ins' CPU kernels refuse what the trace (and the
    GPU the runtime trains on) runs. A model traced on meta takes its GPU branches
    (Hugging Face's mixture-of-experts layers count tokens per expert with ``histc`` on
    int32, which CPU kernels do not have). The op's FLOPs and bytes are those of its
    shapes either way; the moves are no work of the layer's."""
    with launched.paused(), casts.paused():
        on_meta = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    result = _call(gm, node, setting, *on_meta)
    with launched.paused(), casts.paused():
        return pytree.tree_map_only(torch.Tensor, lambda t: t.to(setting.device), result)


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


def _attribute_saved(run: LayerRun) -> None:
    """Add each saved storage's bytes to the node in this layer that produced it."""
    extra: dict[fx.Node, int] = {}
    for size, node in run.saved.values():
        extra[node] = extra.get(node, 0) + size
    for node, size in extra.items():
        if node in run.costs:
            cost = run.costs[node]
            run.costs[node] = dataclasses.replace(cost, saved_bytes=cost.saved_bytes + size)
