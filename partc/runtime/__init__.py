"""Running a plan: one process per device under torchrun (gloo on CPU, NCCL on CUDA)."""

from .module import DistributedModule, build, connect
from .recompute import checkpoint_layer
from .stage import StageProgram
from .topology import Topology

__all__ = ["DistributedModule", "StageProgram", "Topology", "build", "checkpoint_layer",
           "connect"]
