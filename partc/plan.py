"""Plan: the planner's answer, typed (docs/architecture.md, "The plan's sections").

A Plan names layers, never fx nodes, so it can be saved, diffed, reviewed and loaded
again without tracing the model. Each section is a frozen dataclass; each decision is
stored once, and what follows from decisions is a property computed in one place:

- ``mesh`` (:class:`Mesh`): pp, dp, cp (and its kind), tp; ``zero_stage`` as chosen, and
  :attr:`Plan.effective_zero_stage`, the one that runs (0 with one replica);
  :attr:`Plan.global_batch_size`, microbatches x their size x replicas;
  ``zero2_grad_sync``, when ZeRO-2 reduce-scatters gradients ("microbatch" or "step",
  :data:`partc.problem.ZERO2_GRAD_SYNCS`), and :attr:`Plan.reduces_once`, whether it
  does so once per step (plans written before it read as "microbatch");
- ``stages`` (:class:`StagePlan`): layers, recompute modes, :class:`StageMemory` and
  :class:`StageTime` per rank, point-to-point messages (:class:`P2PMessages`);
- ``tensor_parallel`` (:class:`TensorParallelPlan`, ``None`` when tp = 1): per parameter
  FQN its :class:`partc.placement.Placement`, per layer the sharding strategies chosen;
- ``train`` (:class:`partc.spec.TrainSpec`): the training setup with its real
  ``torch.dtype`` (the runtime's compute dtype) and its ``precision`` (bytes per
  parameter);
- ``model`` (:class:`ModelInfo`), ``budget`` (:class:`BudgetInfo`), ``predicted``
  (:class:`Predicted`), ``solver`` (:class:`SolverStats`), ``alternatives``
  (:class:`Alternative`) and ``meshes`` (:class:`MeshOutcome`).

``to_dict``/``to_json`` write schema version :data:`SCHEMA_VERSION` through
:mod:`partc.codec` (each section from its annotations; field metadata keep the form
older files have), and ``from_dict``/``from_json`` read it back equal. Version 1
(untyped sections) still loads:
:func:`migrate_v1` maps it to version 2, which differs only in the ``train`` section
(version 1 could hold "4-byte weights" where a dtype name belongs, and derived
``bytes_per_param``) and in ``p2p`` (``{}`` where version 2 writes ``null``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping

import torch

from partc.codec import (NONE_AS_EMPTY, UNLESS_DEFAULT, CodecError, as_list, from_data,
                         own_form, to_data)
from partc.cost.schedules import SCHEDULE_TABLE, stages_of_rank
from partc.device.budget import DEFAULT_DISK_BANDWIDTH, DEFAULT_STORAGE_BANDWIDTH
from partc.device.figures import FIGURE_NAMES, DeviceFigures
from partc.errors import PlanSchemaError
from partc.names import CpKind, Offload, Outcome, Phase, Recompute, Schedule
from partc.placement import REPLICATE, Placement
from partc.problem import effective_zero_stage, reduces_once_per_step
from partc.spec import TrainSpec
from partc.units import format_bytes, parse_rate

SCHEMA_VERSION = 2


def _read(cls: type, data: Mapping[str, Any], where: str, **converted: Any) -> Any:
    """``cls`` from JSON data, ``converted`` fields replacing theirs; a missing or unknown
    key is a :class:`PlanSchemaError` naming the section."""
    if not isinstance(data, Mapping):
        raise PlanSchemaError(f"plan section {where} is a {type(data).__name__}, not a mapping")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise PlanSchemaError(f"plan section {where} has unknown keys {unknown}")
    try:
        return cls(**{**data, **converted})
    except TypeError as error:   # a required key is missing
        raise PlanSchemaError(f"plan section {where}: {error}") from None


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """Devices as a (pp, dp, cp, tp) grid; ranks are ordered with tp innermost, cp next
    (Megatron-Core's order; :mod:`partc.rank_grid` gives each rank's coordinates and
    groups). ``cp``: the context-parallel degree, each sequence split over ``cp`` ranks
    that also reduce gradients with the dp replicas; ``cp_kind``: how their attention
    exchanges the shards (:class:`~partc.names.CpKind`), ``None`` when cp = 1. Both are
    written only when set (plans without them read as cp = 1). ``ep``: the
    expert-parallel degree of mixture-of-experts layers, folded over each stage's dp x tp
    ranks (groups of ``ep`` consecutive ranks; see :class:`ExpertParallelPlan`); 1
    without expert parallelism, and then not written (plans without it read as before)."""

    pp: int
    dp: int
    tp: int = 1
    ep: int = field(default=1, metadata=UNLESS_DEFAULT)
    cp: int = field(default=1, metadata=UNLESS_DEFAULT)
    cp_kind: CpKind | None = field(default=None, metadata=UNLESS_DEFAULT)

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts in a stage (their gradients are reduced over
        them): dp x tp / ep."""
        return self.dp * self.tp // self.ep

    def __str__(self) -> str:
        cp = f" cp={self.cp} ({self.cp_kind})" if self.cp != 1 else ""
        return f"pp={self.pp} dp={self.dp}{cp} tp={self.tp}" + (
            f" ep={self.ep}" if self.ep != 1 else "")


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """Bytes per rank of a stage, by category. ``peak`` is the state (params, grads,
    optimizer) and the larger of the microbatches' working set (activations, transient,
    receive) and the optimizer step's temporaries (``step``), which come after the
    activations are gone."""

    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int   # the largest working set of one layer
    # The pipeline's receive buffer for a gradient, one per run (partc.cost.evaluate.receive_bytes);
    # plans written before it was counted read as 0.
    receive: int = 0
    # The optimizer step's temporaries (partc.cost.state_bytes.step_bytes); plans written before
    # they were counted read as 0.
    step: int = 0
    peak: int
    # On the host, not in ``peak``: the saved activations of the stage's offloaded layers
    # (recompute mode "offload") for the microbatches in flight at the schedule's peak
    # (partc.cost.offload_time); not written when 0.
    host: int = field(default=0, metadata=UNLESS_DEFAULT)


@dataclass(frozen=True, kw_only=True)
class StageTime:
    """Seconds per step on a rank of a stage: every microbatch's forward, backward,
    recompute and point-to-point communication; ``tail`` once per step after the
    pipeline drains (gradient sync left exposed, the optimizer step)."""

    forward: float
    backward: float
    recompute: float
    comm: float
    tail: float


@dataclass(frozen=True, kw_only=True)
class P2PMessages:
    """Point-to-point messages per step on each rank of a stage (activations forward,
    their gradients backward)."""

    sends: int
    recvs: int


@as_list
@dataclass(frozen=True, kw_only=True)
class RunTime:
    """Seconds of one microbatch through one run of a stage's layers (its virtual stage),
    as the cost model plays the schedule out (:func:`partc.cost.evaluate.simulate`):
    forward, backward and recompute, ``send``: this end's share of the transfer across
    the cut after it, each way, ``receive``: its share of the cut before it, each way
    (:func:`partc.cost.evaluate.end_share_ps`); ``send_delay`` and ``receive_delay``: what
    of each of those transfers its end does not pay, which still delays the rank waiting
    for it (written as ``[forward, backward, recompute, send, receive, send_delay,
    receive_delay]``, the delays left off while 0)."""

    forward: float
    backward: float
    recompute: float
    send: float
    receive: float
    send_delay: float = field(default=0.0, metadata=UNLESS_DEFAULT)
    receive_delay: float = field(default=0.0, metadata=UNLESS_DEFAULT)


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    index: int
    layers: tuple[str, ...]
    recompute: dict[str, Recompute]
    param_count: int
    memory_bytes: StageMemory
    limit_bytes: int
    time_s: StageTime
    p2p: P2PMessages | None = None   # None: the problem does not count messages
    # Interleaved 1F1B: the stage's runs of layers (it holds runs index, index + pp, ...);
    # empty otherwise (``layers`` is then one run).
    runs: tuple[tuple[str, ...], ...] = ()
    # Per run (model order), what the simulation of the plan's step plays, so that the
    # report's timeline is the step the plan predicts; empty in plans written before it
    # (the timeline then shares the stage's times among its runs by their layers).
    run_times: tuple[RunTime, ...] = field(default=(), metadata=UNLESS_DEFAULT)
    # Bytes a rank of the stage copies to the host per step for its offloaded layers'
    # activations (and back: as many), every microbatch's; not written when 0.
    host_traffic_bytes: int = field(default=0, metadata=UNLESS_DEFAULT)
    # Bytes of a rank's offloaded optimizer state a checkpoint writes from the host (the
    # fp32 masters and the optimizer state of what it steps,
    # partc.cost.host_offload.host_checkpoint_bytes); not written when 0 (no offload).
    host_checkpoint_bytes: int = field(default=0, metadata=UNLESS_DEFAULT)
    # Per run (as ``run_times``), the part of its recompute that is those copies' time
    # compute does not hide (the timeline's host blocks); empty without offload.
    run_host_s: tuple[float, ...] = field(default=(), metadata=UNLESS_DEFAULT)

    @property
    def offloaded(self) -> tuple[str, ...]:
        """The stage's layers whose saved activations go to the host."""
        return tuple(name for name in self.layers if self.recompute.get(name) == "offload")


@as_list
@dataclass(frozen=True, kw_only=True)
class TPCollective:
    """One tensor-parallel collective of a layer per microbatch (written as ``[kind,
    phase, nbytes]``)."""

    kind: str     # "all_reduce" | "all_gather" | "reduce_scatter"
    phase: Phase
    nbytes: int   # of the whole tensor


@dataclass(frozen=True, kw_only=True)
class TensorParallelPlan:
    """How each rank of a tensor-parallel group of ``degree`` holds and runs its layers.

    ``params`` places every parameter (by FQN); ``choices`` gives per layer the strategy
    index of each node, which the tensor-parallel rewrite replays on the traced graph;
    ``partial_grad_params`` are replicated parameters whose gradients are partial sums
    over the group. ``collectives`` and the times are per layer and microbatch, as the
    cost model prices them: ``collective_total_seconds`` the collectives' own time,
    ``collective_seconds`` what the step pays for them (a ring beside its linears'
    matmuls hides part of its time, ``partc.cost.communication.tp_collective_times``;
    plans written before the total was kept have none); ``notes`` say why a layer stays
    replicated.
    """

    degree: int
    sequence_parallel: bool
    objective: str   # what the per-layer choice minimised first: "time" or "memory"
    params: dict[str, Placement]
    partial_grad_params: tuple[str, ...] = ()
    choices: dict[str, tuple[int, ...]] = field(default_factory=dict)
    collectives: dict[str, tuple[TPCollective, ...]] = field(default_factory=dict)
    collective_seconds: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    collective_total_seconds: dict[str, float] = field(default_factory=dict,
                                                       metadata=UNLESS_DEFAULT)

    def step_seconds(self, layer: str, microbatches: int) -> tuple[float | None, float]:
        """Layer ``layer``'s collectives over a step of ``microbatches``: their own time
        (None in a plan written before it was kept) and what the step pays for them."""
        total = self.collective_total_seconds.get(layer)
        return (None if total is None else total * microbatches,
                self.collective_seconds.get(layer, 0.0) * microbatches)

    def placement(self, names: Iterable[str]) -> Placement:
        """How a parameter known under ``names`` (all its FQNs) is placed."""
        return next((self.params[n] for n in names if n in self.params), REPLICATE)


@dataclass(frozen=True, kw_only=True)
class ExpertLayer:
    """One mixture-of-experts layer under expert parallelism: ep rank ``e`` of every
    expert-parallel group holds experts ``[e * local_experts, (e + 1) *
    local_experts)``; per step on each of its ranks, ``all_to_alls`` all-to-alls (dispatch
    and combine, forward and backward, and a recomputed forward's) of ``all_to_all_bytes``
    in all, taking ``all_to_all_s``; its experts' saved activations budgeted at
    ``worst_factor`` times the balanced share (``expert_activation_bytes`` per
    microbatch)."""

    name: str
    stage: int
    num_experts: int
    top_k: int
    local_experts: int
    expert_params: int          # the rank's share of the routed experts' parameters
    all_to_alls: int
    all_to_all_bytes: int
    all_to_all_s: float
    worst_factor: float
    expert_activation_bytes: int

    def experts_of(self, ep_rank: int) -> range:
        """The experts ep rank ``ep_rank`` holds."""
        return range(ep_rank * self.local_experts, (ep_rank + 1) * self.local_experts)


@dataclass(frozen=True, kw_only=True)
class Fp8Plan:
    """The linears that run FP8 (``TrainSpec.fp8``; :mod:`partc.cost.fp8_pricing` says
    where it pays): their weights' FQNs, each run with torchao's float8 training under
    ``recipe`` (``"tensorwise"`` or ``"rowwise"`` scaling). ``emulated``: the device has
    no FP8 matmuls and torchao emulates them (the CPU: the same casts, matmuls in fp32)."""

    recipe: str
    emulated: bool
    linears: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ExpertParallelPlan:
    """How the routed experts of mixture-of-experts layers are split (``ep`` > 1): within
    each pipeline stage the dp x tp ranks, in rank order (tp fastest), form groups of
    ``ep`` consecutive ranks that split every layer's experts contiguously; the ranks at
    the same position of each group (``expert_dp`` of them) hold the same experts and
    reduce their gradients. Tokens reach their experts by all-to-all, dropless unless
    ``capacity_factor`` caps each expert at that multiple of its balanced share.
    ``imbalance`` is the busiest expert's tokens over the balanced share that memory was
    budgeted for (time at balanced routing). Per stage, per step on one rank: the
    all-to-all bytes and seconds (``stage_all_to_all_*``) and the saved expert activations
    in flight at the budgeted routing (``stage_expert_activation_bytes``: the part of the
    stage's memory that grows with the imbalance)."""

    ep: int
    expert_dp: int
    imbalance: float
    capacity_factor: float | None
    layers: tuple[ExpertLayer, ...]
    stage_all_to_all_bytes: tuple[int, ...]
    stage_all_to_all_s: tuple[float, ...]
    stage_expert_activation_bytes: tuple[int, ...]
    crosses_nodes: bool = False   # an expert-parallel group spans nodes (network)

    @property
    def all_to_all_bytes(self) -> int:
        """All-to-all bytes per step on a rank of the busiest stage."""
        return max(self.stage_all_to_all_bytes, default=0)

    @property
    def all_to_all_s(self) -> float:
        return max(self.stage_all_to_all_s, default=0.0)


@as_list
@dataclass(frozen=True, kw_only=True)
class DPCollective:
    """One kind of data-parallel collective a rank of a stage runs, per step (written as
    ``[kind, when, nbytes, seconds, exposed_s]``): ``kind`` all_gather, reduce_scatter or
    all_reduce; ``when`` it runs (:data:`DP_WHEN`); the bytes of the whole tensors it
    moves; the collectives' own time; and ``exposed_s``, what the step pays of that time:
    the rest is assumed hidden behind the compute it runs beside
    (``DeviceFigures.comm_overlap`` of the shorter of the two)."""

    kind: str
    when: str
    nbytes: int
    seconds: float
    exposed_s: float

    @property
    def hidden_s(self) -> float:
        return max(0.0, self.seconds - self.exposed_s)


#: When a data-parallel collective runs, as :class:`DPCollective` names it.
DP_WHEN = {"forward": "beside each microbatch's forward",
           "backward": "beside each microbatch's backward",
           "last backward": "beside the last microbatch's backward",
           "step": "after the pipeline drains (the optimizer step's)",
           "next forward": "beside the next step's forward"}


@dataclass(frozen=True, kw_only=True)
class DataParallelPlan:
    """The data-parallel traffic of the plan (dp x cp > 1): per stage, what one of its
    ranks runs per step over its gradient group (the dp x cp ranks holding the same
    parameters, :class:`DPCollective`), and the share of the
    shorter of a collective and the compute beside it assumed hidden (``overlap``,
    ``DeviceFigures.comm_overlap``). ZeRO-0/1 reduce the gradients beside the last
    backward (the last bucket after it), ZeRO-1 all-gathers the stepped weights (beside
    the next forward, or after the step); ZeRO-2 reduce-scatters each microbatch's
    gradients (or once per step) and gathers the weights after the step; ZeRO-3 gathers
    each layer's weights for its forward and its backward and reduce-scatters its
    gradients, every microbatch (:func:`partc.planner.data_parallel.data_parallel_section`)."""

    dp: int
    # Context-parallel ranks: they hold the same parameters as their dp replicas and see
    # other tokens, so the gradients are reduced (and ZeRO state sharded) over dp x cp.
    cp: int = 1
    zero_stage: int   # the effective one
    overlap: float
    stages: tuple[tuple[DPCollective, ...], ...]

    @property
    def replicas(self) -> int:
        """The ranks of a gradient group: dp x cp."""
        return self.dp * self.cp

    def seconds(self, stage: int) -> float:
        return sum(c.seconds for c in self.stages[stage])

    def exposed_s(self, stage: int) -> float:
        return sum(c.exposed_s for c in self.stages[stage])


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """One input of the model (the target last, named "target"): its shape without the
    batch dimension and its dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    # Given by keyword (``model(**batch)``, ``forward_backward(**batch)``), by its name.
    keyword: bool = field(default=False, metadata=UNLESS_DEFAULT)


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    name: str
    num_params: int
    hash: str   # partc.identity.model_hash: ranks check they run the planned model
    tracer: str   # "symbolic_trace" | "export"
    num_layers: int
    inputs: tuple[InputSpec, ...] = ()   # empty: written before partc recorded them
    # The batch the model was traced and measured at (per-sample numbers depend on it a
    # little): partc.load measures again at this one. None: written before it was recorded.
    traced_batch_size: int | None = field(default=None, metadata=UNLESS_DEFAULT)
    # The loss is the model's own (no loss_fn: a Hugging Face model given ``labels``),
    # a mean over these labels: "shifted" (a causal LM's: ``labels[:, 1:]`` not -100),
    # "tokens" (``labels`` not -100) or "samples"; the target is then one weight per
    # sample, made by the runtime (``partc.runtime.label_weights``). None: loss_fn's.
    own_loss: str | None = field(default=None, metadata=UNLESS_DEFAULT)
    # partc gives that loss its labels already shifted: the input ``shift_labels``,
    # which the runtime makes from the ``labels`` given
    # (``partc.runtime.label_weights.next_labels``), so that no label is read across the
    # sequence (context parallelism splits it).
    shift_labels: bool = field(default=False, metadata=UNLESS_DEFAULT)
    # Keyword inputs the model was traced without, where they change no counted output
    # (``partc.runtime.padding``): a tokenizer's ``attention_mask`` (each attention's
    # mask then follows from the shapes, causal, and may split with the sequence) and
    # ``position_ids`` of 0..S-1 in every row. The runtime takes them with each batch,
    # checks and leaves them out: with ``pads_at_end`` (a model causal throughout, whose
    # loss counts labels) rows padded at their end whose pads count no label are taken,
    # else unpadded rows only; position ids must be 0..S-1.
    left_out: tuple[str, ...] = field(default=(), metadata=UNLESS_DEFAULT)
    pads_at_end: bool = field(default=False, metadata=UNLESS_DEFAULT)
    # The user's loss_fn returns a mean over its target's entries not -100 (probed, as
    # cross-entropy's default): the runtime weighs each microbatch's loss (each
    # context-parallel rank's) by its count of them over the batch's, so the step's loss
    # is the mean over the whole batch, as one device's (``partc.runtime.label_weights``).
    # None: loss_fn could not be asked; the runtime warns where its target's -100s fall
    # unevenly over the parts it averages.
    counted_target: bool | None = field(default=False, metadata=UNLESS_DEFAULT)
    # Of num_params, those the forward never reads on the traced inputs (a vision tower
    # under text-only batches): no layer holds them, so the plan does not train them; the
    # runtime keeps them as they are, on the host of the first stage's ranks, for state
    # dicts and checkpoints (and warns, naming them).
    unread_params: int = field(default=0, metadata=UNLESS_DEFAULT)

    @property
    def sequence_length(self) -> int | None:
        """Tokens per sample: the first input's leading dimension (after the batch);
        None where no input was recorded or the first has no such dimension."""
        given = [spec for spec in self.inputs if spec.name != "target"]
        return given[0].shape[0] if given and given[0].shape else None

    def meta_batch(self, batch: int) -> tuple[tuple, dict[str, torch.Tensor], Any]:
        """Meta tensors of the recorded inputs for a batch of ``batch`` rows, as the
        model is traced: (positional, by keyword, the target or None)."""
        def empty(spec: InputSpec) -> torch.Tensor:
            return torch.empty((batch, *spec.shape), dtype=spec.dtype, device="meta")

        given = [spec for spec in self.inputs if spec.name != "target"]
        target = next((empty(s) for s in self.inputs if s.name == "target"), None)
        return (tuple(empty(s) for s in given if not s.keyword),
                {s.name: empty(s) for s in given if s.keyword}, target)


@own_form
@dataclass(frozen=True, kw_only=True)
class BudgetInfo:
    """The device budget the plan was made for: its figures as resolved for the plan's
    dtype (``DeviceBudget.to_dict``), written flat beside the device's name. ``None``
    where an older plan recorded none (the preset's then, as ``partc.load`` reads it)."""

    device: str
    num_devices: int
    memory_bytes: tuple[int, ...]   # per device
    figures: DeviceFigures          # memory None: memory_bytes holds it
    source: str | None = None    # "profile" when a calibration profile gave the numbers
    profile: str | None = None   # its path
    preset: str | None = None    # the preset it overrides

    @property
    def memory(self) -> str:
        """The smallest device memory, for people."""
        return format_bytes(min(self.memory_bytes))

    def to_dict(self) -> dict[str, Any]:
        memory = self.memory_bytes
        return {"device": self.device, "num_devices": self.num_devices,
                "memory_bytes": memory[0] if len(set(memory)) == 1 else list(memory),
                **self.figures.to_dict(),
                **{key: getattr(self, key) for key in ("source", "profile", "preset")
                   if getattr(self, key) is not None},
                "memory": self.memory}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BudgetInfo":
        data = {k: v for k, v in data.items() if k != "memory"}   # derived
        memory = data.get("memory_bytes", ())
        if isinstance(memory, (int, float)):
            memory = (memory,) * data.get("num_devices", 1)
        named = {key: value for key, value in data.items() if key not in FIGURE_NAMES}
        try:
            figures = DeviceFigures(**{key: value for key, value in data.items()
                                       if key in FIGURE_NAMES and key != "memory"})
        except (TypeError, ValueError) as error:
            raise PlanSchemaError(f"plan section budget: {error}") from None
        return _read(cls, named, "budget", memory_bytes=tuple(memory), figures=figures)


@dataclass(frozen=True, kw_only=True)
class Predicted:
    """What the cost model predicts for one step of the plan."""

    step_time_s: float
    samples_per_s: float
    mfu: float
    bubble_fraction: float
    peak_memory_bytes: int
    pipeline_time_s: float
    bottleneck_s: float   # the slowest stage, per microbatch
    tail_time_s: float
    tokens_per_s: float | None = field(default=None, metadata=UNLESS_DEFAULT)   # when a
    # sample is a sequence.
    # The planner's closed form of the step (what the search minimises; the step time
    # above is the schedule played out, partc.cost.timeline).
    closed_form_step_s: float | None = field(default=None, metadata=UNLESS_DEFAULT)
    # A compiled plan: the first step's torch.compile on the slowest rank, estimated
    # (partc.cost.compile_time); None when nothing is compiled.
    compile_time_s: float | None = field(default=None, metadata=UNLESS_DEFAULT)


@dataclass(frozen=True, kw_only=True)
class SolverStats:
    status: str
    objective: float
    bound: float
    gap: float
    solve_time_s: float
    configs_total: int = 0
    configs_solved: int = 0
    configs_pruned: int = 0
    # Schedule trials settled without CP-SAT or a bound: played out with their greedy
    # split, or shown to have no split that fits; not written when 0 (plans before it
    # counted them as not reached).
    configs_played: int = field(default=0, metadata=UNLESS_DEFAULT)


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """An obvious plan the report compares with, under the same cost model."""

    name: str
    description: str
    recompute: Recompute   # every layer's (the "none" of a layer that has no other)
    stages: tuple[tuple[str, ...], ...]
    step_time_s: float
    fits: bool
    peak_memory_bytes: int
    worst_stage: int
    worst_need_bytes: int
    worst_limit_bytes: int
    bottleneck_s: float


@dataclass(frozen=True, kw_only=True)
class ScheduleOption:
    """One pipeline schedule priced on the plan's mesh, microbatches and ZeRO stage: its
    step time and bubble as the schedule plays out (:mod:`partc.cost.timeline`), for the
    plan's own split (``how`` "chosen"), the split the automatic schedule choice solved
    for it ("solved split"), the greedy split of its virtual stages ("greedy split"), or
    why there is none (``how`` "no split fits" or torch's refusal)."""

    schedule: Schedule
    virtual_stages: int
    how: str
    step_time_s: float | None = field(default=None, metadata=UNLESS_DEFAULT)
    bubble_fraction: float | None = field(default=None, metadata=UNLESS_DEFAULT)
    peak_memory_bytes: int | None = field(default=None, metadata=UNLESS_DEFAULT)


@dataclass(frozen=True, kw_only=True)
class MeshOutcome:
    """One (pp, dp, cp, tp) factorisation the planner weighed: its fastest configuration
    and step time, or why it has none (``outcome``: "solved", "pruned", "work limit",
    "infeasible")."""

    pp: int
    dp: int
    tp: int
    outcome: Outcome
    # The rest is absent where it does not apply (the file leaves out what is None).
    step_time_s: float | None = field(default=None, metadata=UNLESS_DEFAULT)
    solver_status: str | None = field(default=None, metadata=UNLESS_DEFAULT)
    micro_batch_size: int | None = field(default=None, metadata=UNLESS_DEFAULT)
    num_microbatches: int | None = field(default=None, metadata=UNLESS_DEFAULT)
    schedule: Schedule | None = field(default=None, metadata=UNLESS_DEFAULT)
    zero_stage: int | None = field(default=None, metadata=UNLESS_DEFAULT)
    sequence_parallel: bool | None = field(default=None, metadata=UNLESS_DEFAULT)
    bound_s: float | None = field(default=None, metadata=UNLESS_DEFAULT)
    # infeasible: the tightest split's need per device
    need_bytes: int | None = field(default=None, metadata=UNLESS_DEFAULT)
    limit_bytes: int | None = field(default=None, metadata=UNLESS_DEFAULT)
    # its best configuration's expert-parallel degree
    ep: int | None = field(default=None, metadata=UNLESS_DEFAULT)
    # "step" where its best configuration's ZeRO-2 reduces once per step
    zero2_grad_sync: str | None = field(default=None, metadata=UNLESS_DEFAULT)
    # The context-parallel degree (1: none, not written) and its best configuration's kind
    cp: int = field(default=1, metadata=UNLESS_DEFAULT)
    cp_kind: CpKind | None = field(default=None, metadata=UNLESS_DEFAULT)

    @property
    def mesh(self) -> Mesh:
        return Mesh(pp=self.pp, dp=self.dp, tp=self.tp, ep=self.ep or 1, cp=self.cp,
                    cp_kind=self.cp_kind)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The plan; its fields in the order plan.json writes its sections."""

    mesh: Mesh
    schedule: Schedule
    num_microbatches: int
    micro_batch_size: int
    zero_stage: int   # as chosen or pinned; see effective_zero_stage
    # ZeRO-2: reduce-scatter gradients after every microbatch's backward, or accumulate
    # them whole and reduce-scatter once per "step" (see reduces_once).
    zero2_grad_sync: str = "microbatch"
    stages: tuple[StagePlan, ...]
    predicted: Predicted
    solver: SolverStats
    budget: BudgetInfo
    train: TrainSpec
    model: ModelInfo
    # None when tp = 1, written as {} (as plans always wrote it).
    tensor_parallel: TensorParallelPlan | None = field(default=None, metadata=NONE_AS_EMPTY)
    alternatives: tuple[Alternative, ...] = ()
    # Every (pp, dp, tp) factorisation the planner considered, best first.
    meshes: tuple[MeshOutcome, ...] = ()
    # Every schedule priced on the plan's mesh (the chosen one first, then fastest first).
    schedules: tuple[ScheduleOption, ...] = ()
    # Mixture-of-experts layers split over expert-parallel groups (mesh.ep > 1); None
    # without expert parallelism, and then not written.
    expert_parallel: ExpertParallelPlan | None = field(default=None, metadata=UNLESS_DEFAULT)
    # Mixture-of-experts layers whose routed experts are an nn.ModuleList called one by
    # one: the runtime splits batched experts only, so these keep ep = 1 (the report
    # says so). Written only when there are some.
    module_list_experts: tuple[str, ...] = field(default=(), metadata=UNLESS_DEFAULT)
    # The data-parallel collectives per stage and what of them is assumed hidden; None
    # with one replica, and in plans written before it (not written then).
    data_parallel: DataParallelPlan | None = field(default=None, metadata=UNLESS_DEFAULT)
    # FP8 linears (TrainSpec.fp8); None with fp8 off (not written then).
    fp8: Fp8Plan | None = field(default=None, metadata=UNLESS_DEFAULT)
    # Offload (ZeRO-Offload): the optimizer's state, fp32 master weights and step on the
    # host, gradients copied out and updated weights back each step; under ZeRO-3 the
    # parameter shards on the host too, copied in for each use (FSDP2's CPU offload).
    # Not written when off (older plans read as off).
    offload_optimizer: bool = field(default=False, metadata=UNLESS_DEFAULT)
    offload_params: bool = field(default=False, metadata=UNLESS_DEFAULT)
    # Host memory per node the plan's offloaded state takes (every rank of the node's),
    # which the validator holds to the budget's host_memory.
    host_bytes_per_node: int = field(default=0, metadata=UNLESS_DEFAULT)

    @property
    def offload(self) -> tuple[Offload, ...]:
        """The kinds of state the plan keeps on the host, in Offload's order (what
        ``Constraints(offload=...)`` pins back)."""
        on = {Offload.OPTIMIZER: self.offload_optimizer, Offload.PARAMS: self.offload_params}
        return tuple(kind for kind, is_on in on.items() if is_on)

    @property
    def pp(self) -> int:
        return self.mesh.pp

    @property
    def dp(self) -> int:
        return self.mesh.dp

    @property
    def tp(self) -> int:
        return self.mesh.tp

    @property
    def cp(self) -> int:
        return self.mesh.cp

    @property
    def cp_kind(self) -> CpKind | None:
        return self.mesh.cp_kind

    @property
    def grad_dp(self) -> int:
        """The ranks holding the same parameters, over which gradients are reduced and
        ZeRO shards the state: dp x cp."""
        return self.dp * self.cp

    @property
    def effective_zero_stage(self) -> int:
        """The ZeRO stage the runtime runs (:func:`partc.problem.effective_zero_stage`)."""
        return effective_zero_stage(self.zero_stage, self.grad_dp)

    @property
    def reduces_once(self) -> bool:
        """ZeRO-2 accumulates the step's gradients whole and reduce-scatters them in the
        last microbatch's backward (:func:`partc.problem.reduces_once_per_step`)."""
        return reduces_once_per_step(self.zero_stage, self.grad_dp, self.zero2_grad_sync,
                                     self.num_microbatches)

    @property
    def sequence_parallel(self) -> bool:
        return self.tensor_parallel is not None and self.tensor_parallel.sequence_parallel

    @property
    def tp_objective(self) -> str:
        return self.tensor_parallel.objective if self.tensor_parallel is not None else "time"

    def placement(self, names: Iterable[str]) -> Placement:
        """How the plan places a parameter known under ``names`` (all its FQNs)."""
        if self.tensor_parallel is None:
            return REPLICATE
        return self.tensor_parallel.placement(names)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Every layer once, in model order when the plan is sound."""
        return tuple(name for run in self.runs for name in run)

    @property
    def chunks(self) -> int:
        """Runs of layers per stage: more than one under interleaved 1F1B."""
        return len(self.stages[0].runs) if self.stages and self.stages[0].runs else 1

    @property
    def runs(self) -> tuple[tuple[str, ...], ...]:
        """The contiguous runs of layers in model order: run ``j`` (virtual stage ``j``)
        is on the rank ``partc.cost.schedules.rank_of(schedule, pp, chunks, j)`` says, which
        lists its runs in model order."""
        if self.chunks == 1:
            return tuple(stage.layers for stage in self.stages)
        pp, v = len(self.stages), self.chunks
        name = self.schedule if self.schedule in SCHEDULE_TABLE else Schedule.INTERLEAVED_1F1B
        runs: dict[int, tuple[str, ...]] = {}
        for stage in self.stages:
            for j, run in zip(stages_of_rank(name, pp, v, stage.index), stage.runs):
                runs[j] = run
        return tuple(runs[j] for j in range(pp * v))

    @property
    def recompute(self) -> dict[str, str]:
        return {k: v for stage in self.stages for k, v in stage.recompute.items()}

    @property
    def checkpoint_bytes_per_rank(self) -> int:
        """What the busiest rank writes to a checkpoint: its weights and optimizer state
        (its shards under tensor parallelism and ZeRO), as the plan predicts them; under
        offload the host's, whose fp32 masters are the weights it writes (the device's
        are their copies)."""
        if self.offload_optimizer:
            return max(s.host_checkpoint_bytes + s.memory_bytes.optimizer for s in self.stages)
        return max(s.memory_bytes.params + s.memory_bytes.optimizer for s in self.stages)

    @property
    def save_rate(self) -> float:
        """Bytes per second a rank writes a checkpoint at: the budget's disk bandwidth
        per rank (``DeviceBudget.disk_bandwidth``, or its default), or, when lower, its
        share of the storage's aggregate bandwidth (``DeviceBudget.storage_bandwidth``,
        or its default) with every rank writing at once."""
        per_rank, storage = self.write_bandwidths
        return min(per_rank, storage / self.budget.num_devices)

    @property
    def write_bandwidths(self) -> tuple[float, float]:
        """The checkpoint's write rates in bytes per second: one rank's alone
        (``disk_bandwidth``) and the storage's aggregate (``storage_bandwidth``), the
        budget's or their defaults."""
        figures = self.budget.figures
        return (figures.disk_bandwidth or parse_rate(DEFAULT_DISK_BANDWIDTH),
                figures.storage_bandwidth or parse_rate(DEFAULT_STORAGE_BANDWIDTH))

    @property
    def predicted_save_s(self) -> float:
        """Seconds to write a checkpoint: :attr:`checkpoint_bytes_per_rank` at
        :attr:`save_rate`."""
        return self.checkpoint_bytes_per_rank / self.save_rate

    @property
    def hash(self) -> str:
        """Hash of the decisions (not of timings): ranks compare it before running."""
        text = json.dumps(decisions(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step: microbatches x their size x replicas."""
        return self.num_microbatches * self.micro_batch_size * self.dp

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON data (:mod:`partc.codec`), with its schema version."""
        return {"schema_version": SCHEMA_VERSION, **to_data(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        """A plan from ``to_dict``'s data, of this schema version or an older one; a
        :class:`PlanSchemaError` naming the section otherwise."""
        try:
            return plan_from_data(data)
        except CodecError as error:
            raise PlanSchemaError(f"plan section {error}") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def plan_from_data(data: Mapping[str, Any]) -> Plan:
    """A plan from JSON data of this schema version or version 1 (migrated); a
    :class:`~partc.codec.CodecError` naming the field where the data is not a plan."""
    version = data.get("schema_version", 1)
    if version == 1:
        data = migrate_v1(data)
    elif version != SCHEMA_VERSION:
        raise PlanSchemaError(
            f"plan schema version {version} is not one this partc reads (1 and "
            f"{SCHEMA_VERSION}): it was written by another version of partc; compile "
            "the model again with this one (partc.compile or `partc plan`)")
    return from_data(Plan, {k: v for k, v in data.items() if k != "schema_version"})


# The plan's fields that are decisions, which its hash covers, and those that are not
# (what the plan was made for, what the cost model and the solver said of it); a test
# holds the two to Plan's fields, so that a new field is one or the other.
DECIDED = ("mesh", "schedule", "num_microbatches", "micro_batch_size", "zero_stage",
           "zero2_grad_sync", "stages", "tensor_parallel", "model", "expert_parallel",
           "offload_optimizer", "offload_params", "fp8")
NOT_DECIDED = ("predicted", "solver", "budget", "train", "alternatives", "meshes",
               "schedules", "module_list_experts", "data_parallel", "host_bytes_per_node")


def decisions(plan: Plan) -> dict[str, Any]:
    """The plan's :data:`DECIDED` sections as the codec writes them, in the form the
    first plans hashed them, so that hashes already written (in emitted code, in saved
    programs) stay valid: a stage as its layers and recompute modes, the model as its
    hash, the runs in model order only when interleaved, expert parallelism as its
    degree and capacity factor, ZeRO-2's gradient sync only when it is "step", and an
    offload only when it is on."""
    data = to_data(plan)
    decided = {name: data[name] for name in DECIDED if name in data}
    decided["stages"] = [[stage["layers"], stage["recompute"]] for stage in data["stages"]]
    decided["model"] = plan.model.hash
    if plan.zero2_grad_sync == "microbatch":
        del decided["zero2_grad_sync"]
    for name in ("offload_optimizer", "offload_params"):
        if not getattr(plan, name):
            decided.pop(name, None)
    if plan.chunks > 1:
        decided["runs"] = to_data(plan.runs)
    if plan.expert_parallel is not None:
        decided["expert_parallel"] = {"ep": plan.mesh.ep,
                                      "capacity_factor": plan.expert_parallel.capacity_factor}
    return decided


_V1_WEIGHTS = re.compile(r"^(\d+(?:\.\d+)?)-byte weights$")
_V1_OPTIMIZER = re.compile(r"^(\d+(?:\.\d+)?) bytes of state per parameter$")


def migrate_v1(data: Mapping[str, Any]) -> dict[str, Any]:
    """A version-1 plan as version 2: its ``train`` section with a dtype name and the
    optimizer's own state (version 1 wrote, for a problem planned from numbers alone,
    "4-byte weights" and the optimizer's bytes with a mixed-precision master copy in
    them), derived ``bytes_per_param`` dropped, and ``p2p`` ``None`` where it was empty.
    A plan too old to hold what version 2 needs is refused by :meth:`Plan.from_dict`
    with the section it lacks."""
    data = dict(data, schema_version=SCHEMA_VERSION)
    train = {k: v for k, v in data.get("train", {}).items() if k != "bytes_per_param"}
    weights = _V1_WEIGHTS.match(str(train.get("dtype", "")))
    if weights:
        mixed = float(weights.group(1)) < 4
        train["dtype"] = "bfloat16" if mixed else "float32"
        state = _V1_OPTIMIZER.match(str(train.get("optimizer", "")))
        if state:
            train["optimizer"] = float(state.group(1)) - (4.0 if mixed else 0.0)
    if "global_batch_size" not in train and "mesh" in data:
        train["global_batch_size"] = (data["mesh"].get("dp", 1) * data.get("micro_batch_size", 0)
                                      * data.get("num_microbatches", 0))
    # Version 1 ran every kernel as written: no compile, torch's unfused optimizer step.
    train.setdefault("compile", False)
    train.setdefault("fused_optimizer", False)
    data["train"] = train
    data["stages"] = [{**s, "p2p": s.get("p2p") or None} for s in data.get("stages", ())]
    return data
