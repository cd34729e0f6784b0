"""Run under torchrun by the runtime tests: train each named case with partc and on one
process, on every rank, and write what was seen to ``<out>/rank<k>.json``.

    torchrun --standalone --nproc-per-node=2 tests/runtime/worker.py OUT CASE [CASE ...]

``A+B`` compiles and builds cases A and B in the same process, then trains A, then B
(the results of each under its own name inside ``A+B``'s).

A case that raises is recorded with its error rather than ending the run, so one
failure does not hide the others (every rank raises alike: checks come before
collectives).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import os
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_param_group  # noqa: E402

import partc  # noqa: E402
from partc.codec import to_data  # noqa: E402
from partc.runtime import cp_layout  # noqa: E402
from partc.runtime.cp_group import ContextParallelGroup, attention  # noqa: E402
from partc.runtime.ring_attention import AttentionMask  # noqa: E402
from partc.passes.fuse_attention import count_fused  # noqa: E402
from partc.runtime import activation_offload, topology, tp as tp_ops  # noqa: E402
from samples import gpt  # noqa: E402
from tests import hf_families, models  # noqa: E402

BATCH, SEQ, STEPS = 8, 16, 3

# FSDP's gradient reductions in this process (one per unit that reduce-scatters): a
# ZeRO-2 plan that reduces once per step makes one per unit a step, else one per unit
# and microbatch.
FSDP_REDUCES = [0]
_foreach_reduce = fsdp_param_group.foreach_reduce


def _counted_reduce(*args: Any, **kwargs: Any) -> Any:
    FSDP_REDUCES[0] += 1
    return _foreach_reduce(*args, **kwargs)


fsdp_param_group.foreach_reduce = _counted_reduce


@dataclass(frozen=True)
class Case:
    build: Callable[[], torch.nn.Module]
    data: str  # "tokens" or "floats"
    loss_fn: Callable
    constraints: dict[str, Any] = field(default_factory=dict)
    # "batch": the reference trains on the whole batch at once. "microbatches": one
    # microbatch after another from the same random state as the program, so that
    # dropout draws the same masks (tp only: a pipeline draws per stage).
    reference: str = "batch"
    clip: float | None = None  # TrainSpec.max_grad_norm; the reference clips likewise
    dtype: torch.dtype = torch.float32  # TrainSpec.dtype; the reference trains in fp32
    attention: str = "as_written"  # TrainSpec.attention; the reference runs it as written
    compile: bool = False  # TrainSpec.compile; the reference runs eagerly
    tp_overlap: bool = True  # TrainSpec.tp_overlap: sequence-parallel rings or blocking
    # TrainSpec.fp8: the reference runs the plan's FP8 linears as torchao's Float8Linear
    # modules (emulated), one microbatch after another (each casts with its own scales).
    fp8: bool = False
    # DeviceFigures overriding the CPU preset's in the budget planned for (a faster link).
    figures: dict[str, Any] = field(default_factory=dict)


def _tokens(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    return getattr(config, "vocab_size", 128)


def _gpt2(n_layer: int = 2) -> torch.nn.Module:
    # Dropout draws different masks when a batch is cut into microbatches: parity with
    # one process needs it off. (Recompute replays the forward's masks:
    # tests/passes/test_recompute.py.)
    return models.gpt2(n_layer=n_layer, dropout=0.0)


def _skip() -> torch.nn.Module:
    # stem, 4 blocks, head: in 4 stages the stem's output crosses every boundary.
    return models.LongSkip(width=16, depth=4)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def _hidden_mse(output: Any, target: torch.Tensor) -> torch.Tensor:
    """An encoder's loss: its last hidden state against a float target."""
    return F.mse_loss(output.last_hidden_state, target)


ALL_MODES = {"blocks.0": "full", "blocks.1": "selective"}
HF_MODES = {"model.layers.0": "full", "model.layers.1": "selective"}
GPT2_MODES = {"transformer.h.0": "selective", "transformer.h.1": "full"}

CASES: dict[str, Case] = {
    # 2 processes
    "gpt-pp2-1f1b": Case(gpt.gpt_tiny, "tokens", gpt.loss_fn, dict(pp=2, schedule="1f1b")),
    "gpt-pp2-gpipe-recompute": Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                    dict(pp=2, schedule="gpipe", recompute=ALL_MODES)),
    "gpt2-pp2-1f1b-recompute": Case(_gpt2, "tokens", models.causal_lm_loss,
                                    dict(pp=2, schedule="1f1b", recompute=GPT2_MODES)),
    "gpt2-pp2-gpipe": Case(_gpt2, "tokens", models.causal_lm_loss,
                           dict(pp=2, schedule="gpipe", recompute="none")),
    "llama-pp2-gpipe-recompute": Case(models.llama, "tokens", models.causal_lm_loss,
                                      dict(pp=2, schedule="gpipe", recompute=HF_MODES)),
    "llama-pp2-1f1b": Case(models.llama, "tokens", models.causal_lm_loss,
                           dict(pp=2, schedule="1f1b", recompute="none")),
    "skip-pp2-1f1b": Case(_skip, "floats", _mse, dict(pp=2, schedule="1f1b")),
    "llama-pp2-1f1b-loaded": Case(models.llama, "tokens", models.causal_lm_loss,
                                  dict(pp=2, schedule="1f1b", recompute=HF_MODES)),
    "gpt-dp2": Case(gpt.gpt_tiny, "tokens", gpt.loss_fn, dict(pp=1, dp=2)),
    # 4 processes
    "gpt-pp4-1f1b-recompute": Case(lambda: gpt.gpt_tiny(n_layer=4), "tokens", gpt.loss_fn,
                                   dict(pp=4, schedule="1f1b", recompute="full")),
    "gpt-pp4-gpipe": Case(lambda: gpt.gpt_tiny(n_layer=4), "tokens", gpt.loss_fn,
                          dict(pp=4, schedule="gpipe", recompute="none")),
    "gpt2-pp4-gpipe-recompute": Case(lambda: _gpt2(n_layer=4), "tokens",
                                     models.causal_lm_loss,
                                     dict(pp=4, schedule="gpipe", recompute="selective")),
    "llama-pp4-1f1b": Case(lambda: models.llama(n_layer=4), "tokens", models.causal_lm_loss,
                           dict(pp=4, schedule="1f1b", recompute=HF_MODES)),
    "skip-pp4-gpipe": Case(_skip, "floats", _mse, dict(pp=4, schedule="gpipe")),
    "gpt-pp2-dp2": Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                        dict(pp=2, dp=2, schedule="1f1b", recompute=ALL_MODES)),
    # Side effects (tests/runtime/test_side_effects.py): in-place ops nobody reads, under
    # recompute too; export's lifted constant of a slice assignment.
    "inplace-pp2-1f1b": Case(lambda: models.InPlaceScale(width=16, depth=4, d_out=16),
                             "floats", _mse, dict(pp=2, schedule="1f1b", recompute="none")),
    "inplace-pp2-gpipe-recompute": Case(
        lambda: models.InPlaceScale(width=16, depth=4, d_out=16), "floats", _mse,
        dict(pp=2, schedule="gpipe", recompute={"blocks.0": "full", "blocks.3": "selective"})),
    "slice-pp2-1f1b": Case(lambda: models.SliceZero(width=16, depth=4, d_out=16), "floats",
                           _mse, dict(pp=2, schedule="1f1b")),
    # One module called twice, sharded alike in both calls (the fewest parameter bytes).
    "twice-tp2": Case(lambda: models.CalledTwiceInARow(width=16), "floats", _mse,
                      dict(pp=1, tp=2, tp_objective="memory", recompute="none")),
}

# Tensor parallelism: the sharding that holds the fewest parameter bytes (the tiny models
# here would otherwise stay replicated on a CPU budget), with and without sequence
# parallelism; 2 processes are tp=2, 4 are pp=2 x tp=2.
_TP_MODELS = {
    "gpt": (gpt.gpt_tiny, "tokens", gpt.loss_fn),
    "gpt2": (_gpt2, "tokens", models.causal_lm_loss),
    "llama": (models.llama, "tokens", models.causal_lm_loss),
    "bert": (lambda: models.bert(dropout=0.0), "hidden", _hidden_mse),
}
for _name, (_build, _data, _loss) in _TP_MODELS.items():
    for _sp in (False, True):
        _tp = dict(tp=2, sequence_parallel=_sp, tp_objective="memory", recompute="none")
        _suffix = "-sp" if _sp else ""
        CASES[f"{_name}-tp2{_suffix}"] = Case(_build, _data, _loss, dict(pp=1, **_tp))
        CASES[f"{_name}-pp2-tp2{_suffix}"] = Case(_build, _data, _loss,
                                                 dict(pp=2, schedule="1f1b", **_tp))
# A vocabulary large enough that the LM head's logits stay sharded by class into a
# vocab-parallel cross entropy (partc.runtime.tp_loss): a CPU group gathers the logits of
# the tiny models' 128 classes sooner than it runs two all-reduces.
_VOCAB = 2048
CASES["gpt-tp2-sp-vocab"] = Case(lambda: gpt.gpt_tiny(vocab_size=_VOCAB), "tokens",
                                 gpt.loss_fn, dict(pp=1, tp=2, sequence_parallel=True,
                                                   tp_objective="memory", recompute="none"))
CASES["gpt-tp2-sp-vocab-recompute"] = Case(lambda: gpt.gpt_tiny(vocab_size=_VOCAB), "tokens",
                                           gpt.loss_fn,
                                           dict(pp=1, tp=2, sequence_parallel=True,
                                                tp_objective="memory", recompute="full"))
CASES["llama-tp2-vocab"] = Case(lambda: models.llama(vocab=_VOCAB), "tokens",
                                models.causal_lm_loss,
                                dict(pp=1, tp=2, tp_objective="memory", recompute="none"))
CASES["gpt2-pp2-tp2-sp-vocab"] = Case(lambda: models.gpt2(vocab=_VOCAB, dropout=0.0),
                                      "tokens", models.causal_lm_loss,
                                      dict(pp=2, schedule="1f1b", tp=2, sequence_parallel=True,
                                           tp_objective="memory", recompute="none"))
# Plain tensor parallelism (sequence_parallel=False), the fastest sharding planned for a
# link fast enough that, left free, the chooser would reduce-scatter each block's output
# and run its norms and residuals on sequence shards: all-reduces, norms whole.
CASES["llama-tp2-fast-link"] = Case(
    models.llama, "tokens", models.causal_lm_loss,
    dict(pp=1, tp=2, sequence_parallel=False, tp_objective="time", recompute="none"),
    figures=dict(intra_node_bandwidth=1e12, intra_node_latency_s=1e-7, collective_links=()))
# Sequence parallelism with its collectives blocking (TrainSpec.tp_overlap=False); the
# "-sp" cases above run them as rings beside the linears' matmuls.
for _name in ("gpt", "llama"):
    _build, _data, _loss = _TP_MODELS[_name]
    for _pp in (1, 2):
        _mesh = dict(pp=1) if _pp == 1 else dict(pp=2, schedule="1f1b")
        CASES[f"{_name}-{'pp2-' if _pp == 2 else ''}tp2-sp-blocking"] = Case(
            _build, _data, _loss,
            dict(tp=2, sequence_parallel=True, tp_objective="memory", recompute="none",
                 **_mesh), tp_overlap=False)
# Recompute inside tensor-parallel layers: full recompute replays the layer's forward
# collectives, selective recompute keeps them out of the replay.
_TP_RECOMPUTE = dict(tp=2, tp_objective="memory")
CASES["gpt-tp2-recompute"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                  dict(pp=1, recompute=ALL_MODES, **_TP_RECOMPUTE))
# Dropout 0.1 in sharded regions: each rank keeps its part of the whole tensor's mask.
for _name, _build in (("gpt", lambda: gpt.gpt_tiny(dropout=0.1)),
                      ("gpt2", lambda: models.gpt2(dropout=0.1))):
    _data, _loss = _TP_MODELS[_name][1:]
    for _sp in (False, True):
        CASES[f"{_name}-tp2{'-sp' if _sp else ''}-dropout"] = Case(
            _build, _data, _loss,
            dict(pp=1, tp=2, sequence_parallel=_sp, tp_objective="memory", recompute="none"),
            reference="microbatches")
CASES["gpt2-tp2-dropout-recompute"] = Case(
    lambda: models.gpt2(dropout=0.1), "tokens", models.causal_lm_loss,
    dict(pp=1, tp=2, tp_objective="memory", recompute=GPT2_MODES), reference="microbatches")
# Global gradient-norm clipping: below the gradients' norm, so that it scales them.
_CLIP = 0.5
CASES["gpt-dp2-clip"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn, dict(pp=1, dp=2), clip=_CLIP)
CASES["gpt2-pp2-clip"] = Case(_gpt2, "tokens", models.causal_lm_loss,
                              dict(pp=2, schedule="1f1b", recompute="none"), clip=_CLIP)
CASES["gpt-tp2-sp-clip"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                dict(pp=1, tp=2, sequence_parallel=True, tp_objective="memory",
                                     recompute="none"), clip=_CLIP)
CASES["llama-pp2-tp2-clip"] = Case(models.llama, "tokens", models.causal_lm_loss,
                                   dict(pp=2, tp=2, schedule="1f1b", tp_objective="memory",
                                        recompute="none"), clip=_CLIP)
CASES["gpt-pp2-dp2-clip"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                 dict(pp=2, dp=2, schedule="1f1b"), clip=_CLIP)
# The loss alone on the last stage: a stage without parameters trains with the README's
# loop (its optimizer steps nothing).
CASES["gpt-pp2-loss-alone"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn, dict(
    pp=2, schedule="1f1b", stages=[["tok_emb", "pos_emb", "drop", "blocks.0", "blocks.1",
                                    "ln_f", "lm_head"], ["loss"]]))
# ZeRO-1: each dp rank holds and steps the optimizer state of half the parameters.
CASES["gpt-dp2-zero1"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                              dict(pp=1, dp=2, zero_stage=1))
CASES["gpt2-dp2-zero1-clip"] = Case(_gpt2, "tokens", models.causal_lm_loss,
                                    dict(pp=1, dp=2, zero_stage=1), clip=_CLIP)
CASES["gpt-pp2-dp2-zero1"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                  dict(pp=2, dp=2, schedule="1f1b", zero_stage=1))
CASES["llama-dp2-tp2-zero1"] = Case(models.llama, "tokens", models.causal_lm_loss,
                                    dict(pp=1, dp=2, tp=2, tp_objective="memory",
                                         recompute="none", zero_stage=1))
# Optimizer offload: the masters, state and step on the host tier, under pp, ZeRO-0/1/2,
# ZeRO-3 with the parameters offloaded too (FSDP2's CPU offload policy) and tp.
_HOST = dict(figures=dict(host_memory="4GiB"))
CASES["gpt-pp2-offload"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                dict(pp=2, schedule="1f1b", offload=("optimizer",)), **_HOST)
CASES["gpt-dp2-zero1-offload"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                      dict(pp=1, dp=2, zero_stage=1, offload=("optimizer",)),
                                      **_HOST)
CASES["gpt-dp2-zero3-offload-params"] = Case(
    gpt.gpt_tiny, "tokens", gpt.loss_fn,
    dict(pp=1, dp=2, zero_stage=3, offload=("optimizer", "params")), **_HOST)
CASES["gpt-dp2-offload"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                dict(pp=1, dp=2, zero_stage=0, offload=("optimizer",)), **_HOST)
CASES["gpt-dp2-zero2-offload"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                      dict(pp=1, dp=2, zero_stage=2, offload=("optimizer",)),
                                      **_HOST)
CASES["gpt-tp2-offload"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                dict(pp=1, tp=2, tp_objective="memory", recompute="none",
                                     offload=("optimizer",)), **_HOST)
# Fused attention (one scaled_dot_product_attention call per block) against the
# attention the model writes, run on one process.
CASES["llama-tp2-fused"] = Case(models.llama, "tokens", models.causal_lm_loss,
                                dict(pp=1, tp=2, tp_objective="memory", recompute="none"),
                                attention="fused")
CASES["gpt-tp2-sp-fused"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                 dict(pp=1, tp=2, sequence_parallel=True, tp_objective="memory",
                                      recompute="selective"), attention="fused")
CASES["gpt2-pp2-fused-recompute"] = Case(_gpt2, "tokens", models.causal_lm_loss,
                                         dict(pp=2, schedule="1f1b", recompute=GPT2_MODES),
                                         attention="fused")
# gpt-oss's attention sinks (a per-head logit in every softmax, dropped after it): fused
# as one more key and feature, sharded with its heads under tp; sliding-window and full
# layers alternate.
_OSS = hf_families.FAMILIES["gpt-oss"]
CASES["hf-gpt-oss-tp2-fused"] = Case(_OSS.build, "hf:tokens", hf_families.causal_lm_loss,
                                     dict(pp=1, tp=2, tp_objective="memory",
                                          recompute="selective"), attention="fused")
CASES["hf-gpt-oss-pp2-fused"] = Case(_OSS.build, "hf:tokens", hf_families.causal_lm_loss,
                                     dict(pp=2, schedule="1f1b", recompute="none"),
                                     attention="fused")
# Stages run through torch.compile (inductor's CPU kernels) against one eager process;
# recomputed layers stay eager inside the compiled stage.
_COMPILED = dict(compile=True)
CASES["gpt-pp2-compiled"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                 dict(pp=2, schedule="1f1b", recompute=ALL_MODES), **_COMPILED)
CASES["gpt-dp2-compiled"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn, dict(pp=1, dp=2),
                                 **_COMPILED)
CASES["gpt-pp2-dp2-compiled"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                     dict(pp=2, dp=2, schedule="1f1b", recompute=ALL_MODES),
                                     **_COMPILED)
CASES["gpt-tp2-sp-dropout-compiled"] = Case(
    lambda: gpt.gpt_tiny(dropout=0.1), "tokens", gpt.loss_fn,
    dict(pp=1, tp=2, sequence_parallel=True, tp_objective="memory", recompute="none"),
    reference="microbatches", **_COMPILED)
CASES["llama-pp2-compiled"] = Case(models.llama, "tokens", models.causal_lm_loss,
                                   dict(pp=2, schedule="1f1b", recompute="none"), **_COMPILED)
# Under ZeRO-2/3 each FSDP unit is compiled on its own, FSDP's hooks eager around it.
CASES["gpt-dp2-zero2-compiled"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                       dict(pp=1, dp=2, zero_stage=2), **_COMPILED)
CASES["gpt-dp2-zero3-compiled"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                       dict(pp=1, dp=2, zero_stage=3), **_COMPILED)
# FP8 linears (torchao's float8 training, emulated on CPU), every linear pinned, against
# one process running the same linears as torchao's Float8Linear modules.
_FP8 = dict(fp8=True, reference="microbatches")
CASES["gpt-pp2-fp8"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                            dict(pp=2, schedule="1f1b", fp8_linears="all"), **_FP8)
CASES["gpt-dp2-fp8"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                            dict(pp=1, dp=2, fp8_linears="all"), **_FP8)
CASES["gpt-dp2-zero3-fp8"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                  dict(pp=1, dp=2, zero_stage=3, fp8_linears="all"), **_FP8)
# ZeRO-2/3: FSDP2 shards gradients (and parameters) over dp, one unit per layer.
for _zero in (2, 3):
    CASES[f"gpt-dp2-zero{_zero}"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                         dict(pp=1, dp=2, zero_stage=_zero))
    CASES[f"gpt2-dp2-zero{_zero}-clip"] = Case(_gpt2, "tokens", models.causal_lm_loss,
                                               dict(pp=1, dp=2, zero_stage=_zero), clip=_CLIP)
    CASES[f"gpt-pp2-dp2-zero{_zero}"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                             dict(pp=2, dp=2, schedule="1f1b", zero_stage=_zero,
                                                  recompute=ALL_MODES))
    CASES[f"llama-dp2-tp2-zero{_zero}"] = Case(models.llama, "tokens", models.causal_lm_loss,
                                               dict(pp=1, dp=2, tp=2, tp_objective="memory",
                                                    recompute="none", zero_stage=_zero))
# ZeRO-2 reducing once per step: whole gradients accumulated over the microbatches,
# reduce-scattered by the last backward (4 microbatches per replica).
_STEP = dict(dp=2, zero_stage=2, zero2_grad_sync="step", num_microbatches=4)
CASES["gpt-dp2-zero2-step"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn, dict(pp=1, **_STEP))
CASES["gpt-dp2-zero2-microbatch"] = Case(
    gpt.gpt_tiny, "tokens", gpt.loss_fn, dict(pp=1, **{**_STEP, "zero2_grad_sync": "microbatch"}))
for _sync in ("step", "microbatch"):
    CASES[f"gpt2-dp2-zero2-{_sync}-clip"] = Case(
        _gpt2, "tokens", models.causal_lm_loss,
        dict(pp=1, **{**_STEP, "zero2_grad_sync": _sync}), clip=_CLIP)
CASES["gpt-pp2-dp2-zero2-step"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                       dict(pp=2, schedule="1f1b", recompute=ALL_MODES,
                                            **_STEP))
CASES["llama-pp2-dp2-zero2-step-bf16"] = Case(models.llama, "tokens", models.causal_lm_loss,
                                              dict(pp=2, tp=1, schedule="gpipe", **_STEP),
                                              dtype=torch.bfloat16)
# Mixed precision (bf16 compute, fp32 master weights and gradient reduction): autocast
# under ZeRO 0/1, FSDP's mixed precision under ZeRO-2/3; against fp32 in one process.
_BF16 = dict(dtype=torch.bfloat16)
CASES["gpt-dp2-bf16"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn, dict(pp=1, dp=2), **_BF16)
CASES["gpt2-dp2-zero1-bf16"] = Case(_gpt2, "tokens", models.causal_lm_loss,
                                    dict(pp=1, dp=2, zero_stage=1), **_BF16)
CASES["gpt-dp2-zero3-bf16"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                   dict(pp=1, dp=2, zero_stage=3), clip=_CLIP, **_BF16)
CASES["llama-pp2-bf16"] = Case(models.llama, "tokens", models.causal_lm_loss,
                               dict(pp=2, schedule="1f1b", recompute=HF_MODES), **_BF16)
CASES["llama-pp2-dp2-zero2-bf16"] = Case(models.llama, "tokens", models.causal_lm_loss,
                                         dict(pp=2, dp=2, tp=1, schedule="1f1b",
                                              zero_stage=2),
                                         **_BF16)
# dp=2 x tp=2 with sequence parallelism, ZeRO-1, the loss vocab-parallel (2048 classes).
CASES["llama-dp2-tp2-sp-zero1-vocab-bf16"] = Case(
    lambda: models.llama(vocab=_VOCAB), "tokens", models.causal_lm_loss,
    dict(pp=1, dp=2, tp=2, sequence_parallel=True, tp_objective="memory",
         recompute="none", zero_stage=1), **_BF16)
# tp=2 with sequence parallelism and the vocab-parallel loss in bf16, on 2 processes.
CASES["llama-tp2-sp-vocab-bf16"] = Case(
    lambda: models.llama(vocab=_VOCAB), "tokens", models.causal_lm_loss,
    dict(pp=1, dp=1, tp=2, sequence_parallel=True, recompute="none"), **_BF16)
CASES["bert-dp2"] = Case(lambda: models.bert(dropout=0.0), "hidden", _hidden_mse,
                        dict(pp=1, dp=2, tp=1))  # the pooler gets no gradient
CASES["gpt-tp2-sp-recompute"] = Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                     dict(pp=1, recompute=ALL_MODES, sequence_parallel=True,
                                          **_TP_RECOMPUTE))
CASES["llama-tp2-sp-recompute"] = Case(models.llama, "tokens", models.causal_lm_loss,
                                       dict(pp=1, recompute=HF_MODES, sequence_parallel=True,
                                            **_TP_RECOMPUTE))
CASES["gpt2-pp2-tp2-recompute"] = Case(_gpt2, "tokens", models.causal_lm_loss,
                                       dict(pp=2, schedule="1f1b", recompute=GPT2_MODES,
                                            **_TP_RECOMPUTE))

# Activation offload (recompute mode "offload"): what offloaded layers save goes to the
# host (a copy apart on CPU) and comes back for their backward; beside recompute, under
# pp=2, dp=2 with ZeRO-1 and ZeRO-3, tp=2.
LLAMA_OFFLOAD = {"model.layers.0": "offload", "model.layers.1": "full"}
GPT_OFFLOAD = {"blocks.0": "offload", "blocks.1": "offload"}
_ACT_HOST = dict(figures=dict(host_memory="1GiB"))   # the CPU preset knows no host memory
CASES["llama-pp2-1f1b-offload"] = Case(models.llama, "tokens", models.causal_lm_loss,
                                       dict(pp=2, schedule="1f1b", recompute=LLAMA_OFFLOAD),
                                       **_ACT_HOST)
for _zero in (1, 3):
    CASES[f"gpt-dp2-zero{_zero}-act-offload"] = Case(
        gpt.gpt_tiny, "tokens", gpt.loss_fn,
        dict(pp=1, dp=2, zero_stage=_zero, recompute=GPT_OFFLOAD), **_ACT_HOST)
CASES["gpt-tp2-act-offload"] = Case(
    gpt.gpt_tiny, "tokens", gpt.loss_fn,
    dict(pp=1, tp=2, tp_objective="memory", recompute=GPT_OFFLOAD), **_ACT_HOST)
CASES["llama-pp2-tp2-offload"] = Case(models.llama, "tokens", models.causal_lm_loss,
                                      dict(pp=2, tp=2, schedule="1f1b", tp_objective="memory",
                                           recompute=LLAMA_OFFLOAD), **_ACT_HOST)

# BatchNorm inside a tensor-parallel pair: both ranks update the same running statistics
# from the same (replicated) activations, as one device running the microbatches in order.
CASES["normed-tp2"] = Case(lambda: models.Normed(width=16, depth=2, d_out=16), "floats", _mse,
                           dict(pp=1, tp=2, tp_objective="memory", recompute="none"),
                           reference="microbatches")
# Integers, a stride-0 mask and transposed activations cross the stage boundary.
CASES["handoff-pp2"] = Case(models.Handoff, "tokens", gpt.loss_fn,
                            dict(pp=2, tp=1, schedule="1f1b", recompute="none"))
# A parameter read by several layers, tensor-parallel: one placement for every read.
CASES["shared-embedding-tp2"] = Case(models.SharedEmbedding, "tokens", gpt.loss_fn,
                                     dict(pp=1, tp=2, tp_objective="memory",
                                          recompute="none"))

# Hugging Face families from tiny configs (tests/hf_families.py), as users bring them:
# benchmarks/hf_coverage.py runs every one; the suite runs a few. ``-pp2-zbv``: the
# zero-bubble "V" schedule, whose backward is split in two (input, then weights).
for _family, _spec in hf_families.FAMILIES.items():
    _hf = (_spec.build, f"hf:{_spec.data}", hf_families.loss_for(_spec.data))
    CASES[f"hf-{_family}-pp2"] = Case(*_hf, dict(pp=2, schedule="1f1b", recompute="none"))
    CASES[f"hf-{_family}-pp2-zbv"] = Case(*_hf, dict(pp=2, schedule="zbv-zero-bubble",
                                                     recompute="none"))
    CASES[f"hf-{_family}-tp2"] = Case(*_hf, dict(pp=1, tp=2, tp_objective="memory",
                                                 recompute="none"))


# A Hugging Face model as people call it: model(**batch) with padding and labels, trained
# on its own loss (no loss_fn), the mean over the whole batch's counted labels.
for _mesh, _pins in (("pp2", dict(pp=2, schedule="1f1b")), ("tp2", dict(pp=1, tp=2)),
                     ("dp2", dict(pp=1))):
    CASES[f"hf-llama-own-loss-{_mesh}"] = Case(hf_families.FAMILIES["llama"].build,
                                                "hf:padded", None,
                                                dict(_pins, recompute="none"))


# Context parallelism (each sequence split over 2 ranks, the ring or the all-to-all):
# the four families issue 46 names, alone (2 processes) and beside pp, tp and dp with
# ZeRO-3 (4 processes). SEQ (16) is longer than Mistral's window (8) and a shard (8)
# is not: only the whole sequence's mask shows the window.
_CP_KINDS = {"ring": "ring", "a2a": "all-to-all"}
for _family in ("llama", "qwen2", "mistral", "gpt2"):
    _spec = hf_families.FAMILIES[_family]
    _hf = (_spec.build, f"hf:{_spec.data}", hf_families.loss_for(_spec.data))
    for _short, _kind in _CP_KINDS.items():
        _cp = dict(cp=2, cp_kind=_kind, recompute="none")
        CASES[f"hf-{_family}-cp2-{_short}"] = Case(*_hf, dict(_cp, pp=1))
        CASES[f"hf-{_family}-cp2-{_short}-pp2"] = Case(*_hf, dict(_cp, pp=2, schedule="1f1b"))
        CASES[f"hf-{_family}-cp2-{_short}-tp2"] = Case(*_hf, dict(_cp, pp=1, tp=2,
                                                                   tp_objective="memory"))
        CASES[f"hf-{_family}-cp2-{_short}-dp2-zero3"] = Case(*_hf, dict(_cp, pp=1, dp=2,
                                                                         zero_stage=3))

# Llama called as people call it, on its own loss, with each sequence split over 2 ranks:
# partc gives the loss its labels already shifted (made from the batch's labels), and
# weighs each rank's mean by the labels its tokens count (prompts count none).
for _short, _kind in _CP_KINDS.items():
    CASES[f"hf-llama-own-loss-cp2-{_short}"] = Case(
        hf_families.FAMILIES["llama"].build, "hf:prompts", None,
        dict(cp=2, cp_kind=_kind, pp=1, recompute="none"))
# The same with the tokenizer's attention_mask, all ones (unpadded rows): read as ones,
# each attention's mask follows from the shapes and splits with the sequence.
CASES["hf-llama-own-loss-unpadded-cp2-ring"] = Case(
    hf_families.FAMILIES["llama"].build, "hf:prompts-unpadded", None,
    dict(cp=2, cp_kind="ring", pp=1, recompute="none"))
# Rows padded at their end, labels -100 under the pads, position ids 0..S-1: the model,
# causal throughout, is traced without the mask and the positions too, and each rank's
# tokens count what they count (some ranks' tokens are mostly pads).
CASES["hf-llama-own-loss-padded-cp2-ring"] = Case(
    hf_families.FAMILIES["llama"].build, "hf:padded", None,
    dict(cp=2, cp_kind="ring", pp=1, recompute="none"))
# A loss_fn averaging its counted targets (cross-entropy, -100 over each row's prompt),
# asked what it averages over and weighed by its counts: each microbatch's, each cp
# rank's tokens'.
for _name, _pins in (("cp2-ring", dict(cp=2, cp_kind="ring", pp=1)), ("dp2", dict(pp=1)),
                     ("pp2", dict(pp=2, schedule="1f1b")), ("tp2", dict(pp=1, tp=2))):
    CASES[f"hf-llama-masked-{_name}"] = Case(
        hf_families.FAMILIES["llama"].build, "hf:tokens-masked",
        hf_families.loss_for("tokens-masked"), dict(_pins, recompute="none"))
# Beside pp=2 (the shifted labels carried to the loss's stage) and dp=2 with ZeRO-3 (the
# batch's count of labels over both replicas).
CASES["hf-llama-own-loss-cp2-ring-pp2"] = Case(
    hf_families.FAMILIES["llama"].build, "hf:prompts", None,
    dict(cp=2, cp_kind="ring", pp=2, schedule="1f1b", recompute="none"))
CASES["hf-llama-own-loss-cp2-ring-dp2-zero3"] = Case(
    hf_families.FAMILIES["llama"].build, "hf:prompts", None,
    dict(cp=2, cp_kind="ring", pp=1, dp=2, zero_stage=3, recompute="none"))

# ZeRO-3 with one dp replica: the state sharded over the cp pair, which holds the same
# parameters.
CASES["hf-llama-cp2-ring-zero3"] = Case(
    hf_families.FAMILIES["llama"].build, "hf:tokens", hf_families.loss_for("tokens"),
    dict(cp=2, cp_kind="ring", pp=1, dp=1, zero_stage=3, recompute="none"))

# Recompute of a layer whose attention is the ring: full (the whole layer again, the ring
# with it) and selective (the ring alone).
CASES["hf-llama-cp2-ring-recompute"] = Case(
    hf_families.FAMILIES["llama"].build, "hf:tokens", hf_families.loss_for("tokens"),
    dict(cp=2, cp_kind="ring", pp=1, recompute=HF_MODES))


def batch(case: Case, model: torch.nn.Module, step: int,
          seq: int = SEQ) -> tuple[Any, Any]:
    """Step ``step``'s batch: (the model's inputs, the loss's target); for the model's
    own loss, (its keyword inputs, None)."""
    g = torch.Generator().manual_seed(1000 + step)
    if case.data == "hf:padded":
        return hf_families.padded_batch(model, BATCH, seq, g), None
    if case.data == "hf:prompts":
        return hf_families.prompt_batch(model, BATCH, seq, g), None
    if case.data == "hf:prompts-unpadded":   # a tokenizer's batch of unpadded rows
        prompts = hf_families.prompt_batch(model, BATCH, seq, g)
        return {**prompts, "attention_mask": torch.ones_like(prompts["input_ids"])}, None
    if case.data.startswith("hf:"):
        return hf_families.batch(case.data[3:], model, BATCH, seq, g)
    x, y = _one_input_batch(case, model, g, seq)
    return (x,), y


def _one_input_batch(case: Case, model: torch.nn.Module, g: torch.Generator,
                     seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    if case.data in ("tokens", "hidden"):
        vocab = _tokens(model)
        tokens = torch.randint(0, vocab, (BATCH, seq + 1), generator=g)
        if case.data == "hidden":
            width = model.config.hidden_size
            return tokens[:, :-1].contiguous(), torch.randn(BATCH, seq, width, generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 16, generator=g)


# SGD with momentum: Adam divides each gradient by its own size, which turns the
# rounding noise of gradients that are mathematically zero (a key projection's bias
# under softmax) into full-size steps, in one process as in many.
OPTIMIZER = dict(lr=0.1, momentum=0.9)


def optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, **OPTIMIZER)


def compile_case(case: Case, model: torch.nn.Module, world: int) -> partc.Program:
    x, y = batch(case, model, 0)
    constraints = dict(case.constraints)
    constraints.setdefault("dp", world // (constraints["pp"] * constraints.get("tp", 1)
                                        * constraints.get("cp", 1)))
    constraints.setdefault("num_microbatches", 4 // constraints["dp"])
    return partc.compile(model, x, loss_fn=case.loss_fn, example_target=y,
                         budget=partc.DeviceBudget(num_devices=world, device="CPU",
                                                   **case.figures),
                         train=partc.TrainSpec(global_batch_size=BATCH, optimizer="sgd",
                                               max_grad_norm=case.clip, dtype=case.dtype,
                                               attention=case.attention,
                                               compile=case.compile, fp8=case.fp8,
                                               tp_overlap=case.tp_overlap),
                         constraints=partc.Constraints(**constraints))


@dataclass
class Built:
    """A case compiled and built, ready to train: its program, this rank's module, the
    model it was compiled from and an untouched copy for the one-process reference."""
    case: Case
    model: torch.nn.Module
    reference: torch.nn.Module
    program: partc.Program
    module: Any


def build_case(name: str) -> Built:
    case = CASES[name]
    torch.manual_seed(0)
    model = case.build()
    reference = copy.deepcopy(model)
    program = compile_case(case, model, dist.get_world_size())
    if case.fp8:
        reference = float8_reference(reference, program.plan)
    if name.endswith("-loaded"):
        # Rank 0 saves the program; every rank loads plan.json and builds from it.
        directory = Path(os.environ["PARTC_WORKER_OUT"]) / name
        if dist.get_rank() == 0:
            program.save(directory)
        dist.barrier()
        program = partc.load(directory, model, loss_fn=case.loss_fn)
    return Built(case, model, reference, program, program.build())


def float8_reference(model: torch.nn.Module, plan: partc.Plan) -> torch.nn.Module:
    """``model`` with the plan's FP8 linears as torchao's Float8Linear modules (emulated):
    each ``nn.Linear`` whose weight is named, under any of its FQNs, in ``plan.fp8``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    aliases: dict[int, set[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), set()).add(fqn)
    wanted = set(plan.fp8.linears)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(plan.fp8.recipe),
                                 emulate=True)
    return convert_to_float8_training(
        model, config=config,
        module_filter_fn=lambda module, fqn: bool(aliases[id(module.weight)] & wanted))


def run_case(name: str) -> dict[str, Any]:
    return train_case(build_case(name))


def run_together(names: list[str]) -> dict[str, Any]:
    """Several programs in one process: every one compiled and built first, then each
    trained in turn. Each must train as it does alone (nothing one program sets up may
    change another's run)."""
    built = [build_case(name) for name in names]
    return {name: train_case(one) for name, one in zip(names, built)}


def train_case(built: Built) -> dict[str, Any]:
    case, model, reference = built.case, built.model, built.reference
    program, module = built.program, built.module
    graphs_before = _compiled_graphs()  # stages compile at their first step
    module.tp.counts.clear()
    module.tp.ring_steps = 0
    opt = module.optimizer(torch.optim.SGD, **OPTIMIZER)  # ZeRO-1 where the plan says
    ref_opt = optimizer(reference.parameters())
    losses, ref_losses, messages, norms, ref_norms = [], [], [], [], []
    reduces, offloaded = [], []
    ledgers = activation_offload.ledgers(module.module)
    for step in range(STEPS):
        for ledger in ledgers:
            ledger.counters.reset()
        x, y = batch(case, model, step)
        if step == 1:
            module.tp.counts.clear()  # the first step also runs the schedule's shape inference
            module.tp.ring_steps = 0
        state = torch.get_rng_state()
        before = FSDP_REDUCES[0]
        if isinstance(x, dict):  # by keyword, then as one mapping
            loss = module.forward_backward(**x) if step % 2 else module.forward_backward(x)
        else:
            loss = module.forward_backward(*x, target=y)
        losses.append(loss.item())
        reduces.append(FSDP_REDUCES[0] - before)
        messages.append(dict(module.last_messages))
        offloaded.append([sum(getattr(ledger.counters, kind) for ledger in ledgers)
                          for kind in ("to_host", "to_device", "resident", "peak_resident")])
        opt.step()
        opt.zero_grad()
        if case.reference == "microbatches":
            torch.set_rng_state(state)
            # Every replica's microbatches, in the batch's order.
            m = program.plan.num_microbatches * program.plan.dp
            pieces = zip(*(t.chunk(m) for t in x), y.chunk(m))
            ref_loss = sum(_backward(case.loss_fn(reference(*p[:-1]), p[-1]) / m)
                           for p in pieces)
        elif isinstance(x, dict):
            ref_loss = _backward(reference(**x).loss)
        else:
            ref_loss = _backward(case.loss_fn(reference(*x), y))
        if case.clip is not None:
            ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(),
                                                            case.clip).item())
            norms.append(module.last_grad_norm.item())
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    plan = program.plan
    topo = module.topology

    def reference_shard(fqn: str) -> torch.Tensor:
        # A sharded parameter is compared with the same shard of the reference.
        tensor = ref_params[fqn].detach()
        aliases = [a for a, t in ref_params.items() if t is ref_params[fqn]]
        placement = plan.placement(aliases)
        if placement.kind == "S":
            tensor = tp_ops.shard_of(tensor, placement.dim, placement.chunks, topo.tp_rank,
                                     topo.tp)
        return tensor

    # Relative error; against 1e-3 where the reference is ~0 (a key projection's bias never
    # moves: its gradient is mathematically zero, so only rounding noise is compared).
    errors = {fqn: ((_master_or_whole(module, p) - reference_shard(fqn)).norm()
                    / max(reference_shard(fqn).norm().item(), 1e-3)).item()
              for fqn, p in module.named_parameters()}
    own_params = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
    # The whole model back from every stage and shard, as one process holds it; loading
    # it again slices each rank's shards out unchanged.
    full, ref_state = module.full_state_dict(), reference.state_dict()
    before = {name: _here(t).clone() for name, t in module.state_dict().items()}
    module.load_state_dict(full)
    changed = [name for name, t in module.state_dict().items()
               if not torch.equal(before[name], _here(t))]
    reloaded = not changed
    full_error = max(((full[k] - v).double().norm() / max(v.double().norm().item(), 1e-3))
                     .item() for k, v in ref_state.items() if k in full)  # buffers too
    p2p = plan.stages[module.stage_index].p2p
    return {"losses": losses, "ref_losses": ref_losses, "param_errors": errors,
            "messages": messages, "predicted": asdict(p2p) if p2p else {},
            "stage": module.stage_index, "mesh": to_data(plan.mesh), "schedule": plan.schedule,
            "recompute": plan.stages[module.stage_index].recompute,
            # Activation offload per step: bytes to the host, back, left there, and the
            # most held; beside the plan's traffic and host bytes for the stage.
            "offloaded": offloaded,
            "planned_offload": [plan.stages[module.stage_index].host_traffic_bytes,
                                plan.stages[module.stage_index].memory_bytes.host],
            "num_params": len(errors), "own_params": own_params,
            "full_state_keys": sorted(set(full) ^ set(ref_state)),
            "full_state_error": full_error, "reloaded_unchanged": reloaded,
            "changed_by_reload": changed,
            "grad_norms": norms, "ref_grad_norms": ref_norms,
            "zero_stage": plan.zero_stage, "dp_rank": topo.dp_rank,
            "zero2_grad_sync": plan.zero2_grad_sync, "reduces_once": plan.reduces_once,
            "num_microbatches": plan.num_microbatches, "fsdp_reduces": reduces,
            # Units, not modules: modules sharded together (fully_shard of a list, a
            # small layer with the next) share one parameter group and one reduction.
            "fsdp_units": len({id(m._get_fsdp_state()._fsdp_param_group)
                               for m in module.module.modules() if isinstance(m, FSDPModule)
                               and m._get_fsdp_state()._fsdp_param_group is not None}),
            "compiled_graphs": _compiled_graphs() - graphs_before,
            "fused_attention": sum(count_fused(m) for m in module.module.modules()
                                   if isinstance(m, torch.fx.GraphModule)),
            "optimizer_state_numel": sum(_numel_here(t) for state in getattr(opt, "optim", opt)
                                         .state.values() for t in state.values()
                                         if isinstance(t, torch.Tensor) and t.dim() > 0),
            "param_numel_here": sum(_numel_here(p) for p in module.parameters()),
            # The fp32 truth (ZeRO-1's masters in mixed precision), and what computes.
            "param_dtypes": sorted({str((module.master_of(p) if module.master_of(p)
                                         is not None else p).dtype)
                                    for p in module.parameters()}),
            "compute_param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
            "planned_params": plan.stages[module.stage_index].param_count,
            "collectives": dict(module.tp.counts),
            "ring_steps": module.tp.ring_steps,
            # Offload: what the host tier holds and moved (None without), beside the plan.
            "host": (asdict(module.parts.host.counters) if module.parts.host is not None
                     else None),
            "offload": [str(kind) for kind in plan.offload],
            "planned_host_bytes_per_node": plan.host_bytes_per_node,
            "planned_collectives": _planned_collectives(plan, module.stage_index),
            "layer_collectives": {layer: [(move.kind, move.phase) for move in moves]
                                  for layer, moves in _tp_collectives(plan).items()}}


def _compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (cases share a process)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _tp_collectives(plan: partc.Plan) -> dict:
    return plan.tensor_parallel.collectives if plan.tensor_parallel is not None else {}


def _whole_over_dp(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter as its tp rank holds it: gathered over dp where ZeRO-2/3 shards it."""
    tensor = tensor.detach()
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _master_or_whole(module: Any, param: torch.Tensor) -> torch.Tensor:
    """A parameter as its tp rank holds it, in fp32: from the dp ranks' masters under
    ZeRO-1 in mixed precision (collective), else :func:`_whole_over_dp`."""
    if module.master_of(param) is not None:
        return module.parts.buckets.full_master(param)
    return _whole_over_dp(param)


def _here(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank stores of a tensor (its dp shard, under ZeRO-2/3)."""
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()


def _numel_here(tensor: torch.Tensor) -> int:
    return _here(tensor).numel()


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss.detach()


def _planned_collectives(plan: partc.Plan, stage: int) -> dict[str, int]:
    """Per step: the plan's per-microbatch collectives of this stage's layers (forward
    ones twice in a fully recomputed layer: selective recompute reruns attention cores,
    which hold none), times the microbatches, plus one all-reduce of partial gradients
    when the stage has any."""
    counts: dict[str, int] = {}
    steps = STEPS - 1
    recomputed = plan.stages[stage].recompute
    for layer in plan.stages[stage].layers:
        for move in _tp_collectives(plan).get(layer, ()):
            # A fully recomputed layer replays its forward (collectives too) in backward.
            replayed = move.phase == "forward" and recomputed.get(layer, "none") == "full"
            runs = 2 if replayed else 1
            counts[move.kind] = counts.get(move.kind, 0) + runs * plan.num_microbatches * steps
    layers = set(plan.stages[stage].layers)
    partial = plan.tensor_parallel.partial_grad_params if plan.tensor_parallel else ()
    if any(_layer_of(plan, fqn) in layers for fqn in partial):
        counts["all_reduce"] = counts.get("all_reduce", 0) + steps
    return counts


def _layer_of(plan: partc.Plan, fqn: str) -> str:
    """The layer a parameter belongs to, by the longest layer name that prefixes it."""
    names = [n for n in plan.layer_names if fqn.startswith(n + ".")]
    return max(names, key=len) if names else ""


def run_mismatch_cases() -> dict[str, Any]:
    """Ranks with different plans, and a batch of the wrong shape: errors, not hangs."""
    case = CASES["gpt-pp2-1f1b"]
    results: dict[str, Any] = {}
    torch.manual_seed(0)
    model = case.build()
    world = dist.get_world_size()
    pinned = dict(case.constraints, recompute="full" if dist.get_rank() == 1 else "none")
    program = compile_case(Case(case.build, case.data, case.loss_fn, pinned), model, world)
    try:
        program.build()
        results["different-plans"] = "no error"
    except partc.PlanMismatchError as error:
        results["different-plans"] = str(error)
    module = compile_case(case, model, world).build()
    for label, seq in (("shorter-sequence", SEQ // 2),):
        x, y = batch(case, model, 0, seq=seq)
        try:
            module.forward_backward(*x, target=y)
            results[label] = "no error"
        except partc.PlanMismatchError as error:
            results[label] = str(error)
    x, y = batch(case, model, 0)
    try:
        module.forward_backward(x[0][:4], target=y[:4])
        results["smaller-batch"] = "no error"
    except partc.PlanMismatchError as error:
        results["smaller-batch"] = str(error)
    # After the refused batches the program still trains on the planned shapes.
    results["loss-after"] = module.forward_backward(*x, target=y).item()
    return results


def run_cp_attention() -> dict[str, float]:
    """Context-parallel attention over every rank against plain attention on the whole
    sequence (float64): for each kind and mask, the largest difference in this rank's
    output and in its gradients of q, k and v (grouped-query: 4 heads, 2 key/value)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    seq = 8 * world
    q, dout = (torch.randn(2, 4, seq, 8, generator=g, dtype=torch.float64) for _ in "qo")
    k, v = (torch.randn(2, 2, seq, 8, generator=g, dtype=torch.float64) for _ in "kv")
    errors = {}
    for kind in ("ring", "all-to-all"):
        for mask in (AttentionMask("causal"), AttentionMask("none"),
                     AttentionMask("sliding", 3), AttentionMask("sliding", seq // 2 + 1)):
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            every = torch.arange(seq)
            expected = F.scaled_dot_product_attention(
                whole[0], *(t.repeat_interleave(2, 1) for t in whole[1:]),
                attn_mask=mask.keeps(every, every), scale=0.3)
            expected.backward(dout)
            mine = [cp_layout.shard(t, 2, world, rank).detach().requires_grad_()
                    for t in (q, k, v)]
            group = ContextParallelGroup(world, kind, dist.group.WORLD)
            out = attention(group, *mine, scale=0.3, mask=mask.kind, window=mask.window)
            out.backward(cp_layout.shard(dout, 2, world, rank))
            pairs = [(out, expected)] + [(m.grad, w.grad) for m, w in zip(mine, whole)]
            errors[f"{kind} {mask.kind} {mask.window}"] = max(
                (ours - cp_layout.shard(theirs, 2, world, rank)).abs().max().item()
                for ours, theirs in pairs)
    return errors


def run_elsewhere(worker: str, name: str) -> dict[str, Any]:
    """Case ``name`` of the worker module ``worker`` (``tests/runtime/<worker>.py``), run
    by its ``run_named`` (or ``run_case``) in this process: launches of several workers
    share one torchrun."""
    module = importlib.import_module(f"tests.runtime.{worker}")
    return getattr(module, "run_named", module.run_case)(name)


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    os.environ["PARTC_WORKER_OUT"] = str(out)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for name in names:
        try:
            if name == "mismatch":
                results[name] = run_mismatch_cases()
            elif name == "cp-attention":
                results[name] = run_cp_attention()
            elif "::" in name:  # another worker's case (test_parity.launched)
                results[name] = run_elsewhere(*name.split("::", 1))
            elif "+" in name:
                results[name] = run_together(name.split("+"))
            else:
                results[name] = run_case(name)
        except Exception as error:  # recorded: the test reports it per case
            results[name] = {"error": f"{type(error).__name__}: {error}",
                             "traceback": traceback.format_exc()}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    topology.leave()   # no gloo thread left running into shutdown


if __name__ == "__main__":
    # The other workers import this module by name (run_elsewhere): one copy, one patch.
    sys.modules.setdefault("tests.runtime.worker", sys.modules[__name__])
    os.environ.setdefault("PARTC_TIMEOUT_S", "120")
    main()
