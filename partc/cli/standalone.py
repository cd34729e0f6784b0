"""``partc train --nproc-per-node N ...``: torchrun's one-machine launch (``torchrun
--standalone --nproc-per-node N -m partc train ...``) run inside this process, so that a
failure ends as the rank that failed said it.

Under a plain ``torchrun`` the failing rank's one line (:mod:`partc.cli.failures`) is
followed by about 40 lines of torchrun's own log and traceback, and torchrun exits with
status 1 whatever the rank's was. Here torchrun's log is kept for errors of its own, the
ranks' failure is left to the line the first of them printed, and the exit status is that
rank's (0 done, 2 bad input, 5 non-finite, ...); a rank killed by a signal (the kernel's
out-of-memory killer: SIGKILL) prints nothing itself, so this process says it, with the
status a shell gives (128 + the signal's number). Across machines, run torchrun itself
(docs/gpu.md).

    partc train samples/gpt.py:factory --nproc-per-node 2 --memory 10MiB --steps 8
"""

from __future__ import annotations

import logging
import signal
import sys

# torchrun's loggers: its agent logs each rank's failure (and the SIGTERM it sends the
# others) at WARNING and ERROR.
_TORCHRUN_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run",
                     "torch.distributed.launcher")


def launch(nproc: int, argv: list[str], *, prefix: str = "partc train") -> int:
    """Run ``partc train argv`` on ``nproc`` processes of this machine; the exit status of
    the first rank to fail, or 0."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "-m", "partc", "train", *argv])
    _quiet_torchrun()
    try:
        torchrun.run(args)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        if failure.exitcode >= 0:
            return failure.exitcode   # the rank said why (partc.cli.failures)
        name = signal.Signals(-failure.exitcode).name
        print(f"{prefix}: rank {rank} was killed by {name} (pid {failure.pid}; SIGKILL is "
              f"often the out-of-memory killer) [exit {128 - failure.exitcode}]",
              file=sys.stderr, flush=True)
        return 128 - failure.exitcode
    return 0


def _quiet_torchrun() -> None:
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(_TORCHRUN_LOGGERS):
            logging.getLogger(name).setLevel(logging.CRITICAL)
