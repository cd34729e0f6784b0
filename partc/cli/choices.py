"""The names a user picks among, in one torch-free module.

``partc --help`` lists them and the command line checks them before it imports torch;
:mod:`partc.spec` validates TrainSpec and Constraints against the same tuples. Device
presets are in :mod:`partc.device.presets`; recompute modes and ZeRO stages in
:mod:`partc.problem` (both torch-free too).
"""

from __future__ import annotations

from partc.names import CpKind, Schedule

# How attention runs: as the model writes it, or as one fused kernel call
# (``scaled_dot_product_attention``) wherever partc proves it computes the same; "auto":
# fused on a GPU, as written on a CPU (TrainSpec.for_device).
ATTENTION: tuple[str, ...] = ("auto", "as_written", "fused")

# The pipeline schedules' names (:class:`partc.names.Schedule`; partc.cost.schedules holds
# what each needs of a plan, and a test holds the two together).
SCHEDULES: tuple[str, ...] = tuple(name.value for name in Schedule)

# The kinds of context-parallel attention (:class:`partc.names.CpKind`).
CP_KINDS: tuple[str, ...] = tuple(kind.value for kind in CpKind)

# How FP8 linears scale their operands (TrainSpec.fp8_recipe; torchao.float8's recipes):
# one scale per tensor, or one per row (more accurate, slower casts).
FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")

# What a tensor-parallel sharding is chosen for: the fastest, or the fewest parameter
# bytes (then, with sequence parallelism, activation bytes; then the fastest).
TP_OBJECTIVES: tuple[str, ...] = ("time", "memory")

# What a training step with an inf or NaN loss or gradient norm does: raise a
# partc.NonFiniteError before the optimizer steps, skip the step (gradients dropped, the
# optimizer not stepped, counted in telemetry), or go on as if nothing happened.
ON_NONFINITE: tuple[str, ...] = ("raise", "skip", "ignore")

# Bytes of optimizer state per parameter, kept in fp32 whatever the compute dtype.
OPTIMIZER_STATE_BYTES: dict[str, float] = {
    "sgd": 0.0,
    "sgd-momentum": 4.0,
    "adam": 8.0,
    "adamw": 8.0,
}

# The training dtypes by the names the command line takes, each to torch's name for it.
DTYPE_NAMES: dict[str, str] = {
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16",
}

# The formats of the report (what partc.report.text.render writes; a test holds the two
# together).
REPORT_FORMATS: tuple[str, ...] = ("text", "markdown", "json", "html")

# The dtypes of a token file (``partc train --data train.bin --data-dtype ...``): its ids
# as a flat array of unsigned ints, nanoGPT's uint16 or, for vocabularies above 65,536
# ids, uint32.
TOKEN_DTYPES: tuple[str, ...] = ("uint16", "uint32")
