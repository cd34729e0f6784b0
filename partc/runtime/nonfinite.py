"""The step's numbers, reduced once and checked: the mean loss and the global gradient
norm, and what a step does when one of them is inf or NaN (``TrainSpec.on_nonfinite``).

After the gradient sync every rank adds its part to one small float32 vector and one
all-reduce over the world sums it (:meth:`StepCheck.reduce`):

- the sum of the microbatch losses (only the last stage's ranks hold some), which
  divided by microbatches x dp x tp is the mean loss ``forward_backward`` returns;
- this rank's part of the gradient 2-norm's square (each parameter counted once,
  :meth:`partc.runtime.gradients.GradientSync.local_power`), when the check is on or the
  plan clips: clipping then scales by this norm with no collective of its own;
- per pipeline stage, how many of its ranks had a non-finite loss and how many a
  non-finite gradient part, and the sums of those ranks' indices (with one such rank,
  its index);
- on a step whose batch is checked (``TrainSpec.batch_check_every``), four slots per
  rank holding that rank's digests of its batch (:mod:`.batch_digest`): every rank
  reads every rank's, and a batch that differs between ranks that must agree raises
  :class:`partc.BatchMismatchError` before the non-finite verdict.

inf and NaN propagate through the sums, so every rank reads the same verdict from the
same numbers, and raises or skips alike: no rank can be left waiting in a collective.

What it costs, against the loss all-reduce every step had: with clipping, nothing (the
norm's all-reduce and the loss's are now one); without, one pass over the rank's
gradients (the squares' sum) and 4 + 2 x pp floats more in the same all-reduce, no
collective more; reading the verdict is one device-to-host copy of that vector (the
host-device sync reading the loss would be). ``benchmarks/nonfinite_check.py`` measures
it. With ``on_nonfinite="ignore"`` and no clipping the vector carries the loss alone and
no gradient is read; under torch's fake process group, which moves no data (memory
measurements run under it), the check is off whatever the plan says, and so is the
batch digest.

Megatron-Core checks the same two numbers (``check_for_nan_in_loss_and_grad``, on by
default) and raises.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.distributed as dist

from partc.errors import NonFiniteError

from partc.runtime.batch_check import BatchCheck
from partc.runtime.batch_digest import BatchDigests
from partc.runtime.gradients import GradientSync
from partc.runtime.rank_parts import RankParts

log = logging.getLogger("partc.runtime")

LOSS, GRAD_NORM = "loss", "gradient norm"
# How many of a rank's non-finite parameters a message names.
NAMED_PARAMETERS = 4


@dataclasses.dataclass(frozen=True)
class StepNumbers:
    """One step's reduced numbers, the same on every rank."""

    step: int
    loss: torch.Tensor              # the global batch's mean loss (0-dim, on the device)
    grad_norm: torch.Tensor | None  # the global gradient 2-norm, when measured
    loss_value: float
    grad_norm_value: float | None
    # Per pipeline stage, the ranks whose part was non-finite; with one such rank over
    # all stages, its index.
    loss_stages: tuple[int, ...]
    grad_stages: tuple[int, ...]
    loss_rank: int | None
    grad_rank: int | None
    # Every rank's batch digests (batch_digest.SLOTS_PER_RANK floats per rank), on a
    # step whose batch is checked; else empty.
    digests: tuple[float, ...] = ()

    @property
    def nonfinite(self) -> tuple[str, ...]:
        """What was inf or NaN: ``"loss"``, ``"gradient norm"``, both or neither."""
        what = [LOSS] if not math.isfinite(self.loss_value) else []
        if self.grad_norm_value is not None and not math.isfinite(self.grad_norm_value):
            what.append(GRAD_NORM)
        return tuple(what)


class StepCheck:
    """This rank's reduction of the step's numbers and the check on them."""

    def __init__(self, parts: RankParts, gradients: GradientSync, batches: BatchCheck
                 ) -> None:
        self._parts = parts
        self._gradients = gradients
        train = parts.plan.train
        # torch's fake process group moves no data (memory is measured under it): what a
        # stage receives there is whatever its buffers held, so its numbers mean nothing.
        fake = dist.get_backend() == "fake"
        self.mode = "ignore" if fake else train.on_nonfinite
        self.measures_norm = self.mode != "ignore" or train.max_grad_norm is not None
        self.digests = BatchDigests(parts.topology, batches, train.batch_check_every,
                                    enabled=not fake)

    def reduce(self, step: int, losses: list[torch.Tensor],
               digests: torch.Tensor | None = None) -> StepNumbers:
        """The step's numbers from the last stage's microbatch ``losses``, this rank's
        gradients and its batch ``digests`` (``self.digests.measure``'s; None on a step
        not checked): collective, one all-reduce over the world."""
        parts, topo = self._parts, self._parts.topology
        zero = torch.zeros((), device=topo.device)
        loss = torch.stack(losses).sum().detach().to(torch.float32) if losses else zero
        power = self._gradients.local_power() if self.measures_norm else zero
        flags = torch.zeros(2 * topo.pp + 2, device=topo.device)
        if self.mode != "ignore":
            bad = torch.stack([~torch.isfinite(loss), ~torch.isfinite(power)]).float()
            flags[[topo.pp_rank, topo.pp + topo.pp_rank]] = bad
            flags[2 * topo.pp:] = bad * topo.rank
        vector = torch.cat([torch.stack([loss, power]), flags]
                           + ([] if digests is None else [digests]))
        dist.all_reduce(vector)  # only the last stage's ranks add losses, tp copies alike
        values = vector.tolist()
        # cp ranks each add their tokens' mean: as many tokens each, the mean of means.
        scale = parts.plan.num_microbatches * topo.dp * topo.cp * topo.tp
        norm = norm_value = None
        if self.measures_norm:
            norm = self._gradients.norm_of(vector[1])
            # From the host's copy: no second wait for the device.
            norm_value = float(self._gradients.norm_of(torch.tensor(values[1])))
        pp = topo.pp
        loss_stages = tuple(round(v) for v in values[2:2 + pp])
        grad_stages = tuple(round(v) for v in values[2 + pp:2 + 2 * pp])
        return StepNumbers(
            step=step, loss=vector[0] / scale, grad_norm=norm,
            loss_value=values[0] / scale,
            grad_norm_value=norm_value,
            loss_stages=loss_stages, grad_stages=grad_stages,
            loss_rank=round(values[2 + 2 * pp]) if sum(loss_stages) == 1 else None,
            grad_rank=round(values[3 + 2 * pp]) if sum(grad_stages) == 1 else None,
            digests=tuple(values[4 + 2 * pp:]))

    def judge(self, numbers: StepNumbers) -> bool:
        """Whether the step is to be skipped: False when its numbers are finite (or the
        check is off); with ``"raise"`` a :class:`partc.NonFiniteError` on every rank;
        with ``"skip"`` True, after a warning on rank 0. First, whatever the mode, a
        :class:`partc.BatchMismatchError` on every rank when the batch was checked and
        ranks that must agree on it did not."""
        if numbers.digests:
            self.digests.judge(numbers.step, numbers.digests)
        if self.mode == "ignore" or not numbers.nonfinite:
            return False
        parameters = tuple(self._gradients.nonfinite_parameters())
        message = describe(numbers, rank=self._parts.topology.rank,
                           stage=self._parts.topology.pp_rank, parameters=parameters,
                           mode=self.mode)
        if self.mode == "raise":
            raise NonFiniteError(
                message, step=numbers.step, what=numbers.nonfinite,
                loss=numbers.loss_value, grad_norm=numbers.grad_norm_value,
                stages=_stages(numbers), ranks=_ranks(numbers), parameters=parameters)
        if self._parts.topology.rank == 0:
            log.warning("%s", message)
        return True


def _stages(numbers: StepNumbers) -> tuple[int, ...]:
    return tuple(stage for stage, (loss, grad) in
                 enumerate(zip(numbers.loss_stages, numbers.grad_stages)) if loss or grad)


def _ranks(numbers: StepNumbers) -> tuple[int, ...]:
    return tuple(sorted({r for r in (numbers.loss_rank, numbers.grad_rank) if r is not None}))


def _where(counts: tuple[int, ...], rank: int | None) -> str:
    """``stage 1 (rank 3)``, ``stages 0 (2 ranks), 1 (1 rank)``."""
    stages = [(stage, count) for stage, count in enumerate(counts) if count]
    if rank is not None:
        return f"stage {stages[0][0]} (rank {rank})"
    return (f"stage{'s' if len(stages) > 1 else ''} "
            + ", ".join(f"{stage} ({count} rank{'s' if count > 1 else ''})"
                        for stage, count in stages))


def describe(numbers: StepNumbers, *, rank: int, stage: int, parameters: tuple[str, ...],
             mode: str) -> str:
    """The message of a non-finite step, as every rank tells it (``parameters``: this
    rank's non-finite gradients)."""
    values = {LOSS: numbers.loss_value, GRAD_NORM: numbers.grad_norm_value}
    what = " and ".join(f"the {name} is {values[name]}" for name in numbers.nonfinite)
    found = []
    if any(numbers.loss_stages):
        found.append(f"the loss on {_where(numbers.loss_stages, numbers.loss_rank)}")
    if any(numbers.grad_stages):
        found.append(f"gradients on {_where(numbers.grad_stages, numbers.grad_rank)}")
    elif GRAD_NORM in numbers.nonfinite:
        found.append("no rank's own gradients: their squares' sum overflowed float32")
    here = ""
    if parameters:
        more = len(parameters) - NAMED_PARAMETERS
        here = (f"; on this rank ({rank}, stage {stage}) the gradients of "
                + ", ".join(parameters[:NAMED_PARAMETERS])
                + (f" and {more} more" if more > 0 else "")
                + " hold inf or NaN")
    head = (f"step {numbers.step}: {what} (non-finite: {'; '.join(found)}{here})")
    if mode == "skip":
        return (f"{head}; the step is skipped: its gradients are dropped and the optimizer "
                "does not step (TrainSpec.on_nonfinite='skip')")
    return (f"{head}. Found before the optimizer stepped: no parameter has changed. Look "
            f"at the batch of step {numbers.step} (data({numbers.step - 1}) under partc "
            "train), lower the learning rate or clip the gradients "
            "(TrainSpec.max_grad_norm, --max-grad-norm); or skip such steps: "
            "TrainSpec(on_nonfinite='skip') (--on-nonfinite skip)")
