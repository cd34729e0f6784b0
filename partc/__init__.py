"""partc: a declarative model-partitioning compiler for PyTorch.

Declare a model, example inputs, a device budget and a training setup; partc traces the
model, measures it, and plans pipeline stages, recompute, microbatches and schedule under
each device's memory limit, with a report that says why.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# A checkout used in place, not installed (``PYTHONPATH=.``, as on a machine the
# repository is copied to): ``partc.passes`` is the repository's top-level ``passes/``,
# as pyproject's package-dir maps it for an install.
_HERE = os.path.dirname(os.path.abspath(__file__))
if not os.path.isdir(os.path.join(_HERE, "passes")) and os.path.isfile(
        os.path.join(os.path.dirname(_HERE), "passes", "__init__.py")):
    __path__.append(os.path.dirname(_HERE))

# Each public name and the module that defines it. They are imported on first use
# (PEP 562), so that importing the package, as ``partc --help`` and ``python -m partc``
# do, does not import torch; ``from partc import compile`` and ``partc.compile`` work as
# if they were imported here.
_EXPORTS = {
    "PRESETS": "device.budget", "DeviceBudget": "device.budget",
    "PlanCache": "cache",
    "build_problem": "compiler", "compile": "compiler", "plan_problem": "compiler",
    "ArgumentTypeError": "errors", "BatchMismatchError": "errors",
    "CheckpointError": "errors", "ContextParallelError": "errors",
    "FactoryError": "errors", "PartcError": "errors",
    "PlanFileError": "errors",
    "NonFiniteError": "errors", "PlanInfeasibleError": "errors",
    "PlanMismatchError": "errors", "PlanSchemaError": "errors",
    "PlanValidationError": "errors", "TraceError": "errors",
    "DataError": "errors",
    "Plan": "plan",
    "PlannerOptions": "options", "ShardingOptions": "options",
    "Program": "program", "load": "compiler",
    "Constraints": "spec", "TrainSpec": "spec",
    "validate_plan": "planner.validate",
    "on_meta": "weights",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:   # what static tools and IDEs read
    from partc.cache import PlanCache
    from partc.compiler import build_problem, compile, load, plan_problem
    from partc.device.budget import PRESETS, DeviceBudget
    from partc.errors import (ArgumentTypeError, BatchMismatchError, CheckpointError,
                              ContextParallelError, DataError, FactoryError,
                              NonFiniteError, PartcError,
                              PlanFileError, PlanInfeasibleError,
                              PlanMismatchError, PlanSchemaError, PlanValidationError,
                              TraceError)
    from partc.options import PlannerOptions, ShardingOptions
    from partc.plan import Plan
    from partc.planner.validate import validate_plan
    from partc.program import Program
    from partc.spec import Constraints, TrainSpec
    from partc.weights import on_meta


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'partc' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value   # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
