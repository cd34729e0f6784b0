"""The context every pass after ``trace`` receives beside the graph."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode


@dataclass(frozen=True, kw_only=True)
class Context:
    """What the passes after ``trace`` need besides the graph."""

    model: nn.Module
    name: str
    fake_mode: FakeTensorMode
    fake_inputs: tuple[Any, ...]  # one per model placeholder, in order
    fake_target: Any  # None: propagate derives it from the model's output
    batch_size: int
    param_fqns: dict[int, tuple[str, ...]] = field(default_factory=dict)  # id → all FQNs
    # How the traced layers stand for the whole model's, when ``analyze`` traced one
    # block per repeated structure (``partc.passes.helpers.dedupe.Expansion``); None otherwise.
    expansion: Any = None
    # The dtype training computes in under autocast (mixed precision), which ``estimate``
    # measures the layers in; None: the model's own.
    autocast: torch.dtype | None = None
    # The device type the runtime trains on, "cuda" or "cpu" (the budget's): which kernels
    # run (fused dropout, causal attention skipping masked blocks). Autocast's policy is
    # CUDA's on both: the runtime applies it on CPU ranks too (``partc.runtime.precision``).
    autocast_device: str = "cuda"
    # What the lowering passes apply (the plan's decisions); None while analysing.
    lowering: Lowering | None = None
    # Lowering: the graph the plan's sharding was chosen on (the model traced at the
    # batch the planner measured, through the lowering passes up to ``layers``), made
    # when asked; ``tp_rewrite`` asks where the trace at the micro-batch size took
    # another branch of the model's code (``partc.passes.tp.carry``). None: not known.
    sharding_graph: Any = None
    # The tensor-parallel sharding ``tp_rewrite`` applies, on this graph's nodes
    # (``partc.passes.tp.chooser.Sharding``); None before one is chosen.
    sharding: Any = None
    # What ``estimate`` measured a ring to add to the blocking call it stands for, by the
    # call's arguments (their shapes and dtypes): shared by the tensor-parallel variants
    # measured from this context, whose layers repeat the same calls.
    ring_work: dict = field(default_factory=dict)
    # What ``estimate`` measured each layer's run to give, by all the run reads
    # (``partc.passes.helpers.run_memo.run_key``): shared likewise, the variants' layers
    # that the sharding leaves alone (a rotary table, a replicated loss) run once.
    layer_runs: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Lowering:
    """A plan's decisions, as the lowering passes read them (``partc.plan.Plan`` holds
    them; ``partc.program`` hands them over)."""

    stages: tuple[tuple[str, ...], ...]      # layer names of each stage, in order
    recompute: Mapping[str, str]             # layer → "none" | "selective" | "full"
    tp: int = 1                              # tensor-parallel degree
    sequence_parallel: bool = False
    tp_choices: Mapping[str, tuple] = field(default_factory=dict)  # layer → node choices
    # ZeRO-2/3 over more than one replica: each layer that owns its parameters becomes a
    # module of its own, an FSDP unit.
    fsdp_units: bool = False
    attention: str = "as_written"
    # Mixed precision: the stages compute in a lower dtype than the graph was traced in
    # (``partc.passes.portable.unpin_dtypes`` frees the dtypes the trace fixed).
    mixed: bool = False
    # Mixture-of-experts layers: the expert-parallel degree and the capacity factor
    # (None: dropless); with either, the experts run as ``partc.runtime.experts``.
    ep: int = 1
    capacity_factor: float | None = None
    # Context parallelism: the sequence split over ``cp`` ranks, the attention run as
    # ``cp_kind`` ("ring" or "all-to-all"); ``attention_masks``: each attention call's
    # mask as read at the whole sequence's length, and ``whole_length_shapes`` the shape
    # each op that reduces along a dim reads there, by node name (``pipeline.lower``
    # fills both): a dim whose size differs on the shard is the sequence.
    cp: int = 1
    cp_kind: str = "ring"
    attention_masks: tuple = ()
    whole_length_shapes: Mapping[str, tuple] = field(default_factory=dict)
    # FP8 linears (the plan's ``fp8``): their weights' FQNs and torchao's recipe.
    fp8_linears: tuple[str, ...] = ()
    fp8_recipe: str = "tensorwise"
