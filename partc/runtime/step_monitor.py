"""What watches this rank's steps: the watchdog and the telemetry, told of each phase.

With more than one rank the watchdog (``partc/runtime/watchdog.py``) hears the step
(``DistributedModule.step``, the ``forward_backward`` calls so far) and phase; a rank
that stops or stays in one phase for ``PARTC_WATCHDOG_S`` s (default 60) is reported on
every other rank, which exit with ``watchdog.EXIT_CODE``. Between steps it hears the
data call (:meth:`StepMonitor.during` ``data(step=N)``) and checkpoints' saves and loads,
each judged against a limit of its own. Telemetry
(``partc/runtime/telemetry.py``), once turned on, measures every step from
``forward_backward`` to the optimizer's step (or ``end_step``) against the plan.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch

from partc.runtime.activation_offload import ledgers
from partc.runtime.rank_parts import RankParts
from partc.runtime.telemetry import StepRecord, Telemetry
from partc.runtime.watchdog import IDLE, PhaseMarks


class StepMonitor:
    """This rank's watchdog (None with one process) and telemetry (None until turned
    on)."""

    def __init__(self, parts: RankParts) -> None:
        self._parts = parts
        self.watchdog = parts.watchdog
        self.telemetry: Telemetry | None = None
        if self.watchdog is not None:
            weakref.finalize(self, self.watchdog.stop)  # also at interpreter exit

    def mark(self, phase: str, step: int | None = None) -> None:
        if self.watchdog is not None:
            self.watchdog.mark(phase, step)

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[PhaseMarks | None]:
        """The main thread is in ``phase`` (between steps: ``data(step=3)``, ``checkpoint
        save(step=3)``) for the block, whose marks (None without a watchdog) tell its
        storage work apart; then between steps again."""
        self.mark(phase)
        try:
            yield None if self.watchdog is None else PhaseMarks(self.watchdog.mark, phase)
        finally:
            self.mark(IDLE)

    def start_telemetry(self, **options: Any) -> Telemetry:
        """A new telemetry (the previous one closed), with ``options`` as
        ``DistributedModule.telemetry`` takes them."""
        if self.telemetry is not None:
            self.telemetry.close()
        parts, topo = self._parts, self._parts.topology
        self.telemetry = Telemetry(
            parts.plan, rank=topo.rank, stage=topo.pp_rank, device=topo.device,
            leads_stage=topo.dp_rank == 0 and topo.tp_rank == 0,
            memory_baseline=parts.memory_baseline,
            offload=[ledger.counters for ledger in ledgers(parts.module)], **options)
        return self.telemetry

    def begin(self, step: int) -> None:
        """``forward_backward`` of ``step`` starts."""
        self.mark("forward_backward", step)
        if self.telemetry is not None:
            self.telemetry.begin(step)

    def measured(self, loss: torch.Tensor, norm: torch.Tensor | None,
                 grad_norm: Callable[[], torch.Tensor], *, skipped: bool = False) -> None:
        """``forward_backward`` returned ``loss``; ``skipped``: its step was skipped (a
        non-finite loss or gradient norm). The step's gradient norm is ``norm`` when
        the step measured it (the non-finite check, or clipping), else ``grad_norm()``
        (collective: telemetry is on for every rank or none) unless telemetry was asked
        not to measure it."""
        if self.telemetry is None:
            return
        if norm is None and self.telemetry.grad_norm:
            norm = grad_norm()
        self.telemetry.measured(loss, norm, skipped=skipped)

    def end(self, *, optimizer_stepped: bool = True) -> StepRecord | None:
        if self.telemetry is None:
            return None
        return self.telemetry.end(optimizer_stepped=optimizer_stepped)

    def watch(self, optimizer: torch.optim.Optimizer, end_step: Callable[[], Any]) -> None:
        """The watchdog hears ``optimizer``'s steps, and each ends the step under way
        for telemetry (``end_step``: held weakly by the caller, so that the optimizer
        does not keep the module alive)."""
        if self.watchdog is not None:
            watchdog = self.watchdog
            optimizer.register_step_pre_hook(lambda *_: watchdog.mark("optimizer step"))
            optimizer.register_step_post_hook(lambda *_: watchdog.mark(IDLE))
        optimizer.register_step_post_hook(lambda *_: end_step())

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.telemetry is not None:
            self.telemetry.close()
