"""Weights for models planned on the meta device (partc/weights.py), on one process:
Hugging Face Llama and Qwen2 built under ``partc.on_meta()`` train from a state dict,
a safetensors checkpoint or a DCP directory without their non-persistent buffers, and
a stage reads only its own tensors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

import partc
from partc.runtime.parameters import TensorParallelCut, own_parameters
from partc.weights import open_weights
from tests import hf_families, models

from .test_program import B, process_group, tokens  # noqa: F401

FAMILIES = ["llama", "qwen2"]


def _compile(model: torch.nn.Module, devices: int = 1, **constraints) -> partc.Program:
    x, y = tokens()
    return partc.compile(model, (x,), loss_fn=hf_families.causal_lm_loss, example_target=y,
                         budget=partc.DeviceBudget(num_devices=devices, device="CPU"),
                         train=partc.TrainSpec(global_batch_size=B),
                         constraints=partc.Constraints(**constraints))


def _pair(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    real = hf_families.FAMILIES[family].build()
    with partc.on_meta():
        planned = hf_families.FAMILIES[family].build()
    return real, planned


def _save_safetensors(state: dict[str, torch.Tensor], directory) -> None:
    """A Hugging Face style checkpoint in two shards with its index."""
    from safetensors.torch import save_file

    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(directory / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_on_meta_trains_from_its_weights_alone(family, tmp_path, process_group):
    real, planned = _pair(family)
    assert all(p.is_meta for p in planned.parameters())
    assert not any(b.is_meta for b in planned.buffers())  # computed by the model's code
    state = real.state_dict()
    assert not any(name.endswith("inv_freq") for name in state)  # non-persistent
    (tmp_path / "hf").mkdir()
    _save_safetensors(state, tmp_path / "hf")
    # A DCP checkpoint under a root whose `latest` names it, as save_checkpoint writes.
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp" / "step-1"), no_dist=True)
    (tmp_path / "dcp" / "latest").write_text("step-1\n")
    x, y = tokens()
    expected = hf_families.causal_lm_loss(real(x), y).detach()
    program = _compile(planned)
    # Every source for one family; the plain state dict for the other (each build lowers
    # the model again, the test's main cost).
    sources = (state, tmp_path / "hf", str(tmp_path / "dcp")) if family == "llama" \
        else (state,)
    for source in sources:
        module = program.build(state_dict=source)
        torch.testing.assert_close(module.forward_backward(x, target=y), expected,
                                   rtol=1e-5, atol=1e-6)
        module.close()


def test_buffers_never_computed_and_weights_of_other_shapes_are_refused(process_group):
    torch.manual_seed(0)
    real = models.llama()
    with torch.device("meta"):
        planned = models.llama()
    program = _compile(planned)
    with pytest.raises(partc.PartcError, match=r"model.rotary_emb.inv_freq is a "
                       r"non-persistent buffer .* partc.on_meta\(\)"):
        program.build(state_dict=real.state_dict())
    wrong = dict(real.state_dict(), **{"model.norm.weight": torch.ones(65)})
    with partc.on_meta():
        planned = models.llama()
    with pytest.raises(partc.PartcError, match=r"model.norm.weight: the weights given have "
                       r"shape \[65\], the model's is \[64\]"):
        _compile(planned).build(state_dict=wrong)
    with pytest.raises(partc.PartcError, match="holds no weights partc reads"):
        _compile(planned).build(state_dict=str(__import__("pathlib").Path(__file__).parent))


class _Counting(dict):
    """A state dict that records which entries were read."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.seen.add(name)
        return super().__getitem__(name)


def test_a_stage_reads_its_own_tensors_only(tmp_path):
    real, planned = _pair("llama")
    lowered = _compile(planned, 2, pp=2).lower(only=(1,))
    stage = lowered.stages[1].module
    state = _Counting(real.state_dict())
    own_parameters(stage, planned, state, torch.device("cpu"))
    held = {name for name, _ in stage.named_parameters()}
    assert state.seen == held and 0 < len(held) < len(state)
    # From files: one read of the stage's tensors.
    _save_safetensors(real.state_dict(), tmp_path)
    weights, asked = open_weights(tmp_path), []
    read = weights.read_tensors
    weights.read_tensors = lambda names: asked.append(set(names)) or read(names)
    own_parameters(stage, planned, weights, torch.device("cpu"))
    assert asked == [held]
    real_params = dict(real.named_parameters())
    for name, param in stage.named_parameters():
        assert torch.equal(param, real_params[name])


def test_a_tensor_parallel_rank_reads_its_shard_of_each_tensor_from_files(tmp_path):
    """Under tp=2 each rank's shards, read alone from safetensors (get_slice) or cut
    from a DCP load, are the runtime's own cut of the whole tensors (tp.shard_of; for
    fused layouts, chunks > 1, see the next test)."""
    real, planned = _pair("llama")
    program = _compile(planned, 2, pp=1, tp=2, tp_objective="memory")
    stage = program.lower(only=(0,)).stages[0].module
    state = real.state_dict()
    (tmp_path / "hf").mkdir()
    _save_safetensors(state, tmp_path / "hf")
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for rank in range(2):
        cut = TensorParallelCut(program.plan, rank, 2)
        held = []
        for source in (state, open_weights(tmp_path / "hf"), open_weights(tmp_path / "dcp")):
            own_parameters(stage, planned, source, torch.device("cpu"), cut)
            held.append({name: p.detach().clone() for name, p in stage.named_parameters()})
        sharded = [name for name, p in held[0].items() if p.shape != state[name].shape]
        assert sharded  # some tensors are cut, and every source cuts them alike
        for other in held[1:]:
            assert all(torch.equal(other[name], held[0][name]) for name in held[0])


def test_shard_ranges_are_the_runtimes_cut():
    from partc.runtime import tp as tp_ops
    from partc.weights import shard_ranges

    whole = torch.arange(24).reshape(12, 2)
    for chunks in (1, 2, 3):
        for rank in range(2):
            rows = torch.cat([whole[a:b] for a, b in shard_ranges(12, chunks, rank, 2)])
            assert torch.equal(rows, tp_ops.shard_of(whole, 0, chunks, rank, 2))
