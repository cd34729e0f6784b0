"""The cost model's per-op roofline, against numbers worked out by hand.

Devices: 1e12 FLOP/s peak at efficiency 0.5 (5e11 achievable) and 1e11 bytes/s of HBM.
"""

import dataclasses

import pytest

from partc.costs import PS_PER_S, PipelineConfig, build_cost_table, roofline_seconds
from partc.problem import HeavyOp
from tests.planner import instances

DEVICES = dataclasses.replace(instances.devices(1, 10**12), flops_efficiency=0.5,
                              hbm_bandwidth=1e11)


def test_compute_bound_op_takes_its_flops():
    # 4 samples: 4e9 FLOPs / 5e11 = 8 ms; (4 * 1e6 + 1e6) bytes / 1e11 = 50 us.
    op = HeavyOp(flops=1e9, activation_bytes=1e6, weight_bytes=1e6)
    assert roofline_seconds([op], DEVICES, 4, 1.0) == pytest.approx((8e-3, 0.0))


def test_memory_bound_op_takes_its_bytes():
    # 2 samples: 2e6 FLOPs / 5e11 = 4 us; 2e8 bytes / 1e11 = 2 ms. Three such ops: 6 ms;
    # in bf16 of an fp32 trace (scale 0.5), half the bytes.
    op = HeavyOp(flops=1e6, activation_bytes=1e8, weight_bytes=0.0, count=3)
    assert roofline_seconds([op], DEVICES, 2, 1.0) == pytest.approx((0.0, 6e-3))
    assert roofline_seconds([op], DEVICES, 2, 0.5) == pytest.approx((0.0, 3e-3))


def test_weight_is_read_once_per_microbatch():
    # A 1 GB weight: one sample is bound by reading it (1e9 + 1e3 bytes / 1e11 = 10.00001
    # ms against 0.2 ms of FLOPs); two samples read it once, not twice; a hundred samples
    # are bound by their FLOPs (20 ms against 10.001 ms of bytes).
    op = HeavyOp(flops=1e8, activation_bytes=1e3, weight_bytes=1e9)
    assert roofline_seconds([op], DEVICES, 1, 1.0) == pytest.approx((0.0, 10.00001e-3))
    assert roofline_seconds([op], DEVICES, 2, 1.0) == pytest.approx((0.0, 10.00002e-3))
    assert roofline_seconds([op], DEVICES, 100, 1.0) == pytest.approx((20e-3, 0.0))


def test_layer_rows_price_each_op_at_its_roofline():
    """A layer of a weight-bound matmul, two compute-bound attention-like ops and 1e7
    bytes per sample of light ops, micro-batch 2: backward is twice the forward, full
    recompute the forward again, selective only light bytes."""
    matmul = HeavyOp(flops=1e8, activation_bytes=1e3, weight_bytes=1e9)
    score = HeavyOp(flops=1e9, activation_bytes=1e6, weight_bytes=0.0, count=2)
    layer = dataclasses.replace(
        instances.layer("block", flops=2.1e9, selective=500.0, mem_bytes=1e7),
        heavy_ops=(matmul, score))
    problem = instances.problem([layer], [], DEVICES, batch=2)
    config = PipelineConfig(pp=1, dp=1, micro_batch_size=2, num_microbatches=1,
                            schedule="1f1b")
    row = build_cost_table(problem, config).layers[0]
    # matmul: memory-bound, 10.00002 ms; score: 2 x max(4 ms, 20 us) = 8 ms; light:
    # 2e7 bytes / 1e11 = 0.2 ms.
    forward = 10.00002e-3 + 8e-3 + 0.2e-3
    assert row.forward_ps == pytest.approx(forward * PS_PER_S, abs=2)
    assert row.backward_ps == pytest.approx(2 * forward * PS_PER_S, abs=2)
    assert row.recompute_ps["full"] == pytest.approx(forward * PS_PER_S, abs=2)
    # instances.layer's selective mode reruns half the light bytes and no heavy op.
    assert row.recompute_ps["selective"] == pytest.approx(0.1e-3 * PS_PER_S, abs=2)
    assert row.recompute_ps["none"] == 0


def test_heavy_ops_must_account_for_the_layers_flops():
    with pytest.raises(ValueError, match="heavy_ops"):
        dataclasses.replace(instances.layer("block", flops=1e9),
                            heavy_ops=(HeavyOp(flops=5e8, activation_bytes=0.0,
                                               weight_bytes=0.0),))


def test_a_fused_kernels_recomputed_scores_add_backward_flops():
    # Backward of a compute-bound op is its two gradient ops, 2 x 8 ms, plus what the fused
    # kernel recomputes: 5e8 FLOPs per sample, 4 samples at 5e11 FLOP/s = 4 ms more.
    op = HeavyOp(flops=1e9, activation_bytes=1e6, weight_bytes=1e6, bwd_extra_flops=5e8)
    assert roofline_seconds([op], DEVICES, 4, 1.0, backward=True) == pytest.approx(
        (20e-3, 0.0))
