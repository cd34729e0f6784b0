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

from .test_parity import assert_trains_like_one_process, launched

TWO = ["gpt-dp2-zero1", "gpt2-dp2-zero1-clip"]
FOUR = ["gpt-pp2-dp2-zero1", "llama-dp2-tp2-zero1"]


zero2 = launched("zero2", 2, TWO)
zero4 = launched("zero4", 4, FOUR)


def _check(ranks: list[dict], name: str) -> None:
    by_replica_group: dict[tuple, list[dict]] = {}
    for rank, results in enumerate(ranks):
        result = results[name]
        assert_trains_like_one_process(rank, result)
        assert result["zero_stage"] == 1 and result["mesh"]["dp"] == 2
        for ours, ref in zip(result["grad_norms"], result["ref_grad_norms"]):
            assert ours == pytest.approx(ref, rel=1e-5)
        assert 0 < result["optimizer_state_numel"] < result["own_params"]
        # Ranks holding the same parameters (same stage and tp shard) form a dp group.
        key = (result["stage"], rank % result["mesh"]["tp"])
        by_replica_group.setdefault(key, []).append(result)
    for group in by_replica_group.values():
        assert len(group) == 2
        assert sum(r["optimizer_state_numel"] for r in group) == group[0]["own_params"]


@pytest.mark.parametrize("name", TWO)
def test_zero1_matches_one_process_on_two(zero2, name):
    _check(zero2, name)


@pytest.mark.parametrize("name", FOUR)
def test_zero1_matches_one_process_on_four(zero4, name):
    _check(zero4, name)
