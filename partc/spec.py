"""What the user declares about training (TrainSpec) and what they pin (Constraints).

Every decision is ``"auto"``/``None`` (the planner decides) or a pinned value.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from partc.cli.choices import (ATTENTION, CP_KINDS, FP8_RECIPES, ON_NONFINITE,
                               OPTIMIZER_STATE_BYTES, SCHEDULES, TP_OBJECTIVES)
from partc.codec import UNLESS_DEFAULT
from partc.cost.schedules import refusal
from partc.names import Offload, Schedule
from partc.problem import BUCKET_ELEMENTS, RECOMPUTE_MODES, ZERO2_GRAD_SYNCS, ZERO_STAGES, Precision

# What the planner's closed-form search weighs when the schedule is "auto"; it chooses
# the mesh, and every other schedule of SCHEDULES is then solved on that mesh and the
# fastest played out kept (partc.planner.joint.choose). Every schedule is planned
# when pinned (Constraints.schedule, virtual_stages).
AUTO_SCHEDULES: tuple[Schedule, ...] = (Schedule.ONE_F_ONE_B, Schedule.GPIPE)
INTERLEAVED = Schedule.INTERLEAVED_1F1B
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The busiest expert's tokens over the balanced share a plan budgets memory for by
# default (TrainSpec's docstring gives the sources).
DEFAULT_MOE_IMBALANCE = 2.0


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _is_real(value: Any, *, minimum: float | None = None, above: float | None = None) -> bool:
    """A finite int or float (not a bool) at least ``minimum`` or above ``above``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        return False
    return (minimum is None or value >= minimum) and (above is None or value > above)


def _check_positive_int(name: str, value: Any, alternatives: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be {alternatives}a positive int, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """The training setup: batch, precision, optimizer, schedule, attention.

    ``global_batch_size`` is in samples (sequences) per optimizer step, over all
    data-parallel replicas and microbatches. ``dtype=torch.bfloat16`` trains in mixed
    precision: bf16 compute, fp32 master weights (the parameters stay fp32, except
    under ZeRO-1, whose distributed optimizer keeps bf16 weights and each rank's fp32
    master shard, as Megatron's), fp32 gradients and gradient reduction (autocast under
    ZeRO 0/1, FSDP's mixed precision under ZeRO-2/3; :attr:`precision` says the bytes
    each holds).
    ``float16`` can be planned but not trained: it would need loss scaling.
    ``max_grad_norm``: after each step's backward the runtime scales all gradients so
    that their global 2-norm (every parameter counted once, whatever holds it) is at
    most this, as ``torch.nn.utils.clip_grad_norm_`` does on one device.
    The kernel choices (``attention``, ``compile``, ``fused_optimizer``) are partc's by
    default (``"auto"``/``None``), the fastest that computes the same; each can be pinned,
    and the plan records what was chosen (:meth:`for_device`, then the planner).
    ``attention="fused"`` runs attention written as matmul + softmax (with its scale,
    mask and dropout) as one ``torch.nn.functional.scaled_dot_product_attention`` call,
    which keeps q, k, v, the output and one log-sum-exp per row for backward instead of
    the (seq x seq) probabilities of every head, and recomputes them in backward (flash,
    cuDNN or memory-efficient kernels on a GPU); a model's own such call with a provably
    causal mask takes ``is_causal`` instead (:mod:`partc.passes.fuse_attention` says which
    patterns and masks it rewrites; any other attention stays as written). ``"as_written"``
    changes nothing. ``"auto"`` (the default) is ``"fused"`` on a GPU and ``"as_written"``
    on a CPU, whose plans tests and golden copies read.
    ``compile=True`` runs each stage through ``torch.compile`` (inductor), which fuses
    chains of element-wise ops between the heavy ones into single kernels; the plan is
    costed with those chains' fused bytes (:mod:`partc.runtime.compiled` says what is
    compiled: the stage, or under ZeRO-2/3 each FSDP unit). ``None`` (the default): on a
    GPU the planner compiles every plan whose schedule runs a whole backward (a split
    backward, the zero-bubble schedules', cannot split a compiled region's) and prices
    each schedule so; on a CPU, where inductor's C++ takes long to build, it does not.
    ``True`` pins it on (refusing split-backward schedules), ``False`` off.
    ``fused_optimizer``: torch's fused Adam/AdamW (one kernel over all of a rank's
    tensors) for the optimizer :meth:`DistributedModule.optimizer` makes, priced at the
    device's ``fused_optimizer_bandwidth``; ``None`` (the default): on for Adam and AdamW
    on a GPU, off elsewhere (torch's CPU step is not the fused one's equal in speed).
    ``fp8=True`` (opt-in: it changes the numerics) lets the planner run linears in FP8
    with torchao's float8 training (``torchao.float8``: dynamic scaling of inputs,
    weights and output gradients, e4m3 forward, e5m2 gradients), ``fp8_recipe``
    ``"tensorwise"`` (one scale per tensor) or ``"rowwise"`` (one per row). Each linear
    runs FP8 where it pays: its matmul at the device's ``fp8_peak_flops`` plus the casts'
    bytes against the same matmul in the training dtype (:mod:`partc.cost.fp8_pricing`),
    chosen for the configuration's micro-batch size; small linears stay as they are. The
    plan names the FP8 linears (``plan.fp8``); ``Constraints.fp8_linears`` pins them. A
    device without an FP8 peak (an A100) refuses it; the CPU preset emulates FP8
    (torchao's ``emulate=True``, the same casts, the matmul in fp32), which never pays,
    so there only pinned linears run FP8 (for testing). Not with tensor parallelism yet.
    ``loss_per_microbatch=True`` declares that the loss of each microbatch is its own:
    needed only where the model's loss couples the samples of a batch (a load-balancing
    loss over the whole batch, as Mixtral's and Qwen-MoE's router losses are), so that
    splitting the batch over replicas and microbatches changes it. Without it such a
    model is planned with one replica and one microbatch, and pinning more is refused
    (:mod:`partc.batch_coupling`); with it the program computes each microbatch's loss
    as Megatron and gradient accumulation do, and the report says so.
    ``tp_overlap`` (on by default): under sequence parallelism, the all-gather before a
    column-parallel linear and the reduce-scatter after a row-parallel one run as rings
    beside the linear's matmul (Megatron's tensor-parallel communication overlap,
    :mod:`partc.runtime.tp_rings`), and the plan charges their exposed part only
    (``DeviceBudget.comm_overlap`` says how much compute hides); ``False`` runs them
    blocking and charges them whole.
    ``overlap_param_gather`` (on by default): under ZeRO-1, the optimizer step leaves
    the all-gather of the updated parameters in flight, bucket by bucket, and the next
    forward waits for each bucket just before the first layer reading it runs
    (Megatron's distributed optimizer with ``overlap_param_gather``,
    :func:`partc.runtime.optimizer.wait_in_forward`); the plan charges what that forward
    cannot hide. ``False`` finishes the all-gathers inside ``optimizer.step()`` and
    charges them whole.
    ``bucket_elements``: under ZeRO 0/1, the gradients are reduced over the replicas
    (and ZeRO-1's parameters gathered) in buckets of up to this many elements, each one
    collective as soon as backward has filled it (:mod:`partc.runtime.optimizer`). The
    plan prices the buckets the runtime makes: one collective's latency per bucket, and
    the last bucket's reduction after the step's last backward. Smaller buckets start
    reducing sooner and pay more latencies; the default is 25M (100 MB of fp32
    gradients, Megatron's order of size).
    ``on_nonfinite``: every step the runtime checks the mean loss and the global
    gradient norm for inf and NaN, on every rank, in the all-reduce that already sums the
    loss (:mod:`partc.runtime.nonfinite`). ``"raise"`` (the default, as Megatron-Core's
    ``check_for_nan_in_loss_and_grad``) raises :class:`partc.NonFiniteError` naming the
    step, the stages and ranks and what was non-finite, before the optimizer steps: no
    parameter has changed. ``"skip"`` drops the step's gradients instead (the optimizer's
    next step does nothing, ZeRO-1's distributed optimizer and FSDP2's alike), counts it
    in telemetry and trains on. ``"ignore"`` turns the check off (the step is taken
    whatever its numbers).
    ``batch_check_every``: every rank that must train on the same batch (the pipeline
    stages and tensor-parallel ranks of a data-parallel replica; every rank given the
    global batch) is checked to have been given it, by a digest of the batch compared in
    that same all-reduce (:mod:`partc.runtime.batch_digest`): a batch that differs
    raises :class:`partc.BatchMismatchError` naming two ranks and the step, before the
    optimizer steps. N checks steps 1, 1 + N, 1 + 2N, ...; the default, 1, checks every
    step, for the cost of hashing the rank's share of the batch (about 1 ns per byte on
    an idle core) and four floats per rank in the all-reduce; 0 turns the check off.
    """

    global_batch_size: int
    micro_batch_size: int | str = "auto"
    dtype: torch.dtype = torch.float32
    optimizer: str | float = "adamw"
    schedule: str = "auto"
    max_grad_norm: float | None = None  # clip the global gradient norm (2-norm) to this
    attention: str = "auto"
    # Mixture-of-experts (see the class docstring's last paragraph).
    moe_imbalance: float = DEFAULT_MOE_IMBALANCE
    moe_capacity_factor: float | None = None
    compile: bool | None = None
    fp8: bool = field(default=False, metadata=UNLESS_DEFAULT)
    fp8_recipe: str = field(default="tensorwise", metadata=UNLESS_DEFAULT)
    # Written to a plan only when declared: plans without them read back unchanged.
    fused_optimizer: bool | None = field(default=None, metadata=UNLESS_DEFAULT)
    loss_per_microbatch: bool = field(default=False, metadata=UNLESS_DEFAULT)
    tp_overlap: bool = field(default=True, metadata=UNLESS_DEFAULT)
    overlap_param_gather: bool = field(default=True, metadata=UNLESS_DEFAULT)
    bucket_elements: int = field(default=BUCKET_ELEMENTS, metadata=UNLESS_DEFAULT)
    on_nonfinite: str = field(default="raise", metadata=UNLESS_DEFAULT)
    batch_check_every: int = field(default=1, metadata=UNLESS_DEFAULT)

    def __post_init__(self) -> None:
        _check_positive_int("TrainSpec.global_batch_size", self.global_batch_size)
        if not _is_real(self.moe_imbalance, minimum=1):
            raise ValueError(f"TrainSpec.moe_imbalance must be a finite number of at least 1 "
                             f"(the busiest expert's tokens over the balanced share), got "
                             f"{self.moe_imbalance!r}")
        if self.moe_capacity_factor is not None \
                and not _is_real(self.moe_capacity_factor, above=0):
            raise ValueError(f"TrainSpec.moe_capacity_factor must be positive and finite "
                             f"(None: dropless), got {self.moe_capacity_factor!r}")
        if self.micro_batch_size != "auto":
            _check_positive_int("TrainSpec.micro_batch_size", self.micro_batch_size, "'auto' or ")
            if self.global_batch_size % self.micro_batch_size:
                raise ValueError(f"TrainSpec.micro_batch_size {self.micro_batch_size} does "
                                 f"not divide global_batch_size {self.global_batch_size}")
        if self.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {_FLOAT_DTYPES}, got {self.dtype}")
        if isinstance(self.optimizer, str) and self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; use one of "
                             f"{sorted(OPTIMIZER_STATE_BYTES)} or bytes of state per parameter")
        if not isinstance(self.optimizer, str) and not _is_real(self.optimizer, minimum=0):
            raise ValueError(f"TrainSpec.optimizer must be a name or a finite number of bytes "
                             f"of state per parameter (0 or more), got {self.optimizer!r}")
        if self.max_grad_norm is not None and not _is_real(self.max_grad_norm, above=0):
            raise ValueError(f"TrainSpec.max_grad_norm must be positive and finite (None: no "
                             f"clipping), got {self.max_grad_norm!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.compile is not None and not isinstance(self.compile, bool):
            raise ValueError(f"TrainSpec.compile must be None (partc decides), True or "
                             f"False, got {self.compile!r}")
        if self.fused_optimizer is not None and not isinstance(self.fused_optimizer, bool):
            raise ValueError(f"TrainSpec.fused_optimizer must be None (partc decides), True "
                             f"or False, got {self.fused_optimizer!r}")
        if not isinstance(self.fp8, bool):
            raise ValueError(f"TrainSpec.fp8 must be True or False, got {self.fp8!r}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"TrainSpec.fp8_recipe must be one of {FP8_RECIPES}, got "
                             f"{self.fp8_recipe!r}")
        if not isinstance(self.tp_overlap, bool):
            raise ValueError(f"TrainSpec.tp_overlap must be True or False, got "
                             f"{self.tp_overlap!r}")
        if not isinstance(self.overlap_param_gather, bool):
            raise ValueError(f"TrainSpec.overlap_param_gather must be True or False, got "
                             f"{self.overlap_param_gather!r}")
        _check_positive_int("TrainSpec.bucket_elements", self.bucket_elements)
        if not isinstance(self.loss_per_microbatch, bool):
            raise ValueError(f"TrainSpec.loss_per_microbatch must be True or False, got "
                             f"{self.loss_per_microbatch!r}")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"TrainSpec.on_nonfinite must be one of {ON_NONFINITE} (what a "
                             f"step with an inf or NaN loss or gradient norm does), got "
                             f"{self.on_nonfinite!r}")
        if isinstance(self.batch_check_every, bool) \
                or not isinstance(self.batch_check_every, int) or self.batch_check_every < 0:
            raise ValueError(f"TrainSpec.batch_check_every must be an int, 0 or more (check "
                             f"the batch every N steps; 0: never), got "
                             f"{self.batch_check_every!r}")
        if self.schedule not in ("auto", *SCHEDULES):
            raise ValueError(f"schedule must be 'auto' or one of {SCHEDULES}, "
                             f"got {self.schedule!r}")

    @property
    def adam(self) -> bool:
        """Adam or AdamW, by name (what torch's fused step exists for)."""
        return self.optimizer in ("adam", "adamw")

    def for_device(self, device_type: str) -> "TrainSpec":
        """The kernel choices the device decides, made: attention ``"auto"`` fused on a
        GPU, as written on a CPU; ``compile=None`` off on a CPU (on a GPU it stays the
        planner's, per schedule); ``fused_optimizer=None`` on for Adam/AdamW on a GPU.
        Pinned values are kept."""
        gpu = device_type != "cpu"
        return dataclasses.replace(
            self,
            attention=("fused" if gpu else "as_written") if self.attention == "auto"
            else self.attention,
            compile=False if self.compile is None and not gpu else self.compile,
            fused_optimizer=(gpu and self.adam) if self.fused_optimizer is None
            else self.fused_optimizer)

    @property
    def precision(self) -> Precision:
        """Bytes per parameter as the runtime keeps them (what the cost model reads)."""
        state = (OPTIMIZER_STATE_BYTES[self.optimizer]
                 if isinstance(self.optimizer, str) else float(self.optimizer))
        # Adam's step divides by sqrt(v) made anew; an optimizer named by its bytes of
        # state is taken for Adam when it keeps two fp32 moments.
        adam = self.optimizer in ("adam", "adamw") if isinstance(self.optimizer, str) \
            else state >= 8
        return Precision(compute_bytes=dtype_bytes(self.dtype), optimizer_state_bytes=state,
                         step_copies=1.0 if adam else 0.0)

    # The ZeRO paper's accounting of the same bytes (2 + 2 + 12 for mixed-precision Adam).
    @property
    def weight_bytes(self) -> float:
        return self.precision.zero_paper_bytes[0]

    @property
    def grad_bytes(self) -> float:
        return self.precision.zero_paper_bytes[1]

    @property
    def optimizer_bytes(self) -> float:
        return self.precision.zero_paper_bytes[2]


@dataclass(frozen=True, kw_only=True)
class Constraints:
    """Pins for any decision the planner would otherwise make. All optional.

    ``stages`` lists, per pipeline stage, the names of its layers (the names in the
    report); ``recompute`` is one mode for every layer or a mapping layer → mode.
    ``tp`` pins the tensor-parallel degree (it must divide the devices of a node);
    ``sequence_parallel`` pins Megatron-style sequence parallelism on (norms,
    residuals and dropout on sequence shards, an all-gather before each tensor-parallel
    region and a reduce-scatter after) or off (Megatron's plain tensor parallelism: each
    row-parallel output all-reduced, norms, residuals and dropout replicated);
    ``tp_objective`` keeps only the per-layer shardings chosen for ``"time"`` (fastest)
    or ``"memory"`` (fewest parameter bytes, then with sequence parallelism fewest
    activation bytes, then fastest). ``zero2_grad_sync`` pins
    when ZeRO-2 reduce-scatters gradients: after every microbatch (``"microbatch"``:
    sharded gradients, one reduce-scatter per microbatch) or once per step (``"step"``:
    a whole fp32 gradient accumulated over the microbatches, one reduce-scatter);
    with one microbatch, or another ZeRO stage, it changes nothing.
    ``cp`` pins the context-parallel degree: each sequence is split over ``cp`` ranks
    (load-balanced for causal masks: rank ``i`` holds chunks ``i`` and ``2cp-1-i`` of
    ``2cp``), which also reduce gradients together with the data-parallel replicas
    (the mesh is pp x dp x cp x tp, tp innermost, as Megatron-Core places it);
    ``cp_kind`` pins how attention exchanges the shards (:data:`CP_KINDS`: ``"ring"``
    or ``"all-to-all"``), meaningful only with cp > 1. ``offload`` pins
    what lives on the host (:class:`partc.names.Offload`): exactly the kinds given are
    on ("optimizer": state, master weights and the step, ZeRO-Offload; "params": the
    parameters between uses, under ZeRO-3; "activations": saved activations), ``()``
    none; ``None`` leaves it to the planner. A comma-separated string is read as a
    list.
    ``fp8_linears`` (with ``TrainSpec(fp8=True)``) pins the linears that run FP8:
    ``"all"``, ``"none"`` or their weights' FQNs (``"blocks.0.mlp.c_fc.weight"``, as the
    plan's ``fp8`` section names them); None: each linear where it pays.

    Pins that contradict each other whatever the model are a ValueError here; pins that
    cannot hold for a model, budget and batch raise ``PlanInfeasibleError`` naming the
    pin from ``partc.compile`` (:mod:`partc.planner.pins`).
    """

    pp: int | None = None
    dp: int | None = None
    tp: int | None = None
    sequence_parallel: bool | None = None
    tp_objective: str | None = None
    stages: tuple[tuple[str, ...], ...] | list[list[str]] | None = None
    recompute: str | Mapping[str, str] | None = None
    num_microbatches: int | None = None
    micro_batch_size: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None   # virtual stages (runs of layers) per pipeline rank
    zero_stage: int | None = None
    zero2_grad_sync: str | None = None
    ep: int | None = None
    cp: int | None = None
    cp_kind: str | None = None
    offload: tuple[str, ...] | None = None
    fp8_linears: tuple[str, ...] | list[str] | str | None = None
    _recompute_map: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "cp", "num_microbatches", "micro_batch_size", "ep",
                     "virtual_stages"):
            if getattr(self, name) is not None:
                _check_positive_int(f"Constraints.{name}", getattr(self, name), "None or ")
        if not any(self.sequence_parallel is v for v in (None, True, False)):
            raise ValueError(f"Constraints.sequence_parallel must be None, True or False, "
                             f"got {self.sequence_parallel!r}")
        if self.tp_objective is not None and self.tp_objective not in TP_OBJECTIVES:
            raise ValueError(f"tp_objective must be one of {TP_OBJECTIVES}, "
                             f"got {self.tp_objective!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence parallelism needs tensor parallelism: tp=1 was pinned")
        if self.cp_kind is not None and self.cp_kind not in CP_KINDS:
            raise ValueError(f"Constraints.cp_kind must be None or one of {CP_KINDS} (how "
                             f"context-parallel attention exchanges sequence shards), got "
                             f"{self.cp_kind!r}")
        if self.cp_kind is not None and self.cp == 1:
            raise ValueError(f"Constraints.cp_kind={self.cp_kind!r} needs context "
                             f"parallelism, but cp=1 was pinned: pin cp > 1, or drop "
                             f"cp_kind")
        if self.zero_stage is not None and (isinstance(self.zero_stage, bool)
                                            or self.zero_stage not in ZERO_STAGES):
            raise ValueError(f"zero_stage must be 0 (plain data parallelism), 1 (optimizer "
                             f"state sharded over dp), 2 (gradients too) or 3 (parameters "
                             f"too), got {self.zero_stage!r}")
        if self.zero2_grad_sync is not None and self.zero2_grad_sync not in ZERO2_GRAD_SYNCS:
            raise ValueError(f"zero2_grad_sync must be one of {ZERO2_GRAD_SYNCS} (ZeRO-2 "
                             f"reduce-scatters gradients after every microbatch, or once "
                             f"per step), got {self.zero2_grad_sync!r}")
        if self.zero_stage and self.dp == 1 and self.cp == 1:
            raise ValueError(f"zero_stage={self.zero_stage} shards over the ranks holding "
                             f"the same parameters (dp x cp), but dp=1 and cp=1 were "
                             f"pinned: pin zero_stage=0, or dp > 1 or cp > 1")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule is not None and self.virtual_stages is not None:
            refused = refusal(self.schedule, 1, self.virtual_stages, 10**9)
            if refused:
                raise ValueError(f"Constraints: {refused}")
        if self.virtual_stages is not None and self.virtual_stages > 1 \
                and self.stages is not None:
            raise ValueError("Constraints.stages pins one run of layers per stage; "
                             "virtual_stages > 1 needs runs the planner places")
        if self.stages is not None:
            if isinstance(self.stages, str) or any(
                    isinstance(s, str) or not all(isinstance(n, str) for n in s)
                    for s in self.stages):
                raise ValueError(f"Constraints.stages must be a list of stages, each a list "
                                 f"of layer names, got {self.stages!r}")
            stages = tuple(tuple(s) for s in self.stages)
            if not stages or any(not s for s in stages):
                raise ValueError("Constraints.stages needs at least one non-empty stage")
            if self.pp is not None and self.pp != len(stages):
                raise ValueError(f"pp={self.pp} but {len(stages)} stages were pinned")
            object.__setattr__(self, "stages", stages)
        if self.fp8_linears is not None:
            if isinstance(self.fp8_linears, str):
                if self.fp8_linears not in ("all", "none"):
                    raise ValueError(f"Constraints.fp8_linears must be 'all', 'none' or a "
                                     f"list of linear weights' FQNs, got {self.fp8_linears!r}")
            elif not all(isinstance(name, str) for name in self.fp8_linears):
                raise ValueError(f"Constraints.fp8_linears must be 'all', 'none' or a list of "
                                 f"linear weights' FQNs, got {self.fp8_linears!r}")
            else:
                object.__setattr__(self, "fp8_linears", tuple(self.fp8_linears))
        object.__setattr__(self, "_recompute_map", self._read_recompute())
        if self.offload is not None:
            object.__setattr__(self, "offload", self._read_offload())

    def _read_offload(self) -> tuple[Offload, ...]:
        given = self.offload
        if isinstance(given, str):
            given = [name.strip() for name in given.split(",") if name.strip()]
        names = [o.value for o in Offload]
        if not isinstance(given, (tuple, list)) or not all(
                isinstance(n, str) and n in names for n in given):
            raise ValueError(f"Constraints.offload must be None (the planner chooses) or a "
                             f"list of {names} (() for none), got {self.offload!r}")
        if len(set(given)) != len(given):
            raise ValueError(f"Constraints.offload names a kind twice: {self.offload!r}")
        kinds = tuple(o for o in Offload if o.value in given)
        if Offload.PARAMS in kinds and Offload.OPTIMIZER not in kinds:
            raise ValueError("offload of params steps the optimizer on the host too (the "
                             "parameter shards live there): pin offload=('optimizer', "
                             "'params')")
        if Offload.PARAMS in kinds and (self.zero_stage not in (None, 3) or self.dp == 1):
            pinned = f"zero_stage={self.zero_stage}" if self.zero_stage not in (None, 3) \
                else "dp=1"
            raise ValueError(f"offload of params runs under ZeRO-3 (the parameters sharded "
                             f"over data-parallel replicas), but {pinned} was pinned: pin "
                             f"zero_stage=3 with dp > 1, or leave params out of offload")
        return kinds

    def _read_recompute(self) -> dict[str, str]:
        if self.recompute is None or isinstance(self.recompute, str):
            if self.recompute is not None and self.recompute not in RECOMPUTE_MODES:
                raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, "
                                 f"got {self.recompute!r}")
            return {}
        modes = dict(self.recompute)
        for layer, mode in modes.items():
            if mode not in RECOMPUTE_MODES:
                raise ValueError(f"recompute for {layer!r} must be one of {RECOMPUTE_MODES}, "
                                 f"got {mode!r}")
        return modes

    def recompute_for(self, layer_names: tuple[str, ...]) -> dict[str, str]:
        """The pinned mode of each named layer; unknown names are an error."""
        if isinstance(self.recompute, str):
            return {name: self.recompute for name in layer_names}
        unknown = sorted(set(self._recompute_map) - set(layer_names))
        if unknown:
            raise ValueError(f"recompute pins name unknown layers {unknown}; "
                             f"layers are {list(layer_names)}")
        return dict(self._recompute_map)

    @property
    def effective_pp(self) -> int | None:
        return len(self.stages) if self.stages is not None else self.pp
