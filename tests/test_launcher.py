"""``partc train``'s settings in one process: flags, the TOML file and which wins, refusals
that name the bad key or value, and the learning-rate schedule. (The run itself is
tests/runtime/test_launcher_run.py, under torchrun.)"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from partc.cli import failures, launcher, standalone, config as train_config
from partc.cli.choices import OPTIMIZER_STATE_BYTES
from partc.cli.main import (
    BUDGET_FLAGS,
    PIN_FLAGS,
    TRAIN_FLAGS,
    _budget,
    _constraints,
    _parser,
    _train,
)
from partc.cli.config import (TrainConfig, learning_rate, parse_config,
                                read_config_file)
from partc.device.presets import DEFAULT_DEVICE
from partc.errors import FactoryError
from partc.runtime import checkpoint_lock

ROOT = Path(__file__).resolve().parents[1]


def _toml(tmp_path, text: str) -> str:
    path = tmp_path / "train.toml"
    path.write_text(text)
    return str(path)


def test_flags_alone():
    config = parse_config(["m.py:f", "--steps", "5", "--lr", "0.01", "--optimizer", "sgd",
                           "--momentum", "0.9", "--sequence-parallel", "--tp", "2"])
    assert (config.target, config.steps, config.lr, config.optimizer) == ("m.py:f", 5, 0.01,
                                                                         "sgd")
    assert config.momentum == 0.9 and config.train_optimizer == "sgd-momentum"
    assert config.plan == {"sequence_parallel": True, "tp": 2}
    assert config.warmup_steps == 0 and config.eval_every == 0   # defaults
    assert config.checkpoint_dir is None and not config.resume


def test_the_plan_flags_are_partc_plans():
    """Every budget, pin and training flag of ``partc plan`` but --devices (the world size
    is the number of devices), read by the same readers into the same objects."""
    plan = _parser()._subparsers._group_actions[0].choices["plan"]
    shared = {*BUDGET_FLAGS.values(), *PIN_FLAGS.values(), *TRAIN_FLAGS.values(),
              "--recompute-layer"} - {"--devices"}
    train = {o for action in train_config.parser()._actions for o in action.option_strings}
    planned = {o for action in plan._actions for o in action.option_strings}
    assert shared <= train and shared <= planned and "--devices" not in train
    argv = ["--pp", "2", "--dp", "2", "--no-sequence-parallel", "--tp-objective", "memory",
            "--stage", "a,b", "--stage", "c", "--recompute-layer", "a=full",
            "--microbatches", "4", "--micro-batch", "2", "--schedule", "gpipe", "--zero", "1",
            "--memory", "40GiB,40GB", "--hbm-bandwidth", "1TB/s", "--device", "a100-80gb"]
    config = parse_config([f"{__file__}:never", "--steps", "1", *argv])
    budget, constraints = launcher.check(config, 2)
    args = _parser().parse_args(["plan", "m.py:f", "--devices", "2", *argv])
    assert constraints == _constraints(args) and budget == _budget(args)
    assert budget.memory_bytes == (40 * 2**30, 40 * 10**9) and budget.num_devices == 2
    assert train_config.OPTIMIZERS == tuple(sorted(OPTIMIZER_STATE_BYTES))
    # without --device or --profile: the devices that train (CPU where torch sees no GPU)
    budget, _ = launcher.check(parse_config([f"{__file__}:never", "--steps", "1"]), 1)
    assert budget.device == ("CPU" if not torch.cuda.is_available() else DEFAULT_DEVICE)


@pytest.mark.parametrize("argv, says", [
    (["--memory", "40G"], "'40G' is ambiguous"),
    (["--zero-stage", "1"], "unrecognized arguments: --zero-stage"),
    (["--devices", "2"], "no --devices here: the number of devices is the launch's world"),
    (["--schedule", "zb"], "invalid choice: 'zb'"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--keep", "0"], "argument --keep: must be a positive whole number"),
    (["--memory", "1GiB,1GiB,1GiB"], "3 sizes for 1 devices"),
    (["--global-batch", "6", "--micro-batch", "4"], "does not divide"),
])
def test_bad_flags_are_refused_before_the_model(capsys, argv, says):
    assert launcher.main([f"{__file__}:never", "--steps", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
    assert launcher.main(["no/such.py:f", "--steps", "1"]) == 2
    assert "no such file: no/such.py" in capsys.readouterr().err


def never():
    raise SystemExit("the model was built")


def test_flags_win_over_the_file(tmp_path):
    path = _toml(tmp_path, 'target = "m.py:f"\nsteps = 10\nlr = 1\nmax-grad-norm = 1\n'
                           'warmup_steps = 3\ntensorboard = true\nlog_dir = "logs"\n')
    config = parse_config(["--config", path, "--steps", "4"])
    assert config.steps == 4                       # the flag
    assert config.lr == 1.0 and isinstance(config.lr, float)   # the file; int widened
    assert (config.plan["max_grad_norm"], config.warmup_steps) == (1.0, 3)
    assert (config.tensorboard, config.log_dir, config.target) == (True, "logs", "m.py:f")
    assert parse_config(["other.py:g", "--config", path]).target == "other.py:g"


def test_the_file_is_read_as_the_flags(tmp_path):
    path = _toml(tmp_path, 'target = "m.py:f"\nsteps = 2\nmemory = "10MiB"\nzero = 1\n'
                           'stage = [["a", "b"], "c"]\nsequence-parallel = false\n'
                           'recompute = "full"\ncheckpoint-dir = "ckpt"\nresume = true\n'
                           'hbm_bandwidth = "1TB/s"\n')
    config = parse_config(["--config", path])
    assert config.plan == {"memory": 10 * 2**20, "zero": 1, "stage": [("a", "b"), ("c",)],
                           "sequence_parallel": False, "recompute": "full",
                           "hbm_bandwidth": 1e12}
    assert (config.checkpoint_dir, config.resume) == ("ckpt", True)
    # a flag wins over the file, also over the other member of an exclusive pair
    config = parse_config(["--config", path, "--recompute-layer", "a=none", "--zero", "2"])
    assert "recompute" not in config.plan and config.plan["recompute_layer"] == [("a", "none")]
    assert config.plan["zero"] == 2
    for text, says in (('memory = "40G"\n', "argument --memory: '40G' is ambiguous"),
                       ("zero = 5\n", "invalid choice: 5"),
                       ('zero = "1"\n', "zero must be int"),
                       ("stage = [1]\n", "stage must be a string or a list of strings")):
        with pytest.raises(ValueError, match=re.escape(says)):
            read_config_file(_toml(tmp_path, text))


def test_on_nonfinite_reaches_the_train_spec(tmp_path, capsys):
    """--on-nonfinite (or the file's key) becomes TrainSpec.on_nonfinite; raise by default."""
    workload = {"example_inputs": torch.zeros(4, 3)}
    file = _toml(tmp_path, 'target = "m.py:f"\nsteps = 1\non-nonfinite = "skip"\n')
    for argv in (["m.py:f", "--steps", "1", "--on-nonfinite", "skip"], ["--config", file]):
        assert _train(parse_config(argv).plan_arguments(), workload,
                      "cpu").on_nonfinite == "skip"
    default = parse_config(["m.py:f", "--steps", "1"]).plan_arguments()
    assert _train(default, workload, "cpu").on_nonfinite == "raise"
    assert launcher.main(["m.py:f", "--steps", "1", "--on-nonfinite", "never"]) == 2
    assert "invalid choice: 'never'" in capsys.readouterr().err


def test_unknown_key_is_refused_by_name(tmp_path):
    path = _toml(tmp_path, "steps = 3\nlearning_rate = 0.1\n")
    with pytest.raises(ValueError, match="unknown key 'learning_rate'"):
        read_config_file(path)
    assert launcher.main(["m.py:f", "--config", path]) == 2


def test_wrong_types_and_values_are_refused(tmp_path):
    with pytest.raises(ValueError, match="steps must be int, got '3'"):
        read_config_file(_toml(tmp_path, 'steps = "3"\n'))
    with pytest.raises(ValueError, match="tensorboard must be bool"):
        read_config_file(_toml(tmp_path, "tensorboard = 1\n"))
    with pytest.raises(ValueError, match="not valid TOML"):
        read_config_file(_toml(tmp_path, "steps = \n"))
    with pytest.raises(ValueError, match="--steps is required"):
        TrainConfig(target="m.py:f")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        TrainConfig(target="m.py:f", steps=1, optimizer="lion")
    with pytest.raises(ValueError, match="sgd-momentum needs --momentum"):
        TrainConfig(target="m.py:f", steps=1, optimizer="sgd-momentum")
    with pytest.raises(ValueError, match="--checkpoint-every, --keep need --checkpoint-dir"):
        TrainConfig(target="m.py:f", steps=1, checkpoint_every=2, keep=1)
    with pytest.raises(ValueError, match="min_lr 1.0 is above lr"):
        TrainConfig(target="m.py:f", steps=1, lr=0.1, min_lr=1.0)
    with pytest.raises(ValueError, match="tensorboard needs log_dir"):
        TrainConfig(target="m.py:f", steps=1, tensorboard=True)
    with pytest.raises(ValueError, match="no target"):
        parse_config(["--steps", "2"])


def test_learning_rate_warms_up_then_falls_on_a_cosine():
    config = TrainConfig(target="m.py:f", steps=12, lr=1.0, min_lr=0.1, warmup_steps=2)
    rates = [learning_rate(step, config) for step in range(12)]
    assert rates[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert learning_rate(7, config) == pytest.approx(0.55)    # halfway through the decay
    assert rates[-1] == pytest.approx(0.1 + 0.45 * (1 + math.cos(0.9 * math.pi)))
    assert learning_rate(12, config) == pytest.approx(0.1)    # min_lr when training ends
    assert all(a > b for a, b in itertools.pairwise(rates[2:]))
    assert learning_rate(0, TrainConfig(target="m.py:f", steps=1, lr=0.3)) == 0.3


class _Module:
    """What train() uses of a DistributedModule, recording the calls and the steps whose
    data calls the watchdog was told of."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.watched: list[int] = []

    @contextlib.contextmanager
    def watch_data(self, step):
        self.watched.append(step)
        yield

    def forward_backward(self, *inputs, target):
        self.calls.append(("forward_backward", inputs[0].item(), target))
        return torch.tensor(10.0 - inputs[0].item())

    def evaluate(self, *inputs, target):
        self.calls.append(("evaluate", inputs[0].item(), target))
        return torch.tensor(0.5)


class _Optimizer:
    def __init__(self, module: _Module) -> None:
        self.param_groups = [{"lr": None}]
        self.module = module

    def step(self) -> None:
        self.module.calls.append(("step", self.param_groups[0]["lr"]))

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


def test_the_loop_steps_evaluates_resumes_and_stops():
    module = _Module()
    workload = {"data": lambda step: (torch.tensor([step]), f"t{step}")}
    config = TrainConfig(target="m.py:f", steps=6, lr=1.0, eval_every=2)
    seen = []
    losses = launcher.train(module, _Optimizer(module), workload, config, start_step=2,
                            after_step=lambda n: seen.append(n) or n == 5)
    assert losses == [8.0, 7.0, 6.0]    # steps 2, 3, 4: stopped after the 5th
    assert seen == [3, 4, 5]
    assert module.calls == [
        ("forward_backward", 2, "t2"), ("step", learning_rate(2, config)),
        ("forward_backward", 3, "t3"), ("step", learning_rate(3, config)),
        ("evaluate", -1, "t-1"),        # after the 4th step: the held-out batch
        ("forward_backward", 4, "t4"), ("step", learning_rate(4, config))]
    assert module.watched == [-1, 2, 3, 4]   # every data call, the held-out one first


def test_eval_data_replaces_the_held_out_step():
    module = _Module()
    workload = {"data": lambda step: (torch.tensor([step]), None),
                "eval_data": lambda: ((torch.tensor([99]),), "held")}
    config = TrainConfig(target="m.py:f", steps=1, eval_every=1)
    launcher.train(module, _Optimizer(module), workload, config)
    assert module.calls[-1] == ("evaluate", 99, "held")
    bad = {"data": lambda step: torch.tensor([step])}
    with pytest.raises(FactoryError, match=r"data\(-1\) of the factory must return "
                                           r"\(inputs, target\)"):
        launcher.train(module, _Optimizer(module), bad, config)


def test_help_and_bad_flags_return_a_status(capsys, monkeypatch):
    for name in launcher.ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert launcher.main(["--help"]) == 0
    # A run takes partc's allocator settings, and keeps the user's own under either
    # name (torch reads PYTORCH_CUDA_ALLOC_CONF first: setting it would hide the other).
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == launcher.ALLOCATOR_SETTINGS
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert launcher.main(["--help"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    assert launcher.main(["--help"]) == 0
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert "--max-grad-norm" in capsys.readouterr().out
    assert launcher.main(["m.py:f", "--steps", "two"]) == 2


def test_a_resume_whose_data_or_seed_differs_is_refused(caplog):
    config = TrainConfig(target="m.py:f", steps=6, checkpoint_dir="ckpt", resume=True)
    workload = {"data": lambda step: (torch.arange(4) + step, torch.zeros(2))}
    extra = launcher._record(config, workload, 4)
    assert extra["launcher"]["data"]["step"] == 3
    launcher.check_resume(extra, config, workload, 4, "ckpt/step-4")   # the same: fine
    shifted = {"data": lambda step: (torch.arange(4) + step + 1, torch.zeros(2))}
    with pytest.raises(ValueError, match="read another batch at step 4"):
        launcher.check_resume(extra, config, shifted, 4, "ckpt/step-4")
    wider = {"data": lambda step: (torch.arange(4.0) + step, torch.zeros(2))}   # dtype
    with pytest.raises(ValueError, match="its data order differs"):
        launcher.check_resume(extra, config, wider, 4, "ckpt/step-4")
    with pytest.raises(ValueError, match="resume with --seed 0"):
        launcher.check_resume(extra, TrainConfig(target="m.py:f", steps=6, seed=1),
                              workload, 4, "ckpt/step-4")
    with pytest.raises(ValueError, match="not written by partc train"):
        launcher.check_resume({"data": {}}, config, workload, 4, "ckpt/step-4")
    with caplog.at_level("INFO", logger="partc"):   # more steps: allowed, said
        launcher.check_resume(extra, TrainConfig(target="m.py:f", steps=9), workload, 4, "c")
    assert "steps 6 -> 9" in caplog.text


HOLD = """
import sys, time
from partc.runtime.checkpoint_lock import acquire
lock = acquire(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_job_on_a_checkpoint_directory_is_refused_naming_the_holder(tmp_path,
                                                                            capsys):
    directory = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        # Refused at start-up: the factory (which does not exist) is never read.
        argv = ["nowhere.py:factory", "--steps", "1", "--checkpoint-dir", str(directory)]
        assert launcher.main(argv) == failures.CHECKPOINT
        error = capsys.readouterr().err
        assert (f"CheckpointError: {directory} is in use by another job: "
                f"{directory / '.lock'} names host {socket.gethostname()} pid "
                f"{holder.pid}") in error
        # --nproc-per-node: refused before any process starts (the factory is real: the
        # lock is what stops it)
        gpt = ["samples/gpt.py:factory", "--steps", "1", "--checkpoint-dir", str(directory),
               "--nproc-per-node", "2"]
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(ROOT)
            patch.setattr(standalone, "launch", lambda *a, **k: pytest.fail("launched"))
            assert launcher.main(gpt) == failures.CHECKPOINT
        assert "is in use by another job" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    # Its holder gone, the lock is stale: taken over, and released again.
    lock = checkpoint_lock.acquire(directory)
    assert json.loads((directory / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (directory / ".lock").exists()


@pytest.mark.parametrize("case", ["under a file", "read-only"])
def test_an_unwritable_checkpoint_directory_is_refused_at_start_up(tmp_path, capsys, case):
    if case == "under a file":
        (tmp_path / "file").write_text("")
        directory = tmp_path / "file" / "ckpt"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only directory")
        directory = tmp_path / "ro"
        directory.mkdir()
        directory.chmod(0o555)
    argv = ["nowhere.py:factory", "--steps", "1", "--checkpoint-dir", str(directory)]
    assert launcher.main(argv) == failures.CHECKPOINT
    assert (f"CheckpointError: the checkpoint directory {directory} is not writable"
            in capsys.readouterr().err)


def test_calibrate_measures_this_cpu_once_and_keeps_it(tmp_path, monkeypatch):
    """--calibrate plans with a profile of this machine, measured by local rank 0 the first
    time (here a stand-in for the quick calibration) and read from the cache after; the
    other ranks wait for the file; with --device it is refused."""
    from partc.calibrate import cached_profile
    from partc.device.budget import PROFILE_SCHEMA, PROFILE_VERSION

    calls = []

    def measured(options):
        calls.append(options)
        return {"schema": PROFILE_SCHEMA, "schema_version": PROFILE_VERSION,
                "device": {"name": "this CPU", "preset": "CPU"},
                "budget": {"peak_flops": {"float32": 1e11}, "flops_efficiency": 0.25,
                           "flops_efficiency_by_dtype": {"float32": 0.25},
                           "hbm_bandwidth": 1e10, "devices_per_node": 2,
                           **dict.fromkeys(("intra_node_bandwidth", "inter_node_bandwidth",
                                            "link_latency_s", "intra_node_latency_s",
                                            "memory"))}}

    monkeypatch.setenv("PARTC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cached_profile, "calibrate", measured)
    monkeypatch.setattr(launcher, "_has_gpu", lambda: False)
    path = cached_profile.profile_path(2)
    with pytest.raises(cached_profile.CalibrationError, match="local rank 0"):
        cached_profile.cpu_profile(2, measure=False, wait_s=0.0)   # nobody measured
    config = parse_config([f"{__file__}:never", "--steps", "1", "--calibrate",
                           "--memory", "10MiB"])
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    budget, _ = launcher.check(config, 2)
    assert path.exists() and path.parent == tmp_path / "profiles"
    assert [(o.device, o.processes, o.quick) for o in calls] == [("cpu", 2, True)]
    assert budget.figures.flops_efficiency == 0.25   # the machine's, not the preset's
    assert budget.memory_bytes == (10 * 2**20,) * 2   # a flag still wins over the profile
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launcher.check(config, 2)[0] == budget and len(calls) == 1   # read, not measured
    with pytest.raises(Exception, match="--calibrate measures this machine's CPU"):
        launcher.check(parse_config([f"{__file__}:never", "--steps", "1", "--calibrate",
                                     "--device", "CPU"]), 2)


def test_global_batch_is_refused_where_the_factorys_data_gives_another():
    """--global-batch overrides the plan's batch, not the batches a factory's data makes:
    a difference is one line naming both, before the plan (every step would be refused)."""
    workload = {"target": "f.py:f",
                "data": lambda step: ({"ids": torch.zeros(16, 4)}, torch.zeros(16))}
    launcher.check_data_batch(workload, None)
    launcher.check_data_batch(workload, 16)
    with pytest.raises(FactoryError, match=r"--global-batch 8, but data\(0\) of f.py:f gives "
                       r"16 samples a step"):
        launcher.check_data_batch(workload, 8)
