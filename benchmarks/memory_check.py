"""Predicted memory per rank against a measurement: one rank of a plan, run on CPU.

    python benchmarks/memory_check.py                      # every case: the full table
    python benchmarks/memory_check.py --case gpt-pp2-1f1b-m4 --case llama-pp1
    python benchmarks/memory_check.py --list               # the cases' names
    python benchmarks/memory_check.py --breakdown          # also each category's own peak

Each case compiles a small model with ``partc.compile`` (the sample GPT, Hugging Face
GPT-2 and Llama from tiny configs; fp32 or bf16 AdamW) with the plan's shape pinned, and
then, for each rank measured, in this one process:

1. joins a fake process group (``FakeStore``, backend ``"fake"``) as that rank of the
   plan's world: collectives and point-to-point messages move nothing, so the values are
   garbage, but every tensor the rank would allocate is allocated with its real shape;
2. runs ``program.build()``, the optimizer from ``module.optimizer(torch.optim.AdamW)``
   and one training step untracked: the pipeline's shape inference, and the optimizer
   state, which exists from the first step on;
3. runs the second step under ``MemTracker`` (``torch.distributed._tools``), with the
   stage's parameters and the optimizer registered, and the pipeline's gradient receive
   buffers as the stage makes them, and reports the peak of that step and its breakdown
   by category at the peak.

The first step's shape inference sends each stage's output shapes forward and its input
gradients' shapes back, as Python objects: under a fake group a receive gets nothing.
Here the stage is handed what its neighbours would send (``neighbour_messages``): its
inputs are the outputs of the stages before it, run on fake tensors from the microbatch
(under autocast in mixed precision; tensor-parallel collectives simulated), and the
gradients coming back have the shapes of its own outputs that need one. The vote on
static or dynamic shapes needs nothing: with no shapes given, every stage votes dynamic,
which is also what a zero-filled receive says.

Why the first step is not the measured one: it holds no optimizer state until its end,
and ``MemTracker``'s backward hooks cannot run beside the shape inference's
``autograd.grad`` on leaf inputs.

The table, one row per category for each rank measured: the plan's figure
(``plan.stages[k].memory_bytes``), the measured one at the moment of the step's peak, and
their ratio; on the "peak" row, ok or OFF against ±10% and the phase the peak came in.
Parameters, gradients and optimizer state are MemTracker's own categories (buffers count
as parameters); receive is the pipeline's gradient receive buffers (given to MemTracker
as the stage makes them, which counts them as "Other": one per run while its backward
runs; ``partc.cost.evaluate.receive_bytes``; a received activation is the stage's
input, among the activations); activations are what was allocated outside
backward and the optimizer step (saved tensors, a stage's outputs), transient what
backward allocated (gradients of activations, recomputed tensors, weight gradients
before they are accumulated). The split between the last two is MemTracker's, not the
plan's: under recompute, or with ZeRO-2/3's gathered weights (parameters to the plan,
forward allocations here), compare their sum, or the peak.

Tensor bytes are counted, as the plan counts them: no allocator rounding, no
communication library buffers. It reaches into ``torch.distributed.pipelining``'s
private metadata classes (torch 2.13) for the shape inference; ``tests/validation/
test_memory.py`` runs some of the cases. All of them take about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import partc  # noqa: E402
from partc.autocast_policy import cuda_autocast  # noqa: E402

CATEGORIES = ("params", "grads", "optimizer", "activations", "transient", "receive")
# MemTracker's reference types, by the plan's category they stand for.
TRACKED = {"params": ("Parameter", "Buffer"), "grads": ("Gradient",),
           "optimizer": ("Optstate",), "activations": ("Activation",),
           "transient": ("Temp",), "receive": ("Other",)}
TOLERANCE = 0.10


# ---------------------------------------------------------------------------- cases

@dataclass(frozen=True, kw_only=True)
class Case:
    """One plan to check: a model, its batch, the pins, and the ranks to measure."""

    name: str
    model: str                     # "gpt" (samples/gpt.py), "gpt2" or "llama" (tests/models.py)
    constraints: dict[str, Any] = field(default_factory=dict)
    world: int = 1
    ranks: tuple[int, ...] = (0,)
    dtype: torch.dtype = torch.float32
    batch: int = 8
    seq: int = 32
    layers: int = 4
    width: int = 64
    vocab: int = 128
    heads: int = 4
    device: str = "CPU"            # the budget's preset: "CPU", or a GPU's ("H100-80GB")


def _case(name: str, model: str, world: int = 1, ranks: tuple[int, ...] = (0,),
          dtype: torch.dtype = torch.float32, batch: int = 16, seq: int = 64,
          **constraints: Any) -> Case:
    return Case(name=name, model=model, constraints=constraints, world=world, ranks=ranks,
                dtype=dtype, batch=batch, seq=seq)


PP2 = dict(world=2, ranks=(0, 1), pp=2)
ONE_F_ONE_B = dict(schedule="1f1b", num_microbatches=4)
GPIPE = dict(schedule="gpipe", num_microbatches=4)
# 16 sequences of 64 tokens: activations outweigh parameters, gradients and optimizer
# state, so the check is mostly of the activation model; "-small" cases (8 of 32) are
# mostly of the state's.
SMALL = dict(batch=8, seq=32)
# One block per stage and 32 microbatches of one sequence: had the stage kept a receive
# buffer per microbatch (a sequence's activations, 64 tokens x 128 wide, and as many
# gradients), as torch's does, they would be a fifth of the last stage's memory; it
# holds those of the microbatches in flight.
SHALLOW = Case(name="gpt-pp2-1f1b-m32-shallow", model="gpt", world=2, ranks=(0, 1),
               constraints=dict(pp=2, schedule="1f1b", num_microbatches=32, recompute="none"),
               batch=32, seq=64, layers=2, width=128)
CASES: tuple[Case, ...] = (
    _case("gpt-pp1", "gpt", pp=1, num_microbatches=1, recompute="none"),
    _case("gpt-pp1-m4", "gpt", pp=1, num_microbatches=4, recompute="none"),
    _case("gpt2-pp1", "gpt2", pp=1, num_microbatches=1, recompute="none"),
    _case("llama-pp1", "llama", pp=1, num_microbatches=1, recompute="none"),
    _case("gpt-pp2-1f1b-m4", "gpt", **PP2, **ONE_F_ONE_B, recompute="none"),
    _case("gpt-pp2-gpipe-m4", "gpt", **PP2, **GPIPE, recompute="none"),
    _case("gpt-pp2-1f1b-m2", "gpt", **PP2, schedule="1f1b", num_microbatches=2,
          recompute="none"),
    _case("gpt-pp2-1f1b-m8", "gpt", **PP2, schedule="1f1b", num_microbatches=8,
          recompute="none"),
    SHALLOW,
    # Two runs of layers per rank, held unequally: rank 1's are blocks 0-1 (2.6 MB a
    # microbatch) and the head and loss (0.2 MB), and at its peak it holds three of the
    # heavy run's and none of the light one's (PipelineConfig.held). Priced at the
    # average of its runs, it measured 1.59x its predicted peak. (A "V" schedule's last
    # stage, on rank 0 beside the first, does not run under the fake group: its loss's
    # backward finds no output gradient.)
    _case("gpt-pp2-interleaved-m4", "gpt", **PP2, schedule="interleaved-1f1b",
          virtual_stages=2, num_microbatches=4, recompute="none"),
    _case("gpt2-pp2-1f1b-m4", "gpt2", **PP2, **ONE_F_ONE_B, recompute="none"),
    _case("llama-pp2-1f1b-m4", "llama", **PP2, **ONE_F_ONE_B, recompute="none"),
    _case("gpt-pp2-1f1b-m4-full", "gpt", **PP2, **ONE_F_ONE_B, recompute="full"),
    _case("gpt-pp2-gpipe-m4-full", "gpt", **PP2, **GPIPE, recompute="full"),
    _case("llama-pp2-gpipe-m4-full", "llama", **PP2, **GPIPE, recompute="full"),
    _case("gpt-pp2-1f1b-m4-selective", "gpt", **PP2, **ONE_F_ONE_B, recompute="selective"),
    _case("gpt2-pp2-1f1b-m4-selective", "gpt2", **PP2, **ONE_F_ONE_B,
          recompute="selective"),
    _case("llama-pp1-selective", "llama", pp=1, num_microbatches=1, recompute="selective"),
    _case("gpt-tp2", "gpt", world=2, pp=1, tp=2, num_microbatches=1, recompute="none"),
    _case("gpt-pp2-tp2", "gpt", world=4, ranks=(0, 2), pp=2, tp=2, **ONE_F_ONE_B,
          recompute="none"),
    _case("gpt-dp2-zero1", "gpt", world=2, pp=1, dp=2, zero_stage=1, num_microbatches=1,
          recompute="none"),
    _case("gpt-dp2-zero2", "gpt", world=2, pp=1, dp=2, zero_stage=2, num_microbatches=1,
          recompute="none"),
    _case("gpt-dp2-zero3", "gpt", world=2, pp=1, dp=2, zero_stage=3, num_microbatches=1,
          recompute="none"),
    _case("gpt-pp2-dp2-zero1", "gpt", world=4, ranks=(0, 2), pp=2, dp=2, zero_stage=1,
          **ONE_F_ONE_B, recompute="none"),
    _case("gpt-pp2-1f1b-m4-bf16", "gpt", **PP2, dtype=torch.bfloat16, **ONE_F_ONE_B,
          recompute="none"),
    _case("llama-pp1-bf16", "llama", dtype=torch.bfloat16, pp=1, num_microbatches=1,
          recompute="none"),
    _case("gpt-pp2-1f1b-m4-small", "gpt", **PP2, **SMALL, **ONE_F_ONE_B, recompute="none"),
    _case("gpt-pp2-gpipe-m4-small", "gpt", **PP2, **SMALL, **GPIPE, recompute="none"),
    _case("gpt-dp2-zero3-small", "gpt", world=2, pp=1, dp=2, zero_stage=3, **SMALL,
          num_microbatches=1, recompute="none"),
    _case("gpt-pp2-1f1b-m4-bf16-small", "gpt", **PP2, **SMALL, dtype=torch.bfloat16,
          **ONE_F_ONE_B, recompute="none"),
    # ZeRO-2's gradient sync: sharded gradients, or whole ones accumulated over the step.
    *(_case(f"gpt-dp2-zero2-m4-{sync}-small", "gpt", world=2, pp=1, dp=2, zero_stage=2,
            **SMALL, num_microbatches=4, zero2_grad_sync=sync, recompute="none")
      for sync in ("microbatch", "step")),
    # A vocabulary 128 times the width, full recompute in bf16: the loss's working set
    # (fp32 logits) is most of the peak, and a recomputed loss keeps no fp32 copies.
    Case(name="gpt-pp2-1f1b-m4-full-bf16-vocab", model="gpt", world=2, ranks=(0, 1),
         dtype=torch.bfloat16, batch=16, seq=128, layers=2, width=128, vocab=16384,
         constraints=dict(pp=2, **ONE_F_ONE_B, recompute="full")),
    # The same vocabulary at tp=2, in bf16 with sequence parallelism: the loss a
    # vocab-parallel cross entropy on each rank's half of the classes.
    Case(name="gpt-tp2-sp-bf16-vocab", model="gpt", world=2, ranks=(0, 1),
         dtype=torch.bfloat16, batch=16, seq=128, layers=2, width=128, vocab=16384,
         constraints=dict(pp=1, tp=2, sequence_parallel=True, num_microbatches=4,
                          recompute="none")),
)


def case_named(name: str) -> Case:
    for case in CASES:
        if case.name == name:
            return case
    raise KeyError(f"no case {name!r}; cases: {', '.join(c.name for c in CASES)}")


def _model(case: Case) -> tuple[torch.nn.Module, Callable]:
    from samples import gpt
    from tests import models

    layers, width = case.layers, case.width
    if case.model == "gpt":
        return (gpt.gpt_tiny(n_layer=layers, n_embd=width, n_head=case.heads,
                             block_size=case.seq, vocab_size=case.vocab), gpt.loss_fn)
    if case.model == "gpt2":
        return (models.gpt2(n_layer=layers, n_embd=width, positions=case.seq, vocab=case.vocab),
                models.causal_lm_loss)
    if case.model == "llama":
        return (models.llama(n_layer=layers, hidden=width, heads=case.heads,
                             kv_heads=max(1, case.heads // 2), intermediate=2 * width,
                             positions=case.seq, vocab=case.vocab), models.causal_lm_loss)
    raise ValueError(f"unknown model {case.model!r}")


def compile_case(case: Case) -> tuple[partc.Program, tuple[torch.Tensor, ...], torch.Tensor]:
    """The case's program and one global batch (token ids and next-token targets)."""
    torch.manual_seed(0)
    model, loss_fn = _model(case)
    ids = torch.randint(0, case.vocab, (case.batch, case.seq))
    target = torch.randint(0, case.vocab, (case.batch, case.seq))
    program = partc.compile(
        model, (ids,), loss_fn=loss_fn, example_target=target,
        budget=partc.DeviceBudget(num_devices=case.world, device=case.device),
        train=partc.TrainSpec(global_batch_size=case.batch, dtype=case.dtype),
        constraints=partc.Constraints(**case.constraints), name=case.name)
    return program, (ids,), target


# ---------------------------------------------------------------------------- measuring

class StepTracker(MemTracker):
    """``MemTracker`` with a window: the peak total since :meth:`start_window`, the
    breakdown at that moment, and each category's own largest value in the window.

    Only these totals are kept. ``MemTracker``'s per-module statistics are not: a
    pipeline calls its stage once per microbatch, which ``MemTracker`` takes for a new
    iteration and refuses (here each such call starts the module's statistics over), and
    keeping them copies a snapshot per module at every new local peak, which costs more
    than the step itself."""

    def __init__(self) -> None:
        super().__init__()
        self.start_window()

    def start_window(self) -> None:
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.phase = ""
        self.category_peaks: dict[str, int] = {}

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        tracker = self._mod_tracker
        if (module in self.memory_tracking and not tracker.is_bw
                and set(tracker.parents) <= {"Global", tracker.get_known_fqn(module)}):
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for by_kind in self._curr_mem_snap.values():
            for kind, nbytes in by_kind.items():
                if nbytes > self.category_peaks.get(kind, 0):
                    self.category_peaks[kind] = nbytes
            if by_kind[_TOTAL_KEY] > self.peak:
                self.peak = by_kind[_TOTAL_KEY]
                self.at_peak = dict(by_kind)
                self.phase = ("optimizer" if self._in_opt else
                              "backward" if self._mod_tracker.is_bw else "forward")

    def window(self) -> tuple[int, dict[str, int], dict[str, int], str]:
        """The window's peak, the breakdown at it, each category's own peak, and the
        phase of the step the peak came in, with MemTracker's reference types by name."""
        return self.peak, _named(self.at_peak), _named(self.category_peaks), self.phase


def _named(by_kind: dict[Any, int]) -> dict[str, int]:
    return {getattr(kind, "value", str(kind)): nbytes for kind, nbytes in by_kind.items()}


def by_category(tracked: dict[str, int]) -> dict[str, int]:
    """MemTracker's reference types summed into the plan's categories."""
    return {category: sum(tracked.get(kind, 0) for kind in kinds)
            for category, kinds in TRACKED.items()}


def answer_shape_inference(program: partc.Program, stage: Any,
                            microbatch: tuple[torch.Tensor, ...]) -> None:
    """Hand ``stage`` what its neighbours would send it during pipelining's first-step
    shape inference, which a fake group cannot carry.

    From torch 2.12 the stage asks through ``_recv_meta`` (:func:`neighbour_messages`).
    Earlier ones (the GPU machine's 2.11) receive the previous stage's outputs as meta
    tensors through ``dist.recv_object_list``, send their own with
    ``dist.send_object_list``, and derive the gradients' shapes locally: those two calls
    are answered for the length of the stage's shape inference."""
    if hasattr(type(stage), "_recv_meta"):
        stage._recv_meta = neighbour_messages(program, stage, microbatch)
        return
    from torch.distributed.pipelining import stage as stage_module

    metas = tuple(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                  for v in _forward_values(program, stage, microbatch))
    infer = stage._shape_inference

    def receive_object(objects: list, *args: Any, **kwargs: Any) -> None:
        objects[0] = metas

    def shape_inference(*args: Any, **kwargs: Any) -> Any:
        distributed = stage_module.dist
        receive, send = distributed.recv_object_list, distributed.send_object_list
        distributed.recv_object_list = receive_object
        distributed.send_object_list = lambda *a, **k: None
        try:
            return infer(*args, **kwargs)
        finally:
            distributed.recv_object_list, distributed.send_object_list = receive, send
    stage._shape_inference = shape_inference


def neighbour_messages(program: partc.Program, stage: Any,
                       microbatch: tuple[torch.Tensor, ...]) -> Callable[[int], Any]:
    """What the stage's neighbours send it during shape inference, as ``_recv_meta``
    returns it: from the previous stage, the metadata of the tensors it sends (the
    stages before this one run on fake tensors); from the next, that of the gradients of
    this stage's outputs that need one."""
    # torch 2.13's private pipelining metadata: imported here, so that the plans of one
    # stage are checked on a torch without them.
    from torch.distributed.pipelining._utils import (
        _derive_grad_metas, _StageBackwardMeta, _StageForwardMeta, extract_tensor_meta)

    forward = tuple(extract_tensor_meta(v) for v in _forward_values(program, stage, microbatch))

    def receive(source_stage: int) -> Any:
        if source_stage == stage.stage_index - 1:
            return _StageForwardMeta(forward_metas=forward)
        return _StageBackwardMeta(backward_metas=_derive_grad_metas(stage._stage_meta.outputs))

    return receive


def _forward_values(program: partc.Program, stage: Any,
                    microbatch: tuple[torch.Tensor, ...]) -> tuple:
    """What the stages before ``stage`` send it for ``microbatch``, as fake tensors
    (nothing for the first stage)."""
    plan = program.plan
    values: tuple = ()
    if stage.stage_index > 0:
        dtype = plan.train.dtype
        earlier = [program.module for program in program.stages()[:stage.stage_index]]
        if dtype != torch.float32:
            # As the runtime runs a stage in mixed precision: compute-dtype parameters
            # (buffers as they are) under CUDA's autocast policy.
            earlier = [_in_compute_dtype(module, dtype) for module in earlier]
        with contextlib.ExitStack() as scope:
            fake = scope.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            if dtype != torch.float32:
                # On CPU ranks and GPUs alike the runtime applies CUDA's policy (here
                # on CPU fake tensors).
                scope.enter_context(cuda_autocast(dtype))
            values = tuple(fake.from_tensor(t) for t in microbatch)
            for module in earlier:
                values = module(*values)
            if isinstance(values, torch.Tensor):
                values = (values,)
    return tuple(values)


def _in_compute_dtype(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``module`` with its floating parameters in ``dtype``."""
    module = copy.deepcopy(module)
    for param in module.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    return module


def track_receive_buffers(stage: Any, tracker: MemTracker) -> None:
    """Have ``tracker`` count the gradient buffers the stage allocates as "Other" (the
    plan's receive), and see its activation buffers go: the stage makes each buffer
    when its receive is posted and lets it go after that microbatch's backward
    (``partc.runtime.pipeline_stage``). Activation buffers are left as MemTracker finds
    them, forward allocations: a stage's input is saved by its first layer, as the plan
    counts it.

    MemTracker's module tracker hooks every module input that needs a gradient, and
    its hook holds the input's gradient accumulator, which holds the input: a stage's
    input, a leaf, would outlive the stage's hold on it through a cycle that passes
    through autograd's C++ nodes, which Python's collector cannot break. Its hooks have
    run once the microbatch's backward has, and are dropped when the stage lets go; the
    tracker's other bookkeeping leaves cycles of Python objects around the input too,
    collected there and then (without the tracker the stage's inputs go as soon as it
    lets them go: ``tests/runtime/test_receive_buffers.py``)."""
    gradients, activations = stage.gradient_buffers, stage.activation_buffers
    allocate, release = gradients.allocate, activations.release

    def allocate_tracked(infos: dict, chunk: int) -> None:
        allocate(infos, chunk)
        tracker.track_external(*(info.buffer for info in infos[chunk]
                                 if getattr(info, "buffer", None) is not None))

    def release_unhooked(infos: dict, chunk: int) -> None:
        for info in infos.get(chunk, ()):
            hooks = getattr(getattr(info, "buffer", None), "_backward_hooks", None)
            if hooks:
                hooks.clear()
        release(infos, chunk)
        gc.collect()
    gradients.allocate, activations.release = allocate_tracked, release_unhooked


def zero_integer_receives(stage: Any) -> None:
    """The fake group delivers nothing: an integer tensor a stage receives (positions,
    token ids) would index with whatever its buffer's memory held. Zeros are in range
    and leave shapes and sizes as they are."""
    activations = stage.activation_buffers
    receive = activations.allocate

    def allocate_zeroed(infos: dict, chunk: int) -> None:
        receive(infos, chunk)
        with torch.no_grad():
            for info in infos[chunk]:
                buffer = getattr(info, "buffer", None)
                if buffer is not None and not buffer.is_floating_point():
                    buffer.zero_()
    activations.allocate = allocate_zeroed


@dataclass(frozen=True)
class Measured:
    peak: int
    at_peak: dict[str, int]          # by the plan's categories, at the moment of the peak
    category_peaks: dict[str, int]   # each category's own largest value in the step
    raw: dict[str, int]              # MemTracker's reference types at the peak
    phase: str                       # when the peak came: forward, backward or optimizer
    cuda_peak: int | None = None     # torch.cuda.max_memory_allocated in the step (GPUs)


def measure_rank(program: partc.Program, inputs: tuple[torch.Tensor, ...],
                 target: torch.Tensor, rank: int, world: int) -> Measured:
    """The peak of ``rank``'s second training step and its breakdown (steps 1-3 of the
    module's docstring)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    module = None
    # What the process holds already (an earlier rank's module until the collector frees
    # it): a GPU's counters take it off, as a rank on its own GPU would not hold it.
    gc.collect()
    held = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    try:
        module = program.build()
        microbatch = tuple(t[:program.plan.micro_batch_size] for t in inputs)
        on_gpu = module.topology.device.type == "cuda"
        if program.plan.pp > 1:
            for stage in module.parts.stages:   # the rank's virtual stages
                answer_shape_inference(program, stage, microbatch)
                zero_integer_receives(stage)
        optimizer = module.optimizer(torch.optim.AdamW, lr=1e-3)
        module.forward_backward(*inputs, target=target)
        optimizer.step()
        optimizer.zero_grad()
        cuda_peak = None
        if on_gpu:
            # The allocator's own count, a step with no tracker: what the plan promises.
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            module.forward_backward(*inputs, target=target)
            optimizer.step()
            optimizer.zero_grad()
            torch.cuda.synchronize()
            cuda_peak = torch.cuda.max_memory_allocated() - held
        tracker = StepTracker()
        # ZeRO-1's optimizer keeps its state in the local optimizer it wraps.
        tracker.track_external(module.module, getattr(optimizer, "optim", optimizer))
        for stage in module.parts.stages:
            track_receive_buffers(stage, tracker)
        with tracker:
            tracker.start_window()
            module.forward_backward(*inputs, target=target)
            optimizer.step()
            optimizer.zero_grad()
        peak, at_peak, category_peaks, phase = tracker.window()
        return Measured(peak=peak, at_peak=by_category(at_peak),
                        category_peaks=by_category(category_peaks), raw=at_peak, phase=phase,
                        cuda_peak=cuda_peak)
    finally:
        if module is not None:
            module.close()
        dist.destroy_process_group()


@dataclass(frozen=True)
class Row:
    case: str
    rank: int
    stage: int
    predicted: dict[str, int]
    measured: Measured

    @property
    def ratio(self) -> float:
        return self.measured.peak / self.predicted["peak"]


def stage_of_rank(plan: Any, rank: int) -> int:
    return rank // (plan.dp * plan.tp)


def check_case(case: Case) -> list[Row]:
    program, inputs, target = compile_case(case)
    rows = []
    for rank in case.ranks:
        stage = stage_of_rank(program.plan, rank)
        measured = measure_rank(program, inputs, target, rank, case.world)
        rows.append(Row(case=case.name, rank=rank, stage=stage,
                        predicted=asdict(program.plan.stages[stage].memory_bytes),
                        measured=measured))
    return rows


# ---------------------------------------------------------------------------- report

def _ratio(measured: int, predicted: int) -> str:
    return f"{measured / predicted:5.2f}" if predicted else ("    -" if not measured else "  inf")


def table(rows: list[Row], breakdown: bool = False) -> str:
    head = (f"{'case':28s} {'rank':>4s} {'stage':>5s} {'category':12s} {'predicted':>11s} "
            f"{'measured':>11s} {'ratio':>5s}")
    if breakdown:
        head += f" {'own peak':>11s}"
    lines = [head, "-" * len(head)]
    for row in rows:
        for category in (*CATEGORIES, "peak"):
            predicted = row.predicted.get(category, 0)
            measured = row.measured.peak if category == "peak" else row.measured.at_peak[category]
            line = (f"{row.case:28s} {row.rank:4d} {row.stage:5d} {category:12s} "
                    f"{predicted:11,d} {measured:11,d} {_ratio(measured, predicted)}")
            if category == "peak":
                line += ("  ok " if abs(row.ratio - 1) <= TOLERANCE else "  OFF") + \
                    f" (in {row.measured.phase})"
            elif breakdown:
                line += f" {row.measured.category_peaks[category]:11,d}"
            lines.append(line)
            if category == "peak" and row.measured.cuda_peak is not None:
                cuda = row.measured.cuda_peak
                lines.append(f"{row.case:28s} {row.rank:4d} {row.stage:5d} {'cuda peak':12s} "
                             f"{predicted:11,d} {cuda:11,d} {_ratio(cuda, predicted)}"
                             + ("  ok " if abs(cuda / predicted - 1) <= TOLERANCE else "  OFF")
                             + " (torch.cuda.max_memory_allocated)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="a case's name (default: all)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--breakdown", action="store_true",
                        help="also each category's own peak within the step")
    args = parser.parse_args()
    if args.list:
        print("\n".join(f"{c.name:28s} {c.model:6s} world={c.world} ranks={c.ranks} "
                        f"{str(c.dtype).removeprefix('torch.')} {c.constraints}" for c in CASES))
        return
    cases = [case_named(name) for name in args.case] if args.case else list(CASES)
    rows = []
    for case in cases:
        started = time.perf_counter()
        try:
            rows += check_case(case)
        except Exception as error:  # one failing case must not hide the others
            print(f"{case.name}: failed: {type(error).__name__}: {error}", file=sys.stderr)
            continue
        print(f"{case.name}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    print(table(rows, args.breakdown))
    off = [r for r in rows if abs(r.ratio - 1) > TOLERANCE]
    print(f"\n{len(rows) - len(off)} of {len(rows)} ranks' peaks within "
          f"±{TOLERANCE:.0%} of the prediction")


if __name__ == "__main__":
    main()
