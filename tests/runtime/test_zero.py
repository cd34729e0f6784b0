"""ZeRO-1 (``Constraints(zero_stage=1)``, ``module.optimizer(...)``) against one process.

Each data-parallel rank keeps the optimizer state (SGD momentum) of its share of the
parameters only, steps them and sends them to the other replica
(``ZeroRedundancyOptimizer`` over the dp group). Cases: dp=2 on the sample GPT and on
GPT-2 with gradient clipping, pp=2 x dp=2, and dp=2 x tp=2 on Llama. Checks: losses and
parameters within 1e-5 of one process; the momentum buffers on a rank cover only part of
its parameters, and the dp replicas' buffers together cover all of them exactly once.
"""

from __future__ import annotations

import pytest

from .test_parity import launch

TWO = ["gpt-dp2-zero1", "gpt2-dp2-zero1-clip"]
FOUR = ["gpt-pp2-dp2-zero1", "llama-dp2-tp2-zero1"]


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    return launch(2, TWO, tmp_path_factory.mktemp("zero2"))


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    return launch(4, FOUR, tmp_path_factory.mktemp("zero4"))


def _check(ranks: list[dict], name: str) -> None:
    by_replica_group: dict[tuple, list[dict]] = {}
    for rank, results in enumerate(ranks):
        result = results[name]
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert result["zero_stage"] == 1 and result["mesh"]["dp"] == 2
        for ours, ref in zip(result["losses"], result["ref_losses"]):
            assert ours == pytest.approx(ref, rel=1e-5)
        for ours, ref in zip(result["grad_norms"], result["ref_grad_norms"]):
            assert ours == pytest.approx(ref, rel=1e-5)
        assert max(result["param_errors"].values()) < 1e-5
        assert 0 < result["optimizer_state_numel"] < result["own_params"]
        # Ranks holding the same parameters (same stage and tp shard) form a dp group.
        key = (result["stage"], rank % result["mesh"]["tp"])
        by_replica_group.setdefault(key, []).append(result)
    for group in by_replica_group.values():
        assert len(group) == 2
        assert sum(r["optimizer_state_numel"] for r in group) == group[0]["own_params"]


@pytest.mark.parametrize("name", TWO)
def test_zero1_matches_one_process_on_two(two, name):
    _check(two, name)


@pytest.mark.parametrize("name", FOUR)
def test_zero1_matches_one_process_on_four(four, name):
    _check(four, name)
