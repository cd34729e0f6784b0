"""Tolerances from what each precision guarantees, not from one CPU's kernels.

Two programs that compute the same step in another order (collectives summing shards,
microbatches accumulated apart, another kernel for the same op) agree to a few roundings
of the precision they compute in. bf16 results differ between CPUs (each picks its own
kernels): a tolerance fitted to what one machine showed fails on another, so the bound
is the precision's own.

- ``FP32``: the oracle docs/architecture.md fixes for fp32 (1e-5 relative).
- ``BF16``: bf16's unit roundoff, 2**-8 (half its machine epsilon): a loss or a
  gradient norm, each a sum over many terms computed from bf16 values, that agrees to one
  rounding of bf16. A wrong gradient (one unreduced, one from another batch) moves them
  by far more.
"""

from __future__ import annotations

import torch

FP32 = 1e-5
BF16 = torch.finfo(torch.bfloat16).eps / 2
