"""The watchdog (partc/runtime/watchdog.py): the verdict on a fake store and clock; a
rank stuck in partc train's data(step) named by its phase, on real threads and clock;
and end to end: a rank stopped by SIGSTOP ends the job within the limit, reported by
name."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from partc.cli import launcher
from partc.cli.config import TrainConfig
from partc.errors import FactoryError
from partc.runtime.module import DistributedModule
from partc.runtime.step_monitor import StepMonitor
from partc.runtime.watchdog import (DATA, EXIT_CODE, IDLE, SAVE, Beat, Seen, Watchdog,
                                    limit_from_env, phase_limits_from_env, stuck_ranks)

LIMIT = 5.0


class FakeStore:
    """The part of torch.distributed.Store the watchdog uses, in a dict."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.values[key] for key in keys]

    def add(self, key: str, amount: int) -> int:
        value = int(self.values.get(key, b"0")) + amount
        self.values[key] = str(value).encode()
        return value


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ranks(n: int, store: FakeStore, clock: Clock, limits=None
          ) -> tuple[list[Watchdog], list[str]]:
    reports: list[str] = []
    dogs = [Watchdog(store, rank=r, world_size=n, limit=LIMIT, limits=limits, clock=clock,
                     on_stuck=reports.append) for r in range(n)]
    return dogs, reports


def run_for(seconds: float, dogs: list[Watchdog], clock: Clock, stopped=()) -> None:
    """Every rank not ``stopped`` ticks once a second for ``seconds``."""
    for _ in range(int(seconds)):
        clock.now += 1.0
        for dog in dogs:
            if dog.rank not in stopped:
                dog.tick()


def test_a_stopped_rank_is_reported_by_the_others_after_the_limit():
    store, clock = FakeStore(), Clock()
    dogs, reports = ranks(3, store, clock)
    for dog in dogs:
        dog.mark("forward_backward", step=1)
    dogs[1].mark(IDLE)
    run_for(3, dogs, clock)
    dogs[0].mark("schedule", step=2), dogs[2].mark("schedule", step=2)
    run_for(LIMIT, dogs, clock, stopped={1})
    assert reports == []  # exactly the limit: not yet
    run_for(2, dogs, clock, stopped={1})  # a reader sees the last beat up to a tick late
    assert len(reports) == 2
    assert all(re.search(r"rank 1 made no progress for [67].0 s: no heartbeat", r)
               for r in reports)
    assert all("step 1, phase 'between steps'" in r for r in reports)
    assert sorted(re.search(r"on rank (\d)", r).group(1) for r in reports) == ["0", "2"]
    assert all("this rank is at step 2, phase 'schedule'" in r for r in reports)


def test_a_rank_stuck_in_a_phase_is_reported_not_the_ranks_waiting_on_it():
    store, clock = FakeStore(), Clock()
    dogs, reports = ranks(3, store, clock)
    for dog in dogs:
        dog.mark("forward_backward", step=4)
    dogs[0].mark("loss all-reduce"), dogs[2].mark("loss all-reduce")
    dogs[1].mark("gradient sync")  # never leaves it; ranks 0 and 2 wait for it
    run_for(LIMIT + 2, dogs, clock)  # a reader sees the last beat up to a tick late
    assert len(reports) == 3  # every rank, rank 1 included, ends
    assert all("rank 1 made no progress" in r and "did not leave the phase" in r and
               "step 4, phase 'gradient sync'" in r for r in reports)
    assert not any("rank 0 made" in r or "rank 2 made" in r for r in reports)


def test_a_rank_stopped_in_the_phase_others_wait_in_is_the_one_reported():
    """The waiting rank has been in the phase longer than the stopped rank's heartbeat
    has been missing: the heartbeat verdict still comes first, naming the stopped rank."""
    store, clock = FakeStore(), Clock()
    dogs, reports = ranks(2, store, clock)
    for dog in dogs:
        dog.mark("gradient sync", step=3)
    run_for(1, dogs, clock)
    run_for(LIMIT + 2, dogs, clock, stopped={1})
    assert len(reports) == 1
    assert "rank 1 made no progress" in reports[0] and "no heartbeat" in reports[0]
    assert "rank 0 made" not in reports[0]


def test_long_steps_time_between_steps_and_closed_ranks_are_not_judged():
    store, clock = FakeStore(), Clock()
    dogs, reports = ranks(2, store, clock)
    # Progress every few seconds: fine however long the step.
    for microbatch in range(20):
        dogs[0].mark(f"schedule: forward, microbatch {microbatch}", step=1)
        dogs[1].mark(f"schedule: backward, microbatch {microbatch}", step=1)
        run_for(LIMIT - 1, dogs, clock)
    # Rank 0 checkpoints for a long time between steps; rank 1 waits for it in step 2.
    dogs[0].mark(IDLE)
    dogs[1].mark("schedule", step=2)
    run_for(10 * LIMIT, dogs, clock)
    # Rank 0 exits (its module closed): rank 1 no longer hears it, and must not care.
    dogs[0].stop()
    dogs[1].mark(IDLE)
    run_for(10 * LIMIT, dogs, clock, stopped={0})
    assert reports == []


def test_ranks_not_yet_published_are_not_judged_and_phases_order_progress():
    clock = Clock()
    assert stuck_ranks({}, clock.now, LIMIT) == []
    seen = {0: Seen(Beat(1, 2, "schedule", LIMIT + 1), clock.now),
            1: Seen(Beat(1, 2, "optimizer step", LIMIT + 1), clock.now)}
    assert [s.rank for s in stuck_ranks(seen, clock.now, LIMIT)] == [0]
    seen[2] = Seen(Beat(1, 1, IDLE, 100.0), clock.now)  # behind, between steps
    assert stuck_ranks(seen, clock.now, LIMIT) == []


def test_a_rank_in_data_is_judged_by_the_data_limit_while_others_wait_for_it():
    """Rank 2 is in data(step=4) (the user's loader); ranks 0 and 1 wait in step 5's
    schedule. Past the general limit nothing is said (the waiting ranks are not the
    ones stuck); past the data limit, rank 2 is named with its phase."""
    store, clock = FakeStore(), Clock()
    dogs, reports = ranks(3, store, clock, limits={DATA: 3 * LIMIT})
    dogs[0].mark("schedule", step=5), dogs[1].mark("schedule", step=5)
    dogs[2].mark("data(step=4)", step=4)
    run_for(3 * LIMIT - 1, dogs, clock)
    assert reports == []
    run_for(3, dogs, clock)
    assert len(reports) == 3
    assert all(re.search(r"rank 2 spent 1[5-7]\.0 s in data\(step=4\) while other ranks "
                         r"waited for it \(the limit: 15 s, PARTC_WATCHDOG_DATA_S\)", r)
               for r in reports), reports
    assert not any(re.search(r"rank [01] (spent|made)", r) for r in reports)


def test_a_rank_still_writing_its_checkpoint_is_named_not_those_waiting_in_the_save():
    store, clock = FakeStore(), Clock()
    dogs, reports = ranks(2, store, clock, limits={SAVE: LIMIT})
    dogs[0].mark("checkpoint save(step=3)", step=3)   # its files written: in a collective
    dogs[1].mark("checkpoint save(step=3): writing", step=3)
    run_for(LIMIT + 2, dogs, clock)
    assert len(reports) == 2 and all(
        "rank 1 spent" in r and "in checkpoint save(step=3): writing while other ranks "
        "waited for it (the limit: 5 s, PARTC_WATCHDOG_SAVE_S)" in r for r in reports)
    assert not any("rank 0 spent" in r or "rank 0 made" in r for r in reports)


def test_ranks_all_in_data_wait_for_no_one_and_are_not_judged():
    """A slow loader on every rank: no collective waits, so no verdict however long."""
    store, clock = FakeStore(), Clock()
    dogs, reports = ranks(2, store, clock, limits={DATA: LIMIT})
    for dog in dogs:
        dog.mark("data(step=0)")
    run_for(10 * LIMIT, dogs, clock)
    assert reports == []
    assert Beat(1, 0, "checkpoint load: reading", 0.0).at_work
    assert not Beat(1, 0, "checkpoint load", 0.0).at_work
    assert Beat(1, 0, "checkpoint load", 0.0).waits and not Beat(1, 0, IDLE, 0.0).waits


class _Rank:
    """What partc train's loop uses of a DistributedModule, with the real watch_data."""

    watch_data = DistributedModule.watch_data

    def __init__(self, watchdog: Watchdog) -> None:
        self._monitor = StepMonitor(SimpleNamespace(watchdog=watchdog))


def test_partc_trains_data_call_stuck_on_one_rank_is_named_on_every_rank():
    """Real threads, store client and clock: rank 1's data(0) under partc train's loop
    hangs (until the watchdog speaks) while rank 0 waits in step 1's schedule; with a
    data limit of 0.5 s both watchdogs name rank 1 and data(step=0) within about a
    second. The general limit (60 s) plays no part."""
    store, said = FakeStore(), threading.Event()
    reports: list[str] = []

    def on_stuck(message: str) -> None:
        reports.append(message)
        said.set()

    dogs = [Watchdog(store, rank=r, world_size=2, limit=60.0, limits={DATA: 0.5},
                     on_stuck=on_stuck) for r in range(2)]
    dogs[0].mark("schedule", step=1)

    def data(step: int):
        said.wait(timeout=30)   # a loader that hangs
        raise RuntimeError("the loader gave up")

    start = time.monotonic()
    try:
        for dog in dogs:
            dog.start()
        with pytest.raises(FactoryError, match="the loader gave up"):
            launcher.train(_Rank(dogs[1]), SimpleNamespace(param_groups=[]),
                           {"data": data}, TrainConfig(target="m.py:f", steps=2))
    finally:
        for dog in dogs:
            dog.stop()
    elapsed = time.monotonic() - start
    assert reports and all(re.search(r"rank 1 spent 0\.[5-9]\d* s in data\(step=0\) while "
                                     r"other ranks waited for it", r) for r in reports), reports
    assert 0.5 < elapsed < 5, elapsed


def test_phase_limits_default_under_the_collective_timeout(monkeypatch):
    for name in ("PARTC_TIMEOUT_S", "PARTC_WATCHDOG_DATA_S", "PARTC_WATCHDOG_SAVE_S",
                 "PARTC_WATCHDOG_LOAD_S"):
        monkeypatch.delenv(name, raising=False)
    assert phase_limits_from_env() == {"data": 540.0, "checkpoint save": 540.0,
                                       "checkpoint load": 540.0}
    monkeypatch.setenv("PARTC_TIMEOUT_S", "100")
    monkeypatch.setenv("PARTC_WATCHDOG_DATA_S", "7")
    monkeypatch.setenv("PARTC_WATCHDOG_LOAD_S", "0")   # loads not judged
    assert phase_limits_from_env() == {"data": 7.0, "checkpoint save": 90.0}
    monkeypatch.setenv("PARTC_WATCHDOG_SAVE_S", "soon")
    with pytest.raises(ValueError, match="PARTC_WATCHDOG_SAVE_S"):
        phase_limits_from_env()


def test_the_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("PARTC_WATCHDOG_S", raising=False)
    assert limit_from_env() == 60.0
    monkeypatch.setenv("PARTC_WATCHDOG_S", "0")
    assert limit_from_env() == 0.0
    for bad in ("soon", "-1", "inf", "nan"):
        monkeypatch.setenv("PARTC_WATCHDOG_S", bad)
        with pytest.raises(ValueError, match="PARTC_WATCHDOG_S"):
            limit_from_env()


def test_a_stopped_rank_ends_the_torchrun_job(tmp_path):
    """Rank 1 SIGSTOPs itself after step 1; rank 0 reports it within the limit and exits."""
    worker = Path(__file__).with_name("watchdog_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", str(worker)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARTC_TIMEOUT_S": "300",
           "PARTC_WATCHDOG_S": str(LIMIT)}
    job = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                           text=True, env=env, start_new_session=True)
    lines, stopped_at, reported_at = [], None, None
    try:
        for line in job.stderr:
            lines.append(line)
            if "rank 1 stops itself" in line:
                stopped_at = time.time()
            if "partc watchdog on rank 0" in line and reported_at is None:
                reported_at = time.time()
            closing = re.search(r"Sending process (\d+) closing signal SIGTERM", line)
            if closing:
                # The stopped rank takes torchrun's SIGTERM only once continued; else
                # torchrun waits 30 s before it kills it.
                try:
                    os.kill(int(closing.group(1)), signal.SIGCONT)
                except ProcessLookupError:
                    pass
        job.wait(timeout=120)
        ended_at = time.time()
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)  # the stopped rank, if torchrun left it
        except ProcessLookupError:
            pass
        job.wait()
    text = "".join(lines)
    assert stopped_at is not None, text[-4000:]
    assert reported_at is not None, text[-4000:]
    assert re.search(r"rank 1 made no progress for [\d.]+ s: no heartbeat", text), text[-4000:]
    assert "it was at step 1, phase 'between steps'" in text
    assert "this rank is at step 2, phase 'schedule" in text
    assert f"exitcode\x20\x20: {EXIT_CODE}" in text or f"exit code {EXIT_CODE}" in text
    assert job.returncode != 0
    assert "finished every step" not in text
    elapsed = reported_at - stopped_at
    print(f"watchdog: SIGSTOP of rank 1 to rank 0's exit: {elapsed:.1f} s (limit {LIMIT} s); "
          f"to torchrun's end: {ended_at - stopped_at:.1f} s")
    assert LIMIT <= elapsed + 0.5 and elapsed < LIMIT + 3.0, elapsed
