"""The ``node.meta`` and ``gm.meta`` keys that partc's passes read and write.

Every key is defined once here, with a typed getter and setter; values are frozen
dataclasses (or plain immutable values), never free-form dicts. A pass's docstring names
the keys it reads and writes by the constants below.

Node keys:

- :data:`PARAMS` (``partc.params``): original parameter/buffer FQNs a node uses.
- :data:`MODULE_PATH` (``partc.module_path``): FQN of the innermost module that ran the
  node (``""`` at the root).
- :data:`TENSORS` (``partc.tensors``): shape/dtype/bytes of each tensor the node produces.
- :data:`ROLE` (``partc.role``): what a node is beyond its op (the loss, the target).
- :data:`LAYER` (``partc.layer``): the layer a node belongs to.
- :data:`COST` (``partc.cost``): the node's measured forward costs.
- :data:`RUN_DTYPES` (``partc.run_dtypes``): the dtypes of the node's tensors as the
  runtime makes them (under autocast, where ``estimate`` ran it so), which may differ
  from the traced ones in :data:`TENSORS`; read through :func:`run_bytes`.
- :data:`LOSS_USES` (``partc.loss_uses``), on the loss node: which of its inputs it reads.
- :data:`VOCAB_SHARDED` (``partc.vocab_sharded``), on the loss node: per tensor-parallel
  degree, the input it can read sharded by class and the collectives it then runs
  (``partc.passes.tp.chooser.probe_loss``), or none.
- :data:`ATTENTION_SINK` (``partc.attention_sink``), on a fused attention call: it holds
  attention sinks as one more key (and query row), so its keys are not the sequence's
  tokens alone (``partc.passes.fuse_attention``).

Graph keys (on ``gm.meta``): :data:`TRACE` (how the model was captured) and
:data:`LAYERS` (the layers in order, with their nodes and signatures) and :data:`CUTS`
(bytes crossing each boundary between consecutive layers, for the whole traced batch),
:data:`CUT_TENSORS` (how many tensors cross each boundary, how many carry gradients, and
how many are attention masks made from shapes),
:data:`LAYER_COSTS` (one ``partc.problem.LayerCost`` per layer, per sample) and
:data:`TIMINGS` (seconds each pass took); on a stage, :data:`FSDP_UNITS` (its FSDP units).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

PARAMS = "partc.params"
MODULE_PATH = "partc.module_path"
TENSORS = "partc.tensors"
ROLE = "partc.role"
LAYER = "partc.layer"
COST = "partc.cost"
RUN_DTYPES = "partc.run_dtypes"
TRACE = "partc.trace"
LAYERS = "partc.layers"
CUTS = "partc.cut_bytes"
CUT_TENSORS = "partc.cut_tensors"
LAYER_COSTS = "partc.layer_costs"
TIMINGS = "partc.pass_seconds"
CONTEXT = "partc.context"  # on gm.meta: the trace Context the passes share
LOSS_USES = "partc.loss_uses"  # on the loss node: which of its inputs the loss reads
# On the loss node: per tensor-parallel degree, the input the loss can read sharded by its
# last (class) dim (partc.runtime.tp_loss) and the collectives it then runs, or none.
VOCAB_SHARDED = "partc.vocab_sharded"
FSDP_UNITS = "partc.fsdp_units"  # on a stage's gm.meta: submodule paths of its FSDP units
ATTENTION_SINK = "partc.attention_sink"  # on a fused call holding attention sinks

# Roles: a plain model node has no role.
ROLE_LOSS = "loss"
ROLE_TARGET = "target"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor a node produces: enough to size it and to rebuild a fake copy."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str
    nbytes: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorInfo:
        shape = tuple(int(d) for d in tensor.shape)
        stride = tuple(int(s) for s in tensor.stride())
        nbytes = tensor.numel() * tensor.element_size()
        return cls(shape, stride, tensor.dtype, str(tensor.device), int(nbytes))


@dataclass(frozen=True)
class LayerRef:
    index: int
    name: str


@dataclass(frozen=True)
class NodeCost:
    """Forward costs of one node, for the whole traced batch.

    ``compute_heavy`` marks ops that FlopCounterMode counts (matmul, conv, attention);
    ``is_view`` marks ops whose output aliases an input (no bytes moved). ``saved_bytes``
    is the size of the storages saved for backward that this node *produced*, counted
    once per layer that saves them. ``bytes_moved`` counts the tensors the node reads and
    writes but its parameters and buffers, which are ``weight_bytes`` (a module's own
    included): a microbatch reads them once, whatever its size. ``casts`` and
    ``cast_bytes``: the dtype casts autocast makes of the node's inputs (to the dtype the
    op computes in), each a kernel of its own that reads and writes ``cast_bytes`` in all
    and that no graph node shows. ``backward_bytes``: what the node's backward allocates
    at once where its function says so (``backward_working_set``: partc.runtime.softmax's
    widened copies), 0 where that is no more than twice its output.
    """

    flops: float
    bytes_moved: float
    compute_heavy: bool
    is_view: bool
    output_bytes: float
    saved_bytes: float
    weight_bytes: float = 0.0
    casts: int = 0
    cast_bytes: float = 0.0
    backward_bytes: float = 0.0


@dataclass(frozen=True)
class TraceInfo:
    """How the model was captured, kept on ``gm.meta``."""

    tracer: str
    num_inputs: int
    input_names: tuple[str, ...]
    out_spec: Any  # torch.utils._pytree.TreeSpec of the model's output, or None
    has_loss: bool
    batch_size: int
    # The inputs given by keyword (the last placeholders before the target, in order).
    keywords: tuple[str, ...] = ()
    # The model's own loss is the loss: which labels it averages over
    # (``partc.passes.trace.counted_labels``); None: the user's loss_fn, or none.
    own_loss: str | None = None
    # partc added the keyword input ``shift_labels``, made from ``labels``
    # (``partc.passes.trace.shifted_labels``).
    shift_labels: bool = False


@dataclass(frozen=True)
class LayerInfo:
    """One layer: a contiguous run of graph nodes, in graph order."""

    index: int
    name: str
    key: str
    # The ops in graph order (passes.layers._signature): layers of one signature pair node
    # by node within one trace. Not LayerCost.signature, which holds in every trace.
    signature: str
    nodes: tuple[str, ...]
    is_loss: bool = False


def _set(node: fx.Node, key: str, value: Any) -> None:
    node.meta[key] = value


def set_params(node: fx.Node, fqns: tuple[str, ...]) -> None:
    _set(node, PARAMS, tuple(fqns))


def params(node: fx.Node) -> tuple[str, ...]:
    return node.meta.get(PARAMS, ())


def set_module_path(node: fx.Node, path: str) -> None:
    _set(node, MODULE_PATH, path)


def module_path(node: fx.Node) -> str:
    return node.meta.get(MODULE_PATH, "")


def set_tensors(node: fx.Node, infos: tuple[TensorInfo, ...]) -> None:
    _set(node, TENSORS, tuple(infos))


def tensors(node: fx.Node) -> tuple[TensorInfo, ...]:
    return node.meta.get(TENSORS, ())


def output_bytes(node: fx.Node) -> int:
    return sum(info.nbytes for info in tensors(node))


def set_run_dtypes(node: fx.Node, dtypes: tuple[torch.dtype, ...]) -> None:
    _set(node, RUN_DTYPES, tuple(dtypes))


def run_bytes(node: fx.Node) -> int:
    """Bytes of ``node``'s tensors in the dtypes the runtime makes them in (what a
    collective or a pipeline send of the value moves); as traced where ``estimate`` did
    not run the node (an input)."""
    infos = tensors(node)
    made = node.meta.get(RUN_DTYPES, tuple(info.dtype for info in infos))
    return sum(info.nbytes // info.dtype.itemsize * dtype.itemsize
               for info, dtype in zip(infos, made))


def set_role(node: fx.Node, role: str) -> None:
    _set(node, ROLE, role)


def role(node: fx.Node) -> str | None:
    return node.meta.get(ROLE)


def set_loss_uses(node: fx.Node, uses: tuple[bool, ...]) -> None:
    _set(node, LOSS_USES, uses)


def loss_uses(node: fx.Node) -> tuple[bool, ...] | None:
    """Per input of the loss node, whether the loss's value depends on it (``None``:
    not measured, assume all)."""
    return node.meta.get(LOSS_USES)


def set_vocab_sharded(node: fx.Node, tp: int, position: int | None,
                      collectives: tuple[tuple[str, str, int], ...] = ()) -> None:
    probed = dict(node.meta.get(VOCAB_SHARDED, ()))
    probed[tp] = None if position is None else (position, tuple(collectives))
    _set(node, VOCAB_SHARDED, tuple(sorted(probed.items())))


def vocab_sharded(node: fx.Node, tp: int) -> int | None:
    """The input of the loss node the loss reads sharded ``tp`` ways by its class dim
    (an index into ``node.args``), if any; ``tp`` not probed: none."""
    found = dict(node.meta.get(VOCAB_SHARDED, ())).get(tp)
    return found[0] if found is not None else None


def vocab_collectives(node: fx.Node, tp: int) -> tuple[tuple[str, str, int], ...]:
    """The collectives (kind, phase, bytes of the traced batch) that loss runs so."""
    found = dict(node.meta.get(VOCAB_SHARDED, ())).get(tp)
    return found[1] if found is not None else ()


def vocab_probed(node: fx.Node, tp: int) -> bool:
    return tp in dict(node.meta.get(VOCAB_SHARDED, ()))


def set_attention_sink(node: fx.Node) -> None:
    _set(node, ATTENTION_SINK, True)


def attention_sink(node: fx.Node) -> bool:
    return bool(node.meta.get(ATTENTION_SINK, False))


def set_layer(node: fx.Node, ref: LayerRef) -> None:
    _set(node, LAYER, ref)


def layer(node: fx.Node) -> LayerRef:
    return node.meta[LAYER]


def set_cost(node: fx.Node, cost: NodeCost) -> None:
    _set(node, COST, cost)


def cost(node: fx.Node) -> NodeCost | None:
    return node.meta.get(COST)


def set_trace_info(gm: fx.GraphModule, info: TraceInfo) -> None:
    gm.meta[TRACE] = info


def trace_info(gm: fx.GraphModule) -> TraceInfo:
    return gm.meta[TRACE]


def set_layers(gm: fx.GraphModule, layers: tuple[LayerInfo, ...]) -> None:
    gm.meta[LAYERS] = tuple(layers)


def layers(gm: fx.GraphModule) -> tuple[LayerInfo, ...]:
    return gm.meta.get(LAYERS, ())


def set_cut_bytes(gm: fx.GraphModule, cuts: tuple[float, ...]) -> None:
    gm.meta[CUTS] = tuple(cuts)


def cut_bytes(gm: fx.GraphModule) -> tuple[float, ...]:
    return gm.meta[CUTS]


def set_cut_tensors(gm: fx.GraphModule, counts: tuple[tuple[int, int, int], ...]) -> None:
    gm.meta[CUT_TENSORS] = tuple(counts)


def cut_tensors(gm: fx.GraphModule) -> tuple[tuple[int, int, int], ...]:
    """Per cut: (tensors crossing it, those among them whose gradients cross back, those
    among them that are attention masks made from shapes)."""
    return gm.meta[CUT_TENSORS]


def set_layer_costs(gm: fx.GraphModule, costs: tuple) -> None:
    gm.meta[LAYER_COSTS] = tuple(costs)


def layer_costs(gm: fx.GraphModule) -> tuple:
    """The ``partc.problem.LayerCost`` of each layer, in layer order."""
    return gm.meta[LAYER_COSTS]


def set_fsdp_units(gm: fx.GraphModule, paths: tuple[str, ...]) -> None:
    gm.meta[FSDP_UNITS] = paths


def fsdp_units(gm: fx.GraphModule) -> tuple[str, ...]:
    """Submodule paths of a stage that are FSDP units (none unless ``fsdp_units`` ran)."""
    return gm.meta.get(FSDP_UNITS, ())


def add_pass_time(gm: fx.GraphModule, name: str, seconds: float) -> None:
    gm.meta[TIMINGS] = gm.meta.get(TIMINGS, ()) + ((name, seconds),)


def pass_times(gm: fx.GraphModule) -> tuple[tuple[str, float], ...]:
    return gm.meta.get(TIMINGS, ())
