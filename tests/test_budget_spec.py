"""DeviceBudget presets and overrides, TrainSpec and Constraints validation, units."""

import pytest
import torch

import partc
from partc.units import format_bytes, parse_bytes


def test_presets_carry_numbers_and_accept_overrides():
    for name in ("A100-40GB", "A100-80GB", "H100-80GB", "H200", "CPU"):
        budget = partc.DeviceBudget(num_devices=2, device=name)
        assert budget.peak_flops_for(torch.bfloat16) > 0
        assert budget.hbm_bytes_per_s > 0 and budget.memory_bytes[0] > 0
        # Whose autocast policy mixed precision is measured under.
        assert budget.device_type == ("cpu" if name == "CPU" else "cuda")
    budget = partc.DeviceBudget(num_devices=4, device="A100-80GB", memory="70GiB",
                                devices_per_node=2, inter_node_bandwidth="10GB/s",
                                peak_flops={"bfloat16": 100e12})
    assert budget.memory_bytes == (70 * 2**30,) * 4
    assert budget.node_size == 2 and budget.inter_node_bytes_per_s == 10e9
    assert budget.peak_flops_for(torch.bfloat16) == 100e12
    assert budget.peak_flops_for(torch.float32) == 19.5e12


def test_per_device_memory_and_errors():
    budget = partc.DeviceBudget(num_devices=2, device="CPU", memory=["1GiB", "2GiB"])
    assert budget.memory_bytes == (2**30, 2 * 2**30)
    with pytest.raises(ValueError, match="2 memory sizes given for 3 devices"):
        partc.DeviceBudget(num_devices=3, memory=["1GiB", "2GiB"])
    with pytest.raises(ValueError, match="unknown device"):
        partc.DeviceBudget(num_devices=1, device="TPU")
    with pytest.raises(ValueError, match="cannot read"):
        partc.DeviceBudget(num_devices=1, memory="lots")
    with pytest.raises(ValueError, match="positive int"):
        partc.DeviceBudget(num_devices=0)


def test_train_spec_bytes_per_parameter():
    fp32 = partc.TrainSpec(global_batch_size=8)
    assert (fp32.weight_bytes, fp32.grad_bytes, fp32.optimizer_bytes) == (4, 4, 8.0)
    mixed = partc.TrainSpec(global_batch_size=8, dtype=torch.float16, optimizer="adam")
    # ZeRO's accounting: 2 + 2 + 12 bytes per parameter.
    assert (mixed.weight_bytes, mixed.grad_bytes, mixed.optimizer_bytes) == (2, 2, 12.0)
    assert partc.TrainSpec(global_batch_size=8, optimizer=3.0).optimizer_bytes == 3.0
    with pytest.raises(ValueError, match="does not divide"):
        partc.TrainSpec(global_batch_size=8, micro_batch_size=3)
    with pytest.raises(ValueError, match="unknown optimizer"):
        partc.TrainSpec(global_batch_size=8, optimizer="lion")
    with pytest.raises(ValueError, match="max_grad_norm must be positive"):
        partc.TrainSpec(global_batch_size=8, max_grad_norm=0.0)
    assert partc.TrainSpec(global_batch_size=8, max_grad_norm=1.0).to_dict()["max_grad_norm"] == 1.0


def test_constraints_validate_pins():
    pins = partc.Constraints(recompute={"h.0": "full"}, stages=[["a"], ["b"]])
    assert pins.effective_pp == 2 and pins.stages == (("a",), ("b",))
    assert pins.recompute_for(("h.0", "h.1")) == {"h.0": "full"}
    with pytest.raises(ValueError, match="unknown layers"):
        pins.recompute_for(("h.1",))
    with pytest.raises(ValueError, match="pp=3 but 2 stages"):
        partc.Constraints(pp=3, stages=[["a"], ["b"]])
    with pytest.raises(ValueError, match="recompute"):
        partc.Constraints(recompute="sometimes")


def test_units_round_trip():
    assert parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes("40GB") == 40 * 10**9
    assert format_bytes(3 * 2**29) == "1.50 GiB"


def test_float16_plans_but_the_runtime_asks_for_bfloat16():
    from partc.runtime.module import _compute_dtype

    train = partc.TrainSpec(global_batch_size=8, dtype=torch.float16)
    assert train.weight_bytes == 2  # planning in fp16 is fine

    class _Plan:
        train = partc.TrainSpec(global_batch_size=8, dtype=torch.float16)

    with pytest.raises(partc.PartcError, match="bfloat16"):
        _compute_dtype(_Plan())
    _Plan.train = partc.TrainSpec(global_batch_size=8, dtype=torch.bfloat16)
    assert _compute_dtype(_Plan()) == torch.bfloat16
