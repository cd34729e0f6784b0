"""What lowering hands the runtime: the stage one rank runs, ready to run.

``partc.Program`` lowers the plan (split, tensor-parallel rewrite, recompute, FSDP
units) with ``partc.passes``; the runtime only runs the result, so it imports nothing
from the passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from torch import fx, nn

from partc import meta


@dataclass(frozen=True, kw_only=True)
class StageProgram:
    index: int
    num_stages: int
    layers: tuple[str, ...]
    # The stage's code: recomputed layers and (ZeRO-2/3) FSDP units already in place.
    module: fx.GraphModule = field(repr=False)
    # The user's loss on the model's outputs (every rank has it; the last stage runs it)
    # and how the plan recomputes it.
    loss: nn.Module | None = field(default=None, repr=False)
    loss_recompute: str = "none"
    # Every parameter (all its FQNs) → the stages holding it: tied weights span several.
    holders: Mapping[tuple[str, ...], tuple[int, ...]] = field(default_factory=dict)

    @property
    def fsdp_units(self) -> tuple[str, ...]:
        return meta.fsdp_units(self.module)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1
