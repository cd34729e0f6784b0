"""The batch digest (partc/runtime/batch_digest.py) in one process: what it sees, that a
replica's rows digest alike whether given alone or inside the global batch, and the
verdict over every rank's digests, each rank's slots summed as the step's all-reduce
sums them. Under torchrun, a pipeline whose last stage is given another batch is
refused in test_distributed_optimizer.py (optimizer_worker's ``-rankbatch-`` case)."""

from __future__ import annotations

import pytest
import torch

import partc
from partc.codec import from_data, to_data
from partc.runtime.batch_check import BatchCheck
from partc.runtime.batch_digest import GLOBAL, ROWS, BatchDigests, describe, digest
from partc.runtime.topology import Topology

BATCH, SEQ = 8, 6


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _digests(rank: int, *, pp: int, dp: int, tp: int = 1, every: int = 1) -> BatchDigests:
    tp_rank, rest = rank % tp, rank // tp
    topology = Topology(rank=rank, world_size=pp * dp * tp, pp=pp, dp=dp, pp_rank=rest // dp,
                        dp_rank=rest % dp, device=torch.device("cpu"), mesh=None, tp=tp,
                        tp_rank=tp_rank)
    batches = BatchCheck(inputs=(), target=None, global_batch_size=BATCH, dp=dp,
                         dp_rank=rest % dp)
    return BatchDigests(topology, batches, every)


def _reduced(given: list[tuple[torch.Tensor, torch.Tensor]], **mesh) -> tuple:
    """Every rank's slots summed (what the all-reduce hands each rank), and rank 0's
    check: ``given[r]`` is rank r's (inputs, target)."""
    checks = [_digests(rank, **mesh) for rank in range(len(given))]
    total = sum(check.measure(5, (x,), y) for check, (x, y) in zip(checks, given))
    return checks[0], tuple(total.tolist())


def test_a_changed_byte_rows_in_another_order_or_another_dtype_change_the_digest():
    x, y = _batch(0)
    assert digest([x, y]) == digest([x.clone(), y.clone()]) < 2 ** 48
    changed = y.clone()
    changed[3, 2] += 1
    assert digest([x, changed]) != digest([x, y])
    assert digest([x[[1, 0, *range(2, BATCH)]], y]) != digest([x, y])
    assert digest([x.to(torch.int32), y]) != digest([x, y])
    assert digest([y, x]) != digest([x, y])
    assert digest([x.float().bfloat16(), y]) == digest([x.float().bfloat16(), y])


def test_a_replica_digests_its_rows_alike_given_alone_or_in_the_global_batch():
    x, y = _batch(1)
    for dp_rank in range(2):
        check = _digests(dp_rank, pp=1, dp=2)
        rows = slice(dp_rank * BATCH // 2, (dp_rank + 1) * BATCH // 2)
        whole = check.measure(1, (x,), y).tolist()
        alone = check.measure(1, (x[rows],), y[rows]).tolist()
        mine = slice(4 * dp_rank, 4 * dp_rank + 2)
        assert whole[mine] == alone[mine] and whole[mine][0] >= 0
        assert alone[4 * dp_rank + 2:4 * dp_rank + 4] == [-1.0, -1.0]  # no global sample
        assert sum(v != 0 for v in whole) == 4   # only this rank's slots


def test_a_pipeline_stage_given_another_batch_is_named_with_its_replica_and_the_step():
    """pp=2 x dp=2: rank 3 (the last stage of replica 1) is given another batch's rows."""
    same, other = _batch(2), _batch(3)
    check, values = _reduced([same, same, same, other], pp=2, dp=2)
    found = check.verdict(5, values)
    assert (found.what, found.ranks, found.replica, found.step) == (ROWS, (1, 3), 1, 5)
    message = describe(found, check._topology)
    assert message.startswith("step 5: rank 1 (stage 0, replica 1) and rank 3 (stage 1, "
                              "replica 1) were given different rows of data-parallel "
                              "replica 1")
    assert "no parameter has changed" in message and "data(4)" in message
    with pytest.raises(partc.BatchMismatchError) as raised:
        check.judge(5, values)
    assert raised.value.step == 5 and raised.value.ranks == (1, 3)
    # Without data parallelism the pair is simply given different batches.
    check, values = _reduced([same, other], pp=2, dp=1)
    assert "were given different batches (digests" in describe(check.verdict(5, values),
                                                               check._topology)


def test_replicas_given_their_own_rows_agree_but_not_different_global_batches():
    x, y = _batch(4)
    rows = [(x[:4], y[:4]), (x[4:], y[4:])]
    check, values = _reduced(rows, pp=1, dp=2)
    assert check.verdict(5, values) is None
    check, values = _reduced([(x, y), (x, y)], pp=1, dp=2)
    assert check.verdict(5, values) is None
    check, values = _reduced([(x, y), _batch(5)], pp=1, dp=2)   # a loader seeded by rank
    found = check.verdict(5, values)
    assert (found.what, found.ranks) == (GLOBAL, (0, 1))
    assert "were given different global batches" in describe(found, check._topology)
    # tp ranks of a replica must agree: pp=1 x dp=1 x tp=2.
    check, values = _reduced([(x, y), _batch(6)], pp=1, dp=1, tp=2)
    assert check.verdict(5, values).ranks == (0, 1)
    assert "rank 1 (stage 0, tp rank 1)" in describe(check.verdict(5, values),
                                                      check._topology)


def test_steps_checked_every_n_and_never_when_off():
    assert [_digests(0, pp=1, dp=1, every=3).checks(s) for s in range(1, 8)] == \
        [True, False, False, True, False, False, True]
    assert not any(_digests(0, pp=1, dp=1, every=0).checks(s) for s in range(1, 8))
    assert _digests(0, pp=1, dp=1, every=0).measure(1, _batch(0)[:1], None) is None


def test_batch_check_every_is_a_count_written_only_when_not_the_default():
    spec = partc.TrainSpec
    assert spec(global_batch_size=4).batch_check_every == 1
    assert "batch_check_every" not in to_data(spec(global_batch_size=4))
    sparse = spec(global_batch_size=4, batch_check_every=10)
    assert from_data(spec, to_data(sparse)) == sparse
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="batch_check_every"):
            spec(global_batch_size=4, batch_check_every=bad)
