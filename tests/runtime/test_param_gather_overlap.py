"""ZeRO-1's parameter all-gather overlapped with the next forward
(``TrainSpec.overlap_param_gather``; ``gather_worker.py`` under torchrun, Adam, buckets
of 4096 elements so that every stage spans several).

- The overlapped run equals the run that finishes the all-gathers inside
  ``optimizer.step()`` bit for bit: losses of every step and the final parameters, on
  the sample GPT and Hugging Face Llama, fp32 and bf16 (parity of both with one process
  is ``test_distributed_optimizer.py``'s, which runs the default: overlapped).
- The all-gathers are in flight after ``step()``: every bucket's, and finishing them
  then changes parameters (it changes none without the overlap); the next forward's
  pre-hooks finish them in several waits, a layer's buckets each, with no wait outside
  the hooks, and none is left after the step's backward.
- A checkpoint saved right after ``step()``, all-gathers in flight, resumes to the same
  losses and parameters, bit for bit (fp32, where the parameters themselves are saved,
  and bf16, where the masters are).
The pipeline (pp=2 x dp=2) cases are slow: they run 4 processes; ``-v2`` is interleaved
1F1B with two virtual stages per rank, each waiting for its own buckets.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_parity import launch, launched, matrix

WORKER = Path(__file__).with_name("gather_worker.py")
CASES = ["gpt-fp32", "llama-bf16", "gpt-fp32-ckpt", "gpt-bf16-ckpt"]
FOUR_CASES = ["gpt-pp2-bf16", "llama-pp2-fp32", "gpt-pp2-v2-fp32", "gpt-pp2-fp32-ckpt"]


def _launch(cases: list[str], out: Path, nproc: int) -> list[dict]:
    return launch(nproc, cases, out, worker=WORKER)


two = launched("two", 2, CASES, worker="gather_worker")


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    return _launch(FOUR_CASES, tmp_path_factory.mktemp("gather_four"), 4)


def _check(ranks: list[dict], name: str) -> None:
    for rank, results in enumerate(ranks):
        seen = results[name]
        assert "error" not in seen, f"rank {rank}: {seen['traceback']}"
        if name.endswith("-ckpt"):
            _check_resume(rank, seen)
        else:
            _check_overlap(rank, seen, 2 if "-v2-" in name else 1)


def _check_overlap(rank: int, seen: dict, virtual_stages: int) -> None:
    assert seen["virtual_stages"] == virtual_stages
    assert seen["losses"] == seen["off_losses"], rank
    assert seen["differ"] == [], (rank, seen["differ"][:3])
    everything = list(reversed(range(seen["buckets"])))
    assert seen["buckets"] > 1
    assert seen["pending"] == [everything] * len(seen["losses"]), rank
    assert seen["off_pending"] == [[]] * len(seen["losses"]), rank
    assert seen["changed_by_wait"] > 0 and seen["off_changed_by_wait"] == 0, rank
    # The first step has nothing in flight; every later forward finishes it all in
    # pre-hooks, each for the buckets of one layer (the stage's own first: those of the
    # parameters outside its layers' modules).
    assert seen["hook_waits"][0] == []
    for waits in seen["hook_waits"][1:]:
        assert None not in waits and len(waits) > 1, (rank, waits)
        assert sorted({b for wait in waits for b in wait}, reverse=True) == everything
        assert len(waits[0]) < len(everything), (rank, waits)
    assert seen["waits_outside"] == 1, rank  # reading the parameters after the last step


def _check_resume(rank: int, seen: dict) -> None:
    assert seen["pending_at_save"], rank  # saved with all-gathers in flight
    assert seen["resumed_losses"] == seen["losses"], rank
    assert seen["differ"] == [], (rank, seen["differ"][:3])


# The default profile: bf16 (Llama) and a checkpoint saved with gathers in flight; the
# rest -m slow.
@pytest.mark.parametrize("name", matrix(CASES, {"llama-bf16", "gpt-fp32-ckpt"}))
def test_overlapped_gather(two, name):
    _check(two, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", FOUR_CASES)
def test_overlapped_gather_pipeline(four, name):
    _check(four, name)
