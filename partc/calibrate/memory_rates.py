"""Memory-bound rates: copy and add, training's element-wise ops, and the optimizer step.

- memory bandwidth: a large copy (bytes read + written: 2 per element byte) and add (3);
  the better is ``hbm_bandwidth``.
- element-wise ops: an add, layer norm, scale, mask, softmax and GELU on activations,
  forward and backward, in bytes as partc counts them (``elementwise_bandwidth``).
- the optimizer: ``torch.optim.AdamW``'s step over a transformer block's parameters, in
  the bytes the cost model charges a step (``optimizer_bandwidth``).

One CPU thread computes the last two well below its copy bandwidth; a GPU runs
element-wise kernels somewhat below it (an H100 0.82 of its copy rate), and torch's AdamW
(its foreach form, the default there) passes over the state several times (an H100
stepped 0.31 of its copy rate in those bytes).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from partc.calibrate.calibration_options import Sizes
from partc.calibrate.overheads import OpOverhead
from partc.calibrate.stopwatch import format_rate, median_seconds
from partc.passes.helpers.op_bytes import MovedBytes
from partc.problem import Precision

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- copy, add

@dataclass(frozen=True, kw_only=True)
class MemoryPass:
    """One pass over float32 tensors, timed."""

    seconds: float                 # per call
    bytes_moved: int               # read + written per call

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_moved / self.seconds

    def to_dict(self) -> dict:
        return {"seconds": self.seconds, "bytes_moved": self.bytes_moved,
                "bytes_per_s": self.bytes_per_s}


@dataclass(frozen=True, kw_only=True)
class MemoryBandwidth:
    """A copy and an add of tensors of ``tensor_bytes`` each."""

    tensor_bytes: int
    copy: MemoryPass               # 2 x tensor_bytes moved
    add: MemoryPass                # 3 x tensor_bytes moved

    @property
    def best_bytes_per_s(self) -> float:
        return max(self.copy.bytes_per_s, self.add.bytes_per_s)

    def to_dict(self) -> dict:
        return {"tensor_bytes": self.tensor_bytes, "copy": self.copy.to_dict(),
                "add": self.add.to_dict(), "best_bytes_per_s": self.best_bytes_per_s}


def measure_memory(device: torch.device, sizes: Sizes) -> MemoryBandwidth:
    numel = sizes.memory_bytes // 4
    a, b, out = (torch.ones(numel, device=device) for _ in range(3))
    copy_s = median_seconds(lambda: out.copy_(a), device, sizes)
    add_s = median_seconds(lambda: torch.add(a, b, out=out), device, sizes)
    result = MemoryBandwidth(tensor_bytes=numel * 4,
                             copy=MemoryPass(seconds=copy_s, bytes_moved=2 * numel * 4),
                             add=MemoryPass(seconds=add_s, bytes_moved=3 * numel * 4))
    log.info("memory: copy %s, add %s", format_rate(result.copy.bytes_per_s),
             format_rate(result.add.bytes_per_s))
    return result


# ------------------------------------------------------------------------- element-wise

@dataclass(frozen=True, kw_only=True)
class ElementwiseRate:
    """Six element-wise ops, forward and backward, in the bytes partc counts."""

    shape: tuple[int, int]         # (tokens, width) of each op's activation
    ops: int
    forward_bytes: int             # as passes/estimate counts them
    backward_bytes: int            # the ops autograd runs, counted alike
    forward_s: float               # seconds, all six forward
    forward_backward_s: float      # seconds, all six forward and backward
    bytes_per_s: float             # both passes' bytes over their time less dispatch

    def to_dict(self) -> dict:
        return asdict(self) | {"shape": list(self.shape)}


def measure_elementwise(device: torch.device, sizes: Sizes,
                        overhead: OpOverhead | None = None) -> ElementwiseRate:
    """The memory-bound ops of training, forward and backward as autograd runs them: a
    residual add, a layer norm, a scale, a mask, a softmax and a GELU, each on its own
    (tokens, out) activation of ``sizes.linear[0]`` that needs a gradient. Their bytes
    are counted as ``passes/estimate`` counts them (tensor inputs read and outputs
    written; the norm's weights, parameters, left out), backward's as it counts a layer's
    backward (the ops autograd runs, :class:`partc.passes.helpers.op_bytes.MovedBytes`,
    with the kernels of the device's own where they differ); the ops' fixed cost per call
    (``overhead``, from :func:`partc.calibrate.overheads.measure_op_overhead`), which the
    cost model charges apart, is taken off. ``bytes_per_s`` = (forward + backward bytes)
    / (forward + backward) seconds: a CPU thread computes exp, erf and compares at well
    below its copy bandwidth."""
    tokens, _, width = sizes.linear[0]
    inputs = [torch.randn(tokens, width, device=device, requires_grad=True)
              for _ in range(6)]
    norm = [torch.ones(width, device=device, requires_grad=True),
            torch.zeros(width, device=device, requires_grad=True)]
    keep = torch.rand(tokens, width, device=device) < 0.5
    grads = [torch.randn(tokens, width, device=device) for _ in range(6)]

    def forward() -> list[torch.Tensor]:
        residual, normed, scaled, masked, soft, gelu = inputs
        return [residual + normed, F.layer_norm(normed, (width,), *norm), scaled * 0.125,
                masked.masked_fill(keep, -1e4), F.softmax(soft, dim=-1), F.gelu(gelu)]

    def both() -> None:
        torch.autograd.backward(forward(), grads)
        for tensor in inputs + norm:
            tensor.grad = None

    one = tokens * width * 4
    # add: 2 read, 1 written; mask: its bool mask too, and the copy masked_fill makes
    # before filling in place; the others 1 read, 1 written.
    nbytes = 3 * one + 2 * one + 2 * one + (4 * one + tokens * width) + 2 * one + 2 * one
    counted = MovedBytes({StorageWeakRef(t.untyped_storage()) for t in norm},
                         cuda=device.type == "cuda")
    outputs = forward()
    with counted:
        torch.autograd.backward(outputs, grads)
    for tensor in inputs + norm:
        tensor.grad = None
    forward_s, both_s = (median_seconds(f, device, sizes) for f in (forward, both))
    per_op = (overhead.forward_s + overhead.backward_s) if overhead else 0.0
    work_s = max(both_s - 6 * per_op, both_s / 2)
    result = ElementwiseRate(shape=(tokens, width), ops=6, forward_bytes=nbytes,
                             backward_bytes=counted.moved, forward_s=forward_s,
                             forward_backward_s=both_s,
                             bytes_per_s=(nbytes + counted.moved) / work_s)
    log.info("element-wise ops, forward and backward: %s", format_rate(result.bytes_per_s))
    return result


# ---------------------------------------------------------------------------- optimizer

def block_shapes(width: int) -> list[tuple[int, ...]]:
    """A transformer block's parameters of width ``width``: two norms, attention's input
    and output projections, an MLP of 4x; weights and biases: 12 tensors."""
    return [(width,), (width,), (3 * width, width), (3 * width,), (width, width),
            (width,), (width,), (width,), (4 * width, width), (4 * width,),
            (width, 4 * width), (width,)]


@dataclass(frozen=True, kw_only=True)
class OptimizerRate:
    """An optimizer's step over a block's parameters, in the cost model's bytes."""

    optimizer: str                 # "AdamW"
    tensors: int                   # parameter tensors stepped
    params: int                    # parameters stepped
    seconds: float                 # per step
    bytes_counted: int             # Precision.step_bytes per parameter

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_counted / self.seconds

    def to_dict(self) -> dict:
        return asdict(self) | {"bytes_per_s": self.bytes_per_s}


def measure_optimizer(device: torch.device, sizes: Sizes) -> OptimizerRate:
    """``torch.optim.AdamW``'s step as a user builds it (torch's defaults for the device:
    a loop over the parameters on a CPU) over a transformer block's parameters
    (:func:`block_shapes`) of width ``sizes.linear[0]``'s input. ``bytes_per_s`` counts
    the bytes the cost model charges a step (:attr:`partc.problem.Precision.step_bytes`:
    28 per parameter for Adam in fp32) over the step's time: every pass over the state
    and the dispatch per tensor of an unfused step included."""
    width = sizes.linear[0][1]
    params = [torch.nn.Parameter(torch.randn(shape, device=device))
              for shape in block_shapes(width)]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    seconds = median_seconds(optimizer.step, device, sizes)
    count = sum(param.numel() for param in params)
    nbytes = count * Precision(compute_bytes=4, optimizer_state_bytes=8).step_bytes
    result = OptimizerRate(optimizer="AdamW", tensors=len(params), params=count,
                           seconds=seconds, bytes_counted=nbytes)
    log.info("optimizer step (AdamW): %s", format_rate(result.bytes_per_s))
    return result
