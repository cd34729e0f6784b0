"""Optimizer offload in one process: the step on the host tier trains as the optimizer on
the device does, the host holds and moves the bytes the plan prices, and the host's Adam
is torch's AdamW.

On a CPU the host tier is the same memory as the "device", but its tensors (masters,
gradient buckets, the optimizer's state) are its own and counted by the runtime
(``partc.runtime.offload.TierCounters``), so the plan's figures are checked against what
the runtime made. Parity under pp, dp (ZeRO-1, ZeRO-3 with parameter offload) and tp:
tests/runtime/test_parity.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import partc
from partc.cost.host_offload import host_traffic
from partc.cost.pipeline_config import PipelineConfig
from partc.errors import CheckpointError, PlanMismatchError
from partc.runtime.offload import HostOptimizer, HostTier
from samples.gpt import gpt_tiny, loss_fn
from tests.tolerances import FP32

STEPS, BATCH, SEQ, VOCAB = 3, 8, 16, 128


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def _compile(model: torch.nn.Module, offload: tuple[str, ...]) -> partc.Program:
    ids, _ = _batch(0)
    return partc.compile(model, (ids,), loss_fn=loss_fn, example_target=ids,
                         budget=partc.DeviceBudget(num_devices=1, device="CPU",
                                                   host_memory="1GiB"),
                         train=partc.TrainSpec(global_batch_size=BATCH,
                                               optimizer="sgd-momentum"),
                         constraints=partc.Constraints(offload=offload, num_microbatches=2),
                         cache=None)


def test_the_offloaded_step_trains_as_one_process_and_holds_what_the_plan_says(tmp_path):
    torch.manual_seed(0)
    model = gpt_tiny(n_layer=2)
    reference = copy.deepcopy(model)
    program = _compile(model, ("optimizer",))
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
    for step in range(STEPS):
        ids, target = _batch(step)
        loss = module.forward_backward(ids, target=target)
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
    config = PipelineConfig(pp=1, dp=1, micro_batch_size=plan.micro_batch_size,
                            num_microbatches=plan.num_microbatches, schedule=plan.schedule,
                            offload_optimizer=True)
    out, back = host_traffic(program.problem, config, params)
    assert (counters.to_host, counters.to_device) == (STEPS * out, STEPS * back)
    assert counters.steps == STEPS
    # Checkpoints do not read the host's state yet: refused, not saved without it.
    with pytest.raises(CheckpointError, match="offloaded"):
        module.save_checkpoint(tmp_path, optimizer=optimizer, step=STEPS)


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
