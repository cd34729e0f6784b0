"""Megatron-Core's published H100 weak-scaling runs as partc problems, and partc's
predictions of them.

The Megatron-LM README's table (July 2024; ``/work/shared/validation/
mcore_h100_weak_scaling.json``, copied into :data:`RUNS`): GPT models of 1.7B to 462B
parameters on 48 to 6,144 H100-80GB SXM (8 per node on NVLink 4, 8 x 400 Gb/s
InfiniBand per node), vocabulary 131072, sequence 4096, bf16 with fp32 main gradients
and optimizer state, the distributed optimizer (ZeRO-1), data-parallel and
tensor-parallel communication overlapped with compute. The published throughput is model
FLOPs per second per GPU, end to end: :func:`step_flops` is Megatron's count for a step
without recompute, 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) (it gives the README's 0.45 s
iteration for 1.7B and 12.72 s for 462B), and :func:`tflops_per_gpu` counts partc's
predicted step time the same way.

The model is ``samples/gpt.py``'s GPT with its head untied from the token embedding
(Megatron-Core's runs untie them: 12 l h^2 + 2 V h parameters, plus biases, norms and
positions), dropout 0.1 (Megatron's default), attention fused into one kernel call
(``TrainSpec(attention="fused")``: Megatron-Core runs flash attention), planned in bf16
for the H100 preset. Pinned as published: tp, pp, dp, the global batch and the
distributed optimizer (``zero_stage=1``). Free, as the issue asks: sequence parallelism,
recompute per layer and the micro-batch size. A pipelined row runs a schedule
Megatron-Core r0.8.0 (the release the figures name) can run over its even split of the
blocks, embeddings on the first stage, final norm, head and loss on the last: plain
1F1B (:data:`PUBLISHED_SCHEDULE`, what the planner plans the pinned mesh with:
:func:`published`), or interleaved 1F1B over ``v`` chunks per rank, where ``v``
divides the blocks per stage (``--num-layers-per-virtual-pipeline-stage``) and the
microbatches are a multiple of pp (:func:`megatron_interleavings`: the plan's
micro-batch size, sequence parallelism and recompute kept). The table gives neither the
schedule nor the micro-batch size; its authors chose both for speed, and
:func:`predict` takes the faster schedule within 80 GB. Under plain 1F1B the pipelined
rows would be predicted at 0.71-0.81x (fitted, below), the interleavings' shorter fill
and drain ((p - 1) / (v m) of the microbatches' time where 1F1B's is (p - 1) / m) put
them at 0.86-1.03x: each virtual stage's gradient reduction hides behind the rank's
backwards after its last (``partc.cost.timeline.overlap_windows``), and a pipeline send
costs neither end beside NCCL's kernels, only the wait for it, so deep interleavings pay
(314B 12 chunks a rank, 462B 7). That release has no zero-bubble schedule and no uneven
split: left to itself on a published mesh, partc's planner may pick one Megatron-Core
r0.8.0 cannot run (``benchmarks/validation.py --only mcore`` prints all three). The
planner prices every chunk count the blocks allow, played out
(:mod:`partc.planner.joint`; ``--interleavings`` prints them beside Megatron's). Its
own plan of the devices, every mesh open, is at least as fast as its plan of the
published mesh on every pipelined row (462B: 14.40 s on pp = 12 against 14.70 s on the
published pp = 16). The 177B row (pp = 6)
is in the README's table but not in the json; it is here. partc's interleaved pricing
itself is checked on the SC'21 runs that did interleave
(``tests/validation/megatron.py``).

One H100 matmul efficiency is fitted on one row (:data:`FIT_RUN`), the rest predicted
with it (``tests/validation/test_mcore_scaling.py``; ``benchmarks/validation.py`` prints
the table). Fused attention is not fitted: it runs at the H100 preset's attention
efficiency, 0.5 of peak (cuDNN's flash kernel, which Transformer Engine runs on Hopper,
as the FlashAttention-3 paper measured it; ``partc/device/presets.py``).

What the fitted constant absorbs. Without a pipeline partc plans one microbatch of four
sequences (b = 4, m = 1: 32B at 49 GiB), whose backward hides the whole fp32
reduce-scatter of ZeRO-1's gradients and whose forward the bf16 all-gather of its
weights; as the four microbatches of one that the published batches (4 pp dp
sequences) would also allow, Megatron-Core overlaps them with the last microbatch's
backward and the first one's forward only, and partc prices about 0.35 s of them
exposed on 32B. Fitted on the plan that hides them, the constant comes out at 0.59 of
peak where an H100's bf16 linears measured 0.70 (``partc calibrate``,
:data:`MEASURED_EFFICIENCY`), and it prices the pipelined rows' matmuls that much
slower. At the measured 0.70, nothing fitted, the pipelined rows are predicted at
1.17-1.38x (0.98-1.05x while the pipeline's sends and each stage's gradient reduction
were priced exposed: those charges stood in for losses the model lacks, likely NCCL's
contention with compute at ``comm_overlap`` 1, not measured on a GPU) and the
unpipelined ones at 1.12-1.22x as partc plans them; with
micro-batches of one (:data:`MICROBATCH_OF_THE_BATCHES`) 16B and 32B, whose
data-parallel groups hold two ranks and one rank per node (a NIC each), spend 0.15 and
0.36 s on exposed data-parallel traffic that 0.85 and 0.89 s published steps leave no
room for: they likely ran larger microbatches, which the table does not say. 1.7B and
7.1B run their rings over 8 and 4 NICs a node (:mod:`partc.cost.collectives`) and expose
little either way. 1.7B (1.11x fitted, 1.22x at 0.70) is the row furthest above: the one
without tensor parallelism, where the fitted row's sequence-parallel rings cost kernels
and adds of their own (``LayerCost.ring_kernels``: 132 more kernels per block and
microbatch of several samples at tp = 8, 3 us each on the H100 preset, an estimate not
yet measured on a GPU), which the constant absorbs; and the 0.22 s of data-parallel
traffic its backward and forward hide are priced as costing their compute nothing (the
preset's ``comm_overlap`` of 1, also not measured on a GPU). Its loss runs on the
whole vocabulary, where the tensor-parallel rows' run Megatron's vocab-parallel cross
entropy on a tp-th of it (``partc.runtime.tp_loss``; before it, each rank of 32B ran the
whole loss, and 1.7B was predicted at 1.15x).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import partc
from partc.compiler import build_problem, plan_problem
from partc.device.presets import PRESETS
from partc.problem import PlanningProblem
from partc.spec import INTERLEAVED
from tests.validation.megatron import (Assignment, even_runs, even_stages, layer_names,
                                       peak_bytes, plan_assignment, played_seconds, price,
                                       step_seconds)

_SAMPLES = Path(__file__).resolve().parents[2] / "samples"
if str(_SAMPLES) not in sys.path:
    sys.path.insert(0, str(_SAMPLES))

from gpt import GPT, GPTConfig, loss_fn  # noqa: E402

VOCAB = 131072
SEQ_LEN = 4096
DROPOUT = 0.1
PEAK_TFLOPS = 989.4
DEVICE = "H100-80GB"
DEVICE_BYTES = 80 * 2**30
# What the planner plans a pipelined row's mesh with: Megatron-Core's schedule unless
# told to interleave (predict also prices the interleavings it can run).
PUBLISHED_SCHEDULE = "1f1b"
# bf16 linear layers' matmuls on one H100 SXM, as `partc calibrate` measured them
# (0.697; square matmuls of 2048^3 and more 0.71-0.72): the efficiency a row is
# predicted at when nothing is fitted.
MEASURED_EFFICIENCY = 0.70
# The micro-batch size the published batches imply: 4 pp dp sequences, 4 pp
# microbatches of one per replica (the table does not give it).
MICROBATCH_OF_THE_BATCHES = 1


@dataclass(frozen=True, kw_only=True)
class Run:
    """One row of the table."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    dp: int
    gpus: int
    batch: int
    tflops_per_gpu: float
    mfu: float | None = None
    # The table's common settings and its hardware as a partc device preset.
    vocab: int = VOCAB
    seq_len: int = SEQ_LEN
    device: str = DEVICE

    @property
    def name(self) -> str:
        return f"{self.params_b:g}B"


RUNS: tuple[Run, ...] = tuple(Run(**row) for row in (
    dict(params_b=1.7, heads=16, hidden=2048, layers=24, tp=1, pp=1, dp=48, gpus=48,
         batch=192, tflops_per_gpu=408.8, mfu=0.41),
    dict(params_b=7.1, heads=32, hidden=4096, layers=30, tp=2, pp=1, dp=48, gpus=96,
         batch=192, tflops_per_gpu=465.9, mfu=0.47),
    dict(params_b=16, heads=48, hidden=6144, layers=32, tp=4, pp=1, dp=48, gpus=192,
         batch=192, tflops_per_gpu=489.1, mfu=0.49),
    dict(params_b=32, heads=56, hidden=7168, layers=48, tp=8, pp=1, dp=48, gpus=384,
         batch=192, tflops_per_gpu=459.6, mfu=0.46),
    dict(params_b=70, heads=64, hidden=8192, layers=84, tp=8, pp=2, dp=48, gpus=768,
         batch=384, tflops_per_gpu=419.7, mfu=0.42),
    dict(params_b=119, heads=80, hidden=10240, layers=92, tp=8, pp=4, dp=48, gpus=1536,
         batch=768, tflops_per_gpu=420.5, mfu=0.43),
    dict(params_b=177, heads=96, hidden=12288, layers=96, tp=8, pp=6, dp=48, gpus=2304,
         batch=1152, tflops_per_gpu=432.8, mfu=0.44),
    dict(params_b=314, heads=128, hidden=16384, layers=96, tp=8, pp=8, dp=48, gpus=3072,
         batch=1536, tflops_per_gpu=474.4, mfu=0.48),
    dict(params_b=462, heads=144, hidden=18432, layers=112, tp=8, pp=16, dp=48, gpus=6144,
         batch=3072, tflops_per_gpu=459.9, mfu=0.47),
))

# The row the H100's matmul efficiency is fitted on: 32B runs tensor parallelism over a
# whole node (tp = 8, as every larger row does) without a pipeline, so the constant sees
# the NVLink collectives of the larger rows but none of the pipeline's bubble and sends,
# which the other rows then test.
FIT_RUN = RUNS[3]


def run_named(name: str) -> Run:
    return next(run for run in RUNS if run.name == name)


def _run(row: Run | str) -> Run:
    return row if isinstance(row, Run) else run_named(row)


def load_runs(path: str | Path) -> tuple[Run, ...]:
    """The rows of a published table in the schema of ``mcore_h100_weak_scaling.json``
    (``rows`` of heads, hidden, layers, tp, pp, dp, gpus, batch and tflops_per_gpu;
    ``common``'s vocab_size and seq_len; ``hardware``'s gpu, named as a partc device
    preset is, e.g. "H100-80GB SXM"), to predict as :data:`RUNS` are
    (``benchmarks/validation.py --table``)."""
    table = json.loads(Path(path).read_text())
    common, gpu = table.get("common", {}), table.get("hardware", {}).get("gpu", DEVICE)
    shared = dict(vocab=common.get("vocab_size", VOCAB),
                  seq_len=common.get("seq_len", SEQ_LEN), device=_preset_named(gpu))
    fields = {f.name for f in dataclasses.fields(Run)}
    needed = {f.name for f in dataclasses.fields(Run)
              if f.default is dataclasses.MISSING}
    runs = []
    for row in table["rows"]:
        if needed - set(row):
            raise ValueError(f"{path}: row {row} lacks {sorted(needed - set(row))}")
        # A row's own settings stand over the common ones; other keys only describe it.
        given = {key: value for key, value in row.items() if key in fields}
        runs.append(Run(**(shared | given)))
    return tuple(runs)


def _preset_named(gpu: str) -> str:
    """The device preset a table's hardware names ("H100-80GB SXM" -> "H100-80GB")."""
    def key(text: str) -> str:
        return "".join(c for c in text.upper() if c.isalnum())

    found = [name for name in PRESETS if key(gpu).startswith(key(name))]
    if not found:
        raise ValueError(f"hardware {gpu!r} names no device preset ({', '.join(PRESETS)})")
    return max(found, key=len)


def step_flops(run: Run) -> float:
    """Model FLOPs of one step as Megatron counts them (no recompute)."""
    b, s, l, h = run.batch, run.seq_len, run.layers, run.hidden
    return 72 * b * s * l * h**2 * (1 + s / (6 * h) + run.vocab / (12 * l * h))


def tflops_per_gpu(run: Run, step_s: float) -> float:
    return step_flops(run) / (step_s * run.gpus) / 1e12


def budget(run: Run, flops_efficiency: float | None = None) -> partc.DeviceBudget:
    return partc.DeviceBudget(num_devices=run.gpus, device=run.device,
                              flops_efficiency=flops_efficiency)


def train_spec(run: Run) -> partc.TrainSpec:
    return partc.TrainSpec(global_batch_size=run.batch, dtype=torch.bfloat16,
                           optimizer="adam", attention="fused")


def gpt(run: Run) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    """The row's GPT on the meta device, head untied, with (1, seq_len) ids and targets."""
    config = GPTConfig(n_layer=run.layers, n_head=run.heads, n_embd=run.hidden,
                       vocab_size=run.vocab, block_size=run.seq_len, dropout=DROPOUT)
    with torch.device("meta"):
        model = GPT(config)
        model.lm_head.weight = torch.nn.Parameter(torch.empty(run.vocab, run.hidden))
        ids = torch.zeros(1, run.seq_len, dtype=torch.long)
    return model, ids, ids.clone()


@functools.lru_cache(maxsize=None)
def analysed(row: Run | str):
    """(graph, ModelAnalysis) of the row's GPT, measured as ``partc.compile`` does."""
    from partc.passes.pipeline import analyze

    run = _run(row)
    model, ids, target = gpt(run)
    return analyze(model, (ids,), loss_fn=loss_fn, example_target=target,
                   name=f"mcore-gpt-{run.name}", attention="fused",
                   autocast=torch.bfloat16, autocast_device="cuda")


def published(run: Run, megatron_pipeline: bool = True,
              micro_batch_size: int | None = None) -> partc.Constraints:
    """The published mesh and the distributed optimizer, and a pipeline as Megatron-Core
    runs it (:data:`PUBLISHED_SCHEDULE` over :func:`even_stages`; without
    ``megatron_pipeline``, the schedule and stages partc chooses); the rest left to the
    planner, the micro-batch size too unless ``micro_batch_size`` pins it."""
    pipelined = run.pp > 1 and megatron_pipeline
    return partc.Constraints(tp=run.tp, pp=run.pp, dp=run.dp, zero_stage=1,
                             tp_objective="time" if run.tp > 1 else None,
                             schedule=PUBLISHED_SCHEDULE if pipelined else None,
                             stages=even_stages(run, run.pp) if pipelined else None,
                             micro_batch_size=micro_batch_size)


@functools.lru_cache(maxsize=None)
def problem(row: Run | str, flops_efficiency: float | None, own: bool = False,
            megatron_pipeline: bool = True,
            micro_batch_size: int | None = None) -> PlanningProblem:
    """The row's planning problem: its published mesh pinned (:func:`published`), or
    (``own``) nothing but the devices and the batch."""
    run = _run(row)
    graph, analysis = analysed(run)
    constraints = partc.Constraints() if own else published(run, megatron_pipeline,
                                                            micro_batch_size)
    return build_problem(analysis, budget(run, flops_efficiency), train_spec(run),
                         constraints, graph)


def plan(problem: PlanningProblem, options: partc.PlannerOptions | None = None) -> partc.Plan:
    return plan_problem(problem, options=options or partc.PlannerOptions())


def with_efficiency(problem: PlanningProblem, efficiency: float) -> PlanningProblem:
    devices = dataclasses.replace(problem.devices, flops_efficiency=efficiency)
    return dataclasses.replace(problem, devices=devices)


def fit_efficiency(run: Run, problem: PlanningProblem, assignment: Assignment,
                   low: float = 0.05, high: float = 1.0, tolerance: float = 1e-6) -> float:
    """The matmul efficiency at which ``assignment`` (the planner's plan for the row)
    is predicted at the published TF/GPU, by bisection."""
    def gap(efficiency: float) -> float:
        step = step_seconds(price(with_efficiency(problem, efficiency), assignment))
        return tflops_per_gpu(run, step) - run.tflops_per_gpu

    if gap(high) < 0:
        raise ValueError(f"{run.name}: even at 100% of peak partc predicts less than the "
                         f"published {run.tflops_per_gpu} TF/GPU")
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (middle, high) if gap(middle) < 0 else (low, middle)
    return (low + high) / 2


@functools.lru_cache(maxsize=None)
def fitted_efficiency(fit: Run = FIT_RUN) -> float:
    """One efficiency, fitted on ``fit``'s published mesh as planned (:data:`FIT_RUN`)."""
    fit_problem = problem(fit, None)
    fit_plan = plan(fit_problem)
    return fit_efficiency(fit, fit_problem, plan_assignment(fit_plan))


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """A row as partc predicts it: ``plan`` is the planner's (the published mesh pinned,
    plain 1F1B on a pipelined row), ``chunks`` the virtual stages per rank of the
    schedule predicted (1: the plan's own; more: Megatron-Core's interleaved 1F1B over
    that many chunks of its even split, the plan's micro-batch size, sequence
    parallelism and recompute kept), ``peak`` that schedule's peak bytes."""

    run: Run
    plan: partc.Plan
    tflops_per_gpu: float
    chunks: int = 1
    peak: int | None = None
    interleaved: Assignment | None = None

    @property
    def assignment(self) -> Assignment:
        """What was priced: the plan's, or its interleaving's."""
        return plan_assignment(self.plan) if self.interleaved is None else self.interleaved

    @property
    def ratio(self) -> float:
        return self.tflops_per_gpu / self.run.tflops_per_gpu

    @property
    def planned_tflops_per_gpu(self) -> float:
        """The plan's own schedule's TF/GPU (a pipelined row's plain 1F1B)."""
        return tflops_per_gpu(self.run, self.plan.predicted.step_time_s)

    @property
    def peak_bytes(self) -> int:
        return self.plan.predicted.peak_memory_bytes if self.peak is None else self.peak

    @property
    def schedule(self) -> str:
        return INTERLEAVED if self.chunks > 1 else self.plan.schedule


def predict(row: Run | str, efficiency: float | None = None, own: bool = False,
            megatron_pipeline: bool = True, micro_batch_size: int | None = None) -> Prediction:
    """partc's prediction of the row at ``efficiency`` (the fitted one by default): its
    plan for the published mesh (pinned as :func:`published` pins it), or its own plan
    (``own``). A pipelined row's schedule is the fastest of those Megatron-Core r0.8.0
    could run on that plan within 80 GB: plain 1F1B or interleaved 1F1B
    (:func:`megatron_interleavings`); the table does not say which ran, as it does not
    give the micro-batch size, and its authors chose both for speed."""
    run = _run(row)
    efficiency = fitted_efficiency() if efficiency is None else efficiency
    pinned = problem(run, efficiency, own, megatron_pipeline, micro_batch_size)
    result = plan(pinned)
    planned = Prediction(run=run, plan=result,
                         tflops_per_gpu=tflops_per_gpu(run, result.predicted.step_time_s))
    if own or not megatron_pipeline or run.pp == 1:
        return planned
    fitting = [i for i in _interleavings(run, pinned, result)
               if i.peak_bytes <= DEVICE_BYTES]
    best = max(fitting, key=lambda i: i.tflops_per_gpu, default=None)
    if best is None or best.tflops_per_gpu <= planned.tflops_per_gpu:
        return planned
    return dataclasses.replace(planned, tflops_per_gpu=best.tflops_per_gpu,
                               chunks=best.chunks, peak=best.peak_bytes,
                               interleaved=best.assignment)


@dataclass(frozen=True, kw_only=True)
class Interleaving:
    """A row priced as interleaved 1F1B with ``chunks`` virtual stages per rank."""

    chunks: int
    tflops_per_gpu: float
    ratio: float
    peak_bytes: int
    assignment: Assignment


def megatron_interleavings(row: Run | str,
                           efficiency: float | None = None) -> list[Interleaving]:
    """The row as the planner plans its published mesh (plain 1F1B), priced under each
    interleaving Megatron-Core r0.8.0 could run instead: ``v`` chunks per rank of its
    even split for every ``v > 1`` that divides the blocks per stage, where the
    microbatches are a multiple of pp (its interleaved schedule requires it);
    micro-batch size, sequence parallelism and recompute as planned."""
    run = _run(row)
    efficiency = fitted_efficiency() if efficiency is None else efficiency
    pinned = problem(run, efficiency)
    return _interleavings(run, pinned, plan(pinned))


def _interleavings(run: Run, pinned: PlanningProblem,
                   planned: partc.Plan) -> list[Interleaving]:
    base = plan_assignment(planned)
    per_stage = run.layers // run.pp
    if run.pp == 1 or planned.num_microbatches % run.pp:
        return []
    names = layer_names(run.layers)
    mode_of = dict(zip((layer for members in planned.runs for layer in members), base.modes))
    modes = tuple(mode_of[layer] for layer in names)
    found = []
    for chunks in (v for v in range(2, per_stage + 1) if per_stage % v == 0):
        runs = even_runs(run, names, run.pp * chunks)
        config = dataclasses.replace(base.config, schedule=INTERLEAVED, chunks=chunks)
        stage_of = tuple(j for j, members in enumerate(runs) for _ in members)
        assignment = Assignment(config=config, stage_of=stage_of, modes=modes)
        evaluation = price(pinned, assignment)
        tflops = tflops_per_gpu(run, played_seconds(config, evaluation))
        found.append(Interleaving(chunks=chunks, tflops_per_gpu=tflops,
                                  ratio=tflops / run.tflops_per_gpu,
                                  peak_bytes=peak_bytes(evaluation), assignment=assignment))
    return found
