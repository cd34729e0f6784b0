"""What ``partc train`` is told: its flags, its TOML config file, and the settings
they make (:class:`TrainConfig`), with the learning rate of each step.

The budget, pin and training flags are :mod:`partc.cli.main`'s, so that ``partc plan`` and
``partc train`` take the same names, read the same way; a config file's keys are the
flags' names and each value is read as its flag is (see :mod:`partc.cli.launcher`).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:   # pragma: no cover - Python 3.10: the same parser, as a package
    import tomli as tomllib

from partc.cli import main as cli
from partc.cli.choices import OPTIMIZER_STATE_BYTES, TOKEN_DTYPES
from partc.device.presets import DEFAULT_DEVICE
from partc.options import PlannerOptions

DESCRIPTION = "compile a model, build this rank's part and train it, with telemetry"
# The preset a run without a GPU plans for when neither --device nor --profile is given
# (with a GPU: partc's default preset, as for partc plan).
CPU_PRESET = "CPU"
# The flags --help shows (every flag parses; --help-all shows them all).
COMMON = (cli.PLAN_COMMON - {"--devices", "--report"}) | {
    "--config", "--steps", "--nproc-per-node", "--lr", "--warmup-steps", "--max-grad-norm",
    "--eval-every", "--log-dir", "--seed", "--checkpoint-dir", "--checkpoint-every",
    "--resume"}
EXAMPLES = """\
examples:
  partc train samples/gpt.py:factory --nproc-per-node 2 --memory 10MiB --steps 8 --lr 3e-3
  torchrun --standalone --nproc-per-node=2 -m partc train samples/gpt.py:factory \\
      --memory 10MiB --steps 8 --checkpoint-dir out/ckpt --checkpoint-every 4 --resume
  partc train samples/gpt.py:factory --nproc-per-node 2 --config train.toml --steps 100

Run it under torchrun, or give --nproc-per-node to start the processes on this machine.
Sizes take a unit: 40GiB (binary) or 40GB (decimal). --help-all: every flag, with each
cost-model figure of the device that a flag overrides."""
# The optimizers by TrainSpec's names (what the planner counts their state as).
OPTIMIZERS = tuple(sorted(OPTIMIZER_STATE_BYTES))
COMMAND = "train"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything ``partc train`` is told, from flags and the config file."""

    target: str | None = None   # path/to/file.py:factory, or a Hugging Face config
    hf_config: list[str] | None = None   # KEY=VALUE overrides of that config
    seq_len: int | None = None           # its example batch's tokens per sample
    steps: int | None = None
    # The budget, pins and TrainSpec flags, as partc.cli.main reads them (by argparse dest;
    # absent: not given). The number of devices is the launch's world size.
    plan: dict[str, Any] = field(default_factory=dict)
    work_limit: float = PlannerOptions().work_limit
    # The optimizer and its learning-rate schedule.
    optimizer: str = "adamw"
    lr: float = 3e-4
    min_lr: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    momentum: float = 0.0   # sgd and sgd-momentum only
    # The data from a file (partc.corpus) instead of the factory's data(step).
    data: str | None = None
    data_dtype: str | None = None   # a .bin token file's; uint16 when not given
    tokenizer: str | None = None    # a Hugging Face tokenizer's directory, for text
    eval_data: str | None = None    # the held-out batch's file, in --data's forms
    # Evaluation, logging, reproducibility, output.
    eval_every: int = 0     # 0: never
    log_dir: str | None = None
    tensorboard: bool = False
    wandb: str | None = None   # a Weights & Biases project rank 0 logs to
    warn_ratio: float = 0.25
    seed: int = 0
    quiet: bool = False
    out: str | None = None
    # Plan with this machine's CPU measured once and kept (partc/calibrate/cached_profile.py).
    calibrate: bool = False
    # Checkpoints.
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0   # 0: only after the last step (and on a stop signal)
    keep: int | None = None
    resume: bool = False
    async_save: bool = False
    # Launch: processes to start on this machine (partc.cli.standalone); None: as started.
    nproc_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.target is None:
            raise ValueError("no target: give path/to/file.py:factory or a Hugging Face "
                             "config (or target = ... in the config file)")
        if self.steps is None:
            raise ValueError("--steps is required (or steps = ... in the config file)")
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        for name in ("warmup_steps", "eval_every", "seed", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")
        for name in ("lr", "warn_ratio", "work_limit"):
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
        if self.data is None:
            given = [f"--{name.replace('_', '-')}" for name in ("data_dtype", "tokenizer",
                                                               "eval_data")
                     if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} "
                                 "--data")
        if self.data_dtype is not None and self.data_dtype not in TOKEN_DTYPES:
            raise ValueError(f"data_dtype must be one of {', '.join(TOKEN_DTYPES)}, got "
                             f"{self.data_dtype!r}")
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
        """The plan flags as :mod:`partc.cli.main`'s readers take them (None: not given)."""
        return argparse.Namespace(**{**dict.fromkeys(_plan_dests(), None), **self.plan,
                                     "optimizer": self.train_optimizer})


# -- the command line and the config file -----------------------------------------------------

def parser(*, full: bool = False) -> argparse.ArgumentParser:
    """The flags; each defaults to absent, so that the config file fills what is not given.
    ``--help`` shows the common ones (:data:`COMMON`) unless ``full``."""
    p = cli._Parser(prog="partc train", description=DESCRIPTION,
                    argument_default=argparse.SUPPRESS,
                    epilog=cli.UNITS if full else EXAMPLES,
                    allow_abbrev=False,   # --devices must not read as --devices-per-node
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", help=cli.TARGET_HELP)
    p.add_argument("--config", help="TOML file with these settings (flags win over it)")
    p.add_argument("--steps", type=cli.COUNT, metavar="N", help="optimizer steps to train")
    p.add_argument("--nproc-per-node", type=cli.COUNT, metavar="N",
                   help="start N processes on this machine, as torchrun --standalone; a "
                        "failure ends with the failing rank's line and exit status")
    cli._config_arguments(p.add_argument_group("a model by Hugging Face config"))
    cli._budget_arguments(p.add_argument_group(
        "devices, as partc plan (the number of devices is the launch's world size)"),
        devices=False, default_device=f"default {CPU_PRESET} where torch sees no GPU, else "
                                      f"{DEFAULT_DEVICE}; or the profile's")
    cli._pin_arguments(p.add_argument_group("pins (the planner decides what is not pinned)"))
    cli._training_arguments(p.add_argument_group(
        "training (overrides the factory's TrainSpec; --optimizer also picks the torch "
        "optimizer, default adamw)"))
    p.add_argument("--work-limit", type=cli.POSITIVE, metavar="WORK",
                   help=cli.WORK_LIMIT_HELP)
    opt = p.add_argument_group("learning rate")
    opt.add_argument("--lr", type=cli.POSITIVE, help="peak learning rate (default 3e-4)")
    opt.add_argument("--min-lr", type=cli.NON_NEGATIVE, help="learning rate at the last step "
                     "(default 0)")
    opt.add_argument("--warmup-steps", type=cli.WHOLE, metavar="N",
                     help="linear warm-up steps (default 0)")
    opt.add_argument("--weight-decay", type=cli.NON_NEGATIVE, help="default 0")
    opt.add_argument("--momentum", type=cli.NON_NEGATIVE,
                     help="sgd's momentum (default 0; above 0 plans sgd-momentum)")
    data = p.add_argument_group(
        "data from a file, instead of the factory's data(step) (packed into sequences of "
        "the example inputs' length; each step's samples fixed by --seed and the step)")
    data.add_argument("--data", metavar="PATH",
                      help="a token file (.bin: flat ids, nanoGPT's; .npy), a UTF-8 text "
                           "file, or a directory a datasets data set was saved to")
    data.add_argument("--data-dtype", choices=TOKEN_DTYPES,
                      help="a .bin token file's id type (default uint16)")
    data.add_argument("--tokenizer", metavar="DIR",
                      help="a Hugging Face tokenizer saved in DIR, for text (default: "
                           "byte-level, 256 ids)")
    data.add_argument("--eval-data", metavar="PATH",
                      help="held-out data in --data's forms: --eval-every evaluates its "
                           "first global batch")
    run = p.add_argument_group("evaluation, logging and output")
    run.add_argument("--eval-every", type=cli.WHOLE, metavar="K",
                     help="evaluate the held-out batch every K steps")
    run.add_argument("--log-dir", metavar="DIR", help="directory for rank<k>.jsonl telemetry")
    run.add_argument("--tensorboard", action="store_true",
                     help="also write TensorBoard events under <log-dir>/tensorboard")
    run.add_argument("--wandb", metavar="PROJECT",
                     help="also log rank 0's figures to Weights & Biases project PROJECT "
                          "(needs the wandb package; WANDB_MODE=offline keeps it local)")
    run.add_argument("--warn-ratio", type=cli.POSITIVE, metavar="RATIO",
                     help="warn when time or memory departs from the plan by more (0.25)")
    run.add_argument("--seed", type=cli.WHOLE, help="torch seed before the factory (default 0)")
    run.add_argument("--out", metavar="DIR", help="rank 0 saves the program here: plan.json, "
                     "report.md, report.html and the stages' code")
    run.add_argument("-q", "--quiet", action="store_true", help="no report, no progress lines")
    run.add_argument("--calibrate", action="store_true",
                     help="on CPU: plan with this machine's own figures, measured by a quick "
                          "partc calibrate the first time (about a minute) and kept under "
                          "$PARTC_CACHE_DIR or ~/.cache/partc")
    saved = p.add_argument_group("checkpoints")
    saved.add_argument("--checkpoint-dir", metavar="DIR",
                       help="save checkpoints here (every --checkpoint-every steps, after "
                            "the last, and on a stop signal)")
    saved.add_argument("--checkpoint-every", type=cli.WHOLE, metavar="N",
                       help="save every N steps (default: after the last step only)")
    saved.add_argument("--keep", type=cli.COUNT, metavar="K",
                       help="keep only the newest K checkpoints")
    saved.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in --checkpoint-dir if "
                            "there is one, else start afresh")
    saved.add_argument("--async-save", action="store_true",
                       help="write checkpoints in the background while training goes on")
    if full:
        return p
    p.usage = "%(prog)s TARGET --steps N [--nproc-per-node N] [flags]"
    return cli.shorten(p, COMMON, lambda: parser(full=True))


_PLAN_GROUPS = ("devices, as", "pins", "training")


def _plan_dests() -> tuple[str, ...]:
    """The dests of the flags partc.cli.main defines for both commands."""
    return tuple(action.dest for group in parser()._action_groups
                 if group.title and group.title.startswith(_PLAN_GROUPS)
                 for action in group._group_actions)


# What a TOML value of a flag may be: the Python types TOML gives, by the flag's type.
_WHOLE = (cli.COUNT, cli.WHOLE, int)
_REAL = (cli.POSITIVE, cli.FRACTION, cli.SECONDS, cli.NON_NEGATIVE, float)


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
               if action.dest not in ("help", "config", argparse.SUPPRESS)}
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
