"""Megatron-LM's published GPT runs as partc problems, and partc's predictions of them.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), Table 1: GPT models of 1.7B to 1T parameters trained on DGX
A100-80GB nodes (8 GPUs per node on NVLink/NVSwitch, 8 x 200 Gb/s HDR InfiniBand per
node), mixed-precision fp16, Adam, full activation recompute of every transformer layer,
vocabulary 51200, sequence 2048. The paper reports teraFLOP/s per GPU counted with its
eq. 3, F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per step, which assumes the full
recompute (four forward passes' worth of matmuls in every transformer layer, three in
the head). :func:`tflops_per_gpu` counts partc's predicted step time the same way, so the
two compare like with like.

The micro-batch size and the interleaving of each run are not in the table; they are
those of the script Megatron-LM ships to reproduce it (``examples/sc21/run_table_1.sh``:
``--micro-batch-size`` and ``--num-layers-per-virtual-pipeline-stage``). That script
keeps Megatron's defaults for what it does not set: dropout 0.1 on attention
probabilities and hidden states, which the model here has too.

The model is ``samples/gpt.py``'s GPT, which has Megatron's GPT architecture: learned
position embeddings, pre-LayerNorm blocks with biases on every linear layer and norm, a
4h GELU MLP, a final LayerNorm and a head tied to the token embedding (12 l h^2 + 13 l h
+ (V + s) h parameters as Megatron counts them, and the final norm's 2 h). What differs
is how the work is done, not what it is: Megatron fuses scale + mask + softmax, bias +
GELU and bias + dropout + add into single kernels (the sample runs each op alone, so
partc counts more bytes moved in memory-bound ops), uses the tanh GELU, computes the
loss vocabulary-parallel (partc gathers the tensor-parallel logits and computes the
loss on every rank), and splits each pipeline send over the tensor-parallel ranks
(scatter/gather: 1/tp of the activation crosses InfiniBand per rank, where partc sends
all of it).
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import partc
from partc.compiler import build_problem, plan_problem
from partc.cost.communication import gradient_work_seconds, tp_comm_seconds
from partc.cost.evaluate import (Evaluation, evaluate, exposed_gather_ps, exposed_sync_ps,
                                 simulated_step_ps, stage_windows)
from partc.cost.layer_compute import layer_work, roofline_seconds, run_layer
from partc.cost.pipeline_config import PS_PER_S, PipelineConfig
from partc.cost.schedules import runs_compiled
from partc.cost.tables import build_cost_table
from partc.problem import PlanningProblem
from partc.spec import INTERLEAVED

_SAMPLES = Path(__file__).resolve().parents[2] / "samples"
if str(_SAMPLES) not in sys.path:
    sys.path.insert(0, str(_SAMPLES))

from gpt import GPT, GPTConfig, loss_fn  # noqa: E402

VOCAB = 51200
SEQ_LEN = 2048
DROPOUT = 0.1          # Megatron's default attention and hidden dropout
# The schedule the runs with virtual stages (76B to 530B) are predicted with: as they
# ran, now that partc's cost model prices interleaved 1F1B ("1f1b" to compare).
SCHEDULE = INTERLEAVED

# DGX A100: NVLink 3 through NVSwitch gives each GPU 600 GB/s, 300 GB/s each way; each
# GPU has one 200 Gb/s HDR InfiniBand port, 25 GB/s each way; HBM2e at 2039 GB/s. The
# latencies per collective step, 2 us on NVLink and 10 us across nodes, are the
# preset's guesses: the paper does not give them.
DGX_A100 = dict(device="A100-80GB", devices_per_node=8, intra_node_bandwidth=300e9,
                inter_node_bandwidth=25e9, hbm_bandwidth=2039e9,
                intra_node_latency_s=2e-6, link_latency_s=10e-6)


@dataclass(frozen=True, kw_only=True)
class Run:
    """One row of Table 1, with the micro-batch size and interleaving it ran with."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    dp: int
    gpus: int
    batch: int
    tflops_per_gpu: float        # published, eq. 3 FLOPs per second per GPU
    micro_batch_size: int
    layers_per_virtual_stage: int | None = None   # None: plain 1F1B, no interleaving

    @property
    def name(self) -> str:
        return f"{self.params_b:g}B"

    @property
    def num_microbatches(self) -> int:
        return self.batch // (self.dp * self.micro_batch_size)

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank under interleaved 1F1B (1: not interleaved)."""
        if self.layers_per_virtual_stage is None:
            return 1
        return self.layers // (self.pp * self.layers_per_virtual_stage)


RUNS: tuple[Run, ...] = tuple(Run(**row) for row in (
    dict(params_b=1.7, heads=24, hidden=2304, layers=24, tp=1, pp=1, dp=32, gpus=32,
         batch=512, tflops_per_gpu=137, micro_batch_size=16),
    dict(params_b=3.6, heads=32, hidden=3072, layers=30, tp=2, pp=1, dp=32, gpus=64,
         batch=512, tflops_per_gpu=138, micro_batch_size=16),
    dict(params_b=7.5, heads=32, hidden=4096, layers=36, tp=4, pp=1, dp=32, gpus=128,
         batch=512, tflops_per_gpu=142, micro_batch_size=16),
    dict(params_b=18.4, heads=48, hidden=6144, layers=40, tp=8, pp=1, dp=32, gpus=256,
         batch=1024, tflops_per_gpu=135, micro_batch_size=8),
    dict(params_b=39.1, heads=64, hidden=8192, layers=48, tp=8, pp=2, dp=32, gpus=512,
         batch=1536, tflops_per_gpu=138, micro_batch_size=4),
    dict(params_b=76.1, heads=80, hidden=10240, layers=60, tp=8, pp=4, dp=32, gpus=1024,
         batch=1792, tflops_per_gpu=140, micro_batch_size=2, layers_per_virtual_stage=5),
    dict(params_b=145.6, heads=96, hidden=12288, layers=80, tp=8, pp=8, dp=24, gpus=1536,
         batch=2304, tflops_per_gpu=148, micro_batch_size=2, layers_per_virtual_stage=5),
    dict(params_b=310.1, heads=128, hidden=16384, layers=96, tp=8, pp=16, dp=15, gpus=1920,
         batch=2160, tflops_per_gpu=155, micro_batch_size=1, layers_per_virtual_stage=3),
    dict(params_b=529.6, heads=128, hidden=20480, layers=105, tp=8, pp=35, dp=9, gpus=2520,
         batch=2520, tflops_per_gpu=163, micro_batch_size=1, layers_per_virtual_stage=1),
    dict(params_b=1008.0, heads=160, hidden=25600, layers=128, tp=8, pp=64, dp=6, gpus=3072,
         batch=3072, tflops_per_gpu=163, micro_batch_size=1),
))

# The row the A100's matmul efficiency is fitted on: 18.4B runs tensor parallelism over
# a whole node (tp = 8, as every larger run does), so the fitted constant sees the same
# share of NVLink all-reduces as the rest; with pp = 1 it is free of the pipeline's
# bubble, point-to-point and schedule terms, which the other rows then test.
FIT_RUN = RUNS[3]


def run_named(name: str) -> Run:
    return next(run for run in RUNS if run.name == name)


def step_flops(run: Run) -> float:
    """FLOPs of one step as the paper counts them (eq. 3, full recompute)."""
    b, s, l, h = run.batch, SEQ_LEN, run.layers, run.hidden
    return 96 * b * s * l * h**2 * (1 + s / (6 * h) + VOCAB / (16 * l * h))


def tflops_per_gpu(run: Run, step_s: float) -> float:
    return step_flops(run) / (step_s * run.gpus) / 1e12


def budget(run: Run, flops_efficiency: float | None = None) -> partc.DeviceBudget:
    return partc.DeviceBudget(num_devices=run.gpus, flops_efficiency=flops_efficiency,
                              **DGX_A100)


def train_spec(run: Run) -> partc.TrainSpec:
    # float16 is planned (not run: the runtime would need loss scaling). Megatron-LM
    # then ran its tensor-parallel collectives blocking: no overlap with the matmuls
    # (the chooser still reduce-scatters and gathers inside a layer where that is
    # cheaper than an all-reduce, which partc would otherwise run as rings).
    return partc.TrainSpec(global_batch_size=run.batch, dtype=torch.float16,
                           optimizer="adam", tp_overlap=False)


def gpt(run: Run) -> tuple[GPT, torch.Tensor, torch.Tensor]:
    """The run's GPT on the meta device, with (1, 2048) token ids and targets."""
    config = GPTConfig(n_layer=run.layers, n_head=run.heads, n_embd=run.hidden,
                       vocab_size=VOCAB, block_size=SEQ_LEN, dropout=DROPOUT)
    with torch.device("meta"):
        model = GPT(config)
        ids = torch.zeros(1, SEQ_LEN, dtype=torch.long)
        target = torch.zeros(1, SEQ_LEN, dtype=torch.long)
    return model, ids, target


def analyse(run: Run):
    """Trace and measure the run's GPT: (graph, ModelAnalysis) as ``partc.compile`` does."""
    from partc.passes.pipeline import analyze

    model, ids, target = gpt(run)
    return analyze(model, (ids,), loss_fn=loss_fn, example_target=target,
                   name=f"gpt-{run.name}")


def schedule(run: Run) -> str:
    """What the run used: interleaved 1F1B where it had virtual stages, plain 1F1B else."""
    return SCHEDULE if run.virtual_stages > 1 else "1f1b"


def published(run: Run) -> partc.Constraints:
    """The configuration Megatron ran, as pins: mesh, micro-batch size, schedule, no
    ZeRO, no sequence parallelism (Megatron had none yet), and recompute of every
    transformer layer and nothing else. The stages are pinned to Megatron's split
    where partc can pin them (see :func:`published_assignment`)."""
    layers = layer_names(run.layers)
    stages = even_stages(run, run.pp) if schedule(run) != INTERLEAVED else None
    return partc.Constraints(
        tp=run.tp, pp=run.pp, dp=run.dp, sequence_parallel=False,
        tp_objective="time" if run.tp > 1 else None, stages=stages,
        recompute={name: "full" if name.startswith("blocks.") else "none"
                   for name in layers},
        micro_batch_size=run.micro_batch_size, schedule=schedule(run), zero_stage=0)


def layer_names(blocks: int) -> tuple[str, ...]:
    """The layers partc finds in ``samples/gpt.py``'s GPT of ``blocks`` blocks, in order."""
    return ("tok_emb", "pos_emb", "drop", *(f"blocks.{i}" for i in range(blocks)),
            "ln_f", "lm_head", "loss")


def even_stages(run, count: int) -> list[list[str]]:
    """Megatron's split of ``run``'s GPT (anything with ``layers`` and ``name``) into
    ``count`` stages, by layer name (:func:`even_runs`)."""
    layers = layer_names(run.layers)
    return [[layers[l] for l in members] for members in even_runs(run, layers, count)]


def even_runs(run, layers: tuple[str, ...], count: int) -> list[list[int]]:
    """Megatron's split of the layers into ``count`` runs: the blocks evenly, the
    embeddings before the first, the final norm, head and loss after the last."""
    blocks = [i for i, name in enumerate(layers) if name.startswith("blocks.")]
    if len(blocks) != run.layers or run.layers % count:
        raise ValueError(f"{run.name}: {len(blocks)} blocks do not split into {count} runs")
    size = run.layers // count
    runs = [blocks[j * size:(j + 1) * size] for j in range(count)]
    runs[0] = list(range(blocks[0])) + runs[0]
    runs[-1] = runs[-1] + list(range(blocks[-1] + 1, len(layers)))
    return runs


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """A configuration with every layer placed (its run: its stage unless interleaved)
    and its recompute mode: what ``partc.cost.evaluate.evaluate`` prices."""

    config: PipelineConfig
    stage_of: tuple[int, ...]
    modes: tuple[str, ...]


def published_assignment(run: Run, problem: PlanningProblem) -> Assignment:
    """Exactly what Megatron ran, interleaving included: ``pp x v`` runs of
    ``layers_per_virtual_stage`` blocks, run ``j`` on rank ``j % pp``."""
    names = tuple(layer.name for layer in problem.layers)
    interleaved = schedule(run) == INTERLEAVED
    chunks = run.virtual_stages if interleaved else 1
    runs = even_runs(run, names, run.pp * chunks)
    stage_of = tuple(j for j, members in enumerate(runs) for _ in members)
    config = PipelineConfig(
        pp=run.pp, dp=run.dp, tp=run.tp, micro_batch_size=run.micro_batch_size,
        num_microbatches=run.num_microbatches, schedule=schedule(run),
        sequence_parallel=False, tp_objective="time", zero_stage=0, chunks=chunks)
    modes = tuple("full" if name.startswith("blocks.") else "none" for name in names)
    return Assignment(config=config, stage_of=stage_of, modes=modes)


def plan_assignment(plan: partc.Plan) -> Assignment:
    """A plan's configuration and assignment, to price or break down again."""
    config = PipelineConfig(pp=plan.pp, dp=plan.dp, tp=plan.tp,
                            micro_batch_size=plan.micro_batch_size,
                            num_microbatches=plan.num_microbatches, schedule=plan.schedule,
                            sequence_parallel=plan.sequence_parallel,
                            tp_objective=plan.tp_objective,
                            zero_stage=plan.zero_stage, chunks=plan.chunks,
                            ep=plan.mesh.ep)
    runs = plan.runs
    stage_of = tuple(j for j, members in enumerate(runs) for _ in members)
    recompute = plan.recompute
    modes = tuple(recompute[name] for members in runs for name in members)
    return Assignment(config=config, stage_of=stage_of, modes=modes)


def problem(run: Run, analysis, graph=None, constraints: partc.Constraints | None = None,
            flops_efficiency: float | None = None) -> PlanningProblem:
    """The planning problem; with ``graph``, the tensor-parallel variants the constraints
    allow are measured (without, those already in ``analysis`` are used)."""
    return build_problem(analysis, budget(run, flops_efficiency), train_spec(run),
                         constraints or partc.Constraints(), graph)


def with_efficiency(problem: PlanningProblem, efficiency: float) -> PlanningProblem:
    """The same problem on devices whose matmuls reach ``efficiency`` of peak. (The
    tensor-parallel shardings stay those chosen at the efficiency they were measured at.)"""
    devices = dataclasses.replace(problem.devices, flops_efficiency=efficiency)
    return dataclasses.replace(problem, devices=devices)


def plan(problem: PlanningProblem, options: partc.PlannerOptions | None = None) -> partc.Plan:
    return plan_problem(problem, options=options or partc.PlannerOptions())


def price(problem: PlanningProblem, assignment: Assignment) -> Evaluation:
    """The cost model's step time and memory for ``assignment``, without the planner."""
    table = build_cost_table(problem, assignment.config)
    return evaluate(table, assignment.stage_of, assignment.modes)


def step_seconds(evaluation: Evaluation) -> float:
    return evaluation.step_ps / PS_PER_S


def played_seconds(config: PipelineConfig, evaluation: Evaluation) -> float:
    """The step a plan of ``evaluation`` reports: its schedule played out
    (:func:`~partc.cost.evaluate.simulated_step_ps`), where :func:`step_seconds` is the
    closed form the search weighs (Megatron's ``(m + (p - 1) / v) t`` for interleaving,
    which the step played out need not equal)."""
    return simulated_step_ps(config, evaluation)[0] / PS_PER_S


def peak_bytes(evaluation: Evaluation) -> int:
    """The largest stage's memory. partc's runtime holds the pipeline's receive buffers
    as Megatron-LM does, each made for its microbatch and freed after its backward (a
    gradient's for the backward being run; an activation's is the input the stage
    saves), so the plan's peak is Megatron's too."""
    return max(stage.memory.peak for stage in evaluation.stages)


def fit_efficiency(run: Run, problem: PlanningProblem, assignment: Assignment,
                   low: float = 0.05, high: float = 1.0, tolerance: float = 1e-6) -> float:
    """The matmul efficiency at which the predicted throughput of ``assignment`` equals
    the published one, by bisection (step time is not linear in 1/efficiency:
    memory-bound work and communication do not scale with it, and the exposed part of
    the dp all-reduce depends on how long the backward takes)."""
    def gap(efficiency: float) -> float:
        step = step_seconds(price(with_efficiency(problem, efficiency), assignment))
        return tflops_per_gpu(run, step) - run.tflops_per_gpu

    if gap(high) < 0:
        raise ValueError(f"{run.name}: even at 100% of peak partc predicts less than the "
                         f"published {run.tflops_per_gpu} TFLOP/s per GPU")
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (middle, high) if gap(middle) < 0 else (low, middle)
    return (low + high) / 2


@dataclass(frozen=True, kw_only=True)
class Breakdown:
    """A step's predicted time on its bottleneck rank, by cause, in seconds.

    ``step = compute + attention + memory + tp + tp_latency + p2p + grads + bubble +
    dp_sync + optimizer + tied``: the first seven are the bottleneck rank's work over all
    microbatches (ops bound by their FLOPs at the devices' efficiency, fused attention
    kernels bound by theirs at the devices' attention efficiency, ops bound by their
    bytes at HBM bandwidth,
    tensor-parallel collectives' bytes and their per-step latency, pipeline sends, the
    runtime's adds of each microbatch's gradients into their fp32 buckets);
    ``bubble`` is the pipeline's fill and
    drain (the other ranks' time for one microbatch, divided by the chunks when
    interleaved); then what follows the pipeline: the exposed dp gradient all-reduce
    (with its latency), the optimizer step and the tied embedding's gradient sync.
    """

    compute: float
    attention: float
    memory: float
    tp: float
    tp_latency: float
    p2p: float
    grads: float
    bubble: float
    dp_sync: float
    optimizer: float
    tied: float
    step: float

    @property
    def terms(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in
                ("compute", "attention", "memory", "tp", "tp_latency", "p2p", "grads",
                 "bubble", "dp_sync", "optimizer", "tied")}


def breakdown(problem: PlanningProblem, assignment: Assignment) -> Breakdown:
    """Split the predicted step time of ``assignment`` by cause (for ZeRO 0/1: ZeRO-2/3
    overlap their collectives with compute, which this split does not separate)."""
    config = assignment.config
    table = build_cost_table(problem, config)
    evaluation = evaluate(table, assignment.stage_of, assignment.modes)
    local = problem.variant(config.tp, config.sequence_parallel, config.tp_objective)
    m, stages = config.num_microbatches, evaluation.stages
    worst = max(stages, key=lambda s: s.busy_ps)
    layers = [(l, assignment.modes[l]) for l in worst.layers]
    work = _work_seconds(local, config, layers)
    no_latency = dataclasses.replace(local.devices, intra_node_latency_s=0.0)
    bandwidth = _work_seconds(dataclasses.replace(local, devices=no_latency), config,
                              layers)["tp"]
    index = max(range(len(stages)), key=lambda s: stages[s].tail_ps)
    last, windows = stages[index], stage_windows(config, index)
    rows = [table.layers[l] for l in last.layers]
    held = [g for g in table.shared if any(l in last.layers for l in g.layers)]
    sync_ps = sum(r.sync_ps for r in rows) + sum(g.sync_ps for g in held)
    gather_ps = sum(r.gather_ps for r in rows) + sum(g.gather_ps for g in held)
    exposed = exposed_sync_ps(sync_ps, last.backward_ps, table.overlap_permille,
                              table.last_sync_ps, windows.sync) + table.tail_latency_ps \
        + exposed_gather_ps(gather_ps, last.forward_ps, table.first_gather_ps,
                            table.overlap_permille, windows.gather)
    optimizer = sum(r.tail_ps for r in rows) + sum(g.tail_ps for g in held)
    fill_drain = evaluation.pipeline_ps - m * worst.busy_ps
    grads = m * sum(gradient_work_seconds(local, config, local.layers[l].param_count,
                                          local.layers[l].param_tensors)["backward"]
                    for l, _ in layers)
    return Breakdown(
        compute=m * (work["compute"] - work["attention"]), attention=m * work["attention"],
        memory=m * work["memory"], tp=m * bandwidth,
        tp_latency=m * (work["tp"] - bandwidth),
        p2p=m * worst.comm_ps / PS_PER_S, grads=grads, bubble=fill_drain / PS_PER_S,
        dp_sync=exposed / PS_PER_S, optimizer=optimizer / PS_PER_S,
        tied=evaluation.tie_ps / PS_PER_S, step=evaluation.step_ps / PS_PER_S)


def _work_seconds(problem: PlanningProblem, config: PipelineConfig,
                  layers: list[tuple[int, str]]) -> dict[str, float]:
    """One microbatch's forward, backward and recompute of ``layers`` (index, mode), split
    into compute-bound ops (of which ``attention``: fused attention kernels), memory-bound
    ops and tensor-parallel collectives, as ``partc.cost`` charges them."""
    total = {"compute": 0.0, "attention": 0.0, "memory": 0.0, "tp": 0.0}
    b, scale = config.micro_batch_size, problem.train.measured_scale
    for index, mode in layers:
        layer = run_layer(problem, index, b)
        work = layer_work(layer, problem.devices, b, scale,
                          runs_compiled(config.schedule, problem.train.compiled))
        for compute, memory in (work["forward"], work["backward"], work["recompute"][mode]):
            total["compute"] += compute
            total["memory"] += memory
        kernels = [op for op in layer.heavy_ops if op.attention]
        replayed = layer.recompute_flops[mode] / layer.fwd_flops if layer.fwd_flops else 0.0
        forward = roofline_seconds(kernels, problem.devices, b, scale)[0]
        total["attention"] += (1 + replayed) * forward + roofline_seconds(
            kernels, problem.devices, b, scale, backward=True)[0]
        comm = tp_comm_seconds(problem, config, layer)
        total["tp"] += comm["forward"] + comm["backward"] + (
            comm["forward"] if mode != "none" else 0.0)
    return total
