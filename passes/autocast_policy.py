"""CUDA's autocast policy on CPU tensors, for the passes' measurements: the policy lives
in :mod:`partc.autocast_policy`, which the runtime reads as well (its CPU ranks train
under it), outside the passes the runtime must not import."""

from partc.autocast_policy import (BANNED, FP32, FP32_APPENDED, FP32_OUTPUT,
                                   LOWER_PRECISION, PROMOTE, cuda_autocast, cuda_policy,
                                   policy_ops)

__all__ = ["BANNED", "FP32", "FP32_APPENDED", "FP32_OUTPUT", "LOWER_PRECISION", "PROMOTE",
           "cuda_autocast", "cuda_policy", "policy_ops"]
