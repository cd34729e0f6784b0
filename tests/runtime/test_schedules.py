"""Every pipeline schedule torch runs trains exactly like one process: several virtual
stages per rank (looped and "V" placement), tied weights within a rank and across
ranks, recompute, data and tensor parallelism; what cannot run with parity is refused.

The default run is one torchrun of 4 processes (pp=2 ranks of 2 virtual stages, with
dp=2 or tp=2); ``pytest -m slow`` runs the whole matrix (7 schedules x 3 models x
{plain, recompute, full recompute, dp=2, dp=2 with recompute, tp=2, dp=2 under ZeRO-2
reducing per microbatch and once per step}),
which ``benchmarks/schedule_parity.py`` prints as a table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from partc.cost.schedules import SCHEDULE_TABLE, schedule, stages_of_rank

from .schedule_worker import (COMBINATIONS, MODELS, not_planned, parse, processes,
                              virtual_stages)
from .test_parity import assert_trains_like_one_process
from .test_parity import launch as launch_worker
from .test_parity import launched

WORKER = Path(__file__).with_name("schedule_worker.py")
DEFAULT = [
    "gpt-interleaved-1f1b-dp2-recompute",     # looped, GPT's tie across ranks, recompute
    "gpt2-zbv-zero-bubble-dp2-recompute",     # "V", GPT-2's tie within rank 0, split
                                              # backward through full + selective recompute
    "llama-dualpipev-tp2",                    # "V", tensor-parallel layers in each stage
    "gpt-looped-bfs-dp2-zero2",               # FSDP units in each virtual stage
    "gpt-zbv-zero-bubble-dp2-zero2",          # refused: split backward under FSDP
]


def launch(nproc: int, cases: list[str], out: Path) -> list[dict]:
    """Run the schedule worker under torchrun; return each rank's results."""
    return launch_worker(nproc, cases, out, worker=WORKER, timeout=1800)


def run(cases: list[str], tmp_path) -> list[dict]:
    return launch(processes(cases[0]), cases, tmp_path)


def check(ranks: list[dict], name: str) -> None:
    _, schedule_name, _ = parse(name)
    v = virtual_stages(schedule_name)
    pp = 2
    for rank, results in enumerate(ranks):
        seen = results[name]
        assert "refused" not in seen, f"rank {rank}: {seen['refused']}"
        assert_trains_like_one_process(rank, seen)
        # The clipped norm counts every weight once, tied ones held by two stages too.
        assert seen["grad_norms"] == pytest.approx(seen["ref_grad_norms"], rel=1e-5)
        # The whole model back from every virtual stage, and loaded again unchanged.
        assert seen["full_state_keys"] == [] and seen["full_state_error"] < 1e-5
        assert seen["reloaded_unchanged"], seen["changed_by_reload"]
        assert seen["eval_loss"] == pytest.approx(seen["ref_eval_loss"], rel=1e-5)
        # Each pipeline rank holds the virtual stages the schedule places on it.
        pp_rank = seen["stage"]
        if parse(name)[2] == "planned":  # the planner chose v
            v = len(seen["virtual_stages"])
        assert tuple(seen["virtual_stages"]) == stages_of_rank(schedule_name, pp, v, pp_rank)
        assert seen["schedule"] == schedule_name
        if parse(name)[2].endswith("zero2-step"):   # each unit reduce-scattered once a step
            assert seen["reduces_once"]
            assert seen["fsdp_reduces"] == [seen["fsdp_units"]] * len(seen["fsdp_reduces"])


default_ranks = launched("default_ranks", 4, DEFAULT, worker="schedule_worker")


@pytest.mark.parametrize("name", [n for n in DEFAULT if not n.endswith("zbv-zero-bubble-dp2-zero2")])
def test_schedule_trains_like_one_process(default_ranks, name):
    check(default_ranks, name)


def test_split_backward_under_fsdp_is_refused(default_ranks):
    for results in default_ranks:
        why = results["gpt-zbv-zero-bubble-dp2-zero2"]["refused"]
        assert "zbv-zero-bubble splits backward" in why and "ZeRO-2" in why


def test_v_placement_ties_the_embedding_within_rank_zero(default_ranks):
    # GPT-2's embedding and head are virtual stages 0 and 3, both on rank 0: one
    # parameter there (under one of its two names), none on rank 1 (blocks only).
    tied = {"transformer.wte.weight", "lm_head.weight"}
    for results in default_ranks:
        seen = results["gpt2-zbv-zero-bubble-dp2-recompute"]
        held = tied & set(seen["param_errors"])
        assert len(held) == (1 if seen["stage"] == 0 else 0), (seen["stage"], held)


MATRIX = [f"{m}-{s}-{c}" for m in MODELS for s in SCHEDULE_TABLE for c in COMBINATIONS]


def refused(name: str) -> bool:
    """What the runtime refuses: a split backward under FSDP."""
    _, schedule_name, combination = parse(name)
    return schedule(schedule_name).split_backward and "zero2" in combination


@pytest.fixture(scope="module")
def matrix_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    found = {}
    for nproc in (2, 4):
        cases = [c for c in MATRIX if processes(c) == nproc]
        ranks = launch(nproc, cases, tmp_path_factory.mktemp(f"matrix{nproc}"))
        found.update({case: ranks for case in cases})
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", MATRIX)
def test_matrix(matrix_ranks, name):
    if not_planned(name):
        pytest.skip(not_planned(name))
    if refused(name):
        assert all("splits backward" in r[name]["refused"] for r in matrix_ranks[name])
    else:
        check(matrix_ranks[name], name)


@pytest.mark.slow
def test_a_checkpoint_of_virtual_stages_loads_into_another_schedule(tmp_path):
    # Saved by "V" stages (GPT-2's tied weight on rank 0's two stages), loaded by 1F1B.
    name = "checkpoint:gpt2-zbv-zero-bubble-dp2"
    for results in launch(4, [name], tmp_path):
        seen = results[name]
        assert "error" not in seen, seen.get("traceback")
        assert seen["step"] == 1 and seen["keys_differ"] == []
        assert seen["losses"][0] == pytest.approx(seen["losses"][1], rel=1e-6)
        assert seen["state_error"] < 1e-6


def test_the_matrix_names_every_schedule_and_combination():
    assert {parse(n)[1] for n in MATRIX} == set(SCHEDULE_TABLE)
    assert {parse(n)[2] for n in MATRIX} >= {"plain", "recompute", "dp2", "tp2"}
    assert {parse(n)[0] for n in MATRIX} == {"gpt", "llama", "gpt2"}
