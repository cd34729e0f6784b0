"""The program one rank runs: :class:`DistributedModule`, what ``program.build()``
returns (:mod:`.rank_build` makes it).

Its ``forward_backward`` runs one optimizer step's worth of forward and backward over
all microbatches of the global batch (:mod:`.schedule_run`), then:

1. sums the gradients of parameters that several stages hold (tied weights), and the
   partial gradients of replicated tensor-parallel parameters (:mod:`.gradients`);
2. has averaged gradients over data-parallel replicas (routed experts' summed over their
   expert-data-parallel group, divided by dp alike): under ZeRO 0/1 gradients are
   accumulated in fp32 buckets, each all-reduced (ZeRO-0) or reduce-scattered (ZeRO-1)
   as soon as the last microbatch's backward has filled it
   (``partc/runtime/optimizer.py``); under ZeRO-2/3 FSDP2 reduce-scatters them, each
   replica keeping the mean gradient of its shard (:mod:`.fsdp_shard`);
3. reduces the mean loss and the global gradient norm in one all-reduce and checks
   them for inf and NaN (:mod:`.nonfinite`), and in the same all-reduce compares a
   digest of the batch over the ranks that must train on the same one
   (:mod:`.batch_digest`: :class:`partc.BatchMismatchError` names two that do not;
   ``TrainSpec.batch_check_every``); by default a non-finite step raises
   :class:`partc.NonFiniteError` before the optimizer steps; with
   ``TrainSpec(on_nonfinite="skip")`` its gradients are dropped, so that the optimizer's
   next step changes nothing, and it is counted (``skipped_steps``, telemetry);
4. clips the gradients when the plan says so (``TrainSpec.max_grad_norm``), by that norm;
5. returns the mean loss of the global batch, the same on every rank.

Gradients are those of the mean loss over the whole global batch, as on one device, so
under ZeRO 0/2/3 any ``torch.optim`` optimizer over ``module.parameters()`` trains the
same model. Under ZeRO-1 they are each rank's shards in the buckets: only the optimizer
``module.optimizer(...)`` makes steps them, and a plain one's step is refused before it
changes anything (:mod:`.rank_optimizer`).

The class is a facade: each concern lives in a module of its own, over the frozen
:class:`.RankParts` that ``build`` made — state dicts and the view checkpoints read
(:mod:`.rank_state`), gradients (:mod:`.gradients`), batch checks (:mod:`.batch_check`),
the optimizer (:mod:`.rank_optimizer`), watchdog and telemetry (:mod:`.step_monitor`),
checkpoints (:mod:`.checkpoint`), data (:mod:`.data`) and stop signals (:mod:`.suspend`).
"""

from __future__ import annotations

import math
import weakref
from pathlib import Path
from typing import Any, ContextManager, Iterator, Mapping

import torch
from torch import nn

from partc.runtime import checkpoint
from partc.runtime.batch_check import BatchCheck
from partc.runtime.data import DataSampler
from partc.runtime.gradients import GradientSync
from partc.runtime.nonfinite import StepCheck, StepNumbers
from partc.runtime.rank_optimizer import make_optimizer, refuse_plain_steps
from partc.runtime.rank_parts import RankParts
from partc.runtime.rank_state import RankState
from partc.runtime.schedule_run import ScheduleRun
from partc.runtime.step_monitor import StepMonitor
from partc.runtime.suspend import StopFlag
from partc.runtime.telemetry import StepRecord, Telemetry
from partc.runtime.watchdog import DATA, IDLE, LOAD, SAVE


class DistributedModule:
    """This rank's part of the program: parameters, and one training step's fwd + bwd.

    With more than one rank, ``watchdog`` is this rank's watchdog: ``forward_backward``
    (and the optimizer ``optimizer()`` makes) tell it the step (``self.step``, the
    ``forward_backward`` calls so far) and phase (:mod:`.step_monitor`). ``close()``
    stops it.
    """

    def __init__(self, parts: RankParts) -> None:
        self.parts = parts  # what build made, read-only
        self.state = RankState(parts)  # the tensors under FQNs; what checkpoints read
        self.plan = parts.plan
        self.topology = parts.topology
        self.module = parts.module  # the stage's GraphModule, or RankStages of several
        self.tp = parts.tp  # its ``counts``: the tensor-parallel collectives run so far
        self.watchdog = parts.watchdog
        self.memory_baseline = parts.memory_baseline  # host RSS before build (telemetry)
        self.expert_params = list(parts.expert_params)
        self.stage_index = parts.topology.pp_rank  # the plan's stage this rank runs
        self.virtual_stages = parts.virtual_stages
        self.step = 0  # forward_backward calls so far
        self.last_grad_norm: torch.Tensor | None = None
        # The last step's reduced numbers (loss, gradient norm, what was non-finite),
        # whether it was skipped, and the steps skipped so far (on_nonfinite="skip").
        self.last_numbers: StepNumbers | None = None
        self.last_step_skipped = False
        self.skipped_steps = 0
        self.last_messages: dict[str, int] = {"sends": 0, "recvs": 0}
        self._batches = BatchCheck.of(parts.plan, parts.topology.dp_rank)
        self.global_batch_size = self._batches.global_batch_size
        self._gradients = GradientSync(parts, self.state)
        self._run = ScheduleRun(parts, self._batches)
        self._check = StepCheck(parts, self._gradients, self._batches)
        self._monitor = StepMonitor(parts)
        self._optimizers: weakref.WeakSet = weakref.WeakSet()   # from optimizer()
        self._saves = checkpoint.BackgroundSave()
        self._stop = StopFlag()  # stop_requested()'s: set by a stop signal
        refuse_plain_steps(self, parts, self.state)  # ZeRO-1: module.optimizer's alone

    # -- parameters and state (partc/runtime/rank_state.py) -----------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.state.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.state.named_parameters()

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.state.named_buffers()

    def wait_param_gathers(self) -> None:
        self.state.wait_param_gathers()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state.state_dict()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.state.full_state_dict()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.state.load_state_dict(state_dict)

    def master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        return self.state.master_of(param)

    def refresh_from_masters(self) -> None:
        self.state.refresh_from_masters()

    # -- the optimizer and telemetry --------------------------------------------------

    def optimizer(self, optimizer_class: type[torch.optim.Optimizer], **defaults: Any
                  ) -> torch.optim.Optimizer:
        """``optimizer_class(self.parameters(), **defaults)`` as the plan holds its state
        (ZeRO-1: each dp rank its shard's, :mod:`.rank_optimizer`); its steps are heard
        by the watchdog and end the step for telemetry."""
        optimizer = make_optimizer(self.parts, self.state, optimizer_class, defaults)
        self._optimizers.add(optimizer)   # its state is held memory (telemetry)
        this = weakref.ref(self)  # the optimizer must not keep the module alive

        def end_step() -> None:  # the step's telemetry includes the optimizer's
            module = this()
            if module is not None:
                module.end_step()

        self._monitor.watch(optimizer, end_step)
        return optimizer

    def telemetry(self, *, jsonl_dir: str | None = None, console: bool = True,
                  tensorboard_dir: str | None = None, warn_ratio: float = 0.25,
                  grad_norm: bool = True, wandb: dict | None = None) -> Telemetry:
        """Report every step from now on against the plan (``partc/runtime/telemetry.py``):
        loss, step time, tokens/s, MFU, peak memory, gradient norm; printed on rank 0,
        appended to ``<jsonl_dir>/rank<k>.jsonl``, written to TensorBoard under
        ``tensorboard_dir``, logged by rank 0 to a Weights & Biases run made with
        ``wandb.init(**wandb)``; a warning when time or memory departs from the prediction
        by more than ``warn_ratio``. A step ends with the step of an optimizer from
        :meth:`optimizer`, or :meth:`end_step`. ``grad_norm=False`` skips the norm's
        all-reduce when the plan does not clip. Call it on every rank."""
        return self._monitor.start_telemetry(
            jsonl_dir=jsonl_dir, console=console, tensorboard_dir=tensorboard_dir,
            warn_ratio=warn_ratio, grad_norm=grad_norm, wandb=wandb,
            held=self._held_tensors)

    def _held_tensors(self) -> list[torch.Tensor]:
        """What this rank holds from step to step, as the plan counts it: its parameters,
        their gradients, and the state of the optimizers :meth:`optimizer` made."""
        held = []
        for parameter in self.parameters():
            held.append(parameter)
            if parameter.grad is not None:
                held.append(parameter.grad)
        for optimizer in list(self._optimizers):
            for state in optimizer.state.values():
                held += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return held

    def end_step(self, *, optimizer_stepped: bool = True) -> StepRecord | None:
        """End the step under way for telemetry (after an optimizer step that
        :meth:`optimizer` did not make); returns its record, or None without telemetry."""
        return self._monitor.end(optimizer_stepped=optimizer_stepped)

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
        only the newest ``keep`` checkpoints, and the newest whose state is finite (the
        manifest records it, with the last step's loss and norm). Raises
        :class:`partc.CheckpointError` on every rank if any rank cannot save; earlier
        checkpoints stay as they were."""
        with self._monitor.during(f"{SAVE}(step={step})") as marks:
            self.state.wait_param_gathers()
            return checkpoint.save(self.state, self._saves, directory, optimizer=optimizer,
                                   step=step, extra=extra, async_save=async_save, keep=keep,
                                   last_step=self._last_step_finite(), marks=marks)

    def _last_step_finite(self) -> dict[str, Any]:
        """What a checkpoint records of the last step's numbers (None: not measured)."""
        numbers = self.last_numbers
        if numbers is None:
            return {}
        return {"loss": math.isfinite(numbers.loss_value),
                "grad_norm": None if numbers.grad_norm_value is None
                else math.isfinite(numbers.grad_norm_value),
                "skipped": self.last_step_skipped}

    def load_checkpoint(self, directory: str | Path, *,
                        optimizer: torch.optim.Optimizer | None = None) -> tuple[int, dict]:
        """Load the checkpoint ``directory/latest`` names (or the step directory
        ``directory``) into this module's plan, whatever plan saved it, and ``optimizer``'s
        state; returns ``(step, extra)``. Collective. Raises :class:`partc.CheckpointError`
        on every rank, before any tensor changes, for a partial checkpoint or one of
        another model or shapes."""
        with self._monitor.during(LOAD) as marks:
            self.state.wait_param_gathers()  # one finished later would overwrite the load
            step, extra = checkpoint.load(self.state, self._saves, directory,
                                          optimizer=optimizer, marks=marks)
        self.step = step
        self._monitor.mark(IDLE, step)
        return self.step, extra

    def wait_checkpoint(self) -> Path | None:
        """Finish the asynchronous save under way, if any (collective); returns its
        directory. Raises :class:`partc.CheckpointError` on every rank if it failed."""
        with self._monitor.during(f"{SAVE}(finishing)") as marks:
            return checkpoint.wait(self._saves, marks=marks)

    # -- data, stop signals, closing --------------------------------------------------

    def watch_data(self, step: int) -> ContextManager[Any]:
        """``with module.watch_data(step): batch = data(step)``: the watchdog judges the
        block as phase ``data(step=N)`` against its own limit (``PARTC_WATCHDOG_DATA_S``,
        by default 0.9 of the collective timeout): a rank that spends longer there while
        other ranks wait for it is named, ``rank 1 spent 540.2 s in data(step=12)``,
        and the job ends (:mod:`.watchdog`). ``partc train`` wraps its ``data(step)``."""
        return self._monitor.during(f"{DATA}(step={step})")

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

    def close(self) -> None:
        """Stop this rank's watchdog thread (also done when the module is freed and at
        exit); the other ranks then stop judging this one. Stop signals get their
        handlers from before ``stop_requested()`` back, and CPU autocast its own rules
        (mixed precision on CPU ranks, ``partc/runtime/precision.py``)."""
        self._stop.uninstall()
        if self.parts.copies is not None:
            self.parts.copies.close()
        self._monitor.close()

    # -- one step ------------------------------------------------------------------------

    def forward_backward(self, *inputs: Any, target: Any = None,
                         **named: torch.Tensor) -> torch.Tensor:
        """Forward and backward over the whole global batch; returns its mean loss.

        Every rank passes the same global batch (``inputs`` with dim 0 the global batch
        size, and ``target``), each data-parallel replica taking its own rows, or only
        its replica's rows (dim 0 the global batch over dp, e.g. the samples of
        ``data_sampler().indices(step)``); stage 0 reads the inputs and the last stage
        the target. Inputs come as the model was compiled: by position, by name
        (``forward_backward(**batch)``) or as one mapping (``forward_backward(batch)``);
        a plan on the model's own loss takes no target, its labels being an input, and
        returns the mean over the whole batch's counted labels, as one device's
        ``model(**batch).loss`` (:mod:`.label_weights`). Gradients accumulate into
        ``.grad`` like ``loss.backward()``: zero them between steps.
        """
        self.step += 1
        self._monitor.begin(self.step)
        self.last_step_skipped = False
        try:
            loss = self._train(inputs, named, target)
            self._monitor.measured(loss, self.last_grad_norm, self.grad_norm,
                                   skipped=self.last_step_skipped)
            return loss
        finally:
            # Returned or raised, the user's code runs next: not judged by the watchdog.
            self._monitor.mark(IDLE)

    def _train(self, inputs: tuple, named: dict[str, Any], target: Any) -> torch.Tensor:
        """Steps 1-5 of the module's doc, each a phase the watchdog hears."""
        losses: list[torch.Tensor] = []
        args, kwargs = self._run.arguments(inputs, named, target, losses)
        # Inputs by keyword are digested in their names' order, whatever order each rank
        # passed them in.
        given = (*inputs, *(named[key] for key in sorted(named)))
        digests = self._check.digests.measure(self.step, given, target)
        self._monitor.mark("schedule")
        self.last_messages = self._run.train(args, kwargs)
        self._monitor.mark("gradient sync")
        self._gradients.sync()
        self._monitor.mark("loss all-reduce")
        numbers = self._check.reduce(self.step, losses, digests)
        self.last_numbers = numbers
        self.last_grad_norm = numbers.grad_norm
        if self._check.judge(numbers):  # raises, unless the plan skips such steps
            self._skip_step()
            return numbers.loss
        max_norm = self.plan.train.max_grad_norm
        if max_norm is not None:
            self._monitor.mark("clip")
            self._gradients.scale_to(max_norm, numbers.grad_norm)
        return numbers.loss

    def _skip_step(self) -> None:
        """Drop the step's gradients: set to None (any torch optimizer's step then leaves
        every parameter and its state alone) and, under ZeRO-1, the distributed
        optimizer's next step skipped."""
        self._gradients.zero(set_to_none=True)
        if self.parts.buckets is not None:
            self.parts.buckets.skip_step = True
        self.last_step_skipped = True
        self.skipped_steps += 1

    def evaluate(self, *inputs: Any, target: Any = None,
                 **named: torch.Tensor) -> torch.Tensor:
        """The mean loss of a global batch, forward only: the same on every rank.

        As ``forward_backward`` takes them (every rank passes the same global batch),
        run through the pipeline's stages without gradients, in eval mode (dropout off,
        normalisation statistics read, not updated), microbatch by microbatch as the plan
        runs them; no parameter or gradient changes. Collective: every rank calls it,
        before training or between steps.
        """
        losses: list[torch.Tensor] = []
        args, kwargs = self._run.arguments(inputs, named, target, losses)
        self.state.wait_param_gathers()  # an evaluation has no step to overlap them with
        self._run.evaluate(args, kwargs)
        return self._run.mean_loss(losses)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every rank's gradients so that the whole model's gradient norm is at
        most ``max_norm``; returns that norm (the same on every rank). Collective.

        As ``torch.nn.utils.clip_grad_norm_`` on one device: each parameter is counted
        once, i.e. a tensor-parallel shard on every rank of its group, a replicated
        tensor on one of them, a tied weight on the first stage holding it, and one
        data-parallel replica.
        """
        return self._gradients.clip(max_norm, norm_type)

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The whole model's gradient norm, each parameter counted once as in
        :meth:`clip_grad_norm_` (which scales by it); the same on every rank. Collective."""
        return self._gradients.norm(norm_type)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._gradients.zero(set_to_none)
