"""Korthikanti et al.'s activation equations as partc problems, and partc's estimates of them.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(MLSys'23), sections 4-5: the bytes one GPT transformer layer keeps for backward, with
16-bit activations and 1-byte dropout masks, under tensor parallelism of degree t,
with and without sequence parallelism, and with selective or full recompute
(``/work/shared/validation/korthikanti_activations.json``, copied into :data:`EQUATIONS`).

The layer partc measures is built as the paper's: Hugging Face's GPT-2 block (LayerNorm,
attention written out, 4h MLP with exact GeLU, dropout 0.1 on the attention
probabilities and after each residual branch) at the evaluated configurations' widths,
planned in bf16 for H100s (CUDA's autocast policy and its fused dropout kernel), on the
meta device (a 530B layer's activations are ~4 GiB: only fake tensors are made). partc's
figure is ``LayerCost.saved_bytes[mode]`` of the first block, as one rank of the
tensor-parallel group keeps it (the variant the planner prices), times the micro-batch.

What differs from the paper is what partc's runtime keeps, not a rounding: see
:func:`breakdown` and the notes in ``benchmarks/validation.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

import partc
from partc.compiler import build_problem, plan_problem
from partc.problem import LayerCost

GIB = 2**30
BLOCK = "transformer.h.0"
DROPOUT = 0.1
# HBM of the devices the paper trained on (A100-80GB), and what the paper adds for the
# model's state per parameter: "16-18 bytes per parameter" (mixed-precision Adam).
DEVICE_BYTES = 80 * 10**9
STATE_BYTES_PER_PARAM = 16


@dataclass(frozen=True, kw_only=True)
class Config:
    """One evaluated configuration of the paper (Table 3)."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    micro_batch: int
    seq_len: int = 2048
    vocab: int = 51200
    interleave: int = 1

    @property
    def params(self) -> float:
        """12 l h^2 + V h (+ positions): the paper's count, near enough for the verdicts."""
        h = self.hidden
        return 12 * self.layers * h * h + (self.vocab + self.seq_len) * h


CONFIGS = (
    Config(name="22B", heads=64, hidden=6144, layers=48, tp=8, pp=1, micro_batch=4),
    Config(name="175B", heads=96, hidden=12288, layers=96, tp=8, pp=8, micro_batch=1,
           interleave=3),
    Config(name="530B", heads=128, hidden=20480, layers=105, tp=8, pp=35, micro_batch=1,
           interleave=3),
)
MODES = ("none", "selective", "full")


def config_named(name: str) -> Config:
    return next(c for c in CONFIGS if c.name == name)


def load_configs(path: str | Path) -> tuple[Config, ...]:
    """The ``configurations`` of a table in the schema of ``korthikanti_activations.json``
    (each: params_b, which names it, heads, hidden, layers, tp, pp, micro_batch, and
    optionally seq_len, vocab and interleave), to estimate as :data:`CONFIGS` are
    (``benchmarks/validation.py --korthikanti-table``)."""
    fields = {f.name for f in dataclasses.fields(Config)}
    needed = {f.name for f in dataclasses.fields(Config)
              if f.default is dataclasses.MISSING} - {"name"} | {"params_b"}
    configs = []
    for row in json.loads(Path(path).read_text())["configurations"]:
        if needed - set(row):
            raise ValueError(f"{path}: configuration {row} lacks {sorted(needed - set(row))}")
        given = {key: value for key, value in row.items() if key in fields}
        configs.append(Config(name=f"{row['params_b']:g}B", **given))
    return tuple(configs)


def _config(config: Config | str) -> Config:
    return config if isinstance(config, Config) else config_named(config)


def equation_bytes(config: Config, tp: int, sequence_parallel: bool, mode: str) -> float:
    """The paper's bytes per layer (section 4, Table 2) for one rank of ``tp``."""
    s, b, h, a, t = config.seq_len, config.micro_batch, config.hidden, config.heads, tp
    if mode == "full":
        # The layer's input only: the shard of it under sequence parallelism.
        return 2 * s * b * h / (t if sequence_parallel else 1)
    attention = 5 * a * s / (h * t) if mode == "none" else 0.0
    if sequence_parallel or t == 1:
        return s * b * h * (34 / t + attention)
    return s * b * h * (10 + 24 / t + attention)


def gpt2_layer(config: Config, device: str = "meta"
               ) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A two-block GPT-2 of the configuration's width (on the meta device), as the paper
    builds its layers, with (1, seq) token ids and targets. Two blocks: a value every
    block reads (the causal mask) is charged to the layer that makes it, as in a deep
    model, not to the one block."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2Config(n_layer=2, n_embd=config.hidden, n_head=config.heads,
                    vocab_size=config.vocab, n_positions=config.seq_len,
                    activation_function="gelu", resid_pdrop=DROPOUT, embd_pdrop=DROPOUT,
                    attn_pdrop=DROPOUT, use_cache=False, attn_implementation="eager",
                    bos_token_id=0, eos_token_id=0)
    with torch.device(device):
        model = GPT2LMHeadModel(hf)
        ids = torch.zeros(1, config.seq_len, dtype=torch.long)
    return model, ids, ids.clone()


def loss(output, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def budget(config: Config) -> partc.DeviceBudget:
    return partc.DeviceBudget(num_devices=8, device="H100-80GB")


def train_spec(config: Config) -> partc.TrainSpec:
    return partc.TrainSpec(global_batch_size=config.micro_batch, dtype=torch.bfloat16)


@functools.lru_cache(maxsize=None)
def analysed(config: Config | str):
    from partc.passes.pipeline import analyze

    config = _config(config)
    model, ids, target = gpt2_layer(config)
    return analyze(model, (ids,), loss_fn=loss, example_target=target,
                   name=f"gpt2-layer-{config.name}", autocast=torch.bfloat16,
                   autocast_device="cuda")


@functools.lru_cache(maxsize=None)
def block(config: Config | str, tp: int, sequence_parallel: bool,
          objective: str | None = None) -> LayerCost:
    """The first block's costs as one rank of a tensor-parallel group of ``tp`` keeps
    them, sharded as the planner shards it (:func:`planned_objective`) or as
    ``objective`` asks (``tp_objective``)."""
    config = _config(config)
    graph, analysis = analysed(config)
    if tp > 1:
        objective = objective or planned_objective(config, tp, sequence_parallel)
    problem = build_problem(analysis, budget(config), train_spec(config), partc.Constraints(
        tp=tp, sequence_parallel=sequence_parallel if tp > 1 else None,
        tp_objective=objective if tp > 1 else None), graph)
    local = problem.variant(tp, sequence_parallel, objective) if tp > 1 else problem
    return next(layer for layer in local.layers if layer.name == BLOCK)


@functools.lru_cache(maxsize=None)
def planned_objective(config: Config | str, tp: int, sequence_parallel: bool) -> str:
    """The sharding partc's planner runs the layers with on one group of ``tp`` H100s
    (memory unbounded, so its fastest by the stage cost model) of those its chooser
    offers: the fastest by the chooser's own estimate of each layer (``"time"``), and
    the one that holds the fewest bytes (``"memory"``; equal for most widths)."""
    config = _config(config)
    graph, analysis = analysed(config)
    devices = partc.DeviceBudget(num_devices=tp, device="H100-80GB", memory=2**50)
    problem = build_problem(analysis, devices, train_spec(config), partc.Constraints(
        tp=tp, sequence_parallel=sequence_parallel, pp=1, recompute="none"), graph)
    return plan_problem(problem).tp_objective


def estimate_bytes(config: Config, tp: int, sequence_parallel: bool, mode: str) -> float:
    """partc's bytes per layer for one rank: the block's saved bytes in ``mode`` (a
    block without a selective mode keeps what "none" keeps) times the micro-batch."""
    layer = block(config, tp, sequence_parallel)
    saved = layer.saved_bytes.get(mode, layer.saved_bytes["none"])
    return saved * config.micro_batch


@dataclass(frozen=True, kw_only=True)
class Row:
    config: str
    tp: int
    sequence_parallel: bool
    mode: str
    estimate: float
    equation: float

    @property
    def ratio(self) -> float:
        return self.estimate / self.equation


def rows(config: Config | str, degrees: tuple[int, ...] = (1, 2, 8)) -> list[Row]:
    config = _config(config)
    result = []
    for tp in degrees:
        for sp in ((False,) if tp == 1 else (False, True)):
            for mode in MODES:
                result.append(Row(config=config.name, tp=tp, sequence_parallel=sp, mode=mode,
                                  estimate=estimate_bytes(config, tp, sp, mode),
                                  equation=equation_bytes(config, tp, sp, mode)))
    return result


def peak_bytes(config: Config, per_layer: float) -> float:
    """The paper's memory verdict for the first pipeline stage: model state of its
    layers at 16 bytes per parameter over tp, plus activations of L layers' worth
    (1F1B stage 0 holds p microbatches of L/p layers), times (1 + (p-1)/(p v)) when
    interleaved."""
    p, v = config.pp, config.interleave
    state = STATE_BYTES_PER_PARAM * config.params / (config.tp * p)
    interleaving = 1 + (p - 1) / (p * v) if v > 1 else 1.0
    return state + per_layer * config.layers * interleaving


def fits(config: Config, sequence_parallel: bool, mode: str, *, estimate: bool) -> bool:
    """Does the first stage fit in 80 GB with partc's per-layer figure (``estimate``) or
    the paper's?"""
    per_layer = (estimate_bytes if estimate else equation_bytes)(
        config, config.tp, sequence_parallel, mode)
    return peak_bytes(config, per_layer) <= DEVICE_BYTES
