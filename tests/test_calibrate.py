"""partc calibrate: a quick run on CPU with two gloo processes, the profile it writes,
DeviceBudget and partc.compile reading it, and the errors a bad profile gives.

Timings on a shared machine are noisy, so nothing here asserts a measured speed: the
tests check that the profile's numbers follow from its own raw samples (the budget from
the measurements, each fit the least-squares optimum of its samples) and that the
planner uses whatever numbers the profile holds.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import statistics
import time
from datetime import datetime

import pytest
import torch

import partc
from partc.device.budget import PROFILE_SCHEMA, PROFILE_VERSION, ProfileError, load_profile
from partc.calibrate.calibration_options import SIZES, CalibrationError, CalibrationOptions
from partc.calibrate.collective_fits import (COLLECTIVES, LinkFit, fit_link, ring_factor,
                                             ring_steps)
from partc.calibrate.collective_ranks import BETWEEN_COMPUTE_S
from partc.calibrate.fsdp_overheads import FSDP_FIGURES
from partc.calibrate.profile_summary import summary
from partc.cli.main import main
from tests import models

BUDGET_NUMBERS = ("peak_flops", "flops_efficiency", "hbm_bandwidth", "devices_per_node",
                  "intra_node_bandwidth", "intra_node_latency_s", "link_latency_s",
                  "inter_node_bandwidth", "comm_overlap", "split_backward_factor",
                  "elementwise_bandwidth", "optimizer_bandwidth", "host_adam_rate",
                  "host_memory", "host_to_device_bandwidth", "device_to_host_bandwidth")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """``partc calibrate --quick`` once for the module: (profile path, printed summary)."""
    path = tmp_path_factory.mktemp("calibrate") / "profile.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["calibrate", "--device", "cpu", "--processes", "2", "--quick",
                     "--out", str(path), "-q"])
    assert code == 0
    return path, printed.getvalue()


def _read(path) -> dict:
    return json.loads(path.read_text())


def _between_compute(collectives: dict) -> dict:
    """The collectives timed between compute, which calibration leaves out where noise
    hid their fit (``partc.calibrate.collective_ranks``): a machine too busy for the
    measurement skips the checks that read it rather than failing them."""
    if "between_compute" not in collectives:
        pytest.skip("calibration left out the collectives timed between compute: noise "
                    "hid their fit on this machine")
    return collectives["between_compute"]


def test_profile_schema_and_summary(calibrated):
    path, printed = calibrated
    profile = _read(path)
    assert profile["schema"] == PROFILE_SCHEMA and profile["schema_version"] == PROFILE_VERSION
    assert profile["mode"] == "quick"
    assert datetime.fromisoformat(profile["created"]).tzinfo is not None
    assert profile["software"]["torch"] == torch.__version__
    assert profile["host"]["cores"] >= 1
    device = profile["device"]
    assert device["kind"] == "cpu" and device["name"] and device["preset"] == "CPU"
    assert device["processes"] == 2 and device["threads_per_process"] >= 1
    assert set(profile["measurements"]) == {"matmul", "linear", "attention", "memory",
                                            "collectives", "op_overhead", "split_backward",
                                            "elementwise", "optimizer", "host_adam"}
    assert profile["budget"]["host_adam_rate"] > 0   # the host's step, for offload
    assert profile["budget"]["host_to_device_bandwidth"] is None   # a CPU's host: itself
    assert set(profile["measurements"]["matmul"]) == {"float32", "bfloat16"}
    for key in BUDGET_NUMBERS:
        assert key in profile["budget"] and key in profile["sources"]
    assert "one machine cannot measure" in profile["sources"]["inter_node_bandwidth"]
    if "between_compute" in profile["measurements"]["collectives"]:
        assert "ms of compute as in a step" in profile["sources"]["collective_links"]
    for line in ("matmul float32", "attention float32_causal", "memory copy / add",
                 "all_reduce", "joint_fit", "budget number", "preset CPU", "hbm_bandwidth",
                 "element-wise ops fwd+bwd", "AdamW step", "elementwise_bandwidth",
                 "optimizer_bandwidth", "all_reduce, in a step", "joint_fit, in a step",
                 "host AdamW step", "host_adam_rate", "note: quick run"):
        assert line in printed


def test_summary_says_when_a_collective_has_no_fit(calibrated):
    profile = _read(calibrated[0])
    profile["measurements"]["collectives"]["all_gather"]["fit"] = None
    text = summary(profile)
    assert "all_gather                    no fit" in text and "joint_fit" in text


def test_budget_numbers_follow_from_the_samples(calibrated):
    profile = _read(calibrated[0])
    budget, measured = profile["budget"], profile["measurements"]
    for key, matmul in measured["matmul"].items():
        rates = [s["flops_per_s"] for s in matmul["samples"]]
        for s in matmul["samples"]:
            assert s["seconds"] > 0
            assert s["flops_per_s"] == pytest.approx(2 * s["m"] * s["k"] * s["n"] / s["seconds"])
        assert matmul["best_flops_per_s"] == max(rates) == budget["achieved_flops"][key]
        # No vendor figures for a CPU: the measured best is the peak; a model's layers
        # reach the rate of training's linear matmuls with every rank computing at once.
        assert budget["peak_flops"][key] == max(rates)
        busy = measured["collectives"]["linear_all_busy"][key]
        for s in busy["samples"]:
            assert s["flops_per_s"] == pytest.approx(6 * s["tokens"] * s["in"] * s["out"]
                                                     / s["seconds"])
        assert budget["flops_efficiency_by_dtype"][key] == pytest.approx(
            min(1.0, busy["flops_per_s"] / max(rates)))
    assert budget["training_dtype"] == "float32"
    assert budget["flops_efficiency"] == budget["flops_efficiency_by_dtype"]["float32"]
    # The share of an all-reduce that compute beside it hides, from the three timings.
    overlap = measured["collectives"]["overlap"]
    hidden = (overlap["all_reduce_s"] + overlap["compute_s"] - overlap["both_s"]) / min(
        overlap["all_reduce_s"], overlap["compute_s"])
    assert budget["comm_overlap"] == pytest.approx(min(1.0, max(0.0, hidden)))
    # A backward as input then weight gradients, over one pass: at least 1.
    split = measured["split_backward"]
    assert budget["split_backward_factor"] == split["factor"] >= 1.0
    assert split["factor"] == pytest.approx(max(1.0, (
        split["forward_split_backward_s"] - split["forward_s"])
        / (split["forward_backward_s"] - split["forward_s"])))
    attention = measured["attention"]
    b, h, s, d = attention["shape"].values()
    for name in ("float32", "float32_causal", "bfloat16", "bfloat16_causal"):
        entry = attention[name]
        assert entry["flops"] == 4 * b * h * s * s * d / (2 if entry["causal"] else 1)
        assert entry["flops_per_s"] == pytest.approx(entry["flops"] / entry["seconds"])
    memory = measured["memory"]
    assert memory["copy"]["bytes_moved"] == 2 * memory["tensor_bytes"]
    assert memory["add"]["bytes_moved"] == 3 * memory["tensor_bytes"]
    assert budget["hbm_bandwidth"] == max(memory["copy"]["bytes_per_s"],
                                          memory["add"]["bytes_per_s"]) > 0
    # The links as a step meets them: on a CPU the collectives timed between compute.
    links = _between_compute(measured["collectives"])
    assert links["compute_s"] >= BETWEEN_COMPUTE_S / 2
    joint = links["joint_fit"]
    assert budget["intra_node_bandwidth"] == joint["bandwidth"] > 0
    assert budget["intra_node_latency_s"] == joint["latency_s"] >= 0
    assert budget["link_latency_s"] is None   # between nodes: the preset's
    assert budget["devices_per_node"] == 2 and budget["memory"] > 0
    assert budget["inter_node_bandwidth"] is None
    # Each collective's own fit beside the joint one; the per-op and per-matmul overheads.
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
        fit = links[kind]["fit"]
        own = budget["collective_links"][kind]
        assert own is None if fit is None else own == {"latency_s": fit["latency_s"],
                                                       "bandwidth": fit["bandwidth"]}
    overhead = measured["op_overhead"]
    assert budget["op_overhead_s"] == overhead["forward_s"] > 0
    assert budget["op_overhead_backward_s"] == overhead["backward_s"] >= 0
    # A GPU's own time per kernel is not measured on a CPU: the preset's 0 applies.
    assert "kernel_overhead" not in measured and budget["kernel_overhead_s"] is None
    assert "op_overhead_s" in profile["sources"]["kernel_overhead_s"]
    samples = measured["matmul"]["float32"]["samples"]
    best = measured["matmul"]["float32"]["best_flops_per_s"]
    assert budget["matmul_overhead_s"] == measured["matmul"]["float32"]["overhead_s"] >= 0
    # The fit's overhead is the weighted mean excess over the best rate, so it lies
    # between the smallest and largest excess (floored at 0).
    excess = [s["seconds"] - 2 * s["m"] * s["k"] * s["n"] / best for s in samples]
    assert min(excess) - 1e-12 <= budget["matmul_overhead_s"] <= max(excess) + 1e-12
    # Element-wise ops and the optimizer step, timed with every rank at once: their
    # rates in the bytes the cost model counts (forward's and backward's over their time
    # less the ops' own overhead; 28 bytes per AdamW parameter).
    for key in ("elementwise", "optimizer"):
        busy = measured["collectives"][f"{key}_all_busy"]
        assert budget[f"{key}_bandwidth"] == busy["bytes_per_s"] > 0
        assert measured[key]["bytes_per_s"] > 0
    elementwise = measured["elementwise"]
    tokens, _, width = SIZES["cpu", True].linear[0]
    assert elementwise["shape"] == [tokens, width]
    # masked_fill copies its input before filling in place: 2 of the 15 fp32 passes.
    assert elementwise["forward_bytes"] == 4 * tokens * width * 15 + tokens * width
    # Backward as autograd runs it on a CPU, in the same count: the gradients of GELU,
    # softmax and the norm read two tensors and write one (the norm also its statistics
    # and its weights' gradients), the scale's one and one, masked_fill's again a copy
    # and a fill reading the mask; the add's pass straight through, but the norm's input
    # is the add's too, and its two gradients are summed (3).
    assert elementwise["backward_bytes"] == (4 * tokens * width * (3 + 3 + 3 + 2 + 4 + 3)
                                             + tokens * width + 8 * (tokens + width))
    per_op = overhead["forward_s"] + overhead["backward_s"]
    assert elementwise["bytes_per_s"] == pytest.approx(
        (elementwise["forward_bytes"] + elementwise["backward_bytes"])
        / max(elementwise["forward_backward_s"] - 6 * per_op,
              elementwise["forward_backward_s"] / 2))
    optimizer = measured["optimizer"]
    width = SIZES["cpu", True].linear[0][1]   # the block's width: the linear's input
    assert optimizer["params"] == 12 * width**2 + 13 * width and optimizer["tensors"] == 12
    assert optimizer["bytes_counted"] == 28 * optimizer["params"]
    assert optimizer["bytes_per_s"] == pytest.approx(28 * optimizer["params"]
                                                     / optimizer["seconds"])
    # FSDP's work per unit and microbatch, from its four timings of tiny blocks against
    # the plain modules': hooks from ZeRO-2 accumulating, a reduce-scatter from reducing
    # every microbatch over that, an all-gather from ZeRO-3's forward over ZeRO-2's; the
    # copies' rate from the wide blocks' all-gather and reduce-scatter over the tiny.
    fsdp = measured["collectives"]["fsdp"]
    figures = {}
    for width in ("tiny", "wide"):
        timed, units = fsdp[width], fsdp["units"]
        plain, hooks, reduced, gathered = (timed[key] for key in (
            "plain_s", "zero2_accumulate_s", "zero2_reduce_s", "zero3_s"))
        figures[width] = {"unit_forward_s": (hooks[0] - plain[0]) / units,
                          "unit_backward_s": (hooks[1] - plain[1]) / units,
                          "scatter_s": (reduced[1] - hooks[1]) / units,
                          "gather_s": (gathered[0] - hooks[0]) / units,
                          "step_s": (gathered[2] - plain[2]) / units / 12}
        for key, value in figures[width].items():
            assert timed[key] == pytest.approx(max(0.0, value))
    for name, key in FSDP_FIGURES.items():
        if key != "copy_bytes_per_s":
            assert budget[name] == fsdp["tiny"][key] >= 0
    width = SIZES["cpu", True].linear[0][1]
    params = [12 * w**2 + 13 * w for w in (8, width)]
    assert list(fsdp["params_per_unit"].values()) == params
    copy_s = sum(fsdp["wide"][k] - fsdp["tiny"][k] for k in ("gather_s", "scatter_s"))
    assert budget["fsdp_copy_bandwidth"] == (pytest.approx(
        2 * 2 * (1 + 1 / 2) * 4 * (params[1] - params[0]) / copy_s) if copy_s > 0 else None)


def _squared_relative_error(fit: LinkFit, samples, ranks: int) -> float:
    return sum((fit.predict(kind, nbytes, ranks) - t) ** 2 / t**2 for kind, nbytes, t in samples)


def test_each_fit_is_the_least_squares_optimum_of_its_samples(calibrated):
    """The fitted (latency, bandwidth) predicts the samples with the errors the profile
    states, and no nearby pair predicts them better (relative squared error)."""
    collectives = _read(calibrated[0])["measurements"]["collectives"]
    ranks = collectives["processes"]
    everything = []
    for kind in COLLECTIVES:
        entry = collectives[kind]
        assert entry["steps"] == ring_steps(kind, ranks)
        sizes = [s["bytes"] for s in entry["samples"]]
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes) >= 3
        samples = [(kind, s["bytes"], s["seconds"]) for s in entry["samples"]]
        everything += samples
        if entry["fit"] is not None:  # None: noise hid the growth with size
            _check_optimal(entry["fit"], samples, ranks)
            assert entry["fit"]["alpha_s"] == pytest.approx(entry["steps"]
                                                            * entry["fit"]["latency_s"])
    _check_optimal(collectives["joint_fit"], everything, ranks)
    # The same collectives and sizes timed between compute, fitted alike.
    between, everything = _between_compute(collectives), []
    for kind in COLLECTIVES:
        samples = [(kind, s["bytes"], s["seconds"]) for s in between[kind]["samples"]]
        assert [s[1] for s in samples] == [s["bytes"] for s in collectives[kind]["samples"]]
        everything += samples
        if between[kind]["fit"] is not None:
            _check_optimal(between[kind]["fit"], samples, ranks)
    _check_optimal(between["joint_fit"], everything, ranks)


def _check_optimal(record: dict, samples, ranks: int) -> None:
    fit = LinkFit(latency_s=record["latency_s"], bandwidth=record["bandwidth"])
    errors = [abs(fit.predict(kind, nbytes, ranks) - t) / t for kind, nbytes, t in samples]
    assert max(errors) == pytest.approx(record["max_rel_error"])
    assert statistics.median(errors) == pytest.approx(record["median_rel_error"])
    best = _squared_relative_error(fit, samples, ranks)
    for scale_latency, scale_bandwidth in ((1.01, 1), (0.99, 1), (1, 1.01), (1, 0.99)):
        nearby = LinkFit(latency_s=fit.latency_s * scale_latency,
                         bandwidth=fit.bandwidth * scale_bandwidth)
        assert _squared_relative_error(nearby, samples, ranks) >= best * (1 - 1e-9)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_fit_link_recovers_the_ring_model(ranks):
    truth = LinkFit(latency_s=20e-6, bandwidth=3e9)
    sizes = [2**e for e in range(10, 27, 2)]
    samples = [(kind, m, truth.predict(kind, m, ranks)) for kind in COLLECTIVES for m in sizes]
    fit = fit_link(samples, ranks)
    assert fit.latency_s == pytest.approx(20e-6, rel=1e-9)
    assert fit.bandwidth == pytest.approx(3e9, rel=1e-9)
    # All-reduce moves 2(n-1)/n of the tensor per rank: the per-link figure is the same.
    assert ring_factor("all_reduce", ranks) == 2 * ring_factor("all_gather", ranks)
    # +-10% alternating noise: the fit still predicts every sample within 10%.
    noisy = [(k, m, t * (1.1 if i % 2 else 0.9)) for i, (k, m, t) in enumerate(samples)]
    fit = fit_link(noisy, ranks)
    assert all(abs(fit.predict(k, m, ranks) - t) / t < 0.25 for k, m, t in noisy)


def test_fit_link_keeps_latency_non_negative_and_refuses_flat_times():
    # Times proportional to bytes: an unconstrained fit would give a latency below zero.
    samples = [("send_recv", m, m / 1e9 * (0.8 if m == 1024 else 1.0))
               for m in (1024, 2**20, 2**24)]
    fit = fit_link(samples, 2)
    assert fit.latency_s == 0.0 and fit.bandwidth == pytest.approx(1e9, rel=0.1)
    with pytest.raises(CalibrationError, match="do not grow with message size"):
        fit_link([("all_reduce", m, 1e-3) for m in (1024, 4096)] +
                 [("all_reduce", 2**20, 0.5e-3)], 2)


def test_profile_drives_the_budget(calibrated):
    path = calibrated[0]
    budget_numbers = _read(path)["budget"]
    budget = partc.DeviceBudget(num_devices=2, profile=path)
    assert budget.device == "CPU" and budget.name == _read(path)["device"]["name"]
    assert budget.peak_flops_for(torch.float32) == budget_numbers["peak_flops"]["float32"]
    # Rates are whole bytes per second (partc.units.parse_rate).
    assert budget.figures.hbm_bandwidth == int(budget_numbers["hbm_bandwidth"])
    assert budget.figures.intra_node_bandwidth == int(budget_numbers["intra_node_bandwidth"])
    assert budget.figures.intra_node_latency_s == budget_numbers["intra_node_latency_s"]
    assert budget.figures.devices_per_node == 2
    assert budget.memory_bytes == (budget_numbers["memory"],) * 2
    # Not measurable on one machine: the preset's.
    assert budget.figures.inter_node_bandwidth == partc.PRESETS["CPU"].inter_node_bandwidth
    with pytest.raises(ValueError, match="no peak FLOP/s for float16"):
        budget.peak_flops_for(torch.float16)
    data = budget.to_dict()
    assert data["source"] == "profile" and data["profile"] == str(path)
    assert data["hbm_bandwidth"] == int(budget_numbers["hbm_bandwidth"])
    # Fields given to DeviceBudget win over the profile.
    pinned = partc.DeviceBudget(num_devices=2, profile=path, hbm_bandwidth="1GB/s",
                                flops_efficiency=0.5, memory="1GiB", device="cpu")
    assert pinned.figures.hbm_bandwidth == 1e9 and pinned.efficiency_for(torch.bfloat16) == 0.5
    assert pinned.memory_bytes == (2**30,) * 2
    # The preset path is unchanged.
    assert "source" not in partc.DeviceBudget(num_devices=2, device="CPU").to_dict()


def test_each_collective_kind_and_the_overheads_reach_the_cost_model(calibrated, tmp_path):
    """The profile's per-collective fits price each kind inside a node (send/recv as
    "send"); the op and matmul overheads reach DeviceNumbers. A profile written before
    these keys existed still loads: its fits come from its measurements, its overheads
    from the preset."""
    from partc.cost.collectives import Group, collective_seconds
    from partc.compiler import device_numbers

    path = calibrated[0]
    profile = _read(path)
    budget = partc.DeviceBudget(num_devices=2, profile=path)
    numbers = device_numbers(budget, torch.float32)
    links = profile["budget"]["collective_links"]
    names = {"all_reduce": "all_reduce", "all_gather": "all_gather",
             "reduce_scatter": "reduce_scatter", "send_recv": "send"}
    expected = sorted((names[k], f["latency_s"], f["bandwidth"]) for k, f in links.items() if f)
    assert list(numbers.intra_node_links) == expected
    group = Group.over(numbers, 2, 2)
    for kind, latency, bandwidth in expected:
        steps, factor = (1, 1.0) if kind == "send" else \
            (2, 1.0) if kind == "all_reduce" else (1, 0.5)
        assert collective_seconds(kind, 1e6, group) == pytest.approx(
            steps * latency + factor * 1e6 / bandwidth)
    assert numbers.op_overhead_s == profile["budget"]["op_overhead_s"]
    assert numbers.op_overhead_backward_s == profile["budget"]["op_overhead_backward_s"]
    assert numbers.matmul_overhead_s == profile["budget"]["matmul_overhead_s"]
    for key in FSDP_FIGURES:
        if not key.endswith("bandwidth"):
            assert getattr(numbers, key) == profile["budget"][key]
    # Rates are whole bytes per second (partc.units.parse_rate); one the profile lacks
    # (the copies' rate, where noise hid them) is the preset's.
    preset = partc.PRESETS[profile["device"]["preset"]]
    for key in ("elementwise_bandwidth", "optimizer_bandwidth", "fsdp_copy_bandwidth"):
        given = profile["budget"][key]
        assert getattr(numbers, key) == (getattr(preset, key) if given is None else int(given))
    # A plan records them, and the budget it reads back prices alike (partc.load).
    from partc.compiler import budget_from_info
    from partc.plan import BudgetInfo
    again = budget_from_info(BudgetInfo.from_dict(budget.to_dict()))
    assert device_numbers(again, torch.float32) == numbers
    # A link number given to DeviceBudget prices every kind.
    given = partc.DeviceBudget(num_devices=2, profile=path, intra_node_bandwidth="1GB/s")
    assert device_numbers(given, torch.float32).intra_node_links == ()

    def older(p):
        for key in ("collective_links", "op_overhead_s", "op_overhead_backward_s",
                    "matmul_overhead_s", "elementwise_bandwidth", "optimizer_bandwidth",
                    *FSDP_FIGURES):
            p["budget"].pop(key)
    old = device_numbers(partc.DeviceBudget(num_devices=2, profile=_edited(
        calibrated, tmp_path, older)), torch.float32)
    assert list(old.intra_node_links) == expected
    cpu = partc.PRESETS["CPU"]
    assert (old.op_overhead_s, old.op_overhead_backward_s, old.matmul_overhead_s) == (
        cpu.op_overhead_s, cpu.op_overhead_backward_s, cpu.matmul_overhead_s)
    assert old.elementwise_bandwidth is None and old.optimizer_bandwidth is None
    assert all(getattr(old, key) == getattr(cpu, key) for key in FSDP_FIGURES)
    assert old.fsdp_copy_bandwidth == cpu.fsdp_copy_bandwidth
    with pytest.raises(ProfileError, match="collective fit 'broadcast'"):
        load_profile(_edited(calibrated, tmp_path, lambda p: p["budget"]["collective_links"]
                             .update(broadcast={"latency_s": 0, "bandwidth": 1})))
    with pytest.raises(ProfileError, match="all_gather.bandwidth must be a positive"):
        load_profile(_edited(calibrated, tmp_path, lambda p: p["budget"]["collective_links"]
                             .update(all_gather={"latency_s": 0, "bandwidth": 0})))
    with pytest.raises(ProfileError, match="budget.op_overhead_s must be a number"):
        load_profile(_edited(calibrated, tmp_path,
                             lambda p: p["budget"].update(op_overhead_s=-1)))
    with pytest.raises(ProfileError, match="budget.optimizer_bandwidth must be a positive"):
        load_profile(_edited(calibrated, tmp_path,
                             lambda p: p["budget"].update(optimizer_bandwidth=0)))


def _mlp_plan(budget: partc.DeviceBudget) -> partc.Plan:
    program = partc.compile(models.MLP(d_in=256, d_hidden=1024, d_out=256),
                            (torch.randn(64, 256),), budget=budget,
                            train=partc.TrainSpec(global_batch_size=64),
                            constraints=partc.Constraints(pp=1, num_microbatches=1))
    partc.validate_plan(program.problem, program.plan)
    return program.plan


def test_compile_uses_the_profile_numbers(calibrated, tmp_path):
    path = calibrated[0]
    profile = _read(path)
    plan = _mlp_plan(partc.DeviceBudget(num_devices=1, profile=path))
    assert plan.budget.source == "profile"
    assert plan.budget.figures.peak_flops == profile["budget"]["peak_flops"]["float32"]
    assert plan.budget.figures.hbm_bandwidth == int(profile["budget"]["hbm_bandwidth"])
    # Twice the FLOP/s and memory bandwidth: every layer's time halves.
    faster = profile | {"budget": profile["budget"] | {
        "peak_flops": {k: 2 * v for k, v in profile["budget"]["peak_flops"].items()},
        "hbm_bandwidth": 2 * profile["budget"]["hbm_bandwidth"],
        "elementwise_bandwidth": 2 * profile["budget"]["elementwise_bandwidth"],
        **{key: profile["budget"][key] / 2 for key in
           ("op_overhead_s", "op_overhead_backward_s", "matmul_overhead_s")}}}
    (tmp_path / "faster.json").write_text(json.dumps(faster))
    fast = _mlp_plan(partc.DeviceBudget(num_devices=1, profile=tmp_path / "faster.json"))
    for phase in ("forward", "backward"):
        assert getattr(fast.stages[0].time_s, phase) == pytest.approx(
            getattr(plan.stages[0].time_s, phase) / 2, rel=1e-6)
    preset = _mlp_plan(partc.DeviceBudget(num_devices=1, device="CPU"))
    assert preset.budget.source is None
    assert not math.isclose(preset.stages[0].time_s.forward, plan.stages[0].time_s.forward)


def test_plan_command_takes_a_profile(calibrated, tmp_path, capsys):
    factory = tmp_path / "work.py"
    factory.write_text("import torch\nfrom tests.models import MLP\n"
                       "def make():\n    return MLP(), (torch.zeros(4, 8),)\n")
    code = main(["plan", f"{factory}:make", "--devices", "2", "--profile",
                 str(calibrated[0]), "--out", str(tmp_path / "out"), "-q"])
    assert code == 0
    capsys.readouterr()
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["budget"]["source"] == "profile"
    assert plan["budget"]["profile"] == str(calibrated[0])
    code = main(["plan", f"{factory}:make", "--devices", "2", "--profile",
                 str(tmp_path / "missing.json"), "-q"])
    assert code == 2 and "no device profile" in capsys.readouterr().err


def _edited(calibrated, tmp_path, edit) -> str:
    profile = _read(calibrated[0])
    edit(profile)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(profile))
    return str(path)


def test_bad_profiles_say_what_is_wrong(calibrated, tmp_path):
    with pytest.raises(ProfileError, match="no device profile at .*missing.json.*partc calibrate"):
        partc.DeviceBudget(num_devices=2, profile=tmp_path / "missing.json")
    (tmp_path / "text.json").write_text("{not json")
    with pytest.raises(ProfileError, match="cannot read device profile"):
        load_profile(tmp_path / "text.json")
    (tmp_path / "other.json").write_text(json.dumps({"mesh": {}}))
    with pytest.raises(ProfileError, match="not a partc device profile"):
        load_profile(tmp_path / "other.json")
    cases = {
        "schema version 99": lambda p: p.update(schema_version=99),
        "has no budget.hbm_bandwidth": lambda p: p["budget"].pop("hbm_bandwidth"),
        "has no budget.peak_flops table": lambda p: p["budget"].pop("peak_flops"),
        "budget.devices_per_node must be a positive number":
            lambda p: p["budget"].update(devices_per_node=0),
        "budget.peak_flops.float32 must be a positive number":
            lambda p: p["budget"]["peak_flops"].update(float32="fast"),
        "device.preset 'TPU' is not one of": lambda p: p["device"].update(preset="TPU"),
    }
    for message, edit in cases.items():
        with pytest.raises(ProfileError, match=message):
            load_profile(_edited(calibrated, tmp_path, edit))
    with pytest.raises(ValueError, match="drop device="):
        partc.DeviceBudget(num_devices=2, profile=calibrated[0], device="H100-80GB")
    # A device with no preset and no link measured: the user must give the number.
    no_link = _edited(calibrated, tmp_path, lambda p: (
        p["device"].update(preset=None), p["budget"].update(intra_node_bandwidth=None)))
    with pytest.raises(ValueError, match="no intra_node_bandwidth .* pass intra_node_bandwidth="):
        partc.DeviceBudget(num_devices=2, profile=no_link, inter_node_bandwidth="1GB/s",
                           link_latency_s=1e-5)
    with pytest.raises(ValueError, match="no link_latency_s .* pass link_latency_s="):
        partc.DeviceBudget(num_devices=2, profile=no_link, inter_node_bandwidth="1GB/s",
                           intra_node_bandwidth="2GB/s")
    assert partc.DeviceBudget(num_devices=2, profile=no_link, inter_node_bandwidth="1GB/s",
                              intra_node_bandwidth="2GB/s",
                              link_latency_s=1e-5).figures.intra_node_bandwidth == 2e9


def test_options_are_checked():
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        CalibrationOptions(device="tpu")
    with pytest.raises(ValueError, match="at least 1"):
        CalibrationOptions(processes=0)
    if not torch.cuda.is_available():
        with pytest.raises(CalibrationError, match="sees no GPU"):
            CalibrationOptions(device="cuda")


def test_median_seconds_times_by_the_sizes_clock():
    """On a CPU the clock is ``Sizes.clock`` (wall time unless one asks for the thread's
    CPU time): a clock that advances 0.5 s per reading times every call at 0.5 s."""
    import dataclasses
    import itertools

    from partc.calibrate.stopwatch import median_seconds

    readings = itertools.count(0.0, 0.5)
    sizes = dataclasses.replace(SIZES["cpu", True], clock=lambda: next(readings))
    assert median_seconds(lambda: None, torch.device("cpu"), sizes) == 0.5
    assert SIZES["cpu", True].clock is time.perf_counter


@pytest.mark.parametrize("finished", [True, False])
def test_a_rank_lost_after_the_measurements_leaves_them_whole(monkeypatch, caplog, finished):
    """gloo's threads can abort a rank as its interpreter exits ("terminate called without
    an active exception", seen once in the suite): once any rank is past the workers' last
    barrier every figure is written, so calibrate keeps them and warns; a rank lost before
    that is still a failure."""
    import pickle
    from pathlib import Path

    import torch.multiprocessing as mp

    from partc.calibrate import collective_ranks
    from partc.calibrate.collective_fits import CollectiveSample
    from partc.calibrate.memory_rates import ElementwiseRate, OptimizerRate

    truth = LinkFit(latency_s=50e-6, bandwidth=2e9)
    sizes = (2**12, 2**16, 2**20, 2**24)
    timed = collective_ranks.RankTimings(
        back_to_back={kind: tuple(CollectiveSample(nbytes=m, seconds=truth.predict(kind, m, 2))
                                  for m in sizes) for kind in COLLECTIVES},
        between_compute=None,
        overlap=collective_ranks.Overlap(nbytes=2**24, all_reduce_s=1e-2, compute_s=1e-2,
                                         both_s=1.5e-2),
        linear_all_busy={},
        elementwise_all_busy=ElementwiseRate(shape=(4, 4), ops=6, forward_bytes=1,
                                             backward_bytes=1, forward_s=1.0,
                                             forward_backward_s=2.0, bytes_per_s=1.0),
        optimizer_all_busy=OptimizerRate(optimizer="AdamW", tensors=1, params=1, seconds=1.0,
                                         bytes_counted=28),
        fsdp=None)

    def spawn(worker, nprocs, join, args):
        out = Path(args[-1])
        out.write_bytes(pickle.dumps(timed))   # rank 0's output, then rank 1 passes the barrier
        if finished:
            out.with_name(f"{collective_ranks.DONE_MARKER}1").touch()
        raise mp.ProcessExitedException("process 0 terminated with signal SIGABRT", 0,
                                        1234, -6, "SIGABRT")

    monkeypatch.setattr(collective_ranks.mp, "spawn", spawn)
    options = CalibrationOptions(processes=2)
    if not finished:
        with pytest.raises(CalibrationError, match="collective measurement failed"):
            collective_ranks.measure_collectives(options)
        return
    with caplog.at_level("WARNING", logger="partc.calibrate.collective_ranks"):
        result = collective_ranks.measure_collectives(options)
    assert "ended abnormally after the measurements were done" in caplog.text
    fit = result.back_to_back.joint_fit
    assert fit.latency_s == pytest.approx(50e-6, rel=1e-6)
    assert fit.bandwidth == pytest.approx(2e9, rel=1e-6)
    assert result.overlap.overlap == pytest.approx(0.5)
