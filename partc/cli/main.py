"""Command line: ``partc plan path/to/file.py:factory --devices N --device H100-80GB``.

- ``partc plan``: trace, measure and plan a model; print the report, write the plan.
- ``partc report plan.json --format html``: render a saved plan again.
- ``partc train file.py:factory ...``: train under torchrun (:mod:`partc.cli.launcher`).
- A model may be named by its Hugging Face config instead of a factory: a directory
  with ``config.json`` or a model type transformers ships (``partc plan llama
  --hf-config num_hidden_layers=2``; :mod:`partc.cli.hf_config`).
- ``partc calibrate --out profile.json``: measure this machine's devices and write a
  profile; ``partc plan ... --profile profile.json`` plans with its numbers.
- ``partc checkpoint verify DIR``: check a checkpoint's files against its manifest's
  sizes and digests and its ``.metadata`` as data (every step of a root, or one step
  directory); one line per bad file, exit status 1 when there is one.

The factory is a function of no arguments in that file. It returns either a dict with
keys ``model`` and ``example_inputs`` (optional: ``loss_fn``, ``example_target``,
``train`` — a TrainSpec — and ``name``), or a tuple ``(model, example_inputs[, loss_fn])``.
Command-line flags override the factory's TrainSpec field by field.

Everything the command line can check without the model is checked before the model is
built, each error one line and exit status 2: device names (with the closest presets),
sizes and rates (:mod:`partc.units`), the factory's file and function, pins that
contradict each other. This module imports no torch: ``--help`` and ``--version`` answer
at once, and each command imports what it needs.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import importlib.util
import logging
import math
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from partc.cli import hf_config
from partc.cli.choices import (ATTENTION, CP_KINDS, DTYPE_NAMES, FP8_RECIPES, ON_NONFINITE,
                               OPTIMIZER_STATE_BYTES, REPORT_FORMATS, SCHEDULES,
                               TP_OBJECTIVES)
from partc.cost.collectives import KINDS as COLLECTIVE_KINDS
from partc.device.figures import FIGURES
from partc.device.presets import DEFAULT_DEVICE, PRESETS, preset
from partc.errors import PartcError
from partc.names import Offload
from partc.options import PlannerOptions
from partc.problem import RECOMPUTE_MODES, ZERO2_GRAD_SYNCS, ZERO_STAGES
from partc.units import format_seconds, parse_bytes, parse_rate

# The flag for each field of Constraints, TrainSpec and DeviceBudget: a test fails when one
# of those classes gains a field that has no flag here.
PIN_FLAGS = {
    "pp": "--pp", "dp": "--dp", "tp": "--tp", "sequence_parallel": "--sequence-parallel",
    "tp_objective": "--tp-objective", "stages": "--stage", "recompute": "--recompute",
    "num_microbatches": "--microbatches", "micro_batch_size": "--micro-batch",
    "schedule": "--schedule", "zero_stage": "--zero", "ep": "--ep",
    "virtual_stages": "--virtual-stages", "zero2_grad_sync": "--zero2-grad-sync",
    "cp": "--cp", "cp_kind": "--cp-kind",
    "offload": "--offload",
    "fp8_linears": "--fp8-linears",
}
TRAIN_FLAGS = {
    "global_batch_size": "--global-batch", "micro_batch_size": "--micro-batch",
    "dtype": "--dtype", "optimizer": "--optimizer", "schedule": "--schedule",
    "max_grad_norm": "--max-grad-norm", "attention": "--attention",
    "moe_imbalance": "--moe-imbalance", "moe_capacity_factor": "--moe-capacity-factor",
    "compile": "--compile", "fused_optimizer": "--fused-optimizer",
    "loss_per_microbatch": "--loss-per-microbatch",
    "tp_overlap": "--no-tp-overlap", "overlap_param_gather": "--no-param-gather-overlap",
    "bucket_elements": "--bucket-elements", "on_nonfinite": "--on-nonfinite",
    "batch_check_every": "--batch-check-every", "fp8": "--fp8", "fp8_recipe": "--fp8-recipe",
}
# A figure's flag is in its metadata (partc.device.figures).
BUDGET_FLAGS = {"num_devices": "--devices", "device": "--device", "profile": "--profile",
                **{spec.name: spec.metadata["flag"] for spec in FIGURES}}

UNITS = """\
sizes and rates take an explicit unit: binary KiB MiB GiB TiB (80GiB = 80 x 2**30
bytes, as nvidia-smi and torch count memory) or decimal kB MB GB TB (80GB = 80 x 10**9
bytes, as vendors quote); a bare prefix such as 40G, and Gb (bits), are refused as
ambiguous; a plain number is bytes. Rates append /s: 900GB/s."""

# The flags ``--help`` shows (every flag parses; ``--help-all`` shows them all, with every
# cost-model figure a flag overrides).
PLAN_COMMON = frozenset({
    "--devices", "--device", "--profile", "--memory", "--pp", "--dp", "--tp", "--zero",
    "--recompute", "--microbatches", "--schedule", "--global-batch", "--micro-batch",
    "--dtype", "--optimizer", "--out", "--report", "--quiet"})
PLAN_EXAMPLES = """\
examples:
  partc plan samples/gpt.py:factory --devices 2 --device CPU --memory 10MiB
  partc plan samples/plan_llama.py:workload --devices 8 --device H100-80GB \\
      --out out/llama                # plan.json, report.md and each stage's code
  partc plan samples/gpt.py:factory --devices 4 --device CPU --memory 10MiB --pp 2 \\
      --zero 1 --report html --out out/gpt   # pin what you know; the planner does the rest

Sizes and rates take a unit: 40GiB (binary) or 40GB (decimal), 900GB/s. --help-all: every
flag, with each cost-model figure of the device (a preset's or a profile's) it overrides."""

WORK_LIMIT_HELP = (f"the stage planner's search limit, in deterministic seconds of CP-SAT work "
                   f"(default {PlannerOptions().work_limit:g}): work, not wall-clock time, so "
                   f"every rank and any machine plans alike")


class UsageError(Exception):
    """A command line that cannot run: printed as one line, exit status 2."""


def _refused(message: str, command: str = "plan") -> UsageError:
    return UsageError(f"partc {command}: error: {message}")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


# ------------------------------------------------------------------------ argument types
# Each reads one argument or raises ArgumentTypeError with what to write instead; argparse
# prefixes the flag.

def _argument(read: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    def checked(text: str) -> Any:
        try:
            return read(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    checked.__name__ = name   # what argparse calls the type in its messages
    return checked


def _number(text: str, read: Callable[[str], float], allowed: Callable[[float], bool],
            what: str) -> float:
    try:
        value = read(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or not allowed(value):
        raise ValueError(f"must be {what}, got {text!r}")
    return value


def _count(text: str) -> int:
    return _number(text, int, lambda n: n >= 1, "a positive whole number")


def _whole(text: str) -> int:
    return _number(text, int, lambda n: n >= 0, "a whole number, 0 or more")


def _non_negative(text: str) -> float:
    return _number(text, float, lambda x: x >= 0, "a number, 0 or more")


def _positive(text: str) -> float:
    return _number(text, float, lambda x: x > 0, "a positive number")


def _fraction(text: str) -> float:
    return _number(text, float, lambda x: 0 < x <= 1, "a number in (0, 1]")


def _share(text: str) -> float:
    return _number(text, float, lambda x: 0 <= x <= 1, "a number in [0, 1]")


def _seconds(text: str) -> float:
    return _number(text, float, lambda x: x >= 0, "a number of seconds, 0 or more")


def _size(text: str) -> int:
    size = parse_bytes(text)
    if size <= 0:
        raise ValueError(f"a memory size must be above 0, got {text!r}")
    return size


def _reserved(text: str) -> int:
    size = parse_bytes(text)
    if size < 0:
        raise ValueError(f"a reserved memory size must be 0 or more, got {text!r}")
    return size


def _sizes(text: str) -> int | tuple[int, ...]:
    sizes = tuple(_size(part.strip()) for part in text.split(","))
    return sizes[0] if len(sizes) == 1 else sizes


def _rate(text: str) -> float:
    rate = parse_rate(text)
    if rate <= 0:
        raise ValueError(f"a rate must be above 0, got {text!r}")
    return rate


def _device(text: str) -> str:
    return preset(text).name


def _layer_mode(text: str) -> tuple[str, str]:
    layer, sep, mode = text.rpartition("=")
    if not sep or not layer:
        raise ValueError(f"write LAYER=MODE, e.g. h.3={RECOMPUTE_MODES[-1]}, got {text!r}")
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"{mode!r} is not a recompute mode; use one of "
                         f"{', '.join(RECOMPUTE_MODES)}")
    return layer, mode


def _collective_link(text: str) -> tuple[str, dict[str, float]]:
    kind, sep, numbers = text.partition("=")
    latency, comma, rate = numbers.partition(",")
    if not sep or not comma:
        raise ValueError(f"write KIND=LATENCY,RATE, e.g. all_gather=20e-6,5GB/s, got {text!r}")
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"{kind!r} is not a collective; use one of "
                         f"{', '.join(COLLECTIVE_KINDS)}")
    return kind, {"latency_s": _seconds(latency), "bandwidth": _rate(rate)}


def _stage(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise ValueError(f"a stage is a comma-separated list of layer names, got {text!r}")
    return names


COUNT, POSITIVE = _argument(_count, "count"), _argument(_positive, "number")


def _offload_kinds(text: str) -> tuple[str, ...]:
    kinds = () if text.strip() == "none" else tuple(
        k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in {o.value for o in Offload}]
    if unknown:
        raise ValueError(f"unknown offload kinds {unknown}: use "
                         f"{', '.join(o.value for o in Offload)} or none")
    return kinds


OFFLOAD = _argument(_offload_kinds, "offload kinds")
WHOLE, NON_NEGATIVE = _argument(_whole, "count"), _argument(_non_negative, "number")
FRACTION, SECONDS = _argument(_fraction, "fraction"), _argument(_seconds, "seconds")
SHARE = _argument(_share, "share")
SIZES, RATE = _argument(_sizes, "size"), _argument(_rate, "rate")
RESERVED = _argument(_reserved, "size")
DEVICE, LAYER_MODE = _argument(_device, "device"), _argument(_layer_mode, "LAYER=MODE")
STAGE, LINK = _argument(_stage, "stage"), _argument(_collective_link, "KIND=LATENCY,RATE")
# The reader of each unit of DeviceFigures (their flags: _budget_arguments). A factor is
# read as a positive number; DeviceBudget says why one below 1 is refused.
_UNIT_TYPES = {"bytes": SIZES, "count": COUNT, "FLOP/s": POSITIVE, "bytes/s": RATE,
               "seconds": SECONDS, "fraction": FRACTION, "share": SHARE, "factor": POSITIVE,
               "links": LINK, "updates/s": POSITIVE,
               "reserved bytes": RESERVED}


# -------------------------------------------------------------------------------- parser

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):   # one line, not the usage: the flags are many
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


class _Version(argparse.Action):
    """``--version``: the installed distribution's version, read only when asked."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print partc's version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("partc")
        except PackageNotFoundError:
            found = "(not installed: running from a source tree)"
        print(f"partc {found}")
        parser.exit()


class _HelpAll(argparse.Action):
    """``--help-all``: the help of the parser ``full()`` makes, with every flag."""

    def __init__(self, option_strings, dest, full: Callable[[], argparse.ArgumentParser],
                 **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0,
                         help="show every flag, with each cost-model figure, and exit")
        self.full = full

    def __call__(self, parser, namespace, values, option_string=None):
        self.full().print_help()
        parser.exit()


def shorten(parser: argparse.ArgumentParser, common: frozenset[str],
            full: Callable[[], argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """``parser`` with ``--help`` showing only the flags in ``common`` (the others still
    parse) and a ``--help-all`` that prints ``full()``'s help."""
    for action in parser._actions:
        if action.option_strings and not common & set(action.option_strings) \
                and not isinstance(action, argparse._HelpAction):
            action.help = argparse.SUPPRESS
    parser.add_argument("--help-all", action=_HelpAll, full=full)
    return parser


def plan_parser(parser: argparse.ArgumentParser | None = None, *,
                full: bool = False) -> argparse.ArgumentParser:
    """``partc plan``'s flags on ``parser`` (a new one by default); ``--help`` shows the
    common ones unless ``full``."""
    parser = parser or _Parser(prog="partc plan")
    parser.description = "Trace, measure and plan a model; print the report, write the plan."
    parser.epilog = UNITS if full else PLAN_EXAMPLES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    _plan_arguments(parser)
    if full:
        return parser
    parser.usage = "%(prog)s TARGET --devices N [--device NAME] [flags]"
    return shorten(parser, PLAN_COMMON, lambda: plan_parser(full=True))


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="partc", description="partc: plan how to train a PyTorch model on "
                     "many devices (pipeline, data and tensor parallelism, ZeRO, recompute), "
                     "and train it.")
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan_parser(commands.add_parser(
        "plan", help="trace, measure and plan a model; print the report, write the plan"))
    report = commands.add_parser("report", help="render a saved plan (plan.json) again",
                                 description="Render a plan that partc plan --out saved.")
    report.add_argument("plan", type=Path, help="plan.json, or the directory holding it")
    report.add_argument("--format", choices=REPORT_FORMATS, default="text",
                        help="html: one self-contained file with the pictures (default text)")
    report.add_argument("--out", type=Path, help="write the report here (default: print it)")
    commands.add_parser("train", add_help=False,
                        help="train a model under torchrun: partc train --help says how")
    _calibrate_arguments(commands.add_parser(
        "calibrate", help="measure this machine's devices; write a profile that "
        "--profile and DeviceBudget load"))
    checkpoint = commands.add_parser("checkpoint", help="inspect checkpoints that partc "
                                     "train or module.save_checkpoint wrote")
    actions = checkpoint.add_subparsers(dest="action", required=True, metavar="ACTION")
    verify = actions.add_parser("verify", help="check every file against the manifest's "
                                "size and SHA-256, and .metadata as data; exit 1 if any is bad")
    verify.add_argument("directory", type=Path,
                        help="a checkpoint root (every step-* under it) or one step directory")
    return parser


TARGET_HELP = ("path/to/file.py:factory, or a Hugging Face config: a model directory "
               "(config.json) or a model type such as llama")


def _plan_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("target", help=TARGET_HELP)
    _config_arguments(plan.add_argument_group("a model by Hugging Face config"))
    _budget_arguments(plan.add_argument_group("devices"))
    _pin_arguments(plan.add_argument_group(
        "pins (the planner decides what is not pinned)"))
    _training_arguments(plan.add_argument_group(
        "training (overrides the factory's TrainSpec)"))
    out = plan.add_argument_group("planner and output")
    out.add_argument("--work-limit", type=POSITIVE, default=PlannerOptions().work_limit,
                     metavar="WORK", help=WORK_LIMIT_HELP)
    out.add_argument("--report", "--format", dest="report", choices=REPORT_FORMATS,
                     default="text", help="the report's format (default text); with --out, "
                     "html is written to DIR/report.html instead of printed")
    out.add_argument("--out", type=Path, metavar="DIR",
                     help="write plan.json, report.md and the stages' code here")
    shown = out.add_mutually_exclusive_group()
    shown.add_argument("-q", "--quiet", action="store_true",
                       help="no progress bars or progress lines")
    shown.add_argument("--progress", action="store_true",
                       help="progress bars on stderr even when it is not a terminal "
                            "(they are drawn by default on a terminal)")


def _config_arguments(group) -> None:
    """How a model named by its Hugging Face config is made (``partc plan``, ``partc
    train``): :mod:`partc.cli.hf_config`."""
    # extend: "--hf-config a=1 b=2" and "--hf-config a=1 --hf-config b=2" alike.
    group.add_argument("--hf-config", action="extend", nargs="+", metavar="KEY=VALUE",
                       help="set config fields: --hf-config num_hidden_layers=2 "
                            "hidden_size=512 (or repeat the flag); a composite "
                            "config's text model by dotted keys: "
                            "text_config.num_hidden_layers=2")
    group.add_argument("--seq-len", type=COUNT, metavar="N",
                       help="tokens per sample (default: the text model's "
                            "max_position_embeddings, at most 2048)")


def _training_arguments(train) -> None:
    """The TrainSpec fields (``partc plan`` and ``partc train`` alike)."""
    train.add_argument("--global-batch", type=COUNT, metavar="N",
                       help="samples per optimizer step")
    train.add_argument("--micro-batch", type=COUNT, metavar="N",
                       help="samples per microbatch (also pins it for the planner)")
    train.add_argument("--dtype", choices=sorted(DTYPE_NAMES),
                       help="compute dtype; bf16/fp16 train in mixed precision (default: "
                       "the factory's TrainSpec; else a Hugging Face config's dtype, else "
                       "bf16 on a GPU and float32 on a CPU)")
    train.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATE_BYTES))
    train.add_argument("--max-grad-norm", type=POSITIVE, metavar="NORM",
                       help="clip the global gradient norm to this")
    train.add_argument("--attention", choices=ATTENTION,
                       help="run attention as written, or fused into one kernel call "
                            "(default auto: fused on GPUs)")
    train.add_argument("--moe-imbalance", type=POSITIVE, metavar="FACTOR",
                       help="mixture-of-experts: the busiest expert's tokens over its "
                            "balanced share that memory is budgeted for (default 2, at "
                            "least 1)")
    train.add_argument("--moe-capacity-factor", type=POSITIVE, metavar="FACTOR",
                       help="mixture-of-experts: cap each expert's tokens at FACTOR x its "
                            "balanced share, dropping the rest (default: dropless)")
    train.add_argument("--loss-per-microbatch", action="store_true",
                       help="each microbatch's loss is its own, where the model's loss "
                            "couples a batch's samples (a router's load-balancing loss "
                            "over the batch); without it such a model is planned with one "
                            "replica and one microbatch")
    train.add_argument("--no-tp-overlap", action="store_true",
                       help="run the sequence-parallel all-gathers and reduce-scatters "
                            "blocking, not as rings beside their linears' matmuls")
    train.add_argument("--no-param-gather-overlap", action="store_true",
                       help="ZeRO-1: finish the all-gather of the updated parameters in "
                            "the optimizer step, not beside the next forward")
    train.add_argument("--bucket-elements", type=COUNT, metavar="N",
                       help="ZeRO 0/1: reduce gradients over the replicas in buckets of up "
                            "to N elements (default 25000000); the plan prices them")
    train.add_argument("--on-nonfinite", choices=ON_NONFINITE,
                       help="a step whose loss or gradient norm is inf or NaN: raise "
                            "before the optimizer steps (default), skip it (gradients "
                            "dropped, counted in telemetry), or ignore it")
    train.add_argument("--batch-check-every", type=WHOLE, metavar="N",
                       help="compare a digest of the batch over the ranks that must train "
                            "on the same one every N steps (default 1; 0: never)")
    train.add_argument("--compile", action=argparse.BooleanOptionalAction,
                       help="pin torch.compile on or off (default: the planner's: on for "
                            "GPUs where the schedule allows, off for CPUs)")
    train.add_argument("--fused-optimizer", action=argparse.BooleanOptionalAction,
                       help="pin torch's fused Adam/AdamW step on or off (default: on "
                            "for GPUs)")
    train.add_argument("--fp8", action="store_true",
                       help="let linears run FP8 where it pays (torchao's float8 training; "
                            "needs an FP8 peak: H100, H200; emulated on the CPU preset)")
    train.add_argument("--fp8-recipe", choices=FP8_RECIPES,
                       help="FP8 scaling: one scale per tensor (tensorwise, default) or per "
                            "row (rowwise)")


def _budget_arguments(group, *, devices: bool = True,
                      default_device: str = f"default {DEFAULT_DEVICE}, or the profile's"
                      ) -> None:
    """The DeviceBudget fields; ``devices=False`` leaves out ``--devices`` (``partc
    train`` plans for the launch's world size); ``default_device`` says what runs without
    ``--device``."""
    if devices:
        group.add_argument("--devices", type=COUNT, metavar="N", required=True,
                           help="number of devices")
    group.add_argument("--device", type=DEVICE, metavar="NAME",
                       help=f"a preset: {', '.join(PRESETS)} ({default_device})")
    group.add_argument("--profile", type=Path, metavar="FILE",
                       help="device profile from partc calibrate")
    for spec in FIGURES:
        unit = spec.metadata["unit"]
        group.add_argument(spec.metadata["flag"], type=_UNIT_TYPES[unit.name],
                           metavar=unit.metavar, help=spec.metadata["help"],
                           **({"action": "append"} if unit.name == "links" else {}))


def _pin_arguments(group) -> None:
    group.add_argument("--pp", type=COUNT, metavar="N", help="pipeline stages")
    group.add_argument("--dp", type=COUNT, metavar="N", help="data-parallel replicas")
    group.add_argument("--tp", type=COUNT, metavar="N",
                       help="tensor-parallel degree (divides a node)")
    group.add_argument("--cp", type=COUNT, metavar="N",
                       help="context-parallel degree: each sequence split over N ranks")
    group.add_argument("--cp-kind", choices=CP_KINDS,
                       help="how context-parallel attention exchanges sequence shards: a "
                            "ring of key/value blocks, or all-to-alls to heads (Ulysses)")
    group.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction,
                       help="Megatron-style sequence parallelism on or off")
    group.add_argument("--tp-objective", choices=TP_OBJECTIVES,
                       help="keep only the fastest shardings, or those of fewest "
                            "parameter bytes (then, with sequence parallelism, "
                            "activation bytes)")
    group.add_argument("--stage", type=STAGE, action="append", metavar="LAYERS",
                       help="one pipeline stage's layers, comma-separated, as the report "
                            "names them; once per stage, in order")
    recompute = group.add_mutually_exclusive_group()
    recompute.add_argument("--recompute", choices=RECOMPUTE_MODES,
                           help="one recompute mode for every layer")
    recompute.add_argument("--recompute-layer", type=LAYER_MODE, action="append",
                           metavar="LAYER=MODE", help="one layer's recompute mode; "
                           "repeat for more layers (the others are left to the planner)")
    group.add_argument("--microbatches", type=COUNT, metavar="N", help="microbatches per step")
    group.add_argument("--schedule", choices=SCHEDULES, help="the pipeline schedule")
    group.add_argument("--virtual-stages", type=COUNT, metavar="V",
                       help="virtual stages (runs of layers) per pipeline rank: 2 or more "
                            "for the interleaved, looped and 'V' schedules")
    group.add_argument("--zero", type=int, choices=ZERO_STAGES,
                       help="ZeRO stage: 1 shards optimizer state over dp, 2 gradients "
                            "too, 3 parameters too")
    group.add_argument("--fp8-linears", type=_fp8_linears, metavar="all|none|W,W",
                       help="with --fp8: the linears that run FP8, all, none, or their "
                            "weights' FQNs comma-separated (default: where it pays)")
    group.add_argument("--zero2-grad-sync", choices=ZERO2_GRAD_SYNCS,
                       help="when ZeRO-2 reduce-scatters gradients: after every "
                            "microbatch, or once per step (accumulated whole)")
    group.add_argument("--offload", type=OFFLOAD, metavar="KINDS",
                       help="what lives on the host, comma-separated, exactly these: "
                            "optimizer (state, master weights and step), params (ZeRO-3's "
                            "parameters), activations; 'none' for nothing (default: the "
                            "planner chooses)")
    group.add_argument("--ep", type=COUNT, metavar="N",
                       help="expert-parallel degree of mixture-of-experts layers (divides "
                            "dp x tp and the expert count)")


def _calibrate_arguments(calibrate: argparse.ArgumentParser) -> None:
    calibrate.add_argument("--out", type=Path, default=Path("profile.json"),
                           help="where to write the profile (default: profile.json)")
    calibrate.add_argument("--device", choices=("cpu", "cuda"),
                           help="default: cuda when torch sees a GPU, else cpu")
    calibrate.add_argument("--processes", type=COUNT, metavar="N",
                           help="ranks for the collectives (default: one per GPU; 2 on CPU, "
                                "where a device is one process)")
    calibrate.add_argument("--quick", action="store_true",
                           help="small sizes, few repeats: seconds, rough figures")
    calibrate.add_argument("-q", "--quiet", action="store_true", help="no progress lines")


# ------------------------------------------------------------- checks before any import

def _check_plan(args: argparse.Namespace) -> None:
    """What the flags say together, and the files they name: before torch is imported."""
    check_flags(args, args.devices)
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise _refused(f"--out {args.out} is a file, not a directory")
    check_target(args.target)


def check_flags(args: argparse.Namespace, devices: int, command: str = "plan") -> None:
    """What the budget, pin and training flags (as :func:`_budget_arguments`,
    :func:`_pin_arguments` and :func:`_training_arguments` read them) say together on
    ``devices`` devices; a flag not in ``args`` counts as not given."""
    memory = getattr(args, "memory", None)
    if isinstance(memory, tuple) and len(memory) != devices:
        raise _refused(f"--memory lists {len(memory)} sizes for "
                       f"{devices} devices: give one size, or one per device", command)
    layers = [layer for layer, _ in getattr(args, "recompute_layer", None) or ()]
    twice = sorted({layer for layer in layers if layers.count(layer) > 1})
    if twice:
        raise _refused(f"--recompute-layer names {', '.join(twice)} "
                       f"more than once", command)
    global_batch = getattr(args, "global_batch", None)
    micro_batch = getattr(args, "micro_batch", None)
    if global_batch and micro_batch and global_batch % micro_batch:
        raise _refused(f"--micro-batch {micro_batch} does not "
                       f"divide --global-batch {global_batch}", command)
    profile = getattr(args, "profile", None)
    if profile is not None and not Path(profile).is_file():
        raise _refused(f"no device profile at {profile}; write one "
                       f"with `partc calibrate --out {profile}`", command)


def check_target(target: str, command: str = "plan") -> None:
    """``file.py:factory``: the file exists, parses, and defines (or imports) ``factory``
    at its top level, unless it makes names in ways a reader cannot see. A Hugging Face
    config's directory holds config.json (a model type is checked when it is read)."""
    if hf_config.is_config_target(target):
        try:
            hf_config.config_file(target)
        except ValueError as error:
            raise _refused(str(error), command) from None
        return
    path, _, name = target.rpartition(":")
    if not path or not name:
        raise _refused(f"expected path/to/file.py:factory, got {target!r}", command)
    file = Path(path)
    if not file.is_file():
        raise _refused(f"no such file: {file}", command)
    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except (SyntaxError, ValueError) as error:
        raise _refused(f"{file} does not parse: {error}", command) from None
    names, dynamic = _top_level_names(tree.body)
    if name not in names and not dynamic:
        close = difflib.get_close_matches(name, sorted(names), n=3)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise _refused(f"{file} has no function {name!r}{hint}", command)


def _top_level_names(body: list[ast.stmt]) -> tuple[set[str], bool]:
    """The names a module's top level binds (inside if/try/with/for blocks too), and
    whether it may bind others a reader cannot see (``import *``, ``globals()``, a module
    ``__getattr__``, ``match``)."""
    names, dynamic = set(), False
    for statement in body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
            continue
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            for alias in statement.names:
                dynamic |= alias.name == "*"
                names.add(alias.asname or alias.name.split(".")[0])
            continue
        dynamic |= type(statement).__name__ == "Match" or any(
            isinstance(n, ast.Name) and n.id in ("globals", "setattr", "exec")
            for n in ast.walk(statement))
        names.update(n.id for n in ast.walk(statement)
                     if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
        for block in ("body", "orelse", "finalbody", "handlers"):
            inner, unseen = _top_level_names(getattr(statement, block, []))
            names |= inner
            dynamic |= unseen
    return names, dynamic or "__getattr__" in names


def _check_report(args: argparse.Namespace) -> None:
    if not args.plan.exists():
        raise _refused(f"no such file or directory: {args.plan}", "report")
    if args.plan.is_dir() and not (args.plan / "plan.json").is_file():
        raise _refused(f"{args.plan} holds no plan.json", "report")


CHECKS = {"plan": _check_plan, "report": _check_report}


# ---------------------------------------------------------------------------- the plan

def load_model(target: str, args: argparse.Namespace | None = None, *,
               meta: bool = False) -> dict[str, Any]:
    """What ``target`` names, as a factory's dict: the factory's, or a Hugging Face
    config's causal LM (``meta``: on the meta device) with its example batch and data
    (``args``: its --hf-config, --seq-len and --global-batch)."""
    if not hf_config.is_config_target(target):
        return load_factory(target)
    try:
        return hf_config.workload(target, getattr(args, "hf_config", None),
                                  batch=getattr(args, "global_batch", None),
                                  seq_len=getattr(args, "seq_len", None), meta=meta)
    except ValueError as error:
        raise _refused(str(error)) from None


def load_factory(target: str) -> dict[str, Any]:
    """Import ``file.py:function`` and call it; normalise what it returns to a dict."""
    path, _, name = target.rpartition(":")
    file = Path(path)
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    # Registered before running, as an import would: dataclasses and pickling look it up.
    sys.modules[spec.name] = module
    sys.path.insert(0, str(file.parent.resolve()))
    spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise _refused(f"{file} has no function {name!r}")
    made = getattr(module, name)()
    if isinstance(made, dict):
        if "model" not in made or "example_inputs" not in made:
            raise _refused(f"{target} must return a dict with 'model' "
                           f"and 'example_inputs'")
        return made
    if isinstance(made, tuple) and len(made) in (2, 3):
        return dict(zip(("model", "example_inputs", "loss_fn"), made))
    raise _refused(f"{target} returned {type(made).__name__}; expected "
                   f"a dict or a tuple (model, example_inputs[, loss_fn])")


def _fp8_linears(text: str) -> str | tuple[str, ...]:
    """``--fp8-linears``: "all", "none", or weight FQNs separated by commas."""
    if text in ("all", "none"):
        return text
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError("give all, none or weights' FQNs, comma-separated")
    return names


def _flagged(args: argparse.Namespace, flags: dict[str, str], **read: Any) -> dict[str, Any]:
    """The fields whose flag was given, each read by ``read[field]`` when there is one."""
    given = {}
    for name, flag in flags.items():
        value = getattr(args, _dest(flag), None)   # absent: a command without the flag
        if value is not None:
            given[name] = read[name](value) if name in read else value
    return given


def _constraints(args: argparse.Namespace):
    from partc.spec import Constraints

    given = _flagged(args, PIN_FLAGS)
    if getattr(args, "recompute_layer", None):
        given["recompute"] = dict(args.recompute_layer)
    return Constraints(**given)


def _budget(args: argparse.Namespace, **fixed: Any):
    """The DeviceBudget the flags give; ``fixed`` fields (``num_devices`` for ``partc
    train``: the launch's world size) are not flags."""
    from partc.device.budget import DeviceBudget

    return DeviceBudget(**_flagged(args, BUDGET_FLAGS, peak_flops=lambda tflops: tflops * 1e12,
                                   fp8_peak_flops=lambda tflops: tflops * 1e12,
                                   collective_links=dict), **fixed)


def _train(args: argparse.Namespace, workload: dict[str, Any], device_type: str):
    """The factory's TrainSpec with the training flags over it. Without one (a factory
    that gives none, a Hugging Face config): the example inputs' batch, and the dtype the
    workload names (a config's) or else mixed bf16 on a GPU (``device_type`` "cuda", the
    budget's: every GPU preset computes in bf16) and float32 on a CPU."""
    from dataclasses import replace

    from partc.codec import dtype_named
    from partc.spec import TrainSpec

    inputs = workload["example_inputs"]
    first = inputs[0] if isinstance(inputs, (tuple, list)) else \
        next(iter(inputs.values())) if isinstance(inputs, dict) else inputs
    dtype = workload.get("dtype") or ("bfloat16" if device_type == "cuda" else "float32")
    train = workload.get("train") or TrainSpec(global_batch_size=int(first.shape[0]),
                                               dtype=dtype_named(dtype))
    return replace(train, **_flagged(args, TRAIN_FLAGS,
                                     dtype=lambda name: dtype_named(DTYPE_NAMES[name]),
                                     tp_overlap=lambda blocking: not blocking,
                                     overlap_param_gather=lambda blocking: not blocking))


@contextmanager
def _config_hint(target: str, model: Any) -> Iterator[None]:
    """A model built from a bare Hugging Face config that fails to trace: the trace error
    names the fields the config leaves unset (``hf_config.unset_hint``), which its code
    may read (DeepSeek-V2's router calls ``topk(k=None)``)."""
    from partc.errors import TraceError

    try:
        yield
    except TraceError as error:
        hint = hf_config.unset_hint(model.config) \
            if hf_config.is_config_target(target) and hasattr(model, "config") else ""
        if not hint:
            raise
        raise TraceError(f"{error}\nThe model was built from a config{hint}: a checkpoint's "
                         f"config.json gives them; here, give each with --hf-config "
                         f"KEY=VALUE.") from error


def plan_command(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    # Pins and budget before the model: a contradiction costs no model build.
    constraints, budget = _constraints(args), _budget(args)
    from partc.compiler import compile

    workload = load_model(args.target, args, meta=True)
    with _progress_bars(args.progress or (not args.quiet and sys.stderr.isatty())), \
            _config_hint(args.target, workload["model"]):
        program = compile(workload["model"], workload["example_inputs"], budget=budget,
                          train=_train(args, workload, budget.device_type),
                          loss_fn=workload.get("loss_fn"),
                          example_target=workload.get("example_target"),
                          constraints=constraints, name=workload.get("name"),
                          options=PlannerOptions(work_limit=args.work_limit))
    report = program.report(args.report)
    if args.out is not None:
        program.save(args.out)
        written = [args.out / "plan.json", args.out / "report.md"]
        if args.report == "html":
            written.append(args.out / "report.html")
            written[-1].write_text(report)
        print(f"wrote {', '.join(map(str, written))} and the stages' code in "
              f"{args.out / 'code'}", file=sys.stderr)
    if args.out is None or args.report != "html":
        print(report)
    logging.getLogger("partc").info("done in %.2f s", time.perf_counter() - start)
    return 0


# ----------------------------------------------------------------------------- progress

class _Bars:
    """Draws each phase :mod:`partc.progress` reports as a tqdm bar on stderr."""

    UNITS = {"trace": "step", "tensor parallelism": "option", "search": "config",
             "schedules": "schedule"}

    def __init__(self) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self._bars: dict[str, Any] = {}

    def __call__(self, event) -> None:
        bar = self._bars.get(event.phase)
        if bar is not None and event.done < bar.n:   # the phase started again
            bar.close()
            bar = None
        if bar is None:
            bar = self._bars[event.phase] = self._tqdm(
                total=event.total, desc=event.phase, unit=self.UNITS.get(event.phase, "step"),
                file=sys.stderr, leave=False, dynamic_ncols=True)
        bar.total = event.total
        # A step done is drawn by update, at most every tqdm's mininterval, so that fast
        # phases stay cheap; a new detail in the same step (rare) at once.
        bar.set_postfix_str(_postfix(event), refresh=event.done == bar.n)
        bar.update(event.done - bar.n)
        if event.done >= event.total:
            self._bars.pop(event.phase).close()

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()


def _postfix(event) -> str:
    parts = [event.detail] if event.detail else []
    if event.incumbent_s is not None:
        parts.append(f"best {format_seconds(event.incumbent_s)}")
    if event.bound_s is not None:
        parts.append(f"bound {format_seconds(event.bound_s)}")
    if event.gap is not None:
        parts.append(f"gap {event.gap:.1%}")
    return ", ".join(parts)


@contextmanager
def _progress_bars(shown: bool) -> Iterator[None]:
    """Progress bars for everything run inside, when ``shown``; log lines are written
    above the bars meanwhile."""
    if not shown:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    from partc import progress

    bars = _Bars()
    with ExitStack() as stack:
        stack.callback(bars.close)
        stack.enter_context(logging_redirect_tqdm())
        stack.enter_context(progress.listening(bars))
        yield


# ----------------------------------------------------------------- the other commands

def report_command(args: argparse.Namespace) -> int:
    from partc.program import read_plan_file
    from partc.report.text import render

    path = args.plan / "plan.json" if args.plan.is_dir() else args.plan
    report = render(read_plan_file(path), args.format)
    if args.out is None:
        print(report)
        return 0
    args.out.write_text(report if report.endswith("\n") else report + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def train_command(argv: list[str]) -> int:
    """``partc train ...``: the launcher's own command line, imported only now."""
    try:
        launcher = importlib.import_module(f"{__package__}.launcher")
    except ModuleNotFoundError as error:
        if error.name != f"{__package__}.launcher":   # not a module the launcher needs
            raise
        print("partc train: error: this partc has no launcher (partc/cli/launcher.py)",
              file=sys.stderr)
        return 2
    return launcher.main(argv)


def calibrate_command(args: argparse.Namespace) -> int:
    import torch

    from partc.calibrate.calibration import calibrate
    from partc.calibrate.calibration_options import CalibrationOptions
    from partc.calibrate.profile_summary import summary
    from partc.calibrate.profile_writer import write_profile

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    processes = args.processes or (torch.cuda.device_count() if device == "cuda" else 2)
    options = CalibrationOptions(device=device, processes=processes, quick=args.quick)
    profile = calibrate(options)
    write_profile(profile, args.out)
    print(summary(profile))
    print(f"wrote {args.out}; plan with it: partc plan ... --profile {args.out}",
          file=sys.stderr)
    return 0


def checkpoint_command(args: argparse.Namespace) -> int:
    """``partc checkpoint verify DIR``: one line per bad file on stdout, status 1 if any."""
    from partc.runtime.checkpoint import LATEST, MANIFEST, read_manifest
    from partc.runtime.checkpoint_files import verify

    root = args.directory
    steps = ([root] if (root / MANIFEST).is_file() else
             sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
             if root.is_dir() else [])
    if not steps:
        raise PartcError(f"no checkpoint at {root}: neither {root / MANIFEST} nor step-* "
                         "directories")
    bad = 0
    pointer = root / LATEST
    if pointer.is_file() and not (root / pointer.read_text().strip() / MANIFEST).is_file():
        print(f"{pointer} names {pointer.read_text().strip()!r}, which is no complete "
              "checkpoint under it")
        bad += 1
    for step in steps:
        try:
            problems = verify(step, read_manifest(step))
        except PartcError as error:
            problems = [str(error)]
        for problem in problems:
            print(problem)
        bad += len(problems)
        if not problems:
            print(f"ok {step}", file=sys.stderr)
    return 1 if bad else 0


COMMANDS = {"plan": plan_command, "report": report_command, "calibrate": calibrate_command,
            "checkpoint": checkpoint_command}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:   # its flags are the launcher's own
        return train_command(argv[1:])
    try:
        args = _parser().parse_args(argv)
        CHECKS.get(args.command, lambda args: None)(args)
    except UsageError as error:
        print(error, file=sys.stderr)
        return 2
    return run_reported(lambda: COMMANDS[args.command](args), "partc",
                        quiet=getattr(args, "quiet", False))


class _Attributed(logging.Formatter):
    """A log line under the name of whom it comes from: partc's own as ``partc:``,
    another library's (torchao's, warning at import that its kernels did not load) under
    that library's name, not partc's."""

    def format(self, record: logging.LogRecord) -> str:
        top = record.name.split(".")[0]
        line = f"{'partc' if top in ('partc', 'root') else top}: {record.getMessage()}"
        return line + ("\n" + self.formatException(record.exc_info) if record.exc_info
                       else "")


def stderr_handler(quiet: bool, stream: Any = None) -> logging.Handler:
    """Log lines on ``stream`` (stderr), each under its source's name
    (:class:`_Attributed`); with ``quiet``, only partc's and other libraries' errors
    pass (the level passes partc's warnings)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_Attributed())
    if quiet:
        handler.addFilter(lambda record: record.name.split(".")[0] == "partc"
                          or record.levelno >= logging.ERROR)
    return handler


def log_to_stderr(quiet: bool) -> None:
    """The commands' logging: :func:`stderr_handler` at INFO, or WARNING with ``quiet``
    (where the process has set up none yet)."""
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO,
                        handlers=[stderr_handler(quiet)])


def run_reported(command: Callable[[], int], prefix: str, *, quiet: bool) -> int:
    """Run a command with partc's log lines on stderr; bad input (a usage error, a
    PartcError, a ValueError) is one line there, ``prefix`` first, and exit status 2."""
    log_to_stderr(quiet)
    try:
        return command()
    except UsageError as error:
        print(error, file=sys.stderr)
    except PartcError as error:
        print(f"{prefix}: {type(error).__name__}: {error}", file=sys.stderr)
    except ValueError as error:
        print(f"{prefix}: invalid input: {error}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
