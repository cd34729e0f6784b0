"""partc.compile end to end: real models traced, measured, planned, validated, reported."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import partc
from partc.cost.tables import build_cost_table
from partc.runtime.pipeline_schedule import runtime_refusal
from partc.plan import Plan
from partc.planner import candidate_configs, solve
from partc.problem import Pins
from partc.report.explain import tightest_split
from partc.report.text import render
from samples.gpt import gpt_small, gpt_tiny, loss_fn
from tests import models


def lm_loss(output, target):
    logits = output.logits if hasattr(output, "logits") else output[0]
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def check(program: partc.Program) -> Plan:
    """Every plan a test sees goes through the solver-free validator."""
    partc.validate_plan(program.problem, program.plan)
    assert program.plan.solver.status == "OPTIMAL"
    return program.plan


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hugging_face_models_plan(name):
    model = getattr(models, name)(n_layer=4)
    ids = torch.zeros(2, 16, dtype=torch.long)
    loss = None if name == "bert" else lm_loss
    program = partc.compile(model, (ids,), loss_fn=loss, example_target=ids if loss else None,
                            budget=partc.DeviceBudget(num_devices=2, device="CPU"),
                            train=partc.TrainSpec(global_batch_size=4),
                            constraints=partc.Constraints(pp=2))
    plan = check(program)
    assert plan.pp == 2 and len(plan.layer_names) >= 6
    assert plan.model.tracer == "export"
    assert "stage" in program.report() and "uniform" in program.report()


@pytest.mark.parametrize("schedule", ["1f1b", "zbv-zero-bubble"])
def test_sample_gpt_plans_with_tied_embeddings(schedule):
    program = partc.compile(gpt_tiny(n_layer=4), (torch.zeros(2, 16, dtype=torch.long),),
                            loss_fn=loss_fn, budget=partc.DeviceBudget(num_devices=2,
                                                                       device="CPU"),
                            constraints=partc.Constraints(pp=2, schedule=schedule))
    plan = check(program)
    assert plan.model.tracer == "symbolic_trace"
    first, last = plan.stages
    held = first.param_count + last.param_count
    if schedule == "1f1b":   # the tied embedding/head matrix is held by both stages
        assert held > plan.model.num_params
    else:   # a "V" puts the first and the last virtual stage on rank 0: held once
        assert held == plan.model.num_params
        assert {"tok_emb", "lm_head"} <= set(first.layers)


@functools.cache   # the tests read a program, never change it
def _gpt_124m_on(memory: str, tp: int | None = 1) -> partc.Program:
    # tp=1, no ZeRO, no offload: these tests are about pipeline stages and recompute under
    # a tight budget (ZeRO-3 over 4 replicas would fit it otherwise:
    # tests/planner/test_regimes.py; so would offload, tests/runtime/test_offload.py).
    with torch.device("meta"):
        model = gpt_small()
    ids = torch.zeros(1, 1024, dtype=torch.long, device="meta")
    return partc.compile(model, (ids,), loss_fn=loss_fn, example_target=ids,
                         budget=partc.DeviceBudget(num_devices=4, device="A100-40GB",
                                                   memory=memory, **models.WHOLE_MEMORY),
                         train=partc.TrainSpec(global_batch_size=32), name="gpt-124m",
                         constraints=partc.Constraints(tp=tp, zero_stage=0, offload=()),
                         # Microbatches of one sequence are dispatch-bound on the A100
                         # (the GPU's launch floor), which leaves the layers' costs equal:
                         # proving the interleaved zero-bubble trial with 12 virtual
                         # stages takes 4.8 deterministic seconds of CP-SAT work (~12 s
                         # on an idle core), beyond the default share of 16 / 8.
                         options=partc.PlannerOptions(config_work_limit=8))


def test_50k_vocab_tight_budget_beats_both_baselines():
    # 1.6 GiB: at 1.5 the uniform split, with full recompute, no longer fits beside the
    # pipeline's receive buffers (32 microbatches of a 1024 x 768 activation, 96 MiB
    # each way on a stage inside the pipeline).
    program = _gpt_124m_on("1.6GiB")
    plan = check(program)
    assert plan.pp > 1
    step = plan.predicted.step_time_s
    alternatives = {a.name: a for a in plan.alternatives}
    assert set(alternatives) == {"uniform", "parameters"}
    for alt in alternatives.values():
        assert alt.fits and step < alt.step_time_s
    text = program.report()
    assert "partc plan" in text and "uniform" in text and "parameters" in text
    for stage in plan.stages:
        assert stage.memory_bytes.peak <= stage.limit_bytes


def test_infeasible_budget_names_stage_need_limit_and_fix_fast():
    with pytest.raises(partc.PlanInfeasibleError) as info:
        _gpt_124m_on("1GiB")
    error = info.value
    assert error.need_bytes > error.limit_bytes == 2**30
    assert f"stage {error.stage}" in str(error) and "It would fit with" in str(error)
    # Planning alone (the model is already measured) says so too. How fast is measured
    # in benchmarks/plan_time.py, not asserted here. (The problem is taken from a plan
    # with the device's whole memory, which the planner settles at once.)
    program = _gpt_124m_on("40GiB")
    tight = replace(program.problem, devices=replace(program.problem.devices,
                                                     memory_bytes=(2**30,) * 4))
    with pytest.raises(partc.PlanInfeasibleError):
        solve(tight)


def test_infeasible_under_pinned_recompute_names_memory_not_solver_time():
    # Recompute would make the model fit; pinned to "none" nothing does. The error must
    # say memory (what the pins leave), not that a plan fits but the solver ran out.
    # The problem of a plan with the device's whole memory (settled at once): the
    # memory is set below.
    problem = _gpt_124m_on("40GiB").problem
    pinned = replace(problem, pins=replace(
        problem.pins, recompute={layer.name: "none" for layer in problem.layers}))
    configs = candidate_configs(pinned)
    need = min(max(tightest_split(build_cost_table(pinned, c), pinned).stage_need)
               for c in configs)
    tight = replace(pinned, devices=replace(pinned.devices, memory_bytes=(need - 1,) * 4))
    free = replace(tight, pins=problem.pins)
    assert any(tightest_split(build_cost_table(free, c), free).ratio <= 1
               for c in candidate_configs(free))   # recompute would fit it
    with pytest.raises(partc.PlanInfeasibleError) as info:
        solve(tight)
    assert info.value.resource == "memory" and "It would fit with" in str(info.value)


def test_pins_reach_the_plan():
    model = gpt_tiny(n_layer=4)
    program = partc.compile(model, (torch.zeros(2, 16, dtype=torch.long),), loss_fn=loss_fn,
                            budget=partc.DeviceBudget(num_devices=2, device="CPU"),
                            train=partc.TrainSpec(global_batch_size=4),
                            constraints=partc.Constraints(recompute="full", schedule="gpipe",
                                                          num_microbatches=4))
    plan = check(program)
    assert plan.schedule == "gpipe" and plan.num_microbatches == 4
    assert set(plan.recompute.values()) == {"full"}


def test_a_selective_pin_on_a_layer_without_attention_says_it_runs_as_none(caplog):
    """Selective recompute reruns attention cores: pinned by name on the final norm, it
    is planned as "none", and the user is told; pinned for every layer it is the
    attention layers' mode, and nothing is said."""
    ids = torch.zeros(4, 16, dtype=torch.long)
    for pinned, told in (({"ln_f": "selective"}, True), ("selective", False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="partc"):
            program = partc.compile(gpt_tiny(), (ids,), loss_fn=loss_fn,
                                    budget=partc.DeviceBudget(num_devices=1, device="CPU"),
                                    train=partc.TrainSpec(global_batch_size=4),
                                    constraints=partc.Constraints(recompute=pinned))
        assert program.plan.recompute["ln_f"] == "none"
        assert ("recompute pinned 'selective' on ln_f" in caplog.text) == told


def test_tensor_parallelism_is_measured_only_where_the_pinned_degrees_leave_devices():
    from partc.compiler import device_numbers, tp_degrees

    devices = device_numbers(partc.DeviceBudget(num_devices=4, device="CPU"), torch.float32)
    assert tp_degrees(devices, partc.Constraints()) == [2, 4]
    assert tp_degrees(devices, partc.Constraints(pp=2)) == [2]
    # pp=2 and dp=2 on four devices leave no pair to split a layer over: no sharding
    # search runs, so none can make the plan fail.
    assert tp_degrees(devices, partc.Constraints(pp=2, dp=2)) == []
    assert tp_degrees(devices, partc.Constraints(pp=4)) == []
    assert tp_degrees(devices, partc.Constraints(pp=4, tp=1)) == []


def test_save_round_trips_plan_and_report(tmp_path):
    program = partc.compile(gpt_tiny(), (torch.zeros(2, 16, dtype=torch.long),),
                            loss_fn=loss_fn,
                            budget=partc.DeviceBudget(num_devices=2, device="CPU"))
    program.save(tmp_path)
    data = json.loads((tmp_path / "plan.json").read_text())
    for key in ("mesh", "schedule", "num_microbatches", "micro_batch_size", "zero_stage",
                "stages", "tensor_parallel", "predicted", "solver", "budget", "train", "model"):
        assert key in data
    for key in ("step_time_s", "samples_per_s", "tokens_per_s", "mfu", "bubble_fraction",
                "peak_memory_bytes"):
        assert key in data["predicted"]
    loaded = Plan.from_dict(data)
    assert loaded == program.plan and loaded.hash == program.plan.hash
    assert render(loaded, "markdown") == (tmp_path / "report.md").read_text()
    assert json.loads(program.report("json"))["mesh"] == data["mesh"]


def test_cli_plans_and_writes(tmp_path, capsys):
    from partc.cli.main import main

    factory = tmp_path / "work.py"
    factory.write_text(
        "import torch\n"
        "from samples.gpt import gpt_tiny, loss_fn\n"
        "def make():\n"
        "    return gpt_tiny(), (torch.zeros(2, 16, dtype=torch.long),), loss_fn\n")
    code = main(["plan", f"{factory}:make", "--devices", "2", "--device", "CPU",
                 "--pp", "2", "--attention", "fused", "--out", str(tmp_path / "out"), "-q"])
    assert code == 0
    assert "partc plan" in capsys.readouterr().out
    saved = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert saved["train"]["attention"] == "fused"
    code = main(["plan", f"{factory}:make", "--devices", "2", "--device", "CPU",
                 "--memory", "1KiB", "-q"])
    assert code == 2 and "PlanInfeasibleError" in capsys.readouterr().err


def test_interleaved_schedule_is_planned_saved_and_runnable(tmp_path):
    model = gpt_tiny(n_layer=4)
    ids = torch.zeros(8, 16, dtype=torch.long)
    program = partc.compile(model, (ids,), budget=partc.DeviceBudget(num_devices=2,
                                                                     device="CPU"),
                            train=partc.TrainSpec(global_batch_size=8), loss_fn=loss_fn,
                            example_target=ids,
                            constraints=partc.Constraints(pp=2, tp=1,
                                                          schedule="interleaved-1f1b"))
    plan = check(program)
    assert plan.chunks >= 2 and all(len(s.runs) == plan.chunks for s in plan.stages)
    names = [layer.name for layer in program.problem.layers]
    assert [name for run in plan.runs for name in run] == names
    # Rank 0 holds runs 0, 2, ...: its layers interleave with rank 1's.
    assert plan.stages[0].runs[1][0] in plan.stages[0].layers
    assert " + " in program.report()
    program.save(tmp_path)
    loaded = Plan.from_json((tmp_path / "plan.json").read_text())
    assert loaded == plan and loaded.hash == plan.hash
    # One file per virtual stage (pp x v), each naming the rank that holds it.
    files = sorted((tmp_path / "code").glob("stage_*.py"))
    assert len(files) == plan.pp * plan.chunks
    assert "Virtual stage 1 of" in files[1].read_text()
    partc.validate_plan(program.problem, loaded)
    # The runtime runs it (tests/runtime/test_schedules.py trains it under torchrun), and
    # refuses what torch's schedules cannot run with parity, before any process group.
    assert runtime_refusal(plan) is None
    odd = dataclasses.replace(plan, num_microbatches=5)   # 2 rounds of 2 stages, and 1
    assert "a multiple of its rounds" in runtime_refusal(odd)
    zero_bubble = dataclasses.replace(plan, schedule="interleaved-zero-bubble", zero_stage=2,
                                      mesh=dataclasses.replace(plan.mesh, dp=2))
    assert "FSDP (ZeRO-2)" in runtime_refusal(zero_bubble)
    with pytest.raises(partc.PartcError, match="cannot run: .*FSDP"):
        zero_bubble_program = dataclasses.replace(program, plan=zero_bubble)
        zero_bubble_program.build()


_LAYERS = ["tok_emb", "pos_emb", "drop", "blocks.0", "blocks.1", "ln_f", "lm_head", "loss"]


@pytest.mark.parametrize("devices, node, pins, pin, fragment", [
    (16, 16, dict(pp=16), "pp", "pp=16 stages need at least 16 layers; the model has 8"),
    (4, 4, dict(pp=3), "pp", "pp=3 does not divide the 4 devices"),
    (4, 4, dict(pp=2, dp=1, tp=1), "pp x dp x tp", "= 2, not the 4 devices"),
    (4, 4, dict(pp=2, dp=4), "pp x dp", "pp=2 x dp=4 does not divide the 4 devices"),
    (8, 8, dict(dp=8), "dp", "dp=8 does not divide the global batch 4"),
    (2, 2, dict(num_microbatches=3), "num_microbatches", "does not divide the global batch 4"),
    (2, 2, dict(micro_batch_size=3), "micro_batch_size", "does not divide the global batch 4"),
    (2, 2, dict(dp=2, micro_batch_size=4), "micro_batch_size",
     "does not divide the 2 samples per replica"),
    (2, 2, dict(stages=[["nope"], _LAYERS]), "stages", "unknown layers ['nope']"),
    (2, 2, dict(stages=[_LAYERS[:3], _LAYERS[4:]]), "stages", "missing ['blocks.0']"),
    (2, 2, dict(recompute={"nope": "full"}), "recompute", "unknown layers ['nope']"),
    (4, 2, dict(tp=4), "tp", "tp=4 must divide the 2 devices of a node"),
    (4, 4, dict(cp=3), "cp", "cp=3 does not divide the 4 devices"),
    (4, 4, dict(cp=2, dp=4), "dp", "dp=4 does not divide the 4 devices / cp=2"),
    (8, 8, dict(pp=2, dp=1, cp=2, tp=1), "pp x dp x cp x tp", "= 4, not the 8 devices"),
])
def test_pins_that_cannot_hold_name_the_pin(devices, node, pins, pin, fragment):
    budget = partc.DeviceBudget(num_devices=devices, device="CPU", devices_per_node=node)
    with pytest.raises(partc.PlanInfeasibleError) as info:
        partc.compile(gpt_tiny(n_layer=2), (torch.zeros(4, 16, dtype=torch.long),),
                      loss_fn=loss_fn, budget=budget, constraints=partc.Constraints(**pins),
                      train=partc.TrainSpec(global_batch_size=4), cache=None)
    assert info.value.pin == pin and info.value.resource == "pin"
    assert f"cannot hold the pin {pin}: " in str(info.value) and fragment in str(info.value)


def test_the_planner_refuses_pins_of_a_problem_built_by_hand():
    # Planning a PlanningProblem directly (no compile) takes the same checks.
    program = partc.compile(gpt_tiny(n_layer=2), (torch.zeros(4, 16, dtype=torch.long),),
                            loss_fn=loss_fn, budget=partc.DeviceBudget(num_devices=16,
                                                                       device="CPU"),
                            train=partc.TrainSpec(global_batch_size=16), cache=None,
                            # (pinned here only to keep the first plan quick)
                            constraints=partc.Constraints(pp=1, tp=1))
    problem = dataclasses.replace(program.problem, pins=Pins(pp=16))
    with pytest.raises(partc.PlanInfeasibleError, match="pp=16 stages need at least 16"):
        solve(problem)


class _Chain(torch.nn.Module):
    """fc1: 8 → 16, then relu, * 2, - 1 (one chain of element-wise ops), fc2: 16 → 8."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * 2.0 - 1.0)


def test_a_fused_chain_moves_its_inputs_and_outputs_once():
    from partc.passes import analyze

    _, analysis = analyze(_Chain(), (torch.randn(2, 8),))
    fc1 = analysis.layers[0]
    # Eager: relu, mul and sub each read and write 16 floats per sample.
    assert fc1.fwd_mem_bytes == 6 * 16 * 4 and fc1.num_nodes == 4
    # Fused: fc1's output read once; sub's output (fc2 reads it) and relu's output
    # (relu's backward keeps it) written once; one kernel.
    assert fc1.fused_mem_bytes == 3 * 16 * 4 and fc1.fused_kernels == 1


class _Scan(torch.nn.Module):
    """A reference scan between two linears: ``s = s * exp(h)[t] + h[t]`` over the
    sequence, every iteration reading the one early value ``exp(h)``."""

    STEPS = 64

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc1(x)
        a = torch.exp(h)
        s = h[:, 0]
        for t in range(1, self.STEPS):
            s = s * a[:, t] + h[:, t]
        return self.fc2(s)


def test_a_scan_loop_is_one_fused_kernel():
    from partc.passes import analyze

    steps = _Scan.STEPS
    _, analysis = analyze(_Scan(), (torch.randn(2, steps, 8),))
    fc1 = analysis.layers[0]
    # Every light op of the loop joins one chain (the early exp read by each iteration
    # is where a plain union-find walk went quadratic): one kernel, reading fc1's output
    # once and writing what backward keeps (exp's output, each mul's running sum) and
    # what fc2 reads (the last sum), per sample: 16 floats each.
    assert fc1.fused_kernels == 1
    assert fc1.fused_mem_bytes == (steps + steps + (steps - 1)) * 16 * 4


def test_compiled_stages_are_priced_fused_under_every_zero_stage():
    model = gpt_tiny()
    ids, target = torch.randint(0, 128, (8, 16)), torch.randint(0, 128, (8, 16))

    def compiled(flag: bool, **pins) -> partc.Program:
        return partc.compile(model, (ids,), loss_fn=loss_fn, example_target=target,
                             budget=partc.DeviceBudget(num_devices=2, device="CPU"),
                             train=partc.TrainSpec(global_batch_size=8, compile=flag),
                             constraints=partc.Constraints(pp=1, dp=2, **pins))

    fused, eager = check(compiled(True)), check(compiled(False))
    assert fused.train.compile and not eager.train.compile
    assert fused.predicted.step_time_s < eager.predicted.step_time_s
    assert Plan.from_json(fused.to_json()).train == fused.train
    # FSDP2's units are compiled one by one (partc.runtime.compiled).
    zero3, eager3 = check(compiled(True, zero_stage=3)), check(compiled(False, zero_stage=3))
    assert zero3.train.compile and zero3.effective_zero_stage == 3
    assert zero3.predicted.step_time_s < eager3.predicted.step_time_s
    with pytest.raises(ValueError, match="TrainSpec.compile must be None"):
        partc.TrainSpec(global_batch_size=8, compile="yes")


def _tiny_plan(device: str, **train) -> Plan:
    ids = torch.randint(0, 128, (8, 16))
    return check(partc.compile(
        gpt_tiny(), (ids,), loss_fn=loss_fn, example_target=ids,
        budget=partc.DeviceBudget(num_devices=2, device=device),
        train=partc.TrainSpec(global_batch_size=8, dtype=torch.bfloat16, **train),
        constraints=partc.Constraints(pp=2)))


def test_kernel_choices_default_to_the_fastest_on_a_gpu_and_eager_on_a_cpu():
    """No switches: a GPU preset's plan compiles, fuses attention and steps Adam fused
    (each priced: faster than the same plan with them pinned off); the CPU preset's
    runs as written. Pins are kept, and a split-backward schedule plans uncompiled."""
    gpu = _tiny_plan("H100")
    assert (gpu.train.compile, gpu.train.attention, gpu.train.fused_optimizer) \
        == (True, "fused", True)
    off = _tiny_plan("H100", compile=False, attention="as_written", fused_optimizer=False)
    assert (off.train.compile, off.train.attention, off.train.fused_optimizer) \
        == (False, "as_written", False)
    assert gpu.predicted.step_time_s < off.predicted.step_time_s
    cpu = _tiny_plan("CPU")
    assert (cpu.train.compile, cpu.train.attention, cpu.train.fused_optimizer) \
        == (False, "as_written", False)
    # The first step's compile, estimated, in the report beside what runs.
    assert gpu.predicted.compile_time_s > 0 and cpu.predicted.compile_time_s is None
    assert "kernels: compiled (torch.compile), attention fused, optimizer step fused; the " \
        "first step compiles for about" in render(gpu)
    assert "kernels: eager, attention as written, optimizer step unfused\n" in render(cpu)
    # The zero-bubble schedules split backward, which a compiled region cannot: left to
    # the planner they run eagerly; pinned on, compile refuses them.
    split = _tiny_plan("H100", schedule="zbv-zero-bubble")
    assert split.schedule == "zbv-zero-bubble" and split.train.compile is False
    with pytest.raises(partc.PlanInfeasibleError, match="compiled region"):
        _tiny_plan("H100", schedule="zbv-zero-bubble", compile=True)


def test_compile_time_builds_a_repeated_block_once():
    from partc.cost.compile_time import BUILD_S_PER_NODE, FIXED_S, FP8_S_PER_LINEAR, \
        TRACE_S_PER_NODE, rank_compile_seconds
    from types import SimpleNamespace

    def layer(name: str, signature: str) -> SimpleNamespace:   # what it reads of a LayerCost
        return SimpleNamespace(name=name, signature=signature, num_nodes=10, heavy_ops=(
            SimpleNamespace(linear_names=(f"{name}.fc.weight",)),))

    blocks = [layer(f"blocks.{i}", "block") for i in range(3)]
    seconds = rank_compile_seconds(blocks, gpu=True)
    assert seconds == pytest.approx(FIXED_S + 30 * TRACE_S_PER_NODE + 10 * BUILD_S_PER_NODE["gpu"])
    assert rank_compile_seconds(blocks[:1], gpu=False) > rank_compile_seconds(blocks[:1], gpu=True)
    # Each FP8 linear traces as torchao's subclasses: every one pays, repeated or not.
    fp8 = rank_compile_seconds(blocks, gpu=True, fp8_linears={"blocks.0.fc.weight",
                                                               "blocks.2.fc.weight"})
    assert fp8 == pytest.approx(seconds + 2 * FP8_S_PER_LINEAR)


def test_a_plan_from_before_kernel_choices_loads_with_them_as_written():
    """plan.json files written when compile and attention were plain switches (and the
    optimizer step was not a choice) read back with those values: nothing re-decided."""
    from pathlib import Path

    data = json.loads((Path(__file__).parent / "data" / "plan_v2_tp2_sp.json").read_text())
    assert "fused_optimizer" not in data["train"]
    plan = Plan.from_json(json.dumps(data))
    assert plan.train.compile is False and plan.train.attention == "as_written"
    assert plan.train.fused_optimizer is None
    assert Plan.from_json(plan.to_json()) == plan


def test_compiled_stages_are_refused_where_they_cannot_train(monkeypatch):
    from torch._inductor import cpp_builder

    from partc.runtime import compiled

    cpu = torch.device("cpu")
    assert compiled.refusal(cpu) is None

    def no_compiler():
        raise RuntimeError("no g++")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    compiled._no_cpu_compiler.cache_clear()
    try:
        assert "needs a C++ compiler" in compiled.refusal(cpu)
        assert compiled.refusal(torch.device("cuda")) is None
    finally:
        compiled._no_cpu_compiler.cache_clear()


def test_data_dependent_experts_loop_is_refused_by_compile_naming_op_and_module():
    """Mixtral's older experts loop (torch.where per expert) reaches the user as the
    TraceError propagate raises, not as fake tensors' exception."""
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(partc.TraceError, match="where in module moes.0 gives a tensor whose "
                                               "shape depends on tensor values"):
        partc.compile(models.ListMoEModel(dispatch="indexed"), ids, loss_fn=models.token_loss,
                      example_target=ids, budget=partc.DeviceBudget(num_devices=2, device="CPU"),
                      train=partc.TrainSpec(global_batch_size=8))


WRONG_ARGUMENTS = [
    # (call, argument, type given, words of the type expected)
    (dict(constraints={"pp": 2}), "constraints", "dict", "partc.Constraints or None"),
    (dict(budget=None), "budget", "None", "partc.DeviceBudget"),
    (dict(train={"global_batch_size": 2}), "train", "dict", "partc.TrainSpec or None"),
    (dict(options=5), "options", "int", "partc.PlannerOptions or None"),
    (dict(name=3), "name", "int", "a str or None"),
    (dict(cache="here"), "cache", "str", "partc.PlanCache or None"),
    (dict(loss_fn="mse"), "loss_fn", "str", "a callable"),
    (dict(model=torch.zeros(2)), "model", "Tensor", "a torch.nn.Module"),
]


@pytest.mark.parametrize("change, argument, got, expected", WRONG_ARGUMENTS,
                         ids=[case[1] for case in WRONG_ARGUMENTS])
def test_a_wrong_argument_type_is_named_before_anything_runs(change, argument, got,
                                                             expected):
    arguments = dict(model=torch.nn.Linear(4, 4), example_inputs=(torch.zeros(2, 4),),
                     budget=partc.DeviceBudget(num_devices=2, device="CPU"), **{})
    arguments.update(change)
    with pytest.raises(partc.ArgumentTypeError) as refused:
        partc.compile(arguments.pop("model"), arguments.pop("example_inputs"), **arguments)
    error = refused.value
    assert isinstance(error, TypeError) and isinstance(error, partc.PartcError)
    assert (error.argument, error.got) == (argument, got)
    assert f"partc.compile({argument}=...)" in str(error) and expected in str(error)


def test_load_and_build_name_a_wrong_argument_type(tmp_path):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(partc.ArgumentTypeError, match=r"partc.load\(directory=...\)"):
        partc.load(3, model)
    with pytest.raises(partc.ArgumentTypeError, match=r"partc.load\(model=...\): expected "
                                                      r"a torch.nn.Module, got dict"):
        partc.load(tmp_path, {"weight": torch.zeros(4, 4)})
    from tests.test_report import _plan

    program = partc.Program(plan=_plan(), model=model)
    with pytest.raises(partc.ArgumentTypeError, match=r"Program.build\(state_dict=...\)"):
        program.build(state_dict=[torch.zeros(4, 4)])
    with pytest.raises(partc.ArgumentTypeError, match=r"Program.build\(device=...\)"):
        program.build(device=0)
