"""A calibration of this machine's CPU made once and kept, for ``partc train --calibrate``.

The CPU preset's figures are guesses: a run planned with them on a given machine may take
several times the predicted step. ``partc train --calibrate`` plans with this machine's own
figures instead, measured by a quick ``partc calibrate`` (:func:`partc.calibrate.calibration.calibrate`)
the first time and read from the cache after: a profile per machine (its host name,
processor, core count and torch version) and number of processes, under
``$PARTC_CACHE_DIR/profiles`` (else ``~/.cache/partc/profiles``). Under torchrun the local
rank 0 of a node measures while the others wait for the file; a profile is written whole
(to a temporary file, then renamed), so no rank reads one half written.
"""

from __future__ import annotations

import hashlib
import os
import platform
import time
from pathlib import Path

import torch

from partc.calibrate.calibration import calibrate
from partc.calibrate.calibration_options import CalibrationError, CalibrationOptions
from partc.calibrate.machine import device_name
from partc.calibrate.profile_writer import write_profile

WAIT_S = 3600.0   # how long a rank waits for local rank 0's calibration


def profiles_dir() -> Path:
    """Where kept profiles live: ``$PARTC_CACHE_DIR/profiles``, else
    ``~/.cache/partc/profiles``."""
    root = os.environ.get("PARTC_CACHE_DIR") or Path.home() / ".cache" / "partc"
    return Path(root) / "profiles"


def profile_path(processes: int) -> Path:
    """The kept profile of this machine's CPU for ``processes`` ranks."""
    machine = "|".join((platform.node(), device_name("cpu"), str(os.cpu_count()),
                        torch.__version__, str(processes)))
    digest = hashlib.sha256(machine.encode()).hexdigest()[:16]
    return profiles_dir() / f"cpu-{processes}p-{digest}.json"


def cpu_profile(processes: int, *, measure: bool, wait_s: float = WAIT_S) -> Path:
    """The path of this machine's kept CPU profile for ``processes`` ranks: measured now
    when there is none and ``measure`` (the node's local rank 0), else waited for."""
    path = profile_path(processes)
    if path.exists():
        return path
    if measure:
        profile = calibrate(CalibrationOptions(device="cpu", processes=processes, quick=True))
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        write_profile(profile, partial)
        os.replace(partial, path)
        return path
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise CalibrationError(f"no CPU profile at {path} after {wait_s:.0f} s: local "
                                   f"rank 0 was to calibrate this machine; run partc "
                                   f"calibrate --device cpu --processes {processes} --quick "
                                   f"--out {path} once, then start again")
        time.sleep(0.5)
    return path
