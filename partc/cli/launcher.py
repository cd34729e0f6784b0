"""``partc train``: compile a model, build this rank's part and train it, with telemetry
and checkpoints.

    torchrun --standalone --nproc-per-node=2 -m partc train samples/gpt.py:factory \\
        --steps 20 --memory 10MiB --checkpoint-dir out/ckpt --resume
    torchrun --standalone --nproc-per-node=2 -m partc.cli.launcher samples/gpt.py:factory \\
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

Or the data comes from a file (``partc/corpus/``): ``--data PATH``, a token file
(``.bin``, flat uint16 ids as nanoGPT writes them, or uint32 with ``--data-dtype``;
``.npy``), a UTF-8 text file or a directory a ``datasets`` data set was saved to, the
last two tokenized by ``--tokenizer DIR`` (a Hugging Face tokenizer saved there) or the
byte-level tokenizer (256 ids). Its ids are packed into samples of the factory's example
inputs' sequence length (inputs and next-token targets); step ``s`` reads the samples
``partc.runtime.data.DataSampler`` gives for ``(--seed, s)``, and each rank only its
data-parallel replica's rows of them (``rank_data(step)``, beside the global
``data(step)``). ``--eval-data PATH``: the held-out batch is that file's first. The
factory then needs no ``data``.

The budget, pin and training flags are ``partc plan``'s (:mod:`partc.cli.main` builds both
commands' flags, checks them before the model is built and reads them into the
DeviceBudget, Constraints and TrainSpec), except ``--devices``: the number of devices is
the launch's world size, and without ``--device`` or ``--profile`` a run on a machine
whose torch sees no GPU plans for the ``CPU`` preset. Every rank seeds torch with
``--seed`` before calling the factory, so that every rank builds the same initial weights,
then compiles (the planner is deterministic and ranks compare plan hashes), builds, and
trains ``--steps`` optimizer steps: the learning rate rises linearly over
``--warmup-steps`` to ``--lr``, then falls on a cosine to ``--min-lr`` at the end;
gradients are clipped to ``--max-grad-norm`` (planned, as ``TrainSpec.max_grad_norm``); a
step whose loss or gradient norm is inf or NaN raises ``partc.NonFiniteError`` naming it
before the optimizer steps (the run ends, its last checkpoint finite), or with
``--on-nonfinite skip`` is skipped, logged and counted (``TrainSpec.on_nonfinite``);
telemetry (``partc/runtime/telemetry.py``) prints a line per step on rank 0 and, with
``--log-dir``, writes JSON lines per rank (and TensorBoard events with ``--tensorboard``;
``--wandb PROJECT``: rank 0 logs the same figures to Weights & Biases).
``--out DIR``: rank 0 saves the program there (plan.json, report.md, report.html, code/).
With more than one rank the watchdog (``partc/runtime/watchdog.py``) also watches every
``data(step)`` call and every checkpoint save and load, each against a limit of its own
(``PARTC_WATCHDOG_DATA_S``, ``PARTC_WATCHDOG_SAVE_S``, ``PARTC_WATCHDOG_LOAD_S``; by
default 0.9 of the collective timeout ``PARTC_TIMEOUT_S``): a rank that stays there while
the others wait for it is named on every rank (``rank 1 spent 540.2 s in data(step=12)
while other ranks waited for it``) and the job ends with exit code 75, not at the
collective timeout with no rank named.

Checkpoints (``partc/runtime/checkpoint.py``): with ``--checkpoint-dir D`` every rank
saves every ``--checkpoint-every N`` steps and after the last (``--keep K``: only the
newest K, and the newest whose state is finite; ``--async-save``: written in the
background while training goes on).
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

The checkpoint directory is checked at start-up, before the model is built: every rank
checks it is writable, and rank 0 takes its lock (``D/.lock``, naming its host and pid:
partc/runtime/checkpoint_lock.py), released when the run ends; a second job on the
same directory is refused, naming the holder. Without ``D/latest``, ``--resume``
continues from the newest complete ``step-*`` with a warning, and refuses to start
afresh over step directories none of which is complete.

``--config file.toml`` gives the same settings as a flat TOML table, keys named as the
flags (``max_grad_norm = 1.0`` or ``max-grad-norm = 1.0``; ``target`` too; sizes as
strings, ``memory = "10MiB"``; a repeatable flag as a list, ``stage = ["a,b", "c"]``;
``zero = 1``); each value is read as its flag is, flags given on the command line win
over the file, and an unknown key is refused.

A failure ends the run with one line on stderr, from the first rank to fail, and an exit
status that says what kind of failure it was (partc/cli/failures.py: 2 bad input, 3 no
plan, 4 plan mismatch, 5 non-finite, 6 checkpoint, 75 hang, 1 a bug); what the factory
or its ``data`` raise is a ``partc.FactoryError`` naming the step and the line.
``--nproc-per-node N`` starts N processes on this machine itself (partc/cli/standalone.py),
so that the failing rank's line and status end the run, not torchrun's report.
``--resume`` with the checkpoint already at ``--steps`` says so from its manifest, before
torch loads.

The command line imports this module only when ``partc train`` runs, and this module
imports torch, the compiler and the runtime inside the functions that use them: reading
the flags and the config file, and refusing a mistake in them, happen before torch
loads (about two seconds).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from partc.cli import failures
from partc.cli import main as cli
from partc.cli.config import (COMMAND, CPU_PRESET, TrainConfig, learning_rate,
                              parse_config)
from partc.errors import FactoryError, PartcError
from partc.runtime import checkpoint_lock

HELD_OUT_STEP = -1
# The CUDA caching allocator's settings a run takes unless PYTORCH_CUDA_ALLOC_CONF gives
# others: expandable segments, whose blocks grow one mapped range instead of leaving the
# free pieces of fixed segments between them. Without them, gpu_check's cases on an H200
# reserved 16% more than they allocated at the step's peak, with no memory pressure; the
# plan keeps 5% back (DeviceBudget.memory_fragmentation). Read where CUDA starts, so it
# is set before torch loads; the ranks partc starts inherit it. A user's own settings,
# under any of the names torch reads (torch reads PYTORCH_CUDA_ALLOC_CONF before
# PYTORCH_ALLOC_CONF, torchtitan's name), are left alone.
ALLOCATOR_SETTINGS = "expandable_segments:True"
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")

log = logging.getLogger("partc")


# -- the run ---------------------------------------------------------------------------------

def called(function: Callable[..., Any], what: str, *args: Any) -> Any:
    """``function(*args)``, the user's code (``what`` names it: ``data(3) of
    file.py:factory``); what it raises becomes a FactoryError naming it, the exception and
    the line it came from."""
    try:
        return function(*args)
    except (PartcError, cli.UsageError):
        raise
    except Exception as error:
        raise FactoryError(f"{what} raised {type(error).__name__}{_where(error)}: "
                           f"{error}") from error


def _where(error: BaseException) -> str:
    """`` at file.py:line``: the innermost frame of the user's own code that ``error``
    passed through (not partc's, the standard library's or an installed package's)."""
    others = (str(Path(__file__).parents[1]), str(Path(os.__file__).parent), "site-packages")
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if not any(o in f.filename for o in others)] or frames[-1:]
    return f" at {Path(own[-1].filename).name}:{own[-1].lineno}" if own else ""


def _batch(made: Any, what: str) -> tuple[tuple, Any]:
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        raise FactoryError(f"{what} must return (inputs, target), got {type(made).__name__}")
    inputs, target = made
    return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), target


def data_batch(workload: dict[str, Any], step: int, *,
               rows: bool = False) -> tuple[tuple, Any]:
    """The global batch of ``step``, from the factory's ``data``; with ``rows``, this
    rank's replica's rows of it (``rank_data``, what ``--data`` feeds)."""
    key = "rank_data" if rows else "data"
    what = f"{key}({step}) of {workload.get('target', 'the factory')}"
    return _batch(called(workload[key], what, step), what)


def check_data_batch(workload: dict[str, Any], global_batch: int | None) -> None:
    """Refuse ``--global-batch`` where the factory's ``data`` gives another number of
    samples a step (it makes its own batches: the plan would refuse every one of them)."""
    if global_batch is None:
        return
    from torch.utils._pytree import tree_leaves

    inputs, target = data_batch(workload, 0)
    first = next((t for t in tree_leaves((inputs, target)) if getattr(t, "ndim", 0) > 0),
                 None)
    if first is not None and first.shape[0] != global_batch:
        raise FactoryError(f"--global-batch {global_batch}, but data(0) of "
                           f"{workload.get('target', 'the factory')} gives "
                           f"{first.shape[0]} samples a step: the factory's data makes the "
                           f"batches, so give it {global_batch} samples, drop the flag, or "
                           "train on a file (--data PATH)")


def _held_out(workload: dict[str, Any]) -> tuple[tuple, Any]:
    source = workload.get("eval_data")
    if source is None:
        return data_batch(workload, HELD_OUT_STEP)
    what = f"eval_data of {workload.get('target', 'the factory')}"
    return _batch(called(source, what) if callable(source) else source, what)


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
    constraints)``; raises :class:`partc.cli.main.UsageError` or ValueError naming the
    problem."""
    args = config.plan_arguments()
    cli.check_flags(args, world_size, COMMAND)
    cli.check_target(config.target, COMMAND)
    if config.out is not None and Path(config.out).exists() and not Path(config.out).is_dir():
        raise cli._refused(f"--out {config.out} is a file, not a directory", COMMAND)
    for flag, path in (("--data", config.data), ("--eval-data", config.eval_data),
                       ("--tokenizer", config.tokenizer)):
        if path is not None and not Path(path).exists():
            raise cli._refused(f"{flag} {path} does not exist", COMMAND)
    fixed: dict[str, Any] = {"num_devices": world_size}
    if config.calibrate:
        fixed["profile"] = str(_calibrated(args, world_size))
    elif args.device is None and args.profile is None and not _has_gpu():
        fixed["device"] = CPU_PRESET   # plan for the devices that train
    return cli._budget(args, **fixed), cli._constraints(args)


def _calibrated(args: Any, world_size: int) -> Path:
    """This machine's kept CPU profile for the launch's ranks on a node, measured by the
    node's local rank 0 if there is none yet (``--calibrate``)."""
    from partc.calibrate.cached_profile import cpu_profile

    if args.device is not None or args.profile is not None:
        raise cli._refused("--calibrate measures this machine's CPU: give it without "
                           "--device and --profile", COMMAND)
    if _has_gpu():
        raise cli._refused("--calibrate measures a CPU; on GPUs run partc calibrate "
                           "--device cuda --out profile.json once, then --profile "
                           "profile.json", COMMAND)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return cpu_profile(ranks, measure=int(os.environ.get("LOCAL_RANK", "0")) == 0)


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def compile_workload(config: TrainConfig, workload: dict[str, Any], world_size: int, *,
                     checked: tuple[Any, Any] | None = None) -> Any:
    """The Program for ``workload`` on ``world_size`` devices as ``config`` says (the
    budget and constraints :func:`check` gave, or made again)."""
    from partc.compiler import compile
    from partc.options import PlannerOptions

    budget, constraints = checked or check(config, world_size)
    return compile(workload["model"], workload["example_inputs"], budget=budget,
                   train=cli._train(config.plan_arguments(), workload, budget.device_type),
                   loss_fn=workload.get("loss_fn"),
                   example_target=workload.get("example_target"), constraints=constraints,
                   name=workload.get("name"),
                   options=PlannerOptions(work_limit=config.work_limit))


def train(module: Any, optimizer: Any, workload: dict[str, Any], config: TrainConfig, *,
          telemetry: Any = None, start_step: int = 0,
          after_step: Callable[[int], bool | None] | None = None) -> list[float]:
    """Steps ``start_step`` .. ``config.steps - 1``; returns their losses.

    ``after_step(n)`` runs on every rank after the n-th optimizer step (n counts from 1)
    and its evaluation: where a checkpoint is written; returning True stops training
    there (a requested stop). Resuming is loading the checkpoint and passing its step as
    ``start_step``: the learning rate and the data are functions of the step."""
    held_out = None
    if config.eval_every:
        with module.watch_data(HELD_OUT_STEP):
            held_out = _held_out(workload)
    losses = []
    for step in range(start_step, config.steps):
        lr = learning_rate(step, config)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with module.watch_data(step):   # the watchdog names a rank stuck here
            inputs, target = data_batch(workload, step, rows="rank_data" in workload)
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

    from partc.runtime.topology import world_size_from_env

    world = world_size_from_env()
    checked = check(config, world)   # before the model is built
    torch.manual_seed(config.seed)   # every rank builds the same initial weights
    workload = called(cli.load_model, config.target, config.target, argparse.Namespace(
        hf_config=config.hf_config, seq_len=config.seq_len,
        global_batch=config.plan.get("global_batch")))
    files = open_data(config, workload)   # before the plan: a bad file fails fast
    if files is None and not callable(workload.get("data")):
        raise FactoryError(f"{config.target} must return a dict with a 'data' key: a "
                           "callable data(step) -> (inputs, target) giving the global batch "
                           "of a step (or train on a file: --data PATH)")
    workload = {**workload, "target": config.target}   # what its errors name
    if files is None:
        check_data_batch(workload, config.plan.get("global_batch"))
    program = compile_workload(config, workload, world, checked=checked)
    module = program.build()
    if files is not None:
        feed(workload, files, config, global_batch_size=module.global_batch_size,
             dp=module.topology.dp, dp_rank=module.topology.dp_rank)
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
                                 warn_ratio=config.warn_ratio,
                                 wandb=_wandb_settings(config, module))
    return module, _optimizer(module, config), telemetry, workload


def _wandb_settings(config: TrainConfig, module: Any) -> dict[str, Any] | None:
    """``wandb.init``'s arguments for ``--wandb PROJECT``: the run's flags and mesh as its
    config, its files beside the telemetry's when there is a log directory."""
    if config.wandb is None:
        return None
    flags = {k: v for k, v in vars(config).items()
             if isinstance(v, (bool, int, float, str)) and k != "wandb"}
    mesh = module.plan.mesh
    return {"project": config.wandb, "dir": config.log_dir,
            "config": {**flags, **config.plan, "pp": mesh.pp, "dp": mesh.dp, "tp": mesh.tp,
                       "global_batch_size": module.global_batch_size}}


# -- data from a file ------------------------------------------------------------------------

@dataclass(frozen=True)
class DataFiles:
    """What ``--data`` and ``--eval-data`` opened (partc.corpus), the model's
    vocabulary that every batch is checked against (None: no embedding to check), and
    how a batch is handed to the model (``partc.corpus.model_batch``)."""

    corpus: Any
    held_out: Any
    vocab_size: int | None
    form: Callable[[Any, Any], tuple[Any, Any]]


def open_data(config: TrainConfig, workload: dict[str, Any]) -> DataFiles | None:
    """``--data`` (and ``--eval-data``) packed into sequences of the factory's example
    inputs' length; None without ``--data``. Raises :class:`partc.DataError` naming the
    file (or the flags) before the model is planned."""
    if config.data is None:
        return None
    from partc.corpus import model_batch, model_vocab_size, open_corpus, sequence_length
    from partc.errors import DataError

    if config.eval_every and config.eval_data is None and "eval_data" not in workload:
        raise DataError(f"--eval-every with --data evaluates a held-out batch: give "
                        f"--eval-data PATH (or an 'eval_data' from {config.target})")
    seq_len = sequence_length(workload["example_inputs"], config.target)
    form = model_batch(workload["example_inputs"], config.target,
                       loss_fn=workload.get("loss_fn") is not None)
    vocab = model_vocab_size(workload["model"])
    opened = [None if path is None else
              open_corpus(path, seq_len=seq_len, tokenizer=config.tokenizer,
                          dtype=config.data_dtype, vocab_size=vocab)
              for path in (config.data, config.eval_data)]
    return DataFiles(corpus=opened[0], held_out=opened[1], vocab_size=vocab, form=form)


def feed(workload: dict[str, Any], files: DataFiles, config: TrainConfig, *,
         global_batch_size: int, dp: int, dp_rank: int) -> None:
    """Make ``files`` the workload's data: ``data(step)`` the global batch of a step (the
    batch a checkpoint's data digest reads), ``rank_data(step)`` this rank's replica's
    rows of it (what it trains on), ``eval_data`` the held-out file's first global batch,
    each in the form the model takes (``files.form``). The order is ``--seed``'s and the
    step's (partc.corpus.StepBatches)."""
    from partc.corpus import StepBatches

    def batches(corpus: Any) -> Any:
        return StepBatches(corpus, global_batch_size=global_batch_size, seed=config.seed,
                           vocab_size=files.vocab_size)

    def formed(read: Callable[[int], tuple[Any, Any]]) -> Callable[[int], tuple[Any, Any]]:
        return lambda step: files.form(*read(step))

    steps = batches(files.corpus)
    workload["data"] = formed(steps)
    workload["rank_data"] = formed(steps.for_replica(dp, dp_rank))
    if files.held_out is not None:
        held_out = formed(batches(files.held_out))
        workload["eval_data"] = lambda: held_out(0)


# -- checkpoints ------------------------------------------------------------------------------

def data_digest(workload: dict[str, Any], step: int) -> str:
    """A digest of ``data(step)``'s batch (shapes, dtypes and bytes): a resumed run whose
    data differs from the checkpoint's reads another batch at the checkpoint's last step."""
    import torch

    digest = hashlib.sha256()
    inputs, target = data_batch(workload, step)
    # A batch by name (a dict of inputs) is digested value by value, in its order.
    values = [v for item in (*inputs, target)
              for v in (item.values() if isinstance(item, dict) else (item,))]
    for value in values:
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
        with self.module.watch_data(step - 1):   # the record reads that step's batch again
            extra = _record(self.config, self.workload, step)
        path = self.module.save_checkpoint(
            self.directory, optimizer=self.optimizer, step=step, extra=extra,
            async_save=async_save, keep=self.config.keep)
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


def claim_checkpoint_dir(config: TrainConfig) -> Any:
    """At start-up, before the model is built: every rank checks the checkpoint
    directory is writable and rank 0 takes its lock (None without a directory, or on
    the other ranks); raises CheckpointError naming the directory or the lock's holder."""
    if config.checkpoint_dir is None:
        return None
    if int(os.environ.get("RANK", "0")) != 0:
        checkpoint_lock.check_writable(Path(config.checkpoint_dir))
        return None
    return checkpoint_lock.acquire(config.checkpoint_dir)


def execute(config: TrainConfig) -> Outcome:
    """Prepare, resume if asked, train with checkpoints; the process group stays (:func:`run`
    leaves it). ``status`` is 0, or SUSPEND_EXIT_CODE when a stop signal ended training
    after saving its step."""
    lock = claim_checkpoint_dir(config)
    try:
        return _execute(config)
    finally:
        if lock is not None:
            lock.release()


def _execute(config: TrainConfig) -> Outcome:
    from partc.runtime import checkpoint
    from partc.runtime.suspend import SUSPEND_EXIT_CODE

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
                with module.watch_data(manifest["step"] - 1):   # reads that step's batch
                    check_resume(manifest["extra"], config, workload, manifest["step"],
                                 found)
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
        if module.skipped_steps and module.topology.rank == 0:
            print(f"{module.skipped_steps} of {len(losses)} steps skipped: their loss or "
                  "gradient norm was inf or NaN (--on-nonfinite skip)", flush=True)
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


def run(config: TrainConfig, *, claimed: bool = False) -> int:
    """:func:`execute` (without claiming the checkpoint directory again when ``claimed``),
    then leave the process group (``topology.leave``: its gloo threads joined before the
    interpreter shuts down, which could otherwise abort a finished run); returns the exit
    status."""
    import torch.distributed as dist

    from partc.runtime import topology

    outcome = _execute(config) if claimed else execute(config)
    if outcome.status == 0:
        dist.barrier()
    topology.leave()   # the module _execute built is released: its groups go here
    return outcome.status


# partc.runtime.checkpoint's names, read here without importing torch (a test holds them
# equal).
LATEST, MANIFEST = "latest", "manifest.json"


def finished_step(config: TrainConfig) -> int | None:
    """With ``--resume``: the step of the checkpoint it would continue from, when that is
    already ``--steps`` or more and the checkpoint was trained with this ``--seed``, read
    without torch (so that a job with nothing left to do says so at once); None when there
    is training to do, or anything about the checkpoint to check that needs torch."""
    if not config.resume or config.checkpoint_dir is None:
        return None
    root = Path(config.checkpoint_dir)
    try:
        name = (root / LATEST).read_text().strip()
        manifest = json.loads((root / name / MANIFEST).read_text())
        step, seed = manifest["step"], manifest["extra"]["launcher"]["seed"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not name or "/" in name or name.startswith(".") or not isinstance(step, int):
        return None
    return step if step >= config.steps and seed == config.seed else None


def _without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less ``--nproc-per-node N``: what each rank is started with."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == "--nproc-per-node":
            skip = True
        elif not word.startswith("--nproc-per-node="):
            out.append(word)
    return out


def main(argv: list[str]) -> int:
    """``partc train ...``: returns the exit status (:mod:`partc.cli.failures`: 0 done, 2
    bad input, ...); a failure is one line on stderr, from the first rank to fail."""
    prefix = f"partc {COMMAND}"
    if not any(name in os.environ for name in ALLOCATOR_VARIABLES):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_SETTINGS
    try:
        config = parse_config(argv)
    except SystemExit as exit_:   # argparse: --help (0)
        return exit_.code if isinstance(exit_.code, int) else 2
    except (cli.UsageError, ValueError) as error:   # a bad flag, one line naming it
        return failures.report(error, prefix)
    done = finished_step(config)
    if done is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"nothing to train: the checkpoint is at step {done}, --steps is "
                  f"{config.steps}", flush=True)
        return 0
    if config.nproc_per_node is not None and "TORCHELASTIC_RUN_ID" not in os.environ:
        from partc.cli import standalone

        try:   # a typo or a busy checkpoint directory costs no launch
            cli.check_target(config.target, COMMAND)
            if config.checkpoint_dir is not None:
                checkpoint_lock.check_free(config.checkpoint_dir)
        except (cli.UsageError, PartcError) as error:
            return failures.report(error, prefix)
        return standalone.launch(config.nproc_per_node, _without_nproc(argv), prefix=prefix)
    cli.log_to_stderr(config.quiet)
    lock = None
    try:
        lock = claim_checkpoint_dir(config)   # before torch loads: a refusal costs seconds
        return run(config, claimed=True)
    except Exception as error:
        return failures.report(error, prefix)
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
