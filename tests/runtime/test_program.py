"""The back half on one process: load without the solver, the launch checks, and
one-device training through the runtime (recompute: tests/passes/test_recompute.py)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

import partc
from partc.report.text import render
from samples.gpt import gpt_tiny, loss_fn
from tests import models
from tests.tolerances import BF16

B, T = 8, 16


def tokens(step: int = 0, vocab: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, vocab, (B, T + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def compile_gpt(model: torch.nn.Module, devices: int, **constraints) -> partc.Program:
    x, y = tokens()
    return partc.compile(model, (x,), loss_fn=loss_fn, example_target=y,
                         budget=partc.DeviceBudget(num_devices=devices, device="CPU"),
                         train=partc.TrainSpec(global_batch_size=B),
                         constraints=partc.Constraints(**constraints))


@pytest.fixture
def process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_wrong_world_size_is_refused_before_any_collective():
    program = compile_gpt(gpt_tiny(), 2, pp=2)
    with pytest.raises(partc.PlanMismatchError, match=r"needs 2 processes .* but 1 were started"):
        program.build()
    assert not dist.is_initialized()


def test_load_rebuilds_from_plan_json_without_the_solver(tmp_path, monkeypatch):
    model = gpt_tiny()
    program = compile_gpt(model, 2, pp=2, schedule="1f1b", recompute={"blocks.1": "full"})
    program.save(tmp_path)
    assert sorted(p.name for p in (tmp_path / "code").iterdir()) == ["stage_0.py", "stage_1.py"]

    def no_solver(*args, **kwargs):
        raise AssertionError("load must not plan again")

    monkeypatch.setattr("partc.compiler.solve", no_solver)
    loaded = partc.load(tmp_path, model, loss_fn=loss_fn)
    assert loaded.plan.hash == program.plan.hash
    assert loaded.code() == program.code()
    for name, source in loaded.code().items():
        assert (tmp_path / "code" / name).read_text() == source


def test_load_for_another_model_is_refused(tmp_path):
    compile_gpt(gpt_tiny(), 1).save(tmp_path)
    with pytest.raises(partc.PlanMismatchError, match="not the one the plan was made for"):
        partc.load(tmp_path, gpt_tiny(n_layer=3), loss_fn=loss_fn)
    with pytest.raises(FileNotFoundError, match="no plan.json"):
        partc.load(tmp_path / "missing", gpt_tiny())


def _truncate(text: str) -> str:
    return text[:len(text) // 2]


def _drop(data: dict, section: str, key: str) -> None:
    del (data[section] if section else data)[key]


def _rename_layer(data: dict) -> None:
    stage = data["stages"][0]
    old = stage["layers"][-1]
    stage["layers"][-1] = old + "_renamed"
    stage["recompute"][old + "_renamed"] = stage["recompute"].pop(old)


# (edit of a saved plan.json, the error, what its message must name)
EDITS = {
    "truncated": (None, partc.PlanFileError, "not JSON"),
    "missing key": (lambda d: _drop(d, "", "schedule"), partc.PlanFileError, "schedule"),
    "missing nested key": (lambda d: _drop(d["stages"][0], "memory_bytes", "peak"),
                           partc.PlanFileError, "memory_bytes"),
    "mistyped": (lambda d: d["stages"][0]["time_s"].update(forward="fast"),
                 partc.PlanFileError, r"stages\[0\]\.time_s\.forward: expected float"),
    "max_grad_norm -1": (lambda d: d["train"].update(max_grad_norm=-1),
                         partc.PlanFileError, "max_grad_norm must be positive"),
    "schedule foo": (lambda d: d.update(schedule="foo"), partc.PlanFileError,
                     "unknown schedule 'foo'"),
    "memory too small": (lambda d: d["budget"].update(memory_bytes=2**20),
                         partc.PlanValidationError, "(?s)memory_bytes.*stage 0 needs"),
    "memory zero": (lambda d: d["budget"].update(memory_bytes=0), partc.PlanFileError,
                    "budget: every device needs a positive memory size"),
    "dtype": (lambda d: d["train"].update(dtype="bfloat16"), partc.PlanValidationError,
              "dtype bfloat16"),
    "layer renamed": (_rename_layer, partc.PlanValidationError,
                      r"stages do not cover the layers once in order: .*'blocks.0_renamed'"),
}


@pytest.fixture(scope="module")
def saved_plan(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved")
    compile_gpt(gpt_tiny(), 2, pp=2, schedule="1f1b").save(directory, code=False)
    return (directory / "plan.json").read_text()


@pytest.mark.parametrize("edit", list(EDITS))
def test_load_refuses_an_edited_plan_naming_the_field(tmp_path, saved_plan, edit):
    change, error, names = EDITS[edit]
    if change is None:
        text = _truncate(saved_plan)
    else:
        data = json.loads(saved_plan)
        change(data)
        text = json.dumps(data)
    (tmp_path / "plan.json").write_text(text)
    with pytest.raises(error, match=names) as caught:
        partc.load(tmp_path, gpt_tiny(), loss_fn=loss_fn)
    assert str(tmp_path / "plan.json") in str(caught.value)
    if edit in ("missing nested key", "mistyped", "max_grad_norm -1"):
        assert caught.value.field.startswith(("stages[0]", "train"))


def test_an_unedited_plan_loads_and_its_problem_is_the_compiled_one(tmp_path, saved_plan):
    (tmp_path / "plan.json").write_text(saved_plan)
    program = partc.load(tmp_path, gpt_tiny(), loss_fn=loss_fn)
    assert program.plan.to_json() + "\n" == saved_plan
    # Measured again as compile measured it (tp=1: no tensor-parallel variants).
    compiled = compile_gpt(gpt_tiny(), 2, pp=2).problem
    assert program.problem.model == dataclasses.replace(compiled.model, tensor_parallel=())
    assert program.problem.devices == compiled.devices
    assert program.problem.train == compiled.train


def test_one_process_trains_like_the_model(process_group):
    """pp=1 through the same runtime (microbatches, schedule, grad scaling)."""
    torch.manual_seed(0)
    model = gpt_tiny()
    reference = copy.deepcopy(model)
    module = compile_gpt(model, 1, num_microbatches=4, recompute="selective").build()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = tokens(step)
        loss = module.forward_backward(x, target=y)
        opt.step(); opt.zero_grad()
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward(); ref_opt.step(); ref_opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    ref_params = dict(reference.named_parameters())
    for fqn, param in module.named_parameters():
        torch.testing.assert_close(param, ref_params[fqn], rtol=1e-5, atol=1e-6)
    # The program owns its parameters: the user's model was not trained.
    assert not torch.equal(dict(model.named_parameters())["blocks.0.mlp.c_fc.weight"],
                           dict(module.named_parameters())["blocks.0.mlp.c_fc.weight"])
    assert set(module.state_dict()) == set(dict(model.named_parameters()))


def test_parameters_the_forward_never_reads_are_kept_and_named_in_a_warning(
        process_group, caplog, tmp_path):
    """A model whose forward leaves some parameters unread on its inputs (a vision
    tower under text-only batches: seen on a Hugging Face LLaVA-style family, and on a
    decoder whose cross-attention reads no encoder) trains without them: the program
    does not train them, and keeps them as they are, so that its state dicts and
    checkpoints lose nothing (they were left out before: a text-only run's checkpoint
    of a vision-language model had no vision tower). Building it warns once, naming
    their modules and counts."""
    torch.manual_seed(0)
    model = gpt_tiny()
    model.vision = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    program = compile_gpt(model, 1)
    # The plan counts them apart (its layers hold the rest), and its report says so.
    assert program.plan.model.unread_params == 76
    assert program.plan.model.num_params == sum(p.numel() for p in model.parameters())
    assert "(76 of them never read by the forward on these inputs: kept as they are, not " \
        "trained)" in render(program.plan, "text").splitlines()[2]
    with caplog.at_level("WARNING", logger="partc.runtime"):
        module = program.build()
    said = [r.getMessage() for r in caplog.records if "never read" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("4 parameter tensors (76 of the model's ")
    assert "vision.0, vision.1" in said[0]
    assert set(module.state_dict()) == set(dict(model.named_parameters()))
    assert not any(name.startswith("vision.") for name, _ in module.named_parameters())
    opt = module.optimizer(torch.optim.SGD, lr=0.1)
    x, y = tokens()
    module.forward_backward(x, target=y)
    opt.step()
    vision = {name: t for name, t in model.state_dict().items() if name.startswith("vision.")}
    full = module.full_state_dict()
    assert all(torch.equal(full[name], t) for name, t in vision.items())   # untrained
    module.save_checkpoint(tmp_path, optimizer=opt, step=1)
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in fresh.named_parameters():
            if name.startswith("vision."):
                param.zero_()
    resumed = compile_gpt(fresh, 1).build()
    assert resumed.load_checkpoint(tmp_path)[0] == 1
    loaded = resumed.full_state_dict()
    assert all(torch.equal(loaded[name], t) for name, t in vision.items())


def test_meta_model_loads_its_parameters_from_a_state_dict(process_group):
    torch.manual_seed(0)
    real = gpt_tiny()
    with torch.device("meta"):
        model = gpt_tiny()
    program = compile_gpt(model, 1)
    with pytest.raises(partc.PartcError, match="meta device: pass state_dict="):
        program.build()
    module = program.build(state_dict=real.state_dict())
    for fqn, param in module.named_parameters():
        assert torch.equal(param, real.state_dict()[fqn])


def test_an_exported_model_planned_on_meta_trains_from_a_state_dict(process_group):
    """An exported Hugging Face model planned on the meta device runs on the CPU: lowering
    made its device literals read the stage's input and dropped export's assertions
    (they named the meta device the model was traced on)."""
    torch.manual_seed(0)
    real = models.llama()
    with torch.device("meta"):
        model = models.llama()
    x, y = tokens()
    program = partc.compile(model, (x,), loss_fn=models.causal_lm_loss, example_target=y,
                            budget=partc.DeviceBudget(num_devices=1, device="CPU"),
                            train=partc.TrainSpec(global_batch_size=B))
    # Non-persistent buffers (rotary frequencies) are not in state_dict(): given too.
    weights = {**dict(real.named_buffers()), **real.state_dict()}
    module = program.build(state_dict=weights)
    loss = module.forward_backward(x, target=y)
    expected = models.causal_lm_loss(real(x), y)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)


def test_a_hugging_face_model_that_caches_by_default_trains_as_written(process_group):
    """A Hugging Face model as its config makes it (``use_cache=True``, whose forward
    returns a ``DynamicCache`` no tracer takes), called as people call it: traced and
    trained with its cache off, with its own loss, one process's losses; its config
    says ``use_cache=True`` again after."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = models.llama().config
    config.use_cache = True
    model = AutoModelForCausalLM.from_config(config)
    reference = copy.deepcopy(model)
    x, _ = tokens()
    program = partc.compile(model, {"input_ids": x, "labels": x},
                            budget=partc.DeviceBudget(num_devices=1, device="CPU"),
                            constraints=partc.Constraints(num_microbatches=2))
    module = program.build()
    assert model.config.use_cache is True
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        x, _ = tokens(step)
        loss = module.forward_backward(input_ids=x, labels=x)
        opt.step(); opt.zero_grad()
        expected = reference(input_ids=x, labels=x).loss
        expected.backward(); ref_opt.step(); ref_opt.zero_grad()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)


def test_a_model_loaded_in_bfloat16_trains_from_fp32_masters(process_group):
    """Seen before: a model whose weights are bfloat16 (``from_pretrained(...,
    torch_dtype=torch.bfloat16)``) failed at its first step: "attempting to assign a
    gradient with dtype 'float' to a tensor with grad_dtype 'BFloat16'". The runtime
    trains fp32 masters of them, as it does of an fp32 model (the plan's precision):
    the program's weights are fp32, and its losses are those of the same weights stored
    in fp32, to bf16's rounding."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = models.llama().config
    stored = {"bf16": AutoModelForCausalLM.from_config(config).to(torch.bfloat16)}
    stored["fp32"] = copy.deepcopy(stored["bf16"]).float()
    batches = [tokens(step)[0] for step in range(2)]
    losses = {}
    for kind, model in stored.items():
        module = partc.compile(model, {"input_ids": batches[0], "labels": batches[0]},
                               budget=partc.DeviceBudget(num_devices=1, device="CPU"),
                               train=partc.TrainSpec(global_batch_size=B,
                                                     dtype=torch.bfloat16)).build()
        assert {p.dtype for p in module.parameters()} == {torch.float32}
        opt = module.optimizer(torch.optim.AdamW, lr=1e-3)
        losses[kind] = []
        for x in batches:
            losses[kind].append(module.forward_backward(input_ids=x, labels=x).item())
            opt.step(); opt.zero_grad()
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=BF16)


def test_load_measures_again_at_the_batch_the_model_was_traced_at(tmp_path):
    # Per-sample numbers depend a little on the traced batch: tracing 4 samples for a
    # global batch of 8 gives other bytes than tracing 8, so load re-traces at 4.
    x, y = tokens()
    program = partc.compile(gpt_tiny(), (x[:4],), loss_fn=loss_fn, example_target=y[:4],
                            budget=partc.DeviceBudget(num_devices=2, device="CPU"),
                            train=partc.TrainSpec(global_batch_size=B))
    assert program.plan.model.traced_batch_size == 4
    program.save(tmp_path, code=False)
    assert partc.load(tmp_path, gpt_tiny(), loss_fn=loss_fn).plan == program.plan


def test_a_plan_compiled_from_sliced_views_loads_again(tmp_path):
    # ``ids[:, :-1]`` is a view of a longer storage; the plan file describes inputs by
    # shape and dtype only, so the loaded plan must measure what the compiled one did.
    model = gpt_tiny()
    ids = torch.randint(0, 64, (4, 17))
    program = partc.compile(model, (ids[:, :-1],), example_target=ids[:, 1:],
                            loss_fn=loss_fn, cache=None,
                            budget=partc.DeviceBudget(num_devices=2, device="cpu",
                                                      memory="10MiB"))
    program.save(tmp_path)
    assert partc.load(tmp_path, model, loss_fn=loss_fn).plan.hash == program.plan.hash
