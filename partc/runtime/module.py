"""The program one rank runs: its stage, the planned schedule, and gradient sync.

``program.build()`` (under torchrun) calls :func:`connect`, which checks the launch
against the plan and joins the process group, lowers this rank's stage — or its virtual
stages, when the schedule places several on a rank (:mod:`.pipeline`) — (the runtime
gets each ready-made, a :class:`partc.runtime.StageProgram`), then :func:`build`, which
keeps this rank's parameters only, wraps each stage for ``torch.distributed.pipelining``
under the planned schedule and returns a :class:`DistributedModule`. Its
``forward_backward`` runs one optimizer step's worth of forward and backward over all
microbatches of the global batch, then:

1. sums the gradients of parameters that several stages hold (tied weights);
2. has averaged gradients over data-parallel replicas (routed experts' summed over their
   expert-data-parallel group, divided by dp alike): under ZeRO 0/1 gradients are
   accumulated in fp32 buckets, each all-reduced (ZeRO-0) or reduce-scattered (ZeRO-1)
   as soon as the last microbatch's backward has filled it
   (``partc/runtime/optimizer.py``); under ZeRO-2/3 FSDP2 reduce-scatters them, each
   replica keeping the mean gradient of its shard;
3. returns the mean loss of the global batch, the same on every rank.

ZeRO-2/3 (``plan.effective_zero_stage >= 2``): each layer that owns its parameters
is an FSDP2 unit (lowering made it a module of its own) and the stage the root unit, sharded over
the dp group; under expert parallelism each layer's routed experts are a unit of their
own, sharded over the expert-data-parallel group (the ranks holding the same experts).
In a pipeline, torch's schedules defer FSDP's gradient reduce-scatter to
the last microbatch, accumulating whole gradients in between, which would hold as much
as no ZeRO at all; here every microbatch's backward reduce-scatters into the sharded
gradients instead (ZeRO-2 and 3 alike, as ZeRO does under gradient accumulation), ZeRO-2
keeps the gathered parameters for the whole step and ZeRO-3 frees each unit after its
forward and after its backward, gathering it again for the next microbatch. A ZeRO-2 plan
may choose the other way (``plan.zero2_grad_sync == "step"``, :attr:`Plan.reduces_once`):
the microbatches accumulate whole fp32 gradients and the stage's last backward
reduce-scatters them, one reduce-scatter per step for a whole gradient held through it.

Gradients are those of the mean loss over the whole global batch, as on one device, so
any ``torch.optim`` optimizer over ``module.parameters()`` trains the same model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import DTensor

from partc.errors import PartcError, PlanMismatchError
from partc.identity import model_hash
from partc.placement import Placement
from partc.plan import InputSpec, Plan
from partc.problem import SMALL_UNITS_SHARE
from partc.cost.schedules import schedule as schedule_facts

from partc.runtime import experts
from partc.runtime import tp as tp_ops
from partc.runtime.compiled import compile_stage
from partc.runtime.data import DataSampler
from partc.runtime.recompute import checkpoint_layer
from partc.runtime.parameters import (aliases_of, dp_shard, local_part, own_parameters,
                         shard_plan)
from partc.runtime.optimizer import DistributedOptimizer, GradBuckets, wait_in_forward
from partc.runtime.pipeline_schedule import (RankStages, make_schedule, runtime_refusal, share_local_ties,
                       tied_elsewhere, tied_groups)
from partc.runtime.pipeline_stage import CountingStage, contiguous_transfers
from partc.runtime.precision import ComputeCopies
from partc.runtime.stage import StageProgram
from partc.runtime.suspend import StopFlag
from partc.runtime.telemetry import StepRecord, Telemetry, resident_bytes
from partc.runtime.topology import Topology, init
from partc.runtime.watchdog import IDLE, Watchdog
from partc.runtime.watchdog import start as start_watchdog

# Newer torch schedules can drop the last stage's outputs instead of returning them.
_STEP_TAKES_RETURN_OUTPUTS = "return_outputs" in inspect.signature(
    PipelineScheduleSingle.step).parameters

log = logging.getLogger("partc.runtime")


class _Loss:
    """The user's loss on the last stage's outputs, recomputed if the plan says so; in
    fp32 under mixed precision (the outputs come in the compute dtype)."""

    def __init__(self, loss_call: nn.Module, mode: str, mixed: bool = False) -> None:
        self.loss_call = loss_call
        self.mode = mode
        self.mixed = mixed

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        leaves = tuple(output) if isinstance(output, (tuple, list)) else (output,)
        if self.mode == "none":
            return self._widened(*leaves, target)
        # The fp32 copies are made inside the checkpoint, so that it keeps the outputs
        # as they came (the schedule holds them until this backward anyway) and not
        # copies twice their size (the estimate's "full" keeps the loss's inputs only).
        return checkpoint_layer(self._widened, self.mode, *leaves, target)

    def _widened(self, *args: Any) -> torch.Tensor:
        *leaves, target = args
        if self.mixed:
            leaves = [t.float() if isinstance(t, torch.Tensor) and t.is_floating_point()
                      else t for t in leaves]
        return self.loss_call(*leaves, target)


class DistributedModule:
    """This rank's part of the program: parameters, and one training step's fwd + bwd.

    With more than one rank, ``watchdog`` (``partc/runtime/watchdog.py``) is this rank's
    watchdog: ``forward_backward`` (and the optimizer ``optimizer()`` makes) tell it the
    step (``self.step``, the ``forward_backward`` calls so far) and phase; a rank that
    stops or stays in one phase for ``PARTC_WATCHDOG_S`` s (default 60) is reported on
    every other rank, which exit with ``watchdog.EXIT_CODE``. ``close()`` stops it.
    """

    def __init__(self, *, plan: Plan, topology: Topology, stages: list[Any],
                 module: nn.Module, schedule: Any, tied: list[tuple[list[nn.Parameter], dist.ProcessGroup]],
                 inputs: list[dict], global_batch_size: int,
                 partial_grads: list[nn.Parameter] | None = None,
                 shared: list[nn.Parameter] | None = None,
                 aliases: dict[str, tuple[str, ...]] | None = None,
                 state_keys: set[str] | None = None,
                 tied_elsewhere: set[str] | None = None,
                 tp: tp_ops.TensorParallelGroup | None = None,
                 watchdog: Watchdog | None = None,
                 model_tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
                 ) -> None:
        self.plan = plan
        # The whole model's state_dict() entries (shape, dtype): what a checkpoint holds.
        self._model_tensors = model_tensors or {}
        self._checkpoint_pending: Any = None  # an asynchronous save under way
        self._checkpoint_group: dist.ProcessGroup | None = None  # its gloo group
        # Progress (step, phase) for the watchdog; None when it is off (one process).
        self.watchdog = watchdog
        self.step = 0  # forward_backward calls so far
        for stage in stages:
            stage.watchdog = watchdog
        if watchdog is not None:
            weakref.finalize(self, watchdog.stop)  # also at interpreter exit
        # The tensor-parallel group the stage's collectives run over; its ``counts`` are
        # the collectives this rank has run.
        self.tp = tp if tp is not None else tp_ops.TensorParallelGroup(1)
        self._aliases = aliases or {}
        # Tied weights whose first holder is an earlier stage: counted there in norms.
        self._tied_elsewhere = tied_elsewhere or set()
        self.last_grad_norm: torch.Tensor | None = None
        self._state_keys = state_keys  # model.state_dict()'s: no non-persistent buffers
        self.topology = topology
        # ZeRO 0/1 (dp > 1, or mixed precision): the rank's gradients in fp32 buckets
        # (partc/runtime/optimizer.py), one set over all its virtual stages.
        self._buckets: GradBuckets | None = next(
            (s.grad_sync for s in stages if s.grad_sync is not None), None)
        # Mixed precision under ZeRO 0/1: compute-dtype parameters made once per step.
        self._copies: ComputeCopies | None = next(
            (s.compute_copies for s in stages if s.compute_copies is not None), None)
        # ZeRO-1/2/3: each rank keeps (reduced) gradients of its dp shard of every
        # parameter only: FSDP's under ZeRO-2/3, the buckets' under ZeRO-1.
        self._sharded_grads = any(isinstance(s.submod, FSDPModule) for s in stages) or (
            self._buckets is not None and self._buckets.sharded)
        # The plan's stage this rank runs (its pipeline rank), and the virtual stages
        # (runs of layers, ``plan.runs``) it holds: one, or ``plan.chunks``.
        self.stage_index = topology.pp_rank
        self.virtual_stages = tuple(s.stage_index for s in stages)
        # The rank's stages' modules: the stage's own GraphModule, or with several
        # virtual stages a :class:`RankStages` of them.
        self.module = module
        self._stages = stages
        self._schedule = schedule
        self._tied = tied
        self._partial_grads = partial_grads or []
        # Weights two of this rank's virtual stages hold: their stages leave them
        # unscaled; _sync_gradients divides them by the microbatches.
        self._shared = shared or []
        self._inputs = [spec for spec in inputs if spec.name != "target"]
        self._target = next((spec for spec in inputs if spec.name == "target"), None)
        self.global_batch_size = global_batch_size
        self.last_messages: dict[str, int] = {"sends": 0, "recvs": 0}
        self._telemetry: Telemetry | None = None  # see telemetry()
        self.memory_baseline = 0  # host RSS before build copied parameters (telemetry)
        # This rank's slices of routed expert weights (expert parallelism; build sets it).
        self.expert_params: list[nn.Parameter] = []
        self._stop = StopFlag()  # stop_requested()'s: set by a stop signal

    # -- parameters, as torch.optim and checkpointing expect them -----------------------

    # Under ZeRO-1 the optimizer step leaves the all-gather of the updated parameters in
    # flight for the next forward (TrainSpec.overlap_param_gather): what hands out or
    # reads parameters outside forward finishes it first (wait_param_gathers).

    def parameters(self) -> Iterator[nn.Parameter]:
        self.wait_param_gathers()
        return self.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        self.wait_param_gathers()
        return self.module.named_parameters()

    def wait_param_gathers(self) -> None:
        """Finish ZeRO-1's all-gathers of the stepped parameters still in flight (the
        forward pre-hooks of :func:`partc.runtime.optimizer.wait_in_forward` finish
        them bucket by bucket otherwise); nothing when none is."""
        if self._buckets is not None:
            self._buckets.wait_gathers()

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the model's own FQNs: its stage's
        tensors, and of a tensor-parallel parameter only this rank's shard. (Under ZeRO-1
        in mixed precision the parameters are the compute-dtype ones the stage computes
        with; :meth:`full_state_dict` and checkpoints hold the fp32 masters.)"""
        return {**dict(self.named_parameters()), **dict(self.named_buffers())}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers, whole, on every rank (CPU copies),
        under every FQN ``model.state_dict()`` uses (tied weights under each name).

        Collective: every rank must call it. Shards are gathered over the tensor-parallel
        group, routed experts over the expert-parallel group, and stages over the pipeline
        (as Python objects: meant for exporting and checking models that fit one host's
        memory).
        """
        whole: dict[str, torch.Tensor] = {}
        group = self.topology.tp_group if self.topology.tp > 1 else None
        experts = {id(p) for p in self.expert_params}
        for name, tensor in self.state_dict().items():
            placement = self._placement(name)
            value = tensor.detach()
            if self.master_of(tensor) is not None:   # fp32, from the dp ranks' masters
                value = self._buckets.full_master(tensor)
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if id(tensor) in experts:   # this rank's block of experts: dim 0
                parts = [torch.empty_like(value) for _ in range(self.topology.ep)]
                dist.all_gather(parts, value.contiguous(), group=self.topology.ep_group)
                value = torch.cat(parts)
            if group is not None and placement.kind == "S":
                parts = [torch.empty_like(value) for _ in range(self.topology.tp)]
                dist.all_gather(parts, value.contiguous(), group=group)
                value = tp_ops.whole_of(parts, placement.dim, placement.chunks)
            whole[name] = value.cpu().clone()
        if self.topology.pp > 1:
            stages: list[Any] = [None] * self.topology.pp
            dist.all_gather_object(stages, whole, group=self.topology.pp_group)
            whole = {name: t for stage in stages for name, t in stage.items()}
        return {alias: tensor for name, tensor in whole.items()
                for alias in self._aliases.get(name, (name,))
                if self._state_keys is None or alias in self._state_keys}

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load this rank's tensors from ``state_dict``: its own (``state_dict()``) or the
        whole model's (``full_state_dict()``, ``model.state_dict()``), sliced to shards."""
        # A non-persistent buffer (not in model.state_dict()) may be absent: it is kept.
        own = self.state_dict()
        sources = {name: self._entry(state_dict, name) for name in own}
        missing = [name for name, source in sources.items() if source is None and (
            self._state_keys is None or name in self._state_keys)]
        if missing:
            raise KeyError(f"state dict lacks {len(missing)} of this rank's tensors, "
                           f"e.g. {missing[:3]}")
        experts = {id(p) for p in self.expert_params}
        with torch.no_grad():
            for name, source in sources.items():
                if source is None:
                    continue
                tensor = own[name]
                placement = self._placement(name)
                if isinstance(source, DTensor):  # this rank's own state_dict(), ZeRO-2/3
                    local_part(tensor).copy_(source.to_local())
                    continue
                if id(tensor) in experts and source.shape[0] != tensor.shape[0]:
                    rows = tensor.shape[0]   # the whole weight: this rank's experts
                    source = source[self.topology.ep_rank * rows:
                                    (self.topology.ep_rank + 1) * rows]
                if source.shape != tensor.shape and placement.kind == "S":
                    source = tp_ops.shard_of(source, placement.dim, placement.chunks,
                                             self.topology.tp_rank, self.topology.tp)
                if source.shape != tensor.shape:
                    raise ValueError(f"{name}: state dict has shape {list(source.shape)}, "
                                     f"this rank holds {list(tensor.shape)} ({placement})")
                if isinstance(tensor, DTensor):  # whole over its mesh: this rank's shard
                    mesh = tensor.device_mesh
                    source = dp_shard(source, mesh.size(), mesh.get_local_rank())
                if self.master_of(tensor) is not None:
                    self._buckets.load_whole(tensor, source)
                    continue
                local_part(tensor).copy_(source)

    def master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """ZeRO-1 in mixed precision, once :meth:`optimizer` made it: this rank's fp32
        master of its dp shard of ``param`` (the parameter itself is then kept in the
        compute dtype). None otherwise: the parameter is its own master."""
        return None if self._buckets is None else self._buckets.master_of(param)

    def refresh_from_masters(self) -> None:
        """The parameters again from the masters (after a checkpoint loaded into them).
        Collective over the dp group; nothing without masters."""
        if self._buckets is not None and self._buckets.has_masters:
            self._buckets.gather_params()

    def _placement(self, name: str) -> Placement:
        return self.plan.placement(self._aliases.get(name, (name,)))

    def _entry(self, state_dict: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
        """``state_dict``'s tensor for ``name`` under any of its FQNs, or None."""
        return next((state_dict[a] for a in self._aliases.get(name, (name,))
                     if a in state_dict), None)

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], **defaults: Any
                  ) -> torch.optim.Optimizer:
        """``optimizer_class(self.parameters(), **defaults)`` as the plan holds its state:
        with ZeRO-1 (``plan.effective_zero_stage == 1``) each data-parallel rank keeps the
        state of its dp shard (rows ``chunk(dp)[rank]`` of each parameter), steps it with
        the reduce-scattered gradients and all-gathers the updated shards, bucket by
        bucket (:class:`partc.runtime.optimizer.DistributedOptimizer`).

        A stage may hold no parameters (the planner may put the loss alone on the last
        stage when that is fastest). torch optimizers refuse an empty parameter list, so
        such a rank gets ``optimizer_class`` over one empty placeholder parameter that
        never has a gradient: ``step`` and ``zero_grad`` do nothing, and learning-rate
        schedulers, ``state_dict`` and the README's loop work unchanged on every rank."""
        self._check_step_temporaries(defaults)
        if not any(True for _ in self.parameters()):
            placeholder = nn.Parameter(torch.empty(0, device=self.topology.device))
            optimizer = optimizer_class([placeholder], **defaults)
        elif self._buckets is not None and self._buckets.sharded:
            optimizer = DistributedOptimizer(
                self._buckets, optimizer_class,
                compute_dtype=self._copies.dtype if self._copies is not None else None,
                **defaults)
        else:
            optimizer = optimizer_class(self.parameters(), **defaults)
        if self.watchdog is not None:
            watchdog = self.watchdog
            optimizer.register_step_pre_hook(lambda *_: watchdog.mark("optimizer step"))
            optimizer.register_step_post_hook(lambda *_: watchdog.mark(IDLE))
        this = weakref.ref(self)  # the optimizer must not keep the module alive

        def end_step(*_: Any) -> None:  # the step's telemetry includes the optimizer's
            module = this()
            if module is not None:
                module.end_step()

        optimizer.register_step_post_hook(end_step)
        return optimizer

    def _check_step_temporaries(self, defaults: Mapping[str, Any]) -> None:
        """Warn where ``foreach=True`` makes the optimizer step's fp32 temporaries for all
        of the rank's weights at once although the plan priced torch's default for them,
        one tensor at a time (CPU weights; :func:`partc.cost.model.step_bytes`): the step then
        needs more than the plan's peak says. ``fused=True`` and ``foreach=False`` need
        less, and ZeRO-1's sharded step was priced whole."""
        stage = self.plan.stages[self.stage_index]
        precision = self.plan.train.precision
        if not defaults.get("foreach") or not precision.step_copies \
                or self.topology.device.type != "cpu" \
                or (self._buckets is not None and self._buckets.sharded):
            return
        weights = sum(p.numel() for p in self.parameters())
        whole = int(precision.step_copies * precision.master_bytes * weights)
        priced = stage.memory_bytes.step
        if whole > priced:
            log.warning("rank %d: optimizer foreach=True steps all %s weights at once: its "
                        "temporaries take %.1f MiB where the plan priced %.1f MiB (torch's "
                        "default for CPU weights, one tensor at a time); the stage's peak "
                        "may exceed its planned %.1f MiB. Leave foreach to torch, or plan "
                        "with more memory headroom", self.topology.rank, f"{weights:,}",
                        whole / 2**20, priced / 2**20, stage.memory_bytes.peak / 2**20)

    def telemetry(self, *, jsonl_dir: str | None = None, console: bool = True,
                  tensorboard_dir: str | None = None, warn_ratio: float = 0.25,
                  grad_norm: bool = True) -> Telemetry:
        """Report every step from now on against the plan (``partc/runtime/telemetry.py``):
        loss, step time, tokens/s, MFU, peak memory, gradient norm; printed on rank 0,
        appended to ``<jsonl_dir>/rank<k>.jsonl``, written to TensorBoard under
        ``tensorboard_dir``; a warning when time or memory departs from the prediction
        by more than ``warn_ratio``. A step ends with the step of an optimizer from
        :meth:`optimizer`, or :meth:`end_step`. ``grad_norm=False`` skips the norm's
        all-reduce when the plan does not clip. Call it on every rank."""
        if self._telemetry is not None:
            self._telemetry.close()
        topo = self.topology
        self._telemetry = Telemetry(
            self.plan, rank=topo.rank, stage=self.stage_index, device=topo.device,
            leads_stage=topo.dp_rank == 0 and topo.tp_rank == 0,
            memory_baseline=self.memory_baseline, jsonl_dir=jsonl_dir, console=console,
            tensorboard_dir=tensorboard_dir, warn_ratio=warn_ratio, grad_norm=grad_norm)
        return self._telemetry

    def end_step(self, *, optimizer_stepped: bool = True) -> StepRecord | None:
        """End the step under way for telemetry (after an optimizer step that
        :meth:`optimizer` did not make); returns its record, or None without telemetry."""
        if self._telemetry is None:
            return None
        return self._telemetry.end(optimizer_stepped=optimizer_stepped)

    # -- checkpoints (partc/runtime/checkpoint.py) ---------------------------------------

    def save_checkpoint(self, directory: str | Path, *,
                        optimizer: torch.optim.Optimizer | None = None, step: int,
                        extra: dict | None = None, async_save: bool = False,
                        keep: int | None = None) -> Path:
        """Save this rank's parameters, ``optimizer``'s state, RNG states, ``step``,
        ``extra`` (JSON) and the plan under ``directory/step-<step>``, then point
        ``directory/latest`` at it; returns that directory. Collective: every rank calls
        it. ``async_save``: return once this rank's tensors are copied to CPU memory and
        write them in the background (``wait_checkpoint`` finishes it). ``keep``: keep
        only the newest ``keep`` checkpoints. Raises :class:`partc.CheckpointError` on
        every rank if any rank cannot save; earlier checkpoints stay as they were."""
        from partc.runtime import checkpoint
        self.wait_param_gathers()
        return checkpoint.save(self, directory, optimizer=optimizer, step=step, extra=extra,
                               async_save=async_save, keep=keep)

    def load_checkpoint(self, directory: str | Path, *,
                        optimizer: torch.optim.Optimizer | None = None) -> tuple[int, dict]:
        """Load the checkpoint ``directory/latest`` names (or the step directory
        ``directory``) into this module's plan, whatever plan saved it, and ``optimizer``'s
        state; returns ``(step, extra)``. Collective. Raises :class:`partc.CheckpointError`
        on every rank, before any tensor changes, for a partial checkpoint or one of
        another model or shapes."""
        from partc.runtime import checkpoint
        self.wait_param_gathers()  # one finished later would overwrite what is loaded
        return checkpoint.load(self, directory, optimizer=optimizer)

    def wait_checkpoint(self) -> Path | None:
        """Finish the asynchronous save under way, if any (collective); returns its
        directory. Raises :class:`partc.CheckpointError` on every rank if it failed."""
        from partc.runtime import checkpoint
        return checkpoint.wait(self)

    def close(self) -> None:
        """Stop this rank's watchdog thread (also done when the module is freed and at
        exit); the other ranks then stop judging this one. Stop signals get their
        handlers from before ``stop_requested()`` back, and CPU autocast its own rules
        (mixed precision on CPU ranks, ``partc/runtime/precision.py``)."""
        self._stop.uninstall()
        if self._copies is not None:
            self._copies.close()
        if self.watchdog is not None:
            self.watchdog.stop()
        if self._telemetry is not None:
            self._telemetry.close()

    def _mark(self, phase: str, step: int | None = None) -> None:
        if self.watchdog is not None:
            self.watchdog.mark(phase, step)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)
        if self._buckets is not None:
            self._buckets.zero_()

    # -- data and suspend (partc/runtime/data.py, partc/runtime/suspend.py) --------------

    def data_sampler(self, num_samples: int, *, seed: int = 0) -> DataSampler:
        """The sample indices this rank reads each step (``sampler.indices(step)``, step
        0-based), a function of (seed, step, num_samples, global batch) only: a run
        resumed at a checkpoint's step on another dp degree reads the same samples. Pass
        ``forward_backward`` the rows of those indices (this rank's dp slice) or the
        global batch."""
        return DataSampler(num_samples, global_batch_size=self.global_batch_size,
                           dp=self.topology.dp, dp_rank=self.topology.dp_rank, seed=seed)

    def stop_requested(self) -> bool:
        """True on every rank, from the same step on, once a stop signal (SIGTERM,
        SIGUSR1; ``PARTC_STOP_SIGNALS``) reached any rank: then save a checkpoint and
        exit with ``partc.runtime.suspend.SUSPEND_EXIT_CODE``. Collective (one small
        all-reduce): call it once per step on every rank; the first call installs the
        signal handlers."""
        self._stop.install()
        return self._stop.agreed(self.topology.device)

    # -- one step ------------------------------------------------------------------------

    def forward_backward(self, *inputs: torch.Tensor, target: Any = None) -> torch.Tensor:
        """Forward and backward over the whole global batch; returns its mean loss.

        Every rank passes the same global batch (``inputs`` with dim 0 the global batch
        size, and ``target``), each data-parallel replica taking its own rows, or only
        its replica's rows (dim 0 the global batch over dp, e.g. the samples of
        ``data_sampler().indices(step)``); stage 0 reads the inputs and the last stage
        the target. Gradients accumulate into ``.grad`` like ``loss.backward()``: zero
        them between steps.
        """
        self.step += 1
        self._mark("forward_backward", self.step)
        if self._telemetry is not None:
            self._telemetry.begin(self.step)
        try:
            loss = self._forward_backward(inputs, target)
            if self._telemetry is not None:
                norm = self.last_grad_norm if self.plan.train.max_grad_norm is not None else (
                    self.grad_norm() if self._telemetry.grad_norm else None)
                self._telemetry.measured(loss, norm)
            return loss
        finally:
            # Returned or raised, the user's code runs next: not judged by the watchdog.
            self._mark(IDLE)

    def evaluate(self, *inputs: torch.Tensor, target: Any = None) -> torch.Tensor:
        """The mean loss of a global batch, forward only: the same on every rank.

        As ``forward_backward`` takes them (every rank passes the same global batch),
        run through the pipeline's stages without gradients, in eval mode (dropout off,
        normalisation statistics read, not updated), microbatch by microbatch as the plan
        runs them; no parameter or gradient changes. Collective: every rank calls it,
        before training or between steps.
        """
        losses: list[torch.Tensor] = []
        args, kwargs = self._stage_arguments(inputs, target, losses)
        self.wait_param_gathers()  # an evaluation has no step to overlap them with
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                self._schedule.eval(*args, **kwargs)
        finally:
            self.module.train(was_training)
        return self._mean_loss(losses)

    def _stage_arguments(self, inputs: tuple, target: Any,
                         losses: list[torch.Tensor]) -> tuple[tuple, dict[str, Any]]:
        """The schedule's arguments on this rank: its dp replica's rows of the inputs
        (first stage) and of the target (last stage), after checking the batch."""
        topo = self.topology
        share = self.global_batch_size // topo.dp
        given = self._batch_size(inputs, target)  # the global batch, or this replica's rows
        self._check_batch(inputs, target, given)
        rows = slice(None) if given == share else \
            slice(topo.dp_rank * share, (topo.dp_rank + 1) * share)
        args = tuple(t[rows].to(topo.device) for t in inputs) \
            if any(s.is_first for s in self._stages) else ()
        kwargs: dict[str, Any] = {}
        if any(s.is_last for s in self._stages):
            kwargs = {"target": pytree.tree_map_only(
                torch.Tensor, lambda t: t[rows].to(topo.device), target), "losses": losses}
        if _STEP_TAKES_RETURN_OUTPUTS:
            # The outputs are the loss's inputs (the logits): returned, torch keeps every
            # microbatch's until the step ends; partc only needs the losses.
            kwargs["return_outputs"] = False
        return args, kwargs

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The global batch's mean loss from the last stage's microbatch losses, on
        every rank."""
        topo = self.topology
        total = torch.zeros((), device=topo.device)
        if losses:
            total = torch.stack(losses).sum().detach().to(torch.float32)
        dist.all_reduce(total)  # only the last stage's ranks contribute, tp copies alike
        return total / (self.plan.num_microbatches * topo.dp * topo.tp)

    def _forward_backward(self, inputs: tuple, target: Any) -> torch.Tensor:
        for stage in self._stages:
            stage.messages.clear()
        losses: list[torch.Tensor] = []
        args, kwargs = self._stage_arguments(inputs, target, losses)
        self._mark("schedule")
        with self._copies.step() if self._copies is not None else contextlib.nullcontext():
            self._schedule.step(*args, **kwargs)
            if self._buckets is not None:
                # Reduce what the last backward left (split backwards' weight gradients,
                # weights two virtual stages share) while the compute copies still hold
                # their gradients; the mean over dp and the microbatches.
                self._buckets.finish(self.plan.num_microbatches)
        self.last_messages = {kind: sum(s.messages[kind] for s in self._stages)
                              for kind in ("sends", "recvs")}
        self._mark("gradient sync")
        self._sync_gradients()
        max_norm = self.plan.train.max_grad_norm
        if max_norm is not None:
            self._mark("clip")
            self.last_grad_norm = self.clip_grad_norm_(max_norm)
        self._mark("loss all-reduce")
        return self._mean_loss(losses)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every rank's gradients so that the whole model's gradient norm is at
        most ``max_norm``; returns that norm (the same on every rank). Collective.

        As ``torch.nn.utils.clip_grad_norm_`` on one device: each parameter is counted
        once, i.e. a tensor-parallel shard on every rank of its group, a replicated
        tensor on one of them, a tied weight on the first stage holding it, and one
        data-parallel replica.
        """
        total = self.grad_norm(norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in {id(p): p for p in self.module.parameters()}.values():
            grad = self._grad_of(p)
            if grad is not None:
                grad.mul_(coef.to(grad.dtype))
        return total

    def _grad_of(self, param: nn.Parameter) -> torch.Tensor | None:
        """This rank's gradient of ``param``: its ``.grad`` (FSDP's local shard under
        ZeRO-2/3), or under ZeRO-1 the reduced gradient of its dp shard in the buckets."""
        if self._buckets is not None and self._buckets.sharded:
            return self._buckets.grad_of(param)
        return None if param.grad is None else local_part(param.grad)

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The whole model's gradient norm, each parameter counted once as in
        :meth:`clip_grad_norm_` (which scales by it); the same on every rank. Collective."""
        topo = self.topology
        experts = {id(p) for p in self.expert_params}
        grads = [g for name, p in self.module.named_parameters()
                 if id(p) not in experts and (g := self._grad_of(p)) is not None
                 and self._counts_norm(name)
                 and (self._buckets is None or self._buckets.counted_once(p))]
        # This rank's routed experts: held by dp x tp / ep ranks of the stage, any tp rank
        # (under ZeRO each of them a shard).
        expert_grads = [g for p in self.expert_params if (g := self._grad_of(p)) is not None]
        device = topo.device
        if norm_type == float("inf"):
            local = max((g.detach().abs().max() for g in grads + expert_grads),
                        default=torch.zeros((), device=device)).to(torch.float32)
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
            return local
        local = sum((g.detach().to(torch.float32).norm(norm_type) ** norm_type
                     for g in grads), torch.zeros((), device=device))
        # Each expert once overall: a shard on each rank of its expert-data-parallel
        # group under ZeRO; else whole on each, dp x tp / ep times, divided by dp below.
        weight = 1.0 if self._sharded_grads else topo.ep / topo.tp
        local = local + weight * sum(
            (g.detach().to(torch.float32).norm(norm_type) ** norm_type for g in expert_grads),
            torch.zeros((), device=device))
        dist.all_reduce(local)  # dp replicas add the same sum; dp shards, parts of it
        return (local / (1 if self._sharded_grads else topo.dp)) ** (1.0 / norm_type)

    def _counts_norm(self, name: str) -> bool:
        if name in self._tied_elsewhere:
            return False
        return self.topology.tp_rank == 0 or self._placement(name).kind == "S"

    def _sync_gradients(self) -> None:
        if self._buckets is None:
            # A weight two virtual stages share, scaled once (the buckets scale it
            # otherwise, in ``finish``).
            for param in self._shared:
                if param.grad is not None:
                    param.grad.div_(self.plan.num_microbatches)
        # Replicated parameters that feed only sharded ops hold a partial gradient on
        # each tensor-parallel rank: sum them (one flat all-reduce per step).
        # Under ZeRO-2/3 each rank holds its dp shard of every gradient: the sums below
        # run on those shards, which the ranks they span cut alike.
        partial = [g for p in self._partial_grads if (g := self._grad_of(p)) is not None]
        if partial:
            flat = self.tp.all_reduce(torch.cat([g.reshape(-1) for g in partial]))
            offset = 0
            for grad in partial:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        for params, group in self._tied:
            for param in params:
                if self._buckets is not None and self._buckets.sharded:
                    dist.all_reduce(self._buckets.grad_of(param), group=group)
                    continue
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                dist.all_reduce(local_part(grad), group=group)
                param.grad = grad
        # Over dp the gradients are averaged already, during the last backward: by the
        # buckets' all-reduce or reduce-scatter (ZeRO 0/1) or FSDP's (ZeRO-2/3).

    def _batch_size(self, inputs: tuple, target: Any) -> int:
        """The batch given: the global batch or this replica's slice of it (its dp
        share), read from the first tensor's dim 0; for any other size the global batch,
        which :meth:`_check_batch` then reports the shapes against."""
        first = next((t for t in (*inputs, *pytree.tree_leaves(target))
                      if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        share = self.global_batch_size // self.topology.dp
        if first is not None and first.shape[0] == share:
            return share
        return self.global_batch_size

    def _check_batch(self, inputs: tuple, target: Any, batch: int | None = None) -> None:
        """Shapes and dtypes against the plan, on every rank, before any message."""
        batch = self.global_batch_size if batch is None else batch
        problems = []
        if len(inputs) != len(self._inputs):
            problems.append(f"{len(inputs)} inputs given, the plan has {len(self._inputs)} "
                            f"({', '.join(s.name for s in self._inputs)})")
        for given, spec in zip(inputs, self._inputs):
            problems += _mismatch(spec, given, batch)
        if self._target is not None:
            if target is None:
                problems.append("no target given; the plan's loss needs one")
            else:
                problems += _mismatch(self._target, target, batch)
        if problems:
            dp = self.topology.dp
            if dp > 1:  # the other batch size forward_backward takes
                other = "global batch" if batch != self.global_batch_size else \
                    "data-parallel slice"
                size = self.global_batch_size if batch != self.global_batch_size else \
                    self.global_batch_size // dp
                problems.append(f"(or give this rank's {other}: dim 0 of {size}, "
                                f"global batch {self.global_batch_size} over dp {dp})")
            raise PlanMismatchError(
                "this batch does not match the plan: " + "; ".join(problems) +
                ". The plan fixes the global batch, micro-batch size and every other "
                "dimension; compile again for new shapes")


def _mismatch(spec: InputSpec, given: Any, batch: int) -> list[str]:
    expected = (batch, *spec.shape)
    if not isinstance(given, torch.Tensor):
        return [f"{spec.name} is a {type(given).__name__}, not a tensor"]
    problems = []
    if tuple(given.shape) != expected:
        problems.append(f"{spec.name} has shape {tuple(given.shape)}, "
                        f"the plan's is {expected}")
    if given.dtype != spec.dtype:
        problems.append(f"{spec.name} is {given.dtype}, the plan's is {spec.dtype}")
    return problems


def connect(plan: Plan, model: nn.Module, loss_fn: Callable | None, *,
            device: torch.device | str | None = None) -> Topology:
    """Check the launch against ``plan``, join the process group and check that every
    rank has the same plan and model: the first step of ``Program.build``."""
    if not plan.model.inputs:
        raise PartcError("the plan records no input shapes; compile it again with this "
                         "version of partc")
    if loss_fn is None:
        raise PartcError("training needs a loss: pass loss_fn to partc.compile/partc.load")
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
    # The stages' collectives run over this rank's tp group, in place of the lowering's
    # stand-in.
    tp_group = tp_ops.TensorParallelGroup(topology.tp,
                                          topology.tp_group if topology.tp > 1 else None,
                                          overlap=plan.train.tp_overlap)
    zero_stage = plan.effective_zero_stage
    compute_dtype = _compute_dtype(plan)
    shard = shard_plan(plan, topology)
    for module in modules:
        tp_ops.bind_group(module, tp_group)
        own_parameters(module, model, state_dict, topology.device, shard)
    expert_params = [param for module in modules for param in experts.shard_experts(
        module, topology.ep_group, topology.ep, topology.ep_rank,
        topology.tp_group if topology.tp > 1 else None, topology.tp, topology.tp_rank)]
    aliases = aliases_of(model)
    shared = share_local_ties(modules, aliases)
    if shared and zero_stage >= 2:
        raise PartcError(
            f"virtual stages {[p.index for p in programs]} of pipeline rank "
            f"{topology.pp_rank} both hold {sorted(shared)[:3]} (tied weights; "
            f"{plan.schedule} places them on one rank): FSDP (ZeRO-{zero_stage}) cannot "
            "shard one parameter in two units; plan ZeRO-0/1, or a schedule that places "
            "those stages on different ranks")
    for module, program in zip(modules, programs):
        if zero_stage >= 2:
            # The last stage's backward of a microbatch follows its forward under
            # one microbatch or 1F1B (one virtual stage per rank; with fewer
            # microbatches than stages 1F1B runs as GPipe, see make_schedule).
            follows = program.is_last and len(programs) == 1 and (
                plan.num_microbatches == 1
                or (plan.schedule == "1f1b" and plan.num_microbatches >= plan.pp))
            _shard_over_dp(module, program.fsdp_units, topology, zero_stage, compute_dtype,
                           backward_follows=follows)
        if compute_dtype != torch.float32:
            # Mixed precision: the fp32 parameters are the master weights; the stage
            # computes with compute-dtype copies of them, cast once per step (ZeRO 0/1:
            # ComputeCopies; ZeRO-2/3: FSDP's MixedPrecisionPolicy), gradients
            # accumulated and reduced fp32. Autocast keeps the ops that must stay fp32
            # (softmax, norms) in fp32 and casts activations a traced graph pins to fp32
            # (exported graphs fix dtypes).
            module.forward = torch.autocast(topology.device.type, dtype=compute_dtype)(
                module.forward)
        if plan.train.compile:
            compile_stage(module, plan, topology.device)
    if zero_stage >= 2:  # FSDP made new (DTensor) parameters of the experts' too
        expert_params = [p for module in modules for p in experts.expert_weights(module)]
    whole = modules[0] if len(modules) == 1 else RankStages(modules)
    holders = programs[0].holders
    tied = tied_groups(holders, whole, topology, plan)
    partial_names = set(plan.tensor_parallel.partial_grad_params
                        if plan.tensor_parallel is not None else ())
    partial = [p for name, p in whole.named_parameters()
               if partial_names & set(aliases.get(name, (name,)))]
    if programs[0].loss is not None:   # a vocab-parallel loss meets the other tp ranks
        tp_ops.bind_group(programs[0].loss, tp_group)
    loss = _Loss(programs[0].loss, programs[0].loss_recompute,
                 mixed=compute_dtype != torch.float32)
    grad_sync = None
    # Routed experts' gradients are summed over the ranks holding the same experts.
    expert_groups = ({id(p): topology.expert_dp_group for p in expert_params}
                     if topology.ep > 1 else {})
    if zero_stage < 2 and (topology.dp > 1 or compute_dtype != torch.float32
                           or topology.dp * topology.tp > topology.ep > 1):
        # One set of buckets for the rank: a weight two of its stages share is summed
        # over both before it is reduced (after the schedule, by ``finish``), and a
        # split backward's weight gradients (made outside autograd's accumulation
        # hooks) are taken in there too, so neither overlaps the backward.
        grad_sync = GradBuckets(whole, topology.dp_group, topology.dp, topology.dp_rank,
                                sharded=zero_stage == 1, at_end=set(shared.values()),
                                overlap=not schedule_facts(plan.schedule).split_backward,
                                groups=expert_groups, elements=plan.train.bucket_elements)
    if grad_sync is not None and grad_sync.sharded and plan.train.overlap_param_gather:
        # ZeRO-1's all-gather of the stepped parameters runs beside the next forward:
        # each layer (a unit lowering made) waits for its buckets before it runs.
        for module, program in zip(modules, programs):
            wait_in_forward(grad_sync, module, program.fsdp_units)
    copies = (ComputeCopies(modules, compute_dtype, grad_sync)
              if compute_dtype != torch.float32 else None)
    stages: list[CountingStage] = []
    for module, program in zip(modules, programs):
        contiguous_transfers(module, first=program.is_first, last=program.is_last)
        stage = CountingStage(module, program.index, program.num_stages, topology.device,
                              group=topology.pp_group, zero_stage=zero_stage,
                              reduce_once=plan.reduces_once)
        # A weight two stages share is scaled once, after the schedule: either stage's
        # last backward may come last.
        stage.scaled_elsewhere = set(shared.values())
        stage.grad_sync, stage.compute_copies = grad_sync, copies
        stages.append(stage)
    schedule = make_schedule(plan, stages, loss)
    log.info("rank %d: virtual stage(s) %s of %d (%s), %d parameters", topology.rank,
             [p.index for p in programs], programs[0].num_stages,
             " | ".join(", ".join(p.layers) for p in programs),
             sum(p.numel() for p in whole.parameters()))
    distributed = DistributedModule(
        plan=plan, topology=topology, stages=stages, module=whole, schedule=schedule,
        tied=tied, inputs=plan.model.inputs, partial_grads=partial, aliases=aliases,
        shared=[p for p in whole.parameters() if id(p) in set(shared.values())],
        state_keys=set(model.state_dict(keep_vars=True)),
        tied_elsewhere=tied_elsewhere(holders, whole, plan, topology.pp_rank),
        tp=tp_group, watchdog=start_watchdog(topology.rank, topology.world_size),
        global_batch_size=plan.global_batch_size,
        model_tensors={name: (tuple(t.shape), t.dtype)
                       for name, t in model.state_dict(keep_vars=True).items()})
    distributed.memory_baseline = baseline
    distributed.expert_params = expert_params if topology.ep > 1 else []
    return distributed


def _compute_dtype(plan: Plan) -> torch.dtype:
    dtype = plan.train.dtype
    if dtype == torch.float16:
        raise PartcError("training in float16 needs loss scaling, which partc's runtime "
                         "does not do: train in bfloat16 (plans for float16 are fine)")
    return dtype


def _shard_over_dp(module: fx.GraphModule, unit_paths: tuple[str, ...], topology: Topology,
                   zero_stage: int, compute_dtype: torch.dtype, *,
                   backward_follows: bool) -> None:
    """ZeRO-2/3 by FSDP2 over the dp group: one unit per layer that owns its parameters
    (``unit_paths``; a small layer shares the next one's, see :func:`_unit_groups`), the
    stage itself the root unit for the rest (tied weights, layers without a module of
    their own). ZeRO-3 frees a unit's gathered parameters after its forward, except the
    stage's last unit when ``backward_follows`` (its backward comes next: freed, it
    would be gathered again at once, as torchtitan's ``apply_fsdp`` knows); the root
    keeps its own gathered until backward, as FSDP does. In mixed precision the fp32
    shards are the master weights, gathered as compute-dtype copies, and gradients are
    reduce-scattered in fp32."""
    mesh = topology.mesh["dp"]
    policy = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
        reduce_dtype=torch.float32)
    # Innermost first: the experts (lowering made each call hold its weights).
    for layer in experts.expert_modules(module):
        if layer.owned:
            _shard_experts(layer, topology, zero_stage, policy)
    groups = _unit_groups([module.get_submodule(path) for path in unit_paths],
                          sum(p.numel() for p in module.parameters()))
    for index, group in enumerate(groups):
        kept = backward_follows and index == len(groups) - 1
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=policy,
                    reshard_after_forward=zero_stage >= 3 and not kept)
    fully_shard(module, mesh=mesh, reshard_after_forward=zero_stage >= 3, mp_policy=policy)


def _shard_experts(layer: experts.ExpertParallel, topology: Topology, zero_stage: int,
                   policy: MixedPrecisionPolicy) -> None:
    """One mixture-of-experts layer's routed experts as an FSDP unit of their own over
    the expert-data-parallel group (the ranks holding the same experts; the dp group
    without expert parallelism). Their gradient is the sum over that group divided by
    dp, as the dense weights' mean over dp: together the group's ranks received every
    replica's tokens routed to these experts."""
    mesh = topology.mesh["dp"] if topology.ep == 1 else DeviceMesh.from_group(
        topology.expert_dp_group, topology.device.type, mesh_dim_names=("expert_dp",))
    if mesh.size() != topology.dp and not hasattr(FSDPModule,
                                                  "set_force_sum_reduction_for_comms"):
        raise PartcError("ZeRO-2/3 with expert parallelism divides the experts' gradients "
                         "by dp, not by the ranks holding them, with FSDP's "
                         "set_gradient_divide_factor and set_force_sum_reduction_for_comms, "
                         f"which torch {torch.__version__} lacks: plan ZeRO-0/1 or use a "
                         "newer torch")
    # Its inputs keep their dtypes: the router's combine weights stay fp32 as on one
    # device under autocast (FSDP would cast them to bf16 and the combine with them);
    # the experts' matmuls cast what they compute with, as autocast does.
    policy = dataclasses.replace(policy, cast_forward_inputs=False)
    fully_shard(layer, mesh=mesh, reshard_after_forward=zero_stage >= 3, mp_policy=policy)
    if mesh.size() != topology.dp:
        layer.set_gradient_divide_factor(topology.dp)
        if mesh.size() > 1:  # a sum then a division (gloo has no pre-multiplied sum)
            layer.set_force_sum_reduction_for_comms(True)


def _unit_groups(units: list[nn.Module], stage_params: int) -> list[list[nn.Module]]:
    """The FSDP units of a stage, each a list of the layers' modules it gathers
    together, in order: every layer holding parameters is one, but the smallest, whose
    parameters together stay within ``SMALL_UNITS_SHARE`` of the stage's, join the next
    unit (a final norm the head, as torchtitan groups them), or after the last one the
    root."""
    sizes = {id(unit): sum(p.numel() for p in unit.parameters()) for unit in units}
    units = [unit for unit in units if sizes[id(unit)] > 0]
    allowance = SMALL_UNITS_SHARE * stage_params
    small: set[int] = set()
    for unit in sorted(units, key=lambda u: sizes[id(u)]):
        if sizes[id(unit)] > allowance:
            break
        allowance -= sizes[id(unit)]
        small.add(id(unit))
    groups: list[list[nn.Module]] = []
    waiting: list[nn.Module] = []
    for unit in units:
        waiting.append(unit)
        if id(unit) not in small:
            groups.append(waiting)
            waiting = []
    return groups  # the small layers still waiting are the root's


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
