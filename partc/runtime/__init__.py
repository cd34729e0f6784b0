"""Running a plan: one process per device under torchrun (gloo on CPU, NCCL on CUDA)."""

from .module import DistributedModule, build
from .recompute import checkpoint_layer
from .topology import Topology

__all__ = ["DistributedModule", "Topology", "build", "checkpoint_layer"]
