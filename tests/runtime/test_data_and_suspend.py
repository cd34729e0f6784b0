"""The data sampler's order and the stop flag, on one process (the torchrun run that
suspends and resumes training is tests/runtime/test_suspend_resume.py)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

import partc
from partc.runtime.data import DataSampler
from partc.runtime.suspend import SIGNALS_ENV, StopFlag, stop_signals

from .test_program import compile_gpt, process_group, tokens  # noqa: F401
from samples.gpt import gpt_tiny
from samples.gpt import loss_fn as gpt_loss


def test_each_step_reads_the_next_global_batch_of_a_seeded_epoch():
    sampler = DataSampler(10, global_batch_size=4, seed=3)
    stream = torch.cat([sampler.global_indices(step) for step in range(5)])  # 2 epochs
    first, second = stream[:10], stream[10:20]
    assert sorted(first.tolist()) == list(range(10)) == sorted(second.tolist())
    for epoch, drawn in enumerate((first, second)):
        seeded = torch.Generator().manual_seed(3 + epoch)
        assert drawn.tolist() == torch.randperm(10, generator=seeded).tolist()
    # A pure function of the step: asked again, out of order, on a fresh sampler.
    again = DataSampler(10, global_batch_size=4, seed=3)
    assert again.global_indices(2).tolist() == sampler.global_indices(2).tolist() \
        == stream[8:12].tolist()


def test_replicas_take_consecutive_slices_so_any_dp_degree_reads_the_same_samples():
    whole = DataSampler(50, global_batch_size=8, seed=1)
    for dp in (2, 4, 8):
        for step in (0, 6, 13):
            parts = [DataSampler(50, global_batch_size=8, dp=dp, dp_rank=r, seed=1)
                     .indices(step) for r in range(dp)]
            assert all(len(p) == 8 // dp for p in parts)
            assert torch.cat(parts).tolist() == whole.indices(step).tolist()


def test_bad_sampler_arguments_are_refused():
    with pytest.raises(ValueError, match="does not split over 3"):
        DataSampler(10, global_batch_size=8, dp=3, dp_rank=0)
    with pytest.raises(ValueError, match="num_samples must be a positive int"):
        DataSampler(0, global_batch_size=8)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        DataSampler(10, global_batch_size=8).indices(-1)


def test_stop_signals_come_from_the_environment(monkeypatch):
    assert stop_signals() == (signal.SIGTERM, signal.SIGUSR1)
    monkeypatch.setenv(SIGNALS_ENV, "usr2, SIGINT")
    assert stop_signals() == (signal.SIGUSR2, signal.SIGINT)
    monkeypatch.setenv(SIGNALS_ENV, "SIGKILL")
    with pytest.raises(ValueError, match="'SIGKILL' is not a signal a process can handle"):
        stop_signals()


def test_a_signal_sets_the_flag_every_rank_agrees_on_and_it_stays_set(process_group):
    torch.manual_seed(0)
    module = compile_gpt(gpt_tiny(vocab_size=128, block_size=16, n_layer=1, n_embd=32,
                                  n_head=2), 1).build()
    sampler = module.data_sampler(100, seed=0)
    assert sampler.indices(0).tolist() == sampler.global_indices(0).tolist()  # dp = 1
    flag = StopFlag()
    flag.install()
    try:
        assert not flag.agreed(module.topology.device)
        os.kill(os.getpid(), signal.SIGUSR1)  # handled: the process goes on
        assert flag.local and flag.signal == signal.SIGUSR1
        assert flag.agreed(module.topology.device)
        flag.local = False
        assert flag.agreed(module.topology.device)  # sticky, no collective needed
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    assert not module.stop_requested()  # the program's own flag: not set
    later = StopFlag()
    later.install()  # another program's in the same process, installed after
    os.kill(os.getpid(), signal.SIGTERM)
    assert later.local and module.stop_requested()  # both told
    later.uninstall()
    module.close()  # closed in reverse order, the handlers from before come back
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_report_gives_the_save_time_at_the_budgets_disk_bandwidth():
    with pytest.raises(ValueError, match="DeviceBudget.disk_bandwidth"):
        partc.DeviceBudget(num_devices=1, device="CPU", disk_bandwidth="fast")
    x, y = tokens()
    model = gpt_tiny(vocab_size=128, block_size=16, n_layer=1, n_embd=32, n_head=2)
    plan = partc.compile(model, (x,), loss_fn=gpt_loss, example_target=y,
                         budget=partc.DeviceBudget(num_devices=1, device="CPU",
                                                   disk_bandwidth="1MB/s"),
                         train=partc.TrainSpec(global_batch_size=8)).plan
    memory = plan.stages[0].memory_bytes
    assert plan.checkpoint_bytes_per_rank == memory.params + memory.optimizer > 0
    assert plan.predicted_save_s == pytest.approx(plan.checkpoint_bytes_per_rank / 1e6)
    assert "checkpoint: " in partc.Program(plan=plan).report()
    assert plan.budget.figures.disk_bandwidth == 1e6


def test_forward_backward_takes_the_global_batch_or_the_replicas_slice_only():
    """The batch-size check of a dp=2 rank (the torchrun run in test_suspend_resume.py
    trains on slices)."""
    from partc.plan import InputSpec
    from partc.runtime.batch_check import BatchCheck

    batches = BatchCheck(inputs=(InputSpec(name="idx", shape=(16,), dtype=torch.int64),),
                         target=InputSpec(name="target", shape=(16,), dtype=torch.int64),
                         global_batch_size=8, dp=2, dp_rank=1)
    for rows in (8, 4):
        ids = torch.zeros(rows, 16, dtype=torch.int64)
        assert batches.size((ids,), ids) == rows
        batches.check((ids,), ids, rows)
    whole = torch.zeros(8, 16, dtype=torch.int64)
    assert batches.rows((whole,), whole) == slice(4, 8)  # this replica's rows of 8
    ids = torch.zeros(3, 16, dtype=torch.int64)
    with pytest.raises(partc.PlanMismatchError,
                       match=r"idx has shape \(3, 16\), the plan's is \(8, 16\).*or give "
                             r"this rank's data-parallel slice: dim 0 of 4, global batch 8 "
                             r"over dp 2"):
        batches.check((ids,), ids, batches.size((ids,), ids))
