"""samples/train_gpt.py suspended by a SIGTERM to torchrun and resumed on another
process count: every rank stops at the same step, saves it and exits with
SUSPEND_EXIT_CODE; the resumed run's losses are the uninterrupted run's.

Three runs of a tiny GPT (2 processes suspended, 1 process resumed, 1 process
uninterrupted as the reference; one process and two give the same losses to 1e-6 in
fp32, the data sampler giving each step the same samples on any dp degree).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from partc.runtime.suspend import SUSPEND_EXIT_CODE

# The sample saves with helper ckpt's module.save_checkpoint (partc/runtime/checkpoint.py).
ROOT = Path(__file__).resolve().parents[2]
SAMPLE = [str(ROOT / "samples" / "train_gpt.py"), "--layers", "1", "--width", "32",
          "--seq", "16", "--batch", "8"]
STEP = re.compile(r"^step (\d+) loss (\S+)", re.M)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("PARTC_STOP_SIGNALS", None)
    return env


def _losses(output: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in STEP.findall(output)}


def _suspended(tmp_path: Path) -> tuple[str, int]:
    """torchrun with 2 processes, SIGTERM to torchrun once step 3 is printed. Far more
    steps are asked for than run: the signal lands a step or two later, and every
    rank must stop at the same step whichever it is."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", *SAMPLE, "--steps", "1000", "--out",
               str(tmp_path / "program"), "--checkpoint-dir", str(tmp_path / "ckpt")]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(), cwd=ROOT)
    lines = []
    hung = threading.Timer(600, proc.kill)  # a run that stops printing ends the test
    hung.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step 3 loss"):
                proc.send_signal(signal.SIGTERM)
                break
        lines += proc.stdout.readlines()
        return "".join(lines), proc.wait(timeout=120)
    finally:
        hung.cancel()


def _run(tmp_path: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, *SAMPLE, "--out", str(tmp_path / "program1"),
                           *args], capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("suspend")
    suspended, code = _suspended(tmp_path)
    stops = re.findall(r"rank (\d): stopped at step (\d+) on a signal; exiting with (\d+)",
                       suspended)
    assert stops, suspended
    stopped = int(stops[0][1])
    steps = str(stopped + 3)
    resumed = _run(tmp_path, "--steps", steps, "--checkpoint-dir", str(tmp_path / "ckpt"),
                   "--resume")
    reference = _run(tmp_path, "--steps", steps)
    return dict(suspended=suspended, code=code, stops=stops, stopped=stopped,
                resumed=resumed, reference=reference, ckpt=tmp_path / "ckpt")


def test_every_rank_saves_the_same_step_and_exits_with_the_suspend_code(runs):
    assert sorted(rank for rank, _, _ in runs["stops"]) == ["0", "1"], runs["suspended"]
    assert {(step, code) for _, step, code in runs["stops"]} == {
        (str(runs["stopped"]), str(SUSPEND_EXIT_CODE))}
    assert 3 <= runs["stopped"] < 1000
    assert f"checkpoint: step {runs['stopped']} saved" in runs["suspended"]
    # torchrun forwarded the SIGTERM and did not have to SIGKILL anyone.
    assert "forcefully exiting via" not in runs["suspended"], runs["suspended"]


def test_the_resumed_run_on_one_process_continues_with_the_same_losses(runs):
    stopped = runs["stopped"]
    assert f"resumed from {runs['ckpt']} at step {stopped} on 1 processes" in runs["resumed"]
    reference, suspended = _losses(runs["reference"]), _losses(runs["suspended"])
    resumed = _losses(runs["resumed"])
    assert sorted(resumed) == list(range(stopped + 1, stopped + 4))
    for step, loss in suspended.items():
        assert loss == pytest.approx(reference[step], abs=1e-5), step
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], abs=1e-5), step
