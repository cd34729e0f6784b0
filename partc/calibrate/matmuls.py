"""FLOP rates: square matmuls, training's linear layers, a split backward and attention.

- matmul: achieved FLOP/s, 2·m·k·n per product, over a few square-ish sizes, per dtype
  (float32 and bfloat16 on CPU; float32, tf32, bfloat16 and float16 on CUDA). The best
  size's figure is the dtype's achieved throughput; a fit of ``t = flops / best +
  overhead`` over the sizes gives the fixed time per matmul call that makes small
  matmuls run below it (``matmul_overhead_s``).
- linear layers: a linear layer's forward and both backward products, as autograd runs
  them: the rate a model's layers reach (``flops_efficiency``).
- split backward: a backward run as the zero-bubble schedules run it, input then weight
  gradients, over one pass (``split_backward_factor``).
- attention: ``scaled_dot_product_attention`` forward on one (batch, heads, seq,
  head_dim) shape, counted as 4·b·h·s²·d FLOPs (its two matmuls), and half that when
  causal.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from partc.calibrate.calibration_options import Sizes
from partc.calibrate.stopwatch import format_flops, median_seconds

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "tf32": torch.float32,
                "bfloat16": torch.bfloat16, "float16": torch.float16}


class Fp32Precision:
    """fp32 matmuls as ``key`` asks: full fp32 ("highest") or TF32 tensor cores ("high")."""

    def __init__(self, key: str) -> None:
        self.wanted = "high" if key == "tf32" else "highest"

    def __enter__(self) -> None:
        self.before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(self.wanted)

    def __exit__(self, *exc) -> None:
        torch.set_float32_matmul_precision(self.before)


# ---------------------------------------------------------------------------- matmul

@dataclass(frozen=True, kw_only=True)
class MatmulSample:
    """One product ``(m, k) @ (k, n)``, timed."""

    m: int
    k: int
    n: int
    seconds: float                 # per product

    @property
    def flops_per_s(self) -> float:   # 2·m·k·n FLOPs over the seconds
        return 2 * self.m * self.k * self.n / self.seconds

    def to_dict(self) -> dict:
        return {"m": self.m, "k": self.k, "n": self.n, "seconds": self.seconds,
                "flops_per_s": self.flops_per_s}


@dataclass(frozen=True, kw_only=True)
class MatmulRate:
    """One dtype's products over the sizes, and what follows from them."""

    samples: tuple[MatmulSample, ...]

    @property
    def best(self) -> MatmulSample:
        return max(self.samples, key=lambda s: s.flops_per_s)

    @property
    def best_flops_per_s(self) -> float:   # FLOP/s: the dtype's achieved throughput
        return self.best.flops_per_s

    @property
    def overhead_s(self) -> float:         # seconds per call beyond the FLOPs at best
        return matmul_overhead(self.samples, self.best_flops_per_s)

    def to_dict(self) -> dict:
        return {"samples": [s.to_dict() for s in self.samples],
                "best_flops_per_s": self.best_flops_per_s, "overhead_s": self.overhead_s}


def measure_matmul(device: torch.device, dtypes: tuple[str, ...],
                   sizes: Sizes) -> dict[str, MatmulRate]:
    """Each dtype's ``torch.mm`` over ``sizes.matmul``."""
    result = {}
    for key in dtypes:
        samples = []
        for m, k, n in sizes.matmul:
            a = torch.randn(m, k, device=device, dtype=TORCH_DTYPES[key])
            b = torch.randn(k, n, device=device, dtype=TORCH_DTYPES[key])
            out = torch.empty(m, n, device=device, dtype=TORCH_DTYPES[key])
            with Fp32Precision(key):
                seconds = median_seconds(lambda: torch.mm(a, b, out=out), device, sizes)
            samples.append(MatmulSample(m=m, k=k, n=n, seconds=seconds))
            log.info("matmul %s %dx%dx%d: %s", key, m, k, n,
                     format_flops(samples[-1].flops_per_s))
        result[key] = MatmulRate(samples=tuple(samples))
    return result


def matmul_overhead(samples: Sequence[MatmulSample], rate: float) -> float:
    """The fixed time per matmul call beyond its FLOPs at ``rate`` (the best size's):
    ``t = flops / rate + overhead`` fitted by least squares on relative error, so the
    small sizes, which show it, weigh as much as the large. 0 or more."""
    weights = [1 / s.seconds ** 2 for s in samples]
    excess = [s.seconds - 2 * s.m * s.k * s.n / rate for s in samples]
    return max(0.0, sum(w * e for w, e in zip(weights, excess)) / sum(weights))


# ---------------------------------------------------------------------------- linear

@dataclass(frozen=True, kw_only=True)
class LinearSample:
    """A linear layer's forward and backward on (tokens, in) inputs to ``out`` features."""

    tokens: int
    d_in: int
    d_out: int
    seconds: float                 # per forward and backward

    @property
    def flops(self) -> int:        # three products of 2·tokens·in·out FLOPs
        return 3 * 2 * self.tokens * self.d_in * self.d_out

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "in": self.d_in, "out": self.d_out,
                "seconds": self.seconds, "flops_per_s": self.flops_per_s}


@dataclass(frozen=True, kw_only=True)
class LinearRate:
    """One dtype's linear layers over the sizes."""

    samples: tuple[LinearSample, ...]

    @property
    def flops_per_s(self) -> float:   # all their FLOPs over all their seconds
        return sum(s.flops for s in self.samples) / sum(s.seconds for s in self.samples)

    def to_dict(self) -> dict:
        return {"samples": [s.to_dict() for s in self.samples],
                "flops_per_s": self.flops_per_s}


def measure_linear(device: torch.device, dtypes: tuple[str, ...],
                   sizes: Sizes) -> dict[str, LinearRate]:
    """The matmuls of training, as autograd runs them: a linear layer's forward
    ``x @ W.T`` and backward (``dy @ W`` and ``dy.T @ x``, on transposed views) for each
    (tokens, in, out) of ``sizes.linear``: 3 x 2 x tokens x in x out FLOPs a call. Their
    rate over the best square matmul's is the efficiency a model's layers reach."""
    result = {}
    for key in dtypes:
        if key == "tf32":
            continue
        dtype = TORCH_DTYPES[key]
        samples = []
        for tokens, d_in, d_out in sizes.linear:
            x = torch.randn(tokens, d_in, device=device, dtype=dtype, requires_grad=True)
            weight = torch.randn(d_out, d_in, device=device, dtype=dtype, requires_grad=True)
            grad = torch.randn(tokens, d_out, device=device, dtype=dtype)

            def step() -> None:
                F.linear(x, weight).backward(grad)
                x.grad = weight.grad = None

            with Fp32Precision(key):
                seconds = median_seconds(step, device, sizes)
            samples.append(LinearSample(tokens=tokens, d_in=d_in, d_out=d_out,
                                        seconds=seconds))
        result[key] = LinearRate(samples=tuple(samples))
        log.info("linear layers %s, forward and backward: %s", key,
                 format_flops(result[key].flops_per_s))
    return result


# ---------------------------------------------------------------------- split backward

@dataclass(frozen=True, kw_only=True)
class SplitBackward:
    """Two linear blocks timed three ways; seconds per call."""

    shape: tuple[int, int, int]        # (tokens, in, out) of the blocks
    forward_s: float                   # forward alone
    forward_backward_s: float          # forward and one backward
    forward_split_backward_s: float    # forward, the input's gradient, then the weights'

    @property
    def factor(self) -> float:   # the split backward's time over the whole one's, >= 1
        return max(1.0, (self.forward_split_backward_s - self.forward_s)
                   / max(self.forward_backward_s - self.forward_s, 1e-12))

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "forward_s": self.forward_s,
                "forward_backward_s": self.forward_backward_s,
                "forward_split_backward_s": self.forward_split_backward_s,
                "factor": self.factor}


def measure_split_backward(device: torch.device, sizes: Sizes) -> SplitBackward:
    """A backward run as the zero-bubble schedules run it, over one pass: two linear
    blocks (``sizes.linear[0]``: tokens x in -> out -> in, GELU between) timed forward
    alone, forward and one backward, and forward then ``autograd.grad`` for the input's
    gradient (keeping the graph) and for the weights'."""
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
    result = SplitBackward(shape=(tokens, d_in, d_out), forward_s=forward_s,
                           forward_backward_s=whole_s, forward_split_backward_s=split_s)
    log.info("split backward: %.2fx one pass", result.factor)
    return result


# ---------------------------------------------------------------------------- attention

@dataclass(frozen=True, kw_only=True)
class AttentionRate:
    """``scaled_dot_product_attention``'s forward in one dtype, causal or not."""

    dtype: str
    causal: bool
    seconds: float                 # per call
    flops: float                   # 4·b·h·s²·d, half that when causal

    @property
    def name(self) -> str:         # its key in the profile: "float32", "float32_causal"
        return f"{self.dtype}{'_causal' if self.causal else ''}"

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "causal": self.causal, "seconds": self.seconds,
                "flops": self.flops, "flops_per_s": self.flops_per_s}


@dataclass(frozen=True, kw_only=True)
class AttentionRates:
    """Attention on one (batch, heads, seq, head_dim) shape, per dtype, causal and not."""

    shape: tuple[int, int, int, int]
    rates: tuple[AttentionRate, ...]

    def to_dict(self) -> dict:
        b, h, s, d = self.shape
        return {"shape": {"batch": b, "heads": h, "seq": s, "head_dim": d},
                "flops_counted": "forward only: 4*b*h*s^2*d, half that when causal",
                **{rate.name: rate.to_dict() for rate in self.rates}}


def measure_attention(device: torch.device, dtypes: tuple[str, ...],
                      sizes: Sizes) -> AttentionRates:
    b, h, s, d = sizes.attention
    rates = []
    for key in dtypes:
        if key == "tf32":  # a matmul mode of float32 inputs: attention runs once per dtype
            continue
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=TORCH_DTYPES[key])
                   for _ in range(3))
        for causal in (False, True):
            with torch.no_grad():
                seconds = median_seconds(
                    lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                    device, sizes)
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            rates.append(AttentionRate(dtype=key, causal=causal, seconds=seconds,
                                       flops=flops))
            log.info("attention %s: %s", rates[-1].name, format_flops(flops / seconds))
    return AttentionRates(shape=(b, h, s, d), rates=tuple(rates))
