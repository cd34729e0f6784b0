"""``partc train``'s settings in one process: flags, the TOML file and which wins, refusals
that name the bad key or value, and the learning-rate schedule. (The run itself is
tests/runtime/test_launcher_run.py, under torchrun.)"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from partc import launcher
from partc.launcher import TrainConfig, learning_rate, parse_config, read_config_file


def _toml(tmp_path, text: str) -> str:
    path = tmp_path / "train.toml"
    path.write_text(text)
    return str(path)


def test_flags_alone():
    config = parse_config(["m.py:f", "--steps", "5", "--lr", "0.01", "--optimizer", "sgd",
                           "--momentum", "0.9", "--sequence-parallel", "--tp", "2"])
    assert (config.target, config.steps, config.lr, config.optimizer) == ("m.py:f", 5, 0.01,
                                                                         "sgd")
    assert (config.momentum, config.sequence_parallel, config.tp) == (0.9, True, 2)
    assert config.warmup_steps == 0 and config.eval_every == 0   # defaults


def test_flags_win_over_the_file(tmp_path):
    path = _toml(tmp_path, 'target = "m.py:f"\nsteps = 10\nlr = 1\nmax-grad-norm = 1\n'
                           'warmup_steps = 3\ntensorboard = true\nlog_dir = "logs"\n')
    config = parse_config(["--config", path, "--steps", "4"])
    assert config.steps == 4                       # the flag
    assert config.lr == 1.0 and isinstance(config.lr, float)   # the file; int widened
    assert (config.max_grad_norm, config.warmup_steps) == (1.0, 3)
    assert (config.tensorboard, config.log_dir, config.target) == (True, "logs", "m.py:f")
    assert parse_config(["other.py:g", "--config", path]).target == "other.py:g"


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
    """What train() uses of a DistributedModule, recording the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

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


def test_eval_data_replaces_the_held_out_step():
    module = _Module()
    workload = {"data": lambda step: (torch.tensor([step]), None),
                "eval_data": lambda: ((torch.tensor([99]),), "held")}
    config = TrainConfig(target="m.py:f", steps=1, eval_every=1)
    launcher.train(module, _Optimizer(module), workload, config)
    assert module.calls[-1] == ("evaluate", 99, "held")
    bad = {"data": lambda step: torch.tensor([step])}
    with pytest.raises(ValueError, match=r"data\(-1\) must return \(inputs, target\)"):
        launcher.train(module, _Optimizer(module), bad, config)


def test_help_and_bad_flags_return_a_status(capsys):
    assert launcher.main(["--help"]) == 0
    assert "--max-grad-norm" in capsys.readouterr().out
    assert launcher.main(["m.py:f", "--steps", "two"]) == 2
