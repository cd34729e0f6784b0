"""``partc train``: compile a model, build this rank's part and train it, with telemetry.

    torchrun --standalone --nproc-per-node=2 -m partc train samples/gpt.py:factory --steps 20
    torchrun --standalone --nproc-per-node=2 -m partc.launcher samples/gpt.py:factory \\
        --steps 20 --config train.toml

The factory is a function of no arguments, as for ``partc plan`` (a dict with ``model``,
``example_inputs`` and optionally ``loss_fn``, ``example_target``, ``train`` — a
TrainSpec — and ``name``), plus the data:

- ``data``: a callable ``data(step) -> (inputs, target)`` returning the *global* batch for
  optimizer step ``step`` (0, 1, ..., steps - 1); ``inputs`` a tensor or a tuple of
  tensors as ``example_inputs`` but with the plan's global batch size in dim 0. Every
  rank calls it with the same step and must get the same batch (seed by the step); each
  rank keeps the rows its data-parallel replica reads. ``data(-1)`` is the held-out
  batch that ``--eval-every`` evaluates, unless the factory gives
- ``eval_data`` (optional): the held-out ``(inputs, target)``, or a callable of no
  arguments returning it.

Every rank seeds torch with ``--seed`` before calling the factory, so that every rank
builds the same initial weights, then compiles (the planner is deterministic and ranks
compare plan hashes), builds, and trains ``--steps`` optimizer steps: the learning rate
rises linearly over ``--warmup-steps`` to ``--lr``, then falls on a cosine to ``--min-lr``
at the end; gradients are clipped to ``--max-grad-norm`` (planned, as
``TrainSpec.max_grad_norm``); telemetry (``partc/runtime/telemetry.py``) prints a line per
step on rank 0 and, with ``--log-dir``, writes JSON lines per rank (and TensorBoard
events with ``--tensorboard``).

``--config file.toml`` gives the same settings as a flat TOML table, keys named as the
flags (``max_grad_norm = 1.0`` or ``max-grad-norm = 1.0``; ``target`` too); flags given
on the command line win over the file, and an unknown key is refused.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

if sys.version_info >= (3, 11):
    import tomllib
else:   # pragma: no cover - Python 3.10: the same parser, as a package
    import tomli as tomllib

OPTIMIZERS = ("adamw", "adam", "sgd")
DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b")
RECOMPUTE_MODES = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
HELD_OUT_STEP = -1


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything ``partc train`` is told, from flags and the config file."""

    target: str | None = None   # path/to/file.py:factory
    steps: int | None = None
    # The budget, as for ``partc plan``; the number of devices is the launch's world size.
    device: str | None = None
    profile: str | None = None
    memory: str | None = None
    devices_per_node: int | None = None
    # Planning pins (partc.Constraints) and the training setup (partc.TrainSpec).
    pp: int | None = None
    dp: int | None = None
    tp: int | None = None
    sequence_parallel: bool | None = None
    zero_stage: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    recompute: str | None = None
    global_batch: int | None = None
    micro_batch: int | None = None
    dtype: str | None = None
    time_limit: float = 30.0
    # The optimizer and its learning-rate schedule.
    optimizer: str = "adamw"
    lr: float = 3e-4
    min_lr: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    momentum: float = 0.0   # sgd only
    max_grad_norm: float | None = None
    # Evaluation, logging, reproducibility.
    eval_every: int = 0     # 0: never
    log_dir: str | None = None
    tensorboard: bool = False
    warn_ratio: float = 0.25
    seed: int = 0
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.target is None:
            raise ValueError("no target: give path/to/file.py:factory (or target = ... in "
                             "the config file)")
        if self.steps is None:
            raise ValueError("--steps is required (or steps = ... in the config file)")
        for name in ("steps",):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        for name in ("lr", "warn_ratio", "time_limit"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("min_lr", "weight_decay", "momentum"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr {self.min_lr} is above lr {self.lr}")
        if self.momentum and self.optimizer != "sgd":
            raise ValueError(f"momentum is for sgd; {self.optimizer} has its own betas")
        self._check_choice("optimizer", OPTIMIZERS)
        self._check_choice("dtype", DTYPE_NAMES)
        self._check_choice("schedule", SCHEDULE_NAMES)
        self._check_choice("recompute", RECOMPUTE_MODES)
        self._check_choice("zero_stage", ZERO_STAGES)
        if self.tensorboard and self.log_dir is None:
            raise ValueError("tensorboard needs log_dir: events go to <log_dir>/tensorboard")

    def _check_choice(self, name: str, choices: tuple) -> None:
        value = getattr(self, name)
        if value is not None and value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, "
                             f"got {value!r}")


_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
# Each field's type, from its annotation ("int | None" -> int).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    f.name: (_TYPES[str(f.type).split(" | ")[0]],) for f in fields(TrainConfig)}


def _checked(key: str, value: Any, where: str) -> Any:
    """A config file's ``value`` for field ``key``, of the field's type."""
    types = _FIELD_TYPES[key]
    if isinstance(value, bool) and bool not in types:
        raise ValueError(f"{where}: {key} must be {' or '.join(t.__name__ for t in types)}, "
                         f"got {value!r}")
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, types):
        raise ValueError(f"{where}: {key} must be {' or '.join(t.__name__ for t in types)}, "
                         f"got {value!r}")
    return value


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The settings of a TOML config file (one flat table; keys as the flags, ``-`` or
    ``_``); an unknown key or a value of the wrong type is a ValueError naming it."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"cannot read config file {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"config file {path} is not valid TOML: {error}") from None
    settings: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        if key not in _FIELD_TYPES or key == "config":
            raise ValueError(f"config file {path}: unknown key {raw_key!r}; known keys: "
                             f"{', '.join(sorted(_FIELD_TYPES))}")
        settings[key] = _checked(key, value, f"config file {path}")
    return settings


def parser() -> argparse.ArgumentParser:
    """The flags; each defaults to absent, so that the config file fills what is not given."""
    p = argparse.ArgumentParser(prog="partc train", description=__doc__.splitlines()[0],
                                argument_default=argparse.SUPPRESS)
    p.add_argument("target", nargs="?", help="path/to/file.py:factory")
    p.add_argument("--config", help="TOML file with these settings (flags win over it)")
    p.add_argument("--steps", type=int, help="optimizer steps to train")
    budget = p.add_argument_group("budget and plan (as partc plan)")
    budget.add_argument("--device", help="device preset (default: the profile's, or partc's)")
    budget.add_argument("--profile", help="device profile from partc calibrate")
    budget.add_argument("--memory", help="memory per device, e.g. 40GiB, or a comma list")
    budget.add_argument("--devices-per-node", type=int)
    for name in ("pp", "dp", "tp"):
        budget.add_argument(f"--{name}", type=int, help=f"pin the {name} degree")
    budget.add_argument("--sequence-parallel", action="store_true",
                        help="with tp: shard norms and dropouts on the sequence too")
    budget.add_argument("--zero-stage", type=int, choices=ZERO_STAGES)
    budget.add_argument("--microbatches", type=int, help="pin the number of microbatches")
    budget.add_argument("--schedule", choices=SCHEDULE_NAMES)
    budget.add_argument("--recompute", choices=RECOMPUTE_MODES)
    budget.add_argument("--global-batch", type=int, help="samples per optimizer step")
    budget.add_argument("--micro-batch", type=int, help="samples per microbatch")
    budget.add_argument("--dtype", choices=DTYPE_NAMES)
    budget.add_argument("--time-limit", type=float, help="solver seconds (default 30)")
    opt = p.add_argument_group("optimizer")
    opt.add_argument("--optimizer", choices=OPTIMIZERS, help="default adamw")
    opt.add_argument("--lr", type=float, help="peak learning rate (default 3e-4)")
    opt.add_argument("--min-lr", type=float, help="learning rate at the last step (default 0)")
    opt.add_argument("--warmup-steps", type=int, help="linear warm-up steps (default 0)")
    opt.add_argument("--weight-decay", type=float, help="default 0")
    opt.add_argument("--momentum", type=float, help="sgd's momentum (default 0)")
    opt.add_argument("--max-grad-norm", type=float, help="clip the global gradient 2-norm")
    run = p.add_argument_group("evaluation and logging")
    run.add_argument("--eval-every", type=int, help="evaluate the held-out batch every K steps")
    run.add_argument("--log-dir", help="directory for rank<k>.jsonl telemetry")
    run.add_argument("--tensorboard", action="store_true",
                     help="also write TensorBoard events under <log-dir>/tensorboard")
    run.add_argument("--warn-ratio", type=float,
                     help="warn when time or memory departs from the plan by more (0.25)")
    run.add_argument("--seed", type=int, help="torch seed before the factory (default 0)")
    run.add_argument("-q", "--quiet", action="store_true", help="no report, no progress lines")
    return p


def parse_config(argv: list[str]) -> TrainConfig:
    """Flags over the config file over the defaults."""
    given = vars(parser().parse_args(argv))
    from_file = read_config_file(given.pop("config")) if "config" in given else {}
    return TrainConfig(**{**from_file, **given})


def learning_rate(step: int, config: TrainConfig) -> float:
    """The learning rate of optimizer step ``step`` (0-based): linear warm-up to ``lr``
    over ``warmup_steps``, then a cosine from ``lr`` that reaches ``min_lr`` when
    training ends (at step ``steps``: the last step still learns when ``min_lr`` is 0)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.steps <= config.warmup_steps:
        return config.lr
    progress = min(1.0, (step - config.warmup_steps) / (config.steps - config.warmup_steps))
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


# -- the run ---------------------------------------------------------------------------------

def _batch(made: Any, what: str) -> tuple[tuple, Any]:
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        raise ValueError(f"{what} must return (inputs, target), got {type(made).__name__}")
    inputs, target = made
    return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), target


def _held_out(workload: dict[str, Any]) -> tuple[tuple, Any]:
    source = workload.get("eval_data")
    if source is None:
        return _batch(workload["data"](HELD_OUT_STEP), f"data({HELD_OUT_STEP})")
    return _batch(source() if callable(source) else source, "eval_data")


def _train_spec(config: TrainConfig, workload: dict[str, Any]) -> Any:
    import torch

    from .spec import TrainSpec

    inputs = workload["example_inputs"]
    first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
    train = workload.get("train") or TrainSpec(global_batch_size=int(first.shape[0]))
    dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
              "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    overrides: dict[str, Any] = {
        "optimizer": "sgd-momentum" if config.optimizer == "sgd" and config.momentum
        else config.optimizer}
    for key, name in (("global_batch_size", "global_batch"), ("micro_batch_size", "micro_batch"),
                      ("max_grad_norm", "max_grad_norm")):
        if getattr(config, name) is not None:
            overrides[key] = getattr(config, name)
    if config.dtype is not None:
        overrides["dtype"] = dtypes[config.dtype]
    return replace(train, **overrides)


def _optimizer(module: Any, config: TrainConfig) -> Any:
    import torch

    if config.optimizer == "sgd":
        return module.optimizer(torch.optim.SGD, lr=config.lr, momentum=config.momentum,
                                weight_decay=config.weight_decay)
    cls = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    return module.optimizer(cls, lr=config.lr, weight_decay=config.weight_decay)


def compile_workload(config: TrainConfig, workload: dict[str, Any], world_size: int) -> Any:
    """The Program for ``workload`` on ``world_size`` devices as ``config`` says."""
    from .budget import DeviceBudget
    from .compiler import compile
    from .options import PlannerOptions
    from .spec import Constraints

    memory = None
    if config.memory is not None:
        parts = tuple(part.strip() for part in config.memory.split(","))
        memory = parts[0] if len(parts) == 1 else parts
    budget = DeviceBudget(num_devices=world_size, device=config.device,
                          profile=config.profile, memory=memory,
                          devices_per_node=config.devices_per_node)
    constraints = Constraints(pp=config.pp, dp=config.dp, tp=config.tp,
                              sequence_parallel=config.sequence_parallel,
                              zero_stage=config.zero_stage,
                              num_microbatches=config.microbatches,
                              schedule=config.schedule, recompute=config.recompute)
    return compile(workload["model"], workload["example_inputs"], budget=budget,
                   train=_train_spec(config, workload), loss_fn=workload.get("loss_fn"),
                   example_target=workload.get("example_target"), constraints=constraints,
                   name=workload.get("name"),
                   options=PlannerOptions(time_limit_s=config.time_limit))


def train(module: Any, optimizer: Any, workload: dict[str, Any], config: TrainConfig, *,
          telemetry: Any = None, start_step: int = 0,
          after_step: Callable[[int], bool | None] | None = None) -> list[float]:
    """Steps ``start_step`` .. ``config.steps - 1``; returns their losses.

    ``after_step(n)`` runs on every rank after the n-th optimizer step (n counts from 1)
    and its evaluation: where a checkpoint is written; returning True stops training
    there (a requested stop). Resuming is loading the checkpoint and passing its step as
    ``start_step``: the learning rate and the data are functions of the step."""
    data: Callable[[int], Any] = workload["data"]
    held_out = _held_out(workload) if config.eval_every else None
    losses = []
    for step in range(start_step, config.steps):
        lr = learning_rate(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, target = _batch(data(step), f"data({step})")
        loss = module.forward_backward(*inputs, target=target)
        if telemetry is not None:
            telemetry.note(lr=lr)
        optimizer.step()   # ends the step's telemetry record
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        done = step + 1
        if held_out is not None and done % config.eval_every == 0:
            evaluated = float(module.evaluate(*held_out[0], target=held_out[1]))
            if telemetry is not None:
                telemetry.log_eval(done, evaluated)
        if after_step is not None and after_step(done):
            break
    return losses


def prepare(config: TrainConfig) -> tuple[Any, Any, Any, dict[str, Any]]:
    """Seed, make the workload, compile, build this rank's module, turn its telemetry on
    and make the optimizer: ``(module, optimizer, telemetry, workload)``. Under torchrun
    (or as one process)."""
    import torch

    from .cli import load_factory
    from .runtime.topology import world_size_from_env

    torch.manual_seed(config.seed)   # every rank builds the same initial weights
    workload = load_factory(config.target)
    if not callable(workload.get("data")):
        raise ValueError(f"{config.target} must return a dict with a 'data' key: a callable "
                         "data(step) -> (inputs, target) giving the global batch of a step")
    program = compile_workload(config, workload, world_size_from_env())
    module = program.build()
    if module.topology.rank == 0 and not config.quiet:
        print(program.report(), flush=True)
    telemetry = module.telemetry(jsonl_dir=config.log_dir, console=not config.quiet,
                                 tensorboard_dir=(Path(config.log_dir) / "tensorboard"
                                                  if config.tensorboard else None),
                                 warn_ratio=config.warn_ratio)
    return module, _optimizer(module, config), telemetry, workload


def run(config: TrainConfig) -> int:
    """Prepare, train, and leave the process group."""
    import torch.distributed as dist

    module, optimizer, telemetry, workload = prepare(config)
    try:
        train(module, optimizer, workload, config, telemetry=telemetry)
    finally:
        module.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    """``partc train ...``: returns the exit status (2 for bad input, named)."""
    from .errors import PartcError

    try:
        config = parse_config(argv)
    except ValueError as error:
        print(f"partc train: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:   # argparse: --help (0) or a bad flag (2), already printed
        return exit_.code if isinstance(exit_.code, int) else 2
    logging.basicConfig(level=logging.WARNING if config.quiet else logging.INFO,
                        format="partc: %(message)s", stream=sys.stderr)
    try:
        return run(config)
    except PartcError as error:
        print(f"partc train: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"partc train: invalid input: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
