"""How long the first step's ``torch.compile`` takes on a rank, estimated.

A compiled stage (or, under ZeRO-2/3, each FSDP unit: :mod:`partc.runtime.compiled`)
is traced by dynamo, turned into a joint forward and backward graph by AOTAutograd and
lowered by inductor, node by node: host work per graph node, :data:`TRACE_S_PER_NODE`.
Inductor then builds its kernels (C++ on a CPU, Triton on a GPU), and an identical kernel
is built once per process (its cache is keyed by the kernel's source): a repeated block
(layers of one signature, ``LayerCost.signature``) pays the build once,
:data:`BUILD_S_PER_NODE` per node of the first of its kind. Each pipeline rank compiles
its own runs while the others do theirs, so the plan's figure is the slowest rank's.

FP8 linears (``TrainSpec.fp8``) trace as torchao's float8 tensor subclasses, whose
casts, scales and scaled matmuls expand in the joint graph: each costs
:data:`FP8_S_PER_LINEAR` more, every one of them (tracing, not building, dominates).

The trace rate was measured compiling the sample GPT on this project's 2-core CPU
machine (torch 2.13: 0.03 s of host time per exported node beyond a fixed 4 s per
process); the CPU build rate is a round figure (inductor's C++ builds took over a second
per node on a loaded machine). The GPU's rates were fitted to one H200 machine (16
cores, torch 2.11; ``benchmarks/gpu_check.py``'s 12-layer GPT, 459 nodes, 52 of them in
the first layer of each kind): its first compiled step took 39.1 s against 1.0 s eager,
38 s of compiling where 0.1 s per built node said 23 s; with its 48 linears in FP8 it
took 119.7 s, 81 s more. Inductor's cache on disk makes later runs cheaper than this
first one.
"""

from __future__ import annotations

from typing import Collection, Iterable

from partc.problem import LayerCost

# Host seconds per graph node: dynamo's trace, AOTAutograd, inductor's lowering.
TRACE_S_PER_NODE = 0.03
# Seconds per node of a kind of layer compiled first in the process: its kernels built.
BUILD_S_PER_NODE = {"cpu": 1.0, "gpu": 0.4}
# Seconds more per FP8 linear (torchao's float8 subclasses traced).
FP8_S_PER_LINEAR = 1.7
# Once per process: dynamo's and inductor's start.
FIXED_S = 4.0


def rank_compile_seconds(layers: Iterable[LayerCost], gpu: bool,
                         fp8_linears: Collection[str] = ()) -> float:
    """The seconds one rank spends compiling the runs holding ``layers`` (its layers,
    in order), of which the linears named in ``fp8_linears`` run FP8."""
    build = BUILD_S_PER_NODE["gpu" if gpu else "cpu"]
    seen: set[str] = set()
    seconds = FIXED_S
    for layer in layers:
        seconds += TRACE_S_PER_NODE * layer.num_nodes
        seconds += FP8_S_PER_LINEAR * sum(name in fp8_linears for op in layer.heavy_ops
                                          for name in op.linear_names)
        if layer.signature not in seen:
            seen.add(layer.signature)
            seconds += build * layer.num_nodes
    return seconds
