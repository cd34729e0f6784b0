"""Telemetry's figures against a plan with known predictions, in one process: MFU and
throughput from the step time, departures and their warnings, what each step ends on,
JSON lines, and TensorBoard refused clearly when the package is absent."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from partc.errors import PartcError
from partc.plan import Plan
from partc.runtime import telemetry as tm

PLAN_FILE = Path(__file__).parents[1] / "data" / "plan_v1_gpt_tiny_pp2_bf16.json"


@pytest.fixture(scope="module")
def plan() -> Plan:
    """The tiny GPT's pp=2 plan (2 devices of 2e11 FLOP/s, global batch 4 of 16 tokens),
    with round predictions: 10 ms a step at 40% MFU."""
    loaded = Plan.from_json(PLAN_FILE.read_text())
    assert (loaded.budget.num_devices, loaded.budget.figures.peak_flops) == (2, 2e11)
    predicted = replace(loaded.predicted, step_time_s=0.01, mfu=0.4, samples_per_s=400.0,
                        tokens_per_s=6400.0)
    return replace(loaded, predicted=predicted)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Meter:
    """Peak memory as the test sets it."""

    def __init__(self) -> None:
        self.value = 0

    def reset(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def peak(self) -> int:
        return self.value

    def reserved(self) -> int:   # the allocator's segments: the tensors and a free piece
        return self.value + 1024


def _telemetry(plan: Plan, monkeypatch, **kwargs) -> tuple[tm.Telemetry, _Clock, _Meter]:
    clock, meter = _Clock(), _Meter()
    monkeypatch.setattr(tm.time, "perf_counter", clock)
    made = tm.Telemetry(plan, rank=0, stage=1, leads_stage=True, device=torch.device("cpu"),
                        **kwargs)
    made._meter = meter
    return made, clock, meter


def _step(telemetry, clock, meter, step, seconds, memory, *, optimizer=True, loss=2.0):
    telemetry.begin(step)
    clock.now += seconds / 2
    meter.value = memory
    telemetry.measured(torch.tensor(loss), torch.tensor(1.5))
    clock.now += seconds / 2
    return telemetry.end(optimizer_stepped=True) if optimizer else None


def test_plan_figures(plan):
    # 0.4 * 0.01 s * 2 devices * 2e11 FLOP/s
    assert tm.flops_per_step(plan) == pytest.approx(1.6e9)
    assert tm.achieved_mfu(plan, 0.01) == pytest.approx(0.4)
    assert tm.achieved_mfu(plan, 0.04) == pytest.approx(0.1)
    assert tm.tokens_per_sample(plan) == pytest.approx(16)
    assert tm.departure(1.5, 1.0) == pytest.approx(0.5)
    assert tm.departure(0.5, 1.0) == pytest.approx(-0.5)
    assert (tm._percent(0.4), tm._percent(0.000123)) == ("40.0%", "0.012%")


def test_a_step_record_against_the_plan(plan, monkeypatch, tmp_path, capsys):
    telemetry, clock, meter = _telemetry(plan, monkeypatch, jsonl_dir=tmp_path)
    stage_peak = plan.stages[1].memory_bytes.peak
    telemetry.begin(1)
    clock.now += 0.015
    meter.value = stage_peak // 2
    telemetry.measured(torch.tensor(3.0), torch.tensor(0.25))
    telemetry.note(lr=1e-3)
    clock.now += 0.005   # the optimizer step
    record = telemetry.end(optimizer_stepped=True)
    assert record.step_time_s == pytest.approx(0.02)
    assert record.timed == "forward_backward + optimizer step"
    assert record.samples_per_s == pytest.approx(4 / 0.02)
    assert record.tokens_per_s == pytest.approx(4 * 16 / 0.02)
    assert record.mfu == pytest.approx(0.2)
    assert record.time_departure == pytest.approx(1.0)
    assert record.predicted_memory_bytes == stage_peak
    assert record.memory_departure == pytest.approx(-0.5, abs=1e-5)
    assert record.reserved_bytes == stage_peak // 2 + 1024
    assert (record.loss, record.grad_norm, record.notes) == (3.0, 0.25, {"lr": 1e-3})
    line = capsys.readouterr().out
    assert line.startswith("step 1  loss 3.0000  20.00 ms (plan 10.00 ms, +100%)"), line
    assert "MFU 20.0% (plan 40.0%)" in line and "stage 1" in line and "lr 0.001" in line
    telemetry.log_eval(1, 2.5)
    telemetry.close()
    lines = [json.loads(x) for x in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [x["event"] for x in lines] == ["step", "eval"]
    assert lines[0]["step_time_s"] == pytest.approx(0.02) and lines[0]["lr"] == 1e-3
    assert lines[0]["memory_measure"] in tm.MEMORY_MEASURES
    assert lines[1] == {"event": "eval", "step": 1, "rank": 0, "stage": 1, "eval_loss": 2.5}


def test_without_an_optimizer_step_the_step_ends_with_forward_backward(plan, monkeypatch):
    telemetry, clock, meter = _telemetry(plan, monkeypatch, console=False)
    _step(telemetry, clock, meter, 1, 0.03, 10, optimizer=False)
    clock.now += 1.0   # the user's own optimizer, data loading: not the step's
    _step(telemetry, clock, meter, 2, 0.01, 10, optimizer=False)
    telemetry.close()   # ends step 2
    assert [r.step for r in telemetry.records] == [1, 2]
    assert [r.step_time_s for r in telemetry.records] == pytest.approx([0.015, 0.005])
    assert {r.timed for r in telemetry.records} == {"forward_backward"}


def test_a_skipped_step_is_marked_and_counted(plan, monkeypatch, tmp_path, capsys):
    """A step skipped as non-finite: its record, console line and JSON line say so, and
    the telemetry counts it."""
    telemetry, clock, meter = _telemetry(plan, monkeypatch, jsonl_dir=tmp_path)
    _step(telemetry, clock, meter, 1, 0.02, 10)
    telemetry.begin(2)
    telemetry.measured(torch.tensor(float("nan")), torch.tensor(float("nan")), skipped=True)
    record = telemetry.end(optimizer_stepped=True)
    _step(telemetry, clock, meter, 3, 0.02, 10)
    telemetry.close()
    assert record.skipped and telemetry.skipped_steps == 1
    assert [r.skipped for r in telemetry.records] == [False, True, False]
    lines = capsys.readouterr().out.splitlines()
    assert "SKIPPED (non-finite)" in lines[1] and "SKIPPED" not in lines[0] + lines[2]
    written = [json.loads(x) for x in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [x["skipped"] for x in written] == [False, True, False]


def test_departures_warn_once_per_kind_after_the_first_step(plan, monkeypatch, caplog):
    telemetry, clock, meter = _telemetry(plan, monkeypatch, console=False, warn_ratio=0.25)
    peak = plan.stages[1].memory_bytes.peak
    with caplog.at_level(logging.WARNING, logger="partc.runtime.telemetry"):
        _step(telemetry, clock, meter, 1, 0.05, peak * 3)    # first step: not judged
        assert caplog.records == []
        _step(telemetry, clock, meter, 2, 0.012, peak)       # within 25%
        assert caplog.records == []
        _step(telemetry, clock, meter, 3, 0.02, peak * 2)    # both off by +100%
        _step(telemetry, clock, meter, 4, 0.02, peak * 2)    # already said
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "stage 1" in messages[0] and "step time 20.00 ms is 100% above the plan's 10.00 ms" \
        in messages[0]
    assert "peak memory" in messages[1] and "100% above" in messages[1]


def test_a_rank_that_does_not_lead_its_stage_does_not_warn(plan, monkeypatch, caplog):
    telemetry, clock, meter = _telemetry(plan, monkeypatch, console=False)
    telemetry._leads_stage = False
    with caplog.at_level(logging.WARNING, logger="partc.runtime.telemetry"):
        for step in (1, 2, 3):
            _step(telemetry, clock, meter, step, 1.0, 1)
    assert caplog.records == []


def test_tensorboard_absent_is_a_clear_error(plan, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)   # import fails
    with pytest.raises(PartcError, match="tensorboard package"):
        tm.Telemetry(plan, rank=0, stage=0, leads_stage=True, device=torch.device("cpu"),
                     tensorboard_dir=tmp_path)


def test_host_memory_counts_growth_above_the_baseline():
    meter = tm._HostMemory(baseline=tm.resident_bytes())
    meter.reset()
    block = torch.ones(64 * 2**20 // 4)   # 64 MiB, written: resident
    grown = meter.peak()
    del block
    assert grown >= 60 * 2**20


def test_tensorboard_scalars(plan, monkeypatch, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    telemetry, clock, meter = _telemetry(plan, monkeypatch, console=False,
                                         tensorboard_dir=tmp_path)
    for step, loss in ((1, 3.0), (2, 2.5)):
        _step(telemetry, clock, meter, step, 0.02, 1000, loss=loss)
    telemetry.log_eval(2, 2.25)
    telemetry.close()
    events = EventAccumulator(str(tmp_path / "rank0"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 3.0), (2, 2.5)]
    assert [e.value for e in events.Scalars("speed/mfu")] == pytest.approx([0.2, 0.2])
    assert [e.value for e in events.Scalars("eval/loss")] == [2.25]


class _WandbRun:
    def __init__(self, **settings) -> None:
        self.settings, self.logged, self.finished = settings, [], False

    def log(self, values: dict, step: int) -> None:
        self.logged.append((step, values))

    def finish(self) -> None:
        self.finished = True


def test_wandb_logs_rank_0s_scalars_and_is_refused_clearly_when_absent(plan, monkeypatch):
    """``wandb`` stood in by a module whose ``init`` makes a recording run: rank 0 logs
    each step's scalars (the launcher's lr too) and evaluations, then finishes; another
    rank makes no run; without the package every rank is refused by name."""
    runs: list[_WandbRun] = []
    fake = type(sys)("wandb")
    fake.init = lambda **settings: runs.append(_WandbRun(**settings)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    telemetry, clock, meter = _telemetry(plan, monkeypatch, console=False,
                                         wandb={"project": "p", "config": {"lr": 0.1}})
    for step, loss in ((1, 3.0), (2, 2.5)):
        telemetry.begin(step)
        telemetry.note(lr=0.1)
        clock.now += 0.02
        telemetry.measured(torch.tensor(loss), torch.tensor(1.5))
        telemetry.end(optimizer_stepped=True)
    telemetry.log_eval(2, 2.25)
    telemetry.close()
    (run,) = runs
    assert run.settings == {"project": "p", "config": {"lr": 0.1}} and run.finished
    assert [(step, values["train/loss"]) for step, values in run.logged[:2]] == [(1, 3.0),
                                                                               (2, 2.5)]
    assert run.logged[0][1]["speed/mfu"] == pytest.approx(0.2)
    assert run.logged[0][1]["train/lr"] == 0.1
    assert run.logged[2] == (2, {"eval/loss": 2.25})
    tm.Telemetry(plan, rank=1, stage=0, leads_stage=True, device=torch.device("cpu"),
                 wandb={"project": "p"}).close()
    assert len(runs) == 1   # rank 1: none
    monkeypatch.setitem(sys.modules, "wandb", None)   # not installed
    with pytest.raises(PartcError, match="needs the wandb package: pip install wandb"):
        tm.Telemetry(plan, rank=1, stage=0, leads_stage=True, device=torch.device("cpu"),
                     wandb={"project": "p"})


def test_on_cpu_memory_is_live_tensors_as_the_plan_counts_them(plan, monkeypatch, capsys):
    # A linear layer, its gradient and Adam's state: held from step to step (the
    # parameters before the first step, the rest made during it), and the step's own
    # activations while they live. RSS is reported beside it.
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256)
    optimizer = torch.optim.Adam(layer.parameters())
    held = lambda: list(layer.parameters()) + [p.grad for p in layer.parameters()  # noqa: E731
                                               if p.grad is not None]
    telemetry = tm.Telemetry(plan, rank=0, stage=1, leads_stage=True,
                             device=torch.device("cpu"), held=held)
    params = sum(p.numel() * 4 for p in layer.parameters())
    x = torch.randn(64, 256)
    for step in (1, 2):
        telemetry.begin(step)
        layer(x).square().sum().backward()
        telemetry.measured(torch.tensor(1.0), None)
        optimizer.step()
        optimizer.zero_grad()
        record = telemetry.end(optimizer_stepped=True)
    first, second = telemetry.records
    assert first.memory_measure == "live_tensor_bytes" and first.memory_step == 1
    # Parameters, gradients, Adam's two moments: 4 x the parameters, and at least the
    # 64 x 256 output and its square while backward runs; far less than a megabyte more.
    assert 4 * params + 2 * 64 * 256 * 4 <= first.memory_bytes <= 4 * params + 2**20
    assert second.memory_bytes == first.memory_bytes and second.memory_step == 1
    assert record.rss_bytes is not None
    assert not telemetry._tensors.counting   # counted one step only
    telemetry.close()
    assert "tensors at step 1" in capsys.readouterr().out.splitlines()[-1]
