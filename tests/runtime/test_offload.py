"""Optimizer offload in one process: the step on the host tier trains as the optimizer on
the device does, the host holds and moves the bytes the plan prices (the gradients
streamed in backward, the step pipelined in chunks), the host's Adam is torch's AdamW,
and checkpoints of it resume bit-identically and on plans without offload (and back).

On a CPU the host tier is the same memory as the "device", but its tensors (masters,
gradient buckets, the optimizer's state) are its own and counted by the runtime
(``partc.runtime.offload.TierCounters``), so the plan's figures are checked against what
the runtime made. Parity under pp, dp (ZeRO-1, ZeRO-3 with parameter offload) and tp:
tests/runtime/test_parity.py; checkpoints of those resumed across plans (-m slow):
tests/runtime/test_checkpoint.py.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import partc
from partc.cost.host_offload import host_traffic
from partc.cost.pipeline_config import PipelineConfig
from partc.errors import PlanMismatchError
from partc.runtime.offload import HostOptimizer, HostTier
from samples.gpt import gpt_tiny, loss_fn
from tests.tolerances import FP32

STEPS, BATCH, SEQ, VOCAB = 3, 8, 16, 128


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def _compile(model: torch.nn.Module, offload: tuple[str, ...], optimizer: str = "sgd-momentum",
             dtype: torch.dtype = torch.float32, cache: partc.PlanCache | None = None,
             **train) -> partc.Program:
    ids, _ = _batch(0)
    return partc.compile(model, (ids,), loss_fn=loss_fn, example_target=ids,
                         budget=partc.DeviceBudget(num_devices=1, device="CPU",
                                                   host_memory="1GiB"),
                         train=partc.TrainSpec(global_batch_size=BATCH, optimizer=optimizer,
                                               dtype=dtype, **train),
                         constraints=partc.Constraints(offload=offload, num_microbatches=2),
                         cache=cache)


ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-6)


def _train(module, optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids, target = _batch(step)
        losses.append(module.forward_backward(ids, target=target).item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _weights(module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in
            module.state.full_state_dict().items()}


def test_an_offloaded_bf16_run_resumes_bit_identically_from_the_hosts_masters(tmp_path):
    """The host's fp32 masters and AdamW moments are the checkpoint's weights and
    optimizer state (the device holds bf16 weights only): a module loading it holds, bit
    for bit, the masters, moments and device weights the saving one held, so it trains
    on as that one would (the distributed runs: tests/runtime/test_checkpoint.py)."""
    torch.manual_seed(0)
    model = gpt_tiny(n_layer=1)
    program = _compile(model, ("optimizer",), "adamw", torch.bfloat16)
    module = program.build()
    optimizer = module.optimizer(torch.optim.AdamW, **ADAMW)
    _train(module, optimizer, range(1))
    path = module.save_checkpoint(tmp_path, optimizer=optimizer, step=1)
    # The weights saved are the fp32 masters, not the bf16 copies the device holds.
    assert next(module.parameters()).dtype == torch.bfloat16
    assert json.loads((path / "manifest.json").read_text())["optimizer"]["class"] == "AdamW"
    resumed = program.build()
    resumed_optimizer = resumed.optimizer(torch.optim.AdamW, **ADAMW)
    assert resumed.load_checkpoint(tmp_path, optimizer=resumed_optimizer)[0] == 1
    ours, theirs = _weights(module), _weights(resumed)
    assert all(value.dtype == torch.float32 for value in ours.values())
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    for (name, saved), loaded in zip(module.named_parameters(), resumed.parameters()):
        assert torch.equal(saved, loaded), name   # the device's bf16 weights
        moments, read = optimizer.state[saved], resumed_optimizer.state[loaded]
        assert moments.keys() == read.keys() and moments, name
        assert all(torch.equal(moments[key], read[key]) for key in moments), name


def test_checkpoints_move_between_plans_with_and_without_offload(tmp_path):
    """Saved under optimizer offload and resumed without it, and the reverse: both train
    as the uninterrupted one-process run does (fp32)."""
    torch.manual_seed(0)
    model = gpt_tiny(n_layer=1)
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    expected = []
    for step in range(2):
        ids, target = _batch(step)
        loss = loss_fn(reference(ids), target)
        loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        expected.append(loss.item())
    measured = partc.PlanCache()   # the model measured once, planned twice
    plans = {kind: _compile(copy.deepcopy(model), kind, "adamw", cache=measured)
             for kind in (("optimizer",), ())}
    # Both write the fp32 weights and AdamW's two moments, 12 bytes a parameter (under
    # offload the host's masters and moments), as the report's checkpoint line says.
    sizes = {kind: plans[kind].plan.checkpoint_bytes_per_rank for kind in plans}
    params = sum(p.numel() for p in model.parameters())
    assert sizes[("optimizer",)] == sizes[()] == 12 * params
    for before, after in ((("optimizer",), ()), ((), ("optimizer",))):
        module = plans[before].build()
        optimizer = module.optimizer(torch.optim.AdamW, **ADAMW)
        losses = _train(module, optimizer, range(1))
        module.save_checkpoint(tmp_path / str(before), optimizer=optimizer, step=1)
        resumed = plans[after].build()
        resumed_optimizer = resumed.optimizer(torch.optim.AdamW, **ADAMW)
        resumed.load_checkpoint(tmp_path / str(before), optimizer=resumed_optimizer)
        losses += _train(resumed, resumed_optimizer, range(1, 2))
        assert losses == pytest.approx(expected, rel=FP32), (before, after)
        ours = dict(resumed.named_parameters())
        for name, param in reference.named_parameters():
            error = (ours[name] - param).norm() / max(param.norm().item(), 1e-3)
            assert error < FP32, (before, after, name)


def test_the_offloaded_step_trains_as_one_process_and_holds_what_the_plan_says():
    torch.manual_seed(0)
    model = gpt_tiny(n_layer=2)
    reference = copy.deepcopy(model)
    # Buckets (and the host step's chunks) of 20k elements: the step runs in several.
    program = _compile(model, ("optimizer",), bucket_elements=20_000)
    plan = program.plan
    memory = plan.stages[0].memory_bytes
    # The device holds the weights only: no optimizer state, no gradient (streamed out
    # to the host buckets), no step temporaries.
    assert plan.offload == ("optimizer",)
    assert (memory.optimizer, memory.grads, memory.step) == (0, 0, 0)
    params = plan.stages[0].param_count
    assert memory.params == 4 * params
    assert plan.host_bytes_per_node == params * (4 + 4 + 4)   # master, gradient, momentum
    module = program.build()
    with pytest.raises(PlanMismatchError, match="offloads the optimizer"):
        plain = torch.optim.SGD(module.parameters(), lr=0.1)
        module.forward_backward(*_batch(0)[:1], target=_batch(0)[1])
        plain.step()
    module.zero_grad()
    optimizer = module.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    counters = module.parts.host.counters
    counters.reset()
    config = PipelineConfig(pp=1, dp=1, micro_batch_size=plan.micro_batch_size,
                            num_microbatches=plan.num_microbatches, schedule=plan.schedule,
                            offload_optimizer=True)
    out, back = host_traffic(program.problem, config, params)
    for step in range(STEPS):
        ids, target = _batch(step)
        before = (counters.to_host, counters.to_device)
        loss = module.forward_backward(ids, target=target)
        # Every gradient went out as backward made it, before the step.
        assert (counters.to_host - before[0], counters.to_device) == (out, before[1])
        optimizer.step()
        optimizer.zero_grad()
        expected = loss_fn(reference(ids), target)
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        assert loss.item() == pytest.approx(expected.item(), rel=FP32)
    ours = dict(module.named_parameters())
    for name, param in reference.named_parameters():
        error = (ours[name] - param).norm() / max(param.norm().item(), 1e-3)
        assert error < FP32, name
    # What the host holds and what crossed the link each step: the plan's figures.
    assert counters.host_resident == plan.host_bytes_per_node
    assert (counters.to_host, counters.to_device) == (STEPS * out, STEPS * back)
    assert counters.steps == STEPS
    # All of it streamed in backward; the weights back of every chunk but the last were
    # copied while the host still stepped (what a GPU overlaps: partc.cost.host_offload).
    chunks = optimizer.chunks
    last = sum(p.numel() * p.element_size() for p in chunks[-1])
    assert len(chunks) > 2 and counters.streamed == counters.to_host
    assert counters.overlapped == STEPS * (back - last)


def test_the_host_adam_is_torch_adamw():
    """The host step (torch's fused CPU AdamW, which the host optimizer picks) against
    torch's default AdamW over the same tensors, five steps."""
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (7, 3, 5)]
    device = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in device]
    settings = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    host = HostOptimizer(device, torch.optim.AdamW, HostTier("cpu"), **settings)
    assert host.host.defaults["fused"] is True
    reference = torch.optim.AdamW(plain, **settings)
    for _ in range(5):
        for ours, theirs in zip(device, plain):
            grad = torch.randn(ours.shape)
            ours.grad, theirs.grad = grad.clone(), grad.clone()
        host.step()
        reference.step()
    for ours, theirs in zip(device, plain):
        assert torch.allclose(ours, theirs, rtol=FP32, atol=1e-7)
        assert torch.equal(host.master_of(ours), ours)   # fp32 both: copied back whole


def test_offload_pinned_without_the_host_figures_says_which_to_give():
    ids, _ = _batch(0)
    with pytest.raises(partc.PlanInfeasibleError, match="--host-memory") as refused:
        partc.compile(gpt_tiny(n_layer=1), (ids,), loss_fn=loss_fn, example_target=ids,
                      budget=partc.DeviceBudget(num_devices=1, device="CPU"),
                      constraints=partc.Constraints(offload=["optimizer"]), cache=None)
    assert "offload=['optimizer']" in str(refused.value)
