"""partc: a declarative model-partitioning compiler for PyTorch.

Declare a model, example inputs, a device budget and a training setup; partc traces the
model, measures it, and plans pipeline stages, recompute, microbatches and schedule under
each device's memory limit, with a report that says why.
"""

from .budget import PRESETS, DeviceBudget
from .cache import PlanCache
from .compiler import build_problem, compile, plan_problem
from .errors import (PartcError, PlanFileError, PlanInfeasibleError, PlanMismatchError,
                     PlanSchemaError, PlanValidationError, TraceError)
from .plan import Plan
from .options import PlannerOptions, ShardingOptions
from .program import Program, load
from .spec import Constraints, TrainSpec
from .validate import validate_plan
from .weights import on_meta

__all__ = [
    "PRESETS", "Constraints", "DeviceBudget", "PartcError", "Plan", "PlanFileError",
    "PlanInfeasibleError",
    "PlanCache", "PlanMismatchError", "PlanSchemaError", "PlanValidationError",
    "PlannerOptions", "Program", "ShardingOptions", "TraceError",
    "TrainSpec", "build_problem", "compile", "load", "on_meta", "plan_problem",
    "validate_plan",
]
