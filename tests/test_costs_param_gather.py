"""ZeRO-1's weight all-gather overlapped with the next step's forward
(``TrainSpec.overlap_param_gather``) costs what that forward cannot hide, and the first
bucket's all-gather, which the first layer waits for before any runs.

The hand-built instance: two layers of 30M parameters and 2e10 forward FLOPs on 2 devices
(1e12 FLOP/s, 1 GB/s links, no latency), dp = 2, one microbatch of one sample, ZeRO-1 in
fp32. Per layer: forward 20 ms, backward 40 ms and the gradients' add into their fp32
buckets (30M x 12 bytes at 1 TB/s, 0.36 ms), the optimizer step 15M x 28 bytes at 1
TB/s = 0.42 ms after the buckets' mean over dp (15M x 8 bytes) and zeroing (30M x 4
bytes), 0.24 ms, the gradient reduce-scatter and the weight all-gather 1/2 x 30M x 4
bytes at 1 GB/s = 60 ms each. The stage: of 120 ms of reduce-scatter, the last bucket's
(25M parameters, 50 ms) starts as backward ends and is charged whole once per step; the
other 70 ms run beside 80.72 ms of backward, which hides them (all at ``comm_overlap``
1, half at 0.5). Blocking, the 120 ms all-gather follows the step: tail 1.32 + 120 ms,
and 50 ms once per step. Overlapped, the first bucket's all-gather (50 ms) is waited for
before the first layer runs; of the other 70 ms the 40 ms forward hides 40 (all of it
at ``comm_overlap`` 1, half at 0.5): tail 1.32 + 30 ms, and 50 + 50 ms once per step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from partc.cost.evaluate import evaluate, exposed_gather_ps
from partc.cost.pipeline_config import PS_PER_S, PipelineConfig
from partc.cost.tables import build_cost_table

from .planner.instances import devices, layer, problem

MS = 1e-3
BACKWARD = 2 * (40 + 0.36)    # the stage's, in ms
TAIL = 2 * (0.42 + 0.24)      # its optimizer step and bucket passes
ZERO1 = PipelineConfig(pp=1, dp=2, micro_batch_size=1, num_microbatches=1, schedule="1f1b",
                       zero_stage=1)


def _instance(overlap: bool, comm_overlap: float = 1.0):
    prob = problem([layer(name, flops=2e10, params=30_000_000) for name in "ab"], [0.0],
                   devices(2, 10**12, bandwidth=1e9, overlap=comm_overlap), batch=2)
    return replace(prob, train=replace(prob.train, param_gather_overlap=overlap))


def _ms(ps: int) -> float:
    return ps / PS_PER_S / MS


def test_a_blocking_gather_is_in_the_tail():
    table = build_cost_table(_instance(False), ZERO1)
    assert [(_ms(r.tail_ps), r.gather_ps) for r in table.layers] == \
        [(pytest.approx(60.66), 0)] * 2
    assert table.first_gather_ps == 0
    assert _ms(table.tail_latency_ps) == _ms(table.last_sync_ps) == pytest.approx(50)
    evaluation = evaluate(table, [0, 0], ["none", "none"])
    assert _ms(evaluation.stages[0].tail_ps) == pytest.approx(TAIL + 120)
    assert _ms(evaluation.step_ps) == pytest.approx(40 + BACKWARD + TAIL + 120 + 50)


@pytest.mark.parametrize("comm_overlap, hidden", [(1.0, 40.0), (0.5, 20.0)])
def test_an_overlapped_gather_costs_its_first_bucket_and_what_forward_leaves(comm_overlap,
                                                                            hidden):
    table = build_cost_table(_instance(True, comm_overlap), ZERO1)
    assert [(_ms(r.tail_ps), _ms(r.gather_ps)) for r in table.layers] == \
        [(pytest.approx(0.66), pytest.approx(60))] * 2
    assert _ms(table.first_gather_ps) == _ms(table.last_sync_ps) == pytest.approx(50)
    assert table.tail_latency_ps == table.first_gather_ps + table.last_sync_ps
    evaluation = evaluate(table, [0, 0], ["none", "none"])
    exposed_sync = 70 - min(70, BACKWARD) * comm_overlap
    assert _ms(evaluation.stages[0].tail_ps) == pytest.approx(
        exposed_sync + TAIL + (70 - hidden))
    assert _ms(evaluation.step_ps) == pytest.approx(
        40 + BACKWARD + exposed_sync + TAIL + (70 - hidden) + 50 + 50)


def test_exposed_gather_by_hand():
    # 50 of 120 in the first bucket; a forward of 40 hides 40 of the other 70, one of
    # 100 all of them; a stage holding less than the first bucket hides nothing more.
    assert exposed_gather_ps(120, 40, 50) == 30
    assert exposed_gather_ps(120, 100, 50) == 0
    assert exposed_gather_ps(30, 100, 50) == 0
    assert exposed_gather_ps(120, 40, 50, overlap_permille=500) == 50


def test_the_trainings_bucket_size_is_priced():
    # TrainSpec.bucket_elements of 10M: the first and last buckets hold 10M parameters
    # (20 ms each way); backward hides 80.72 of the other 100 ms of reduce-scatter,
    # forward 40 of the other 100 ms of all-gather.
    prob = _instance(True)
    table = build_cost_table(replace(prob, train=replace(prob.train,
                                                         bucket_elements=10_000_000)), ZERO1)
    assert _ms(table.first_gather_ps) == _ms(table.last_sync_ps) == pytest.approx(20)
    evaluation = evaluate(table, [0, 0], ["none", "none"])
    assert _ms(evaluation.step_ps) == pytest.approx(
        40 + BACKWARD + (100 - BACKWARD) + TAIL + (100 - 40) + 20 + 20)
