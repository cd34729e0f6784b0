"""Running a plan: one process per device under torchrun (gloo on CPU, NCCL on CUDA).

The package's names are imported on first use (PEP 562, as the ``partc`` package's), so
that importing one of its torch-free modules (``checkpoint_lock``, which ``partc train``
reads before torch loads) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each public name and the module that defines it.
_EXPORTS = {"DistributedModule": "module", "build": "rank_build", "connect": "rank_build",
            "checkpoint_layer": "recompute", "StageProgram": "stage", "Topology": "topology"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:   # what static tools and IDEs read
    from partc.runtime.module import DistributedModule
    from partc.runtime.rank_build import build, connect
    from partc.runtime.recompute import checkpoint_layer
    from partc.runtime.stage import StageProgram
    from partc.runtime.topology import Topology


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'partc.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value   # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
