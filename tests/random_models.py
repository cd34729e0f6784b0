"""Random models for property-based tests (issue 16, item 7): a spec drawn by
``hypothesis``, the model built from it, and the mesh it is compiled for.

A ``ModelSpec`` is data (frozen dataclasses, JSON both ways), so that a torchrun worker
can receive a list of them and a failure can be replayed from its printed spec alone;
``build(spec)`` makes the same weights every time (they come from ``spec.seed``).

Under pp=2 a case draws one of every schedule torch runs (zero-bubble ones included);
under tp=2, sequence parallelism pinned on (its linears run as rings) or left to the
planner.

The model: blocks of ``Linear`` → [``BatchNorm1d``] → [in-place op] → activation →
[in-place op] → [``* buffer``], each block's output optionally receiving the input of a
block 1-3 blocks back (through a ``Linear`` where the widths differ), a block's weight
optionally shared with an earlier block of the same shape, and the head optionally the
first block's weight transposed. In-place ops follow the rule eager autograd needs:
never on a value its producer keeps for backward (after ``tanh``/``relu``, which keep
their output, the op goes before the activation).

Used by ``tests/test_random_models.py`` (one process), ``tests/runtime/test_random_models.py``
with ``tests/runtime/random_worker.py`` (torchrun) and ``benchmarks/property_models.py``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from torch import nn

from partc.cost.schedules import refusal

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh, "gelu": F.gelu, "relu": torch.relu, "silu": F.silu}
# Activations that keep their input, not their output, for backward: an in-place op may
# follow them.
KEEP_INPUT = ("gelu", "silu")
IN_PLACE = ("none", "mul_", "clamp_", "relu_", "ReLU(inplace=True)")
# Every schedule torch runs: one stage per rank, then several (looped and "V" placement),
# the zero-bubble ones splitting backward in two (partc/runtime/split_backward.py).
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble",
             "zbv-zero-bubble", "dualpipev")
ZERO_BUBBLE = ("interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev")
# Virtual stages need layers: 2 ranks of 2 stages, each at least one block.
MIN_DEPTH_VIRTUAL = 4
BUFFERS = ("none", "persistent", "non-persistent")
WIDTHS = (4, 6, 8, 12, 16)
MESHES = ("pp2", "tp2", "dp2")
BATCH, STEPS = 8, 3
SEQ, VOCAB = 4, 16  # a sequence-parallel model's tokens per sample, and its words


@dataclass(frozen=True, kw_only=True)
class BlockSpec:
    width: int  # the block's output width
    activation: str
    in_place: str = "none"
    after_activation: bool = False  # the in-place op runs on the activation's output
    norm: bool = False  # BatchNorm1d after the Linear
    buffer: str = "none"  # a constant scale registered as a buffer
    tied_to: int | None = None  # this block's Linear uses that block's weight


@dataclass(frozen=True, kw_only=True)
class Skip:
    start: int  # the input of block ``start`` is added to ...
    span: int  # ... the output of block ``start + span - 1``


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    d_in: int
    d_out: int
    blocks: tuple[BlockSpec, ...]
    skips: tuple[Skip, ...] = ()
    tied_head: bool = False  # the head is the first block's weight, transposed
    seed: int = 0
    # Tokens per sample, or 0: with tokens the model reads (batch, seq) ids through an
    # embedding of VOCAB words d_in wide, else (batch, d_in) floats. Sequence parallelism
    # shards the tokens: no BatchNorm then (it would normalise dim 1, the positions).
    seq: int = 0

    @property
    def batchnorm(self) -> bool:
        return any(block.norm for block in self.blocks)

    def fan_in(self, index: int) -> int:
        return self.d_in if index == 0 else self.blocks[index - 1].width


@dataclass(frozen=True, kw_only=True)
class Case:
    """A model and how to compile it on 2 devices: ``mesh`` names the axis of size 2."""
    model: ModelSpec
    mesh: str
    schedule: str = "1f1b"
    recompute: str = "none"
    num_microbatches: int = 1
    zero_stage: int = 0
    # tp2: sequence parallelism pinned on (its linears run as rings beside their
    # collectives, TrainSpec.tp_overlap), else the planner's choice.
    sequence_parallel: bool = False

    def constraints(self) -> dict[str, Any]:
        pins: dict[str, Any] = dict(pp=1, dp=1, tp=1, recompute=self.recompute,
                                    num_microbatches=self.num_microbatches)
        if self.mesh == "pp2":
            pins.update(pp=2, schedule=self.schedule)
        elif self.mesh == "tp2":
            # The fewest parameter bytes: tiny layers on a CPU budget would stay replicated.
            pins.update(tp=2, tp_objective="memory")
            if self.sequence_parallel:
                pins.update(sequence_parallel=True)
        else:
            pins.update(dp=2, zero_stage=self.zero_stage)
        return pins

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> Case:
        model = dict(data["model"])
        model["blocks"] = tuple(BlockSpec(**b) for b in model["blocks"])
        model["skips"] = tuple(Skip(**s) for s in model["skips"])
        return Case(**{**data, "model": ModelSpec(**model)})

    def __str__(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))


# -- the model ------------------------------------------------------------------------


class RandomBlock(nn.Module):
    def __init__(self, spec: BlockSpec, fan_in: int) -> None:
        super().__init__()
        self.linear = nn.Linear(fan_in, spec.width)
        self.norm = nn.BatchNorm1d(spec.width) if spec.norm else None
        self.relu = nn.ReLU(inplace=True) if spec.in_place == "ReLU(inplace=True)" else None
        self.in_place, self.after_activation = spec.in_place, spec.after_activation
        self.activation = spec.activation
        self.scaled = spec.buffer != "none"
        if self.scaled:
            self.register_buffer("scale", torch.linspace(0.5, 1.5, spec.width),
                                 persistent=spec.buffer == "persistent")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if self.norm is not None:
            h = self.norm(h)
        if not self.after_activation:
            h = self._write(h)
        h = ACTIVATIONS[self.activation](h)
        if self.after_activation:
            h = self._write(h)
        if self.scaled:
            h = h * self.scale
        return h

    def _write(self, h: torch.Tensor) -> torch.Tensor:
        # The in-place op's result is not read: only its side effect on ``h`` counts.
        if self.in_place == "mul_":
            h.mul_(0.5)
        elif self.in_place == "clamp_":
            h.clamp_(-0.5, 0.5)
        elif self.in_place == "relu_":
            h.relu_()
        elif self.relu is not None:
            h = self.relu(h)
        return h


class RandomModel(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, spec.d_in) if spec.seq else None
        self.blocks = nn.ModuleList(RandomBlock(block, spec.fan_in(i))
                                    for i, block in enumerate(spec.blocks))
        for block, block_spec in zip(self.blocks, spec.blocks):
            if block_spec.tied_to is not None:
                block.linear.weight = self.blocks[block_spec.tied_to].linear.weight
        self.skips = tuple((s.start, s.start + s.span - 1) for s in spec.skips)
        self.projections = nn.ModuleDict({
            f"{start}_{end}": nn.Linear(spec.fan_in(start), spec.blocks[end].width)
            for start, end in self.skips if spec.fan_in(start) != spec.blocks[end].width})
        width = spec.blocks[-1].width
        if spec.tied_head:
            self.head_bias = nn.Parameter(torch.zeros(spec.d_out))
        else:
            self.head = nn.Linear(width, spec.d_out)
        self.tied_head = spec.tied_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        inputs = []
        for index, block in enumerate(self.blocks):
            inputs.append(x)
            x = block(x)
            for start, end in self.skips:
                if end == index:
                    key = f"{start}_{end}"
                    source = inputs[start]
                    x = x + (self.projections[key](source) if key in self.projections
                             else source)
        if self.tied_head:
            return F.linear(x, self.blocks[0].linear.weight.t(), self.head_bias)
        return self.head(x)


def build(spec: ModelSpec) -> RandomModel:
    """The model of ``spec``, its weights drawn from ``spec.seed`` (the global random
    state is left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(spec.seed)
        return RandomModel(spec)


def batch(case: Case, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(case.model.seed * 100 + step)
    if case.model.seq:
        return (torch.randint(0, VOCAB, (BATCH, case.model.seq), generator=g),
                torch.randn(BATCH, case.model.seq, case.model.d_out, generator=g))
    return (torch.randn(BATCH, case.model.d_in, generator=g),
            torch.randn(BATCH, case.model.d_out, generator=g))


# -- the strategies -------------------------------------------------------------------


@st.composite
def model_specs(draw: st.DrawFn, *, batchnorm: bool = True, min_depth: int = 2,
                seq: int = 0) -> ModelSpec:
    depth = draw(st.integers(min_depth, 6))
    widths = draw(st.lists(st.sampled_from(WIDTHS), min_size=depth, max_size=depth))
    d_in = draw(st.sampled_from(WIDTHS))
    tied_head = draw(st.booleans())
    if tied_head:  # the head maps widths[-1] back to d_in with the first weight's transpose
        widths[-1] = widths[0]
    d_out = d_in if tied_head else draw(st.sampled_from(WIDTHS))
    blocks: list[BlockSpec] = []
    for index, width in enumerate(widths):
        fan_in = d_in if index == 0 else widths[index - 1]
        blocks.append(draw(block_specs(width, fan_in, batchnorm, [
            j for j in range(index) if (blocks[j].width, (d_in, *widths)[j]) == (width, fan_in)
            and blocks[j].tied_to is None])))
    spans = st.tuples(st.integers(0, depth - 1), st.integers(1, 3)).filter(
        lambda s: s[0] + s[1] <= depth)
    skips = draw(st.lists(spans, max_size=3, unique=True))
    return ModelSpec(d_in=d_in, d_out=d_out, blocks=tuple(blocks),
                     skips=tuple(Skip(start=a, span=b) for a, b in sorted(skips)),
                     tied_head=tied_head, seed=draw(st.integers(0, 2**16)), seq=seq)


@st.composite
def block_specs(draw: st.DrawFn, width: int, fan_in: int, batchnorm: bool,
                tie_candidates: list[int]) -> BlockSpec:
    activation = draw(st.sampled_from(sorted(ACTIVATIONS)))
    in_place = draw(st.sampled_from(IN_PLACE))
    after = in_place != "none" and activation in KEEP_INPUT and draw(st.booleans())
    tied_to = draw(st.none() | st.sampled_from(tie_candidates)) if tie_candidates else None
    return BlockSpec(width=width, activation=activation, in_place=in_place,
                     after_activation=after,
                     norm=batchnorm and draw(st.integers(0, 3)) == 0,
                     buffer=draw(st.sampled_from(BUFFERS)), tied_to=tied_to)


@st.composite
def cases(draw: st.DrawFn, meshes: tuple[str, ...] = MESHES,
          schedules: tuple[str, ...] = SCHEDULES) -> Case:
    mesh = draw(st.sampled_from(meshes))
    schedule = draw(st.sampled_from(schedules)) if mesh == "pp2" else "1f1b"
    sequence_parallel = mesh == "tp2" and draw(st.booleans())
    # BatchNorm's running statistics would drift apart over dp replicas: partc refuses
    # it under dp > 1 (docs/guide.md, "Side effects").
    model = draw(model_specs(batchnorm=mesh != "dp2" and not sequence_parallel,
                             min_depth=MIN_DEPTH_VIRTUAL if _virtual(schedule) else 2,
                             seq=SEQ if sequence_parallel else 0))
    # What the schedule can run over 2 ranks (DualPipeV: a microbatch per virtual stage).
    microbatches = tuple(m for m in (2, 4) if refusal(schedule, 2, 2 if _virtual(schedule)
                                                      else 1, m) is None) \
        if mesh == "pp2" else (1, 2)
    return Case(model=model, mesh=mesh, schedule=schedule,
                recompute=draw(st.sampled_from(("none", "selective", "full"))),
                num_microbatches=draw(st.sampled_from(microbatches)),
                zero_stage=draw(st.integers(0, 3)) if mesh == "dp2" else 0,
                sequence_parallel=sequence_parallel)


def _virtual(schedule: str) -> bool:
    """Whether ``schedule`` runs several stages per rank."""
    return schedule not in ("gpipe", "1f1b")


def draw_cases(count: int, seed: int = 0, meshes: tuple[str, ...] = MESHES,
               schedules: tuple[str, ...] = SCHEDULES) -> list[Case]:
    """``count`` distinct cases drawn by hypothesis from ``seed``: the same list for the
    same arguments. (Drawn ahead of time so that one torchrun launch trains them all.)"""
    drawn: list[Case] = []

    # Hypothesis may draw a case twice: ask for more, keep the first ``count`` distinct.
    @hypothesis_seed(seed)
    @settings(max_examples=3 * count, phases=[Phase.generate], database=None, deadline=None)
    @given(cases(meshes, schedules))
    def collect(case: Case) -> None:
        if case not in drawn and len(drawn) < count:
            drawn.append(case)

    collect()
    return drawn
