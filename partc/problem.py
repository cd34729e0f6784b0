"""The data the planner sees: per-layer costs of a traced model, and the budget as numbers.

Glossary (used across partc):

- *layer*: a contiguous group of graph nodes (an embedding, one transformer block, the
  final norm, the head, the loss). Stage boundaries fall only between layers.
- *stage*: a contiguous run of layers placed on one pipeline rank group.
- *cut*: the boundary after layer ``l``; ``cut_bytes[l]`` is what crosses it per sample.
- *microbatch*: ``micro_batch_size`` samples pushed through the pipeline together.
- *recompute mode*: ``"none"`` keeps every tensor saved for backward; ``"selective"``
  reruns the layer's attention cores in backward (from the product of queries and keys
  to the product with the values, Megatron's selective recompute) and keeps the rest;
  ``"full"`` keeps only the layer's inputs and reruns its forward in backward;
  ``"offload"`` keeps everything, on the host (:mod:`partc.cost.offload_time`).

Everything here is a frozen dataclass of plain numbers: no fx objects, no tensors. The
front half of the compiler (``partc.passes``) produces a :class:`ModelAnalysis`;
:func:`partc.compiler.build_problem` combines it with a budget and a training spec.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, replace
from typing import Any

from partc.device.figures import FIGURE_NAMES, unit_of
from partc.names import Recompute
from partc.placement import Placement

RECOMPUTE_MODES: tuple[str, ...] = tuple(mode.value for mode in Recompute)

# 0: plain data parallelism; 1: optimizer state sharded over dp; 2: gradients too;
# 3: weights too.
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
# When ZeRO-2 reduce-scatters the gradients of a step's microbatches over dp: after every
# microbatch's backward ("microbatch": sharded gradients only, m reduce-scatters), or once,
# in the last microbatch's backward, after accumulating them unsharded ("step": one
# reduce-scatter, a whole fp32 gradient held through the step, as Megatron's and
# DeepSpeed's gradient accumulation do).
ZERO2_GRAD_SYNCS: tuple[str, ...] = ("microbatch", "step")
MASTER_BYTES = 4.0   # fp32, the dtype of master weights and their gradients
# Elements per gradient bucket the runtime reduces over dp at once under ZeRO 0/1 unless
# the training says otherwise (``TrainSpec.bucket_elements``, ``partc/runtime/
# optimizer.py``; 100 MB of fp32 gradients, Megatron's order of size).
BUCKET_ELEMENTS = 25_000_000
# The share of a stage's parameters that its small layers (norms, position embeddings)
# may hold for them not to be FSDP units of their own under ZeRO-2/3: each unit costs an
# all-gather and a reduce-scatter per microbatch (two all-gathers under ZeRO-3), whose
# latency and FSDP's work a layer of a few thousand parameters does not repay in memory.
# The runtime joins them to the next unit (``partc.runtime.fsdp_shard.unit_groups``); the
# cost model charges them no unit's work of their own.
SMALL_UNITS_SHARE = 0.01


def effective_zero_stage(zero_stage: int, replicas: int) -> int:
    """The ZeRO stage that runs: with one rank in the gradient group (``replicas``, the
    dp x cp ranks holding the same parameters) there is nothing to shard over, whatever
    was chosen or pinned."""
    return zero_stage if replicas > 1 else 0


def reduces_once_per_step(zero_stage: int, replicas: int, zero2_grad_sync: str,
                          num_microbatches: int) -> bool:
    """Whether ZeRO-2 accumulates the step's gradients unsharded and reduce-scatters them
    once (``zero2_grad_sync`` "step"): only where ZeRO-2 runs and a step has several
    microbatches; with one, both ways are the same reduce-scatter."""
    return (effective_zero_stage(zero_stage, replicas) == 2 and zero2_grad_sync == "step"
            and num_microbatches > 1)


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes per parameter as the runtime keeps them, by precision; the one place that
    says so (``TrainSpec`` makes it, the cost model reads it).

    In fp32 the weights are their own master. In mixed precision (bf16) the runtime's
    parameters stay fp32 and are the master: under ZeRO 0/1 the stage computes with bf16
    copies of them made once per step (``partc/runtime/precision.py``) and gradients are
    accumulated and reduced in fp32 buckets (``partc/runtime/optimizer.py``); under
    ZeRO-2/3 FSDP gathers bf16 copies of the fp32 shards and reduce-scatters gradients
    in fp32. So, per parameter (weights + gradients + optimizer state), Adam holds:

    ======  =====================  ===============================================
    ZeRO    fp32                   bf16
    ======  =====================  ===============================================
    0       4 + 4 + 8              (4 + 2) + 4 + 8 (master and step copy)
    1       4 + 4 + 8/d            (2 + 4/d) + 4 + 8/d (Megatron's: 2 + 4 + 12/d)
    2       4 + 4/d + 8/d          (2 + 4/d) + 4/d + 8/d (gathered bf16, fp32 shard)
    2 step  4 + 4 + 8/d            (2 + 4/d) + 4 + 8/d (fp32 gradient accumulated whole)
    3       16/d                   16/d, and the layers gathered in bf16 as they run
    ======  =====================  ===============================================

    (the ZeRO paper's 2 + 2 + 12, :attr:`zero_paper_bytes`; ``partc.cost.state_bytes`` applies the
    sharding). Under ZeRO-1 in mixed precision the runtime is Megatron's distributed
    optimizer: the weights are kept in the compute dtype and each rank holds the fp32
    master of its dp shard only (checkpoints and ``full_state_dict`` read the masters).
    """

    compute_bytes: float            # a weight as the layers compute with it: 4 fp32, 2 bf16
    optimizer_state_bytes: float    # the optimizer's own state, fp32 (Adam: 8, SGD: 0)
    # fp32 copies of the stepped weights torch's step makes beside them, over the whole list
    # in its foreach form (Adam: sqrt(v); SGD, momentum or not: none); torch's per-tensor
    # loop makes twice as many of one tensor at a time (partc.cost.state_bytes.step_bytes).
    step_copies: float = 0.0

    @property
    def master_bytes(self) -> float:
        """The fp32 parameters (the master weights) and their gradients."""
        return max(self.compute_bytes, MASTER_BYTES)

    @property
    def mixed(self) -> bool:
        """Compute in a narrower dtype than the master weights."""
        return self.compute_bytes < self.master_bytes

    @property
    def step_bytes(self) -> float:
        """Bytes an optimizer step moves per parameter it steps, fp32 all: the gradient
        read, the weight and the state read and written (Adam: 4 + 8 + 16 = 28)."""
        return 3 * self.master_bytes + 2 * self.optimizer_state_bytes

    @property
    def zero_paper_bytes(self) -> tuple[float, float, float]:
        """(weights, gradients, optimizer state) the ZeRO paper's way: compute-dtype
        weights and gradients, the fp32 master copy counted with the optimizer state
        (2 + 2 + 12 for mixed-precision Adam)."""
        master = self.master_bytes if self.mixed else 0.0
        return self.compute_bytes, self.compute_bytes, self.optimizer_state_bytes + master


@dataclass(frozen=True, kw_only=True)
class HeavyOp:
    """``count`` compute-heavy ops of a layer (matmuls, attention) with equal costs, as the
    roofline prices them: ``flops`` and ``activation_bytes`` (inputs and outputs other
    than parameters) per sample, and ``weight_bytes``, the parameters the op reads, which
    a microbatch reads once whatever its size. ``bwd_extra_flops``: what its backward
    does beyond twice ``flops`` (see :attr:`LayerCost.bwd_extra_flops`), per sample.
    ``attention``: a fused attention kernel (flash), which runs at its own share of peak
    (:attr:`DeviceNumbers.attention_efficiency`), not the matmuls'."""

    flops: float
    activation_bytes: float
    weight_bytes: float
    count: int = 1
    bwd_extra_flops: float = 0.0
    attention: bool = False
    # A linear (``aten.linear`` with a parameter for weight): its weight's (in, out)
    # features, and the weights' FQNs of the ``count`` ops (the names FP8 linears go by,
    # TrainSpec.fp8). None and (): another matmul.
    linear: tuple[int, int] | None = None
    linear_names: tuple[str, ...] = ()


# How a mixture-of-experts layer holds its routed experts (passes/moe.py recognises both).
EXPERT_FORMS = ("batched", "module-list")


@dataclass(frozen=True, kw_only=True)
class MoECost:
    """The routed experts of a mixture-of-experts layer, per sample of the batch, at
    balanced routing (every expert receives ``tokens_per_sample * top_k / num_experts``
    tokens). The layer's own figures (:class:`LayerCost`) include these experts as one
    process runs them; the planner divides the expert parameters over the
    expert-parallel group, adds the all-to-all, and scales the expert activations by
    the routing imbalance it budgets for. The router, the shared experts and the
    combine stay in the layer's ordinary figures and are never expert-parallel.

    ``expert_form`` is how the model holds the routed experts: ``"batched"`` weights
    with a leading experts dimension, or a ``"module-list"`` of experts called one by
    one. The runtime splits batched experts only, so a module list keeps ep = 1."""

    num_experts: int
    top_k: int
    hidden: int                     # width of a token as dispatched (bytes = hidden x dtype)
    tokens_per_sample: int
    expert_param_count: int         # all routed experts together
    expert_param_bytes: int
    expert_fwd_flops: float         # all routed experts' forward FLOPs per sample
    expert_saved_bytes: dict[str, float]   # by recompute mode, like LayerCost.saved_bytes
    dispatch_bytes: float           # one all-to-all's payload per sample
                                    # (tokens x top_k x hidden x dtype)
    capacity_factor: float | None = None   # None: dropless
    aux_loss: bool = False          # the model adds a load-balancing loss
    expert_form: str = "batched"    # batched | module-list (see EXPERT_FORMS)

    def __post_init__(self) -> None:
        if self.expert_form not in EXPERT_FORMS:
            raise ValueError(f"MoECost.expert_form must be one of {EXPERT_FORMS}, "
                             f"not {self.expert_form!r}")


@dataclass(frozen=True, kw_only=True)
class AttentionCost:
    """A layer's attention cores (:mod:`partc.passes.helpers.attention_core`) as context
    parallelism prices them, per sample as traced (one rank's share of the heads under
    tensor parallelism): ``cores`` of them, each over ``tokens`` query and key positions
    with ``heads`` query heads and ``kv_heads`` key/value heads (fewer under grouped-query
    attention, counted before any repeat) of ``head_dim``; ``flops``: the cores' forward
    FLOPs, all of them (as measured: a causal kernel that skips masked blocks counts
    half its (seq x seq) products)."""

    cores: int
    heads: int
    kv_heads: int
    head_dim: int
    tokens: int
    flops: float

    def kv_elements(self, cp: int) -> float:
        """Elements of the keys and values one of ``cp`` ranks holds, per sample: the
        block a ring step passes on."""
        return self.cores * 2 * self.kv_heads * self.head_dim * self.tokens / cp

    def qkvo_elements(self, cp: int) -> float:
        """Elements of queries, keys, values and output one of ``cp`` ranks holds per
        sample: what the all-to-alls around the cores move."""
        return self.cores * 2 * (self.heads + self.kv_heads) * self.head_dim * self.tokens / cp


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """What one layer costs, per sample of the batch, in the dtype it was measured in
    (the traced one, or the autocast dtype in ``ModelSummary.autocast``).

    ``saved_bytes``, ``recompute_flops`` and ``recompute_mem_bytes`` are keyed by recompute
    mode and hold an entry for each mode in :data:`RECOMPUTE_MODES` that the layer allows
    (``"none"`` and ``"full"`` always; ``"selective"`` only when it saves memory).

    ``fwd_flops`` are those of the compute-heavy ops, listed in ``heavy_ops`` (equal ops
    once, with a count) for the roofline; ``fwd_mem_bytes`` and ``recompute_mem_bytes``
    are the bytes the other, memory-bound ops move.
    """

    name: str
    # What the layer computes, in no trace order (passes.layers.canonical_signature):
    # like blocks share it, and every process tracing the model gets the same one.
    signature: str
    fwd_flops: float
    fwd_mem_bytes: float
    param_count: int
    param_bytes: int
    saved_bytes: dict[str, float]
    recompute_flops: dict[str, float]
    recompute_mem_bytes: dict[str, float]
    workspace_bytes: float
    # The ops the layer calls per microbatch (what dispatch is paid for): its graph's
    # calls and the casts autocast inserts beside them.
    num_nodes: int = 0
    # Parameter tensors among ``param_count`` (ZeRO-2/3's optimizer step pays FSDP's
    # dispatch per tensor: DeviceNumbers.fsdp_step_overhead_s); 0: not counted, one.
    param_tensors: int = 0
    # Elements of the largest of those tensors (an optimizer stepping one tensor at a
    # time makes its temporaries that size: partc.cost.state_bytes.step_bytes); 0: not counted.
    largest_param: int = 0
    # Tensor-parallel collectives per sample: (kind, "forward"/"backward", bytes of the
    # whole tensor). Empty without tensor parallelism.
    tp_comm: tuple[tuple[str, str, float], ...] = ()
    # Per entry of ``tp_comm``, the FLOPs per sample of the matmuls that run beside it
    # where the runtime fuses it with them into a ring (partc.runtime.tp_rings): the
    # linears' forward for the forward gather or reduce-scatter, their input or weight
    # gradients for the backward ones; 0 for a blocking collective. Empty: all blocking.
    tp_overlap_flops: tuple[float, ...] = ()
    heavy_ops: tuple[HeavyOp, ...] = ()
    # Mixture-of-experts: the routed experts inside this layer's figures; None for a
    # dense layer.
    moe: MoECost | None = None
    # Compiled (``TrainSpec.compile``): the bytes the memory-bound ops move per sample when
    # each chain of them between heavy ops is one fused kernel (its inputs read once,
    # its outputs that leave the chain or are saved for backward written once), and the
    # number of those kernels. None: not measured.
    fused_mem_bytes: float | None = None
    fused_kernels: int | None = None
    # Ops a recompute mode reruns, by mode (full: every op; selective: the attention
    # cores'). Missing: full reruns ``num_nodes``, selective the light ops.
    recompute_nodes: dict[str, int] = field(default_factory=dict)
    # The bytes the memory-bound ops of the layer's backward move per sample, as measured
    # (autograd run on fake tensors: passes/estimate.py). None: twice ``fwd_mem_bytes``.
    backward_mem_bytes: float | None = None
    # The device kernels the layer launches per microbatch (whatever its size), forward
    # and backward, and those each recompute mode launches again, as the estimate counts
    # them (passes/op_bytes.MovedBytes): each costs DeviceNumbers.kernel_overhead_s of
    # device time. None: not counted (a layer built by hand), no per-kernel time;
    # backward None beside a counted forward: twice the forward's.
    forward_kernels: int | None = None
    backward_kernels: int | None = None
    recompute_kernels: dict[str, int] = field(default_factory=dict)
    # What the layer's sequence-parallel linears add when they run as rings beside their
    # collectives (partc.runtime.tp_rings, TrainSpec.tp_overlap) to the program measured
    # above, where they run blocking: kernels per microbatch ("forward", "backward": a
    # matmul and a copy or an add per chunk where blocking runs one matmul) and bytes per
    # sample the backward's memory-bound ops move. Empty and 0: no such linears.
    ring_kernels: dict[str, int] = field(default_factory=dict)
    ring_bwd_mem_bytes: float = 0.0
    # The same for a microbatch of one sample, whose chunks the rings receive and write
    # in place where a batch-first activation's chunks of several samples are copied;
    # None: no different.
    ring_kernels_single: dict[str, int] | None = None
    ring_bwd_mem_bytes_single: float = 0.0
    # The layer's attention cores as context parallelism prices them; None: it has none.
    attention: AttentionCost | None = None
    # What the layer's own ops save for backward per sample, by storage, parameters and
    # buffers left out, whoever made it (``saved_bytes`` charges a value read by several
    # layers to its maker): what offloading the layer moves to the host and back
    # (partc.runtime.activation_offload). None: not measured, ``saved_bytes["none"]``.
    offload_bytes: float | None = None

    def __post_init__(self) -> None:
        listed = sum(op.flops * op.count for op in self.heavy_ops)
        if abs(listed - self.fwd_flops) > 1e-9 * max(self.fwd_flops, 1.0):
            raise ValueError(f"layer {self.name}: heavy_ops hold {listed} of its "
                             f"{self.fwd_flops} forward FLOPs per sample")
        if self.tp_overlap_flops and len(self.tp_overlap_flops) != len(self.tp_comm):
            raise ValueError(f"layer {self.name}: {len(self.tp_overlap_flops)} overlap "
                             f"figures for {len(self.tp_comm)} collectives")
        for mode in ("none", "full"):
            if mode not in self.saved_bytes:
                raise ValueError(f"layer {self.name}: saved_bytes lacks mode {mode!r}")
        for mode in self.saved_bytes:
            if mode not in RECOMPUTE_MODES:
                raise ValueError(f"layer {self.name}: unknown recompute mode {mode!r}")
            if mode not in self.recompute_flops or mode not in self.recompute_mem_bytes:
                raise ValueError(f"layer {self.name}: recompute cost lacks mode {mode!r}")

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(m for m in RECOMPUTE_MODES if m in self.saved_bytes)

    def unnamed(self) -> "LayerCost":
        """The layer's figures alone: without its name and its linears' weight names
        (what blocks of one structure share)."""
        return replace(self, name="", heavy_ops=tuple(replace(op, linear_names=())
                                                      for op in self.heavy_ops))

    @property
    def bwd_extra_flops(self) -> float:
        """Backward FLOPs beyond twice the forward's: a fused attention kernel recomputes
        its scores in backward (``partc.passes.fuse_attention.backward_recompute_flops``)."""
        return sum(op.bwd_extra_flops * op.count for op in self.heavy_ops)

    @property
    def bwd_flops(self) -> float:
        # Gradient w.r.t. inputs and w.r.t. weights: two matmuls per forward matmul.
        return 2.0 * self.fwd_flops + self.bwd_extra_flops

    @property
    def bwd_mem_bytes(self) -> float:
        """What backward's memory-bound ops move per sample: as measured, else (a layer
        built by hand, or whose backward the stand-ins could not run) twice the
        forward's bytes, a gradient read and written for each value read and written."""
        if self.backward_mem_bytes is not None:
            return self.backward_mem_bytes
        return 2.0 * self.fwd_mem_bytes

    def as_rings(self, micro_batch: int | None = None) -> "LayerCost":
        """The layer as it runs with its sequence-parallel linears as rings (itself where
        it has none), on microbatches of ``micro_batch`` samples (None: several): the
        ring kernels and bytes added to its forward, backward and full recompute (a
        replay of the forward)."""
        if not self.ring_kernels and not self.ring_bwd_mem_bytes:
            return self
        kernels, moved = self.ring_kernels, self.ring_bwd_mem_bytes
        if micro_batch == 1 and self.ring_kernels_single is not None:
            kernels, moved = self.ring_kernels_single, self.ring_bwd_mem_bytes_single
        forward, backward = kernels.get("forward", 0), kernels.get("backward", 0)
        recompute = dict(self.recompute_kernels)
        if "full" in recompute:
            recompute["full"] += forward
        return replace(
            self, ring_kernels={}, ring_bwd_mem_bytes=0.0, ring_kernels_single=None,
            ring_bwd_mem_bytes_single=0.0, recompute_kernels=recompute,
            forward_kernels=None if self.forward_kernels is None
            else self.forward_kernels + forward,
            backward_kernels=None if self.backward_kernels is None
            else self.backward_kernels + backward,
            backward_mem_bytes=None if self.backward_mem_bytes is None
            else self.backward_mem_bytes + moved)

    @property
    def kernels(self) -> dict[str, Any]:
        """Kernels per microbatch by phase, as :func:`partc.cost.layer_compute.layer_work`
        splits its time: forward, backward and per recompute mode (full: the forward's;
        selective: its attention cores'); all 0 where they were not counted."""
        forward = self.forward_kernels or 0
        backward = self.backward_kernels if self.backward_kernels is not None else 2 * forward
        recompute = {m: self.recompute_kernels.get(m, 0 if m == "none" else forward)
                     for m in self.modes}
        return {"forward": forward, "backward": backward, "recompute": recompute}


@dataclass(frozen=True, kw_only=True)
class SharedParam:
    """A parameter used by several layers (tied embeddings); every stage using it holds it."""

    name: str
    fqns: tuple[str, ...]
    param_count: int
    param_bytes: int
    layers: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ModelSummary:
    name: str
    num_params: int
    hash: str
    tokens_per_sample: int
    traced_batch_size: int
    traced_dtype_bytes: int
    tracer: str
    # (name, shape without the batch dimension, dtype name) of each input, target last
    inputs: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    # The inputs given by keyword (``model(**batch)``), in the order of ``inputs``.
    keywords: tuple[str, ...] = ()
    # The model's own loss is trained on: which labels it averages over ("shifted",
    # "tokens", "samples": ``partc.passes.trace.counted_labels``); "": the user's loss_fn.
    own_loss: str = ""
    # partc added the input ``shift_labels`` (the labels shifted, made by the runtime:
    # ``partc.runtime.label_weights.next_labels``) for the model's own loss to read.
    shift_labels: bool = False
    # The user's loss_fn returns a mean over its target's entries not -100
    # (``partc.passes.helpers.loss_labels.counts_its_target``; None: it could not be asked).
    counted_target: bool | None = False
    # The dtype autocast computed in while the layers were measured ("bfloat16"); "": none,
    # the layers' numbers are in the traced dtype.
    autocast: str = ""
    # Why the sequence cannot be split over context-parallel ranks: the first op outside
    # the attention cores that mixes positions of the sequence (a scan, a reduction or a
    # product over it), named with its layer; "": none does.
    context_parallel_blocker: str = ""
    # Why an attention's mask cannot be split with the sequence (one that depends on the
    # batch, or is neither causal nor a sliding window), as lowering refuses it
    # (``partc.passes.context_parallel.attention_masks``); "": every mask can.
    context_parallel_mask: str = ""
    # Every attention is causal (or a sliding window), there being one at least.
    attention_causal: bool = False
    # The example batch's keyword inputs the model was traced without (a padding mask,
    # position ids 0..S-1), and whether rows padded at their end, whose pads count no
    # label, are taken too (else only masks of ones): the runtime checks each batch's and
    # leaves them out (``partc.runtime.padding``). Set by ``partc.compile``, not by the
    # analysis.
    left_out: tuple[str, ...] = ()
    pads_at_end: bool = False


@dataclass(frozen=True, kw_only=True)
class ModelAnalysis:
    """The front half's result: layers in order, the cuts between them, shared parameters."""

    summary: ModelSummary
    layers: tuple[LayerCost, ...]
    cut_bytes: tuple[float, ...]
    shared: tuple[SharedParam, ...] = ()
    # Per cut: tensors that cross it, how many of them carry a gradient back (float
    # tensors that depend on a parameter), and how many are attention masks made from
    # shapes (context parallelism's lowering erases them: under cp they are not sent).
    # One message each, per microbatch.
    cut_tensors: tuple[tuple[int, int, int], ...] = ()
    # Tensor-parallel variants the planner may choose from (none: tp = 1 only).
    tensor_parallel: tuple["TPOption", ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a model needs at least one layer")
        if len(self.cut_bytes) != len(self.layers) - 1:
            raise ValueError(
                f"{len(self.layers)} layers need {len(self.layers) - 1} cuts, "
                f"got {len(self.cut_bytes)}"
            )
        for group in self.shared:
            for layer in group.layers:
                if not 0 <= layer < len(self.layers):
                    raise ValueError(f"shared parameter {group.name}: no layer {layer}")

    @functools.cached_property
    def param_count(self) -> int:
        """The model's parameters (a tensor-parallel rank's, in a variant): its layers'
        and the shared ones', counted once; the cost tables ask for it per row."""
        return sum(layer.param_count for layer in self.layers) + sum(
            shared.param_count for shared in self.shared)


@dataclass(frozen=True, kw_only=True)
class TPOption:
    """The model as one rank of a tensor-parallel group of ``tp`` sees it.

    ``model`` holds per-rank costs (local FLOPs, saved bytes and parameters, with each
    layer's collectives in ``LayerCost.tp_comm``); the rest is what the runtime needs to
    rebuild the same sharding: per layer, a strategy index per node; per parameter, its
    placement; and the replicated parameters whose gradients are summed over the group.
    """

    tp: int
    sequence_parallel: bool
    model: ModelAnalysis
    objective: str = "time"   # what the per-layer choice minimised first: time or memory
    choices: tuple[tuple[str, tuple[int, ...]], ...]
    placements: tuple[tuple[str, Placement], ...]   # (parameter FQN, placement), sorted
    partial_grad_params: tuple[str, ...] = ()
    notes: tuple[tuple[str, str], ...] = ()   # (layer, why it stays replicated)


@dataclass(frozen=True, kw_only=True)
class DeviceNumbers:
    """The budget as the cost model uses it (SI units: bytes, FLOP/s, bytes/s, seconds):
    the resolved figures of the training dtype, by the names of
    :class:`partc.device.figures.DeviceFigures`, which says what each is, and what the
    cost model needs beside them. Defaults: a GPU's where a figure has one, for problems
    built by hand."""

    num_devices: int
    memory_bytes: tuple[int, ...]   # one limit per device
    peak_flops: float               # in the training dtype
    flops_efficiency: float
    hbm_bandwidth: float
    devices_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    link_latency_s: float                       # per step of a collective between nodes
    intra_node_latency_s: float | None = None   # inside a node; None: link_latency_s
    # DeviceFigures.collective_links: (kind, latency per step, bandwidth per link).
    intra_node_links: tuple[tuple[str, float, float], ...] = ()
    op_overhead_s: float = 0.0
    op_overhead_backward_s: float = 0.0
    # Whether the host dispatches ops ahead of the device (a GPU's launch queue): then a
    # layer's phase takes the longer of its kernels and its ops' dispatch (the overhead
    # is a floor, reached when the kernels are too small to hide it); False (a CPU, where
    # the same thread dispatches and computes): the overhead adds to every op.
    dispatch_ahead: bool = False
    matmul_overhead_s: float = 0.0
    kernel_overhead_s: float = 0.0
    fsdp_unit_overhead_s: float = 0.0
    fsdp_unit_overhead_backward_s: float = 0.0
    fsdp_gather_overhead_s: float = 0.0
    fsdp_scatter_overhead_s: float = 0.0
    fsdp_step_overhead_s: float = 0.0
    comm_overlap: float = 1.0
    split_backward_factor: float = 1.0
    elementwise_bandwidth: float | None = None   # None: hbm_bandwidth
    optimizer_bandwidth: float | None = None     # None: hbm_bandwidth
    fsdp_copy_bandwidth: float | None = None     # None: hbm_bandwidth
    attention_efficiency: float | None = None    # None: flops_efficiency
    # The host, for offload (DeviceFigures says what each is); None: not known, and
    # nothing is offloaded unless pinned.
    host_memory: int | None = None
    host_to_device_bandwidth: float | None = None
    device_to_host_bandwidth: float | None = None
    host_adam_rate: float | None = None
    # What a device holds beside the plan (partc.device.usable): 0 for problems built by
    # hand, whose memory_bytes are then the limits themselves.
    context_memory: int = 0
    communicator_memory: int = 0
    memory_fragmentation: float = 0.0
    fp8_peak_flops: float | None = None          # None: no FP8 matmuls (emulated, if any)
    fp8_efficiency: float | None = None          # None: flops_efficiency

    def __post_init__(self) -> None:
        if len(self.memory_bytes) != self.num_devices:
            raise ValueError("one memory limit per device is needed")
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.name not in FIGURE_NAMES or value is None and spec.default is None:
                continue
            try:
                unit_of(spec.name).read(value, spec.name)
            except ValueError:
                either = "None or " if spec.default is None else ""
                raise ValueError(f"DeviceNumbers.{spec.name} must be {either}"
                                 f"{unit_of(spec.name).allowed}, got {value!r}") from None

    @property
    def intra_latency_s(self) -> float:
        return self.link_latency_s if self.intra_node_latency_s is None \
            else self.intra_node_latency_s

    def heavy_op_flops(self, op: HeavyOp) -> float:
        """The FLOP/s ``op`` runs at: peak times ``attention_efficiency`` for a fused
        attention kernel (where the device has one), else times ``flops_efficiency``."""
        share = self.attention_efficiency if op.attention else None
        return self.peak_flops * (share or self.flops_efficiency)

    @property
    def light_op_bandwidth(self) -> float:
        """What memory-bound ops move bytes at: ``elementwise_bandwidth``, else HBM's."""
        return self.elementwise_bandwidth or self.hbm_bandwidth

    def optimizer_step_bandwidth(self, fused: bool = False) -> float:
        """The optimizer step's rate: a fused step's (one kernel reading and writing each
        byte once) HBM's; torch's unfused one's ``optimizer_bandwidth``, else HBM's."""
        return self.hbm_bandwidth if fused else self.optimizer_bandwidth or self.hbm_bandwidth

    @property
    def fsdp_copy_rate(self) -> float:
        """FSDP's copies' rate: ``fsdp_copy_bandwidth``, else HBM's."""
        return self.fsdp_copy_bandwidth or self.hbm_bandwidth


@dataclass(frozen=True, kw_only=True)
class TrainNumbers:
    global_batch_size: int
    micro_batch_sizes: tuple[int, ...]
    # Bytes of the training dtype per traced byte.
    activation_scale: float
    precision: Precision
    # The same for what ``estimate`` measured (saved activations, working sets, bytes
    # moved, and the cuts and tensor-parallel collectives in the dtypes the runtime makes
    # them in): 1 when it measured them under the training's autocast.
    measured_scale: float = 1.0
    # Mixture-of-experts (TrainSpec's): the busiest expert's tokens over the balanced
    # share that memory is budgeted for, and the capacity factor (None: dropless).
    moe_imbalance: float = 2.0
    moe_capacity_factor: float | None = None
    # Stages run through torch.compile wherever the schedule runs a whole backward
    # (partc.cost.schedules.runs_compiled): light ops priced by their fused bytes.
    compiled: bool = False
    # Compile pinned on (TrainSpec(compile=True)): a split-backward schedule is refused
    # rather than planned eagerly.
    compile_pinned: bool = False
    # Torch's fused Adam/AdamW step (TrainSpec.fused_optimizer): one pass at HBM rate.
    fused_optimizer: bool = False
    # Sequence-parallel collectives run as rings beside their linears' matmuls
    # (TrainSpec.tp_overlap): LayerCost.tp_overlap_flops price their exposed part only.
    tp_overlap: bool = True
    # ZeRO-1's all-gather of the updated parameters runs beside the next step's forward
    # (TrainSpec.overlap_param_gather): priced by what that forward leaves exposed.
    param_gather_overlap: bool = True
    # Elements per gradient bucket under ZeRO 0/1 (TrainSpec.bucket_elements).
    bucket_elements: int = BUCKET_ELEMENTS
    # TrainSpec.fp8_recipe where TrainSpec.fp8 is on: linears may run FP8
    # (partc.cost.fp8_pricing); None: off.
    fp8: str | None = None
    # The linears FP8 leaves in the training dtype unless pinned: the model's output
    # layer (partc.cost.fp8_pricing.output_linears).
    fp8_kept: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Pins:
    """Decisions the user fixed; ``None`` leaves a decision to the planner."""

    pp: int | None = None
    dp: int | None = None
    tp: int | None = None
    sequence_parallel: bool | None = None
    tp_objective: str | None = None
    stages: tuple[tuple[str, ...], ...] | None = None
    recompute: dict[str, str] = field(default_factory=dict)
    num_microbatches: int | None = None
    micro_batch_size: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None   # virtual stages (runs of layers) per pipeline rank
    zero_stage: int | None = None
    zero2_grad_sync: str | None = None   # one of ZERO2_GRAD_SYNCS
    ep: int | None = None   # expert-parallel degree of mixture-of-experts layers
    cp: int | None = None   # context-parallel degree (sequence shards)
    cp_kind: str | None = None   # one of partc.cli.choices.CP_KINDS
    # What lives on the host (partc.names.Offload values): exactly these; None: the
    # planner chooses.
    offload: tuple[str, ...] | None = None
    # The linears (weight FQNs) that run FP8 under TrainSpec.fp8: "all", "none" or a
    # tuple of names; None: each where it pays (partc.cost.fp8_pricing).
    fp8_linears: tuple[str, ...] | str | None = None


@dataclass(frozen=True, kw_only=True)
class PlanningProblem:
    model: ModelAnalysis
    devices: DeviceNumbers
    train: TrainNumbers
    pins: Pins = field(default_factory=Pins)

    @property
    def layers(self) -> tuple[LayerCost, ...]:
        return self.model.layers

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def module_list_experts(self) -> tuple[str, ...]:
        """The mixture-of-experts layers whose routed experts are a module list, which
        the runtime does not split: with any, ep stays 1."""
        return tuple(layer.name for layer in self.layers
                     if layer.moe is not None and layer.moe.expert_form == "module-list")

    def variant(self, tp: int, sequence_parallel: bool = False,
                objective: str = "time") -> "PlanningProblem":
        """The problem as one rank of a tensor-parallel group of ``tp`` sees it."""
        if tp == 1:
            return self
        option = self.tp_option(tp, sequence_parallel, objective)
        if option is None:
            raise ValueError(f"no tensor-parallel variant tp={tp} sequence_parallel="
                             f"{sequence_parallel} objective={objective} was measured")
        return replace(self, model=option.model)

    def tp_option(self, tp: int, sequence_parallel: bool,
                  objective: str = "time") -> "TPOption | None":
        return next((o for o in self.model.tensor_parallel if o.tp == tp
                     and o.sequence_parallel == sequence_parallel
                     and o.objective == objective), None)

    @property
    def offloads_activations(self) -> bool:
        """Whether layers may offload their saved activations (recompute mode
        "offload"): the host link (the cost tables price it) and the host memory (the
        planner holds the copies within it) are known, the training is not compiled
        (``partc.runtime.compiled`` refuses offload), and the pins leave it to the
        planner or name activations (``Constraints.offload``)."""
        devices, kinds = self.devices, self.pins.offload
        if not (devices.host_to_device_bandwidth and devices.device_to_host_bandwidth
                and devices.host_memory is not None) or self.train.compiled:
            return False
        return kinds is None or "activations" in kinds

    def layer_modes(self, layer: int) -> tuple[str, ...]:
        """The modes layer ``layer`` has: its measured recompute modes, and offload
        where the problem allows it (:attr:`offloads_activations`)."""
        modes = self.layers[layer].modes
        return (*modes, "offload") if self.offloads_activations else modes

    def allowed_modes(self, layer: int) -> list[str]:
        """The recompute modes layer ``layer`` may take: its pinned one, else all it has."""
        cost = self.layers[layer]
        pinned = self.pins.recompute.get(cost.name)
        if pinned is None:
            return list(self.layer_modes(layer))
        # A pinned "selective" on a layer without an attention core (or whose core keeps
        # nothing the rest does not) behaves as "none".
        return [pinned if pinned in cost.modes or pinned == "offload" else "none"]
