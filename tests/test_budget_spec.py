"""DeviceBudget presets and overrides, TrainSpec and Constraints validation, units."""

import pytest
import torch

import partc
from partc.codec import from_data, to_data
from partc.device.presets import preset
from partc.units import format_bytes, parse_bytes


def test_presets_carry_numbers_and_accept_overrides():
    for name in ("A100-40GB", "A100-80GB", "H100-80GB", "H200", "CPU"):
        budget = partc.DeviceBudget(num_devices=2, device=name)
        assert budget.peak_flops_for(torch.bfloat16) > 0
        assert budget.figures.hbm_bandwidth > 0 and budget.memory_bytes[0] > 0
        # Whose autocast policy mixed precision is measured under.
        assert budget.device_type == ("cpu" if name == "CPU" else "cuda")
    budget = partc.DeviceBudget(num_devices=4, device="A100-80GB", memory="70GiB",
                                devices_per_node=2, inter_node_bandwidth="10GB/s",
                                peak_flops={"bfloat16": 100e12})
    assert budget.memory_bytes == (70 * 2**30,) * 4
    assert budget.figures.devices_per_node == 2 and budget.figures.inter_node_bandwidth == 10e9
    assert budget.peak_flops_for(torch.bfloat16) == 100e12
    assert budget.peak_flops_for(torch.float32) == 19.5e12


def test_per_device_memory_and_errors():
    budget = partc.DeviceBudget(num_devices=2, device="CPU", memory=["1GiB", "2GiB"])
    assert budget.memory_bytes == (2**30, 2 * 2**30)
    with pytest.raises(ValueError, match="2 memory sizes given for 3 devices"):
        partc.DeviceBudget(num_devices=3, memory=["1GiB", "2GiB"])
    with pytest.raises(ValueError, match="unknown device"):
        partc.DeviceBudget(num_devices=1, device="TPU")
    # A name two presets share is refused with both, not read as one of them; exact
    # names and single-preset aliases read in any case.
    with pytest.raises(ValueError, match="a100 is ambiguous: A100-40GB, A100-80GB"):
        partc.DeviceBudget(num_devices=1, device="a100")
    assert [preset(name).name for name in ("a100-40gb", "A100-80GB", "h100", "cpu")] == \
        ["A100-40GB", "A100-80GB", "H100-80GB", "CPU"]
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
    assert to_data(partc.TrainSpec(global_batch_size=8, max_grad_norm=1.0))["max_grad_norm"] == 1.0
    # Written only when off: plans from before it read back unchanged.
    assert "overlap_param_gather" not in to_data(partc.TrainSpec(global_batch_size=8))
    blocking = partc.TrainSpec(global_batch_size=8, overlap_param_gather=False)
    assert from_data(partc.TrainSpec, to_data(blocking)) == blocking
    with pytest.raises(ValueError, match="overlap_param_gather"):
        partc.TrainSpec(global_batch_size=8, overlap_param_gather="no")
    assert "bucket_elements" not in to_data(partc.TrainSpec(global_batch_size=8))
    small = partc.TrainSpec(global_batch_size=8, bucket_elements=4096)
    assert from_data(partc.TrainSpec, to_data(small)) == small
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="bucket_elements"):
            partc.TrainSpec(global_batch_size=8, bucket_elements=bad)


def test_on_nonfinite_is_a_choice_written_only_when_not_the_default():
    """TrainSpec.on_nonfinite: raise (default), skip or ignore; plan.json carries it only
    when it is not the default, so plans written before it read back the same."""
    spec = partc.TrainSpec
    assert spec(global_batch_size=4).on_nonfinite == "raise"
    assert "on_nonfinite" not in to_data(spec(global_batch_size=4))
    skip = spec(global_batch_size=4, on_nonfinite="skip")
    assert to_data(skip)["on_nonfinite"] == "skip"
    assert from_data(spec, to_data(skip)) == skip
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        spec(global_batch_size=4, on_nonfinite="warn")


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


def test_constraints_validate_context_parallel_pins():
    assert partc.Constraints(cp=4, cp_kind="all-to-all").cp_kind == "all-to-all"
    assert partc.Constraints(cp_kind="ring").cp is None   # the degree left to the planner
    with pytest.raises(ValueError, match="Constraints.cp must be None or a positive int"):
        partc.Constraints(cp=0)
    with pytest.raises(ValueError, match=r"cp_kind must be None or one of \('ring', "
                                         r"'all-to-all'\)"):
        partc.Constraints(cp=2, cp_kind="ulysses")
    with pytest.raises(ValueError, match="cp=1 was pinned: pin cp > 1, or drop cp_kind"):
        partc.Constraints(cp=1, cp_kind="ring")
def test_the_host_is_in_the_budget_and_offload_is_a_pin():
    hopper = partc.DeviceBudget(num_devices=8, device="H100").figures
    assert hopper.host_memory == 2 * 10**12 and hopper.host_to_device_bandwidth == 50e9
    assert hopper.device_to_host_bandwidth == 50e9 and hopper.host_adam_rate > 0
    # A custom host; each direction its own figure.
    custom = partc.DeviceBudget(num_devices=1, device="H100", memory="32GiB",
                                host_memory="256GiB", host_to_device_bandwidth="12GB/s")
    assert custom.figures.host_memory == 256 * 2**30
    assert custom.figures.host_to_device_bandwidth == 12e9
    assert custom.figures.device_to_host_bandwidth == 50e9
    assert partc.DeviceBudget(num_devices=2, device="CPU").figures.host_memory is None
    with pytest.raises(ValueError, match="host_adam_rate"):
        partc.DeviceBudget(num_devices=1, device="H100", host_adam_rate=-1)
    assert partc.Constraints().offload is None
    assert partc.Constraints(offload=()).offload == ()
    assert partc.Constraints(offload="params,optimizer", dp=2).offload == ("optimizer", "params")
    with pytest.raises(ValueError, match="host too"):
        partc.Constraints(offload=["params"])
    with pytest.raises(ValueError, match="list of"):
        partc.Constraints(offload=["gradients"])
    with pytest.raises(ValueError, match="twice"):
        partc.Constraints(offload=["optimizer", "optimizer"])
    with pytest.raises(ValueError, match="ZeRO-3"):
        partc.Constraints(offload=["optimizer", "params"], zero_stage=2)


def test_units_round_trip():
    assert parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes("40GB") == 40 * 10**9
    assert format_bytes(3 * 2**29) == "1.50 GiB"


def test_float16_plans_but_the_runtime_asks_for_bfloat16():
    from partc.runtime.precision import compute_dtype

    train = partc.TrainSpec(global_batch_size=8, dtype=torch.float16)
    assert train.weight_bytes == 2  # planning in fp16 is fine

    class _Plan:
        train = partc.TrainSpec(global_batch_size=8, dtype=torch.float16)

    with pytest.raises(partc.PartcError, match="bfloat16"):
        compute_dtype(_Plan())
    _Plan.train = partc.TrainSpec(global_batch_size=8, dtype=torch.bfloat16)
    assert compute_dtype(_Plan()) == torch.bfloat16


NAN, INF = float("nan"), float("inf")
budget, train, pins = partc.DeviceBudget, partc.TrainSpec, partc.Constraints

# Bad input → the error and a fragment of its message (the field, and what is allowed).
BAD_INPUTS = [
    (lambda: budget(num_devices=True), "num_devices must be a positive int, got True"),
    (lambda: budget(num_devices=2.0), "num_devices must be a positive int, got 2.0"),
    (lambda: budget(num_devices=0), "num_devices must be a positive int, got 0"),
    (lambda: budget(num_devices=1, memory=INF), "memory: a size must be finite, got inf"),
    (lambda: budget(num_devices=1, memory=NAN), "memory: a size must be finite, got nan"),
    (lambda: budget(num_devices=1, memory="infGiB"), "memory: cannot read 'infGiB'"),
    (lambda: budget(num_devices=1, memory="1e400GB"), "memory: a size must be finite"),
    (lambda: budget(num_devices=1, memory=0), "positive memory size: DeviceBudget.memory got 0"),
    (lambda: budget(num_devices=1, memory=-1), "memory: a size cannot be negative"),
    (lambda: budget(num_devices=1, memory="40G"), "'40G' is ambiguous: write '40GiB'"),
    (lambda: budget(num_devices=1, memory="512M"), "write '512MiB' .* or '512MB'"),
    (lambda: budget(num_devices=2, memory=["1GiB", "0GiB"]), "memory got '0GiB'"),
    (lambda: budget(num_devices=1, peak_flops=0), "peak_flops must be a finite number"),
    (lambda: budget(num_devices=1, peak_flops=-1e12), "peak_flops must be a finite number"),
    (lambda: budget(num_devices=1, peak_flops={"float32": NAN}),
     r"peak_flops\['float32'\] must be a finite number"),
    (lambda: budget(num_devices=1, flops_efficiency=NAN), "flops_efficiency must be a number in"),
    (lambda: budget(num_devices=1, flops_efficiency=1.5), r"flops_efficiency must be .*\(0, 1\]"),
    (lambda: budget(num_devices=1, hbm_bandwidth=0), "hbm_bandwidth must be above 0"),
    (lambda: budget(num_devices=1, intra_node_bandwidth=-5e9),
     "intra_node_bandwidth: a size cannot be negative"),
    (lambda: budget(num_devices=1, inter_node_bandwidth="0GB/s"),
     "inter_node_bandwidth must be above 0"),
    (lambda: budget(num_devices=1, inter_node_bandwidth="400Gb/s"), "'400Gb' reads as bits"),
    (lambda: budget(num_devices=1, inter_node_bandwidth=INF), "a size must be finite"),
    (lambda: budget(num_devices=1, link_latency_s=-1e-6), "link_latency_s must be a finite"),
    (lambda: budget(num_devices=1, intra_node_latency_s=NAN), "intra_node_latency_s must be"),
    (lambda: budget(num_devices=1, devices_per_node=0), "devices_per_node must be a positive int"),
    (lambda: budget(num_devices=1, devices_per_node=True), "devices_per_node must be a positive"),
    (lambda: train(global_batch_size=True), "global_batch_size must be a positive int"),
    (lambda: train(global_batch_size=8, micro_batch_size=True), "micro_batch_size must be"),
    (lambda: train(global_batch_size=8, optimizer=NAN), "optimizer must be a name or a finite"),
    (lambda: train(global_batch_size=8, optimizer=INF), "optimizer must be a name or a finite"),
    (lambda: train(global_batch_size=8, optimizer=-4.0), "optimizer must be a name or a finite"),
    (lambda: train(global_batch_size=8, max_grad_norm=INF), "max_grad_norm must be positive"),
    (lambda: train(global_batch_size=8, max_grad_norm=NAN), "max_grad_norm must be positive"),
    (lambda: pins(pp=True), "Constraints.pp must be None or a positive int, got True"),
    (lambda: pins(dp=0), "Constraints.dp must be None or a positive int, got 0"),
    (lambda: pins(tp=2.0), "Constraints.tp must be None or a positive int"),
    (lambda: pins(num_microbatches=-1), "num_microbatches must be None or a positive int"),
    (lambda: pins(zero_stage=True), "zero_stage must be 0"),
    (lambda: pins(zero_stage=2, dp=1), "zero_stage=2 shards over data-parallel replicas"),
    (lambda: pins(sequence_parallel=1), "sequence_parallel must be None, True or False"),
    (lambda: pins(stages=["a", "b"]), "stages must be a list of stages"),
]


@pytest.mark.parametrize("make, message", BAD_INPUTS,
                         ids=[m.split(":")[0][:40] for _, m in BAD_INPUTS])
def test_bad_inputs_are_refused_naming_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_memory_units_are_explicit():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("80gib") == 80 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("5kB") == 5000
    assert parse_bytes("1024") == parse_bytes("1024B") == parse_bytes(1024.0) == 1024
    assert partc.DeviceBudget(num_devices=1, inter_node_bandwidth="50GB/s"
                              ).figures.inter_node_bandwidth == 50e9


def test_bad_profile_numbers_are_refused(tmp_path):
    import json

    from partc.device.budget import PROFILE_SCHEMA, PROFILE_VERSION, ProfileError

    numbers = {"flops_efficiency": 0.5, "hbm_bandwidth": float("nan"), "devices_per_node": 1,
               "intra_node_bandwidth": None, "inter_node_bandwidth": None,
               "link_latency_s": None, "intra_node_latency_s": None, "memory": None,
               "peak_flops": {"float32": 1e12}, "flops_efficiency_by_dtype": {"float32": 0.5}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"schema": PROFILE_SCHEMA, "schema_version": PROFILE_VERSION,
                                "device": {"name": "x", "preset": "CPU"}, "budget": numbers}))
    with pytest.raises(ProfileError, match="hbm_bandwidth must be a positive number .*nan"):
        partc.DeviceBudget(num_devices=1, profile=path)
