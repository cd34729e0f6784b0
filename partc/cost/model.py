"""The cost model: integer time and memory tables for one pipeline configuration.

The planner (CP-SAT), the brute-force oracle in the tests, the validator and the report all
read the same :class:`CostTable`, built deterministically from a :class:`PlanningProblem`
and a :class:`PipelineConfig`. Times are integers in picoseconds and memory in bytes, so
the solver's objective and an independent evaluation of a plan agree exactly.

Model (per pipeline stage ``s`` of ``p``, ``m`` microbatches of ``b`` samples):

- compute per microbatch, per layer and recompute mode: forward, backward and the
  recomputed forward, summed op by op. A compute-heavy op (matmul, attention) takes its
  roofline ``max(b * flops / (peak * efficiency), (b * activation bytes + weight bytes)
  / HBM bandwidth)``: its weight is read once per microbatch, so small microbatches
  (decode-like shapes) are bound by memory and large ones by FLOPs; ``efficiency`` is
  one factor per device type (presets, calibration), and a fused attention kernel has
  its own (``DeviceNumbers.attention_efficiency``: flash kernels run below the
  matmuls). Every other op moves its bytes at the device's element-wise rate
  (``DeviceNumbers.elementwise_bandwidth``: 0.75 of HBM bandwidth in the Hopper
  presets, HBM's in the A100s', unless calibrated; a CPU thread runs them well below
  its copy rate), autocast's casts among them. Every op also pays a fixed overhead per
  call and microbatch, and every heavy op a fixed time beyond its FLOPs
  (``DeviceNumbers.op_overhead_s``, ``matmul_overhead_s``): more, smaller microbatches
  cost more. On a GPU, whose host dispatches ahead of its kernels,
  the ops' overhead is a floor under each layer's phase rather than a sum
  (:func:`dispatched`); the GPU's own time per kernel, whatever its size
  (``DeviceNumbers.kernel_overhead_s``), adds to it for each kernel the estimate
  counted the layer launching (``LayerCost.kernels``) and each gradient's add into its
  accumulator. A heavy op's backward is twice its forward (its gradients
  w.r.t. its input and its weight are two ops like it; a fused attention kernel's
  recomputed scores add FLOPs); the light ops' backward moves the bytes the estimate
  measured autograd's ops to move (``LayerCost.bwd_mem_bytes``); recompute replays its
  ops at the same roofline (:func:`layer_work`). Sequence-parallel linears that run as
  rings (``TrainSpec.tp_overlap``) add the kernels and bytes the estimate measured
  their rings to add to the blocking program it runs (:func:`run_layer`);
- ``t_s`` = compute of the stage's layers + send/recv of the activation crossing its
  outgoing cut (forward) and of its gradient (backward) over the link to the next stage;
- pipeline time, in closed form for the planner's search: ``(m - 1) * max_s t_s +
  sum_s t_s``: every microbatch passes the bottleneck stage, and the first one passes
  every stage once (GPipe and 1F1B alike); under a zero-bubble schedule, which runs a
  layer's backward as an input-gradient then a weight-gradient pass, its backward compute
  costs ``DeviceNumbers.split_backward_factor`` times one pass (:func:`split_factor`);
  with ``v`` virtual stages per rank (placed as
  the schedule places them, :mod:`partc.cost.schedules`; ``t_s`` sums them) the fill-and-drain
  term is divided by ``v``, and by 3 more under a zero-bubble schedule
  (:attr:`PipelineConfig.fill_divisor`). The step time a plan reports is the schedule
  played out in its own order (:func:`simulate`, :mod:`partc.cost.timeline`);
- collectives and sends by :mod:`partc.cost.collectives` (alpha-beta, ring or tree as NCCL
  picks, over NVLink inside a node and the network across; inside a node each kind by
  its own calibrated link where the profile has one), in the dtypes the runtime moves
  them in: sends and tensor-parallel collectives as ``estimate`` measured the values
  (under autocast the residual stream and norm outputs fp32, matmul outputs bf16),
  gradients reduced in fp32, ZeRO-2/3 weights gathered in the compute dtype;
- after the pipeline drains, ``max_s e_s`` where ``e_s`` is the exposed part of the
  data-parallel gradient all-reduce (ring; each gradient's all-reduce starts as soon as
  the last microbatch's backward has accumulated it, so ``max(0, all-reduce - that
  backward)`` is left) plus the optimizer step of the stage's parameters (the bytes a
  step touches, :attr:`Precision.step_bytes`, at ``DeviceNumbers.optimizer_bandwidth``:
  HBM bandwidth unless calibrated), and the
  all-reduce of tied parameters' gradients among the stages that hold them;
- ZeRO-2/3 (FSDP2, one unit per layer): every microbatch's backward reduce-scatters the
  layer's gradients, and ZeRO-3 gathers its parameters in forward and again in backward;
  each collective overlaps the layer's own compute (a layer costs ``max(compute, comm)``
  per phase, as FSDP prefetches the next unit while one computes); ZeRO-2 gathers all
  parameters once per step, in the tail. ZeRO-2 with ``zero2_grad_sync`` "step" and
  several microbatches accumulates whole fp32 gradients instead (memory as ZeRO-1's) and
  reduce-scatters them once, in the last microbatch's backward: priced as ZeRO 0/1's
  reduction, exposed after the pipeline drains where that backward does not hide it.
  FSDP's own work on the unit beside its collectives, which no collective hides
  (:func:`_zero_overhead_seconds`): its hooks every microbatch, forward and backward,
  per all-gather and reduce-scatter the copies in and out (``fsdp_copy_bandwidth``,
  else HBM bandwidth) and the fixed work of each, and the optimizer step's dispatch per
  sharded tensor (``DeviceNumbers.fsdp_*_overhead_s``: a CPU's, calibrated; 0 on a GPU,
  whose host runs ahead of its kernels);
- memory of stage ``s``: parameters + gradients + optimizer state of every parameter the
  stage uses (a tied parameter on every stage that uses it) + saved activations times the
  microbatches in flight (1F1B: ``min(m, p - s)``; GPipe: ``m``; the others counted per
  run from the schedule's order, the largest over its peaks, :meth:`PipelineConfig.held`:
  interleaved 1F1B holds a rank's first run more often than its later ones) + the
  largest transient
  working set of one layer (for a recomputed layer: what recompute rematerialises; under
  ZeRO-2/3 what FSDP holds of the layer's unit, :func:`_zero_transient`) + the
  pipeline's receive buffers (:func:`receive_bytes`): the gradient
  crossing the cut after each of the stage's runs, for the backward being run (the
  activations received are the first layer's saved inputs, among the activations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence

from partc.cost.collectives import Group, collective_seconds
from partc.cost.schedules import schedule as schedule_info
from partc.plan import StageMemory
from partc.problem import (SMALL_UNITS_SHARE, ZERO_STAGES, DeviceNumbers,
                      HeavyOp, LayerCost, MoECost, PlanningProblem, effective_zero_stage,
                      reduces_once_per_step)

PS_PER_S = 10**12


def to_ps(seconds: float) -> int:
    return int(round(seconds * PS_PER_S))


def overlapped(compute_s: float, comm_s: float, overlap: float) -> float:
    """Compute and a collective running beside it: the share ``overlap``
    (:attr:`DeviceNumbers.comm_overlap`) of the shorter one hides behind the longer:
    ``max`` of the two at 1, their sum at 0."""
    return compute_s + exposed_seconds(comm_s, compute_s, overlap)


def exposed_seconds(comm_s: float, compute_s: float, overlap: float) -> float:
    """What a collective of ``comm_s`` adds to compute of ``compute_s`` running beside
    it: all but the share ``overlap`` of the shorter of the two (the rule of
    :func:`overlapped` and, in picoseconds, :func:`exposed_sync_ps`)."""
    return comm_s - overlap * min(compute_s, comm_s)


def split_factor(problem: PlanningProblem, config: "PipelineConfig") -> float:
    """What a layer's backward compute costs under ``config``'s schedule over one pass:
    :attr:`DeviceNumbers.split_backward_factor` where the schedule runs it as an input-
    then a weight-gradient pass (the zero-bubble schedules), else 1."""
    if schedule_info(config.schedule).split_backward:
        return problem.devices.split_backward_factor
    return 1.0


def permille(share: float) -> int:
    """A share in [0, 1] in thousandths: the integer the CP-SAT model and the
    evaluation both weigh an overlap by."""
    return int(round(1000 * share))


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """The outer decisions, enumerated by the planner around each CP-SAT solve."""

    pp: int
    dp: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    tp: int = 1
    sequence_parallel: bool = False
    tp_objective: str = "time"
    zero_stage: int = 0  # 1: optimizer state sharded over dp, 2: gradients too, 3: weights too
    chunks: int = 1      # interleaved-1f1b: model chunks (virtual stages) per pipeline rank
    ep: int = 1          # expert-parallel degree of mixture-of-experts layers (moe_layer_table)
    # ZeRO-2: reduce-scatter gradients after every microbatch, or once per "step"
    # (partc.problem.ZERO2_GRAD_SYNCS)
    zero2_grad_sync: str = "microbatch"

    @property
    def effective_zero_stage(self) -> int:
        """The ZeRO stage that runs (0 with one replica): :func:`effective_zero_stage`."""
        return effective_zero_stage(self.zero_stage, self.dp)

    @property
    def reduces_once(self) -> bool:
        """ZeRO-2 reduce-scatters the step's accumulated gradients once
        (:func:`partc.problem.reduces_once_per_step`)."""
        return reduces_once_per_step(self.zero_stage, self.dp, self.zero2_grad_sync,
                                     self.num_microbatches)

    @property
    def virtual_stages(self) -> int:
        """Contiguous runs of layers: ``pp`` ranks of ``chunks`` each; run ``j`` is on the
        rank :meth:`rank_of` says (the schedule's placement, :mod:`partc.cost.schedules`)."""
        return self.pp * self.chunks

    def rank_of(self, run: int) -> int:
        """The rank of run (virtual stage) ``run``: ``run % pp`` for the looped
        schedules, the "V" for ZBV and DualPipeV."""
        if self.chunks == 1:
            return run
        from partc.cost.schedules import rank_of
        return rank_of(self.schedule, self.pp, self.chunks, run)

    def runs_of(self, stage: int) -> tuple[int, ...]:
        """The runs rank ``stage`` holds, in model order."""
        if self.chunks == 1:
            return (stage,)
        from partc.cost.schedules import stages_of_rank
        return stages_of_rank(self.schedule, self.pp, self.chunks, stage)

    @property
    def fill_divisor(self) -> int:
        """What the closed form :func:`pipeline_ps` divides the fill-and-drain by: the
        chunks (Megatron's ``(p - 1) / v``), and 3 more under a split backward (the
        zero-bubble schedules' fill of ``(p - 1)(F + I - W)`` against 1F1B's ``(p - 1)(F +
        B)``, with backward twice forward and its weight gradient half of it). The
        simulation (:func:`simulated_pipeline_ps`) is what the plan reports."""
        from partc.cost.schedules import SCHEDULE_TABLE
        split = self.schedule in SCHEDULE_TABLE and SCHEDULE_TABLE[self.schedule].split_backward
        return self.chunks * (3 if split else 1)

    def inflight(self, stage: int) -> int:
        """(Microbatch, run) activations rank ``stage`` holds at its peak, all runs
        together (:meth:`held`)."""
        return max(sum(peak) for peak in self.held(stage))

    def held(self, stage: int) -> tuple[tuple[int, ...], ...]:
        """Microbatches rank ``stage`` holds activations of, per run (:meth:`runs_of`'s
        order), at each of its schedule's peaks (:func:`partc.cost.timeline.held_per_run`):
        the runs of an interleaved rank are held unequally (the first run's warm-up
        forwards run before the later runs'). GPipe and looped BFS hold every one, 1F1B
        ``min(m, p - s)``."""
        m = self.num_microbatches
        if self.schedule in ("gpipe", "looped-bfs"):
            return ((m,) * self.chunks,)
        if self.chunks == 1 and self.schedule not in _SPLIT:
            return ((min(m, self.pp - stage),),)
        from partc.cost.timeline import held_per_run
        return held_per_run(self.schedule, self.pp, self.chunks, min(m, 4 * self.pp))[stage]

    def held_at_least(self, stage: int) -> int:
        """A count of microbatches rank ``stage`` holds of every run at once (at one
        of :meth:`held`'s peaks): its activations are at least that many times all its
        runs' saved bytes, whatever their split, a bound for relaxations."""
        return max(min(h) for h in self.held(stage))

    def activations(self, stage: int, saved: Sequence[int]) -> int:
        """Bytes of saved activations on rank ``stage`` whose runs (:meth:`runs_of`'s
        order) save ``saved[i]`` bytes per microbatch: the largest of :meth:`held`'s
        peaks."""
        return max(sum(h * a for h, a in zip(peak, saved, strict=True))
                   for peak in self.held(stage))


_SPLIT = ("interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev")


@dataclass(frozen=True, kw_only=True)
class LayerTable:
    """One layer's integer costs per microbatch, per recompute mode."""

    forward_ps: int
    backward_ps: int
    recompute_ps: dict[str, int]
    saved_bytes: dict[str, int]
    transient_bytes: dict[str, int]
    param_count: int
    state_bytes: dict[str, int]   # params / grads / optimizer of the layer's own parameters
    tail_ps: int                  # optimizer step (ZeRO-1: and the weight gather), per step
    sync_ps: int = 0              # dp gradient all-reduce (ZeRO 0/1), overlapping backward
    # ZeRO-1's weight all-gather when it overlaps the next forward (then not in tail_ps)
    gather_ps: int = 0
    step_bytes: int = 0           # the optimizer step's temporaries (:func:`step_bytes`)

    def compute_ps(self, mode: str) -> int:
        return self.forward_ps + self.backward_ps + self.recompute_ps[mode]

    @property
    def state_total(self) -> int:
        return sum(self.state_bytes.values())


@dataclass(frozen=True, kw_only=True)
class SharedTable:
    layers: tuple[int, ...]
    param_count: int
    state_bytes: dict[str, int]
    tail_ps: int
    tie_sync_ps: int              # per extra stage holding it
    sync_ps: int = 0
    gather_ps: int = 0
    step_bytes: int = 0

    @property
    def state_total(self) -> int:
        return sum(self.state_bytes.values())


@dataclass(frozen=True, kw_only=True)
class CostTable:
    config: PipelineConfig
    layers: tuple[LayerTable, ...]
    shared: tuple[SharedTable, ...]
    cut_ps: tuple[tuple[int, ...], ...]   # [cut l][run j]: cut l as the boundary j -> j+1
    cut_bytes: tuple[int, ...]   # [cut l]: bytes crossing it per microbatch (each way)
    limits: tuple[int, ...]               # per stage
    tail_latency_ps: int
    # DeviceNumbers.comm_overlap in thousandths: how much of the dp gradient reduction
    # the last microbatch's backward hides (:func:`exposed_sync_ps`).
    overlap_permille: int = 1000
    # ZeRO-1 with its weight all-gather overlapped: one bucket's all-gather, which the
    # first layer waits for before any forward runs: in tail_latency_ps, and taken off
    # what forward may hide (:func:`exposed_gather_ps`).
    first_gather_ps: int = 0
    # ZeRO 0/1 over dp: the last bucket's gradient reduction, which starts as the step's
    # backward ends and so overlaps none of it: in tail_latency_ps, and taken off what
    # backward may hide (:func:`exposed_sync_ps`).
    last_sync_ps: int = 0
    # Whether a rank's step temporaries are the sum of its rows' step_bytes (torch's
    # foreach step, over the whole list) or the largest of them (one tensor at a time).
    step_sums: bool = True

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def zero_state_bytes(params: float, weight_bytes: float, grad_bytes: float,
                     optimizer_bytes: float, dp: int, stage: int) -> dict[str, float]:
    """Per-device bytes of weights, gradients and optimizer state for ``params``
    parameters over ``dp`` data-parallel ranks under ZeRO ``stage``: 0 replicates all
    three, 1 shards the optimizer state, 2 the gradients too, 3 the weights too (ZeRO's
    (2 + 2 + K)·Ψ, 2Ψ + 2Ψ + KΨ/N, 2Ψ + (2 + K)Ψ/N and (2 + 2 + K)Ψ/N for fp16 Adam)."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {stage!r}")
    if dp < 1:
        raise ValueError(f"dp must be positive, got {dp}")
    return {
        "params": params * weight_bytes / (dp if stage >= 3 else 1),
        "grads": params * grad_bytes / (dp if stage >= 2 else 1),
        "optimizer": params * optimizer_bytes / (dp if stage >= 1 else 1),
    }


def _state_bytes(problem: PlanningProblem, config: PipelineConfig, params: int,
                 gathered: bool = False) -> dict[str, int]:
    """What the runtime holds (see :class:`partc.problem.Precision`): ZeRO's sharding,
    except that under ZeRO-2 FSDP keeps each rank's fp32 shard beside the gathered
    weights (``gathered``: weights the root unit keeps gathered through the step, such as
    tied ones, likewise under ZeRO-3), and in mixed precision the compute-dtype weights
    beside the fp32 master: under ZeRO-0 a copy made once per step beside the whole
    master, under ZeRO-1 the weights kept in the compute dtype and 1/dp of the master
    (Megatron's distributed optimizer). ZeRO-2 reducing once per step
    (:attr:`PipelineConfig.reduces_once`) holds the whole fp32 gradient the microbatches
    accumulate into until the last one's reduce-scatter; its sharded output replaces the
    whole gradient unit by unit."""
    precision = problem.train.precision
    master = precision.master_bytes
    zero = config.effective_zero_stage
    state = zero_state_bytes(params, master, master, precision.optimizer_state_bytes,
                             dp=config.dp, stage=zero)
    if zero == 2 or zero == 3 and gathered:
        state["params"] = params * (precision.compute_bytes + master / config.dp)
    elif zero == 1 and precision.mixed:
        state["params"] = params * (precision.compute_bytes + master / config.dp)
    elif zero == 0 and precision.mixed:
        state["params"] = params * (master + precision.compute_bytes)
    if config.reduces_once:
        state["grads"] = params * master
    return {kind: int(round(nbytes)) for kind, nbytes in state.items()}


def steps_whole_list(problem: PlanningProblem, config: PipelineConfig) -> bool:
    """Whether torch's optimizer step (as the runtime builds it, with torch's defaults)
    makes its temporaries for all of a rank's weights at once: its foreach form, torch's
    default for weights on a GPU; on a CPU it steps one tensor at a time, except that
    ZeRO-1's distributed optimizer (``partc/runtime/optimizer.py``) steps flat shards of
    its buckets, each up to the rank's whole shard, counted whole here."""
    return problem.devices.dispatch_ahead or config.effective_zero_stage == 1


def step_total(steps: Sequence[int], sums: bool) -> int:
    """The optimizer step's temporaries of a rank whose rows make ``steps`` each: their
    sum, or with ``sums`` false (one tensor at a time) the largest."""
    return sum(steps) if sums else max(steps, default=0)


def step_bytes(problem: PlanningProblem, config: PipelineConfig, params: int,
               largest: int) -> int:
    """The fp32 temporaries the optimizer step makes beside the state, for ``params``
    parameters whose largest tensor has ``largest`` elements: ``step_copies`` copies of
    what it steps over the whole list in torch's foreach form (:func:`steps_whole_list`:
    a rank's rows add up), twice as many of its largest tensor one at a time (the rank's
    largest row counts). It steps the fp32 masters, sharded over dp under ZeRO-1/2/3.
    The activations are gone by then, so this meets only the state at the step's peak:
    a plan of small activations (full recompute, microbatches of one) beside many
    weights peaks in the step (a tied 16384 x 128 embedding on CPU: 16.8 MB)."""
    precision = problem.train.precision
    if not precision.step_copies:
        return 0
    shard = config.dp if config.effective_zero_stage >= 1 else 1
    if steps_whole_list(problem, config):
        elements, copies = params / shard, precision.step_copies
    else:
        elements, copies = largest / shard, 2 * precision.step_copies
    return int(round(copies * precision.master_bytes * elements))


def _zero_comm_seconds(problem: PlanningProblem, config: PipelineConfig,
                       params: int) -> dict[str, float]:
    """ZeRO-2/3 collectives of ``params`` parameters over dp (ring), by when they run:
    per microbatch in forward or backward, or once per step ("step" in the tail, "sync"
    overlapping the last microbatch's backward: ZeRO-2's one reduce-scatter when it
    reduces once per step)."""
    zero = config.effective_zero_stage
    result = {"forward": 0.0, "backward": 0.0, "step": 0.0, "sync": 0.0}
    if zero < 2:
        return result
    precision = problem.train.precision
    group = dp_group(problem, config)
    gather = collective_seconds("all_gather", params * precision.compute_bytes, group)
    scatter = collective_seconds("reduce_scatter", params * precision.master_bytes, group)
    if zero == 2 and config.reduces_once:
        result.update(sync=scatter, step=gather)
    elif zero == 2:
        result.update(backward=scatter, step=gather)
    else:
        result.update(forward=gather, backward=gather + scatter)
    return result


def _zero_overhead_seconds(problem: PlanningProblem, config: PipelineConfig,
                           params: int, tensors: int = 1) -> dict[str, float]:
    """The runtime's own work on a unit of ``params`` parameters beside its layers'
    compute, by when it runs (the keys of :func:`_zero_comm_seconds`): under ZeRO 0/1
    its passes over the gradients (:func:`gradient_work_seconds`); under ZeRO-2/3
    FSDP's, with the collectives it goes with: its forward and
    backward hooks every microbatch (``DeviceNumbers.fsdp_unit_overhead_s``,
    ``fsdp_unit_overhead_backward_s``), the optimizer step's dispatch over its
    ``tensors`` sharded parameters once per step (``fsdp_step_overhead_s`` each), and
    around each all-gather and reduce-scatter the unit runs, the fixed work
    (``fsdp_gather_overhead_s``, ``fsdp_scatter_overhead_s``) and the copies: an
    all-gather copies the rank's shard in and the whole weights out (compute dtype), a
    reduce-scatter the whole gradient in and the shard out (fp32), each byte read and
    written (at :attr:`DeviceNumbers.fsdp_copy_rate`). ZeRO-2 reducing once per step
    accumulates every microbatch's whole fp32 gradient instead of copying it out, about
    as many bytes, a kernel per parameter tensor. It runs on the rank's own thread beside its compute: none of it
    overlaps.

    A layer too small to be a unit of its own (under ``SMALL_UNITS_SHARE`` of a stage's
    parameters, about 1/pp of the model's: the runtime joins it to the next unit) adds
    its bytes to that unit's copies but no work of a unit."""
    zero = config.effective_zero_stage
    result = {"forward": 0.0, "backward": 0.0, "step": 0.0, "sync": 0.0}
    if params == 0:
        return result
    if zero < 2:
        return result | gradient_work_seconds(problem, config, params, tensors)
    devices, precision = problem.devices, problem.train.precision
    units = 1.0 if params > SMALL_UNITS_SHARE * _rank_params(problem) / config.pp else 0.0
    copied = 2 * (1 + 1 / config.dp) * params / devices.fsdp_copy_rate
    gather = units * devices.fsdp_gather_overhead_s + copied * precision.compute_bytes
    scatter = units * devices.fsdp_scatter_overhead_s + copied * precision.master_bytes
    result.update(forward=units * devices.fsdp_unit_overhead_s,
                  backward=units * devices.fsdp_unit_overhead_backward_s,
                  step=tensors * devices.fsdp_step_overhead_s)
    if zero == 2 and config.reduces_once:
        # Autograd adds each parameter's gradient into its whole fp32 one: a kernel per
        # tensor (DeviceNumbers.kernel_overhead_s), as ZeRO 0/1's adds into buckets.
        accumulate = copied * precision.master_bytes + tensors * devices.kernel_overhead_s
        result.update(backward=result["backward"] + accumulate, sync=scatter,
                      step=result["step"] + gather)
    elif zero == 2:
        result.update(backward=result["backward"] + scatter, step=result["step"] + gather)
    else:
        result.update(forward=result["forward"] + gather,
                      backward=result["backward"] + gather + scatter)
    return result


def gradient_work_seconds(problem: PlanningProblem, config: PipelineConfig,
                           params: int, tensors: int = 0) -> dict[str, float]:
    """The runtime's element-wise passes over the gradients of ``params`` parameters under
    ZeRO 0/1, at the device's element-wise rate (none of it overlaps: the rank's own
    thread or stream runs it between its layers' kernels).

    Where the runtime keeps fp32 gradient buckets (dp > 1, mixed precision, or experts
    folded over fewer ranks than dp x tp: ``partc/runtime/module.py``), every
    microbatch's backward adds each gradient into its bucket (the gradient read, the
    bucket read and written); once per step the mean over dp and over the microbatches
    each take a pass over the rank's part of the buckets (read and written; the whole
    under ZeRO-0, 1/dp under ZeRO-1), and the buckets are zeroed for the next step.
    Without buckets autograd accumulates ``.grad`` itself: every microbatch's gradient
    but the first is added to it, and the schedule divides it by the microbatches.
    Each add is a kernel per parameter tensor (``tensors`` of them), each paying the
    device's time per kernel (:attr:`DeviceNumbers.kernel_overhead_s`)."""
    precision = problem.train.precision
    rate = problem.devices.light_op_bandwidth
    master, m = precision.master_bytes, config.num_microbatches
    bucketed = config.dp > 1 or precision.mixed or config.dp * config.tp > config.ep > 1
    kernels = tensors * problem.devices.kernel_overhead_s
    if bucketed:
        added = precision.compute_bytes + 2 * master
        mine = params / config.dp if config.effective_zero_stage == 1 else params
        means = (config.dp > 1) + (m > 1)
        return {"backward": params * added / rate + kernels,
                "step": (2 * master * means * mine + master * params) / rate}
    return {"backward": (m - 1) / m * (params * 3 * master / rate + kernels),
            "step": (m > 1) * params * 2 * master / rate}


def dp_group(problem: PlanningProblem, config: PipelineConfig) -> Group:
    # Ranks are ordered (pp, dp, tp) with tp innermost: a dp group spans dp * tp ranks.
    return Group.over(problem.devices, config.dp, config.dp * config.tp)


def _tail_ps(problem: PlanningProblem, config: PipelineConfig, params: int,
             tensors: int = 1) -> int:
    """The optimizer step; under ZeRO-1 each rank steps 1/dp of the parameters, then the
    updated weights are all-gathered, bucket by bucket ((d-1)/d of the bytes; in the
    compute dtype, cast from the fp32 masters, in mixed precision), here unless that
    all-gather overlaps the next forward (:func:`_gather_ps`). Under
    ZeRO-2/3 gradients were reduce-scattered during backward: each rank steps its shard,
    and ZeRO-2 gathers the parameters once per step; FSDP's work on the ``tensors``
    parameter tensors then (:func:`_zero_overhead_seconds`). (ZeRO 0/1's gradient
    all-reduce is :func:`_sync_ps`.)"""
    devices = problem.devices
    seconds = _zero_overhead_seconds(problem, config, params, tensors)["step"]
    stepped = params
    if config.effective_zero_stage >= 2:
        stepped = params / config.dp
        seconds += _zero_comm_seconds(problem, config, params)["step"]
    elif config.effective_zero_stage == 1:
        stepped = params / config.dp
        if not gather_overlaps(problem, config):   # else beside the forward: _gather_ps
            seconds += _gather_seconds(problem, config, params)
    # At the rate the device's optimizer moves the bytes a step touches (a fused step's
    # HBM bandwidth, or the calibrated rate of torch's unfused one).
    seconds += stepped * problem.train.precision.step_bytes / devices.optimizer_step_bandwidth
    return to_ps(seconds)


def _sync_ps(problem: PlanningProblem, config: PipelineConfig, params: int) -> int:
    """The gradient reduction over dp that runs beside the last microbatch's backward
    (:func:`exposed_sync_ps`). ZeRO 0/1: the fp32 gradient buckets' reduction of
    ``params`` parameters, an all-reduce under ZeRO-0 (ring: 2 (d-1)/d of the bytes), a
    reduce-scatter under ZeRO-1 ((d-1)/d), with their share of the buckets' latencies
    (one collective per ``TrainSpec.bucket_elements``), latency and all. ZeRO-2 reducing once per
    step: the unit's one reduce-scatter, latency included."""
    if config.reduces_once:
        return to_ps(_zero_comm_seconds(problem, config, params)["sync"]
                     + _zero_overhead_seconds(problem, config, params)["sync"])
    if config.dp == 1 or config.effective_zero_stage >= 2:
        return 0
    return to_ps(_reduction_seconds(problem, config, params,
                                    params / problem.train.bucket_elements))


def _reduction_seconds(problem: PlanningProblem, config: PipelineConfig, params: float,
                       calls: float) -> float:
    """ZeRO 0/1's reduction over dp of ``params`` fp32 gradients in ``calls``
    collectives: an all-reduce under ZeRO-0 (ring: 2 (d-1)/d of the bytes), a
    reduce-scatter under ZeRO-1 ((d-1)/d), latency and all."""
    group = dp_group(problem, config)
    kind = "reduce_scatter" if config.effective_zero_stage == 1 else "all_reduce"
    moved = (1 if kind == "reduce_scatter" else 2) * (config.dp - 1) / config.dp
    return (moved * params * problem.train.precision.master_bytes / group.link(kind)[1]
            + calls * collective_seconds(kind, 0.0, group))


def gather_overlaps(problem: PlanningProblem, config: PipelineConfig) -> bool:
    """Whether ZeRO-1's all-gather of the stepped weights runs beside the next step's
    forward (``TrainSpec.overlap_param_gather``) rather than after the optimizer step."""
    return config.effective_zero_stage == 1 and problem.train.param_gather_overlap


def _gather_seconds(problem: PlanningProblem, config: PipelineConfig, params: float) -> float:
    """ZeRO-1's all-gather of ``params`` stepped weights, bandwidth only: (d-1)/d of
    their bytes in the compute dtype."""
    bandwidth = dp_group(problem, config).link("all_gather")[1]
    moved = problem.train.precision.compute_bytes
    return (config.dp - 1) / config.dp * params * moved / bandwidth


def _gather_ps(problem: PlanningProblem, config: PipelineConfig, params: int) -> int:
    """ZeRO-1's all-gather of ``params`` stepped weights where it overlaps the next
    step's forward (:func:`gather_overlaps`; what forward leaves exposed is
    :func:`exposed_gather_ps`), with their share of the buckets' latencies (one
    all-gather per ``TrainSpec.bucket_elements``), as :func:`_sync_ps` prices the reduce-scatter
    beside backward. 0 otherwise: the all-gather is in the tail (:func:`_tail_ps`)."""
    if config.dp == 1 or not gather_overlaps(problem, config):
        return 0
    latency = params / problem.train.bucket_elements * collective_seconds(
        "all_gather", 0.0, dp_group(problem, config))
    return to_ps(_gather_seconds(problem, config, params) + latency)


def _first_gather_ps(problem: PlanningProblem, config: PipelineConfig) -> int:
    """One bucket's all-gather, latency and bytes: what the first layer of a stage
    waits for before the forward it overlaps has begun, charged whole once per step. A
    bucket holds ``TrainSpec.bucket_elements``, or a stage's parameters (about 1/pp of
    the tp rank's) when fewer."""
    if config.dp == 1 or not gather_overlaps(problem, config):
        return 0
    bucket = _stage_bucket(problem, _rank_params(problem), config)
    return to_ps(_gather_seconds(problem, config, bucket)
                 + collective_seconds("all_gather", 0.0, dp_group(problem, config)))


def _last_sync_ps(whole: PlanningProblem, problem: PlanningProblem,
                  config: PipelineConfig) -> int:
    """ZeRO 0/1: the gradient reduction of the last bucket backward fills, latency and
    bytes. It starts as the step's last backward ends (the bucket holds the stage's first
    parameters), so nothing hides it: charged whole once per step. The bucket is
    :func:`_stage_bucket` of the parameters reduced over dp (the routed experts' aside
    under expert parallelism: their buckets are reduced over their own group).
    ``whole``: the problem before its tensor-parallel variant ``problem``."""
    if config.dp == 1 or config.effective_zero_stage >= 2:
        return 0
    synced = _rank_params(problem)
    if config.ep > 1:
        for index, layer in enumerate(whole.layers):
            if layer.moe is not None:
                local = problem.layers[index]
                figures = moe_layer_figures(layer.moe, local, problem, config)
                synced -= local.param_count - figures.dense_params
    return to_ps(_reduction_seconds(problem, config, _stage_bucket(problem, synced, config), 1))


def _stage_bucket(problem: PlanningProblem, params: int, config: PipelineConfig) -> int:
    """The elements of a stage's first (or last) bucket, its model's ``params`` spread
    over ``pp`` stages: ``TrainSpec.bucket_elements``, or the stage's parameters when
    fewer."""
    return min(problem.train.bucket_elements, math.ceil(params / config.pp))


def _rank_params(problem: PlanningProblem) -> int:
    """The parameters of the model (a tensor-parallel rank's, in its variant)."""
    return sum(layer.param_count for layer in problem.layers) + sum(
        shared.param_count for shared in problem.model.shared)


def _bucket_latency_seconds(problem: PlanningProblem, config: PipelineConfig) -> float:
    """ZeRO-1's all-gathers' latencies, once per step, after the optimizer step (the
    gradient collectives' are in :func:`_sync_ps`): one per bucket. A stage holds about
    1/pp of the (tp rank's) parameters, in buckets of ``TrainSpec.bucket_elements``. None where
    the all-gathers overlap the next forward: their latencies are in :func:`_gather_ps`."""
    if config.dp == 1 or config.effective_zero_stage != 1 or gather_overlaps(problem, config):
        return 0.0
    group = dp_group(problem, config)
    buckets = max(1, math.ceil(_rank_params(problem) / config.pp
                               / problem.train.bucket_elements))
    return buckets * collective_seconds("all_gather", 0.0, group)


def _shared_tail_ps(problem: PlanningProblem, config: PipelineConfig, params: int) -> int:
    """A tied weight's tail; under ZeRO-2/3 the stage's root unit holds it, whose
    collectives (every microbatch's, or ZeRO-2's one per step) are not overlapped:
    charged here, with FSDP's work on it."""
    zero = _zero_comm_seconds(problem, config, params)
    own = _zero_overhead_seconds(problem, config, params)
    per_microbatch = sum(zero[p] + own[p] for p in ("forward", "backward"))
    return _tail_ps(problem, config, params) + to_ps(
        config.num_microbatches * per_microbatch + zero["sync"] + own["sync"])


def roofline_seconds(ops: Sequence[HeavyOp], devices: DeviceNumbers, micro_batch: int,
                     scale: float, backward: bool = False) -> tuple[float, float]:
    """One microbatch of compute-heavy ``ops``, each at its roofline (:func:`op_seconds`)
    and its rate (a fused attention kernel at the device's attention share of peak, the
    matmuls at theirs: :meth:`DeviceNumbers.heavy_op_flops`), split into
    (compute-bound, memory-bound) seconds."""
    bound = {True: 0.0, False: 0.0}
    for op in ops:
        compute, memory = op_seconds(op, devices.heavy_op_flops(op), devices.hbm_bandwidth,
                                     micro_batch, scale, backward, devices.matmul_overhead_s)
        bound[compute >= memory] += op.count * max(compute, memory)
    return bound[True], bound[False]


def op_seconds(op: HeavyOp, rate: float, hbm_bandwidth: float, micro_batch: int = 1,
               scale: float = 1.0, backward: bool = False,
               overhead_s: float = 0.0) -> tuple[float, float]:
    """One of ``op``'s equal ops on one microbatch as (compute, memory) seconds: its FLOPs
    at ``rate`` (achievable FLOP/s) and its bytes at ``hbm_bandwidth``, with its weight
    read once per microbatch; its time is the larger (the roofline). ``scale`` converts
    the measured dtype's bytes to the training dtype's (``TrainNumbers.measured_scale``).
    ``backward``: an op's gradients w.r.t. its input and its weight are two ops of its
    FLOPs (plus what a fused kernel recomputes), each reading the output's gradient and
    the weight or the input and writing the input's or the weight's gradient: its bytes
    twice. ``overhead_s``: what each kernel call costs beyond its FLOPs at ``rate``
    (:attr:`DeviceNumbers.matmul_overhead_s`: small matmuls run below the rate)."""
    factor = 2 if backward else 1
    flops = factor * op.flops + (op.bwd_extra_flops if backward else 0.0)
    compute = micro_batch * flops / rate + factor * overhead_s
    memory = factor * (micro_batch * op.activation_bytes + op.weight_bytes) * scale \
        / hbm_bandwidth
    return compute, memory


def op_step_seconds(op: HeavyOp, rate: float, hbm_bandwidth: float) -> float:
    """One op's forward and backward at the roofline, as measured (one microbatch of the
    traced batch, its dtype): what the tensor-parallel chooser charges a node."""
    return sum(max(op_seconds(op, rate, hbm_bandwidth, backward=backward))
               for backward in (False, True))


def layer_work(layer: LayerCost, devices: DeviceNumbers, micro_batch: int,
               scale: float, compiled: bool = False) -> dict[str, Any]:
    """A layer's compute per microbatch as (compute-bound, memory-bound) seconds: forward,
    backward and, per recompute mode, the recomputed forward. Heavy ops by the roofline
    (:func:`roofline_seconds`); the other ops move their bytes at the device's
    element-wise rate (:attr:`DeviceNumbers.light_op_bandwidth`), backward's as measured
    (:attr:`LayerCost.bwd_mem_bytes`). A recompute mode replays the share of the heavy
    ops its FLOPs say (all or none, as estimated) and moves its bytes.

    Every op also pays the device's fixed overhead per call and microbatch
    (:attr:`DeviceNumbers.op_overhead_s` forward, ``op_overhead_backward_s`` per forward
    op in backward; :func:`dispatched`): what makes more, smaller microbatches cost more
    than fewer, larger ones. Selective recompute replays the layer's attention cores
    (``recompute_nodes``), full recompute all of its ops.

    ``compiled`` (``TrainSpec.compile``): the light ops of a layer that is not recomputed
    run as fused kernels, moving ``fused_mem_bytes`` (twice in backward) and paying the
    overhead of ``fused_kernels`` calls; a recomputed layer runs eagerly inside the
    compiled stage (:mod:`partc.runtime.compiled`), so its recompute entry carries what
    the unfused forward and backward cost beyond the fused ones."""
    compute, memory = roofline_seconds(layer.heavy_ops, devices, micro_batch, scale)
    back_compute, back_memory = roofline_seconds(layer.heavy_ops, devices, micro_batch,
                                                 scale, backward=True)

    def light(mem_bytes: float) -> float:
        return micro_batch * mem_bytes * scale / devices.light_op_bandwidth

    # The device's own time for the kernels each phase launches (0 where they were not
    # counted, or on a CPU).
    counted, per_kernel = layer.kernels, devices.kernel_overhead_s
    launched = {"forward": per_kernel * counted["forward"],
                "backward": per_kernel * counted["backward"],
                "recompute": {m: per_kernel * n for m, n in counted["recompute"].items()}}

    ops = layer.num_nodes
    heavy = sum(op.count for op in layer.heavy_ops)
    replayed = {m: layer.recompute_flops[m] / layer.fwd_flops if layer.fwd_flops else 0.0
                for m in layer.modes}
    rerun_ops = {m: layer.recompute_nodes.get(
        m, 0 if m == "none" else ops if m == "full" else max(0, ops - heavy))
        for m in layer.modes}
    eager = {"forward": dispatched(compute, memory + light(layer.fwd_mem_bytes)
                                   + launched["forward"],
                                   ops * devices.op_overhead_s, devices),
             "backward": dispatched(back_compute, back_memory + light(layer.bwd_mem_bytes)
                                    + launched["backward"],
                                    ops * devices.op_overhead_backward_s, devices),
             "recompute": {m: dispatched(replayed[m] * compute,
                                         replayed[m] * memory
                                         + light(layer.recompute_mem_bytes[m])
                                         + launched["recompute"][m],
                                         rerun_ops[m] * devices.op_overhead_s, devices)
                           for m in layer.modes}}
    if not compiled or layer.fused_mem_bytes is None:
        return eager
    kernels = heavy + (layer.fused_kernels or 0)
    # The fused kernels' own time, where the layer's were counted: backward launches as
    # many more per forward kernel as the eager layer's does.
    per_kernel = per_kernel if layer.forward_kernels else 0.0
    backward_share = counted["backward"] / counted["forward"] if counted["forward"] else 2.0
    forward = dispatched(compute, memory + light(layer.fused_mem_bytes)
                         + kernels * per_kernel,
                         kernels * devices.op_overhead_s, devices)
    backward = dispatched(back_compute, back_memory + light(2.0 * layer.fused_mem_bytes)
                          + backward_share * kernels * per_kernel,
                          kernels * devices.op_overhead_backward_s, devices)
    unfused = sum(eager["forward"]) + sum(eager["backward"]) - sum(forward) - sum(backward)
    recompute = {m: (c, memory + (unfused if m != "none" else 0.0))
                 for m, (c, memory) in eager["recompute"].items()}
    return {"forward": forward, "backward": backward, "recompute": recompute}


def dispatched(compute: float, memory: float, dispatch: float,
               devices: DeviceNumbers) -> tuple[float, float]:
    """A phase's (compute-bound, memory-bound) kernel seconds with its ops' ``dispatch``
    seconds (their count times the op overhead) added to the memory-bound part. Where the
    host dispatches ahead of the device (:attr:`DeviceNumbers.dispatch_ahead`, a GPU's
    launch queue) the phase takes the longer of its kernels and its dispatch: only the
    dispatch the kernels cannot hide is added (a layer of many small ops on small
    microbatches runs at the host's pace); on a CPU all of it."""
    if devices.dispatch_ahead:
        return compute, memory + max(0.0, dispatch - compute - memory)
    return compute, memory + dispatch


def run_layer(problem: PlanningProblem, index: int, micro_batch: int) -> LayerCost:
    """Layer ``index`` as the runtime runs it on microbatches of ``micro_batch`` samples:
    its sequence-parallel linears as rings where ``TrainSpec.tp_overlap`` has them so
    (:meth:`LayerCost.as_rings`)."""
    layer = problem.layers[index]
    return layer.as_rings(micro_batch) if problem.train.tp_overlap else layer


def _layer_table(problem: PlanningProblem, config: PipelineConfig, index: int) -> LayerTable:
    layer = run_layer(problem, index, config.micro_batch_size)
    devices, train = problem.devices, problem.train
    b, scale = config.micro_batch_size, train.measured_scale
    work = layer_work(layer, devices, b, scale, train.compiled)
    saved = {m: int(round(b * scale * v)) for m, v in layer.saved_bytes.items()}
    workspace = int(round(2 * b * scale * layer.workspace_bytes))
    gathered, gradient = _zero_transient(problem, config, layer.param_count)
    comm = tp_comm_seconds(problem, config, layer)
    zero = _zero_comm_seconds(problem, config, layer.param_count)
    own = _zero_overhead_seconds(problem, config, layer.param_count, layer.param_tensors)
    # Full recompute replays the layer's forward, collectives included; selective
    # replays the attention cores, which hold none (heads are split over the group).
    # ZeRO-3 gathers the layer once for its backward, recompute included.
    rerun = {m: comm["forward"] if m == "full" else 0.0 for m in layer.modes}
    forward = sum(work["forward"]) + comm["forward"] + own["forward"]
    backward = (split_factor(problem, config) * sum(work["backward"]) + comm["backward"]
                + own["backward"])
    return LayerTable(
        forward_ps=to_ps(overlapped(forward, zero["forward"], devices.comm_overlap)),
        backward_ps=to_ps(overlapped(backward, zero["backward"], devices.comm_overlap)),
        recompute_ps={m: to_ps(sum(work["recompute"][m]) + rerun[m]) for m in layer.modes},
        saved_bytes=saved,
        # ZeRO-2/3: the unit's whole gradient is made as its backward ends, when the
        # backward's working set and this microbatch's saved tensors of it are freed.
        transient_bytes={m: gathered + max(saved["none"] - saved[m] + workspace,
                                           gradient - saved[m]) for m in layer.modes},
        param_count=layer.param_count,
        state_bytes=_state_bytes(problem, config, layer.param_count),
        tail_ps=_tail_ps(problem, config, layer.param_count, max(1, layer.param_tensors)),
        sync_ps=_sync_ps(problem, config, layer.param_count),
        gather_ps=_gather_ps(problem, config, layer.param_count),
        step_bytes=step_bytes(problem, config, layer.param_count, layer.largest_param),
    )


def _zero_transient(problem: PlanningProblem, config: PipelineConfig,
                    params: int) -> tuple[int, int]:
    """Bytes a ZeRO-2/3 unit of ``params`` parameters holds beyond its shards in its
    backward, as FSDP2 runs it: (held throughout, held as the backward ends).

    Throughout, under ZeRO-3, its gathered parameters and the next unit's, whose
    all-gather FSDP issues ahead (taken as the same size); ZeRO-2 gathered every weight
    for the step (state). As it ends, its whole gradient (compute dtype) and the fp32
    reduce-scatter input FSDP copies it into before freeing it."""
    zero = config.effective_zero_stage
    if zero < 2:
        return 0, 0
    precision = problem.train.precision
    compute, master = precision.compute_bytes, precision.master_bytes
    gathered = 2 * params * compute if zero == 3 else 0
    return int(round(gathered)), int(round(params * (compute + master)))


def tp_comm_seconds(problem: PlanningProblem, config: PipelineConfig,
                    layer) -> dict[str, float]:
    """A layer's tensor-parallel collectives per microbatch, by phase (ring, in a node).

    A collective the runtime runs as a ring beside its linears' matmuls
    (``LayerCost.tp_overlap_flops``, ``TrainSpec.tp_overlap``) costs its exposed part
    only, :func:`exposed_seconds` of its time ``c`` beside ``t``: the share of those
    matmuls that runs while the ring moves data, ``(tp - 1) / tp`` of them (the chunk
    this rank holds first, or sums last, runs alone), at the compute-bound rate; the
    share ``DeviceNumbers.comm_overlap`` of ``min(c, t)`` is hidden."""
    devices = problem.devices
    group = Group.over(devices, config.tp, config.tp)
    scale = config.micro_batch_size * problem.train.measured_scale
    beside = layer.tp_overlap_flops if problem.train.tp_overlap else ()
    rate = devices.peak_flops * devices.flops_efficiency
    share = (config.tp - 1) / config.tp
    result = {"forward": 0.0, "backward": 0.0}
    for index, (kind, phase, nbytes) in enumerate(layer.tp_comm):
        seconds = collective_seconds(kind, nbytes * scale, group)
        if beside and beside[index]:
            matmul = share * beside[index] * config.micro_batch_size / rate
            seconds = exposed_seconds(seconds, matmul, devices.comm_overlap)
        result[phase] += seconds
    return result


def collectives_seconds(collectives: Iterable[tuple[str, str, float]],
                        group: Group) -> dict[str, float]:
    """Collectives ``(kind, phase, bytes of the whole tensor)`` over ``group``
    (:func:`partc.cost.collectives.collective_seconds`), summed by phase."""
    result = {"forward": 0.0, "backward": 0.0}
    for kind, phase, nbytes in collectives:
        result[phase] += collective_seconds(kind, nbytes, group)
    return result


def stage_ranks(problem: PlanningProblem, config: PipelineConfig, stage: int) -> range:
    width = problem.devices.num_devices // config.pp
    return range(stage * width, (stage + 1) * width)


def _p2p_link(problem: PlanningProblem, config: PipelineConfig, boundary: int) -> Group:
    """The link across ``boundary`` (run ``boundary`` to run ``boundary + 1``, on ranks
    ``boundary % pp`` and the next, wrapping to rank 0 when interleaved): the network if
    any pair of ranks crosses a node."""
    node = problem.devices.devices_per_node
    here = stage_ranks(problem, config, config.rank_of(boundary))
    there = stage_ranks(problem, config, config.rank_of(boundary + 1))
    crosses = any(a // node != b // node for a, b in zip(here, there))
    return Group.over(problem.devices, 2, 2 * node if crosses else 2)


def _cut_table(problem: PlanningProblem, config: PipelineConfig) -> tuple[tuple[int, ...], ...]:
    """[cut l][boundary j]: the sends of cut ``l`` as the boundary ``j -> j + 1``, both
    ways; 0 where both runs are on one rank (the V schedules' turn), which passes the
    tensors on without a send."""
    scale = problem.train.measured_scale * config.micro_batch_size
    links = [None if config.rank_of(j) == config.rank_of(j + 1)
             else _p2p_link(problem, config, j) for j in range(config.virtual_stages - 1)]
    rows: dict[float, tuple[int, ...]] = {}   # equal cuts (between blocks) share a row
    for crossing in set(problem.model.cut_bytes):
        # Forward sends the activation, backward returns its gradient: twice the bytes.
        rows[crossing] = tuple(
            0 if link is None else to_ps(2 * collective_seconds("send", scale * crossing, link))
            for link in links)
    return tuple(rows[crossing] for crossing in problem.model.cut_bytes)


def _cut_bytes(problem: PlanningProblem, config: PipelineConfig) -> tuple[int, ...]:
    """Bytes crossing each cut per microbatch, in the training dtype."""
    scale = problem.train.measured_scale * config.micro_batch_size
    return tuple(math.ceil(scale * crossing) for crossing in problem.model.cut_bytes)


def _shared_tables(problem: PlanningProblem, config: PipelineConfig) -> tuple[SharedTable, ...]:
    devices = problem.devices
    return tuple(
        SharedTable(
            layers=group.layers,
            param_count=group.param_count,
            state_bytes=_state_bytes(problem, config, group.param_count, gathered=True),
            tail_ps=_shared_tail_ps(problem, config, group.param_count),
            # ZeRO-2's once-per-step reduce-scatter of the root unit is in its tail.
            sync_ps=0 if config.reduces_once else _sync_ps(problem, config,
                                                           group.param_count),
            gather_ps=_gather_ps(problem, config, group.param_count),
            step_bytes=step_bytes(problem, config, group.param_count, group.param_count),
            # fp32 gradients between the stages holding it (first and last, usually):
            # over the network unless the whole pipeline fits in one node.
            tie_sync_ps=to_ps(collective_seconds(
                "send", group.param_count * problem.train.precision.master_bytes,
                Group.over(devices, 2, devices.num_devices))),
        )
        for group in problem.model.shared
    )


class TableCache:
    """Rows of cost tables shared between the configurations of one problem.

    A layer's row depends on the layer's numbers and on the configuration's micro-batch
    size, dp, tensor-parallel variant and ZeRO stage, never on its name, pp or schedule;
    the 80 identical blocks of a 70B model thus share one row per configuration family,
    and the many configurations of a search share rows and cut tables. Nothing but the
    limits depends on the devices' memory, so problems that differ only in memory
    (re-planning after a budget change) may share a cache too.

    The caller owns it: ``partc.planner.solve`` takes one (a fresh one by default) and
    ``partc.PlanCache.table_cache`` keeps one per problem, memory aside.
    """

    def __init__(self) -> None:
        self._tables: dict[tuple, tuple] = {}   # rows, cut and shared tables, limits
        self.distinct: dict[int, tuple] = {}   # per rows tuple: planner's row summary
        self.splits: dict[tuple, int] = {}     # planner's min-max splits of layer costs
        # What the planner learnt from earlier problems (memory aside, the same): the
        # assignment it chose for each configuration it solved, and the best configuration.
        self.solutions: dict[PipelineConfig, Any] = {}
        self.best_config: PipelineConfig | None = None
        self._groups: dict[int, tuple[Any, list[int], list[int]]] = {}

    def rows(self, problem: PlanningProblem, config: PipelineConfig) -> tuple[LayerTable, ...]:
        """One row per layer; layers with equal numbers share one row object."""
        family = (config.micro_batch_size, config.dp, config.tp, config.sequence_parallel,
                  config.tp_objective, config.zero_stage, config.reduces_once,
                  schedule_info(config.schedule).split_backward)
        known = self._tables.get(("rows", family, id(problem.model)))
        if known is not None:
            return known
        group_of, representatives = self._layer_groups(problem)
        built = [_layer_table(problem, config, index) for index in representatives]
        rows = self._tables["rows", family, id(problem.model)] = tuple(
            built[group] for group in group_of)
        return rows

    def _layer_groups(self, problem: PlanningProblem) -> tuple[list[int], list[int]]:
        """Per layer, the index of its group of equal layers; each group's first layer."""
        model = problem.model
        known = self._groups.get(id(model))
        if known is None or known[0] is not model:
            keys: dict[tuple, int] = {}
            group_of, representatives = [], []
            for index, layer in enumerate(model.layers):
                group = keys.setdefault(_layer_key(layer), len(keys))
                if group == len(representatives):
                    representatives.append(index)
                group_of.append(group)
            known = self._groups[id(model)] = (model, group_of, representatives)
        return known[1], known[2]

    def shared(self, problem: PlanningProblem,
               config: PipelineConfig) -> tuple[SharedTable, ...]:
        key = ("shared", config.micro_batch_size, config.num_microbatches, config.dp,
               config.tp, config.sequence_parallel, config.tp_objective, config.zero_stage,
               config.reduces_once)
        if key not in self._tables:
            self._tables[key] = _shared_tables(problem, config)
        return self._tables[key]

    def limits(self, problem: PlanningProblem, config: PipelineConfig) -> tuple[int, ...]:
        key = ("limits", config.pp, problem.devices.memory_bytes)
        if key not in self._tables:
            self._tables[key] = tuple(
                min(problem.devices.memory_bytes[r] for r in stage_ranks(problem, config, s))
                for s in range(config.pp))
        return self._tables[key]

    def cuts(self, problem: PlanningProblem,
             config: PipelineConfig) -> tuple[tuple[int, ...], ...]:
        placement = config.chunks > 1 and schedule_info(config.schedule).placement
        key = ("cuts", config.micro_batch_size, config.pp, config.chunks, placement,
               config.tp, config.sequence_parallel, config.tp_objective)
        cuts = self._tables.get(key)
        if cuts is None:
            cuts = self._tables[key] = _cut_table(problem, config)
        return cuts


def _layer_key(layer) -> tuple:
    """Every number of a LayerCost a row depends on (not its name or signature)."""
    return (layer.fwd_flops, layer.heavy_ops, layer.fwd_mem_bytes, layer.param_count,
            layer.param_bytes, tuple(sorted(layer.saved_bytes.items())),
            tuple(sorted(layer.recompute_flops.items())),
            tuple(sorted(layer.recompute_mem_bytes.items())), layer.workspace_bytes,
            layer.tp_comm, layer.tp_overlap_flops, layer.num_nodes, layer.fused_mem_bytes,
            layer.fused_kernels, tuple(sorted(layer.recompute_nodes.items())),
            layer.param_tensors, layer.largest_param, layer.backward_mem_bytes,
            layer.forward_kernels, layer.backward_kernels,
            tuple(sorted(layer.recompute_kernels.items())),
            tuple(sorted(layer.ring_kernels.items())), layer.ring_bwd_mem_bytes,
            layer.ring_kernels_single and tuple(sorted(layer.ring_kernels_single.items())),
            layer.ring_bwd_mem_bytes_single)


def build_cost_table(problem: PlanningProblem, config: PipelineConfig,
                     cache: TableCache | None = None) -> CostTable:
    """The integer tables of ``config``; ``cache`` shares rows with other configurations
    of the same problem (a cache must not outlive its problem: rows are keyed by layer
    numbers, not by the devices and training numbers they were computed with)."""
    cache = cache or TableCache()
    whole, problem = problem, problem.variant(config.tp, config.sequence_parallel,
                                              config.tp_objective)
    devices = problem.devices
    if devices.num_devices != config.pp * config.dp * config.tp:
        raise ValueError(f"pp={config.pp} x dp={config.dp} x tp={config.tp} does not use "
                         f"{devices.num_devices} devices")
    shared = cache.shared(problem, config)
    limits = cache.limits(problem, config)
    latency = _bucket_latency_seconds(problem, config)
    first_gather = _first_gather_ps(problem, config)
    last_sync = _last_sync_ps(whole, problem, config)
    return CostTable(
        config=config,
        layers=moe_rows(whole, problem, config, cache.rows(problem, config), cache),
        shared=shared,
        cut_ps=cache.cuts(problem, config),
        limits=limits,
        tail_latency_ps=to_ps(latency) + first_gather + last_sync,
        overlap_permille=permille(devices.comm_overlap),
        first_gather_ps=first_gather, last_sync_ps=last_sync,
        cut_bytes=_cut_bytes(problem, config),
        step_sums=steps_whole_list(problem, config),
    )


@dataclass(frozen=True, kw_only=True)
class StageCost:
    layers: tuple[int, ...]
    compute_ps: int
    forward_ps: int
    backward_ps: int
    recompute_ps: int
    comm_ps: int
    tail_ps: int
    param_count: int
    memory: StageMemory
    limit: int
    runs: tuple[tuple[int, ...], ...] = ()   # interleaved: the rank's runs of layers
    # Per run of the rank (model order): forward, backward, recompute, the send of its
    # cut (both ways) and its share of the cut into it (:func:`receive_ps`), per
    # microbatch; what the simulation plays.
    run_ps: tuple[tuple[int, int, int, int, int], ...] = ()

    @property
    def busy_ps(self) -> int:
        return self.compute_ps + self.comm_ps


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    stages: tuple[StageCost, ...]
    pipeline_ps: int
    tail_ps: int
    tie_ps: int
    step_ps: int

    @property
    def fits(self) -> bool:
        return all(s.memory.peak <= s.limit for s in self.stages)

    @property
    def worst_stage(self) -> StageCost:
        return max(self.stages, key=lambda s: s.memory.peak / max(s.limit, 1))


def exposed_sync_ps(sync_ps: int, backward_ps: int, overlap_permille: int = 1000,
                    last_ps: int = 0) -> int:
    """What is left of a stage's dp gradient all-reduce once the last microbatch's
    backward (``backward_ps``, which it overlaps bucket by bucket) is done: all but the
    share ``overlap_permille`` / 1000 of the shorter of the two (:func:`overlapped`),
    rounded up; ``max(0, sync - backward)`` at a whole overlap. The last bucket's
    reduction (``last_ps``: it starts as backward ends, and is charged whole in
    ``CostTable.tail_latency_ps``) is not counted here."""
    sync_ps = max(0, sync_ps - last_ps)
    hidden = overlap_permille * min(sync_ps, backward_ps)
    return -(-(1000 * sync_ps - hidden) // 1000)


def exposed_gather_ps(gather_ps: int, forward_ps: int, first_ps: int,
                      overlap_permille: int = 1000) -> int:
    """What is left of a stage's ZeRO-1 weight all-gather (``gather_ps``, overlapping
    the next step's forward) beyond the first bucket's (``first_ps``, which the first
    layer waits for before any runs: charged whole in ``CostTable.tail_latency_ps``):
    what a microbatch's forward of the stage (``forward_ps``; the first microbatch's
    meets the waits) does not hide of the rest, as :func:`exposed_sync_ps`."""
    return exposed_sync_ps(max(0, gather_ps - first_ps), forward_ps, overlap_permille)


def _holders(table: CostTable, stage_of: Sequence[int]) -> list[set[int]]:
    """Per shared group, the ranks holding it (``stage_of`` gives runs, see
    :attr:`PipelineConfig.virtual_stages`)."""
    config = table.config
    return [{config.rank_of(stage_of[l]) for l in group.layers} for group in table.shared]


def receive_bytes(table: CostTable, runs: Sequence[Sequence[int]],
                  numbers: Sequence[int]) -> int:
    """The receive buffers of the rank whose runs ``numbers`` hold the layers ``runs``:
    the gradient crossing the cut after each run but the model's last.

    partc's stage (:class:`partc.runtime.pipeline_stage.CountingStage`) makes a
    microbatch's buffers when their receive is posted and lets them go after its
    backward, as Megatron does. A buffer of activations is the stage's input itself,
    which its first layer saves for backward while its microbatch is in flight: counted
    in :meth:`PipelineConfig.activations`, nothing more here. A buffer of gradients
    lives from just before a run's backward to its end: one per run at a time, the bytes
    crossing out once. (What crosses a cut is counted whole, though a value without a
    gradient, a mask or the positions, gets no gradient buffer; and a value read by
    several layers, charged to the layer that makes it, is not among the first layer's
    saved inputs.) ``benchmarks/memory_check.py`` measures it."""
    last = table.config.virtual_stages - 1
    return sum(table.cut_bytes[run[-1]] for j, run in zip(numbers, runs)
               if run and j < last)


def receive_ps(table: CostTable, cut: int, boundary: int) -> int:
    """The receiving end's share of cut ``cut``'s transfers as the boundary ``boundary ->
    boundary + 1`` (both ways: the activation in, its gradient back out), charged to
    the run after the boundary beside the sender's whole ``cut_ps``: all but the share
    ``comm_overlap`` of it. A transfer costs its sender the send and its receiver the
    receipt; NCCL's kernels run beside the receiver's compute (overlap 1: nothing), gloo's
    threads on the cores the receiver computes on (a CPU's calibrated overlap, about
    0.2), so both ends lose it there."""
    return table.cut_ps[cut][boundary] * (1000 - table.overlap_permille) // 1000


def _stage_cost(table: CostTable, stage: int, runs: list[list[int]], modes: Sequence[str],
                held: list[int], numbers: Sequence[int] = ()) -> StageCost:
    """Rank ``stage``'s costs; ``runs`` are its runs of layers (one unless interleaved),
    each sending to the next run's rank unless it is the model's last."""
    config = table.config
    members = sorted(l for run in runs for l in run)
    rows = [table.layers[l] for l in members]
    state = {k: sum(r.state_bytes[k] for r in rows)
             + sum(table.shared[g].state_bytes[k] for g in held)
             for k in ("params", "grads", "optimizer")}
    saved = [sum(table.layers[l].saved_bytes[modes[l]] for l in run) for run in runs]
    activations = config.activations(stage, saved)
    transient = max(table.layers[l].transient_bytes[modes[l]] for l in members)
    step = step_total([r.step_bytes for r in rows] + [table.shared[g].step_bytes for g in held],
                      table.step_sums)
    forward = sum(r.forward_ps for r in rows)
    backward = sum(r.backward_ps for r in rows)
    recompute = sum(table.layers[l].recompute_ps[modes[l]] for l in members)
    numbers = numbers or config.runs_of(stage)
    receive = receive_bytes(table, runs, numbers)
    sent = [table.cut_ps[run[-1]][j] if run and j < config.virtual_stages - 1 else 0
            for j, run in zip(numbers, runs)]
    # Runs are contiguous in model order: the cut into run j is its first layer's - 1.
    received = [receive_ps(table, run[0] - 1, j - 1) if run and j > 0 else 0
                for j, run in zip(numbers, runs)]
    comm = sum(sent) + sum(received)
    run_ps = tuple(
        (sum(table.layers[l].forward_ps for l in run),
         sum(table.layers[l].backward_ps for l in run),
         sum(table.layers[l].recompute_ps[modes[l]] for l in run), out, into)
        for run, out, into in zip(runs, sent, received))
    return StageCost(
        run_ps=run_ps,
        layers=tuple(members),
        compute_ps=forward + backward + recompute,
        forward_ps=forward, backward_ps=backward, recompute_ps=recompute, comm_ps=comm,
        tail_ps=exposed_sync_ps(
            sum(r.sync_ps for r in rows) + sum(table.shared[g].sync_ps for g in held),
            backward, table.overlap_permille, table.last_sync_ps)
        + sum(r.tail_ps for r in rows)
        + sum(table.shared[g].tail_ps for g in held)
        + exposed_gather_ps(
            sum(r.gather_ps for r in rows) + sum(table.shared[g].gather_ps for g in held),
            forward, table.first_gather_ps, table.overlap_permille),
        param_count=sum(r.param_count for r in rows)
        + sum(table.shared[g].param_count for g in held),
        memory=StageMemory(**state, activations=activations, transient=transient,
                           receive=receive, step=step,
                           peak=sum(state.values()) + max(activations + transient + receive,
                                                          step)),
        limit=table.limits[stage],
        runs=tuple(tuple(run) for run in runs) if config.chunks > 1 else (),
    )


def pipeline_ps(config: PipelineConfig, busy: Sequence[int]) -> int:
    """Forward and backward of all microbatches, ``busy`` per rank and microbatch: every
    microbatch passes the bottleneck rank, and the first one passes every rank once;
    interleaving divides that fill-and-drain by the chunks (Megatron: ``(m + (p - 1) / v)
    t`` for equal ranks)."""
    peak = max(busy)
    return config.num_microbatches * peak + (sum(busy) - peak) // config.fill_divisor


def simulate(config: PipelineConfig, evaluation: Evaluation, schedule: str | None = None):
    """The configuration's step played out by :func:`partc.cost.timeline.play` from the
    evaluation's figures per run and microbatch, in picoseconds (a ``Timeline`` whose
    seconds are picoseconds; the tails are the ranks' own). ``schedule`` plays another
    schedule of the same placement and virtual stages."""
    from partc.cost.timeline import StageSeconds, play

    name = schedule or config.schedule
    runs: list[StageSeconds | None] = [None] * config.virtual_stages
    for s, stage in enumerate(evaluation.stages):
        for j, (forward, backward, recompute, cut, into) in zip(config.runs_of(s),
                                                                 stage.run_ps):
            runs[j] = StageSeconds(forward=forward, backward=backward, recompute=recompute,
                                   send=cut / 2, receive=into / 2)
    return play(name, config.pp, config.chunks, config.num_microbatches, runs,
                [stage.tail_ps for stage in evaluation.stages])


def simulated_step_ps(config: PipelineConfig, evaluation: Evaluation) -> tuple[int, float]:
    """The step time the plan reports, in picoseconds: the simulated pipeline
    (:func:`simulate`) then the slowest tail and the tied-weight syncs, as
    :func:`evaluate` adds them to the closed form; and the simulation's bubble."""
    timeline = simulate(config, evaluation)
    return (round(timeline.pipeline_s) + evaluation.tail_ps + evaluation.tie_ps,
            timeline.bubble_fraction)


def evaluate(table: CostTable, stage_of: Sequence[int], modes: Sequence[str]) -> Evaluation:
    """Step time and memory of one assignment; independent of any solver. ``stage_of``
    gives each layer's run (its rank unless interleaved: run ``j`` is on rank ``j % pp``)."""
    config = table.config
    pp = config.pp
    runs: list[list[int]] = [[] for _ in range(config.virtual_stages)]
    for layer, run in enumerate(stage_of):
        runs[run].append(layer)
    holders = _holders(table, stage_of)
    stages = tuple(
        _stage_cost(table, s, [runs[j] for j in config.runs_of(s)], modes,
                    [g for g, held in enumerate(holders) if s in held], config.runs_of(s))
        for s in range(pp)
    )
    pipeline = pipeline_ps(config, [s.busy_ps for s in stages])
    tail = max(s.tail_ps for s in stages) + table.tail_latency_ps
    tie = sum(group.tie_sync_ps * (len(held) - 1)
              for group, held in zip(table.shared, holders))
    return Evaluation(stages=stages, pipeline_ps=pipeline, tail_ps=tail, tie_ps=tie,
                      step_ps=pipeline + tail + tie)


# ---------------------------------------------------------------- mixture-of-experts
#
# Expert parallelism as Megatron folds it (expert tensor parallelism 1): within a
# pipeline stage, the dp x tp ranks in rank order (tp fastest) form groups of ``ep``
# consecutive ranks; ep rank e holds experts [e E / ep, (e + 1) E / ep) of every
# mixture-of-experts layer, and the ranks at the same position of each group (``dp x tp
# / ep`` of them, the expert-data-parallel group) hold the same experts and reduce their
# gradients. Every token goes to its top-k experts by an all-to-all (dispatch) and comes
# back by another (combine), in forward; backward returns both gradients the same way.
# With ep = 1 a layer's row is the ordinary one (the layer's figures include the experts
# as one process runs them).


def moe_worst_factor(moe: MoECost, ep: int, imbalance: float,
                     capacity_factor: float | None) -> float:
    """The tokens a rank's experts receive at worst over their balanced share, which the
    plan budgets memory for: the routing imbalance assumed (``TrainSpec.moe_imbalance``),
    at most the capacity factor when tokens beyond it are dropped, and at most what the
    group can send (each of the ``ep`` ranks' tokens to ``min(k, E / ep)`` of the rank's
    experts). With ep = 1 a rank runs its own tokens through all its experts: 1."""
    if ep == 1:
        return 1.0
    factor = imbalance if capacity_factor is None else min(imbalance, capacity_factor)
    ceiling = ep * min(moe.top_k, moe.num_experts // ep) / moe.top_k
    return min(factor, ceiling)


def ep_ranks_cross_nodes(devices: DeviceNumbers, config: PipelineConfig) -> bool:
    """Whether any expert-parallel group (``ep`` consecutive ranks of a stage) spans two
    nodes."""
    node, width, ep = devices.devices_per_node, config.dp * config.tp, config.ep
    return any((first + ep - 1) // node != first // node
               for stage in range(config.pp)
               for first in range(stage * width, (stage + 1) * width, ep))


def all_to_all_seconds(nbytes: float, devices: DeviceNumbers, config: PipelineConfig) -> float:
    """One all-to-all over an expert-parallel group, each rank sending ``nbytes`` (its
    whole buffer, its own share included), by the alpha-beta model of
    :mod:`partc.cost.collectives`: ``ep - 1`` steps (pairwise exchanges) at the link's
    latency; of the buffer, ``(ep - 1) / ep`` leaves the rank. Inside a node it moves over
    NVLink; a group spanning nodes sends the shares of peers in other nodes over the
    network and the others over NVLink at the same time (the slower of the two)."""
    ep = config.ep
    if ep == 1:
        return 0.0
    if not ep_ranks_cross_nodes(devices, config):
        group = Group.over(devices, ep, ep)
        latency, bandwidth = group.latency_s, group.bandwidth
        return (ep - 1) * latency + (ep - 1) / ep * nbytes / bandwidth
    local = min(ep, devices.devices_per_node)   # peers in a rank's own node, itself too
    network = (ep - local) / ep * nbytes / devices.inter_node_bandwidth
    nvlink = (local - 1) / ep * nbytes / devices.intra_node_bandwidth
    return (ep - 1) * devices.link_latency_s + max(network, nvlink)


def expert_dp_config(config: PipelineConfig) -> PipelineConfig:
    """The configuration the experts' parameters see: ``dp x tp / ep`` replicas spanning
    the stage's dp x tp ranks (``dp_group`` of it is the expert-data-parallel group), so
    that ZeRO, the gradient reduction and the optimizer step of the experts are priced by
    the functions that price the other parameters."""
    return replace(config, dp=config.dp * config.tp // config.ep, tp=config.ep)


@dataclass(frozen=True, kw_only=True)
class MoELayerFigures:
    """One mixture-of-experts layer on one rank under expert parallelism, per microbatch:
    what :func:`moe_layer_table` prices and the plan records."""

    num_experts: int
    top_k: int
    local_experts: int            # experts per rank: E / ep
    expert_params: int            # the rank's share of the routed experts' parameters
    dense_params: int             # the layer's other parameters on the rank
    all_to_all_bytes: float       # one all-to-all's buffer per rank (dispatch or combine)
    all_to_all_s: float           # one all-to-all's time
    worst_factor: float           # tokens at worst over the balanced share (memory)
    expert_saved: dict[str, float]   # the experts' saved bytes at worst, by mode
    flops_delta: float            # expert FLOPs beyond the layer's own figures (tp > 1)

    @property
    def all_to_alls(self) -> int:
        """All-to-alls per microbatch without recompute: dispatch and combine, forward and
        backward."""
        return 4


def moe_layer_figures(whole: MoECost, layer: LayerCost, problem: PlanningProblem,
                      config: PipelineConfig) -> MoELayerFigures:
    """The expert-parallel figures of ``layer`` (as one rank of the configuration's
    tensor-parallel variant measures it) whose routed experts ``whole`` describes for the
    whole model. ``layer.moe`` says how the layer's own figures include the experts
    (tokens per sample on the rank, the parameters and FLOPs it counts); a variant layer
    without it is taken to include them split over tp, as sequence parallelism splits
    the tokens. Under expert parallelism the experts are whole (expert tensor
    parallelism 1) and the rank's tokens, balanced, cost it the FLOPs of its share of the
    tokens through whole experts."""
    tp = config.tp
    local = layer.moe if layer.moe is not None else replace(
        whole, tokens_per_sample=whole.tokens_per_sample / tp,
        expert_param_count=whole.expert_param_count // tp,
        expert_fwd_flops=whole.expert_fwd_flops / tp,
        expert_saved_bytes={m: v / tp for m, v in whole.expert_saved_bytes.items()},
        dispatch_bytes=whole.dispatch_bytes / tp)
    ratio = local.tokens_per_sample / whole.tokens_per_sample
    b, scale = config.micro_batch_size, problem.train.measured_scale
    worst = moe_worst_factor(whole, config.ep, problem.train.moe_imbalance,
                             problem.train.moe_capacity_factor)
    buffer = b * whole.dispatch_bytes * ratio * scale
    return MoELayerFigures(
        num_experts=whole.num_experts, top_k=whole.top_k,
        local_experts=whole.num_experts // config.ep,
        expert_params=whole.expert_param_count // config.ep,
        dense_params=layer.param_count - local.expert_param_count,
        all_to_all_bytes=buffer,
        all_to_all_s=all_to_all_seconds(buffer, problem.devices, config),
        worst_factor=worst,
        expert_saved={m: whole.expert_saved_bytes.get(m, 0.0) * ratio * worst
                      for m in layer.saved_bytes},
        flops_delta=whole.expert_fwd_flops * ratio - local.expert_fwd_flops)


def moe_layer_table(whole: MoECost, problem: PlanningProblem, config: PipelineConfig,
                    index: int) -> LayerTable:
    """A mixture-of-experts layer's row under expert parallelism (``config.ep > 1``):

    - compute: the layer's own figures (experts included as one process runs them: at
      balanced routing a rank's experts do the FLOPs of its own tokens, whatever ep),
      plus the FLOPs whole experts add where the variant split them over tp, at the
      device's matmul rate; plus two all-to-alls forward (dispatch, combine), two
      backward, and two more in a recomputed forward;
    - memory: the experts' saved activations at the worst routing the plan allows
      (:func:`moe_worst_factor`) instead of the balanced ones, for every microbatch in
      flight;
    - parameters: the layer's other parameters as usual (over dp), the rank's ``1 / ep``
      of the experts over the expert-data-parallel group (:func:`expert_dp_config`):
      their ZeRO sharding, gradient reduction, gather and optimizer step.
    """
    layer = run_layer(problem, index, config.micro_batch_size)
    devices, train = problem.devices, problem.train
    figures = moe_layer_figures(whole, layer, problem, config)
    expert_config = expert_dp_config(config)
    b, scale = config.micro_batch_size, train.measured_scale
    rate = devices.peak_flops * devices.flops_efficiency
    work = layer_work(layer, devices, b, scale)
    comm = tp_comm_seconds(problem, config, layer)
    extra = b * figures.flops_delta / rate
    a2a = 2 * figures.all_to_all_s
    dense, experts = figures.dense_params, figures.expert_params
    zero_dense = _zero_comm_seconds(problem, config, dense)
    zero_experts = _zero_comm_seconds(problem, expert_config, experts)
    own = {phase: _zero_overhead_seconds(problem, config, dense)[phase]
           + _zero_overhead_seconds(problem, expert_config, experts)[phase]
           for phase in ("forward", "backward")}
    forward = sum(work["forward"]) + comm["forward"] + extra + a2a + own["forward"]
    backward = (split_factor(problem, config) * (sum(work["backward"]) + 2 * extra)
                + comm["backward"] + a2a + own["backward"])
    replayed = {m: layer.recompute_flops[m] / layer.fwd_flops if layer.fwd_flops else 0.0
                for m in layer.modes}
    # Selective recompute reruns the attention cores: no expert, no collective.
    recompute = {m: sum(work["recompute"][m]) + (
        comm["forward"] + replayed[m] * extra + a2a if m == "full" else 0.0)
        for m in layer.modes}
    expert_share = dict(layer.moe.expert_saved_bytes) if layer.moe is not None else {
        m: v / config.tp for m, v in whole.expert_saved_bytes.items()}
    saved = {m: int(round(b * scale * (v - expert_share.get(m, 0.0)
                                       + figures.expert_saved[m])))
             for m, v in layer.saved_bytes.items()}
    # In mixed precision the compute-dtype weights are state, made once per step
    # (_state_bytes), not copies kept per microbatch.
    workspace = int(round(2 * b * scale * layer.workspace_bytes))
    gathered_d, gradient_d = _zero_transient(problem, config, dense)
    gathered_e, gradient_e = _zero_transient(problem, expert_config, experts)
    gathered, gradient = gathered_d + gathered_e, gradient_d + gradient_e
    state_d = _state_bytes(problem, config, dense)
    state_e = _state_bytes(problem, expert_config, experts)
    return LayerTable(
        forward_ps=to_ps(overlapped(forward, zero_dense["forward"] + zero_experts["forward"],
                                    problem.devices.comm_overlap)),
        backward_ps=to_ps(overlapped(backward,
                                     zero_dense["backward"] + zero_experts["backward"],
                                     problem.devices.comm_overlap)),
        recompute_ps={m: to_ps(v) for m, v in recompute.items()},
        saved_bytes=saved,
        transient_bytes={m: gathered + max(saved["none"] - saved[m] + workspace,
                                           gradient - saved[m]) for m in layer.modes},
        param_count=dense + experts,
        state_bytes={k: state_d[k] + state_e[k] for k in state_d},
        tail_ps=_tail_ps(problem, config, dense, max(1, layer.param_tensors))
        + _tail_ps(problem, expert_config, experts),
        sync_ps=_sync_ps(problem, config, dense) + _sync_ps(problem, expert_config, experts),
        gather_ps=_gather_ps(problem, config, dense)
        + _gather_ps(problem, expert_config, experts),
        # The experts as one grouped tensor, the rank's share of them.
        step_bytes=step_total((step_bytes(problem, config, dense, layer.largest_param),
                               step_bytes(problem, expert_config, experts, experts)),
                              steps_whole_list(problem, config)),
    )


def moe_rows(whole: PlanningProblem, problem: PlanningProblem, config: PipelineConfig,
             rows: tuple[LayerTable, ...], cache: "TableCache") -> tuple[LayerTable, ...]:
    """``rows`` with each mixture-of-experts layer's row priced under the configuration's
    expert parallelism (:func:`moe_layer_table`); ``rows`` themselves when ``ep`` is 1 or
    the model has no such layer. ``whole`` is the problem before its tensor-parallel
    variant (the experts' whole figures); equal layers share one row, and the tuple is
    kept in ``cache`` (the planner's bounds key rows by identity)."""
    if config.ep == 1 or not any(layer.moe for layer in whole.layers):
        return rows
    key = ("moe rows", config.micro_batch_size, config.dp, config.tp,
           config.sequence_parallel, config.tp_objective, config.zero_stage, config.ep,
           config.reduces_once, schedule_info(config.schedule).split_backward,
           id(problem.model))
    known = cache._tables.get(key)
    if known is not None and known[0] is problem.model:
        return known[1]
    built: dict[tuple, LayerTable] = {}
    result = []
    for index, row in enumerate(rows):
        moe = whole.layers[index].moe
        if moe is None:
            result.append(row)
            continue
        same = (id(row), _moe_key(moe), _moe_key(problem.layers[index].moe))
        if same not in built:
            built[same] = moe_layer_table(moe, problem, config, index)
        result.append(built[same])
    cache._tables[key] = (problem.model, tuple(result))
    return cache._tables[key][1]


def _moe_key(moe: MoECost | None) -> tuple | None:
    """Every field of a MoECost (its dict of saved bytes as sorted items)."""
    if moe is None:
        return None
    return (moe.num_experts, moe.top_k, moe.hidden, moe.tokens_per_sample,
            moe.expert_param_count, moe.expert_param_bytes, moe.expert_fwd_flops,
            tuple(sorted(moe.expert_saved_bytes.items())), moe.dispatch_bytes,
            moe.capacity_factor, moe.aux_loss, moe.expert_form)
