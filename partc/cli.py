"""Command line: ``partc plan path/to/file.py:factory --devices N --device H100-80GB``.

``partc calibrate --out profile.json`` measures this machine's devices and writes a
profile; ``partc plan ... --profile profile.json`` plans with its numbers.

The factory is a function of no arguments in that file. It returns either a dict with
keys ``model`` and ``example_inputs`` (optional: ``loss_fn``, ``example_target``,
``train`` — a TrainSpec — and ``name``), or a tuple ``(model, example_inputs[, loss_fn])``.
Command-line flags override the factory's TrainSpec field by field.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .budget import DEFAULT_DEVICE, PRESETS, DeviceBudget
from .errors import PartcError
from .options import PlannerOptions
from .report import FORMATS
from .spec import ATTENTION, SCHEDULES, Constraints, TrainSpec

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def load_factory(target: str) -> dict[str, Any]:
    """Import ``file.py:function`` and call it; normalise what it returns to a dict."""
    path, _, name = target.rpartition(":")
    if not path or not name:
        raise SystemExit(f"expected path/to/file.py:factory, got {target!r}")
    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"no such file: {file}")
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    # Registered before running, as an import would: dataclasses and pickling look it up.
    sys.modules[spec.name] = module
    sys.path.insert(0, str(file.parent.resolve()))
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise SystemExit(f"{file} has no function {name!r}")
    made = getattr(module, name)()
    if isinstance(made, dict):
        if "model" not in made or "example_inputs" not in made:
            raise SystemExit(f"{target} must return a dict with 'model' and 'example_inputs'")
        return made
    if isinstance(made, tuple) and len(made) in (2, 3):
        return dict(zip(("model", "example_inputs", "loss_fn"), made))
    raise SystemExit(f"{target} returned {type(made).__name__}; expected a dict or a tuple "
                     f"(model, example_inputs[, loss_fn])")


def _memory(text: str | None):
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",")]
    return parts[0] if len(parts) == 1 else tuple(parts)


def _train(args: argparse.Namespace, workload: dict[str, Any]) -> TrainSpec:
    inputs = workload["example_inputs"]
    first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
    train = workload.get("train") or TrainSpec(global_batch_size=int(first.shape[0]))
    overrides = {}
    if args.global_batch is not None:
        overrides["global_batch_size"] = args.global_batch
    if args.micro_batch is not None:
        overrides["micro_batch_size"] = args.micro_batch
    if args.dtype is not None:
        overrides["dtype"] = DTYPES[args.dtype]
    if args.optimizer is not None:
        overrides["optimizer"] = args.optimizer
    if args.attention is not None:
        overrides["attention"] = args.attention
    return replace(train, **overrides)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="partc", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="trace, measure and plan a model; write the plan")
    plan.add_argument("target", help="path/to/file.py:factory")
    plan.add_argument("--devices", type=int, required=True, help="number of devices")
    plan.add_argument("--device", help=f"one of {', '.join(PRESETS)} (default "
                      f"{DEFAULT_DEVICE}, or the profile's)")
    plan.add_argument("--profile", type=Path, help="device profile from partc calibrate")
    plan.add_argument("--memory", help="memory per device, e.g. 40GiB, or a comma list")
    plan.add_argument("--devices-per-node", type=int)
    plan.add_argument("--pp", type=int, help="pin the number of pipeline stages")
    plan.add_argument("--microbatches", type=int, help="pin the number of microbatches")
    plan.add_argument("--schedule", choices=SCHEDULES, help="pin the pipeline schedule")
    plan.add_argument("--recompute", choices=("none", "selective", "full"),
                      help="pin one recompute mode for every layer")
    plan.add_argument("--global-batch", type=int, help="samples per optimizer step")
    plan.add_argument("--micro-batch", type=int, help="samples per microbatch")
    plan.add_argument("--dtype", choices=sorted(DTYPES))
    plan.add_argument("--optimizer", choices=("sgd", "sgd-momentum", "adam", "adamw"))
    plan.add_argument("--attention", choices=ATTENTION,
                      help="run attention as written, or fused into one kernel call")
    plan.add_argument("--time-limit", type=float, default=30.0, help="solver seconds")
    plan.add_argument("--format", choices=FORMATS, default="text", help="printed report")
    plan.add_argument("--out", type=Path, help="directory for plan.json and report.md")
    plan.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    calibrate = commands.add_parser("calibrate", help="measure this machine's devices; write "
                                    "a profile that --profile and DeviceBudget load")
    calibrate.add_argument("--out", type=Path, default=Path("profile.json"),
                           help="where to write the profile (default: profile.json)")
    calibrate.add_argument("--device", choices=("cpu", "cuda"),
                           help="default: cuda when torch sees a GPU, else cpu")
    calibrate.add_argument("--processes", type=int,
                           help="ranks for the collectives (default: one per GPU; 2 on CPU, "
                                "where a device is one process)")
    calibrate.add_argument("--quick", action="store_true",
                           help="small sizes, few repeats: seconds, rough figures")
    calibrate.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return parser


def plan_command(args: argparse.Namespace) -> int:
    from .compiler import compile

    start = time.perf_counter()
    workload = load_factory(args.target)
    budget = DeviceBudget(num_devices=args.devices, device=args.device, profile=args.profile,
                          memory=_memory(args.memory), devices_per_node=args.devices_per_node)
    constraints = Constraints(pp=args.pp, num_microbatches=args.microbatches,
                              schedule=args.schedule, recompute=args.recompute)
    program = compile(workload["model"], workload["example_inputs"], budget=budget,
                      train=_train(args, workload), loss_fn=workload.get("loss_fn"),
                      example_target=workload.get("example_target"),
                      constraints=constraints, name=workload.get("name"),
                      options=PlannerOptions(time_limit_s=args.time_limit))
    print(program.report(args.format))
    if args.out is not None:
        program.save(args.out)
        print(f"wrote {args.out / 'plan.json'}, {args.out / 'report.md'} and the stages' "
              f"code in {args.out / 'code'}", file=sys.stderr)
    logging.getLogger("partc").info("done in %.2f s", time.perf_counter() - start)
    return 0


def calibrate_command(args: argparse.Namespace) -> int:
    from .calibrate import CalibrationOptions, calibrate, summary, write_profile

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    processes = args.processes or (torch.cuda.device_count() if device == "cuda" else 2)
    options = CalibrationOptions(device=device, processes=processes, quick=args.quick)
    profile = calibrate(options)
    write_profile(profile, args.out)
    print(summary(profile))
    print(f"wrote {args.out}; plan with it: partc plan ... --profile {args.out}",
          file=sys.stderr)
    return 0


COMMANDS = {"plan": plan_command, "calibrate": calibrate_command}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="partc: %(message)s", stream=sys.stderr)
    try:
        return COMMANDS[args.command](args)
    except PartcError as error:
        print(f"partc: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"partc: invalid input: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
