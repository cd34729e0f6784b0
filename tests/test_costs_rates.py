"""The rates the memory-bound ops, the optimizer step and fused attention run at
(``DeviceNumbers.elementwise_bandwidth``, ``optimizer_bandwidth``,
``attention_efficiency``), against numbers worked out by hand, and the planner against
brute force when a profile gives them.

Devices: 1e12 FLOP/s peak at efficiency 0.5 (5e11 achievable) and 1e11 bytes/s of HBM.
"""

import dataclasses
import random

import pytest
import torch

import partc
from partc.compiler import budget_from_info, device_numbers
from partc.cost.pipeline_config import PS_PER_S, PipelineConfig
from partc.cost.tables import build_cost_table
from partc.plan import BudgetInfo
from partc.problem import HeavyOp
from tests.planner import instances
from tests.planner.test_search import _matches_oracle

DEVICES = dataclasses.replace(instances.devices(1, 10**12), flops_efficiency=0.5,
                              hbm_bandwidth=1e11)


def _row(devices, layer, dp: int = 1, **config):
    """The layer's row on ``dp`` replicas of ``devices``, a batch of 2."""
    devices = dataclasses.replace(devices, num_devices=dp, memory_bytes=(10**12,) * dp)
    problem = instances.problem([layer], [], devices, batch=2)
    settings = dict(pp=1, micro_batch_size=2 // dp, num_microbatches=1, schedule="1f1b")
    return build_cost_table(problem, PipelineConfig(dp=dp, **settings | config)).layers[0]


def test_light_ops_move_their_bytes_at_the_elementwise_rate():
    """A weight-bound matmul and 1e7 bytes per sample of light ops, micro-batch 2: the
    light bytes take 2e7 / 1e11 = 0.2 ms at HBM bandwidth and 2 ms at an element-wise
    rate of 1e10 (twice that in backward, half under selective recompute); the matmul's
    roofline still reads its weight at HBM bandwidth (10.00002 ms)."""
    matmul = HeavyOp(flops=1e8, activation_bytes=1e3, weight_bytes=1e9)
    layer = dataclasses.replace(
        instances.layer("block", flops=1e8, selective=500.0, mem_bytes=1e7),
        heavy_ops=(matmul,))
    slow = dataclasses.replace(DEVICES, elementwise_bandwidth=1e10)
    for devices, light in ((DEVICES, 0.2e-3), (slow, 2e-3)):
        row = _row(devices, layer)
        assert row.forward_ps / PS_PER_S == pytest.approx(10.00002e-3 + light)
        assert row.backward_ps / PS_PER_S == pytest.approx(2 * (10.00002e-3 + light))
        assert row.recompute_ps["selective"] / PS_PER_S == pytest.approx(light / 2)
    # None is HBM bandwidth: the GPU presets' numbers are unchanged.
    assert DEVICES.light_op_bandwidth == DEVICES.hbm_bandwidth == 1e11


def test_the_optimizer_step_moves_its_bytes_at_the_optimizer_rate():
    """1e6 fp32 parameters under Adam: a step touches 28e6 bytes (gradient read, weight
    and two moments read and written): 0.28 ms at HBM bandwidth, 28 ms at an optimizer
    rate of 1e9; ZeRO-1 over two replicas steps half of them (the all-gather of the
    updated halves runs beside the next forward, not in the tail), after the runtime's
    passes over its fp32 gradient buckets: the mean over dp of its half (read and
    written) and their zeroing, 8e6 bytes at HBM bandwidth (1e11), 0.08 ms."""
    layer = instances.layer("block", flops=1e8, params=10**6)
    slow = dataclasses.replace(DEVICES, optimizer_bandwidth=1e9)
    assert _row(DEVICES, layer).tail_ps / PS_PER_S == pytest.approx(0.28e-3)
    assert _row(slow, layer).tail_ps / PS_PER_S == pytest.approx(28e-3)
    zero1 = _row(slow, layer, dp=2, zero_stage=1)
    assert zero1.tail_ps / PS_PER_S == pytest.approx(14e-3 + 0.08e-3)
    # The forward and backward do not depend on it.
    assert _row(slow, layer).forward_ps == _row(DEVICES, layer).forward_ps


def test_fused_attention_runs_at_the_attention_share_of_peak():
    """A block of a linear (1e8 FLOPs per sample) and a fused attention kernel (2e7
    FLOPs per sample, 1e7 more recomputed in backward), micro-batch 2, at 5e11 FLOP/s of
    matmul: forward 0.4 + 0.08 = 0.48 ms, backward 0.8 + 0.2 = 1.0 ms. At an attention
    share of 0.25 of the 1e12 peak the kernel takes twice as long (0.16 ms forward, 0.4
    backward) and the linear is unchanged; None leaves it at the matmuls' rate."""
    linear = HeavyOp(flops=1e8, activation_bytes=0.0, weight_bytes=0.0)
    attention = HeavyOp(flops=2e7, activation_bytes=0.0, weight_bytes=0.0,
                        bwd_extra_flops=1e7, attention=True)
    layer = dataclasses.replace(instances.layer("block", flops=1.2e8),
                                heavy_ops=(linear, attention))
    slow = dataclasses.replace(DEVICES, attention_efficiency=0.25)
    for devices, forward, backward in ((DEVICES, 0.48e-3, 1.0e-3),
                                       (slow, 0.56e-3, 1.2e-3)):
        row = _row(devices, layer)
        assert row.forward_ps / PS_PER_S == pytest.approx(forward)
        assert row.backward_ps / PS_PER_S == pytest.approx(backward)
        assert row.recompute_ps["full"] / PS_PER_S == pytest.approx(forward)
    # A linear marked otherwise is not affected by it.
    plain = dataclasses.replace(layer, heavy_ops=(linear, dataclasses.replace(
        attention, attention=False)))
    assert _row(slow, plain).forward_ps == _row(DEVICES, layer).forward_ps
    with pytest.raises(ValueError, match="DeviceNumbers.attention_efficiency must be None"):
        dataclasses.replace(DEVICES, attention_efficiency=0.0)


def test_the_hopper_presets_price_attention_below_their_matmuls():
    """H100 and H200 presets carry cuDNN's flash-attention share (0.5, see presets.py);
    a budget's own figure wins, a plan's budget keeps it, and a CPU has none (its
    attention runs at flops_efficiency, as before)."""
    h100 = partc.DeviceBudget(num_devices=8, device="H100")
    assert device_numbers(h100, torch.bfloat16).attention_efficiency == 0.5
    assert partc.PRESETS["H200"].attention_efficiency == 0.5
    given = partc.DeviceBudget(num_devices=8, device="H100", attention_efficiency=0.4)
    numbers = device_numbers(given, torch.bfloat16)
    assert numbers.attention_efficiency == 0.4
    again = budget_from_info(BudgetInfo.from_dict(given.to_dict(torch.bfloat16)))
    assert device_numbers(again, torch.bfloat16) == numbers
    cpu = partc.DeviceBudget(num_devices=2, device="CPU")
    assert device_numbers(cpu, torch.float32).attention_efficiency is None
    with pytest.raises(ValueError, match="DeviceBudget.attention_efficiency must be"):
        partc.DeviceBudget(num_devices=8, device="H100", attention_efficiency=1.5)


def test_rates_must_be_positive():
    for name in ("elementwise_bandwidth", "optimizer_bandwidth"):
        with pytest.raises(ValueError, match=f"DeviceNumbers.{name} must be None or a"):
            dataclasses.replace(DEVICES, **{name: 0.0})
        with pytest.raises(ValueError, match=f"DeviceBudget.{name} must be above 0"):
            partc.DeviceBudget(num_devices=2, device="CPU", **{name: 0})


def test_the_budget_resolves_the_rates_and_a_plan_keeps_them():
    """Given to DeviceBudget they reach DeviceNumbers and the plan's budget, and the
    budget a plan reads back prices alike. A Hopper preset runs element-wise ops and
    steps torch's AdamW at shares of HBM bandwidth (measured on an H100); an A100's
    element-wise ops, not measured, stream at HBM bandwidth."""
    budget = partc.DeviceBudget(num_devices=2, device="CPU", elementwise_bandwidth="8GB/s",
                                optimizer_bandwidth=2e9)
    numbers = device_numbers(budget, torch.float32)
    assert (numbers.elementwise_bandwidth, numbers.optimizer_bandwidth) == (8e9, 2e9)
    assert numbers.light_op_bandwidth == 8e9 and numbers.optimizer_step_bandwidth() == 2e9
    again = budget_from_info(BudgetInfo.from_dict(budget.to_dict()))
    assert device_numbers(again, torch.float32) == numbers
    h100 = device_numbers(partc.DeviceBudget(num_devices=8, device="H100"), torch.bfloat16)
    assert h100.hbm_bandwidth == partc.PRESETS["H100-80GB"].hbm_bandwidth
    assert h100.light_op_bandwidth == h100.elementwise_bandwidth \
        == pytest.approx(0.75 * h100.hbm_bandwidth)
    assert h100.optimizer_step_bandwidth() == pytest.approx(0.3 * h100.hbm_bandwidth)
    # torch's fused AdamW reads and writes each byte once: at HBM bandwidth.
    assert h100.optimizer_step_bandwidth(fused=True) == h100.hbm_bandwidth
    a100 = device_numbers(partc.DeviceBudget(num_devices=8, device="A100-80GB"), torch.bfloat16)
    assert a100.elementwise_bandwidth is None and a100.light_op_bandwidth == a100.hbm_bandwidth


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_plan_equals_brute_force_with_calibrated_rates(seed):
    """Random instances whose light ops, optimizer step and (some layers') heavy ops as
    fused attention run at rates of their own: the planner's plan is still brute force's
    optimum."""
    rng = random.Random(500 + seed)
    feasible = 0
    for _ in range(30):
        prob = instances.random_problem(rng)
        devices = dataclasses.replace(prob.devices,
                                      elementwise_bandwidth=rng.choice([1e8, 1e9, 1e10]),
                                      optimizer_bandwidth=rng.choice([1e6, 1e7, 1e9]),
                                      attention_efficiency=rng.choice([None, 0.3]))
        layers = tuple(dataclasses.replace(layer, heavy_ops=tuple(
            dataclasses.replace(op, attention=rng.random() < 0.5) for op in layer.heavy_ops))
            for layer in prob.model.layers)
        model = dataclasses.replace(prob.model, layers=layers)
        feasible += _matches_oracle(dataclasses.replace(prob, devices=devices, model=model))
    assert feasible > 10
