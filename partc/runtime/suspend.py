"""Suspend on a signal: every rank stops at the same step, saves it, and exits.

A time-shared cluster tells a job to stop with a signal (SIGTERM, or SIGUSR1 some
minutes ahead of it) and kills it when its grace period ends. The signal may reach one
rank, some or all of them, during any step. Here:

1. the first ``module.stop_requested()`` call installs a handler for each stop signal
   (``PARTC_STOP_SIGNALS``, default ``SIGTERM,SIGUSR1``) that only sets this process's
   flag, so a signal no longer ends the rank in the middle of a step;
2. each ``stop_requested()`` call (once per step, on every rank) all-reduces the flag
   with MAX over the world: one 4-byte collective, so every rank sees True from the
   same step on, whichever rank the signal reached;
3. the training loop then saves a checkpoint of that step on every rank and exits with
   :data:`SUSPEND_EXIT_CODE`, which a cluster's wrapper reads as "suspended, resume
   me later" rather than as a failure.

Under torchrun (``torch.distributed.elastic``): a SIGTERM (or SIGINT, SIGHUP, SIGQUIT;
``--signals-to-handle`` adds e.g. SIGUSR1) sent to torchrun is forwarded to every
worker's process group; torchrun then waits ``--shutdown-timeout`` seconds (default 30,
or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) before it sends SIGKILL. Without a handler a
worker dies of the SIGTERM at once; with this one it finishes its step, saves and
exits, which must fit in that timeout (the plan's report gives the predicted save time:
bytes per rank over ``DeviceBudget.disk_bandwidth``). A rank that exits with a non-zero
code while others still save makes torchrun send them SIGTERM too, which here only sets
a flag already set. Under ``--max-restarts=K`` torchrun restarts a job whose worker
exited non-zero, suspended included: signal torchrun itself to stop the job. torchrun
signalled exits 1 itself (it re-raises the signal as an exception once its workers are
gone); each worker's code is in their output.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch
import torch.distributed as dist

# "Saved and suspended": apart from the watchdog's 75 (a peer hung, nothing saved),
# torchrun's 1 and 128 + N (killed by signal N), so a wrapper knows a checkpoint of the
# last step exists.
SUSPEND_EXIT_CODE = 86

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
SIGNALS_ENV = "PARTC_STOP_SIGNALS"

log = logging.getLogger("partc.runtime")


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that ask for a stop: ``PARTC_STOP_SIGNALS`` (comma-separated names,
    e.g. ``SIGTERM,SIGUSR2``) or SIGTERM and SIGUSR1."""
    names = os.environ.get(SIGNALS_ENV)
    names = [n.strip() for n in names.split(",") if n.strip()] if names else DEFAULT_SIGNALS
    found = []
    for name in names:
        full = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
        if not isinstance(getattr(signal, full, None), signal.Signals) \
                or full in ("SIGKILL", "SIGSTOP"):
            raise ValueError(f"{SIGNALS_ENV}: {name!r} is not a signal a process can "
                             f"handle (write names such as SIGTERM,SIGUSR1)")
        found.append(getattr(signal, full))
    return tuple(found)


class StopFlag:
    """A program's stop request (each ``DistributedModule`` has one): set by a stop
    signal (or :meth:`request`), agreed over the world by :meth:`agreed`."""

    def __init__(self) -> None:
        self.local = False  # a signal reached this process
        self.signal: signal.Signals | None = None
        self._agreed = False  # sticky: once every rank knows, it stays known
        self._installed: tuple[signal.Signals, ...] = ()
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> None:
        """Handle the stop signals from now on (once; main thread only, as Python
        requires: elsewhere the signals keep their old handlers, with a warning)."""
        if self._installed:
            return
        signals = stop_signals()
        if threading.current_thread() is not threading.main_thread():
            log.warning("stop_requested() called off the main thread: stop signals "
                        "(%s) keep their default handlers", ", ".join(s.name for s in signals))
            self._installed = signals
            return
        self._previous = {sig: signal.signal(sig, self._handle) for sig in signals}
        self._installed = signals

    def uninstall(self) -> None:
        """Give the stop signals back their handlers from before :meth:`install`
        (where this flag's handler is still the one installed)."""
        for sig, handler in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, handler)
        self._previous, self._installed = {}, ()

    def _handle(self, signum: int, frame: object) -> None:
        # Only a flag: the step in flight (and its collectives) must finish.
        self.local = True
        self.signal = signal.Signals(signum)
        # Another program's flag in this process, installed before this one: it is
        # told too (a signal is the process's, every program stops).
        previous = self._previous.get(self.signal)
        if isinstance(getattr(previous, "__self__", None), StopFlag):
            previous(signum, frame)

    def request(self) -> None:
        """Ask for a stop from the program itself, as a signal would."""
        self.local = True

    def agreed(self, device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
        """True on every rank once any rank's flag is set: an all-reduce MAX of one
        int32 over ``group`` (the world). Collective: every rank calls it once per step."""
        if self._agreed:
            return True
        flag = torch.tensor([1 if self.local else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        self._agreed = bool(flag.item())
        if self._agreed:
            log.warning("rank %d: stop requested (%s); stopping at this step",
                        dist.get_rank(), self.signal.name if self.signal else
                        "by another rank" if not self.local else "by the program")
        return self._agreed

