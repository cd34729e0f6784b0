"""How ``partc train`` ends when something fails: one line, from the first rank to fail,
saying what failed and why, and an exit status that says what kind of failure it was.

Under torchrun every rank runs the same command, so a mistake in it fails every rank at
once, and one rank's failure makes the others fail after it (a collective whose peer is
gone). Each would print its own error; the first is the one that says why. So a failing
rank first claims the failure in the torchrun agent's store (a counter no rank can miss:
it outlives the workers); the rank that claims it first prints its line, the others
print nothing. Before torch is imported (a bad flag or config file, the same on every
rank) there is no store to ask without importing torch for it: rank 0 prints at once and
another rank only after :data:`GRACE_S` seconds, when it is still running (torchrun ends
the others as soon as one rank exits, so a rank still running failed on its own).

The line: ``partc train: <error type>: <message> [rank R; exit S: <kind>]`` (no rank in
one process; ``error`` for a plain ValueError). An internal error (a bug, not a mistake
in the input) prints its traceback above the line.

Exit statuses, :data:`EXIT_STATUSES` (docs/guide.md lists them for users):

====  ===========  ====================================================================
code  kind         raised as
====  ===========  ====================================================================
0     done
1     internal     any other exception: a bug in partc or torch (traceback printed)
2     bad input    a flag, the config file, the factory or its data (UsageError,
                   ValueError, FactoryError, TraceError, PlanSchemaError)
3     no plan      nothing fits the budget and the pins (PlanInfeasibleError)
4     plan         the ranks or the job disagree with the plan (PlanMismatchError,
                   PlanValidationError)
5     non-finite   a step's loss or gradient norm is inf or NaN (NonFiniteError)
6     checkpoint   a checkpoint cannot be saved, loaded or locked (CheckpointError)
75    hang         a collective failed or timed out, or the watchdog ended a stuck rank
                   (partc.runtime.watchdog.EXIT_CODE): launching again may succeed
86    suspended    stopped on SIGTERM or SIGUSR1 after saving its step
                   (partc.runtime.suspend.SUSPEND_EXIT_CODE): resume it
====  ===========  ====================================================================

Torch-free: the command line reports its own refusals with it before torch loads.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta

from partc.cli.main import UsageError
from partc.errors import (CheckpointError, FactoryError, NonFiniteError, PartcError,
                          PlanInfeasibleError, PlanMismatchError, PlanSchemaError,
                          PlanValidationError, TraceError)

INTERNAL, BAD_INPUT, NO_PLAN, PLAN_MISMATCH, NON_FINITE, CHECKPOINT = 1, 2, 3, 4, 5, 6
HANG = 75        # partc.runtime.watchdog.EXIT_CODE (EX_TEMPFAIL)
SUSPENDED = 86   # partc.runtime.suspend.SUSPEND_EXIT_CODE
EXIT_STATUSES = ((0, "done"), (INTERNAL, "internal error"), (BAD_INPUT, "bad input"),
                 (NO_PLAN, "no plan fits"), (PLAN_MISMATCH, "plan mismatch"),
                 (NON_FINITE, "non-finite"), (CHECKPOINT, "checkpoint"),
                 (HANG, "hang or lost peer"), (SUSPENDED, "suspended"))
# The errors of each status, most specific first (CheckpointError is no ValueError;
# PlanSchemaError is one).
_KINDS = ((CHECKPOINT, (CheckpointError,)), (NON_FINITE, (NonFiniteError,)),
          (NO_PLAN, (PlanInfeasibleError,)),
          (PLAN_MISMATCH, (PlanMismatchError, PlanValidationError)),
          (BAD_INPUT, (UsageError, FactoryError, TraceError, PlanSchemaError, ValueError,
                      PartcError)))
# How long a rank other than 0 waits before it reports a failure that came before torch:
# rank 0 fails alike and reports it, and torchrun then ends this rank.
GRACE_S = 3.0
# How long a failing rank waits for the torchrun agent's store to answer.
STORE_TIMEOUT_S = 5.0


def exit_status(error: BaseException) -> int:
    """The exit status that says what kind of failure ``error`` is."""
    for status, kinds in _KINDS:
        if isinstance(error, kinds):
            return status
    if isinstance(error, TimeoutError) or _is_distributed_failure(error):
        return HANG
    return INTERNAL


def _is_distributed_failure(error: BaseException) -> bool:
    """A collective that failed (a peer gone, a timeout): torch's DistError, when torch
    is loaded (it cannot be one otherwise)."""
    distributed = sys.modules.get("torch.distributed")
    kind = getattr(distributed, "DistError", None)
    return kind is not None and isinstance(error, kind)


def kind_of(status: int) -> str:
    return dict(EXIT_STATUSES).get(status, "failed")


def report(error: BaseException, prefix: str) -> int:
    """Print ``error`` as one line on stderr if this rank is the first to fail (its
    traceback above it if it is internal); returns its exit status."""
    status = exit_status(error)
    if not first_to_fail():
        return status
    if status == INTERNAL:
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    print(line(error, prefix, status), file=sys.stderr, flush=True)
    return status


def line(error: BaseException, prefix: str, status: int) -> str:
    """``error`` as the one line :func:`report` prints."""
    text = str(error)
    if not text.startswith(prefix):   # a usage error carries the command already
        named = isinstance(error, PartcError) or exit_status(error) != BAD_INPUT
        text = f"{prefix}: {type(error).__name__ if named else 'error'}: {text}"
    rank = f"rank {_rank()}; " if _world_size() > 1 else ""
    return f"{text} [{rank}exit {status}: {kind_of(status)}]"


def first_to_fail() -> bool:
    """Whether this rank is the first of the job to fail (True in one process, and when
    the ranks cannot agree: a line twice beats none)."""
    if _world_size() <= 1:
        return True
    store = _agent_store()
    if store is not None:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        try:
            return store.add(f"partc/failed/attempt{attempt}", 1) == 1
        except Exception:   # the store is gone: say it
            return True
    if _rank() != 0:
        time.sleep(GRACE_S)   # torchrun ends this rank here when rank 0 failed alike
    return True


def _agent_store():
    """A client of the torchrun agent's store, or None: outside torchrun, before torch
    is loaded, or when it does not answer."""
    if "torch.distributed" not in sys.modules:
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    from torch.distributed import TCPStore

    try:
        return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S))
    except Exception:
        return None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
