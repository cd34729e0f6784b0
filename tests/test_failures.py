"""How ``partc train`` ends on a failure (partc/cli/failures.py): the exit status of each
kind of error, the one line, which rank says it, and the resume with nothing to train
that answers without torch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

import partc
from partc.cli import failures, launcher
from partc.cli.config import TrainConfig
from partc.cli.main import UsageError
from partc.runtime import checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("error, status", [
    (UsageError("partc train: error: argument --pp"), failures.BAD_INPUT),
    (ValueError("steps must be at least 1"), failures.BAD_INPUT),
    (partc.FactoryError("data(3) raised"), failures.BAD_INPUT),
    (partc.TraceError("cannot trace"), failures.BAD_INPUT),
    (partc.PlanInfeasibleError("no plan fits"), failures.NO_PLAN),
    (partc.PlanMismatchError("plan hash differs"), failures.PLAN_MISMATCH),
    (partc.NonFiniteError("loss nan", step=3, what=("loss",), loss=float("nan"),
                          grad_norm=None), failures.NON_FINITE),
    (partc.CheckpointError("disk full"), failures.CHECKPOINT),
    (dist.DistBackendError("Connection closed by peer"), failures.HANG),
    (TimeoutError("collective timed out"), failures.HANG),
    (KeyError("a bug"), failures.INTERNAL),
])
def test_each_kind_of_failure_has_its_exit_status(error, status):
    assert failures.exit_status(error) == status
    assert len({code for code, _ in failures.EXIT_STATUSES}) == len(failures.EXIT_STATUSES)


def test_one_line_names_the_rank_and_the_kind(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    error = partc.CheckpointError("/ckpt is in use by another job")
    assert failures.report(error, "partc train") == failures.CHECKPOINT
    assert capsys.readouterr().err == ("partc train: CheckpointError: /ckpt is in use by "
                                       "another job [rank 0; exit 6: checkpoint]\n")
    # a bug: its traceback, then the line
    monkeypatch.setenv("WORLD_SIZE", "1")
    try:
        {}["x"]
    except KeyError as bug:
        assert failures.report(bug, "partc train") == failures.INTERNAL
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.endswith("partc train: KeyError: 'x' [exit 1: internal error]\n")


def test_the_first_rank_to_fail_says_it_the_others_stay_quiet(monkeypatch, capsys):
    """The ranks claim the failure in the torchrun agent's store (here one of the
    test's): the first to claim prints, the next does not."""
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5))
    for key, value in {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                       "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("RANK", "1")
    assert failures.report(partc.FactoryError("data(1) raised"), "partc train") == 2
    monkeypatch.setenv("RANK", "0")
    assert failures.report(dist.DistBackendError("peer gone"), "partc train") == 75
    err = capsys.readouterr().err
    assert err == "partc train: FactoryError: data(1) raised [rank 1; exit 2: bad input]\n"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")   # a restarted job: afresh
    assert failures.first_to_fail()
    del store


def test_the_users_data_error_names_the_step_and_the_line():
    def data(step):
        return {}["no such key"]   # the line the error names

    workload = {"data": data, "target": "m.py:f"}
    with pytest.raises(partc.FactoryError) as raised:
        launcher.data_batch(workload, 0)
    line = data.__code__.co_firstlineno + 1
    assert str(raised.value) == (f"data(0) of m.py:f raised KeyError at "
                                 f"test_failures.py:{line}: 'no such key'")


def test_nothing_to_train_answers_without_torch(tmp_path):
    """``--resume`` at or past ``--steps``: said from the manifest, before torch loads
    (the names it reads are the checkpoint module's)."""
    assert (launcher.LATEST, launcher.MANIFEST) == (checkpoint.LATEST, checkpoint.MANIFEST)
    root = tmp_path / "ckpt"
    (root / "step-00000004").mkdir(parents=True)
    (root / "latest").write_text("step-00000004")
    (root / "step-00000004" / "manifest.json").write_text(json.dumps(
        {"step": 4, "extra": {"launcher": {"seed": 0}}}))
    resume = TrainConfig(target="m.py:f", steps=4, checkpoint_dir=str(root), resume=True)
    assert launcher.finished_step(resume) == 4
    for other in ({"steps": 5}, {"seed": 1}, {"resume": False}):   # training to do, or
        assert launcher.finished_step(TrainConfig(**{**vars(resume), **other})) is None
    script = ("import sys\nfrom partc.cli.main import main\n"
              f"assert main(['train', 'nowhere.py:f', '--steps', '4', '--checkpoint-dir', "
              f"{str(root)!r}, '--resume']) == 0\n"
              "assert 'torch' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "nothing to train: the checkpoint is at step 4, --steps is 4\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("exitcode, status, says", [
    (6, 6, ""),                                    # the rank said why
    (-9, 137, "partc train: rank 1 was killed by SIGKILL (pid 42; SIGKILL is often the "
              "out-of-memory killer) [exit 137]\n")])
def test_the_standalone_launch_ends_with_the_failing_ranks_status(monkeypatch, capsys,
                                                                   exitcode, status, says):
    """``--nproc-per-node``: torchrun's launch in this process; its failure report becomes
    the first failing rank's exit status, and a line only where the rank could say
    nothing (killed by a signal)."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import (ChildFailedError,
                                                                  ProcessFailure)

    from partc.cli import standalone

    def failed(args):
        assert args.standalone and args.nproc_per_node == "2"
        assert args.training_script_args == ["train", "m.py:f", "--steps", "1"]
        raise ChildFailedError("partc", {1: ProcessFailure(local_rank=1, pid=42,
                                                           exitcode=exitcode,
                                                           error_file="<N/A>")})

    monkeypatch.setattr(torchrun, "run", failed)
    assert standalone.launch(2, ["m.py:f", "--steps", "1"]) == status
    assert capsys.readouterr().err == says


def test_each_rank_is_started_without_the_launch_flag():
    argv = ["m.py:f", "--nproc-per-node", "2", "--steps", "3", "--nproc-per-node=2", "-q"]
    assert launcher._without_nproc(argv) == ["m.py:f", "--steps", "3", "-q"]
