"""Building one rank's program: checking the launch, then its stages, ready to train.

``program.build()`` (under torchrun) calls :func:`connect`, which checks the launch
against the plan and joins the process group, lowers this rank's stage — or its virtual
stages, when the schedule places several on a rank (:mod:`.pipeline_schedule`) — (the
runtime gets each ready-made, a :class:`partc.runtime.StageProgram`), then :func:`build`,
which keeps this rank's parameters only, shards them as the plan says, wraps each stage
for ``torch.distributed.pipelining`` under the planned schedule and returns a
:class:`partc.runtime.DistributedModule` over the :class:`.RankParts` it made.

Under ZeRO 0/1 the rank's gradients go to fp32 buckets (``partc/runtime/optimizer.py``)
when there is anything to reduce or widen: dp > 1, mixed precision, or routed experts
folded over fewer ranks than dp x tp. Under ZeRO-2/3 the stages are FSDP2 units
(:mod:`.fsdp_shard`). In a pipeline, torch's schedules defer FSDP's gradient
reduce-scatter to the last microbatch, accumulating whole gradients in between, which
would hold as much as no ZeRO at all; here every microbatch's backward reduce-scatters
into the sharded gradients instead (ZeRO-2 and 3 alike, as ZeRO does under gradient
accumulation), ZeRO-2 keeps the gathered parameters for the whole step and ZeRO-3 frees
each unit after its forward and after its backward, gathering it again for the next
microbatch. A ZeRO-2 plan may choose the other way (``plan.zero2_grad_sync == "step"``,
:attr:`Plan.reduces_once`): the microbatches accumulate whole fp32 gradients and the
stage's last backward reduce-scatters them, one reduce-scatter per step for a whole
gradient held through it.
"""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from partc.errors import ContextParallelError, PartcError, PlanMismatchError
from partc.identity import model_hash
from partc.plan import Plan
from partc.runtime import cp_group as cp_ops
from partc.runtime import experts
from partc.runtime import tp as tp_ops
from partc.runtime.compiled import compile_stage
from partc.runtime.fsdp_shard import shard_over_dp
from partc.runtime.label_weights import CountWeights, own_loss_refusal, splits_over_sequence
from partc.runtime.module import DistributedModule
from partc.runtime.offload import HostTier
from partc.runtime.optimizer import GradBuckets, wait_in_forward
from partc.runtime.parameters import (aliases_of, own_parameters, shard_plan,
                                      unread_parameters, unread_tensors, unread_warning)
from partc.runtime.pipeline_schedule import (RankStages, make_schedule, runtime_refusal,
                                             share_local_ties, tied_elsewhere, tied_groups)
from partc.runtime.pipeline_stage import CountingStage, contiguous_transfers, not_a_view
from partc.runtime.precision import ComputeCopies, compute_dtype
from partc.runtime.rank_parts import RankParts
from partc.runtime.recompute import checkpoint_layer
from partc.runtime.stage import StageProgram
from partc.runtime.telemetry import resident_bytes
from partc.runtime.topology import Topology, init
from partc.runtime.watchdog import start as start_watchdog

log = logging.getLogger("partc.runtime")


class PlannedLoss:
    """The user's loss on the last stage's outputs, recomputed if the plan says so; in
    fp32 under mixed precision (the outputs come in the compute dtype). ``weights``
    (a loss_fn's mean over its target's entries not -100, ``plan.model.counted_target``;
    set each step): what each microbatch's loss is multiplied by
    (:class:`partc.runtime.label_weights.CountWeights`)."""

    def __init__(self, loss_call: nn.Module, mode: str, mixed: bool = False) -> None:
        self.loss_call = loss_call
        self.mode = mode
        self.mixed = mixed
        self.weights: CountWeights | None = None

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        leaves = tuple(output) if isinstance(output, (tuple, list)) else (output,)
        if self.mode == "none":
            loss = self._widened(*leaves, target)
        else:
            # The fp32 copies are made inside the checkpoint, so that it keeps the
            # outputs as they came (the schedule holds them until this backward anyway)
            # and not copies twice their size (the estimate's "full" keeps the loss's
            # inputs only).
            loss = checkpoint_layer(self._widened, self.mode, *leaves, target)
        if self.weights is not None:
            loss = loss * self.weights.of(target)
        # A loss that is a view (``losses[0]``, ``loss.view(())``) is detached in place
        # by a split backward, as stage outputs are.
        return not_a_view(loss) if isinstance(loss, torch.Tensor) else loss

    def _widened(self, *args: Any) -> torch.Tensor:
        *leaves, target = args
        if self.mixed:
            leaves = [t.float() if isinstance(t, torch.Tensor) and t.is_floating_point()
                      else t for t in leaves]
        return self.loss_call(*leaves, target)


def connect(plan: Plan, model: nn.Module, loss_fn: Callable | None, *,
            device: torch.device | str | None = None) -> Topology:
    """Check the launch against ``plan``, join the process group and check that every
    rank has the same plan and model: the first step of ``Program.build``."""
    if not plan.model.inputs:
        raise PartcError("the plan records no input shapes; compile it again with this "
                         "version of partc")
    if loss_fn is None and plan.model.own_loss is None:
        raise PartcError("training needs a loss: pass loss_fn to partc.compile/partc.load "
                         "(or, for a model that returns its own loss, labels among the "
                         "example inputs)")
    if plan.cp > 1 and plan.mesh.ep > 1:
        raise ContextParallelError("context parallelism beside expert parallelism is not "
                                   "supported yet: plan cp=1 or ep=1")
    if plan.cp > 1 and not splits_over_sequence(plan.model.own_loss,
                                                [s.name for s in plan.model.inputs]):
        raise ContextParallelError(f"context parallelism splits each sequence over its cp "
                                   f"ranks, and {own_loss_refusal(plan.model.own_loss)}")
    why = runtime_refusal(plan)
    if why is not None:
        raise PartcError(f"this plan cannot run: {why}")
    own_hash = model_hash(model)
    if own_hash != plan.model.hash:
        raise PlanMismatchError(f"the model (hash {own_hash}) is not the one the plan was "
                                f"made for (hash {plan.model.hash})")
    topology = init(plan, device)
    _check_same_plan(plan, own_hash)
    return topology


def build(plan: Plan, topology: Topology,
          programs: StageProgram | Sequence[StageProgram], model: nn.Module, *,
          state_dict: Mapping[str, torch.Tensor] | None = None) -> DistributedModule:
    """This rank's :class:`DistributedModule`: ``programs`` (this rank's virtual stages,
    lowered by ``partc.Program``: one, or the ``plan.chunks`` that
    ``partc.cost.schedules.stages_of_rank`` places on it) with this rank's parameters, each
    wrapped as a pipeline stage, and the planned schedule over them. Parameters are
    copied from ``model`` or, for a model on the meta device, from ``state_dict``.

    A weight that two virtual stages of this rank hold (a tied embedding and head under
    "v" placement) is one parameter of both, its gradient summed by autograd; one that
    stages of several ranks hold is summed over those ranks after the schedule."""
    baseline = resident_bytes()  # before this rank's parameters: telemetry's memory zero
    programs = [programs] if isinstance(programs, StageProgram) else list(programs)
    modules = [program.module for program in programs]
    dtype = compute_dtype(plan)
    # The stages' collectives run over this rank's tp group, in place of the lowering's
    # stand-in.
    tp_group = tp_ops.TensorParallelGroup(topology.tp, _tp_process_group(topology),
                                          overlap=plan.train.tp_overlap)
    expert_params = _own_parameters(modules, model, state_dict, plan, topology, tp_group)
    aliases = aliases_of(model)
    shared = share_local_ties(modules, aliases)
    _check_shared_ties(shared, plan, programs, topology)
    _prepare_modules(modules, programs, plan, topology, dtype)
    if plan.effective_zero_stage >= 2:  # FSDP made new (DTensor) parameters of the experts'
        expert_params = [p for module in modules for p in experts.expert_weights(module)]
    whole = modules[0] if len(modules) == 1 else RankStages(modules)
    holders = programs[0].holders
    unread = unread_parameters(model, holders)
    if unread and topology.rank == 0:
        log.warning(unread_warning(model, unread))
    kept = unread_tensors(model, unread, state_dict) if topology.pp_rank == 0 else {}
    tied = tied_groups(holders, whole, topology, plan)  # every rank makes every group
    scaled_once = frozenset(shared.values())
    loss = _planned_loss(programs[0], tp_group, dtype)
    host = HostTier(topology.device.type) if plan.offload_optimizer else None
    buckets = _grad_buckets(plan, topology, whole, dtype, scaled_once, expert_params, host)
    if buckets is not None and buckets.sharded and plan.train.overlap_param_gather:
        # ZeRO-1's all-gather of the stepped parameters runs beside the next forward:
        # each layer (a unit lowering made) waits for its buckets before it runs.
        for module, program in zip(modules, programs):
            wait_in_forward(buckets, module, program.fsdp_units)
    copies = ComputeCopies(modules, dtype, buckets) if dtype != torch.float32 else None
    watchdog = start_watchdog(topology.rank, topology.world_size)
    stages = [_pipeline_stage(module, program, plan, topology, buckets=buckets,
                              copies=copies, watchdog=watchdog, scaled_once=scaled_once)
              for module, program in zip(modules, programs)]
    schedule = make_schedule(plan, stages, loss)
    log.info("rank %d: virtual stage(s) %s of %d (%s), %d parameters", topology.rank,
             [p.index for p in programs], programs[0].num_stages,
             " | ".join(", ".join(p.layers) for p in programs),
             sum(p.numel() for p in whole.parameters()))
    model_state = model.state_dict(keep_vars=True)
    return DistributedModule(RankParts(
        plan=plan, topology=topology, module=whole, stages=tuple(stages), schedule=schedule,
        tp=tp_group, buckets=buckets, copies=copies,
        tied=tuple((tuple(params), group) for params, group in tied),
        partial_grads=_partial_grads(plan, whole, aliases),
        shared=tuple(p for p in whole.parameters() if id(p) in scaled_once),
        expert_params=tuple(expert_params) if topology.ep > 1 else (),
        aliases=MappingProxyType(dict(aliases)), state_keys=frozenset(model_state),
        tied_elsewhere=frozenset(tied_elsewhere(holders, whole, plan, topology.pp_rank)),
        model_tensors=MappingProxyType({name: (tuple(t.shape), t.dtype)
                                        for name, t in model_state.items()}),
        watchdog=watchdog, memory_baseline=baseline, host=host,
        unread=MappingProxyType(kept), loss=loss))


def _tp_process_group(topology: Topology) -> dist.ProcessGroup | None:
    return topology.tp_group if topology.tp > 1 else None


def _own_parameters(modules: list[nn.Module], model: nn.Module,
                    state_dict: Mapping[str, torch.Tensor] | None, plan: Plan,
                    topology: Topology, tp_group: tp_ops.TensorParallelGroup
                    ) -> list[nn.Parameter]:
    """Bind the stages to the tp group and give them this rank's parameters (its
    tensor-parallel shards); returns its slices of routed expert weights."""
    shard = shard_plan(plan, topology)
    cp_group = cp_ops.ContextParallelGroup(topology.cp, str(plan.cp_kind or cp_ops.RING),
                                           topology.cp_group) if topology.cp > 1 else None
    for module in modules:
        tp_ops.bind_group(module, tp_group)
        if cp_group is not None:
            cp_ops.bind_group(module, cp_group)
        own_parameters(module, model, state_dict, topology.device, shard)
    return [param for module in modules for param in experts.shard_experts(
        module, topology.ep_group, topology.ep, topology.ep_rank,
        _tp_process_group(topology), topology.tp, topology.tp_rank)]


def _check_shared_ties(shared: Mapping[str, int], plan: Plan,
                       programs: list[StageProgram], topology: Topology) -> None:
    zero_stage = plan.effective_zero_stage
    if shared and zero_stage >= 2:
        raise PartcError(
            f"virtual stages {[p.index for p in programs]} of pipeline rank "
            f"{topology.pp_rank} both hold {sorted(shared)[:3]} (tied weights; "
            f"{plan.schedule} places them on one rank): FSDP (ZeRO-{zero_stage}) cannot "
            "shard one parameter in two units; plan ZeRO-0/1, or a schedule that places "
            "those stages on different ranks")


def _prepare_modules(modules: list[nn.Module], programs: list[StageProgram], plan: Plan,
                     topology: Topology, dtype: torch.dtype) -> None:
    """Each stage's module as the plan runs it: FSDP units (ZeRO-2/3), autocast (mixed
    precision in ``dtype``), compiled (``TrainSpec.compile``)."""
    zero_stage = plan.effective_zero_stage
    for module, program in zip(modules, programs):
        if zero_stage >= 2:
            # The last stage's backward of a microbatch follows its forward under
            # one microbatch or 1F1B (one virtual stage per rank; with fewer
            # microbatches than stages 1F1B runs as GPipe, see make_schedule).
            follows = program.is_last and len(programs) == 1 and (
                plan.num_microbatches == 1
                or (plan.schedule == "1f1b" and plan.num_microbatches >= plan.pp))
            shard_over_dp(module, program.fsdp_units, topology, zero_stage, dtype,
                          backward_follows=follows, offload_params=plan.offload_params)
        if dtype != torch.float32:
            # Mixed precision: the fp32 parameters are the master weights; the stage
            # computes with compute-dtype copies of them, cast once per step (ZeRO 0/1:
            # ComputeCopies; ZeRO-2/3: FSDP's MixedPrecisionPolicy), gradients
            # accumulated and reduced fp32. Autocast keeps the ops that must stay fp32
            # (softmax, norms) in fp32 and casts activations a traced graph pins to fp32
            # (exported graphs fix dtypes).
            module.forward = torch.autocast(topology.device.type, dtype=dtype)(
                module.forward)
        if plan.train.compile:
            # Under ZeRO-2/3 each unit, FSDP's gather and free hooks left eager
            # around its compiled forward (as torchtitan compiles each block).
            compile_stage(module, plan, topology.device, program.fsdp_units)


def _grad_buckets(plan: Plan, topology: Topology, whole: nn.Module, dtype: torch.dtype,
                  scaled_once: frozenset[int], expert_params: list[nn.Parameter],
                  host: HostTier | None) -> GradBuckets | None:
    """ZeRO 0/1's fp32 gradient buckets for the rank, or None where there is nothing to
    reduce or widen (the module's doc). With optimizer offload and one replica they live
    on the host (``host``): every gradient is streamed out as backward makes it
    (``partc.cost.host_offload.streams_gradients``)."""
    on_host = host if plan.offload_optimizer and not plan.offload_params \
        and topology.grad_replicas == 1 else None
    if plan.effective_zero_stage >= 2 or not (
            topology.grad_replicas > 1 or dtype != torch.float32 or on_host is not None
            or topology.dp * topology.tp > topology.ep > 1):
        return None
    # Routed experts' gradients are summed over the ranks holding the same experts.
    expert_groups = ({id(p): topology.expert_dp_group for p in expert_params}
                     if topology.ep > 1 else {})
    # One set of buckets for the rank: a weight two of its stages share is summed over
    # both before it is reduced (after the schedule, by ``finish``); a split backward's
    # weight gradients (made outside autograd's accumulation hooks) are handed over by
    # each weight pass (``GradBuckets.take``), so the last one's reductions overlap the
    # rank's later backwards as a full backward's do.
    # Over dp x cp: the cp ranks hold the same parameters and see other tokens.
    return GradBuckets(whole, topology.grad_group, topology.grad_replicas, topology.grad_rank,
                       sharded=plan.effective_zero_stage == 1, at_end=set(scaled_once),
                       groups=expert_groups, elements=plan.train.bucket_elements,
                       host=on_host)


def _pipeline_stage(module: nn.Module, program: StageProgram, plan: Plan,
                    topology: Topology, *, buckets: GradBuckets | None,
                    copies: ComputeCopies | None, watchdog: Any,
                    scaled_once: frozenset[int]) -> CountingStage:
    """One virtual stage wrapped for the schedule. A weight two stages share is scaled
    once, after the schedule: either stage's last backward may come last."""
    contiguous_transfers(module, first=program.is_first, last=program.is_last)
    return CountingStage(module, program.index, program.num_stages, topology.device,
                         group=topology.pp_group, zero_stage=plan.effective_zero_stage,
                         reduce_once=plan.reduces_once, grad_sync=buckets,
                         compute_copies=copies, watchdog=watchdog,
                         scaled_elsewhere=scaled_once)


def _planned_loss(program: StageProgram, tp_group: tp_ops.TensorParallelGroup,
                  dtype: torch.dtype) -> PlannedLoss:
    if program.loss is not None:   # a vocab-parallel loss meets the other tp ranks
        tp_ops.bind_group(program.loss, tp_group)
    return PlannedLoss(program.loss, program.loss_recompute, mixed=dtype != torch.float32)


def _partial_grads(plan: Plan, whole: nn.Module, aliases: Mapping[str, tuple[str, ...]]
                   ) -> tuple[nn.Parameter, ...]:
    """Replicated parameters that feed only sharded ops: a partial gradient on each
    tensor-parallel rank (``plan.tensor_parallel.partial_grad_params``)."""
    names = set(plan.tensor_parallel.partial_grad_params
                if plan.tensor_parallel is not None else ())
    return tuple(p for name, p in whole.named_parameters()
                 if names & set(aliases.get(name, (name,))))


def _check_same_plan(plan: Plan, own_hash: str) -> None:
    """Every rank must run the same plan on the same model: compare before anything else."""
    mine = (plan.hash, own_hash)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    differing = [rank for rank, theirs in enumerate(everyone) if tuple(theirs) != mine]
    if differing:
        raise PlanMismatchError(
            f"ranks disagree on the plan or the model: rank {dist.get_rank()} has plan "
            f"{mine[0]} and model {mine[1]}, ranks {differing} have "
            f"{sorted({tuple(everyone[r]) for r in differing})}; give every rank the same "
            "plan.json (partc.load) or the same model and compile arguments")
