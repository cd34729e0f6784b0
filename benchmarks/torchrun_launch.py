"""How the benchmarks that time several processes start: run as a plain script, one
restarts itself under ``torchrun --standalone`` with its own arguments (one thread per
process, so that the ranks share the cores as the measurements assume); under torchrun
(``RANK`` set) it runs its ``main``."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable


def run_under_torchrun(main: Callable[[], None], nproc: int = 2, **env: str) -> None:
    """``main()`` on this rank, or (not under torchrun yet) this script again on ``nproc``
    processes with ``env`` added, exiting with torchrun's status."""
    if "RANK" in os.environ:
        main()
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", sys.argv[0], *sys.argv[1:]]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    sys.exit(subprocess.run(command, env=environment).returncode)
