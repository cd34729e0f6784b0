"""The typed plan: sections as frozen dataclasses, plan.json round trips, version-1 files
load (or are refused with what to do), and derived facts computed in one place."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

import partc
from partc.codec import check
from partc.compiler import plan_problem
from partc.cost.pipeline_config import PipelineConfig
from partc.device.figures import DeviceFigures
from partc.errors import PlanFileError, PlanSchemaError
from partc.names import CpKind
from partc.placement import REPLICATE, Placement
from partc.plan import (DECIDED, NOT_DECIDED, SCHEMA_VERSION, BudgetInfo, Mesh, ModelInfo,
                        P2PMessages, Plan, Predicted, StageMemory, StageTime,
                        TensorParallelPlan, migrate_v1)
from partc.planner.validate import field_conflicts
from partc.program import read_plan_file
from partc.problem import Precision, effective_zero_stage
from partc.runtime.precision import compute_dtype
from samples.gpt import gpt_tiny, loss_fn
from tests.planner.instances import devices, layer, problem

V1_FILE = Path(__file__).parent / "data" / "plan_v1_gpt_tiny_pp2_bf16.json"
# Version-2 files written by partc before the codec was the plan's serializer (the
# test_plan cases of the same names, and tests/planner/test_experts.py's moe_problem
# with ep pinned to 4), with the hashes that partc gave them.
V2_FILES = {"tp2_sp": "db34962bd009c382", "interleaved": "b98f6aeae48c7e6c",
            "zero2_step": "b9433c6227984d29", "moe_ep4": "db166a6f6f85578f"}
IDS = torch.zeros(2, 16, dtype=torch.long)

CASES = {
    "pp2": (2, dict(pp=2), torch.float32),
    "tp2_sp": (2, dict(pp=1, tp=2, sequence_parallel=True, tp_objective="memory"),
               torch.float32),
    "zero3_bf16": (2, dict(pp=1, dp=2, zero_stage=3), torch.bfloat16),
    "interleaved": (2, dict(pp=2, schedule="interleaved-1f1b", num_microbatches=4),
                    torch.float32),
    "zero2_step": (2, dict(pp=1, dp=2, zero_stage=2, zero2_grad_sync="step",
                           num_microbatches=4), torch.float32),
}


def _compile(devices_: int, constraints: dict, dtype: torch.dtype, *,
             batch: int = 8) -> partc.Program:
    return partc.compile(gpt_tiny(n_layer=2), (IDS,), loss_fn=loss_fn,
                         budget=partc.DeviceBudget(num_devices=devices_, device="CPU"),
                         train=partc.TrainSpec(global_batch_size=batch, dtype=dtype,
                                               max_grad_norm=1.0),
                         constraints=partc.Constraints(**constraints), cache=None)


@pytest.fixture(scope="module")
def programs() -> dict[str, partc.Program]:
    return {name: _compile(*case) for name, case in CASES.items()}


def _from_numbers(precision: Precision) -> Plan:
    """A plan of a hand-built problem: budget and training known only as numbers."""
    prob = problem([layer(f"l{i}") for i in range(3)], [1.0, 1.0], devices(2, 10**9),
                   batch=2)
    prob = replace(prob, train=replace(prob.train, precision=precision))
    return plan_problem(prob)


@pytest.mark.parametrize("name", sorted(CASES))
def test_to_json_from_json_is_the_same_plan(programs, name):
    plan = programs[name].plan
    check(plan, Plan)   # the planner's plan holds its types (enums, not their strings)
    loaded = Plan.from_json(plan.to_json())
    assert loaded == plan and loaded.hash == plan.hash
    assert loaded.to_dict() == plan.to_dict()
    assert plan.to_dict()["schema_version"] == SCHEMA_VERSION
    assert isinstance(loaded.mesh, Mesh) and isinstance(loaded.predicted, Predicted)
    assert isinstance(loaded.budget, BudgetInfo) and isinstance(loaded.model, ModelInfo)
    for stage in loaded.stages:
        assert isinstance(stage.memory_bytes, StageMemory)
        assert isinstance(stage.time_s, StageTime)
        assert isinstance(stage.p2p, P2PMessages)


@pytest.mark.parametrize("mixed", [False, True])
def test_a_plan_from_numbers_round_trips(mixed):
    plan = _from_numbers(Precision(compute_bytes=2 if mixed else 4, optimizer_state_bytes=8))
    assert plan.train.dtype == (torch.bfloat16 if mixed else torch.float32)
    assert plan.train.optimizer == 8.0            # the optimizer's own state, no master
    assert plan.budget.device == "custom" and plan.stages[0].p2p is None
    assert Plan.from_json(plan.to_json()) == plan


def test_the_schema_keeps_every_key_design_names(programs):
    data = json.loads(programs["pp2"].plan.to_json())
    for key in ("mesh", "schedule", "num_microbatches", "micro_batch_size", "zero_stage",
                "stages", "tensor_parallel", "predicted", "solver", "budget", "train",
                "model"):
        assert key in data
    assert set(data["mesh"]) == {"pp", "dp", "tp"}
    stage = data["stages"][0]
    assert {"index", "layers", "recompute", "memory_bytes", "limit_bytes", "time_s"} <= set(stage)
    assert {"params", "grads", "optimizer", "activations", "peak"} <= set(stage["memory_bytes"])
    assert {"forward", "backward", "recompute", "comm"} <= set(stage["time_s"])
    assert {"step_time_s", "samples_per_s", "tokens_per_s", "mfu", "bubble_fraction",
            "peak_memory_bytes"} <= set(data["predicted"])
    assert {"status", "objective", "bound", "gap", "solve_time_s"} <= set(data["solver"])
    assert {"name", "num_params", "hash"} <= set(data["model"])
    assert data["train"]["dtype"] == "float32"


def test_a_version_1_file_loads_with_its_hash_unchanged():
    # Written by partc before the typed plan (schema 1) for this very compile.
    old = Plan.from_json(V1_FILE.read_text())
    # The file's plan is 2 microbatches of 2: pinned, since the cost model now charges
    # each microbatch its per-op overhead and picks 1 of 4 for this tiny model on a CPU.
    # 1F1B pinned: the file's plan was 1F1B, and the planner now weighs every schedule.
    program = _compile(2, dict(pp=2, num_microbatches=2, schedule="1f1b"), torch.bfloat16,
                       batch=4)
    # 407706854767671d: the hash the partc that wrote the file gave the plan.
    assert old.hash == program.plan.hash == "407706854767671d"
    # Files before partc recorded the traced batch do not hold it, nor whether loss_fn
    # averages over its counted targets (it is asked now: it does).
    assert program.plan.model.counted_target
    assert old.model == replace(program.plan.model, traced_batch_size=None,
                                counted_target=False)
    # The decisions read back as written; the times are the cost model's of its day (no
    # per-op overhead then), and so is the budget section (no overheads recorded).
    new = program.plan
    assert replace(old, solver=new.solver, model=new.model, stages=new.stages,
                   predicted=new.predicted, budget=new.budget, alternatives=new.alternatives,
                   meshes=new.meshes, schedules=new.schedules) == new
    assert [(s.layers, s.recompute) for s in old.stages] == \
        [(s.layers, s.recompute) for s in new.stages]
    # The figures the file recorded are today's; those it did not record read as None.
    recorded = DeviceFigures(**{name: getattr(new.budget.figures, name)
                                for name in old.budget.figures.known()})
    assert replace(new.budget, figures=recorded) == old.budget
    assert old.train.dtype == torch.bfloat16 and old.train.max_grad_norm == 1.0
    # Its decisions hold under today's cost model (its recorded times are of its day).
    partc.validate_plan(program.problem, replace(old, stages=new.stages,
                                                 predicted=new.predicted))


@pytest.mark.parametrize("name", sorted(V2_FILES))
def test_a_version_2_file_reads_with_its_hash_and_writes_back_the_same(name):
    path = Path(__file__).parent / "data" / f"plan_v2_{name}.json"
    plan = read_plan_file(path)
    assert plan.hash == V2_FILES[name]
    assert plan.to_json() == path.read_text()


def test_every_field_of_the_plan_is_a_decision_or_not():
    # A field added to Plan must say whether ranks compare it (Plan.hash) or not.
    names = [f.name for f in fields(Plan)]
    assert sorted(DECIDED + NOT_DECIDED) == sorted(names)
    assert not set(DECIDED) & set(NOT_DECIDED)


def test_version_1_numbers_only_sections_migrate():
    plan = _from_numbers(Precision(compute_bytes=2, optimizer_state_bytes=8)).to_dict()
    # What version 1 wrote for a problem planned from numbers alone.
    plan.update(schema_version=1, train={"global_batch_size": 2, "dtype": "2-byte weights",
                                         "optimizer": "12 bytes of state per parameter"})
    for stage in plan["stages"]:
        stage["p2p"] = {}
    migrated = migrate_v1(plan)
    assert migrated["train"]["dtype"] == "bfloat16" and migrated["train"]["optimizer"] == 8.0
    loaded = Plan.from_dict(plan)
    assert loaded.train.dtype == torch.bfloat16 and loaded.stages[0].p2p is None


def test_other_versions_and_damaged_files_are_refused_with_what_to_do(programs):
    data = programs["pp2"].plan.to_dict()
    with pytest.raises(PlanSchemaError, match="compile the model again"):
        Plan.from_dict({**data, "schema_version": SCHEMA_VERSION + 1})
    lacking = {k: v for k, v in data.items() if k != "predicted"}
    with pytest.raises(PlanSchemaError, match="predicted"):
        Plan.from_dict({**lacking, "schema_version": 1})
    with pytest.raises(PlanSchemaError, match="mesh.hp: unknown key"):
        Plan.from_dict({**data, "mesh": {**data["mesh"], "hp": 2}})


def test_effective_zero_stage_is_one_rule(programs):
    zero3 = programs["zero3_bf16"].plan
    assert zero3.zero_stage == zero3.effective_zero_stage == 3
    one_replica = replace(programs["pp2"].plan, zero_stage=2)
    assert one_replica.dp == 1 and one_replica.effective_zero_stage == 0
    for dp, zero in ((1, 3), (2, 1), (4, 3)):
        config = PipelineConfig(pp=1, dp=dp, micro_batch_size=1, num_microbatches=1,
                                schedule="1f1b", zero_stage=zero)
        assert config.effective_zero_stage == effective_zero_stage(zero, dp)
        assert config.effective_zero_stage == (zero if dp > 1 else 0)


def test_zero2_grad_sync_is_kept_and_older_plans_read_per_microbatch(programs):
    program = programs["zero2_step"]
    plan = program.plan
    assert plan.zero2_grad_sync == "step" and plan.reduces_once
    assert plan.to_dict()["zero2_grad_sync"] == "step"
    assert "reduce-scattered once per step" in program.report()
    chosen = next(m for m in plan.meshes if (m.pp, m.dp) == (1, 2))
    assert chosen.zero2_grad_sync == "step" and "ZeRO-2 (once per step)" in program.report()
    older = {k: v for k, v in plan.to_dict().items() if k != "zero2_grad_sync"}
    assert Plan.from_dict(older).zero2_grad_sync == "microbatch"
    assert Plan.from_dict(older).hash != plan.hash
    # A plan reducing per microbatch hashes as plans written before the key did.
    pp2 = programs["pp2"].plan
    assert pp2.zero2_grad_sync == "microbatch" and not pp2.reduces_once
    unkeyed = {k: v for k, v in pp2.to_dict().items() if k != "zero2_grad_sync"}
    assert Plan.from_dict(unkeyed).hash == pp2.hash
    # One microbatch, or one replica: nothing to reduce once.
    assert not replace(plan, num_microbatches=1).reduces_once
    assert not replace(plan, mesh=replace(plan.mesh, dp=1)).reduces_once


def test_bytes_per_parameter_by_precision():
    fp32 = partc.TrainSpec(global_batch_size=8).precision
    bf16 = partc.TrainSpec(global_batch_size=8, dtype=torch.bfloat16, optimizer="adam").precision
    assert (fp32.compute_bytes, fp32.master_bytes, fp32.optimizer_state_bytes) == (4, 4, 8)
    assert (bf16.compute_bytes, bf16.master_bytes, bf16.optimizer_state_bytes) == (2, 4, 8)
    assert not fp32.mixed and bf16.mixed
    assert bf16.zero_paper_bytes == (2, 2, 12) and fp32.zero_paper_bytes == (4, 4, 8)


def test_mixed_precision_state_is_what_the_runtime_holds():
    # bf16 Adam without ZeRO: fp32 parameters (the master) and their bf16 copy for the
    # step, fp32 gradients, 8 bytes of state (tests/runtime/test_distributed_optimizer.py
    # measures them).
    program = _compile(2, dict(pp=2), torch.bfloat16)
    for stage in program.plan.stages:
        memory = stage.memory_bytes
        assert (memory.params, memory.grads, memory.optimizer) == \
            (6 * stage.param_count, 4 * stage.param_count, 8 * stage.param_count)


def test_the_runtime_reads_the_real_dtype(programs):
    plan = programs["zero3_bf16"].plan
    assert plan.train.dtype is torch.bfloat16 and compute_dtype(plan) is torch.bfloat16
    assert plan.to_dict()["train"]["dtype"] == "bfloat16"
    assert programs["pp2"].plan.train.dtype is torch.float32


def test_placements_are_typed(programs):
    plan = programs["tp2_sp"].plan
    section = plan.tensor_parallel
    assert isinstance(section, TensorParallelPlan) and section.degree == plan.tp == 2
    assert section.sequence_parallel and plan.sequence_parallel
    assert all(isinstance(p, Placement) for p in section.params.values())
    sharded = {fqn: p for fqn, p in section.params.items() if p.is_shard}
    assert sharded, section.params
    fqn, placement = next(iter(sharded.items()))
    assert plan.placement(("not.a.parameter", fqn)) == placement
    assert plan.placement(("not.a.parameter",)) == REPLICATE
    assert plan.to_dict()["tensor_parallel"]["params"][fqn] == str(placement)
    assert programs["pp2"].plan.tensor_parallel is None
    assert programs["pp2"].plan.to_dict()["tensor_parallel"] == {}


def test_offload_is_written_only_when_on_and_older_plans_read_off(programs):
    plan = programs["pp2"].plan
    assert (plan.offload_optimizer, plan.offload_params, plan.host_bytes_per_node) == \
        (False, False, 0) and plan.offload == ()
    data = plan.to_dict()
    assert not {"offload_optimizer", "offload_params", "host_bytes_per_node"} & set(data)
    on = replace(plan, offload_optimizer=True, host_bytes_per_node=10**6)
    assert on.offload == ("optimizer",)
    assert Plan.from_dict(on.to_dict()) == on and on.hash != plan.hash
    assert replace(plan, host_bytes_per_node=1).hash == plan.hash   # not a decision


def _edit(data: dict, change) -> dict:
    data = json.loads(json.dumps(data))
    change(data)
    return data


EDITS = {
    # a stage's layers contradicting its runs (what lowering reads)
    "stages[0].layers": lambda d: d["stages"][0].update(
        layers=d["stages"][0]["layers"][::-1]),
    "zero_stage": lambda d: d.update(zero_stage=1),                         # with dp=1
    "zero2_grad_sync": lambda d: d.update(zero2_grad_sync="step"),          # not ZeRO-2
    "stages[1].index": lambda d: d["stages"][1].update(index=0),
    "stages[0].recompute": lambda d: d["stages"][0]["recompute"].popitem(),
    "model.num_layers": lambda d: d["model"].update(num_layers=d["model"]["num_layers"] + 1),
    "train.global_batch_size": lambda d: d["train"].update(global_batch_size=16),
    "mesh": lambda d: d["budget"].update(num_devices=4),
    "mesh.cp_kind": lambda d: d["mesh"].update(cp_kind="ring"),             # with cp=1
    # 16 tokens do not split into 2 x cp = 6 chunks (the budget grown to the mesh)
    "mesh.cp": lambda d: (d["mesh"].update(cp=3, cp_kind="all-to-all"),
                          d["budget"].update(num_devices=6)),
    "offload_params": lambda d: d.update(offload_params=True),             # not ZeRO-3
}


@pytest.mark.parametrize("field", sorted(EDITS))
def test_fields_that_contradict_each_other_are_refused_naming_the_field(programs, tmp_path,
                                                                         field):
    plan = programs["interleaved"].plan
    assert plan.chunks == 2 and plan.dp == 1
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_edit(plan.to_dict(), EDITS[field])))
    with pytest.raises(PlanFileError) as refused:
        read_plan_file(path)
    assert refused.value.field == field and "contradict" in str(refused.value)


def test_plans_the_planner_writes_agree_with_themselves(programs):
    for program in programs.values():
        assert field_conflicts(program.plan) == []
    # ZeRO pinned, one replica chosen: the plan records what runs (no ZeRO).
    pinned = _compile(2, dict(pp=2, zero_stage=1), torch.float32)
    assert pinned.plan.dp == 1 and pinned.plan.zero_stage == 0


def test_context_parallelism_round_trips_and_older_plans_read_cp_1(programs):
    plan = programs["pp2"].plan
    assert plan.cp == 1 and plan.cp_kind is None
    assert "cp" not in plan.to_dict()["mesh"]   # plans without cp are written as before

    def devices_(n: int) -> BudgetInfo:
        return replace(plan.budget, num_devices=n, memory_bytes=plan.budget.memory_bytes[:1] * n)

    cp_plan = replace(plan, mesh=replace(plan.mesh, cp=2, cp_kind=CpKind.RING),
                      budget=devices_(4))
    data = cp_plan.to_dict()
    assert data["mesh"]["cp"] == 2 and data["mesh"]["cp_kind"] == "ring"
    loaded = Plan.from_json(cp_plan.to_json())
    assert loaded == cp_plan and loaded.cp_kind is CpKind.RING
    assert loaded.mesh.size == 4 and loaded.hash != plan.hash
    assert str(loaded.mesh) == "pp=2 dp=1 cp=2 (ring) tp=1"
    assert field_conflicts(loaded) == []
    assert field_conflicts(replace(loaded, budget=devices_(2))) == [
        ("mesh", "pp=2 dp=1 cp=2 (ring) tp=1 uses 4 devices, the budget has 2")]
    no_kind = replace(loaded, mesh=replace(loaded.mesh, cp_kind=None))
    assert [f for f, _ in field_conflicts(no_kind)] == ["mesh.cp_kind"]
