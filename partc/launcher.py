"""``partc train``: compile a model, build this rank's part and train it, with telemetry
and checkpoints.

    torchrun --standalone --nproc-per-node=2 -m partc train samples/gpt.py:factory \\
        --steps 20 --memory 10MiB --checkpoint-dir out/ckpt --resume
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

The budget, pin and training flags are ``partc plan``'s (:mod:`partc.cli` builds both
commands' flags, checks them before the model is built and reads them into the
DeviceBudget, Constraints and TrainSpec), except ``--devices``: the number of devices is
the launch's world size, and without ``--device`` or ``--profile`` a run on a machine
whose torch sees no GPU plans for the ``CPU`` preset. Every rank seeds torch with ``--seed`` before calling the
factory, so that every rank builds the same initial weights, then compiles (the planner
is deterministic and ranks compare plan hashes), builds, and trains ``--steps``
optimizer steps: the learning rate rises linearly over ``--warmup-steps`` to ``--lr``,
then falls on a cosine to ``--min-lr`` at the end; gradients are clipped to
``--max-grad-norm`` (planned, as ``TrainSpec.max_grad_norm``); telemetry
(``partc/runtime/telemetry.py``) prints a line per step on rank 0 and, with
``--log-dir``, writes JSON lines per rank (and TensorBoard events with
``--tensorboard``). ``--out DIR``: rank 0 saves the program there (plan.json, report.md,
report.html, code/).

Checkpoints (``partc/runtime/checkpoint.py``): with ``--checkpoint-dir D`` every rank
saves every ``--checkpoint-every N`` steps and after the last (``--keep K``: only the
newest K; ``--async-save``: written in the background while training goes on).
``--resume`` continues from D's latest complete checkpoint when there is one and starts
afresh when there is none, so the same command serves the first launch, a relaunch
after a suspend and torchrun's ``--max-restarts``; the plan is made again for this
launch's world size and pins and the checkpoint resharded into it. The learning rate
and the data are functions of the step, so the resumed run continues as an
uninterrupted one would (the learning rate follows this run's ``--steps``, so resuming
with more steps than the first launch continues a constant schedule exactly and a
cosine one on the new horizon). The checkpoint records ``--seed``, ``--steps``, the
schedule and a digest of the last batch it trained on; a resume whose seed or data
differs is refused. Only with ``--checkpoint-dir`` does the launcher listen for stop
signals (``module.stop_requested()``, once per step on every rank: one small
collective): on SIGTERM or SIGUSR1 every rank finishes its step, saves it and exits with
``partc.runtime.suspend.SUSPEND_EXIT_CODE`` (86). Without a checkpoint directory there
is nothing to save, and a signal ends the job as it would any program.

``--config file.toml`` gives the same settings as a flat TOML table, keys named as the
flags (``max_grad_norm = 1.0`` or ``max-grad-norm = 1.0``; ``target`` too; sizes as
strings, ``memory = "10MiB"``; a repeatable flag as a list, ``stage = ["a,b", "c"]``;
``zero = 1``); each value is read as its flag is, flags given on the command line win
over the file, and an unknown key is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

if sys.version_info >= (3, 11):
    import tomllib
else:   # pragma: no cover - Python 3.10: the same parser, as a package
    import tomli as tomllib

from . import cli
from .choices import OPTIMIZER_STATE_BYTES

# The optimizers by TrainSpec's names (what the planner counts their state as).
OPTIMIZERS = tuple(sorted(OPTIMIZER_STATE_BYTES))
HELD_OUT_STEP = -1
COMMAND = "train"
# The preset a run without a GPU plans for when neither --device nor --profile is given
# (with a GPU: partc's default preset, as for partc plan).
CPU_PRESET = "CPU"

log = logging.getLogger("partc")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything ``partc train`` is told, from flags and the config file."""

    target: str | None = None   # path/to/file.py:factory
    steps: int | None = None
    # The budget, pins and TrainSpec flags, as partc.cli reads them (by argparse dest;
    # absent: not given). The number of devices is the launch's world size.
    plan: dict[str, Any] = field(default_factory=dict)
    time_limit: float = 30.0
    # The optimizer and its learning-rate schedule.
    optimizer: str = "adamw"
    lr: float = 3e-4
    min_lr: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    momentum: float = 0.0   # sgd and sgd-momentum only
    # Evaluation, logging, reproducibility, output.
    eval_every: int = 0     # 0: never
    log_dir: str | None = None
    tensorboard: bool = False
    warn_ratio: float = 0.25
    seed: int = 0
    quiet: bool = False
    out: str | None = None
    # Checkpoints.
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0   # 0: only after the last step (and on a stop signal)
    keep: int | None = None
    resume: bool = False
    async_save: bool = False

    def __post_init__(self) -> None:
        if self.target is None:
            raise ValueError("no target: give path/to/file.py:factory (or target = ... in "
                             "the config file)")
        if self.steps is None:
            raise ValueError("--steps is required (or steps = ... in the config file)")
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        for name in ("warmup_steps", "eval_every", "seed", "checkpoint_every"):
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
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, "
                             f"got {self.optimizer!r}")
        if self.momentum and not self.optimizer.startswith("sgd"):
            raise ValueError(f"momentum is for sgd; {self.optimizer} has its own betas")
        if self.optimizer == "sgd-momentum" and not self.momentum:
            raise ValueError("sgd-momentum needs --momentum above 0")
        if self.tensorboard and self.log_dir is None:
            raise ValueError("tensorboard needs log_dir: events go to <log_dir>/tensorboard")
        if self.keep is not None and self.keep < 1:
            raise ValueError(f"keep must be at least 1, got {self.keep}")
        if self.checkpoint_dir is None:
            given = [name for name, on in (("checkpoint_every", self.checkpoint_every),
                                           ("keep", self.keep is not None),
                                           ("resume", self.resume),
                                           ("async_save", self.async_save)) if on]
            if given:
                flags = [f"--{name.replace('_', '-')}" for name in given]
                raise ValueError(f"{', '.join(flags)} need{'s' if len(flags) == 1 else ''} "
                                 "--checkpoint-dir")

    @property
    def train_optimizer(self) -> str:
        """The optimizer as TrainSpec names it: sgd with momentum keeps a buffer."""
        return "sgd-momentum" if self.optimizer == "sgd" and self.momentum else self.optimizer

    def plan_arguments(self) -> argparse.Namespace:
        """The plan flags as :mod:`partc.cli`'s readers take them (None: not given)."""
        return argparse.Namespace(**{**dict.fromkeys(_plan_dests(), None), **self.plan,
                                     "optimizer": self.train_optimizer})


# -- the command line and the config file -----------------------------------------------------

def parser() -> argparse.ArgumentParser:
    """The flags; each defaults to absent, so that the config file fills what is not given."""
    p = cli._Parser(prog="partc train", description=__doc__.splitlines()[0],
                    argument_default=argparse.SUPPRESS, epilog=cli.UNITS,
                    allow_abbrev=False,   # --devices must not read as --devices-per-node
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", help="path/to/file.py:factory")
    p.add_argument("--config", help="TOML file with these settings (flags win over it)")
    p.add_argument("--steps", type=cli.COUNT, metavar="N", help="optimizer steps to train")
    cli._budget_arguments(p.add_argument_group(
        "devices, as partc plan (the number of devices is the launch's world size)"),
        devices=False)
    cli._pin_arguments(p.add_argument_group("pins (the planner decides what is not pinned)"))
    cli._training_arguments(p.add_argument_group(
        "training (overrides the factory's TrainSpec; --optimizer also picks the torch "
        "optimizer, default adamw)"))
    p.add_argument("--time-limit", type=cli.POSITIVE, metavar="SECONDS",
                   help="seconds for the stage planner's search (default 30)")
    opt = p.add_argument_group("learning rate")
    opt.add_argument("--lr", type=cli.POSITIVE, help="peak learning rate (default 3e-4)")
    opt.add_argument("--min-lr", type=_non_negative, help="learning rate at the last step "
                     "(default 0)")
    opt.add_argument("--warmup-steps", type=_natural, metavar="N",
                     help="linear warm-up steps (default 0)")
    opt.add_argument("--weight-decay", type=_non_negative, help="default 0")
    opt.add_argument("--momentum", type=_non_negative,
                     help="sgd's momentum (default 0; above 0 plans sgd-momentum)")
    run = p.add_argument_group("evaluation, logging and output")
    run.add_argument("--eval-every", type=_natural, metavar="K",
                     help="evaluate the held-out batch every K steps")
    run.add_argument("--log-dir", help="directory for rank<k>.jsonl telemetry")
    run.add_argument("--tensorboard", action="store_true",
                     help="also write TensorBoard events under <log-dir>/tensorboard")
    run.add_argument("--warn-ratio", type=cli.POSITIVE, metavar="RATIO",
                     help="warn when time or memory departs from the plan by more (0.25)")
    run.add_argument("--seed", type=_natural, help="torch seed before the factory (default 0)")
    run.add_argument("--out", metavar="DIR", help="rank 0 saves the program here: plan.json, "
                     "report.md, report.html and the stages' code")
    run.add_argument("-q", "--quiet", action="store_true", help="no report, no progress lines")
    saved = p.add_argument_group("checkpoints")
    saved.add_argument("--checkpoint-dir", metavar="DIR",
                       help="save checkpoints here (every --checkpoint-every steps, after "
                            "the last, and on a stop signal)")
    saved.add_argument("--checkpoint-every", type=_natural, metavar="N",
                       help="save every N steps (default: after the last step only)")
    saved.add_argument("--keep", type=cli.COUNT, metavar="K",
                       help="keep only the newest K checkpoints")
    saved.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in --checkpoint-dir if "
                            "there is one, else start afresh")
    saved.add_argument("--async-save", action="store_true",
                       help="write checkpoints in the background while training goes on")
    return p


def _natural(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number, 0 or more, got {text!r}")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number, 0 or more, got {text!r}")
    return value


_natural.__name__, _non_negative.__name__ = "count", "number"
_PLAN_GROUPS = ("devices, as", "pins", "training")


def _plan_dests() -> tuple[str, ...]:
    """The dests of the flags partc.cli defines for both commands."""
    return tuple(action.dest for group in parser()._action_groups
                 if group.title and group.title.startswith(_PLAN_GROUPS)
                 for action in group._group_actions)


# What a TOML value of a flag may be: the Python types TOML gives, by the flag's type.
_WHOLE = (cli.COUNT, _natural, int)
_REAL = (cli.POSITIVE, cli.FRACTION, cli.SECONDS, _non_negative, float)


def _toml_argv(key: str, value: Any, action: argparse.Action, where: str) -> list[str]:
    """The command-line words that say what ``key = value`` says in the file."""
    flag = next((o for o in action.option_strings
                 if o.startswith("--") and not o.startswith("--no-")), None)

    def wrong(expected: str) -> ValueError:
        return ValueError(f"{where}: {key} must be {expected}, got {value!r}")

    if isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise wrong("bool")
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:   # store_true
        if not isinstance(value, bool):
            raise wrong("bool")
        return [flag] if value else []
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        words = []
        for item in items:
            if isinstance(item, list) and all(isinstance(x, str) for x in item):
                item = ",".join(item)
            if not isinstance(item, str):
                raise wrong("a string or a list of strings")
            words += [flag, item]
        return words
    whole_choices = action.choices is not None and all(isinstance(c, int)
                                                       for c in action.choices)
    if whole_choices or action.type in _WHOLE:
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "int"
    elif action.type in _REAL:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        expected = "a number"
    elif action.type in (cli.SIZES, cli.RATE):
        if isinstance(value, list) and action.type is cli.SIZES:
            value = ",".join(str(v) for v in value)
        ok = isinstance(value, (str, int)) and not isinstance(value, bool)
        expected = "a size such as \"10MiB\"" if action.type is cli.SIZES else \
            "a rate such as \"900GB/s\""
    else:
        ok, expected = isinstance(value, str), "str"
    if not ok:
        raise wrong(expected)
    return [str(value)] if flag is None else [flag, str(value)]


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The settings of a TOML config file (one flat table; keys as the flags, ``-`` or
    ``_``), each read as its flag is: a dict by argparse dest. An unknown key, a value of
    the wrong type or one its flag refuses is a ValueError naming it."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"cannot read config file {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"config file {path} is not valid TOML: {error}") from None
    p = parser()
    actions = {action.dest: action for action in p._actions
               if action.dest not in ("help", "config")}
    words: list[str] = []
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        if key not in actions:
            raise ValueError(f"config file {path}: unknown key {raw_key!r}; known keys: "
                             f"{', '.join(sorted(actions))}")
        said = _toml_argv(key, value, actions[key], f"config file {path}")
        words = said + words if key == "target" else words + said
    try:
        return vars(p.parse_args(words))
    except cli.UsageError as error:
        said = str(error).split("error: ", 1)[-1].rsplit(" (see ", 1)[0]
        raise ValueError(f"config file {path}: {said}") from None


def _exclusive_with(p: argparse.ArgumentParser, given: dict[str, Any]) -> set[str]:
    """The dests a flag in ``given`` excludes (its mutually exclusive group's others)."""
    out = set()
    for group in p._mutually_exclusive_groups:
        dests = {action.dest for action in group._group_actions}
        if dests & given.keys():
            out |= dests - given.keys()
    return out


def parse_config(argv: list[str]) -> TrainConfig:
    """Flags over the config file over the defaults."""
    p = parser()
    if any(word == "--devices" or word.startswith("--devices=") for word in argv):
        raise cli._refused("no --devices here: the number of devices is the launch's world "
                           "size (torchrun --nproc-per-node, --nnodes)", COMMAND)
    given = vars(p.parse_args(argv))
    from_file = read_config_file(given.pop("config")) if "config" in given else {}
    for dest in _exclusive_with(p, given):   # --recompute on the command line wins over
        from_file.pop(dest, None)            # recompute_layer in the file, and so on
    settings = {**from_file, **given}
    plan_dests = set(_plan_dests())
    # --optimizer is a TrainSpec flag that also picks the torch optimizer: a field here.
    plan = {k: settings.pop(k) for k in list(settings) if k in plan_dests and k != "optimizer"}
    return TrainConfig(**settings, plan=plan)


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


def _optimizer(module: Any, config: TrainConfig) -> Any:
    import torch

    if config.optimizer.startswith("sgd"):
        return module.optimizer(torch.optim.SGD, lr=config.lr, momentum=config.momentum,
                                weight_decay=config.weight_decay)
    cls = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    return module.optimizer(cls, lr=config.lr, weight_decay=config.weight_decay)


def check(config: TrainConfig, world_size: int) -> tuple[Any, Any]:
    """What can be checked before the model is built, as ``partc plan`` checks it: the
    factory's file, the flags together, the budget and the pins. Returns ``(budget,
    constraints)``; raises :class:`partc.cli.UsageError` or ValueError naming the
    problem."""
    args = config.plan_arguments()
    cli.check_flags(args, world_size, COMMAND)
    cli.check_target(config.target, COMMAND)
    if config.out is not None and Path(config.out).exists() and not Path(config.out).is_dir():
        raise cli._refused(f"--out {config.out} is a file, not a directory", COMMAND)
    fixed: dict[str, Any] = {"num_devices": world_size}
    if args.device is None and args.profile is None and not _has_gpu():
        fixed["device"] = CPU_PRESET   # plan for the devices that train
    return cli._budget(args, **fixed), cli._constraints(args)


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def compile_workload(config: TrainConfig, workload: dict[str, Any], world_size: int, *,
                     checked: tuple[Any, Any] | None = None) -> Any:
    """The Program for ``workload`` on ``world_size`` devices as ``config`` says (the
    budget and constraints :func:`check` gave, or made again)."""
    from .compiler import compile
    from .options import PlannerOptions

    budget, constraints = checked or check(config, world_size)
    return compile(workload["model"], workload["example_inputs"], budget=budget,
                   train=cli._train(config.plan_arguments(), workload),
                   loss_fn=workload.get("loss_fn"),
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
    """Check, seed, make the workload, compile, build this rank's module, turn its
    telemetry on and make the optimizer: ``(module, optimizer, telemetry, workload)``.
    Under torchrun (or as one process). Rank 0 prints the report and, with ``out``,
    saves the program."""
    import torch

    from .runtime.topology import world_size_from_env

    world = world_size_from_env()
    checked = check(config, world)   # before the model is built
    torch.manual_seed(config.seed)   # every rank builds the same initial weights
    workload = cli.load_factory(config.target)
    if not callable(workload.get("data")):
        raise ValueError(f"{config.target} must return a dict with a 'data' key: a callable "
                         "data(step) -> (inputs, target) giving the global batch of a step")
    program = compile_workload(config, workload, world, checked=checked)
    module = program.build()
    if module.topology.rank == 0:
        if not config.quiet:
            print(program.report(), flush=True)
        if config.out is not None:
            out = program.save(config.out)
            (out / "report.html").write_text(program.report("html"))
            print(f"program saved to {out} (plan.json, report.md, report.html, code/)",
                  flush=True)
    telemetry = module.telemetry(jsonl_dir=config.log_dir, console=not config.quiet,
                                 tensorboard_dir=(Path(config.log_dir) / "tensorboard"
                                                  if config.tensorboard else None),
                                 warn_ratio=config.warn_ratio)
    return module, _optimizer(module, config), telemetry, workload


# -- checkpoints ------------------------------------------------------------------------------

def data_digest(workload: dict[str, Any], step: int) -> str:
    """A digest of ``data(step)``'s batch (shapes, dtypes and bytes): a resumed run whose
    data differs from the checkpoint's reads another batch at the checkpoint's last step."""
    import torch

    digest = hashlib.sha256()
    inputs, target = _batch(workload["data"](step), f"data({step})")
    for value in (*inputs, target):
        if isinstance(value, torch.Tensor):
            flat = value.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def _record(config: TrainConfig, workload: dict[str, Any], step: int) -> dict[str, Any]:
    """What a checkpoint of ``step`` keeps of the launcher's settings (its ``extra``)."""
    return {"launcher": {"seed": config.seed, "steps": config.steps,
                         "lr": config.lr, "min_lr": config.min_lr,
                         "warmup_steps": config.warmup_steps, "target": config.target,
                         "data": {"step": step - 1, "sha256": data_digest(workload, step - 1)}}}


def check_resume(extra: dict[str, Any], config: TrainConfig, workload: dict[str, Any],
                 step: int, where: Any) -> None:
    """Refuse to continue a checkpoint whose data order this run would not follow: another
    seed, or another batch at the checkpoint's last step. Another ``steps`` (or schedule)
    is allowed and logged: the learning rate from here follows this run's."""
    saved = extra.get("launcher")
    if saved is None:
        raise ValueError(f"the checkpoint at {where} was not written by partc train (its "
                         "extra has no 'launcher' record): resume it with the program that "
                         "wrote it")
    if saved["seed"] != config.seed:
        raise ValueError(f"the checkpoint at {where} was trained with --seed "
                         f"{saved['seed']}, this run has --seed {config.seed}: resume with "
                         f"--seed {saved['seed']}")
    if step > 0 and data_digest(workload, saved["data"]["step"]) != saved["data"]["sha256"]:
        raise ValueError(f"the checkpoint at {where} read another batch at step "
                         f"{saved['data']['step'] + 1} than data({saved['data']['step']}) "
                         f"of {config.target} gives now: its data order differs (another "
                         "data set, batch size or factory argument); resume with the data "
                         "it was trained on")
    schedule = ("steps", "lr", "min_lr", "warmup_steps")
    changed = [f"{k} {saved[k]} -> {getattr(config, k)}" for k in schedule
               if saved[k] != getattr(config, k)]
    if changed:
        log.info("resuming with another schedule (%s): the learning rate from step %d "
                 "follows this run's", ", ".join(changed), step + 1)


class _Checkpoints:
    """``after_step`` for :func:`train`: saves every ``checkpoint_every`` steps and after
    the last, and on a stop signal saves the step and asks training to stop."""

    def __init__(self, module: Any, optimizer: Any, workload: dict[str, Any],
                 config: TrainConfig) -> None:
        self.module, self.optimizer, self.workload = module, optimizer, workload
        self.config = config
        self.directory = Path(config.checkpoint_dir)
        self.stopped = False

    def save(self, step: int, *, async_save: bool) -> None:
        path = self.module.save_checkpoint(
            self.directory, optimizer=self.optimizer, step=step,
            extra=_record(self.config, self.workload, step), async_save=async_save,
            keep=self.config.keep)
        if self.module.topology.rank == 0 and not self.config.quiet:
            print(f"checkpoint: step {step} {'saving' if async_save else 'saved'} to {path}",
                  flush=True)

    def __call__(self, done: int) -> bool:
        if self.module.stop_requested():   # every rank, the same step
            self.save(done, async_save=False)
            self.stopped = True
            return True
        every = self.config.checkpoint_every
        if done == self.config.steps or (every and done % every == 0):
            self.save(done, async_save=self.config.async_save)
        return False


@dataclass
class Outcome:
    """What :func:`execute` did: the exit status, the first step trained (0-based: the
    resumed checkpoint's step) and the steps' losses."""

    status: int
    start_step: int
    losses: list[float]


def execute(config: TrainConfig) -> Outcome:
    """Prepare, resume if asked, train with checkpoints; the process group stays (:func:`run`
    leaves it). ``status`` is 0, or SUSPEND_EXIT_CODE when a stop signal ended training
    after saving its step."""
    from .runtime import checkpoint
    from .runtime.suspend import SUSPEND_EXIT_CODE

    module, optimizer, telemetry, workload = prepare(config)
    try:
        start = 0
        saver = None
        if config.checkpoint_dir is not None:
            saver = _Checkpoints(module, optimizer, workload, config)
            found = checkpoint.latest(config.checkpoint_dir) if config.resume else None
            if found is not None:
                # Checked before any tensor is read (every rank reads the same manifest).
                manifest = checkpoint.read_manifest(found)
                check_resume(manifest["extra"], config, workload, manifest["step"], found)
                start, _ = module.load_checkpoint(found, optimizer=optimizer)
                if module.topology.rank == 0 and not config.quiet:
                    print(f"resumed from {found} at step {start} on "
                          f"{module.topology.world_size} processes", flush=True)
            # Installs the signal handlers before the first step; a signal during the
            # build stops here, with nothing new to save.
            if module.stop_requested():
                return Outcome(SUSPEND_EXIT_CODE, start, [])
        if start >= config.steps and module.topology.rank == 0:
            print(f"nothing to train: the checkpoint is at step {start}, --steps is "
                  f"{config.steps}", flush=True)
        losses = train(module, optimizer, workload, config, telemetry=telemetry,
                       start_step=start, after_step=saver)
        if saver is not None:
            module.wait_checkpoint()   # an asynchronous save under way ends before exit
            if saver.stopped:
                if module.topology.rank == 0:
                    print(f"stopped on a signal at step {start + len(losses)}, saved; "
                          f"exiting with {SUSPEND_EXIT_CODE}", flush=True)
                return Outcome(SUSPEND_EXIT_CODE, start, losses)
        return Outcome(0, start, losses)
    finally:
        module.close()


def run(config: TrainConfig) -> int:
    """:func:`execute`, then leave the process group; returns the exit status."""
    import torch.distributed as dist

    outcome = execute(config)
    if outcome.status == 0:
        dist.barrier()
    dist.destroy_process_group()
    return outcome.status


def main(argv: list[str]) -> int:
    """``partc train ...``: returns the exit status (2 for bad input, named)."""
    from .errors import PartcError

    try:
        config = parse_config(argv)
    except cli.UsageError as error:   # a bad flag, one line naming it
        print(error, file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"partc train: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:   # argparse: --help (0)
        return exit_.code if isinstance(exit_.code, int) else 2
    logging.basicConfig(level=logging.WARNING if config.quiet else logging.INFO,
                        format="partc: %(message)s", stream=sys.stderr)
    try:
        return run(config)
    except cli.UsageError as error:
        print(error, file=sys.stderr)
        return 2
    except PartcError as error:
        print(f"partc train: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"partc train: invalid input: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
