"""Llama 3 405B's published pre-training mesh as a partc problem, and the layouts
Megatron-Core could run on it.

The Llama 3 paper (Dubey et al. 2024, section 3.3 and table 4): 8,192 H100-80GB, tensor
parallelism 8, pipeline parallelism 16, data parallelism 64, 16M tokens per step as
2,048 sequences of 8,192, bf16, 430 TF/GPU; 126 transformer layers, the first and last
pipeline stages one layer short of the others (128 slots of 8 per stage, the
embedding and the head taking a slot each). The model is Hugging Face's
``LlamaForCausalLM`` with Llama 3 405B's shape (``samples/plan_llama.py``), built on the
meta device and planned for the H100-80GB preset with only the devices, the batch and
bf16 given (:func:`problem`), or the published tp, pp and dp pinned as well.

:func:`megatron_layouts` prices that split as Megatron-Core runs it: plain 1F1B over the
16 stages (7, 8, ..., 8, 7 layers), and interleaved 1F1B with ``v`` chunks per rank for
every ``v`` that divides the 8 slots of a stage (the 128 slots cut evenly into
``16 v`` chunks, the first and the last chunk one layer short), where the microbatches
are a multiple of pp; the micro-batch size, ZeRO stage, sequence parallelism and
recompute of the planner's plan of the pinned mesh kept.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import partc
from partc.compiler import build_problem
from partc.problem import PlanningProblem
from partc.spec import INTERLEAVED
from tests.validation.megatron import (Assignment, peak_bytes, plan, plan_assignment,
                                       played_seconds, price)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "samples"))
from plan_llama import LLAMA3_405B, build_llama, causal_lm_loss  # noqa: E402

DEVICE = "H100-80GB"
GPUS = 8192
MESH = dict(tp=8, pp=16, dp=64)
BATCH = 2048
SEQ_LEN = 8192
SLOTS_PER_STAGE = 8   # 128 slots over 16 stages; the first and last hold one layer fewer
TFLOPS_PER_GPU = 430.0
PARAMS = 405.8e9


def step_flops() -> float:
    """Model FLOPs of one step as the paper counts them: 6 N T plus attention's 12 l h s T."""
    tokens = BATCH * SEQ_LEN
    return (6 * PARAMS * tokens + 12 * LLAMA3_405B["num_hidden_layers"]
            * LLAMA3_405B["hidden_size"] * SEQ_LEN * tokens)


def published_step_s() -> float:
    return step_flops() / (GPUS * TFLOPS_PER_GPU * 1e12)


@functools.lru_cache(maxsize=None)
def analysed():
    """(graph, ModelAnalysis) of Llama 3 405B on the meta device, as ``partc.compile``
    measures it in bf16 for a CUDA device."""
    from partc.passes.pipeline import analyze

    model = build_llama(LLAMA3_405B)
    ids = torch.zeros(1, SEQ_LEN, dtype=torch.long, device="meta")
    return analyze(model, (ids,), loss_fn=causal_lm_loss, example_target=ids,
                   name="llama3-405b", autocast=torch.bfloat16, autocast_device="cuda")


@functools.lru_cache(maxsize=None)
def problem(pinned: bool) -> PlanningProblem:
    """The planning problem: the devices, batch and bf16; ``pinned``: the published
    tp, pp and dp too (the schedule, split, ZeRO stage and recompute the planner's)."""
    graph, analysis = analysed()
    budget = partc.DeviceBudget(num_devices=GPUS, device=DEVICE)
    train = partc.TrainSpec(global_batch_size=BATCH, dtype=torch.bfloat16)
    constraints = partc.Constraints(**MESH) if pinned else partc.Constraints()
    return build_problem(analysis, budget, train, constraints, graph)


@functools.lru_cache(maxsize=None)
def planned(pinned: bool) -> partc.Plan:
    return plan(problem(pinned))


def llama_runs(names: tuple[str, ...], count: int) -> list[list[int]]:
    """The layers' runs of Llama 3's split into ``count`` chunks: the ``16 x 8`` slots
    cut evenly, the first chunk's first slot the embedding's and the last chunk's last
    the head's (with the final norm and the loss)."""
    blocks = [i for i, name in enumerate(names) if name.startswith("model.layers.")]
    slots = MESH["pp"] * SLOTS_PER_STAGE
    if len(blocks) != slots - 2 or slots % count:
        raise ValueError(f"{len(blocks)} blocks do not fill {slots} slots in {count} chunks")
    size = slots // count
    # Slot s holds block s - 1; slots 0 and slots - 1 hold the embedding and the head.
    runs = [[blocks[s - 1] for s in range(j * size, (j + 1) * size) if 0 < s < slots - 1]
            for j in range(count)]
    runs[0] = list(range(blocks[0])) + runs[0]
    runs[-1] = runs[-1] + list(range(blocks[-1] + 1, len(names)))
    return runs


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The pinned mesh's plan re-split as Megatron-Core runs it, ``chunks`` per rank."""

    chunks: int
    step_s: float
    peak_bytes: int
    assignment: Assignment


def megatron_layouts() -> list[Layout]:
    """Llama 3's split of the pinned mesh's plan (:func:`llama_runs`) under plain 1F1B
    and each interleaving Megatron-Core could run, each played out."""
    pinned = problem(True)
    base = plan_assignment(planned(True))
    names = tuple(layer.name for layer in pinned.layers)
    mode_of = dict(zip((layer for members in planned(True).runs for layer in members),
                       base.modes))
    modes = tuple(mode_of[name] for name in names)
    pp, m = MESH["pp"], base.config.num_microbatches
    found = []
    for chunks in (v for v in range(1, SLOTS_PER_STAGE + 1) if SLOTS_PER_STAGE % v == 0):
        if chunks > 1 and m % pp:
            continue
        runs = llama_runs(names, pp * chunks)
        config = dataclasses.replace(base.config, schedule=INTERLEAVED if chunks > 1
                                     else "1f1b", chunks=chunks)
        stage_of = tuple(j for j, members in enumerate(runs) for _ in members)
        assignment = Assignment(config=config, stage_of=stage_of, modes=modes)
        evaluation = price(pinned, assignment)
        found.append(Layout(chunks=chunks, step_s=played_seconds(config, evaluation),
                            peak_bytes=peak_bytes(evaluation), assignment=assignment))
    return found
