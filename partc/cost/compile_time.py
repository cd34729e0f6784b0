"""How long the first step's ``torch.compile`` takes on a rank, estimated.

A compiled stage (or, under ZeRO-2/3, each FSDP unit: :mod:`partc.runtime.compiled`)
is traced by dynamo, turned into a joint forward and backward graph by AOTAutograd and
lowered by inductor, node by node: host work per graph node, :data:`TRACE_S_PER_NODE`.
Inductor then builds its kernels (C++ on a CPU, Triton on a GPU), and an identical kernel
is built once per process (its cache is keyed by the kernel's source): a repeated block
(layers of one signature, ``LayerCost.signature``) pays the build once,
:data:`BUILD_S_PER_NODE` per node of the first of its kind. Each pipeline rank compiles
its own runs while the others do theirs, so the plan's figure is the slowest rank's.

The rates are estimates, not fits: the trace rate from compiling the sample GPT on this
project's 2-core CPU machine (torch 2.13: 0.03 s of host time per exported node beyond a
fixed 4 s per process); the build rates a round guess for each device type (on the CPU
inductor's C++ builds took over a second per node on a loaded machine; a GPU's Triton
kernels build in parallel workers). Neither has been measured on a GPU; inductor's cache
on disk makes later runs cheaper than this first one.
"""

from __future__ import annotations

from typing import Iterable

from partc.problem import LayerCost

# Host seconds per graph node: dynamo's trace, AOTAutograd, inductor's lowering.
TRACE_S_PER_NODE = 0.03
# Seconds per node of a kind of layer compiled first in the process: its kernels built.
BUILD_S_PER_NODE = {"cpu": 1.0, "gpu": 0.1}
# Once per process: dynamo's and inductor's start.
FIXED_S = 4.0


def rank_compile_seconds(layers: Iterable[LayerCost], gpu: bool) -> float:
    """The seconds one rank spends compiling the runs holding ``layers`` (its layers,
    in order)."""
    build = BUILD_S_PER_NODE["gpu" if gpu else "cpu"]
    seen: set[str] = set()
    seconds = FIXED_S
    for layer in layers:
        seconds += TRACE_S_PER_NODE * layer.num_nodes
        if layer.signature not in seen:
            seen.add(layer.signature)
            seconds += build * layer.num_nodes
    return seconds
