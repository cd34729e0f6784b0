"""``partc train`` under torchrun (2 processes, the sample GPT made tiny): telemetry lines
on rank 0 and JSON lines on every rank, the loss falls as in one process (AdamW, warm-up
and cosine), and ``module.evaluate`` gives the loss of one process on the same weights,
through a pipeline (pp=2, before training too) and over data-parallel replicas (dp=2,
ZeRO-3), changing nothing. Checkpoints: 4 steps on pp=2 saved every 2, resumed with
``--resume --steps 6`` on dp=2, continue at step 5 with the losses of 6 uninterrupted
steps; a resume with another seed is refused. ``--data``: a token file on dp=2, each rank
reading its replica's rows, with one process's losses, for the sample GPT and for a Hugging
Face causal LM named by its config (fed its own batches)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from partc.runtime.checkpoint import step_name

from .launcher_worker import STEPS

WORKER = Path(__file__).with_name("launcher_worker.py")
RTOL = 1e-5


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[list[dict], str, Path]:
    out = tmp_path_factory.mktemp("launcher")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", str(WORKER), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARTC_TIMEOUT_S": "120"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    files = [out / f"rank{r}.json" for r in range(2)]
    if done.returncode != 0 or not all(f.exists() for f in files):
        pytest.fail(f"torchrun exited with {done.returncode}; stderr tail:\n"
                    f"{done.stderr[-4000:]}")
    return [json.loads(f.read_text()) for f in files], done.stdout, out / "telemetry"


def test_telemetry_lines_and_json_per_rank(launched):
    ranks, stdout, telemetry = launched
    for step in range(1, STEPS + 1):
        assert f"step {step}  loss " in stdout   # rank 0's console line
    assert f"step {STEPS}  eval loss " in stdout
    for rank in range(2):
        lines = [json.loads(x) for x in (telemetry / f"rank{rank}.jsonl").read_text()
                 .splitlines()]
        steps = [x for x in lines if x["event"] == "step"]
        assert [x["step"] for x in steps] == list(range(1, STEPS + 1))
        for record in steps:
            assert record["rank"] == rank and record["stage"] == ranks[rank]["pp2"]["stage"]
            assert record["timed"] == "forward_backward + optimizer step"
            for key in ("step_time_s", "tokens_per_s", "mfu", "grad_norm", "lr",
                        "predicted_step_time_s", "predicted_memory_bytes", "memory_bytes"):
                assert math.isfinite(record[key]) and record[key] > 0, (rank, key, record)
        # every rank reports the same loss, the one forward_backward returned
        assert [x["loss"] for x in steps] == pytest.approx(ranks[rank]["pp2"]["losses"])
        evals = [x for x in lines if x["event"] == "eval"]
        assert [x["step"] for x in evals] == [STEPS]


def test_the_loss_falls_as_in_one_process(launched):
    for results in launched[0]:
        for case in ("pp2", "dp2"):
            seen = results[case]
            assert seen["losses"] == pytest.approx(seen["ref_losses"], rel=RTOL), case
    losses = launched[0][0]["pp2"]["losses"]
    assert losses[-1] < losses[0] - 0.3, losses


def test_training_on_a_token_file_reads_each_replicas_rows_as_in_one_process(launched):
    """``--data`` on dp=2: each rank trains on half of each step's samples (rows 4 of 8),
    and the losses are one process's on the whole batches, falling."""
    for results in launched[0]:
        seen = results["data"]
        assert seen["mesh"] == {"pp": 1, "dp": 2, "tp": 1} and seen["rows"] == [4, 8]
        assert seen["losses"] == pytest.approx(seen["ref_losses"], rel=RTOL)
        evaluation = seen["evaluations"][0]   # --eval-data: the text's first batch
        assert evaluation["loss"] == pytest.approx(evaluation["reference"], rel=RTOL)
    losses = launched[0][0]["data"]["losses"]
    assert losses[-1] < losses[0] - 0.3, losses


def test_a_hugging_face_model_trains_on_a_token_file_in_its_own_batches(launched):
    """``partc train qwen2 --hf-config ... --data FILE`` on dp=2: each rank is handed its
    rows as the model is called, ``model(**batch)``, and their next tokens as the target,
    and the losses are one process's on the whole batches."""
    for results in launched[0]:
        seen = results["hf-data"]
        assert seen["mesh"] == {"pp": 1, "dp": 2, "tp": 1}
        assert (seen["keys"], seen["rows"], seen["target"]) == (
            ["input_ids"], 4, [4, 16])
        assert seen["losses"] == pytest.approx(seen["ref_losses"], rel=RTOL)
    losses = launched[0][0]["hf-data"]["losses"]
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.parametrize("case, mesh, evaluations", [
    ("pp2", {"pp": 2, "dp": 1, "tp": 1}, 2),   # before training too
    ("dp2", {"pp": 1, "dp": 2, "tp": 1}, 1)])
def test_evaluate_is_one_process_loss_and_changes_nothing(launched, case, mesh, evaluations):
    ranks = launched[0]
    for rank, results in enumerate(ranks):
        seen = results[case]
        assert seen["mesh"] == mesh
        assert len(seen["evaluations"]) == evaluations
        for index, evaluation in enumerate(seen["evaluations"]):
            assert evaluation["loss"] == pytest.approx(evaluation["reference"], rel=RTOL), rank
            # the same on every rank
            assert evaluation["loss"] == ranks[0][case]["evaluations"][index]["loss"]
            assert evaluation["unchanged"] and evaluation["no_grads"], rank
    # the telemetry's eval line is the last evaluation's loss
    if case == "pp2":
        lines = (launched[2] / "rank0.jsonl").read_text().splitlines()
        evals = [json.loads(x) for x in lines if '"eval"' in x]
        assert evals[-1]["eval_loss"] == pytest.approx(seen["evaluations"][-1]["loss"])


def test_a_resumed_launch_on_another_plan_continues_the_run(launched):
    ranks, _, telemetry = launched
    for results in ranks:
        seen = results["resume"]
        first, resumed, whole = seen["first"], seen["resumed"], seen["whole"]
        assert (first["status"], first["start"], len(first["losses"])) == (0, 0, 4)
        assert seen["kept"] == ["latest", step_name(4)]   # --keep 1
        assert (resumed["status"], resumed["start"], len(resumed["losses"])) == (0, 4, 2)
        assert first["losses"] + resumed["losses"] == pytest.approx(whole["losses"], rel=RTOL)
        assert "--seed 1" in seen["other_seed"]["refused"]
    # telemetry numbers the resumed run's steps from the checkpoint's
    lines = [json.loads(x) for x in (telemetry.parent / "resumed" / "rank0.jsonl")
             .read_text().splitlines()]
    assert [x["step"] for x in lines if x["event"] == "step"] == [5, 6]


RESTARTED = '''
import os, signal, sys
sys.path.insert(0, {root!r})
from samples import gpt


def small():
    made = gpt.factory(global_batch=8, seq=16, layers=2, width=32)
    data = made["data"]

    def dying(step):
        # The first attempt's rank 1 dies as it reads step 3's batch.
        if step == 2 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" \\
                and os.environ.get("RANK") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return data(step)

    made["data"] = dying
    return made
'''


def test_a_rank_that_dies_restarts_the_job_from_its_checkpoint(tmp_path):
    """Under ``torchrun --max-restarts=1`` a rank killed in step 3 makes torchrun restart
    the job; the same command (with ``--resume``) continues from the step-2 checkpoint.
    (The restarted ranks join a process group whose store still holds the first
    attempt's keys: partc keys each attempt apart, partc/runtime/topology.py.)"""
    factory = tmp_path / "restarted.py"
    factory.write_text(RESTARTED.format(root=str(Path(__file__).resolve().parents[2])))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--max-restarts=1", "-m", "partc", "train",
               f"{factory}:small", "--steps", "4", "--pp", "2", "--lr", "3e-3",
               "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2",
               "--resume"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARTC_TIMEOUT_S": "120",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    # About 15 s; without the per-attempt keys the restarted job hangs in its first
    # collective, so the limit is short.
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "exitcode: -9" in done.stderr                     # the first attempt's rank 1
    assert "at step 2 on 2 processes" in done.stdout         # resumed after the restart
    assert done.stdout.count("step 2  loss") == 1            # not trained again
    assert "step 4  loss" in done.stdout and "checkpoint: step 4 saved" in done.stdout


def test_a_failure_on_every_rank_is_one_line_and_its_exit_status(tmp_path):
    """``partc train --nproc-per-node 2`` with a factory that raises on every rank: one
    line on stderr, from the first rank to fail, naming the error, its file and line;
    none of torchrun's log; the exit status says bad input (partc/cli/failures.py)."""
    factory = tmp_path / "broken.py"
    factory.write_text("def f():\n    raise RuntimeError('no tokens at /data/shard-0')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-m", "partc", "train", f"{factory}:f",
                           "--steps", "1", "--nproc-per-node", "2"], capture_output=True,
                          text=True, timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"partc train: FactoryError: {factory}:f raised "
                                  "RuntimeError at broken.py:2: no tokens at /data/shard-0 "
                                  "[rank "), done.stderr
    assert done.stderr.endswith("; exit 2: bad input]\n")
