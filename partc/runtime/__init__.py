"""Running a plan: one process per device under torchrun (gloo on CPU, NCCL on CUDA)."""

from partc.runtime.module import DistributedModule
from partc.runtime.rank_build import build, connect
from partc.runtime.recompute import checkpoint_layer
from partc.runtime.stage import StageProgram
from partc.runtime.topology import Topology

__all__ = ["DistributedModule", "StageProgram", "Topology", "build", "checkpoint_layer",
           "connect"]
