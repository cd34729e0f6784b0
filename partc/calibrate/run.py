"""Measure this machine's devices and write a device profile that DeviceBudget loads.

    partc calibrate --out profile.json                 # CUDA when torch sees a GPU, else CPU
    partc calibrate --device cpu --processes 2 --quick --out cpu.json

Every figure is the median of repeats after warm-up runs, each repeat long enough for the
clock (CUDA events on a GPU, ``time.perf_counter`` on CPU):

- matmul: achieved FLOP/s, 2·m·k·n per product, over a few square-ish sizes, per dtype
  (float32 and bfloat16 on CPU; float32, tf32, bfloat16 and float16 on CUDA). The best
  size's figure is the dtype's achieved throughput; a fit of ``t = flops / best +
  overhead`` over the sizes gives the fixed time per matmul call that makes small
  matmuls run below it (``matmul_overhead_s``).
- op overhead: a chain of tiny element-wise ops that autograd records, forward and
  forward + backward: eager dispatch per op (``op_overhead_s``, ``op_overhead_backward_s``;
  on CPU only: a GPU's launches run ahead of its kernels).
- kernel overhead (a GPU only): a GPU's own time per kernel whatever its size, its
  launch, ramp-up and tail (``kernel_overhead_s``): tiny kernels queued behind a long
  one run back to back, as a layer's do behind a host that dispatches ahead, timed over
  their span (:func:`measure_kernel_overhead`). A CPU's per-op time is the op overhead.
- attention: ``scaled_dot_product_attention`` forward on one (batch, heads, seq, head_dim)
  shape, counted as 4·b·h·s²·d FLOPs (its two matmuls), and half that when causal.
- memory bandwidth: a large copy (bytes read + written: 2 per element byte) and add (3).
- element-wise ops: an add, layer norm, scale, mask, softmax and GELU on activations,
  forward and backward, in bytes as partc counts them (``elementwise_bandwidth``), and
  ``torch.optim.AdamW``'s step over a transformer block's parameters, in the bytes the
  cost model charges a step (``optimizer_bandwidth``): one CPU thread computes these
  well below its copy bandwidth; a GPU runs element-wise kernels somewhat below it (an
  H100 0.82 of its copy rate), and torch's AdamW (its foreach form, the default there)
  passes over the state several times (an H100 stepped 0.31 of its copy rate in those
  bytes).
- FSDP2 (ZeRO-2/3): with the N processes below, its own work per unit and microbatch
  beside the collectives (:func:`measure_fsdp`): forward and backward hooks, and per
  all-gather and reduce-scatter (``fsdp_unit_overhead_s``, ``..._backward_s``,
  ``fsdp_gather_overhead_s``, ``fsdp_scatter_overhead_s``); on CPU only: a GPU's host
  runs it ahead of the kernels.
- collectives: N local processes (gloo on CPU, NCCL on CUDA) time all-reduce, all-gather,
  reduce-scatter and a send/recv ping-pong over message sizes m (bytes of the whole
  tensor; send/recv: of the message). Times are fitted, by least squares on relative
  error, to the ring form the cost model uses (``partc.cost.collectives.ring_seconds``)::

      t(m) = steps · latency + (steps / n) · m / bandwidth

  with steps = 2(n-1) for all-reduce, n-1 for all-gather and reduce-scatter (1 and a
  factor of 1 for send/recv). So ``bandwidth`` is what one link carries, comparable with
  a preset's ``intra_node_bandwidth``, and ``latency`` is one ring step's, the preset's
  ``intra_node_latency_s``. One joint fit over the four collectives gives the budget's numbers;
  each collective's own fit (alpha = steps · latency) is kept beside it. On CPU every
  collective and size is timed again as a training step meets it, each call after a
  burst of compute (``between_compute``: gloo's threads woken, the ranks arriving apart),
  and those fits are the budget's: back to back they ran 2-3x faster than the
  tensor-parallel runtime's all-reduces of the same size.

On CPU a device is one of the N processes: compute and memory bandwidth are measured with
cores / N threads, and a device's memory is the machine's RAM / N. Nominal peak FLOP/s are
the preset's where the device is a known preset (the GPUs in ``partc.device.budget.PRESETS``),
otherwise the measured best, and ``flops_efficiency`` is achieved / nominal. A single
machine cannot measure the network between nodes: ``inter_node_bandwidth`` is the
preset's, or null for the user to give (``DeviceBudget(..., inter_node_bandwidth=...)``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from partc.device.budget import PRESETS, PROFILE_SCHEMA, PROFILE_VERSION, step_links
from partc.errors import PartcError
from partc.runtime.topology import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE
from partc.units import format_seconds

log = logging.getLogger("partc.calibrate.run")

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")
_TORCH_DTYPES = {"float32": torch.float32, "tf32": torch.float32,
                 "bfloat16": torch.bfloat16, "float16": torch.float16}


class CalibrationError(PartcError):
    """A measurement could not be taken or made no sense; the message says which."""


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """What to run: shapes, bytes and how often."""

    matmul: tuple[tuple[int, int, int], ...]   # (m, k, n)
    linear: tuple[tuple[int, int, int], ...]   # (tokens, in, out) of a trained linear layer
    attention: tuple[int, int, int, int]       # (batch, heads, seq, head_dim)
    memory_bytes: int                          # of each tensor in the copy and add
    message_bytes: tuple[int, ...]             # collective sizes
    repeats: int
    warmup: int
    min_sample_s: float                        # calls per sample are batched up to this
    # A CPU's clock: wall time, or ``time.thread_time`` (the calling thread's CPU time:
    # what a one-thread process computes, whatever else the machine runs).
    clock: Callable[[], float] = time.perf_counter


def _powers_of_4(low: int, high: int) -> tuple[int, ...]:
    return tuple(2**e for e in range(low, high + 1, 2))


SIZES = {
    ("cpu", True): Sizes(matmul=((64, 64, 64), (128, 128, 128), (256, 256, 256)),
                         linear=((256, 128, 384), (256, 384, 128)),
                         attention=(1, 4, 128, 32),
                         memory_bytes=16 * 2**20, message_bytes=_powers_of_4(10, 22),
                         repeats=5, warmup=1, min_sample_s=2e-3),
    ("cpu", False): Sizes(matmul=((128, 128, 128), (256, 256, 256), (512, 512, 512),
                                  (1024, 1024, 1024), (2048, 2048, 2048), (2048, 4096, 2048)),
                          linear=((512, 256, 768), (512, 768, 256), (2048, 1024, 4096),
                                  (2048, 4096, 1024)),
                          attention=(2, 8, 1024, 64),
                          memory_bytes=256 * 2**20, message_bytes=_powers_of_4(10, 26),
                          repeats=7, warmup=3, min_sample_s=0.02),
    ("cuda", True): Sizes(matmul=((1024, 1024, 1024), (2048, 2048, 2048)),
                          linear=((4096, 2048, 6144), (4096, 6144, 2048)),
                          attention=(2, 8, 1024, 64), memory_bytes=64 * 2**20,
                          message_bytes=_powers_of_4(10, 24), repeats=3, warmup=2,
                          min_sample_s=1e-3),
    ("cuda", False): Sizes(matmul=((512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048),
                                   (4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 8192)),
                           linear=((8192, 4096, 12288), (8192, 4096, 14336),
                                   (8192, 14336, 4096), (8192, 8192, 28672)),
                           attention=(4, 32, 4096, 128),
                           memory_bytes=2**30, message_bytes=_powers_of_4(10, 30),
                           repeats=10, warmup=5, min_sample_s=0.02),
}


@dataclass(frozen=True, kw_only=True)
class CalibrationOptions:
    device: str = "cpu"          # "cpu" or "cuda"
    processes: int = 2           # ranks for the collectives; on CPU, devices per node
    quick: bool = False          # small sizes, few repeats: seconds, for tests

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.processes < 1:
            raise ValueError(f"processes must be at least 1, got {self.processes}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise CalibrationError("--device cuda, but torch sees no GPU here")
        if self.device == "cuda" and self.processes > torch.cuda.device_count():
            raise ValueError(f"{self.processes} processes asked for, but only "
                             f"{torch.cuda.device_count()} GPUs: one process per GPU")

    @property
    def sizes(self) -> Sizes:
        return SIZES[self.device, self.quick]

    @property
    def dtypes(self) -> tuple[str, ...]:
        if self.device == "cuda":
            return ("float32", "tf32", "bfloat16", "float16")
        return ("float32", "bfloat16")


# ---------------------------------------------------------------------------- timing

def _elapsed(fn: Callable[[], object], device: torch.device, calls: int,
             clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds for ``calls`` back-to-back calls, all finished (on a CPU by ``clock``)."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start_s = clock()
    for _ in range(calls):
        fn()
    return clock() - start_s


# What the ranks time together, every one computing at once as in training, is batched
# into samples at least this long: a training step's phases run for tens of milliseconds,
# and on a shared machine a shorter sample sees one time slice of a core (all of it, or
# none) instead of the share the step gets.
BUSY_SAMPLE_S = 0.05


def _calls_per_sample(one_call_s: float, sizes: Sizes) -> int:
    return max(1, math.ceil(sizes.min_sample_s / max(one_call_s, 1e-9)))


def median_seconds(fn: Callable[[], object], device: torch.device, sizes: Sizes) -> float:
    """Median seconds per call of ``fn`` after warm-up."""
    for _ in range(sizes.warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    calls = _calls_per_sample(_elapsed(fn, device, 1, sizes.clock), sizes)
    return statistics.median(_elapsed(fn, device, calls, sizes.clock) / calls
                             for _ in range(sizes.repeats))


class _Fp32Precision:
    """fp32 matmuls as ``key`` asks: full fp32 ("highest") or TF32 tensor cores ("high")."""

    def __init__(self, key: str) -> None:
        self.wanted = "high" if key == "tf32" else "highest"

    def __enter__(self) -> None:
        self.before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(self.wanted)

    def __exit__(self, *exc) -> None:
        torch.set_float32_matmul_precision(self.before)


# ---------------------------------------------------------------------------- compute

def measure_matmul(device: torch.device, dtypes: tuple[str, ...], sizes: Sizes) -> dict:
    result = {}
    for key in dtypes:
        samples = []
        for m, k, n in sizes.matmul:
            a = torch.randn(m, k, device=device, dtype=_TORCH_DTYPES[key])
            b = torch.randn(k, n, device=device, dtype=_TORCH_DTYPES[key])
            out = torch.empty(m, n, device=device, dtype=_TORCH_DTYPES[key])
            with _Fp32Precision(key):
                seconds = median_seconds(lambda: torch.mm(a, b, out=out), device, sizes)
            samples.append({"m": m, "k": k, "n": n, "seconds": seconds,
                            "flops_per_s": 2 * m * k * n / seconds})
            log.info("matmul %s %dx%dx%d: %s", key, m, k, n, _flops(samples[-1]["flops_per_s"]))
        best = max(samples, key=lambda s: s["flops_per_s"])
        result[key] = {"samples": samples, "best_flops_per_s": best["flops_per_s"],
                       "overhead_s": matmul_overhead(samples, best["flops_per_s"])}
    return result


def measure_linear(device: torch.device, dtypes: tuple[str, ...], sizes: Sizes) -> dict:
    """The matmuls of training, as autograd runs them: a linear layer's forward
    ``x @ W.T`` and backward (``dy @ W`` and ``dy.T @ x``, on transposed views) for each
    (tokens, in, out) of ``sizes.linear``: 3 x 2 x tokens x in x out FLOPs a call. Their
    rate over the best square matmul's is the efficiency a model's layers reach."""
    result = {}
    for key in dtypes:
        if key == "tf32":
            continue
        dtype = _TORCH_DTYPES[key]
        samples = []
        for tokens, d_in, d_out in sizes.linear:
            x = torch.randn(tokens, d_in, device=device, dtype=dtype, requires_grad=True)
            weight = torch.randn(d_out, d_in, device=device, dtype=dtype, requires_grad=True)
            grad = torch.randn(tokens, d_out, device=device, dtype=dtype)

            def step() -> None:
                F.linear(x, weight).backward(grad)
                x.grad = weight.grad = None

            with _Fp32Precision(key):
                seconds = median_seconds(step, device, sizes)
            flops = 3 * 2 * tokens * d_in * d_out
            samples.append({"tokens": tokens, "in": d_in, "out": d_out, "seconds": seconds,
                            "flops_per_s": flops / seconds})
        total = sum(3 * 2 * s["tokens"] * s["in"] * s["out"] for s in samples)
        result[key] = {"samples": samples,
                       "flops_per_s": total / sum(s["seconds"] for s in samples)}
        log.info("linear layers %s, forward and backward: %s", key,
                 _flops(result[key]["flops_per_s"]))
    return result


def measure_split_backward(device: torch.device, sizes: Sizes) -> dict:
    """A backward run as the zero-bubble schedules run it, over one pass: two linear
    blocks (``sizes.linear[0]``: tokens x in -> out -> in, GELU between) timed forward
    alone, forward and one backward, and forward then ``autograd.grad`` for the input's
    gradient (keeping the graph) and for the weights'. ``factor`` = the split backward's
    time over the whole one's, at least 1."""
    tokens, d_in, d_out = sizes.linear[0]
    blocks = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(d_in, d_out),
                                                       torch.nn.GELU(),
                                                       torch.nn.Linear(d_out, d_in))
                                   for _ in range(2))).to(device)
    weights = list(blocks.parameters())
    x = torch.randn(tokens, d_in, device=device, requires_grad=True)
    grad = torch.randn(tokens, d_in, device=device)

    def forward() -> None:
        with torch.no_grad():
            blocks(x)

    def whole() -> None:
        blocks(x).backward(grad)
        x.grad = None
        for w in weights:
            w.grad = None

    def split() -> None:
        out = blocks(x)
        torch.autograd.grad(out, x, grad, retain_graph=True)
        torch.autograd.grad(out, weights, grad)

    forward_s, whole_s, split_s = (median_seconds(f, device, sizes)
                                   for f in (forward, whole, split))
    factor = max(1.0, (split_s - forward_s) / max(whole_s - forward_s, 1e-12))
    log.info("split backward: %.2fx one pass", factor)
    return {"shape": [tokens, d_in, d_out], "forward_s": forward_s,
            "forward_backward_s": whole_s, "forward_split_backward_s": split_s,
            "factor": factor}


def matmul_overhead(samples: list[dict], rate: float) -> float:
    """The fixed time per matmul call beyond its FLOPs at ``rate`` (the best size's):
    ``t = flops / rate + overhead`` fitted by least squares on relative error, so the
    small sizes, which show it, weigh as much as the large. 0 or more."""
    weights = [1 / s["seconds"] ** 2 for s in samples]
    excess = [s["seconds"] - 2 * s["m"] * s["k"] * s["n"] / rate for s in samples]
    return max(0.0, sum(w * e for w, e in zip(weights, excess)) / sum(weights))


def measure_op_overhead(device: torch.device, sizes: Sizes, chain: int = 64) -> dict:
    """Eager dispatch per op, forward and backward: a chain of ``chain`` element-wise ops
    on a 16-element tensor that needs a gradient (so autograd records each), timed
    forward alone and forward then backward; what one op costs whatever its size."""
    x = torch.ones(16, device=device, requires_grad=True)

    def forward() -> torch.Tensor:
        y = x
        for _ in range(chain):
            y = y * 1.0001
        return y

    def both() -> None:
        forward().sum().backward()

    forward_s = median_seconds(forward, device, sizes) / chain
    total_s = median_seconds(both, device, sizes) / chain
    result = {"chain": chain, "forward_s": forward_s,
              "backward_s": max(0.0, total_s - forward_s)}
    log.info("op overhead: %s forward, %s backward per op",
             format_seconds(result["forward_s"]), format_seconds(result["backward_s"]))
    return result


def measure_kernel_overhead(device: torch.device, sizes: Sizes,
                            kernels: int = 256) -> dict | None:
    """A GPU's own time per kernel whatever its size: ``kernels`` multiplies of a
    16-element tensor queued while a long kernel holds the GPU, so that they run back to
    back from a full queue (as a layer's kernels do behind a host that dispatches ahead)
    and not at the host's pace; their span over their number. ``queued_s``: the host's
    time to launch them, under the hold when the figure is the GPU's alone. None on a
    CPU, whose time per op is the op overhead."""
    if device.type != "cuda":
        return None
    x = torch.ones(16, device=device)
    hold_s = 0.05
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        hertz = 1e3 * getattr(torch.cuda.get_device_properties(device), "clock_rate",
                              1.5e6)   # kHz
        cycles = int(hold_s * hertz)

        def hold() -> None:
            sleep(cycles)
    else:   # matmuls long enough to hold it as long
        a = torch.ones(4096, 4096, device=device, dtype=torch.bfloat16)

        def hold() -> None:
            for _ in range(32):
                torch.mm(a, a)

    def span() -> tuple[float, float]:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        hold()
        start.record()
        queued = time.perf_counter()
        for _ in range(kernels):
            x.mul_(1.0)
        queued = time.perf_counter() - queued
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / kernels, queued

    for _ in range(max(1, sizes.warmup)):
        span()
    spans = [span() for _ in range(max(3, sizes.repeats))]
    result = {"kernels": kernels, "per_kernel_s": statistics.median(s for s, _ in spans),
              "queued_s": statistics.median(q for _, q in spans)}
    log.info("kernel overhead: %s per kernel (%d kernels, queued in %s)",
             format_seconds(result["per_kernel_s"]), kernels,
             format_seconds(result["queued_s"]))
    return result


def measure_elementwise(device: torch.device, sizes: Sizes,
                        overhead: dict | None = None) -> dict:
    """The memory-bound ops of training, forward and backward as autograd runs them: a
    residual add, a layer norm, a scale, a mask, a softmax and a GELU, each on its own
    (tokens, out) activation of ``sizes.linear[0]`` that needs a gradient. Their bytes
    are counted as ``passes/estimate`` counts them (tensor inputs read and outputs
    written; the norm's weights, parameters, left out), backward's as it counts a layer's
    backward (the ops autograd runs, :class:`partc.passes.helpers.op_bytes.MovedBytes`, with the
    kernels of the device's own where they differ); the ops' fixed cost per call
    (``overhead``, from :func:`measure_op_overhead`), which the cost model charges
    apart, is taken off. ``bytes_per_s`` = (forward + backward bytes) / (forward +
    backward) seconds: a CPU thread computes exp, erf and compares at well below its
    copy bandwidth."""
    from partc.passes.helpers.op_bytes import MovedBytes

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
    per_op = (overhead["forward_s"] + overhead["backward_s"]) if overhead else 0.0
    work_s = max(both_s - 6 * per_op, both_s / 2)
    result = {"shape": [tokens, width], "ops": 6, "forward_bytes": nbytes,
              "backward_bytes": counted.moved, "forward_s": forward_s,
              "forward_backward_s": both_s,
              "bytes_per_s": (nbytes + counted.moved) / work_s}
    log.info("element-wise ops, forward and backward: %s", _rate(result["bytes_per_s"]))
    return result


def measure_optimizer(device: torch.device, sizes: Sizes) -> dict:
    """``torch.optim.AdamW``'s step as a user builds it (torch's defaults for the device:
    a loop over the parameters on a CPU) over a transformer block's parameters of width
    ``sizes.linear[0]``'s input (two norms, attention's input and output projections, an
    MLP of 4x; weights and biases: 12 tensors). ``bytes_per_s`` counts the bytes the cost
    model charges a step (:attr:`partc.problem.Precision.step_bytes`: 28 per parameter
    for Adam in fp32) over the step's time: every pass over the state and the dispatch per
    tensor of an unfused step included."""
    from partc.problem import Precision

    width = sizes.linear[0][1]
    shapes = [(width,), (width,), (3 * width, width), (3 * width,), (width, width),
              (width,), (width,), (width,), (4 * width, width), (4 * width,),
              (width, 4 * width), (width,)]
    params = [torch.nn.Parameter(torch.randn(shape, device=device)) for shape in shapes]
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    seconds = median_seconds(optimizer.step, device, sizes)
    count = sum(param.numel() for param in params)
    nbytes = count * Precision(compute_bytes=4, optimizer_state_bytes=8).step_bytes
    result = {"optimizer": "AdamW", "tensors": len(params), "params": count,
              "seconds": seconds, "bytes_counted": nbytes, "bytes_per_s": nbytes / seconds}
    log.info("optimizer step (AdamW): %s", _rate(result["bytes_per_s"]))
    return result


def measure_attention(device: torch.device, dtypes: tuple[str, ...], sizes: Sizes) -> dict:
    b, h, s, d = sizes.attention
    result = {"shape": {"batch": b, "heads": h, "seq": s, "head_dim": d},
              "flops_counted": "forward only: 4*b*h*s^2*d, half that when causal"}
    for key in dtypes:
        if key == "tf32":  # a matmul mode of float32 inputs: attention runs once per dtype
            continue
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=_TORCH_DTYPES[key])
                   for _ in range(3))
        for causal in (False, True):
            with torch.no_grad():
                seconds = median_seconds(
                    lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                    device, sizes)
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            name = f"{key}{'_causal' if causal else ''}"
            result[name] = {"dtype": key, "causal": causal, "seconds": seconds,
                            "flops": flops, "flops_per_s": flops / seconds}
            log.info("attention %s: %s", name, _flops(flops / seconds))
    return result


def measure_memory(device: torch.device, sizes: Sizes) -> dict:
    numel = sizes.memory_bytes // 4
    a, b, out = (torch.ones(numel, device=device) for _ in range(3))
    copy_s = median_seconds(lambda: out.copy_(a), device, sizes)
    add_s = median_seconds(lambda: torch.add(a, b, out=out), device, sizes)
    result = {"tensor_bytes": numel * 4,
              "copy": {"seconds": copy_s, "bytes_moved": 2 * numel * 4,
                       "bytes_per_s": 2 * numel * 4 / copy_s},
              "add": {"seconds": add_s, "bytes_moved": 3 * numel * 4,
                      "bytes_per_s": 3 * numel * 4 / add_s}}
    result["best_bytes_per_s"] = max(result["copy"]["bytes_per_s"], result["add"]["bytes_per_s"])
    log.info("memory: copy %s, add %s", _rate(result["copy"]["bytes_per_s"]),
             _rate(result["add"]["bytes_per_s"]))
    return result


# ------------------------------------------------------------------------ collectives

def ring_steps(kind: str, ranks: int) -> int:
    """Latency terms of one collective in a ring of ``ranks``."""
    if kind == "send_recv":
        return 1
    return 2 * (ranks - 1) if kind == "all_reduce" else ranks - 1


def ring_factor(kind: str, ranks: int) -> float:
    """Bytes each rank sends, per byte of the whole tensor (send/recv: of the message)."""
    return 1.0 if kind == "send_recv" else ring_steps(kind, ranks) / ranks


@dataclass(frozen=True)
class LinkFit:
    """``t = steps · latency_s + factor · bytes / bandwidth`` (ring_steps, ring_factor)."""

    latency_s: float
    bandwidth: float

    def predict(self, kind: str, nbytes: float, ranks: int) -> float:
        return (ring_steps(kind, ranks) * self.latency_s
                + ring_factor(kind, ranks) * nbytes / self.bandwidth)


def fit_link(samples: list[tuple[str, float, float]], ranks: int) -> LinkFit:
    """Least squares of relative error over (kind, bytes, seconds) samples, both
    coefficients kept non-negative. Relative, so small messages (which fix the latency)
    count as much as large ones (which fix the bandwidth)."""
    rows = [(ring_steps(kind, ranks) / t, ring_factor(kind, ranks) * nbytes / t)
            for kind, nbytes, t in samples]
    latency, seconds_per_byte = _nonnegative_least_squares(rows)
    if seconds_per_byte <= 0:
        raise CalibrationError("collective times do not grow with message size; measure "
                               "larger messages (drop --quick)")
    return LinkFit(latency_s=latency, bandwidth=1 / seconds_per_byte)


def _nonnegative_least_squares(rows: list[tuple[float, float]]) -> tuple[float, float]:
    """argmin over x, y >= 0 of sum (a·x + b·y - 1)^2 for rows (a, b)."""
    aa = sum(a * a for a, _ in rows)
    bb = sum(b * b for _, b in rows)
    ab = sum(a * b for a, b in rows)
    a1 = sum(a for a, _ in rows)
    b1 = sum(b for _, b in rows)
    candidates = [(a1 / aa, 0.0), (0.0, b1 / bb)]
    det = aa * bb - ab * ab
    if det > 0:
        x, y = (a1 * bb - b1 * ab) / det, (b1 * aa - a1 * ab) / det
        if x >= 0 and y >= 0:
            candidates.append((x, y))
    return min(candidates, key=lambda xy: sum((a * xy[0] + b * xy[1] - 1) ** 2 for a, b in rows))


def _fit_record(fit: LinkFit, samples: list[tuple[str, float, float]], ranks: int) -> dict:
    errors = [abs(fit.predict(kind, nbytes, ranks) - t) / t for kind, nbytes, t in samples]
    return {"latency_s": fit.latency_s, "bandwidth": fit.bandwidth,
            "median_rel_error": statistics.median(errors), "max_rel_error": max(errors)}


def measure_collectives(options: CalibrationOptions) -> dict:
    """Spawn the ranks, time the collectives, fit each one and all of them together."""
    ranks = options.processes
    backend = "nccl" if options.device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="partc-calibrate-") as folder:
        out = Path(folder) / "collectives.json"
        log.info("collectives: %d %s processes, %d sizes", ranks, backend,
                 len(options.sizes.message_bytes))
        try:
            mp.spawn(_collective_worker, nprocs=ranks, join=True,
                     args=(ranks, str(Path(folder) / "store"), backend, options.sizes,
                           str(out)))
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            # A rank past the last barrier (its marker, ``_collective_worker``) proves
            # every rank measured everything and rank 0 wrote it: a rank killed after
            # that (gloo's threads can abort at interpreter exit) leaves the figures whole.
            if not (out.exists() and any(Path(folder).glob(f"{DONE_MARKER}*"))):
                raise CalibrationError(f"the {backend} collective measurement failed: "
                                       f"{error}") from None
            log.warning("collectives: a rank ended abnormally after the measurements were "
                        "done (%s); the figures stand", error)
        timed = json.loads(out.read_text())
    result = {"processes": ranks, "backend": backend, "model": "t = steps*latency_s + "
              "factor*bytes/bandwidth (ring: all_reduce steps 2(n-1), factor 2(n-1)/n; "
              "all_gather/reduce_scatter n-1, (n-1)/n; send_recv 1, 1)"}
    result["overlap"] = timed["overlap"]
    for key in ("linear_all_busy", "elementwise_all_busy", "optimizer_all_busy", "fsdp"):
        if key in timed:   # FSDP's: on a CPU only
            result[key] = timed[key]

    log.info("overlap: %.2f of an all-reduce hidden by compute beside it",
             timed["overlap"]["overlap"])
    result |= _fits(timed, ranks)
    for kind in COLLECTIVES:
        result[kind] = {"steps": ring_steps(kind, ranks), "factor": ring_factor(kind, ranks),
                        **result[kind]}
    if "between_compute" in timed:   # on a CPU only
        between = timed["between_compute"]
        try:   # its samples as measured, each kind's fit beside them
            result["between_compute"] = between | _fits(between, ranks)
        except CalibrationError as error:   # the budget keeps the back-to-back fits
            log.warning("collectives between compute: no joint fit: %s", error)
    return result


def _fits(timed: dict, ranks: int) -> dict:
    """Each collective's samples in ``timed`` with its own fit, and the joint fit over
    all of them (which raises a CalibrationError where noise hides every growth)."""
    result, everything = {}, []
    for kind in COLLECTIVES:
        samples = [(kind, s["bytes"], s["seconds"]) for s in timed[kind]]
        everything += samples
        result[kind] = {"samples": timed[kind], "fit": _own_fit(kind, samples, ranks)}
    result["joint_fit"] = _fit_record(fit_link(everything, ranks), everything, ranks)
    return result


def _own_fit(kind: str, samples: list[tuple[str, float, float]], ranks: int) -> dict | None:
    """One collective's fit, or None when noise hides its growth with size (the joint
    fit, over all four, decides the budget's numbers)."""
    try:
        fit = fit_link(samples, ranks)
    except CalibrationError as error:
        log.warning("%s: no fit: %s", kind, error)
        return None
    log.info("%s: latency %s per step, %s per link", kind, format_seconds(fit.latency_s),
             _rate(fit.bandwidth))
    return _fit_record(fit, samples, ranks) | {"alpha_s": ring_steps(kind, ranks) * fit.latency_s}


# A file each collective rank makes beside the output once every rank is done.
DONE_MARKER = "done-rank"


def _collective_worker(rank: int, ranks: int, store: str, backend: str, sizes: Sizes,
                       out: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.FileStore(store, ranks), rank=rank,
                            world_size=ranks, timeout=timedelta(minutes=5))
    try:
        timed = {kind: [] for kind in COLLECTIVES}
        # On a CPU each collective again as a step meets it (:class:`_BetweenCompute`).
        between = _BetweenCompute(device, sizes) if device.type == "cpu" else None
        for nbytes in sizes.message_bytes:
            numel = max(ranks, nbytes // 4 // ranks * ranks)
            for kind in COLLECTIVES:
                op = _collective(kind, numel, rank, ranks, device)
                # A ping-pong call is a round trip: two messages.
                messages = 2 if kind == "send_recv" else 1
                seconds = _collective_seconds(op, device, sizes) / messages
                timed[kind].append({"bytes": numel * 4, "seconds": seconds})
                if between is not None:
                    seconds = between.seconds(op) / messages
                    between.timed[kind].append({"bytes": numel * 4, "seconds": seconds})
        if between is not None:
            timed["between_compute"] = between.timed
        timed["overlap"] = _overlap(ranks, device, sizes)
        dist.barrier()   # every rank computes at once, as in training
        busy = replace(sizes, min_sample_s=max(sizes.min_sample_s, BUSY_SAMPLE_S))
        timed["linear_all_busy"] = measure_linear(device, ("float32", "bfloat16"), busy)
        overhead = measure_op_overhead(device, busy)
        timed["elementwise_all_busy"] = measure_elementwise(device, busy, overhead)
        timed["optimizer_all_busy"] = measure_optimizer(device, busy)
        if device.type == "cpu":
            timed["fsdp"] = measure_fsdp(device, sizes)

        if rank == 0:
            Path(out).write_text(json.dumps(timed))
        dist.barrier()
        # Every rank is past the barrier, so rank 0 has written everything.
        Path(out).with_name(f"{DONE_MARKER}{rank}").touch()
    finally:
        dist.destroy_process_group()


# The compute a rank runs before each collective timed "between compute": about what a
# training step runs between two of its collectives (a layer's share of a step).
BETWEEN_COMPUTE_S = 2e-3


class _BetweenCompute:
    """Collectives timed as a training step meets them: every call after
    ``BETWEEN_COMPUTE_S`` of compute (a linear layer and a GELU), timed alone by wall
    clock from the call to its end on each rank, waits for the other ranks included.

    Back to back, gloo's threads stay awake and the ranks arrive together; inside a step
    they are woken after each burst of compute and the ranks arrive apart by the noise in
    it. On a 2-core machine an all-reduce of 768 KiB measured 0.6-1.0 ms back to back and
    1.5-3 ms between compute, the time the tensor-parallel runtime's all-reduces took.
    A figure is the slowest rank's mean over the calls (a step pays every call, its
    slow ones included)."""

    def __init__(self, device: torch.device, sizes: Sizes) -> None:
        tokens, d_in, d_out = sizes.linear[0]
        a = torch.randn(tokens, d_in, device=device)
        b = torch.randn(d_in, d_out, device=device)
        self.unit = lambda: F.gelu(a @ b)
        unit_s = median_seconds(self.unit, device, sizes)
        self.units = max(1, round(BETWEEN_COMPUTE_S / max(unit_s, 1e-9)))
        self.calls, self.device, self.sizes = 4 * sizes.repeats, device, sizes
        # What the profile keeps: the compute before each call and the samples per kind.
        self.timed: dict = {"compute_s": self.units * unit_s, "calls": self.calls,
                            **{kind: [] for kind in COLLECTIVES}}

    def seconds(self, op: Callable[[], object]) -> float:
        for _ in range(self.sizes.warmup):
            op()
        dist.barrier()
        total = 0.0
        for _ in range(self.calls):
            for _ in range(self.units):
                self.unit()
            start = time.perf_counter()
            op()
            total += time.perf_counter() - start
        return _slowest(total / self.calls, self.device)


def _overlap(ranks: int, device: torch.device, sizes: Sizes) -> dict:
    """How much of an all-reduce compute running beside it hides: the all-reduce alone
    (``T_a``), matmuls of about as long alone (``T_c``), and the all-reduce started
    asynchronously with the matmuls run while it goes (``T_b``), each the slowest rank's
    median. ``overlap = (T_a + T_c - T_b) / min(T_a, T_c)``, clamped to [0, 1]: 1 when
    they run side by side, 0 when they take turns (gloo's threads on cores the ranks'
    compute fills)."""
    numel = max(ranks, min(sizes.message_bytes[-1], 16 * 2**20) // 4 // ranks * ranks)
    whole = torch.zeros(numel, device=device)
    tokens, d_in, d_out = sizes.linear[0]
    a = torch.randn(tokens, d_in, device=device)
    b = torch.randn(d_in, d_out, device=device)
    all_reduce_s = _collective_seconds(lambda: dist.all_reduce(whole), device, sizes)
    one = _slowest(median_seconds(lambda: a @ b, device, sizes), device)
    calls = max(1, round(all_reduce_s / one))

    def compute() -> None:
        for _ in range(calls):
            a @ b

    def both() -> None:
        work = dist.all_reduce(whole, async_op=True)
        compute()
        work.wait()

    compute_s = _collective_seconds(compute, device, sizes)
    both_s = _collective_seconds(both, device, sizes)
    hidden = (all_reduce_s + compute_s - both_s) / min(all_reduce_s, compute_s)
    return {"bytes": numel * 4, "all_reduce_s": all_reduce_s, "compute_s": compute_s,
            "both_s": both_s, "overlap": min(1.0, max(0.0, hidden))}


# FSDP units timed by measure_fsdp: enough that the root unit's hooks are a small share.
FSDP_UNITS = 8
# The budget's FSDP numbers (DeviceNumbers) and measure_fsdp's figures they are.
FSDP_FIGURES = {"fsdp_unit_overhead_s": "unit_forward_s",
                "fsdp_unit_overhead_backward_s": "unit_backward_s",
                "fsdp_gather_overhead_s": "gather_s",
                "fsdp_scatter_overhead_s": "scatter_s",
                "fsdp_step_overhead_s": "step_s", "fsdp_copy_bandwidth": "copy_bytes_per_s"}
# The tiny units' width: their copies cost next to nothing.
FSDP_TINY_WIDTH = 8


def block_shapes(width: int) -> list[tuple[int, ...]]:
    """A transformer block's parameters of width ``width``: two norms, attention's input
    and output projections, an MLP of 4x; weights and biases: 12 tensors."""
    return [(width,), (width,), (3 * width, width), (3 * width,), (width, width),
            (width,), (width,), (width,), (4 * width, width), (4 * width,),
            (width, 4 * width), (width,)]


class _Block(torch.nn.Module):
    """A unit holding a transformer block's parameters; its forward uses each once."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(shape) / width)
                                              for shape in block_shapes(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(weight.sum() for weight in self.weights)


def measure_fsdp(device: torch.device, sizes: Sizes, units: int = FSDP_UNITS) -> dict:
    """FSDP2's own work per unit and microbatch over the ranks' process group, as
    ``partc.runtime`` runs ZeRO-2/3, beside the collectives: ``units`` units of a
    transformer block's 12 parameter tensors (:func:`block_shapes`) under a root, timed
    forward and forward + backward against the same modules without FSDP, by the rank
    thread's CPU time (``time.thread_time``): the collectives run on gloo's threads while
    it waits, and the cost model prices them apart. Per unit, the root's share included,
    at a tiny width (``FSDP_TINY_WIDTH``: the fixed work):

    - ZeRO-2 accumulating (no gradient sync): its forward and backward hooks
      (``unit_forward_s``, ``unit_backward_s``);
    - ZeRO-2 reducing every microbatch: ``scatter_s``, its backward's excess over that;
    - ZeRO-3 (gathered again in forward and backward, freed after each): ``gather_s``,
      its forward's excess over ZeRO-2's;
    - ``torch.optim.AdamW``'s step over the sharded parameters (DTensors, dispatched per
      tensor and op) over its step over the plain ones: ``step_s``, per parameter tensor
      and step;

    and the same at the width of ``sizes.linear``'s first input, whose all-gather's and
    reduce-scatter's excess over the tiny ones' is their copies: ``copy_bytes_per_s`` is
    the bytes the cost model counts for them (read and written, the whole unit and the
    rank's shard: 2 (1 + 1/n) per byte of weights or gradients) over that time."""
    ranks = dist.get_world_size()
    tiny = _fsdp_figures(device, sizes, units, FSDP_TINY_WIDTH)
    wide = _fsdp_figures(device, sizes, units, sizes.linear[0][1])
    params = {width: sum(math.prod(shape) for shape in block_shapes(width))
              for width in (FSDP_TINY_WIDTH, sizes.linear[0][1])}
    added = params[sizes.linear[0][1]] - params[FSDP_TINY_WIDTH]
    copied = 2 * (1 + 1 / ranks) * 4 * added
    copy_s = (wide["gather_s"] - tiny["gather_s"]) + (wide["scatter_s"] - tiny["scatter_s"])
    result = {"units": units, "clock": "thread CPU time", "tiny": tiny, "wide": wide,
              "params_per_unit": params, "copied_bytes": 2 * copied, "copy_s": copy_s,
              "copy_bytes_per_s": 2 * copied / copy_s if copy_s > 0 else None}
    result.update({key: tiny[key] for key in ("unit_forward_s", "unit_backward_s",
                                              "gather_s", "scatter_s", "step_s")})
    log.info("FSDP per unit and microbatch: hooks %s forward, %s backward; %s per "
             "all-gather, %s per reduce-scatter, %s per tensor's optimizer step, copies "
             "at %s",
             *(format_seconds(result[key]) for key in (
                 "unit_forward_s", "unit_backward_s", "gather_s", "scatter_s", "step_s")),
             _rate(result["copy_bytes_per_s"]) if result["copy_bytes_per_s"] else "-")
    return result


def _fsdp_figures(device: torch.device, sizes: Sizes, units: int, width: int) -> dict:
    """:func:`measure_fsdp`'s four timings of ``units`` blocks of ``width``, and the
    figures per unit they give."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    x = torch.randn(4, width, device=device)
    fixed = replace(sizes, clock=time.thread_time)

    def blocks(zero: int, sync: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(_Block(width) for _ in range(units))).to(device)
        if zero:
            for block in model:
                fully_shard(block, mesh=mesh, reshard_after_forward=zero >= 3)
            fully_shard(model, mesh=mesh, reshard_after_forward=zero >= 3)
            model.set_requires_gradient_sync(sync)
            model.set_reshard_after_backward(zero >= 3)
        return model

    def phases(model: torch.nn.Module) -> tuple[float, float, float]:
        def backward() -> None:
            model(x).sum().backward()
        forward_s = _collective_seconds(lambda: model(x).sum(), device, fixed)
        both_s = _collective_seconds(backward, device, fixed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        step_s = _collective_seconds(optimizer.step, device, fixed)
        return forward_s, both_s - forward_s, step_s

    plain = phases(blocks(0, True))
    hooks, reduced, gathered = (phases(blocks(zero, sync))
                                for zero, sync in ((2, False), (2, True), (3, True)))
    return {"width": width, "plain_s": plain, "zero2_accumulate_s": hooks,
            "zero2_reduce_s": reduced, "zero3_s": gathered,
            "step_s": max(0.0, (gathered[2] - plain[2]) / units / len(block_shapes(width))),
            "unit_forward_s": max(0.0, (hooks[0] - plain[0]) / units),
            "unit_backward_s": max(0.0, (hooks[1] - plain[1]) / units),
            "scatter_s": max(0.0, (reduced[1] - hooks[1]) / units),
            "gather_s": max(0.0, (gathered[0] - hooks[0]) / units)}


def _collective(kind: str, numel: int, rank: int, ranks: int, device: torch.device):
    """A closure running one ``kind`` collective on ``numel`` float32 elements."""
    whole = torch.zeros(numel, device=device)
    part = torch.zeros(numel // ranks, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(whole)
    if kind == "all_gather":
        return lambda: ALL_GATHER_SINGLE(whole, part)
    if kind == "reduce_scatter":
        return lambda: REDUCE_SCATTER_SINGLE(part, whole)
    # send/recv: ranks 0 and 1 play ping-pong, the others wait.
    if rank > 1:
        return lambda: None
    peer = 1 - rank

    def ping_pong():
        if rank == 0:
            dist.send(whole, peer)
            dist.recv(whole, peer)
        else:
            dist.recv(whole, peer)
            dist.send(whole, peer)
    return ping_pong


def _collective_seconds(op: Callable[[], object], device: torch.device, sizes: Sizes) -> float:
    """Median seconds per call; every rank runs the same number of calls per sample and a
    sample is the slowest rank's time (on a CPU by ``sizes.clock``)."""
    clock = sizes.clock
    for _ in range(sizes.warmup):
        op()
    one = _slowest(_elapsed(op, device, 1, clock), device)
    calls = _calls_per_sample(one, sizes)
    samples = []
    for _ in range(sizes.repeats):
        dist.barrier()
        samples.append(_slowest(_elapsed(op, device, calls, clock) / calls, device))
    return statistics.median(samples)


def _slowest(seconds: float, device: torch.device) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


# ---------------------------------------------------------------------------- profile

def calibrate(options: CalibrationOptions) -> dict:
    """Measure everything ``options`` asks for; return the profile (JSON-ready)."""
    device = torch.device("cuda", 0) if options.device == "cuda" else torch.device("cpu")
    threads = _threads_per_process(options)
    host = {"cores": _cores(), "load_average_before": _load_average()}
    if _busy(host):
        log.warning("the machine is busy (load average %.1f on %d cores): figures will be "
                    "low and noisy", host["load_average_before"], host["cores"])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        measured = {"matmul": measure_matmul(device, options.dtypes, options.sizes),
                    "linear": measure_linear(device, options.dtypes, options.sizes),
                    "split_backward": measure_split_backward(device, options.sizes),
                    "attention": measure_attention(device, options.dtypes, options.sizes),
                    "memory": measure_memory(device, options.sizes),
                    "op_overhead": measure_op_overhead(device, options.sizes)}
        try:
            kernel = measure_kernel_overhead(device, options.sizes)
        except (RuntimeError, AttributeError) as error:   # the profile keeps the preset's
            log.warning("kernel overhead not measured: %s", error)
            kernel = None
        if kernel is not None:
            measured["kernel_overhead"] = kernel
        measured["elementwise"] = measure_elementwise(device, options.sizes,
                                                      measured["op_overhead"])
        measured["optimizer"] = measure_optimizer(device, options.sizes)
    finally:
        torch.set_num_threads(before)
    if options.processes > 1:
        measured["collectives"] = measure_collectives(options)
    else:
        log.info("collectives: skipped, one process")
    host["load_average_after"] = _load_average()
    return build_profile(options, measured, name=device_name(options.device), threads=threads,
                         host=host)


def write_profile(profile: dict, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(profile, indent=1) + "\n")


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def known_preset(device: str, name: str) -> str | None:
    """The preset for this device: the GPU's own (vendor figures), or the generic "CPU"."""
    if device == "cpu":
        return "CPU"
    upper = name.upper()
    if "H200" in upper:
        return "H200"
    if "H100" in upper:
        return "H100-80GB"
    if "A100" in upper:
        return "A100-40GB" if "40GB" in upper else "A100-80GB"
    return None


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _load_average() -> float | None:
    """Runnable processes over the last minute (Unix); the calibration's own count too."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _busy(host: dict) -> bool:
    """Other work holds half the cores or more: timings will be low and noisy."""
    load = host["load_average_before"]
    return load is not None and load >= host["cores"] / 2


def _threads_per_process(options: CalibrationOptions) -> int:
    if options.device == "cuda":
        return torch.get_num_threads()
    return max(1, _cores() // options.processes)


def _device_memory(options: CalibrationOptions) -> int | None:
    if options.device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // options.processes
    except (AttributeError, ValueError, OSError):
        return None


def build_profile(options: CalibrationOptions, measured: dict, *, name: str,
                  threads: int, host: dict) -> dict:
    """The profile file's content: what was measured and the numbers DeviceBudget needs."""
    preset_name = known_preset(options.device, name)
    vendor = PRESETS[preset_name] if preset_name and options.device == "cuda" else None
    achieved = {key: m["best_flops_per_s"] for key, m in measured["matmul"].items()}
    peak = {key: vendor.peak_flops.get(key, flops) if vendor else flops
            for key, flops in achieved.items()}
    # A model's layers run at the rate of training's linear-layer matmuls (forward and
    # both backward products), measured with every rank computing at once where the
    # ranks were spawned; tf32 (a matmul mode, no linear measured) by its square matmul.
    linear = measured.get("collectives", {}).get("linear_all_busy") or measured.get("linear", {})
    efficiency = {key: min(1.0, (linear[key]["flops_per_s"] if key in linear
                                 else achieved[key]) / peak[key]) for key in achieved}
    training = "bfloat16" if options.device == "cuda" else "float32"
    # The links as a step meets them: on a CPU the collectives timed between compute
    # (:class:`_BetweenCompute`) where they were fitted, else back to back.
    collectives = measured.get("collectives", {})
    links = step_links(collectives)
    link = links.get("joint_fit")
    overlap = collectives.get("overlap")
    # Element-wise ops and the optimizer step likewise, every rank at once where spawned
    # (they share the memory bus). A GPU runs its element-wise kernels somewhat below its
    # copy rate, and torch's AdamW (foreach) passes over the state several times: an
    # H100 stepped 0.3 of its copy rate in the cost model's bytes.
    busy = {key: measured.get("collectives", {}).get(f"{key}_all_busy") or measured.get(key)
            for key in ("elementwise", "optimizer")}

    # Dispatch per op: on a CPU it adds to every op's time, on a GPU it is the floor
    # under a layer's kernels (DeviceNumbers.dispatch_ahead); either way the measured
    # figure. The matmul overhead only on a CPU: a GPU's small matmuls are launch-bound,
    # which the dispatch floor already prices.
    cpu = options.device == "cpu"
    overhead = measured.get("op_overhead")
    fsdp = measured.get("collectives", {}).get("fsdp")
    budget = {
        "peak_flops": peak,
        "achieved_flops": achieved,
        "flops_efficiency_by_dtype": efficiency,
        "training_dtype": training,
        "flops_efficiency": efficiency[training],
        "memory": _device_memory(options),
        "hbm_bandwidth": measured["memory"]["best_bytes_per_s"],
        "devices_per_node": (torch.cuda.device_count() if options.device == "cuda"
                             else options.processes),
        "intra_node_bandwidth": link["bandwidth"] if link else None,
        "intra_node_latency_s": link["latency_s"] if link else None,
        "link_latency_s": None,      # between nodes: not measurable from one machine
        "inter_node_bandwidth": None,
        "collective_links": {
            kind: ({"latency_s": fit["latency_s"], "bandwidth": fit["bandwidth"]}
                   if (fit := links[kind]["fit"]) else None)
            for kind in COLLECTIVES} if "collectives" in measured else {},
        "op_overhead_s": overhead["forward_s"] if overhead else None,
        "op_overhead_backward_s": overhead["backward_s"] if overhead else None,
        "matmul_overhead_s": (measured["matmul"][training].get("overhead_s") if cpu
                              else None),
        "kernel_overhead_s": (measured["kernel_overhead"]["per_kernel_s"]
                              if "kernel_overhead" in measured else None),
        "comm_overlap": overlap["overlap"] if overlap else None,
        "split_backward_factor": (measured["split_backward"]["factor"]
                                  if "split_backward" in measured else None),
        "elementwise_bandwidth": (busy["elementwise"]["bytes_per_s"]
                                  if busy["elementwise"] else None),
        "optimizer_bandwidth": (busy["optimizer"]["bytes_per_s"]
                                if busy["optimizer"] else None),
        # FSDP's host work: measured on a CPU only, where ranks were spawned.
        **{name: fsdp[key] if cpu and fsdp else None for name, key in FSDP_FIGURES.items()},
    }
    return {
        "schema": PROFILE_SCHEMA,
        "schema_version": PROFILE_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mode": "quick" if options.quick else "full",
        "device": {"kind": options.device, "name": name, "preset": preset_name,
                   "processes": options.processes, "threads_per_process": threads},
        "software": {"torch": torch.__version__, "python": platform.python_version(),
                     "cuda": torch.version.cuda},
        "host": host,
        "budget": budget,
        "sources": _sources(options, preset_name, vendor is not None, training, link,
                            between=links is not collectives),
        "measurements": measured,
        "notes": _notes(options, threads, achieved, peak, host),
    }


def _sources(options: CalibrationOptions, preset_name: str | None, vendor: bool,
             training: str, link: dict | None, *, between: bool = False) -> dict[str, str]:
    """Where each budget number came from; null numbers fall back as said here."""
    fallback = (f"not measured: DeviceBudget uses preset {preset_name}'s" if preset_name
                else "not measured: give it to DeviceBudget")
    ranks = f"{options.processes} {'NCCL' if options.device == 'cuda' else 'gloo'} processes"
    timed = ranks + (f", each call after {BETWEEN_COMPUTE_S * 1e3:g} ms of compute as in "
                     f"a step" if between else ", back to back")
    return {
        "peak_flops": (f"vendor figures of preset {preset_name}" if vendor else
                       "measured: best matmul throughput per dtype (no vendor figures)"),
        "flops_efficiency": (f"measured: {training} linear layers' forward and backward "
                             f"matmuls" + (f", every one of {ranks} computing at once,"
                                           if link else "")
                             + f" / peak_flops.{training}"),
        "memory": ("total memory of GPU 0" if options.device == "cuda" else
                   f"physical memory / {options.processes} processes"),
        "hbm_bandwidth": "measured: best of copy and add, bytes read + written per second",
        "devices_per_node": ("GPUs torch sees" if options.device == "cuda" else
                             "processes calibrated: a CPU device is one process"),
        "intra_node_bandwidth": (f"measured: joint ring fit of the collectives over {timed}"
                                 if link else f"{fallback} (one process: no link to time)"),
        "intra_node_latency_s": (f"measured: joint ring fit, latency per ring step over "
                                 f"{timed}" if link else
                                 f"{fallback} (one process: no link to time)"),
        "link_latency_s": f"{fallback} (one machine cannot measure the network between "
                          f"nodes)",
        "collective_links": (f"measured: each collective's own ring fit over {timed}, "
                             f"inside a node (a kind without a fit takes the joint one)"
                             if link else f"{fallback} (one process: no link to time)"),
        "op_overhead_s": "measured: a chain of tiny element-wise ops, forward, per op" + (
            "" if options.device == "cpu" else
            " (on a GPU the floor under a layer's kernels: launches run ahead of them)"),
        "op_overhead_backward_s": "measured: the same chain's backward, per forward op",
        "matmul_overhead_s": (f"measured: fit t = flops / best rate + overhead over the "
                              f"{training} matmul sizes" if options.device == "cpu"
                              else f"not used on GPUs (the dispatch floor prices small "
                                   f"matmuls): {preset_name or 'the'} preset's 0"),
        "inter_node_bandwidth": f"{fallback} (one machine cannot measure the network "
                                f"between nodes)",
        "kernel_overhead_s": ("measured: tiny kernels queued behind a long one, their span "
                              "per kernel" if options.device == "cuda" else
                              f"not measured on a CPU (its per-op time is op_overhead_s): "
                              f"{preset_name or 'the'} preset's 0"),
        "comm_overlap": (f"measured: an all-reduce over {ranks} alone, matmuls alone, "
                         f"and both at once" if link else
                         f"{fallback} (one process: no collective to overlap)"),
        "split_backward_factor": "measured: two linear blocks' backward as input then "
                                 "weight gradients (two autograd passes) over one pass",
        "elementwise_bandwidth": (f"measured: add, layer norm, scale, mask, softmax and "
                                  f"GELU forward and backward, bytes as partc counts "
                                  f"them" + (f", every one of {ranks} computing at once"
                                             if link else "")),
        "optimizer_bandwidth": (f"measured: torch.optim.AdamW's step over a transformer "
                                f"block's parameters, in the bytes the cost model counts"
                                + (f", every one of {ranks} computing at once"
                                   if link else "")),
        **{name: (f"measured: FSDP2 over {ranks} on {FSDP_UNITS} units of a transformer "
                  f"block's 12 tensors, ZeRO-2 accumulating, reducing and ZeRO-3, against "
                  f"the same modules without it, by the rank thread's CPU time, per unit "
                  f"and microbatch ({key}; the copies' rate from a tiny and a wide "
                  f"width)" if options.device == "cpu" and link else
                  f"{fallback} (one process: no process group to shard over)"
                  if options.device == "cpu" else
                  ("not used on GPUs: hbm_bandwidth" if name == "fsdp_copy_bandwidth" else
                   f"not used on GPUs (host work ahead of the kernels): "
                   f"{preset_name or 'the'} preset's 0"))
           for name, key in FSDP_FIGURES.items()},
    }


def _notes(options: CalibrationOptions, threads: int, achieved: dict, peak: dict,
           host: dict) -> list[str]:
    notes = []
    if _busy(host):
        notes.append(f"the machine was busy when the run started (load average "
                     f"{host['load_average_before']:.1f} on {host['cores']} cores): figures "
                     f"are likely low and noisy; calibrate on an idle machine")
    if options.device == "cpu":
        notes.append(f"compute and memory were measured in one process with {threads} "
                     f"thread(s), the others idle; {options.processes} ranks running at "
                     f"once share memory bandwidth")
        if options.processes > _cores():
            notes.append("more processes than cores: collective times include waiting "
                         "for a core")
    for key in achieved:
        if achieved[key] > peak[key]:
            notes.append(f"{key} matmul measured above the vendor peak; efficiency set to 1")
    if options.quick:
        notes.append("quick run: small sizes and few repeats; figures are rough")
    return notes


# ---------------------------------------------------------------------------- summary

def _flops(value: float) -> str:
    return f"{value / 1e12:.1f} TFLOP/s" if value >= 1e12 else f"{value / 1e9:.1f} GFLOP/s"


def _rate(value: float) -> str:
    return f"{value / 1e9:.2f} GB/s" if value >= 1e9 else f"{value / 1e6:.1f} MB/s"


def summary(profile: dict) -> str:
    """A short table: what was measured, and the budget's numbers beside the preset's."""
    device, measured = profile["device"], profile["measurements"]
    lines = [f"partc calibrate: {device['name']} ({device['kind']}, {device['processes']} "
             f"processes x {device['threads_per_process']} thread(s)), torch "
             f"{profile['software']['torch']}, {profile['mode']} run", "",
             f"{'measured':<30}{'figure'}"]
    for key, matmul in measured["matmul"].items():
        best = max(matmul["samples"], key=lambda s: s["flops_per_s"])
        lines.append(f"{'matmul ' + key:<30}{_flops(best['flops_per_s']):<16}"
                     f"best of {len(matmul['samples'])} sizes: {best['m']}x{best['k']}x{best['n']}")
    attention = measured["attention"]
    shape = "x".join(str(v) for v in attention["shape"].values())
    for name, entry in attention.items():
        if isinstance(entry, dict) and "flops_per_s" in entry:
            lines.append(f"{'attention ' + name:<30}{_flops(entry['flops_per_s']):<16}"
                         f"b x h x s x d = {shape}, fwd")
    memory = measured["memory"]
    lines.append(f"{'memory copy / add':<30}{_rate(memory['copy']['bytes_per_s'])} / "
                 f"{_rate(memory['add']['bytes_per_s'])}")
    for key, what in (("elementwise", "element-wise ops fwd+bwd"),
                      ("optimizer", "AdamW step")):
        if key in measured:
            lines.append(f"{what:<30}{_rate(measured[key]['bytes_per_s'])} in the cost "
                         f"model's bytes")
    collectives = measured.get("collectives", {})
    fits = {kind: collectives[kind]["fit"] for kind in COLLECTIVES if kind in collectives}
    if collectives:
        fits["joint_fit"] = collectives["joint_fit"]
    if between := collectives.get("between_compute"):   # timed as a step meets them
        fits |= {f"{kind}, in a step": between[kind]["fit"] for kind in COLLECTIVES}
        fits["joint_fit, in a step"] = between["joint_fit"]
    for kind, fit in fits.items():
        if fit is None:
            lines.append(f"{kind:<30}no fit: times do not grow with message size")
        else:
            lines.append(f"{kind:<30}{format_seconds(fit['latency_s']) + '/step':<16}"
                         f"{_rate(fit['bandwidth'])} per link, fit error median "
                         f"{fit['median_rel_error']:.0%} max {fit['max_rel_error']:.0%}")
    notes = [f"note: {note}" for note in profile["notes"]]
    return "\n".join(lines + [""] + _budget_rows(profile) + ([""] + notes if notes else []))


def _budget_rows(profile: dict) -> list[str]:
    budget, preset_name = profile["budget"], profile["device"]["preset"]
    preset = PRESETS.get(preset_name) if preset_name else None
    rows = [("peak_flops " + key, _flops(value),
             _flops(preset.peak_flops[key]) if preset and key in preset.peak_flops else "-")
            for key, value in budget["peak_flops"].items()]
    formats = {"flops_efficiency": "{:.2f}".format, "memory": lambda b: f"{b / 2**30:.1f} GiB",
               "hbm_bandwidth": _rate, "devices_per_node": str,
               "intra_node_bandwidth": _rate, "intra_node_latency_s": format_seconds,
               "link_latency_s": format_seconds, "inter_node_bandwidth": _rate,
               "op_overhead_s": format_seconds, "op_overhead_backward_s": format_seconds,
               "matmul_overhead_s": format_seconds, "kernel_overhead_s": format_seconds,
               "comm_overlap": "{:.2f}".format,
               "split_backward_factor": "{:.2f}".format, "elementwise_bandwidth": _rate,
               "optimizer_bandwidth": _rate} | {
                   name: _rate if name.endswith("bandwidth") else format_seconds
                   for name in FSDP_FIGURES}
    for key, show in formats.items():
        mine = "(preset)" if budget.get(key) is None else show(budget[key])
        theirs = getattr(preset, key) if preset else None
        rows.append((key, mine, "-" if theirs is None else show(theirs)))
    head = ("budget number", "profile", f"preset {preset_name}" if preset else "no preset")
    return [f"{a:<30}{b:<16}{c}" for a, b, c in (head, *rows)]
